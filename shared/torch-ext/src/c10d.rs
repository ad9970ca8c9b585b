//! One file: the Rust side of the c10d shim, one binding per C++ entry point.
//!
//! torch.distributed (c10d) process groups and synchronous collectives on tch tensors.

use std::ffi::{c_int, c_void, CString};
use std::fmt;
use std::ptr::NonNull;
use std::time::Duration;

use tch::Tensor;

use crate::ffi::{self, RawError};

/// The c10d backend a group runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    /// `ProcessGroupGloo`: CPU tensors (CUDA tensors are staged through the host).
    Gloo,
    /// `ProcessGroupNCCL`: CUDA tensors; only when the shim was built with it, see [`nccl_built`].
    Nccl,
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Backend::Gloo => "gloo",
            Backend::Nccl => "nccl",
        })
    }
}

/// The reductions the collectives offer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    /// The mean over ranks; floating-point tensors only. Gloo has no AVG: the shim sums, then divides.
    Avg,
    Max,
}

impl ReduceOp {
    fn raw(self) -> c_int {
        match self {
            ReduceOp::Sum => ffi::REDUCE_SUM,
            ReduceOp::Avg => ffi::REDUCE_AVG,
            ReduceOp::Max => ffi::REDUCE_MAX,
        }
    }
}

/// The timeout a group gets when none is given.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

/// How to create a [`ProcessGroup`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessGroupOptions {
    pub backend: Backend,
    /// This process' rank, `0..world_size`.
    pub rank: usize,
    pub world_size: usize,
    /// The TCPStore every rank meets at; rank 0 hosts it (binds `store_port` on all interfaces).
    pub store_host: String,
    pub store_port: u16,
    /// Bounds the store connection, the rendezvous, and every collective.
    pub timeout: Duration,
    /// A c10d `PrefixStore` namespace for every key, so that a restarted group rendezvouses afresh.
    pub store_prefix: Option<String>,
    /// The address Gloo binds its connections to. `None`: `127.0.0.1` when the store is on the loopback
    /// interface, else Gloo's default device (this machine's hostname).
    pub gloo_hostname: Option<String>,
    /// NCCL only: the CUDA device of this rank; `None`: `rank % device count`.
    pub cuda_device: Option<usize>,
}

impl ProcessGroupOptions {
    pub fn new(
        backend: Backend,
        rank: usize,
        world_size: usize,
        store_host: impl Into<String>,
        store_port: u16,
    ) -> Self {
        Self {
            backend,
            rank,
            world_size,
            store_host: store_host.into(),
            store_port,
            timeout: DEFAULT_TIMEOUT,
            store_prefix: None,
            gloo_hostname: None,
            cuda_device: None,
        }
    }

    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    pub fn with_store_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.store_prefix = Some(prefix.into());
        self
    }

    pub fn with_gloo_hostname(mut self, hostname: impl Into<String>) -> Self {
        self.gloo_hostname = Some(hostname.into());
        self
    }

    pub fn with_cuda_device(mut self, device: usize) -> Self {
        self.cuda_device = Some(device);
        self
    }

    /// `host:port` (`[host]:port` for an IPv6 literal), as errors name it.
    pub fn store_addr(&self) -> String {
        if self.store_host.contains(':') {
            format!("[{}]:{}", self.store_host, self.store_port)
        } else {
            format!("{}:{}", self.store_host, self.store_port)
        }
    }

    fn validate(&self) -> Result<(), DistError> {
        let invalid = |message: String| Err(DistError::InvalidOptions(message));
        if self.world_size == 0 {
            return invalid("world size must be at least 1".into());
        }
        if self.rank >= self.world_size {
            return invalid(format!("rank {} is not below the world size {}", self.rank, self.world_size));
        }
        if c_int::try_from(self.world_size).is_err() {
            return invalid(format!("world size {} is too large", self.world_size));
        }
        if self.store_host.is_empty() {
            return invalid("the store host is empty".into());
        }
        if self.timeout < Duration::from_millis(1) {
            return invalid(format!("timeout {:?} is below 1 ms", self.timeout));
        }
        Ok(())
    }

    fn effective_gloo_hostname(&self) -> Option<String> {
        if self.gloo_hostname.is_some() {
            return self.gloo_hostname.clone();
        }
        let loopback = match self.store_host.parse::<std::net::IpAddr>() {
            Ok(ip) => ip.is_loopback(),
            Err(_) => self.store_host == "localhost",
        };
        loopback.then(|| if self.store_host == "::1" { "::1".to_string() } else { "127.0.0.1".to_string() })
    }
}

