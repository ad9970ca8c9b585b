// torch.distributed (c10d) collectives for Rust: TCPStore rendezvous, ProcessGroupGloo (and ProcessGroupNCCL
// when compiled, see c10d_nccl.cpp), synchronous collectives on tch tensors. See torch_ext.h for the C ABI.
//
// Compiled with -DUSE_C10D_GLOO (the wheel's libtorch_cpu is built with it) against the gloo headers vendored in
// third_party/gloo (the commit PyTorch v2.11.0 pins; see README.md).

#include "shim_util.hpp"
#include "torch_ext.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/distributed/c10d/exception.h>

#include "c10d_internal.hpp"

using Millis = std::chrono::milliseconds;

struct jetrl_pg {
  // Declared first so it is destroyed last: the backend may still talk to the store while it shuts down.
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> backend;
  int kind = JETRL_BACKEND_GLOO;
  int rank = 0;
  int world_size = 1;
  Millis timeout{0};
  int64_t cuda_device = -1;
};

namespace {

// An error the shim raises itself, with the status code it maps to.
struct ShimError : std::runtime_error {
  int code;
  ShimError(int code, const std::string& message) : std::runtime_error(message), code(code) {}
};

char* dup_string(const std::string& s) { return jetrl_shim::copy_message(s); }

bool mentions_timeout(std::string message) {
  std::transform(message.begin(), message.end(), message.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return message.find("timed out") != std::string::npos || message.find("timeout") != std::string::npos;
}

// Runs `body`, turning every exception into a status code and a message. `deadline_code` is the code used when
// the failure looks like a timeout (by exception type, message, or elapsed time past `timeout`).
template <class F>
int guarded(char** err, Millis timeout, int deadline_code, F&& body) {
  const auto start = std::chrono::steady_clock::now();
  auto past_deadline = [&] {
    return timeout.count() > 0 && std::chrono::steady_clock::now() - start >= timeout;
  };
  auto fail = [&](int code, const std::string& message) {
    if (err != nullptr) *err = dup_string(message);
    return code;
  };
  try {
    body();
    return JETRL_OK;
  } catch (const ShimError& e) {
    return fail(e.code, e.what());
  } catch (const c10d::TimeoutError& e) {
    return fail(deadline_code, e.what_without_backtrace());
  } catch (const c10::Error& e) {
    std::string message = e.what_without_backtrace();
    bool timed_out = mentions_timeout(message) || past_deadline();
    return fail(timed_out ? deadline_code : JETRL_ERR, message);
  } catch (const std::exception& e) {
    std::string message = e.what();
    bool timed_out = mentions_timeout(message) || past_deadline();
    return fail(timed_out ? deadline_code : JETRL_ERR, message);
  } catch (...) {
    return fail(past_deadline() ? deadline_code : JETRL_ERR, "unknown C++ exception");
  }
}

void wait_work(const c10::intrusive_ptr<c10d::Work>& work, Millis timeout) {
  if (!work) throw ShimError(JETRL_ERR, "the backend returned no work handle");
  if (!work->wait(timeout)) throw ShimError(JETRL_ERR, "the collective was aborted");
}

void check_tensor(const at::Tensor& t, const char* what) {
  if (!t.defined()) throw ShimError(JETRL_ERR_INVALID_ARGUMENT, std::string(what) + " is an undefined tensor");
  if (t.layout() != at::kStrided) throw ShimError(JETRL_ERR_INVALID_ARGUMENT, std::string(what) + " must be dense");
  if (!t.is_contiguous()) throw ShimError(JETRL_ERR_INVALID_ARGUMENT, std::string(what) + " must be contiguous");
}

void check_same_kind(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type()) {
    throw ShimError(JETRL_ERR_INVALID_ARGUMENT, std::string("dtype mismatch: output is ") +
                                                    c10::toString(a.scalar_type()) + ", input is " +
                                                    c10::toString(b.scalar_type()));
  }
  if (a.device() != b.device()) {
    throw ShimError(JETRL_ERR_INVALID_ARGUMENT,
                    "device mismatch: output is on " + a.device().str() + ", input on " + b.device().str());
  }
}

// The c10d op for `op` on this backend, and whether the shim divides by the world size afterwards (Gloo has no
// AVG: SUM then divide).
c10d::ReduceOp reduce_op(const jetrl_pg& pg, int op, const at::Tensor& t, bool* divide_after) {
  *divide_after = false;
  switch (op) {
    case JETRL_REDUCE_SUM:
      return c10d::ReduceOp::SUM;
    case JETRL_REDUCE_MAX:
      return c10d::ReduceOp::MAX;
    case JETRL_REDUCE_AVG:
      if (!at::isFloatingType(t.scalar_type())) {
        throw ShimError(JETRL_ERR_INVALID_ARGUMENT, std::string("Avg needs a floating-point tensor, got ") +
                                                        c10::toString(t.scalar_type()));
      }
      if (pg.kind == JETRL_BACKEND_NCCL) return c10d::ReduceOp::AVG;
      *divide_after = true;
      return c10d::ReduceOp::SUM;
    default:
      throw ShimError(JETRL_ERR_INVALID_ARGUMENT, "unknown reduce op " + std::to_string(op));
  }
}

c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                     int world_size, Millis timeout, const char* hostname) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  if (hostname != nullptr && hostname[0] != '\0') {
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(hostname));
  } else {
    options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  }
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world_size, options);
}

}  // namespace

