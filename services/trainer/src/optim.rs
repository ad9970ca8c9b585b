//! AdamW whose state is plain tensors (libtorch's C++ optimizer state cannot be saved from Rust), with
//! per-group weight decay and verl's learning-rate schedules.
//!
//! Groups: matrices and embeddings decay; 1-D parameters (biases, norm scales) do not — the usual
//! transformer practice, so decay never shrinks a norm's gain towards zero.

use std::collections::BTreeMap;

use jetrl_config::OptimConfig;
use tch::{Kind, Tensor};

#[derive(Debug, thiserror::Error)]
pub enum OptimError {
    #[error("optimizer: {0}")]
    Torch(#[from] tch::TchError),
    #[error("optimizer state: {0}")]
    State(String),
}

/// Decoupled-weight-decay Adam (Loshchilov & Hutter), the arithmetic of `torch.optim.AdamW`'s single-tensor
/// path, with two parameter groups: matrices and embeddings decay, 1-D parameters do not.
///
/// Low-precision (bf16) parameters get an fp32 master copy: moments and updates live in fp32 and the model
/// holds the rounded copy, so small updates are not lost to bf16 rounding. fp32 parameters are updated in
/// place and need no copy.
pub struct AdamW {
    params: Vec<(String, Tensor)>,
    /// fp32 master weights of the parameters the model holds in a lower precision, by name
    master: BTreeMap<String, Tensor>,
    /// first and second moments, by parameter name (created at the first step, fp32)
    exp_avg: BTreeMap<String, Tensor>,
    exp_avg_sq: BTreeMap<String, Tensor>,
    /// per-parameter work buffer for the update's denominator (not state: never saved)
    scratch: BTreeMap<String, Tensor>,
    /// optimizer steps taken (the bias-correction exponent)
    pub step: u64,
    betas: (f64, f64),
    eps: f64,
    weight_decay: f64,
}

impl AdamW {
    pub fn new(params: Vec<(String, Tensor)>, cfg: &OptimConfig) -> Result<Self, OptimError> {
        let mut master = BTreeMap::new();
        tch::no_grad(|| -> Result<(), OptimError> {
            for (name, p) in &params {
                if p.kind() != Kind::Float {
                    master.insert(name.clone(), p.f_detach()?.f_to_kind(Kind::Float)?);
                }
            }
            Ok(())
        })?;
        Ok(Self {
            params,
            master,
            exp_avg: BTreeMap::new(),
            exp_avg_sq: BTreeMap::new(),
            scratch: BTreeMap::new(),
            step: 0,
            betas: (cfg.betas[0], cfg.betas[1]),
            eps: cfg.eps,
            weight_decay: cfg.weight_decay,
        })
    }

    /// Whether fp32 master copies are kept (the parameters are bf16).
    pub fn has_master_weights(&self) -> bool {
        !self.master.is_empty()
    }

    pub fn zero_grad(&mut self) {
        for (_, p) in &mut self.params {
            let mut grad = p.grad();
            if grad.defined() {
                let _ = grad.detach_().zero_();
            }
        }
    }

    /// Global L2 norm of all gradients (before clipping), accumulated in fp32.
    pub fn grad_norm(&self) -> Result<f64, OptimError> {
        let mut norms = Vec::with_capacity(self.params.len());
        for (_, p) in &self.params {
            let grad = p.grad();
            if grad.defined() {
                norms.push(grad.f_to_kind(Kind::Float)?.f_norm()?);
            }
        }
        if norms.is_empty() {
            return Ok(0.0);
        }
        // one host read for the whole model, not one per tensor
        Ok(Tensor::f_stack(&norms, 0)?.f_norm()?.f_double_value(&[])?)
    }

    /// Scales gradients so their global norm is at most `max_norm` (torch `clip_grad_norm_`: coefficient
    /// `max_norm / (norm + 1e-6)`, applied only when below 1); returns the norm before clipping.
    pub fn clip_grad_norm(&mut self, max_norm: f64) -> Result<f64, OptimError> {
        let norm = self.grad_norm()?;
        if max_norm > 0.0 && norm.is_finite() {
            let coef = max_norm / (norm + 1e-6);
            if coef < 1.0 {
                tch::no_grad(|| -> Result<(), OptimError> {
                    for (_, p) in &self.params {
                        let mut grad = p.grad();
                        if grad.defined() {
                            let _ = grad.f_mul_scalar_(coef)?;
                        }
                    }
                    Ok(())
                })?;
            }
        }
        Ok(norm)
    }

