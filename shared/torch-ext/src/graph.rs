//! CUDA graphs: a sequence of kernels issued once through tch, captured, and replayed with one launch
//! (`at::cuda::CUDAGraph`, what `torch.cuda.graph` wraps).
//!
//! A captured graph reads and writes the exact memory it touched during capture: its inputs are tensors the caller
//! keeps alive and refills in place before each replay, and its outputs are the tensors the captured closure
//! returned (allocated in the graph's memory pool, overwritten by each replay). Graphs that share a
//! [`GraphPool`] share that memory: consume one graph's outputs before replaying another.

use std::ptr::NonNull;

use crate::attention::KernelError;
use crate::ffi;

/// Whether the shim was built with its CUDA part (otherwise every graph call is an error).
pub fn cuda_graphs_built() -> bool {
    #[allow(unsafe_code)]
    // SAFETY: takes no arguments and only returns a compile-time constant.
    let built = unsafe { ffi::jetrl_cuda_graphs_built() };
    built != 0
}

fn graph_error(message: String) -> KernelError {
    KernelError { kernel: "cuda_graph", message }
}

/// A memory pool id for graphs captured together (`torch.cuda.graph_pool_handle()`).
#[derive(Debug, Clone, Copy)]
pub struct GraphPool {
    first: u64,
    second: u64,
}

impl GraphPool {
    pub fn new() -> Result<Self, KernelError> {
        let (mut first, mut second) = (0u64, 0u64);
        ffi::check(|err| {
            #[allow(unsafe_code)]
            // SAFETY: two live out-pointers and the error out-pointer.
            unsafe {
                ffi::jetrl_graph_pool_new(&mut first, &mut second, err)
            }
        })
        .map_err(|e| graph_error(e.message))?;
        Ok(GraphPool { first, second })
    }
}

/// One captured CUDA graph on one device.
#[derive(Debug)]
pub struct CudaGraph {
    raw: NonNull<ffi::RawGraph>,
}

#[allow(unsafe_code)]
// SAFETY: the C++ graph and its side stream are not tied to the thread that created them; every method takes
// `&mut self` or is a replay, and the engine that owns graphs drives them from one thread at a time.
unsafe impl Send for CudaGraph {}

impl CudaGraph {
    /// Runs `work` `warmup` times on the graph's side stream (eagerly: libraries allocate their workspaces), then
    /// once more under capture, and returns the graph with what the captured run returned. The capture is ended
    /// and the caller's stream restored whatever `work` returns.
    pub fn capture<T, E: std::fmt::Display>(
        device: usize,
        pool: GraphPool,
        warmup: usize,
        mut work: impl FnMut() -> Result<T, E>,
    ) -> Result<(CudaGraph, T), KernelError> {
        let mut raw: *mut ffi::RawGraph = std::ptr::null_mut();
        ffi::check(|err| {
            #[allow(unsafe_code)]
            // SAFETY: plain integers in, a live out-pointer and the error out-pointer.
            unsafe {
                ffi::jetrl_graph_new(device as i64, pool.first, pool.second, &mut raw, err)
            }
        })
        .map_err(|e| graph_error(e.message))?;
        let raw = NonNull::new(raw).ok_or_else(|| graph_error("no graph created".into()))?;
        let graph = CudaGraph { raw };
        graph.call(ffi::jetrl_graph_enter_stream)?;
        let captured = graph.capture_on_side_stream(warmup, &mut work);
        let left = graph.call(ffi::jetrl_graph_leave_stream);
        let out = captured?;
        left?;
        Ok((graph, out))
    }

    fn capture_on_side_stream<T, E: std::fmt::Display>(
        &self,
        warmup: usize,
        work: &mut impl FnMut() -> Result<T, E>,
    ) -> Result<T, KernelError> {
        for _ in 0..warmup {
            work().map_err(|e| graph_error(format!("warm-up before capture: {e}")))?;
        }
        self.call(ffi::jetrl_graph_capture_begin)?;
        let out = work();
        let ended = self.call(ffi::jetrl_graph_capture_end);
        let out = out.map_err(|e| graph_error(format!("during capture: {e}")))?;
        ended?;
        Ok(out)
    }

    /// Launches the captured kernels on the current stream.
    pub fn replay(&self) -> Result<(), KernelError> {
        self.call(ffi::jetrl_graph_replay)
    }

    fn call(
        &self,
        f: unsafe extern "C" fn(*mut ffi::RawGraph, *mut *mut std::ffi::c_char) -> std::ffi::c_int,
    ) -> Result<(), KernelError> {
        ffi::check(|err| {
            #[allow(unsafe_code)]
            // SAFETY: `raw` is the live graph this value owns; `err` is a live out-pointer.
            unsafe {
                f(self.raw.as_ptr(), err)
            }
        })
        .map_err(|e| graph_error(e.message))
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        #[allow(unsafe_code)]
        // SAFETY: the graph is owned by this value and freed once.
        unsafe {
            ffi::jetrl_graph_free(self.raw.as_ptr())
        }
    }
}

/// A CUDA event: recorded on a device's current stream, waited for on the host (the work queued before it, not
/// after), e.g. a device-to-host copy read one step later.
#[derive(Debug)]
pub struct CudaEvent {
    raw: NonNull<ffi::RawEvent>,
}

#[allow(unsafe_code)]
// SAFETY: a recorded CUDA event may be waited for from any thread.
unsafe impl Send for CudaEvent {}

impl CudaEvent {
    /// Records an event on the current stream of CUDA device `device`.
    pub fn record(device: usize) -> Result<Self, KernelError> {
        let mut raw: *mut ffi::RawEvent = std::ptr::null_mut();
        ffi::check(|err| {
            #[allow(unsafe_code)]
            // SAFETY: an integer in, a live out-pointer and the error out-pointer.
            unsafe {
                ffi::jetrl_event_record(device as i64, &mut raw, err)
            }
        })
        .map_err(|e| KernelError { kernel: "cuda_event", message: e.message })?;
        let raw = NonNull::new(raw).ok_or_else(|| KernelError { kernel: "cuda_event", message: "no event".into() })?;
        Ok(CudaEvent { raw })
    }

    /// Blocks until the work queued before the event is done.
    pub fn synchronize(&self) -> Result<(), KernelError> {
        ffi::check(|err| {
            #[allow(unsafe_code)]
            // SAFETY: `raw` is the live event this value owns; `err` is a live out-pointer.
            unsafe {
                ffi::jetrl_event_synchronize(self.raw.as_ptr(), err)
            }
        })
        .map_err(|e| KernelError { kernel: "cuda_event", message: e.message })
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        #[allow(unsafe_code)]
        // SAFETY: the event is owned by this value and freed once.
        unsafe {
            ffi::jetrl_event_free(self.raw.as_ptr())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_capture_on_a_device_that_does_not_exist_is_an_error_not_an_abort() {
        let pool = GraphPool { first: 0, second: 0 };
        let mut ran = 0;
        let err = CudaGraph::capture(1_000_000, pool, 1, || {
            ran += 1;
            Ok::<_, String>(())
        })
        .unwrap_err();
        println!("{err}");
        assert_eq!(err.kernel, "cuda_graph");
        assert!(err.message.contains("1000000") || err.message.contains("without its CUDA part"), "{err}");
        assert_eq!(ran, 0, "nothing runs before the graph exists");
        let err = CudaEvent::record(1_000_000).unwrap_err();
        assert_eq!(err.kernel, "cuda_event");
    }
}