#ifndef JETRL_WITH_NCCL
namespace jetrl {
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>&, int, int, Millis,
                                                     int64_t, int64_t*) {
  throw ShimError(JETRL_ERR_NOT_BUILT,
                  "this build of jetrl-torch-ext has no NCCL process group (libtorch_cuda, nccl.h or the CUDA "
                  "headers were not found when it was compiled)");
}
}  // namespace jetrl
#endif

extern "C" {

void jetrl_free_string(char* s) { std::free(s); }

int jetrl_nccl_built(void) {
#ifdef JETRL_WITH_NCCL
  return 1;
#else
  return 0;
#endif
}

int64_t jetrl_cuda_peak_allocated(int64_t device, int reset) {
#ifdef JETRL_WITH_NCCL
  try {
    return jetrl::cuda_peak_allocated(device, reset != 0);
  } catch (...) {
    return -1;
  }
#else
  (void)device;
  (void)reset;
  return -1;
#endif
}

int jetrl_pg_new(int backend, int rank, int world_size, const char* host, uint16_t port, int64_t timeout_ms,
                 const char* prefix, const char* gloo_hostname, int64_t cuda_device, jetrl_pg** out, char** err) {
  if (out == nullptr || host == nullptr) {
    if (err != nullptr) *err = dup_string("jetrl_pg_new: null argument");
    return JETRL_ERR_INVALID_ARGUMENT;
  }
  *out = nullptr;
  const Millis timeout(timeout_ms);
  if (world_size < 1 || rank < 0 || rank >= world_size || timeout_ms <= 0) {
    if (err != nullptr) {
      *err = dup_string("rank " + std::to_string(rank) + " / world size " + std::to_string(world_size) +
                        " / timeout " + std::to_string(timeout_ms) + " ms: need 0 <= rank < world size, timeout > 0");
    }
    return JETRL_ERR_INVALID_ARGUMENT;
  }
  if (backend == JETRL_BACKEND_NCCL && !jetrl_nccl_built()) {
    if (err != nullptr) *err = dup_string("NCCL backend not built into this jetrl-torch-ext");
    return JETRL_ERR_NOT_BUILT;
  }
  if (backend != JETRL_BACKEND_GLOO && backend != JETRL_BACKEND_NCCL) {
    if (err != nullptr) *err = dup_string("unknown backend " + std::to_string(backend));
    return JETRL_ERR_INVALID_ARGUMENT;
  }

  auto pg = std::make_unique<jetrl_pg>();
  pg->kind = backend;
  pg->rank = rank;
  pg->world_size = world_size;
  pg->timeout = timeout;
  pg->cuda_device = cuda_device;

  // 1. The store: rank 0 hosts the server, every rank is a client of it. A client that cannot connect within the
  //    timeout is "store unreachable"; the server failing to bind is a plain error.
  const bool is_master = rank == 0;
  int status = guarded(err, timeout, is_master ? JETRL_ERR_TIMEOUT : JETRL_ERR_STORE_UNREACHABLE, [&] {
    c10d::TCPStoreOptions opts;
    opts.port = port;
    opts.isServer = is_master;
    opts.numWorkers = static_cast<std::size_t>(world_size);
    opts.waitWorkers = false;
    opts.timeout = timeout;
    c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::TCPStore>(std::string(host), opts);
    if (prefix != nullptr && prefix[0] != '\0') {
      store = c10::make_intrusive<c10d::PrefixStore>(std::string(prefix), store);
    }
    store->setTimeout(timeout);
    pg->store = store;
  });
  if (status != JETRL_OK) {
    if (status == JETRL_ERR) status = is_master ? JETRL_ERR : JETRL_ERR_STORE_UNREACHABLE;
    return status;
  }

  // 2. Claim the rank: the first process to add to the key gets 1; a second process with the same rank gets 2.
  status = guarded(err, timeout, JETRL_ERR_TIMEOUT, [&] {
    const std::string key = "jetrl/rank/" + std::to_string(rank);
    const int64_t claims = pg->store->add(key, 1);
    if (claims > 1) {
      throw ShimError(JETRL_ERR_DUPLICATE_RANK, "store key '" + key + "' was already claimed " +
                                                    std::to_string(claims - 1) + " time(s) by another process");
    }
  });
  if (status != JETRL_OK) return status;

  // 2b. Every rank must have been started for the same group: rank 0 says its world size, the others compare
  //     (a rank started with another trainer.n_gpus_per_node or nnodes would otherwise wait out the rendezvous).
  status = guarded(err, timeout, JETRL_ERR_TIMEOUT, [&] {
    const std::string key = "jetrl/world_size";
    const std::string mine = std::to_string(world_size);
    if (rank == 0) {
      pg->store->set(key, std::vector<uint8_t>(mine.begin(), mine.end()));
    } else {
      const std::vector<uint8_t> value = pg->store->get(key);
      const std::string theirs(value.begin(), value.end());
      if (theirs != mine) {
        throw ShimError(JETRL_ERR_INVALID_ARGUMENT, "rank " + std::to_string(rank) + " was started for a group of " +
                                                        mine + " ranks, but rank 0 leads a group of " + theirs);
      }
    }
  });
  if (status != JETRL_OK) return status;

  // 3. The backend's own rendezvous (full mesh of connections through the store), bounded by the timeout.
  status = guarded(err, timeout, JETRL_ERR_TIMEOUT, [&] {
    if (backend == JETRL_BACKEND_GLOO) {
      pg->backend = make_gloo_backend(pg->store, rank, world_size, timeout, gloo_hostname);
    } else {
      int64_t used = -1;
      pg->backend = jetrl::make_nccl_backend(pg->store, rank, world_size, timeout, cuda_device, &used);
      pg->cuda_device = used;
    }
  });
  if (status != JETRL_OK) return status;

  *out = pg.release();
  return JETRL_OK;
}

void jetrl_pg_free(jetrl_pg* pg) {
  if (pg == nullptr) return;
  try {
    pg->backend.reset();
    pg->store.reset();
  } catch (...) {
    // A destructor that throws (a dead peer while shutting down) must not take the process with it.
  }
  delete pg;
}

int jetrl_pg_all_reduce(jetrl_pg* pg, jetrl_tensor* tensor, int op, char** err) {
  if (pg == nullptr || tensor == nullptr) return JETRL_ERR_INVALID_ARGUMENT;
  return guarded(err, pg->timeout, JETRL_ERR_TIMEOUT, [&] {
    at::Tensor& t = *tensor;
    check_tensor(t, "tensor");
    bool divide_after = false;
    c10d::AllreduceOptions opts;
    opts.reduceOp = reduce_op(*pg, op, t, &divide_after);
    opts.timeout = pg->timeout;
    std::vector<at::Tensor> tensors{t};
    wait_work(pg->backend->allreduce(tensors, opts), pg->timeout);
    if (divide_after) t.div_(pg->world_size);
  });
}

int jetrl_pg_reduce_scatter(jetrl_pg* pg, jetrl_tensor* out, const jetrl_tensor* input, int op, char** err) {
  if (pg == nullptr || out == nullptr || input == nullptr) return JETRL_ERR_INVALID_ARGUMENT;
  return guarded(err, pg->timeout, JETRL_ERR_TIMEOUT, [&] {
    at::Tensor& o = *out;
    const at::Tensor& in = *input;
    check_tensor(o, "output");
    check_tensor(in, "input");
    check_same_kind(o, in);
    if (in.numel() != o.numel() * pg->world_size) {
      throw ShimError(JETRL_ERR_INVALID_ARGUMENT,
                      "input has " + std::to_string(in.numel()) + " elements, expected world size " +
                          std::to_string(pg->world_size) + " x output " + std::to_string(o.numel()));
    }
    bool divide_after = false;
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = reduce_op(*pg, op, o, &divide_after);
    opts.timeout = pg->timeout;
    at::Tensor out_flat = o.view({-1});
    at::Tensor in_flat = in.view({-1});
    wait_work(pg->backend->_reduce_scatter_base(out_flat, in_flat, opts), pg->timeout);
    if (divide_after) o.div_(pg->world_size);
  });
}

int jetrl_pg_all_gather_into(jetrl_pg* pg, jetrl_tensor* out, const jetrl_tensor* input, char** err) {
  if (pg == nullptr || out == nullptr || input == nullptr) return JETRL_ERR_INVALID_ARGUMENT;
  return guarded(err, pg->timeout, JETRL_ERR_TIMEOUT, [&] {
    at::Tensor& o = *out;
    const at::Tensor& in = *input;
    check_tensor(o, "output");
    check_tensor(in, "input");
    check_same_kind(o, in);
    if (o.numel() != in.numel() * pg->world_size) {
      throw ShimError(JETRL_ERR_INVALID_ARGUMENT,
                      "output has " + std::to_string(o.numel()) + " elements, expected world size " +
                          std::to_string(pg->world_size) + " x input " + std::to_string(in.numel()));
    }
    c10d::AllgatherOptions opts;
    opts.timeout = pg->timeout;
    at::Tensor out_flat = o.view({-1});
    at::Tensor in_flat = in.view({-1});
    wait_work(pg->backend->_allgather_base(out_flat, in_flat, opts), pg->timeout);
  });
}

int jetrl_pg_broadcast(jetrl_pg* pg, jetrl_tensor* tensor, int root, char** err) {
  if (pg == nullptr || tensor == nullptr) return JETRL_ERR_INVALID_ARGUMENT;
  return guarded(err, pg->timeout, JETRL_ERR_TIMEOUT, [&] {
    at::Tensor& t = *tensor;
    check_tensor(t, "tensor");
    if (root < 0 || root >= pg->world_size) {
      throw ShimError(JETRL_ERR_INVALID_ARGUMENT, "root " + std::to_string(root) + " is not a rank of a group of " +
                                                      std::to_string(pg->world_size));
    }
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    opts.timeout = pg->timeout;
    std::vector<at::Tensor> tensors{t};
    wait_work(pg->backend->broadcast(tensors, opts), pg->timeout);
  });
}

int jetrl_pg_barrier(jetrl_pg* pg, char** err) {
  if (pg == nullptr) return JETRL_ERR_INVALID_ARGUMENT;
  return guarded(err, pg->timeout, JETRL_ERR_TIMEOUT, [&] {
    c10d::BarrierOptions opts;
    opts.timeout = pg->timeout;
    if (pg->kind == JETRL_BACKEND_NCCL && pg->cuda_device >= 0) {
      opts.device_ids = {pg->cuda_device};
      opts.device = at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(pg->cuda_device));
    }
    wait_work(pg->backend->barrier(opts), pg->timeout);
  });
}

