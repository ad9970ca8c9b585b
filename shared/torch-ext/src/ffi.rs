//! The C ABI of `csrc/torch_ext.h`. Only this module and `c10d.rs` touch raw pointers.

use std::ffi::{c_char, c_int, c_void, CStr};

pub(crate) const OK: c_int = 0;
pub(crate) const ERR_TIMEOUT: c_int = 2;
pub(crate) const ERR_STORE_UNREACHABLE: c_int = 3;
pub(crate) const ERR_DUPLICATE_RANK: c_int = 4;
pub(crate) const ERR_INVALID_ARGUMENT: c_int = 5;
pub(crate) const ERR_NOT_BUILT: c_int = 6;

pub(crate) const BACKEND_GLOO: c_int = 0;
pub(crate) const BACKEND_NCCL: c_int = 1;

pub(crate) const REDUCE_SUM: c_int = 0;
pub(crate) const REDUCE_AVG: c_int = 1;
pub(crate) const REDUCE_MAX: c_int = 2;

/// `struct jetrl_pg`: owned by the C++ side, freed with [`jetrl_pg_free`].
#[repr(C)]
pub(crate) struct RawGroup {
    _private: [u8; 0],
}

/// `struct jetrl_graph`: owned by the C++ side, freed with [`jetrl_graph_free`].
#[repr(C)]
pub(crate) struct RawGraph {
    _private: [u8; 0],
}

/// `struct jetrl_event`: owned by the C++ side, freed with [`jetrl_event_free`].
#[repr(C)]
pub(crate) struct RawEvent {
    _private: [u8; 0],
}

extern "C" {
    pub(crate) fn jetrl_cuda_graphs_built() -> c_int;
    pub(crate) fn jetrl_event_record(device: i64, out: *mut *mut RawEvent, err: *mut *mut c_char) -> c_int;
    pub(crate) fn jetrl_event_synchronize(event: *mut RawEvent, err: *mut *mut c_char) -> c_int;
    pub(crate) fn jetrl_event_free(event: *mut RawEvent);
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn jetrl_fused_adamw(
        param: *mut c_void,
        grad: *const c_void,
        exp_avg: *mut c_void,
        exp_avg_sq: *mut c_void,
        step: *const c_void,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn jetrl_graph_pool_new(first: *mut u64, second: *mut u64, err: *mut *mut c_char) -> c_int;
    pub(crate) fn jetrl_graph_new(
        device: i64,
        pool_first: u64,
        pool_second: u64,
        out: *mut *mut RawGraph,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn jetrl_graph_free(graph: *mut RawGraph);
    pub(crate) fn jetrl_graph_enter_stream(graph: *mut RawGraph, err: *mut *mut c_char) -> c_int;
    pub(crate) fn jetrl_graph_leave_stream(graph: *mut RawGraph, err: *mut *mut c_char) -> c_int;
    pub(crate) fn jetrl_graph_capture_begin(graph: *mut RawGraph, err: *mut *mut c_char) -> c_int;
    pub(crate) fn jetrl_graph_capture_end(graph: *mut RawGraph, err: *mut *mut c_char) -> c_int;
    pub(crate) fn jetrl_graph_replay(graph: *mut RawGraph, err: *mut *mut c_char) -> c_int;
    pub(crate) fn jetrl_free_string(s: *mut c_char);
    pub(crate) fn jetrl_nccl_built() -> c_int;
    pub(crate) fn jetrl_cuda_peak_allocated(device: i64, reset: c_int) -> i64;
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn jetrl_flash_attention_varlen(
        q: *const c_void,
        k: *const c_void,
        v: *const c_void,
        cu_seqlens: *const c_void,
        max_len: i64,
        scale: f64,
        out: *mut *mut c_void,
        err: *mut *mut c_char,
    ) -> c_int;
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn jetrl_pg_new(
        backend: c_int,
        rank: c_int,
        world_size: c_int,
        host: *const c_char,
        port: u16,
        timeout_ms: i64,
        prefix: *const c_char,
        gloo_hostname: *const c_char,
        cuda_device: i64,
        out: *mut *mut RawGroup,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn jetrl_pg_free(pg: *mut RawGroup);
    pub(crate) fn jetrl_pg_all_reduce(
        pg: *mut RawGroup,
        tensor: *mut c_void,
        op: c_int,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn jetrl_pg_reduce_scatter(
        pg: *mut RawGroup,
        out: *mut c_void,
        input: *const c_void,
        op: c_int,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn jetrl_pg_all_gather_into(
        pg: *mut RawGroup,
        out: *mut c_void,
        input: *const c_void,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn jetrl_pg_broadcast(
        pg: *mut RawGroup,
        tensor: *mut c_void,
        root: c_int,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn jetrl_pg_barrier(pg: *mut RawGroup, err: *mut *mut c_char) -> c_int;
    pub(crate) fn jetrl_pg_store_set(
        pg: *mut RawGroup,
        key: *const c_char,
        data: *const u8,
        len: u64,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn jetrl_pg_store_get(
        pg: *mut RawGroup,
        key: *const c_char,
        timeout_ms: i64,
        out: *mut *mut u8,
        out_len: *mut u64,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn jetrl_free_bytes(p: *mut u8);
    pub(crate) fn jetrl_pg_store_delete(pg: *mut RawGroup, key: *const c_char, err: *mut *mut c_char) -> c_int;
}

/// A failed shim call: its status code and the C++ message.
pub(crate) struct RawError {
    pub(crate) code: c_int,
    pub(crate) message: String,
}

/// Runs one shim call that reports failure through a status code and a malloc'd message, and takes the message.
pub(crate) fn check(call: impl FnOnce(*mut *mut c_char) -> c_int) -> Result<(), RawError> {
    let mut err: *mut c_char = std::ptr::null_mut();
    let code = call(&mut err);
    let message = if err.is_null() {
        String::new()
    } else {
        #[allow(unsafe_code)]
        // SAFETY: a non-null `err` is a NUL-terminated string the shim allocated with malloc for this call; it is
        // read once here and freed once with the shim's matching free.
        unsafe {
            let text = CStr::from_ptr(err).to_string_lossy().into_owned();
            jetrl_free_string(err);
            text
        }
    };
    if code == OK {
        Ok(())
    } else {
        let message = if message.is_empty() { format!("shim status {code}") } else { message };
        Err(RawError { code, message })
    }
}
