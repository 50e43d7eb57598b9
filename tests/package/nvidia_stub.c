/* Stands in for NVIDIA's libnccl.so.2 at link time (SONAME libnccl.so.2, the functions
 * consumer.c calls, every one failing): the program linked against it records NEEDED libnccl.so.2
 * as one linked against NVIDIA's library does, and is then run without it, on comm. */
typedef int ncclResult_t;
#define STUB(name) ncclResult_t name(void) { return 1; }
STUB(ncclGetVersion)
STUB(ncclGetUniqueId)
STUB(ncclCommInitRank)
STUB(ncclAllReduce)
STUB(ncclCommDestroy)
const char* ncclGetErrorString(ncclResult_t r) { (void)r; return "the stand-in library was loaded"; }
