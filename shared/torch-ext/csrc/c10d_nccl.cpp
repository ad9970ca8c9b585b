// ProcessGroupNCCL for the shim. Compiled only when build.rs finds libtorch_cuda, nccl.h and the CUDA headers
// (the wheel's nvidia-* packages ship them), with -DUSE_C10D_NCCL -DJETRL_WITH_NCCL. The symbols live in
// libtorch_cuda.so, which build.rs then links.

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>

#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "c10d_internal.hpp"

namespace jetrl {

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                     int world_size, std::chrono::milliseconds timeout,
                                                     int64_t cuda_device, int64_t* device_out) {
  const int64_t count = c10::cuda::device_count();
  if (count <= 0) {
    throw std::runtime_error("the NCCL backend needs a CUDA device, and none is visible to this process");
  }
  const int64_t device = cuda_device >= 0 ? cuda_device : rank % count;
  if (device >= count) {
    throw std::runtime_error("CUDA device " + std::to_string(device) + " requested, but only " +
                             std::to_string(count) + " visible");
  }
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(device));

  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  auto backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, world_size, options);
  // Binding the device makes the communicator eager (created here, inside the rendezvous deadline) instead of
  // on the first collective.
  const at::Device bound(at::kCUDA, static_cast<c10::DeviceIndex>(device));
  backend->setBoundDeviceId(bound);
  backend->eagerConnectSingleDevice(bound);
  *device_out = device;
  return backend;
}

}  // namespace jetrl
