// jetrl-torch-ext: the C ABI of the project's one C++ shim of libtorch extensions.
//
// Every function catches every C++ exception and reports it through a status code plus a message
// (`*err`, allocated with malloc; free it with jetrl_free_string). Nothing here aborts the process.
// Tensor handles are the `torch::Tensor*` (at::Tensor*) that tch hands out (`Tensor::as_ptr`).
#pragma once

#include <stdint.h>

#ifdef __cplusplus
namespace at {
class Tensor;
}
typedef at::Tensor jetrl_tensor;
extern "C" {
#else
typedef struct jetrl_tensor jetrl_tensor;
#endif

// Status codes (mirrored in src/ffi.rs).
enum {
  JETRL_OK = 0,
  JETRL_ERR = 1,                // any other failure (peer gone, backend error, ...)
  JETRL_ERR_TIMEOUT = 2,        // the operation ran past its deadline
  JETRL_ERR_STORE_UNREACHABLE = 3,  // TCPStore client could not connect to the store
  JETRL_ERR_DUPLICATE_RANK = 4, // another process already registered this rank
  JETRL_ERR_INVALID_ARGUMENT = 5,
  JETRL_ERR_NOT_BUILT = 6,      // backend not compiled into this shim
};

// Backends and reduce ops (mirrored in src/ffi.rs).
enum { JETRL_BACKEND_GLOO = 0, JETRL_BACKEND_NCCL = 1 };
enum { JETRL_REDUCE_SUM = 0, JETRL_REDUCE_AVG = 1, JETRL_REDUCE_MAX = 2 };

typedef struct jetrl_pg jetrl_pg;

void jetrl_free_string(char* s);

// 1 when the NCCL process group was compiled into this shim.
int jetrl_nccl_built(void);

// Causal flash attention over sequences packed end to end (at::_flash_attention_forward with cumulative lengths):
// q [total, heads, d], k and v [total, kv_heads, d], cu_seqlens int32 [n + 1]; *out gets a new tensor
// [total, heads, d] (owned by the caller, as tch's tensors are). CUDA bf16/fp16 only; anything else is an error.
int jetrl_flash_attention_varlen(const jetrl_tensor* q, const jetrl_tensor* k, const jetrl_tensor* v,
                                 const jetrl_tensor* cu_seqlens, int64_t max_len, double scale, jetrl_tensor** out,
                                 char** err);

// One step of ATen's fused AdamW (at::_fused_adamw_, torch.optim.AdamW(fused=True)) over one parameter tensor with
// its gradient and moments (all the same dtype, shape and device); `step` is a float32 scalar tensor on that device
// holding the step count after this step. No amsgrad, no maximize, no grad scaling.
int jetrl_fused_adamw(jetrl_tensor* param, const jetrl_tensor* grad, jetrl_tensor* exp_avg, jetrl_tensor* exp_avg_sq,
                      const jetrl_tensor* step, double lr, double beta1, double beta2, double weight_decay,
                      double eps, char** err);

// Peak bytes the CUDA caching allocator has handed out on `device` (torch.cuda.max_memory_allocated), resetting
// the peak afterwards when `reset` is non-zero; -1 without the CUDA part of the shim or without that device.
int64_t jetrl_cuda_peak_allocated(int64_t device, int reset);

// CUDA graphs (cuda_graph.cpp). 1 when the CUDA part is built. A pool is a memory pool id shared by the graphs
// captured with it (replay them in capture order, or consume each one's outputs before the next replay). A graph
// owns a side stream: enter it, run warm-up passes, capture_begin, issue the work, capture_end, leave it; replay
// runs on the current stream.
typedef struct jetrl_graph jetrl_graph;
int jetrl_cuda_graphs_built(void);
int jetrl_graph_pool_new(uint64_t* first, uint64_t* second, char** err);
int jetrl_graph_new(int64_t device, uint64_t pool_first, uint64_t pool_second, jetrl_graph** out, char** err);
void jetrl_graph_free(jetrl_graph* graph);
int jetrl_graph_enter_stream(jetrl_graph* graph, char** err);
int jetrl_graph_leave_stream(jetrl_graph* graph, char** err);
int jetrl_graph_capture_begin(jetrl_graph* graph, char** err);
int jetrl_graph_capture_end(jetrl_graph* graph, char** err);
int jetrl_graph_replay(jetrl_graph* graph, char** err);
// A CUDA event recorded on the current stream of `device` now; synchronize waits (on the host) until the work queued
// before it is done, and nothing queued after.
typedef struct jetrl_event jetrl_event;
int jetrl_event_record(int64_t device, jetrl_event** out, char** err);
int jetrl_event_synchronize(jetrl_event* event, char** err);
void jetrl_event_free(jetrl_event* event);

// Creates a process group: connects to (rank 0: hosts) the TCPStore at host:port, optionally wraps it in a
// PrefixStore, registers the rank (refusing a rank claimed twice) and rendezvouses the backend.
// `timeout_ms` bounds the store connection, the rendezvous and every later collective.
// `prefix`, `gloo_hostname` may be NULL; `cuda_device` < 0 means rank % device count (NCCL only).
int jetrl_pg_new(int backend, int rank, int world_size, const char* host, uint16_t port, int64_t timeout_ms,
                 const char* prefix, const char* gloo_hostname, int64_t cuda_device, jetrl_pg** out, char** err);
void jetrl_pg_free(jetrl_pg* pg);

int jetrl_pg_all_reduce(jetrl_pg* pg, jetrl_tensor* tensor, int op, char** err);
int jetrl_pg_reduce_scatter(jetrl_pg* pg, jetrl_tensor* out, const jetrl_tensor* input, int op, char** err);
int jetrl_pg_all_gather_into(jetrl_pg* pg, jetrl_tensor* out, const jetrl_tensor* input, char** err);
int jetrl_pg_broadcast(jetrl_pg* pg, jetrl_tensor* tensor, int root, char** err);
int jetrl_pg_barrier(jetrl_pg* pg, char** err);

// The group's store (with its prefix) as a key-value channel between the ranks. `set` writes `len` bytes under
// `key`. `get` waits up to `timeout_ms` for `key` to exist (JETRL_ERR_TIMEOUT when it does not), then returns its
// value in `*out` (malloc'd, `*out_len` bytes; free it with jetrl_free_bytes).
int jetrl_pg_store_set(jetrl_pg* pg, const char* key, const uint8_t* data, uint64_t len, char** err);
int jetrl_pg_store_get(jetrl_pg* pg, const char* key, int64_t timeout_ms, uint8_t** out, uint64_t* out_len,
                       char** err);
void jetrl_free_bytes(uint8_t* p);
// Deletes `key` from the group's store (no error when it is not there).
int jetrl_pg_store_delete(jetrl_pg* pg, const char* key, char** err);

#ifdef __cplusplus
}
#endif
