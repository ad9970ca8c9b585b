// CUDA graphs (at::cuda::CUDAGraph): capture a sequence of kernels issued from Rust once, replay it with one
// launch. The rollout engine's decode step is dozens of small kernels per layer; replaying them as a graph removes
// the host's launch overhead, which is what bounds a decode step of a small model.
//
// Capture must run on a stream other than the default one, so a graph owns a side stream from the pool: the
// caller enters it (the current stream becomes the side stream, ordered after the work already queued), runs
// warm-up passes and the capture there, and leaves it (the previous stream waits for the side stream). Replays
// run on the caller's current stream. Compiled with the CUDA part of the shim (build.rs); without it every call
// reports JETRL_ERR_NOT_BUILT.

#include <optional>
#include <string>

#include "shim_util.hpp"

#ifdef JETRL_WITH_NCCL
#include <c10/core/Event.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>

struct jetrl_graph {
  at::cuda::CUDAGraph graph;
  c10::cuda::CUDAStream side;
  std::optional<c10::cuda::CUDAStream> previous;
  at::cuda::MempoolId_t pool;
  bool captured = false;

  jetrl_graph(c10::cuda::CUDAStream side, at::cuda::MempoolId_t pool) : side(side), pool(pool) {}
};
struct jetrl_event {
  c10::Event event{c10::DeviceType::CUDA};
};
#else
struct jetrl_graph {};
struct jetrl_event {};
#endif

namespace {

using jetrl_shim::fail;
using jetrl_shim::guarded;

#ifndef JETRL_WITH_NCCL
int not_built(char** err) {
  return fail(err, JETRL_ERR_NOT_BUILT, "CUDA graphs: the shim was built without its CUDA part");
}
#endif

}  // namespace

extern "C" {

int jetrl_cuda_graphs_built(void) {
#ifdef JETRL_WITH_NCCL
  return 1;
#else
  return 0;
#endif
}

int jetrl_graph_pool_new(uint64_t* first, uint64_t* second, char** err) {
#ifdef JETRL_WITH_NCCL
  return guarded(err, [&] {
    const auto pool = at::cuda::graph_pool_handle();
    *first = pool.first;
    *second = pool.second;
  });
#else
  (void)first;
  (void)second;
  return not_built(err);
#endif
}

int jetrl_graph_new(int64_t device, uint64_t pool_first, uint64_t pool_second, jetrl_graph** out, char** err) {
#ifdef JETRL_WITH_NCCL
  if (out == nullptr) return fail(err, JETRL_ERR_INVALID_ARGUMENT, "jetrl_graph_new: null out");
  if (device < 0 || device >= c10::cuda::device_count()) {
    return fail(err, JETRL_ERR_INVALID_ARGUMENT, "jetrl_graph_new: no CUDA device " + std::to_string(device));
  }
  return guarded(err, [&] {
    auto side = c10::cuda::getStreamFromPool(false, static_cast<c10::DeviceIndex>(device));
    *out = new jetrl_graph(side, at::cuda::MempoolId_t{pool_first, pool_second});
  });
#else
  (void)device;
  (void)pool_first;
  (void)pool_second;
  (void)out;
  return not_built(err);
#endif
}

void jetrl_graph_free(jetrl_graph* graph) {
  try {
    delete graph;
  } catch (...) {
  }
}

int jetrl_graph_enter_stream(jetrl_graph* g, char** err) {
#ifdef JETRL_WITH_NCCL
  if (g == nullptr || g->previous.has_value()) {
    return fail(err, JETRL_ERR_INVALID_ARGUMENT, "jetrl_graph_enter_stream: null graph or already entered");
  }
  return guarded(err, [&] {
    auto current = c10::cuda::getCurrentCUDAStream(g->side.device_index());
    // c10::Event goes through the CUDA guard implementation libc10_cuda registers (no CUDA runtime call here)
    c10::Event ready(c10::DeviceType::CUDA);
    ready.record(current.unwrap());
    ready.block(g->side.unwrap());
    c10::cuda::setCurrentCUDAStream(g->side);
    g->previous = current;
  });
#else
  (void)g;
  return not_built(err);
#endif
}

int jetrl_graph_leave_stream(jetrl_graph* g, char** err) {
#ifdef JETRL_WITH_NCCL
  if (g == nullptr || !g->previous.has_value()) {
    return fail(err, JETRL_ERR_INVALID_ARGUMENT, "jetrl_graph_leave_stream: null graph or not entered");
  }
  return guarded(err, [&] {
    auto previous = *g->previous;
    g->previous.reset();
    c10::Event done(c10::DeviceType::CUDA);
    done.record(g->side.unwrap());
    done.block(previous.unwrap());
    c10::cuda::setCurrentCUDAStream(previous);
  });
#else
  (void)g;
  return not_built(err);
#endif
}

int jetrl_graph_capture_begin(jetrl_graph* g, char** err) {
#ifdef JETRL_WITH_NCCL
  if (g == nullptr || !g->previous.has_value() || g->captured) {
    return fail(err, JETRL_ERR_INVALID_ARGUMENT,
                "jetrl_graph_capture_begin: the graph must be on its side stream and not captured yet");
  }
  return guarded(err, [&] { g->graph.capture_begin(g->pool); });
#else
  (void)g;
  return not_built(err);
#endif
}

int jetrl_graph_capture_end(jetrl_graph* g, char** err) {
#ifdef JETRL_WITH_NCCL
  if (g == nullptr) return fail(err, JETRL_ERR_INVALID_ARGUMENT, "jetrl_graph_capture_end: null graph");
  return guarded(err, [&] {
    g->graph.capture_end();
    g->captured = true;
  });
#else
  (void)g;
  return not_built(err);
#endif
}

int jetrl_graph_replay(jetrl_graph* g, char** err) {
#ifdef JETRL_WITH_NCCL
  if (g == nullptr || !g->captured) return fail(err, JETRL_ERR_INVALID_ARGUMENT, "jetrl_graph_replay: not captured");
  return guarded(err, [&] { g->graph.replay(); });
#else
  (void)g;
  return not_built(err);
#endif
}

int jetrl_event_record(int64_t device, jetrl_event** out, char** err) {
#ifdef JETRL_WITH_NCCL
  if (out == nullptr) return fail(err, JETRL_ERR_INVALID_ARGUMENT, "jetrl_event_record: null out");
  if (device < 0 || device >= c10::cuda::device_count()) {
    return fail(err, JETRL_ERR_INVALID_ARGUMENT, "jetrl_event_record: no CUDA device " + std::to_string(device));
  }
  return guarded(err, [&] {
    auto event = new jetrl_event();
    try {
      event->event.record(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).unwrap());
    } catch (...) {
      delete event;
      throw;
    }
    *out = event;
  });
#else
  (void)device;
  (void)out;
  return not_built(err);
#endif
}

int jetrl_event_synchronize(jetrl_event* e, char** err) {
#ifdef JETRL_WITH_NCCL
  if (e == nullptr) return fail(err, JETRL_ERR_INVALID_ARGUMENT, "jetrl_event_synchronize: null event");
  return guarded(err, [&] { e->event.synchronize(); });
#else
  (void)e;
  return not_built(err);
#endif
}

void jetrl_event_free(jetrl_event* event) {
  try {
    delete event;
  } catch (...) {
  }
}

}  // extern "C"