    /// One AdamW update at learning rate `lr`.
    pub fn step(&mut self, lr: f64) -> Result<(), OptimError> {
        self.step += 1;
        let (b1, b2) = self.betas;
        let bias1 = 1.0 - b1.powi(self.step as i32);
        let bias2_sqrt = (1.0 - b2.powi(self.step as i32)).sqrt();
        let step_size = lr / bias1;
        tch::no_grad(|| -> Result<(), OptimError> {
            for (name, p) in &mut self.params {
                let grad = p.grad();
                if !grad.defined() {
                    continue;
                }
                let grad = if grad.kind() == Kind::Float { grad } else { grad.f_to_kind(Kind::Float)? };
                if !self.exp_avg.contains_key(name) {
                    self.exp_avg.insert(name.clone(), grad.f_zeros_like()?);
                    self.exp_avg_sq.insert(name.clone(), grad.f_zeros_like()?);
                    self.scratch.insert(name.clone(), grad.f_empty_like()?);
                }
                let (Some(m), Some(v), Some(denom)) =
                    (self.exp_avg.get_mut(name), self.exp_avg_sq.get_mut(name), self.scratch.get_mut(name))
                else {
                    continue;
                };
                let mut target = match self.master.get(name) {
                    Some(master) => master.shallow_clone(),
                    None => p.shallow_clone(),
                };
                if self.weight_decay > 0.0 && p.dim() >= 2 {
                    let _ = target.f_mul_scalar_(1.0 - lr * self.weight_decay)?;
                }
                // Every operation below is in place: a step allocates nothing, so the allocator does not hand
                // pages back to the kernel and fault them in again at every step (large CPU tensors are mmapped).
                let _ = m.f_lerp_(&grad, 1.0 - b1)?;
                // v ← β₂·v + (1−β₂)·g², the square formed in the work buffer
                denom.f_copy_(&grad)?;
                let _ = denom.f_mul_(&grad)?.f_mul_scalar_(1.0 - b2)?;
                let _ = v.f_mul_scalar_(b2)?.f_add_(denom)?;
                if step_size != 0.0 {
                    // p −= step_size·m/(√v/√bias2 + eps): one fused addcdiv on a pre-scaled denominator
                    denom.f_copy_(v)?;
                    let _ = denom
                        .f_sqrt_()?
                        .f_div_scalar_(bias2_sqrt)?
                        .f_add_scalar_(self.eps)?
                        .f_div_scalar_(-step_size)?;
                    let _ = target.f_addcdiv_(m, denom)?;
                }
                if self.master.contains_key(name) {
                    p.f_copy_(&target)?;
                }
            }
            Ok(())
        })
    }

    /// Everything the optimizer needs to continue exactly: the moments (`exp_avg.<param>`,
    /// `exp_avg_sq.<param>`) and the fp32 master weights (`master.<param>`), as named tensors for a
    /// checkpoint. The step count is saved by the caller.
    pub fn state_tensors(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for (prefix, map) in [("exp_avg", &self.exp_avg), ("exp_avg_sq", &self.exp_avg_sq), ("master", &self.master)] {
            for (name, t) in map {
                out.push((format!("{prefix}.{name}"), t.shallow_clone()));
            }
        }
        out
    }

