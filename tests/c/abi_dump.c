/* Prints every enum value, struct size and field offset of the nccl.h it is compiled against, so
 * that the output for comm's header and for NVIDIA's can be compared line by line. */
#include <nccl.h>
#include <stddef.h>
#include <stdio.h>

#define V(x) printf("value %s %lld\n", #x, (long long)(x))
#define SZ(t) printf("sizeof %s %zu\n", #t, sizeof(t))
#define OFF(t, f) printf("offsetof %s.%s %zu\n", #t, #f, offsetof(t, f))

int main(void) {
  V(NCCL_MAJOR); V(NCCL_MINOR); V(NCCL_PATCH); V(NCCL_VERSION_CODE); V(NCCL_VERSION(2, 30, 7));
  V(NCCL_UNIQUE_ID_BYTES); V(NCCL_SPLIT_NOCOLOR); V(NCCL_API_MAGIC); V(NCCL_CONFIG_UNDEF_INT);
  V(NCCL_WIN_DEFAULT); V(NCCL_WIN_COLL_SYMMETRIC); V(NCCL_WIN_STRICT_ORDERING); V(NCCL_WIN_REQUIRED_ALIGNMENT);
  V(NCCL_CTA_POLICY_DEFAULT); V(NCCL_CTA_POLICY_EFFICIENCY); V(NCCL_CTA_POLICY_ZERO);
  V(NCCL_SHRINK_DEFAULT); V(NCCL_SHRINK_ABORT); V(NCCL_REVOKE_DEFAULT);
  V(ncclSuccess); V(ncclUnhandledCudaError); V(ncclSystemError); V(ncclInternalError); V(ncclInvalidArgument);
  V(ncclInvalidUsage); V(ncclRemoteError); V(ncclInProgress); V(ncclTimeout); V(ncclNumResults);
  V(ncclSum); V(ncclProd); V(ncclMax); V(ncclMin); V(ncclAvg); V(ncclNumOps); V(ncclMaxRedOp);
  V(ncclInt8); V(ncclChar); V(ncclUint8); V(ncclInt32); V(ncclInt); V(ncclUint32); V(ncclInt64); V(ncclUint64);
  V(ncclFloat16); V(ncclHalf); V(ncclFloat32); V(ncclFloat); V(ncclFloat64); V(ncclDouble); V(ncclBfloat16);
  V(ncclFloat8e4m3); V(ncclFloat8e5m2); V(ncclNumTypes);
  V(ncclScalarDevice); V(ncclScalarHostImmediate);
  V(ncclStatGpuMemSuspend); V(ncclStatGpuMemSuspended); V(ncclStatGpuMemPersist); V(ncclStatGpuMemTotal);
  SZ(ncclUniqueId); SZ(ncclResult_t); SZ(ncclDataType_t); SZ(ncclRedOp_t); SZ(ncclComm_t); SZ(ncclWindow_t);
  SZ(ncclConfig_t); SZ(ncclSimInfo_t); SZ(ncclWaitSignalDesc_t);
  OFF(ncclConfig_t, size); OFF(ncclConfig_t, magic); OFF(ncclConfig_t, version); OFF(ncclConfig_t, blocking);
  OFF(ncclConfig_t, cgaClusterSize); OFF(ncclConfig_t, minCTAs); OFF(ncclConfig_t, maxCTAs);
  OFF(ncclConfig_t, netName); OFF(ncclConfig_t, splitShare); OFF(ncclConfig_t, trafficClass);
  OFF(ncclConfig_t, commName); OFF(ncclConfig_t, collnetEnable); OFF(ncclConfig_t, CTAPolicy);
  OFF(ncclConfig_t, shrinkShare); OFF(ncclConfig_t, nvlsCTAs); OFF(ncclConfig_t, nChannelsPerNetPeer);
  OFF(ncclConfig_t, nvlinkCentricSched); OFF(ncclConfig_t, graphUsageMode); OFF(ncclConfig_t, numRmaCtx);
  OFF(ncclConfig_t, maxP2pPeers); OFF(ncclConfig_t, graphStreamOrdering);
  OFF(ncclSimInfo_t, size); OFF(ncclSimInfo_t, magic); OFF(ncclSimInfo_t, version); OFF(ncclSimInfo_t, estimatedTime);
  OFF(ncclWaitSignalDesc_t, opCnt); OFF(ncclWaitSignalDesc_t, peer); OFF(ncclWaitSignalDesc_t, sigIdx);
  OFF(ncclWaitSignalDesc_t, ctx);
  {
    ncclConfig_t c = NCCL_CONFIG_INITIALIZER;
    ncclSimInfo_t s = NCCL_SIM_INFO_INITIALIZER;
    printf("init config %zu %u %u %d %d %p %p\n", c.size, c.magic, c.version, c.blocking, c.graphStreamOrdering,
           (void*)c.netName, (void*)c.commName);
    printf("init siminfo %zu %u %u %f\n", s.size, s.magic, s.version, s.estimatedTime);
  }
  return 0;
}