/// Every failure of a group, with the rank and the store address it happened at.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    #[error("invalid process group options: {0}")]
    InvalidOptions(String),
    #[error("rank {rank}: the {backend} backend is not built into this jetrl-torch-ext: {message}")]
    NotBuilt { backend: Backend, rank: usize, message: String },
    #[error("rank {rank}: the store at {addr} was unreachable within {timeout:?}: {message}")]
    StoreUnreachable { rank: usize, addr: String, timeout: Duration, message: String },
    #[error("rank {rank} started twice: another process already claimed it at the store {addr} ({message})")]
    DuplicateRank { rank: usize, addr: String, message: String },
    #[error("rank {rank}: {op} timed out after {timeout:?} (store {addr}): {message}")]
    Timeout { op: &'static str, rank: usize, addr: String, timeout: Duration, message: String },
    #[error("rank {rank}: {op} failed (store {addr}): {message}")]
    Failed { op: &'static str, rank: usize, addr: String, message: String },
    #[error("rank {rank}: {op}: invalid argument: {message}")]
    InvalidArgument { op: &'static str, rank: usize, message: String },
}

impl DistError {
    /// A stable, low-cardinality label for metrics and logs: the stage that failed.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::InvalidOptions(..) => "invalid_options",
            Self::NotBuilt { .. } => "not_built",
            Self::StoreUnreachable { .. } => "store_unreachable",
            Self::DuplicateRank { .. } => "duplicate_rank",
            Self::Timeout { .. } => "timeout",
            Self::Failed { .. } => "failed",
            Self::InvalidArgument { .. } => "invalid_argument",
        }
    }
}

/// Peak bytes the CUDA caching allocator has handed out on `device` since the start or the last reset
/// (`torch.cuda.max_memory_allocated`), resetting the peak afterwards when `reset`. `None` when the shim was built
/// without its CUDA part (with NCCL) or the device does not exist.
pub fn cuda_peak_allocated(device: usize, reset: bool) -> Option<u64> {
    #[allow(unsafe_code)]
    // SAFETY: plain integers in and out; the C++ side catches every exception.
    let peak = unsafe { ffi::jetrl_cuda_peak_allocated(device as i64, c_int::from(reset)) };
    u64::try_from(peak).ok()
}

/// Whether the NCCL process group was compiled into the shim (see the crate README).
pub fn nccl_built() -> bool {
    #[allow(unsafe_code)]
    // SAFETY: takes no arguments and only returns a compile-time constant.
    let built = unsafe { ffi::jetrl_nccl_built() };
    built != 0
}

/// One rank's membership of a c10d process group. Collectives are synchronous: each returns once the work is done
/// (on CUDA, once it is ordered before later work on the current stream) or with an error within the timeout.
/// After any error the group should be dropped: every rank restarts together (docs/scale-out.md).
pub struct ProcessGroup {
    raw: NonNull<ffi::RawGroup>,
    backend: Backend,
    rank: usize,
    world_size: usize,
    store_addr: String,
    timeout: Duration,
}

#[allow(unsafe_code)]
// SAFETY: the C++ group (store client, backend and its worker threads) is not tied to the creating thread; every
// call goes through `&mut self`, so a group is never used from two threads at once.
unsafe impl Send for ProcessGroup {}