int jetrl_pg_store_set(jetrl_pg* pg, const char* key, const uint8_t* data, uint64_t len, char** err) {
  if (pg == nullptr || key == nullptr || (data == nullptr && len > 0)) return JETRL_ERR_INVALID_ARGUMENT;
  return guarded(err, pg->timeout, JETRL_ERR_TIMEOUT, [&] {
    std::vector<uint8_t> value(data, data + len);
    pg->store->set(std::string(key), value);
  });
}

int jetrl_pg_store_get(jetrl_pg* pg, const char* key, int64_t timeout_ms, uint8_t** out, uint64_t* out_len,
                       char** err) {
  if (pg == nullptr || key == nullptr || out == nullptr || out_len == nullptr || timeout_ms <= 0) {
    return JETRL_ERR_INVALID_ARGUMENT;
  }
  *out = nullptr;
  *out_len = 0;
  const Millis timeout(timeout_ms);
  return guarded(err, timeout, JETRL_ERR_TIMEOUT, [&] {
    const std::string k(key);
    pg->store->wait({k}, timeout);
    std::vector<uint8_t> value = pg->store->get(k);
    uint8_t* buf = static_cast<uint8_t*>(std::malloc(value.empty() ? 1 : value.size()));
    if (buf == nullptr) throw ShimError(JETRL_ERR, "out of memory for a store value");
    if (!value.empty()) std::memcpy(buf, value.data(), value.size());
    *out = buf;
    *out_len = value.size();
  });
}

void jetrl_free_bytes(uint8_t* p) { std::free(p); }

int jetrl_pg_store_delete(jetrl_pg* pg, const char* key, char** err) {
  if (pg == nullptr || key == nullptr) return JETRL_ERR_INVALID_ARGUMENT;
  return guarded(err, pg->timeout, JETRL_ERR_TIMEOUT, [&] { pg->store->deleteKey(std::string(key)); });
}

}  // extern "C"
