// comm_fill_u32: dst[i] = value for i < count. Tests use it to set device buffers to a pattern
// without a host copy; any grid covers any count.

extern "C" __global__ void comm_fill_u32(unsigned int *dst, unsigned int value,
                                         unsigned long long count) {
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    dst[i] = value;
  }
}