impl fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("backend", &self.backend)
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("store_addr", &self.store_addr)
            .field("timeout", &self.timeout)
            .finish()
    }
}

fn c_string(what: &str, value: &str) -> Result<CString, DistError> {
    CString::new(value).map_err(|_| DistError::InvalidOptions(format!("{what} contains a NUL byte")))
}

impl ProcessGroup {
    /// Connects to the store (rank 0 hosts it), claims the rank, and runs the backend's rendezvous, all within
    /// `opts.timeout`.
    pub fn new(opts: ProcessGroupOptions) -> Result<Self, DistError> {
        opts.validate()?;
        let rank = opts.rank;
        let addr = opts.store_addr();
        if opts.backend == Backend::Nccl && !nccl_built() {
            return Err(DistError::NotBuilt {
                backend: Backend::Nccl,
                rank,
                message: format!(
                    "{} (it needs libtorch_cuda, nccl.h and the CUDA headers; see the crate README)",
                    env!("JETRL_TORCH_EXT_NCCL_STATUS")
                ),
            });
        }
        let host = c_string("store host", &opts.store_host)?;
        let prefix = opts.store_prefix.as_deref().map(|p| c_string("store prefix", p)).transpose()?;
        let gloo_hostname = opts.effective_gloo_hostname().map(|h| c_string("gloo hostname", &h)).transpose()?;
        let cuda_device = match opts.cuda_device {
            Some(device) => i64::try_from(device)
                .map_err(|_| DistError::InvalidOptions(format!("CUDA device {device} is out of range")))?,
            None => -1,
        };
        let timeout_ms = i64::try_from(opts.timeout.as_millis()).unwrap_or(i64::MAX);
        let backend = match opts.backend {
            Backend::Gloo => ffi::BACKEND_GLOO,
            Backend::Nccl => ffi::BACKEND_NCCL,
        };
        // validate() bounds both by c_int.
        let (rank_c, world_c) = (rank as c_int, opts.world_size as c_int);

        let mut raw: *mut ffi::RawGroup = std::ptr::null_mut();
        let result = ffi::check(|err| {
            #[allow(unsafe_code)]
            // SAFETY: every pointer is valid for the call: the CStrings outlive it, absent options are null (the
            // shim accepts null for them), `raw` and `err` are live out-pointers.
            unsafe {
                ffi::jetrl_pg_new(
                    backend,
                    rank_c,
                    world_c,
                    host.as_ptr(),
                    opts.store_port,
                    timeout_ms,
                    prefix.as_ref().map_or(std::ptr::null(), |p| p.as_ptr()),
                    gloo_hostname.as_ref().map_or(std::ptr::null(), |h| h.as_ptr()),
                    cuda_device,
                    &mut raw,
                    err,
                )
            }
        });
        if let Err(RawError { code, message }) = result {
            return Err(match code {
                ffi::ERR_STORE_UNREACHABLE => {
                    DistError::StoreUnreachable { rank, addr, timeout: opts.timeout, message }
                }
                ffi::ERR_DUPLICATE_RANK => DistError::DuplicateRank { rank, addr, message },
                ffi::ERR_NOT_BUILT => DistError::NotBuilt { backend: opts.backend, rank, message },
                ffi::ERR_INVALID_ARGUMENT => DistError::InvalidOptions(message),
                ffi::ERR_TIMEOUT => DistError::Timeout { op: "rendezvous", rank, addr, timeout: opts.timeout, message },
                _ => DistError::Failed { op: "rendezvous", rank, addr, message },
            });
        }
        let raw = NonNull::new(raw).ok_or_else(|| DistError::Failed {
            op: "rendezvous",
            rank,
            addr: addr.clone(),
            message: "the shim returned no group".into(),
        })?;
        Ok(Self {
            raw,
            backend: opts.backend,
            rank,
            world_size: opts.world_size,
            store_addr: addr,
            timeout: opts.timeout,
        })
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The store's `host:port`.
    pub fn store_addr(&self) -> &str {
        &self.store_addr
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Reduces `tensor` (contiguous) over all ranks, in place.
    pub fn all_reduce(&mut self, tensor: &mut Tensor, op: ReduceOp) -> Result<(), DistError> {
        let raw = self.raw.as_ptr();
        let t = tensor.as_mut_ptr().cast::<c_void>();
        let result = ffi::check(|err| {
            #[allow(unsafe_code)]
            // SAFETY: `raw` is this live group, `t` the `torch::Tensor*` behind a tensor borrowed mutably for the
            // call, `err` a live out-pointer.
            unsafe {
                ffi::jetrl_pg_all_reduce(raw, t, op.raw(), err)
            }
        });
        result.map_err(|e| self.op_error("all_reduce", e))
    }

    /// Reduces `input` (`world_size × out.numel()` elements, any shape, contiguous) over all ranks and leaves this
    /// rank's slice `[rank·n, (rank+1)·n)` of the flattened result in `out`.
    pub fn reduce_scatter(&mut self, out: &mut Tensor, input: &Tensor, op: ReduceOp) -> Result<(), DistError> {
        let raw = self.raw.as_ptr();
        let o = out.as_mut_ptr().cast::<c_void>();
        let i = input.as_ptr().cast::<c_void>();
        let result = ffi::check(|err| {
            #[allow(unsafe_code)]
            // SAFETY: `raw` is this live group; `o` and `i` are the `torch::Tensor*` behind tensors borrowed for
            // the call (the shim only reads `input`); `err` is a live out-pointer.
            unsafe {
                ffi::jetrl_pg_reduce_scatter(raw, o, i, op.raw(), err)
            }
        });
        result.map_err(|e| self.op_error("reduce_scatter", e))
    }

    /// Gathers every rank's `input` into `out` (`world_size × input.numel()` elements, contiguous), rank-major.
    pub fn all_gather_into(&mut self, out: &mut Tensor, input: &Tensor) -> Result<(), DistError> {
        let raw = self.raw.as_ptr();
        let o = out.as_mut_ptr().cast::<c_void>();
        let i = input.as_ptr().cast::<c_void>();
        let result = ffi::check(|err| {
            #[allow(unsafe_code)]
            // SAFETY: as in `reduce_scatter`.
            unsafe {
                ffi::jetrl_pg_all_gather_into(raw, o, i, err)
            }
        });
        result.map_err(|e| self.op_error("all_gather", e))
    }

    /// Copies `root`'s `tensor` into `tensor` on every other rank.
    pub fn broadcast(&mut self, tensor: &mut Tensor, root: usize) -> Result<(), DistError> {
        let root = match c_int::try_from(root) {
            Ok(root) if root >= 0 && (root as usize) < self.world_size => root,
            _ => {
                return Err(DistError::InvalidArgument {
                    op: "broadcast",
                    rank: self.rank,
                    message: format!("root {root} is not a rank of a group of {}", self.world_size),
                })
            }
        };
        let raw = self.raw.as_ptr();
        let t = tensor.as_mut_ptr().cast::<c_void>();
        let result = ffi::check(|err| {
            #[allow(unsafe_code)]
            // SAFETY: as in `all_reduce`.
            unsafe {
                ffi::jetrl_pg_broadcast(raw, t, root, err)
            }
        });
        result.map_err(|e| self.op_error("broadcast", e))
    }

    /// Returns once every rank has reached the barrier.
    pub fn barrier(&mut self) -> Result<(), DistError> {
        let raw = self.raw.as_ptr();
        let result = ffi::check(|err| {
            #[allow(unsafe_code)]
            // SAFETY: `raw` is this live group, `err` a live out-pointer.
            unsafe {
                ffi::jetrl_pg_barrier(raw, err)
            }
        });
        result.map_err(|e| self.op_error("barrier", e))
    }

    /// Writes `value` under `key` in the group's store (its prefix applied): a channel from one rank to the others
    /// that needs no collective (a rank waiting for the next command is not held in a collective's timeout).
    pub fn store_set(&mut self, key: &str, value: &[u8]) -> Result<(), DistError> {
        let key = self.c_key("store_set", key)?;
        let raw = self.raw.as_ptr();
        let result = ffi::check(|err| {
            #[allow(unsafe_code)]
            // SAFETY: `raw` is this live group, `key` a NUL-terminated string and `value` a slice, both alive for the
            // call (the shim copies them); `err` a live out-pointer.
            unsafe {
                ffi::jetrl_pg_store_set(raw, key.as_ptr(), value.as_ptr(), value.len() as u64, err)
            }
        });
        result.map_err(|e| self.op_error("store_set", e))
    }

    /// The value under `key` once it exists, waiting up to `wait`; `Ok(None)` when it did not appear in time. A
    /// store that cannot be reached (rank 0, which hosts it, is gone) is an error.
    pub fn store_get(&mut self, key: &str, wait: Duration) -> Result<Option<Vec<u8>>, DistError> {
        let key = self.c_key("store_get", key)?;
        let raw = self.raw.as_ptr();
        let wait_ms = i64::try_from(wait.as_millis()).unwrap_or(i64::MAX).max(1);
        let mut out: *mut u8 = std::ptr::null_mut();
        let mut len: u64 = 0;
        let result = ffi::check(|err| {
            #[allow(unsafe_code)]
            // SAFETY: `raw` is this live group, `key` alive for the call, `out`/`len`/`err` live out-pointers.
            unsafe {
                ffi::jetrl_pg_store_get(raw, key.as_ptr(), wait_ms, &mut out, &mut len, err)
            }
        });
        match result {
            Ok(()) => {
                let value = if out.is_null() {
                    Vec::new()
                } else {
                    #[allow(unsafe_code)]
                    // SAFETY: on success the shim returned `len` bytes it allocated with malloc for this call; they
                    // are copied once and freed once with the shim's matching free.
                    unsafe {
                        let value = std::slice::from_raw_parts(out, len as usize).to_vec();
                        ffi::jetrl_free_bytes(out);
                        value
                    }
                };
                Ok(Some(value))
            }
            Err(e) if e.code == ffi::ERR_TIMEOUT => Ok(None),
            Err(e) => Err(self.op_error("store_get", e)),
        }
    }

    /// Deletes `key` from the group's store (its prefix applied); a key that is not there is no error.
    pub fn store_delete(&mut self, key: &str) -> Result<(), DistError> {
        let key = self.c_key("store_delete", key)?;
        let raw = self.raw.as_ptr();
        let result = ffi::check(|err| {
            #[allow(unsafe_code)]
            // SAFETY: `raw` is this live group, `key` a NUL-terminated string alive for the call, `err` a live
            // out-pointer.
            unsafe {
                ffi::jetrl_pg_store_delete(raw, key.as_ptr(), err)
            }
        });
        result.map_err(|e| self.op_error("store_delete", e))
    }

    fn c_key(&self, op: &'static str, key: &str) -> Result<std::ffi::CString, DistError> {
        std::ffi::CString::new(key).map_err(|_| DistError::InvalidArgument {
            op,
            rank: self.rank,
            message: format!("store key {key:?} contains a NUL byte"),
        })
    }

    fn op_error(&self, op: &'static str, RawError { code, message }: RawError) -> DistError {
        let (rank, addr) = (self.rank, self.store_addr.clone());
        match code {
            ffi::ERR_TIMEOUT => DistError::Timeout { op, rank, addr, timeout: self.timeout, message },
            ffi::ERR_INVALID_ARGUMENT => DistError::InvalidArgument { op, rank, message },
            _ => DistError::Failed { op, rank, addr, message },
        }
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        #[allow(unsafe_code)]
        // SAFETY: `raw` came from `jetrl_pg_new` and is freed exactly once, here.
        unsafe {
            ffi::jetrl_pg_free(self.raw.as_ptr())
        }
    }
}
