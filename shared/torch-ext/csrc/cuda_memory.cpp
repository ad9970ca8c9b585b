// The CUDA caching allocator's peak statistics (what Python's torch.cuda.max_memory_allocated reads). Compiled
// with the NCCL part (build.rs: libtorch_cuda and the CUDA headers found), which links libc10_cuda.

#include <cstdint>

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>

#include "c10d_internal.hpp"

namespace jetrl {

int64_t cuda_peak_allocated(int64_t device, bool reset) {
  if (device < 0 || device >= c10::cuda::device_count()) return -1;
  const auto index = static_cast<c10::DeviceIndex>(device);
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(index);
  const int64_t peak =
      stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak;
  if (reset) c10::cuda::CUDACachingAllocator::resetPeakStats(index);
  return peak;
}

}  // namespace jetrl
