//! ATen's fused AdamW kernel, which tch does not bind.

use std::ffi::c_void;

use tch::Tensor;

use crate::attention::KernelError;
use crate::ffi;

/// The settings of one fused AdamW step (`torch.optim.AdamW`'s arithmetic: decoupled decay, bias-corrected
/// moments, `eps` added after the square root).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub weight_decay: f64,
    pub eps: f64,
}

/// One step of `at::_fused_adamw_` (what `torch.optim.AdamW(fused=True)` runs) on `param` in place, with its
/// moments updated in place. `grad`, `exp_avg` and `exp_avg_sq` have `param`'s dtype, shape and device; `step` is a
/// float32 scalar tensor on that device holding the step count including this step (the bias-correction
/// exponent). CPU and CUDA; an unsupported input is an error naming the kernel, not an abort.
pub fn fused_adamw(
    param: &mut Tensor,
    grad: &Tensor,
    exp_avg: &mut Tensor,
    exp_avg_sq: &mut Tensor,
    step: &Tensor,
    settings: AdamWStep,
) -> Result<(), KernelError> {
    // the CPU kernel trusts its inputs: check what it would otherwise read past
    let refuse = |message: String| Err(KernelError { kernel: "fused_adamw", message });
    for (name, t) in [("grad", grad), ("exp_avg", &*exp_avg), ("exp_avg_sq", &*exp_avg_sq)] {
        if t.size() != param.size() || t.kind() != param.kind() || t.device() != param.device() {
            return refuse(format!(
                "{name} is {:?} {:?} on {:?}, the parameter {:?} {:?} on {:?}",
                t.size(),
                t.kind(),
                t.device(),
                param.size(),
                param.kind(),
                param.device()
            ));
        }
    }
    if step.numel() != 1 || step.kind() != tch::Kind::Float || step.device() != param.device() {
        return refuse(format!(
            "step must be one float32 on {:?}, got {:?} {:?}",
            param.device(),
            step.size(),
            step.kind()
        ));
    }
    let AdamWStep { lr, beta1, beta2, weight_decay, eps } = settings;
    let (p, g, m, v, s) = (
        param.as_mut_ptr().cast::<c_void>(),
        grad.as_ptr().cast::<c_void>(),
        exp_avg.as_mut_ptr().cast::<c_void>(),
        exp_avg_sq.as_mut_ptr().cast::<c_void>(),
        step.as_ptr().cast::<c_void>(),
    );
    ffi::check(|err| {
        #[allow(unsafe_code)]
        // SAFETY: the five `torch::Tensor*` belong to tensors borrowed for the call (the three written ones
        // mutably); `err` is a live out-pointer.
        unsafe {
            ffi::jetrl_fused_adamw(p, g, m, v, s, lr, beta1, beta2, weight_decay, eps, err)
        }
    })
    .map_err(|e| KernelError { kernel: "fused_adamw", message: e.message })
}

#[cfg(test)]
mod tests {
    use tch::{Device, Kind};

    use super::*;

    #[test]
    fn one_fused_step_is_the_closed_form_adamw_step() {
        let opts = (Kind::Float, Device::Cpu);
        let mut p = Tensor::from_slice(&[1.0f32, -2.0, 0.5]);
        let g = Tensor::from_slice(&[0.1f32, 0.2, -0.3]);
        let (mut m, mut v) = (Tensor::zeros([3], opts), Tensor::zeros([3], opts));
        let step = Tensor::from(1.0f32);
        let settings = AdamWStep { lr: 0.01, beta1: 0.9, beta2: 0.999, weight_decay: 0.1, eps: 1e-8 };
        fused_adamw(&mut p, &g, &mut m, &mut v, &step, settings).unwrap();
        // first step: m̂ = g, v̂ = g², so p ← p·(1 − lr·wd) − lr·g/(|g| + eps)
        for (i, (p0, g0)) in [(1.0f64, 0.1f64), (-2.0, 0.2), (0.5, -0.3)].into_iter().enumerate() {
            let want = p0 * (1.0 - 0.01 * 0.1) - 0.01 * g0 / (g0.abs() + 1e-8);
            let got = p.double_value(&[i as i64]);
            assert!((got - want).abs() < 1e-6, "element {i}: {got} vs {want}");
        }
        assert!((m.double_value(&[0]) - 0.1 * 0.1).abs() < 1e-7);
    }

    #[test]
    fn mismatched_shapes_are_an_error_naming_the_kernel() {
        let opts = (Kind::Float, Device::Cpu);
        let mut p = Tensor::zeros([3], opts);
        let (mut m, mut v) = (Tensor::zeros([3], opts), Tensor::zeros([3], opts));
        let settings = AdamWStep { lr: 0.01, beta1: 0.9, beta2: 0.999, weight_decay: 0.0, eps: 1e-8 };
        let err = fused_adamw(&mut p, &Tensor::zeros([4], opts), &mut m, &mut v, &Tensor::from(1.0f32), settings)
            .unwrap_err();
        assert_eq!(err.kernel, "fused_adamw");
        assert!(err.message.contains("grad is [4]"), "{err}");
    }
}
