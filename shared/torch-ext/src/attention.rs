//! Attention kernels libtorch has and tch does not bind.

use std::ffi::c_void;

use tch::Tensor;

use crate::ffi;

/// A kernel refused its inputs or failed (the message is libtorch's).
#[derive(Debug, thiserror::Error)]
#[error("{kernel}: {message}")]
pub struct KernelError {
    pub kernel: &'static str,
    pub message: String,
}

/// Causal flash attention over sequences packed end to end (`at::_flash_attention_forward` with cumulative
/// sequence lengths, as `flash_attn_varlen_func`): `q` `[total, heads, head_dim]`, `k` and `v` `[total,
/// kv_heads, head_dim]` (grouped heads: `heads` a multiple of `kv_heads`), `cu_seqlens` int32 `[n + 1]` on the
/// same device (0, then each sequence's end), `max_len` the longest sequence. Returns `[total, heads, head_dim]`;
/// no token attends across sequences. Differentiable. CUDA, bf16 or fp16 only: anything else is an error.
pub fn flash_attention_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_seqlens: &Tensor,
    max_len: i64,
    scale: f64,
) -> Result<Tensor, KernelError> {
    let mut out: *mut c_void = std::ptr::null_mut();
    let (qp, kp, vp, cp) = (
        q.as_ptr().cast::<c_void>(),
        k.as_ptr().cast::<c_void>(),
        v.as_ptr().cast::<c_void>(),
        cu_seqlens.as_ptr().cast::<c_void>(),
    );
    ffi::check(|err| {
        #[allow(unsafe_code)]
        // SAFETY: the four inputs are the `torch::Tensor*` behind tensors borrowed for the call (only read);
        // `out` and `err` are live out-pointers.
        unsafe {
            ffi::jetrl_flash_attention_varlen(qp, kp, vp, cp, max_len, scale, &mut out, err)
        }
    })
    .map_err(|e| KernelError { kernel: "flash_attention_varlen", message: e.message })?;
    if out.is_null() {
        return Err(KernelError { kernel: "flash_attention_varlen", message: "no output".into() });
    }
    #[allow(unsafe_code)]
    // SAFETY: on success the shim wrote a heap-allocated `torch::Tensor*` that nothing else owns; tch takes it.
    let tensor = unsafe { Tensor::from_ptr(out.cast::<torch_sys::C_tensor>()) };
    Ok(tensor)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_tensors_are_an_error_naming_the_kernel_not_an_abort() {
        let q = Tensor::zeros([6, 4, 8], (tch::Kind::Float, tch::Device::Cpu));
        let kv = Tensor::zeros([6, 2, 8], (tch::Kind::Float, tch::Device::Cpu));
        let cu = Tensor::from_slice(&[0i32, 2, 6]);
        let err = flash_attention_varlen(&q, &kv, &kv, &cu, 4, 0.35).unwrap_err();
        println!("{err}");
        assert_eq!(err.kernel, "flash_attention_varlen");
        assert!(!err.message.is_empty());
    }
}