    /// Restores state saved by [`AdamW::state_tensors`]; the tensors are moved to the parameters' device.
    /// Master weights are also copied into the (rounded) model parameters.
    pub fn load_state_tensors(&mut self, tensors: Vec<(String, Tensor)>, step: u64) -> Result<(), OptimError> {
        let params: BTreeMap<&str, &Tensor> = self.params.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let mut avg = BTreeMap::new();
        let mut sq = BTreeMap::new();
        let mut master = BTreeMap::new();
        for (name, t) in tensors {
            let (map, param) = if let Some(p) = name.strip_prefix("exp_avg_sq.") {
                (&mut sq, p)
            } else if let Some(p) = name.strip_prefix("exp_avg.") {
                (&mut avg, p)
            } else if let Some(p) = name.strip_prefix("master.") {
                (&mut master, p)
            } else {
                return Err(OptimError::State(format!("unexpected tensor {name}")));
            };
            let Some(target) = params.get(param) else {
                return Err(OptimError::State(format!("state for unknown parameter {param}")));
            };
            if t.size() != target.size() {
                return Err(OptimError::State(format!(
                    "{name} has shape {:?}, the parameter has {:?}",
                    t.size(),
                    target.size()
                )));
            }
            map.insert(param.to_string(), t.f_to_device(target.device())?.f_to_kind(Kind::Float)?);
        }
        tch::no_grad(|| -> Result<(), OptimError> {
            for (name, value) in &master {
                if let Some(p) = params.get(name.as_str()) {
                    p.shallow_clone().f_copy_(value)?;
                }
            }
            Ok(())
        })?;
        // parameters held in fp32 need no master; a bf16 model resumed from an fp32 run gets fresh ones
        for (name, p) in &self.params {
            if p.kind() != Kind::Float && !master.contains_key(name) {
                master.insert(name.clone(), tch::no_grad(|| p.f_detach()?.f_to_kind(Kind::Float))?);
            }
        }
        master.retain(|name, _| params.get(name.as_str()).is_some_and(|p| p.kind() != Kind::Float));
        self.scratch =
            avg.iter().map(|(k, t)| Ok((k.clone(), t.f_empty_like()?))).collect::<Result<_, OptimError>>()?;
        self.exp_avg = avg;
        self.exp_avg_sq = sq;
        self.master = master;
        self.step = step;
        Ok(())
    }
}

/// verl's schedules (`verl/utils/torch_functional.py`), stepped once per training step: linear warmup from 0,
/// then constant, or cosine decay to `min_lr_ratio · lr` at `total` steps.
#[derive(Debug, Clone)]
pub struct LrSchedule {
    base: f64,
    warmup: u64,
    total: u64,
    cosine: bool,
    min_ratio: f64,
}

impl LrSchedule {
    /// `total_steps`: the training horizon (verl's `optim.total_training_steps`).
    pub fn new(cfg: &OptimConfig, total_steps: u64) -> Self {
        let warmup =
            cfg.lr_warmup_steps.filter(|&w| w > 0).unwrap_or((cfg.lr_warmup_steps_ratio * total_steps as f64) as u64);
        Self {
            base: cfg.lr,
            warmup,
            total: total_steps.max(1),
            cosine: cfg.lr_scheduler_type == jetrl_config::LrSchedulerType::Cosine,
            min_ratio: cfg.min_lr_ratio,
        }
    }

