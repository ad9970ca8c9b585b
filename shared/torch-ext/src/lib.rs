//! The project's one thin C++ shim of libtorch extensions that tch does not bind (see README.md next to this
//! crate), built with torch-sys' flags. So far: torch.distributed (c10d) process groups and collectives
//! ([`ProcessGroup`]), the same `ProcessGroupGloo` / `ProcessGroupNCCL` and `TCPStore` Python's
//! `torch.distributed` runs on; the CUDA caching allocator's peak ([`cuda_peak_allocated`]); flash attention
//! over packed variable-length sequences ([`flash_attention_varlen`]); CUDA graphs ([`CudaGraph`]); ATen's fused
//! AdamW ([`fused_adamw`]).
//!
//! ```no_run
//! use jetrl_torch_ext::{Backend, ProcessGroup, ProcessGroupOptions, ReduceOp};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let opts = ProcessGroupOptions::new(Backend::Gloo, 0, 2, "127.0.0.1", 29500)
//!     .with_timeout(std::time::Duration::from_secs(30))
//!     .with_store_prefix("attempt-1");
//! let mut group = ProcessGroup::new(opts)?;
//! let mut grads = tch::Tensor::ones([1024], (tch::Kind::Float, tch::Device::Cpu));
//! group.all_reduce(&mut grads, ReduceOp::Avg)?;
//! # Ok(())
//! # }
//! ```

mod attention;
mod c10d;
mod ffi;
mod graph;
mod optim;

pub use attention::{flash_attention_varlen, KernelError};
pub use graph::{cuda_graphs_built, CudaEvent, CudaGraph, GraphPool};
pub use optim::{fused_adamw, AdamWStep};

pub use c10d::{
    cuda_peak_allocated, nccl_built, Backend, DistError, ProcessGroup, ProcessGroupOptions, ReduceOp, DEFAULT_TIMEOUT,
};
