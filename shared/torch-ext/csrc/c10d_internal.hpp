// Shared between c10d_shim.cpp (store, Gloo, collectives) and c10d_nccl.cpp (only compiled when NCCL is).
#pragma once

#include <chrono>
#include <cstdint>

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace jetrl {

// Builds c10d::ProcessGroupNCCL bound to one CUDA device (cuda_device < 0: rank % device count) and returns the
// device index it used through *device_out. Throws on failure.
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                     int world_size, std::chrono::milliseconds timeout,
                                                     int64_t cuda_device, int64_t* device_out);

// Peak bytes the CUDA caching allocator has handed out on `device` since the start or the last reset (then
// resets the peak when `reset`); -1 when the device does not exist. (cuda_memory.cpp, built with NCCL.)
int64_t cuda_peak_allocated(int64_t device, bool reset);

}  // namespace jetrl