    /// Learning rate of the training step numbered `step` (0-based: the scheduler has stepped `step` times).
    pub fn lr(&self, step: u64) -> f64 {
        if step < self.warmup {
            return self.base * step as f64 / self.warmup as f64;
        }
        if !self.cosine {
            return self.base;
        }
        let progress = ((step - self.warmup) as f64 / (self.total.saturating_sub(self.warmup)).max(1) as f64).min(1.0);
        let cos = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
        self.base * (self.min_ratio + (1.0 - self.min_ratio) * cos).max(self.min_ratio)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adamw_matches_the_closed_form_first_step() {
        // First Adam step moves each weight by lr·sign(g) (bias-corrected m/sqrt(v) = g/|g|), after decay.
        let w = Tensor::from_slice(&[1.0f32, -2.0, 3.0, 4.0]).view([2, 2]).set_requires_grad(true);
        let loss = (&w * Tensor::from_slice(&[1.0f32, -1.0, 2.0, 0.5]).view([2, 2])).sum(Kind::Float);
        loss.backward();
        let cfg = OptimConfig { lr: 0.1, weight_decay: 0.01, eps: 0.0, ..OptimConfig::default() };
        let mut opt = AdamW::new(vec![("w".into(), w.shallow_clone())], &cfg).unwrap();
        opt.step(0.1).unwrap();
        let got = Vec::<f32>::try_from(w.detach().view([-1])).unwrap();
        let expected: Vec<f32> = [1.0f32, -2.0, 3.0, 4.0]
            .iter()
            .zip([1.0f32, -1.0, 2.0, 0.5])
            .map(|(x, g)| x * (1.0 - 0.1 * 0.01) - 0.1 * g.signum())
            .collect();
        for (a, b) in got.iter().zip(&expected) {
            assert!((a - b).abs() < 1e-6, "{got:?} vs {expected:?}");
        }
    }

    #[test]
    fn one_dimensional_parameters_are_not_decayed() {
        let bias = Tensor::from_slice(&[1.0f32, 1.0]).set_requires_grad(true);
        (&bias * 0.0).sum(Kind::Float).backward();
        let cfg = OptimConfig { lr: 0.1, weight_decay: 0.5, ..OptimConfig::default() };
        let mut opt = AdamW::new(vec![("b".into(), bias.shallow_clone())], &cfg).unwrap();
        opt.step(0.1).unwrap();
        assert_eq!(Vec::<f32>::try_from(bias.detach()).unwrap(), vec![1.0, 1.0]);
    }

    #[test]
    fn clipping_scales_to_the_max_norm_and_reports_the_original() {
        let w = Tensor::from_slice(&[0.0f32, 0.0]).set_requires_grad(true);
        (&w * Tensor::from_slice(&[3.0f32, 4.0])).sum(Kind::Float).backward();
        let mut opt = AdamW::new(vec![("w".into(), w.shallow_clone())], &OptimConfig::default()).unwrap();
        let norm = opt.clip_grad_norm(1.0).unwrap();
        assert!((norm - 5.0).abs() < 1e-6);
        assert!((opt.grad_norm().unwrap() - 1.0).abs() < 1e-4);
    }

    /// Updates far below bf16's resolution at 1.0 (2^-8) must accumulate in the fp32 master, and show up in
    /// the bf16 parameter once they add up.
    #[test]
    fn bf16_parameters_accumulate_small_updates_in_fp32_master_weights() {
        let w = Tensor::ones([2, 2], (Kind::BFloat16, tch::Device::Cpu)).set_requires_grad(true);
        let cfg = OptimConfig { lr: 1e-3, weight_decay: 0.0, ..OptimConfig::default() };
        let mut opt = AdamW::new(vec![("w".into(), w.shallow_clone())], &cfg).unwrap();
        assert!(opt.has_master_weights());
        for _ in 0..20 {
            opt.zero_grad();
            w.sum(Kind::Float).backward();
            opt.step(1e-3).unwrap();
        }
        let master = opt.state_tensors().into_iter().find(|(n, _)| n == "master.w").unwrap().1;
        assert_eq!(master.kind(), Kind::Float);
        let m = f64::try_from(master.mean(Kind::Double)).unwrap();
        assert!((m - (1.0 - 20.0 * 1e-3)).abs() < 1e-4, "master {m}");
        let rounded = f64::try_from(w.detach().to_kind(Kind::Float).mean(Kind::Double)).unwrap();
        assert!((rounded - m).abs() < 4e-3 && rounded < 1.0, "bf16 copy {rounded} vs master {m}");
        assert_eq!(w.kind(), Kind::BFloat16);
    }

    #[test]
    fn saved_state_continues_exactly_like_the_uninterrupted_optimizer() {
        let run = |split: bool| -> Vec<f32> {
            let w = Tensor::from_slice(&[0.5f32, -1.0, 2.0, 0.25]).view([2, 2]).set_requires_grad(true);
            let cfg = OptimConfig { lr: 0.05, weight_decay: 0.1, ..OptimConfig::default() };
            let mut opt = AdamW::new(vec![("w".into(), w.shallow_clone())], &cfg).unwrap();
            let target = Tensor::from_slice(&[1.0f32, 2.0, -1.0, 0.0]).view([2, 2]);
            for i in 0..6 {
                if split && i == 3 {
                    let state = opt.state_tensors().into_iter().map(|(n, t)| (n, t.copy())).collect();
                    let step = opt.step;
                    opt = AdamW::new(vec![("w".into(), w.shallow_clone())], &cfg).unwrap();
                    opt.load_state_tensors(state, step).unwrap();
                }
                opt.zero_grad();
                (&w - &target).square().sum(Kind::Float).backward();
                opt.step(0.05).unwrap();
            }
            Vec::<f32>::try_from(w.detach().view([-1])).unwrap()
        };
        assert_eq!(run(false), run(true));
    }

    #[test]
    fn state_for_an_unknown_parameter_is_rejected() {
        let w = Tensor::zeros([2], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
        let mut opt = AdamW::new(vec![("w".into(), w)], &OptimConfig::default()).unwrap();
        let err =
            opt.load_state_tensors(vec![("exp_avg.v".into(), Tensor::zeros([2], (Kind::Float, tch::Device::Cpu)))], 1);
        assert!(matches!(err, Err(OptimError::State(_))));
    }

    #[test]
    fn verl_warmup_starts_at_zero_then_cosine_reaches_the_floor() {
        let cfg = OptimConfig {
            lr: 1.0,
            lr_warmup_steps: Some(2),
            lr_scheduler_type: jetrl_config::LrSchedulerType::Cosine,
            min_lr_ratio: 0.1,
            ..OptimConfig::default()
        };
        let s = LrSchedule::new(&cfg, 10);
        assert_eq!(s.lr(0), 0.0);
        assert_eq!(s.lr(1), 0.5);
        assert!((s.lr(2) - 1.0).abs() < 1e-9);
        assert!((s.lr(10) - 0.1).abs() < 1e-9);
        let constant = LrSchedule::new(&OptimConfig { lr: 0.3, ..OptimConfig::default() }, 10);
        assert_eq!(constant.lr(7), 0.3);
        let ratio = LrSchedule::new(&OptimConfig { lr: 1.0, lr_warmup_steps_ratio: 0.5, ..OptimConfig::default() }, 10);
        assert_eq!(ratio.lr(1), 0.2);
        assert_eq!(ratio.lr(5), 1.0);
    }
}
