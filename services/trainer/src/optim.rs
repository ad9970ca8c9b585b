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

/// Decoupled-weight-decay Adam (Loshchilov & Hutter), as torch.optim.AdamW.
pub struct AdamW {
    params: Vec<(String, Tensor)>,
    /// first and second moments, by parameter name (created lazily, fp32)
    exp_avg: BTreeMap<String, Tensor>,
    exp_avg_sq: BTreeMap<String, Tensor>,
    /// optimizer steps taken
    pub step: u64,
    betas: (f64, f64),
    eps: f64,
    weight_decay: f64,
}

impl AdamW {
    pub fn new(params: Vec<(String, Tensor)>, cfg: &OptimConfig) -> Self {
        Self {
            params,
            exp_avg: BTreeMap::new(),
            exp_avg_sq: BTreeMap::new(),
            step: 0,
            betas: (cfg.betas[0], cfg.betas[1]),
            eps: cfg.eps,
            weight_decay: cfg.weight_decay,
        }
    }

    pub fn zero_grad(&mut self) {
        for (_, p) in &mut self.params {
            let mut grad = p.grad();
            if grad.defined() {
                let _ = grad.detach_().zero_();
            }
        }
    }

    /// Global L2 norm of all gradients (before clipping).
    pub fn grad_norm(&self) -> Result<f64, OptimError> {
        let mut total = 0.0f64;
        for (_, p) in &self.params {
            let grad = p.grad();
            if grad.defined() {
                let n = grad.f_to_kind(Kind::Float)?.f_norm()?.double_value(&[]);
                total += n * n;
            }
        }
        Ok(total.sqrt())
    }

    /// Scales gradients so their global norm is at most `max_norm`; returns the norm before clipping.
    pub fn clip_grad_norm(&mut self, max_norm: f64) -> Result<f64, OptimError> {
        let norm = self.grad_norm()?;
        if max_norm > 0.0 && norm.is_finite() && norm > max_norm {
            let coef = max_norm / (norm + 1e-6);
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
        Ok(norm)
    }

    /// One AdamW update at learning rate `lr`.
    pub fn step(&mut self, lr: f64) -> Result<(), OptimError> {
        self.step += 1;
        let (b1, b2) = self.betas;
        let bias1 = 1.0 - b1.powi(self.step as i32);
        let bias2 = 1.0 - b2.powi(self.step as i32);
        tch::no_grad(|| -> Result<(), OptimError> {
            for (name, p) in &mut self.params {
                let grad = p.grad();
                if !grad.defined() {
                    continue;
                }
                let grad = grad.f_to_kind(Kind::Float)?;
                let m = self.exp_avg.entry(name.clone()).or_insert_with(|| grad.zeros_like());
                let v = self.exp_avg_sq.entry(name.clone()).or_insert_with(|| grad.zeros_like());
                let _ = m.f_mul_scalar_(b1)?.f_add_(&grad.f_mul_scalar(1.0 - b1)?)?;
                let _ = v.f_mul_scalar_(b2)?.f_add_(&grad.f_mul(&grad)?.f_mul_scalar(1.0 - b2)?)?;
                if self.weight_decay > 0.0 && p.dim() >= 2 {
                    let _ = p.f_mul_scalar_(1.0 - lr * self.weight_decay)?;
                }
                let denom = v.f_div_scalar(bias2)?.f_sqrt()?.f_add_scalar(self.eps)?;
                let update = m.f_div(&denom)?.f_mul_scalar(-lr / bias1)?.f_to_kind(p.kind())?;
                let _ = p.f_add_(&update)?;
            }
            Ok(())
        })
    }

    /// The moments as named tensors (`exp_avg.<param>`, `exp_avg_sq.<param>`) for a checkpoint.
    pub fn state_tensors(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for (name, t) in &self.exp_avg {
            out.push((format!("exp_avg.{name}"), t.shallow_clone()));
        }
        for (name, t) in &self.exp_avg_sq {
            out.push((format!("exp_avg_sq.{name}"), t.shallow_clone()));
        }
        out
    }

    /// Restores moments saved by [`AdamW::state_tensors`].
    pub fn load_state_tensors(&mut self, tensors: Vec<(String, Tensor)>, step: u64) -> Result<(), OptimError> {
        let known: std::collections::HashSet<&str> = self.params.iter().map(|(n, _)| n.as_str()).collect();
        let mut avg = BTreeMap::new();
        let mut sq = BTreeMap::new();
        for (name, t) in tensors {
            let (map, param) = if let Some(p) = name.strip_prefix("exp_avg_sq.") {
                (&mut sq, p.to_string())
            } else if let Some(p) = name.strip_prefix("exp_avg.") {
                (&mut avg, p.to_string())
            } else {
                return Err(OptimError::State(format!("unexpected tensor {name}")));
            };
            if !known.contains(param.as_str()) {
                return Err(OptimError::State(format!("moment for unknown parameter {param}")));
            }
            map.insert(param, t);
        }
        self.exp_avg = avg;
        self.exp_avg_sq = sq;
        self.step = step;
        Ok(())
    }
}

/// verl's schedules: linear warmup, then constant or cosine decay to `min_lr_ratio · lr`.
#[derive(Debug, Clone)]
pub struct LrSchedule {
    base: f64,
    warmup: u64,
    total: u64,
    cosine: bool,
    min_ratio: f64,
}

impl LrSchedule {
    pub fn new(cfg: &OptimConfig, total_updates: u64) -> Self {
        let warmup = cfg
            .lr_warmup_steps
            .filter(|&w| w > 0)
            .unwrap_or_else(|| (cfg.lr_warmup_steps_ratio * total_updates as f64) as u64);
        Self {
            base: cfg.lr,
            warmup,
            total: total_updates.max(1),
            cosine: cfg.lr_scheduler_type == "cosine",
            min_ratio: cfg.min_lr_ratio,
        }
    }

    /// Learning rate for the update numbered `update` (0-based).
    pub fn lr(&self, update: u64) -> f64 {
        if self.warmup > 0 && update < self.warmup {
            return self.base * (update + 1) as f64 / self.warmup as f64;
        }
        if !self.cosine {
            return self.base;
        }
        let progress = (update - self.warmup) as f64 / (self.total.saturating_sub(self.warmup)).max(1) as f64;
        let cos = 0.5 * (1.0 + (std::f64::consts::PI * progress.min(1.0)).cos());
        self.base * (self.min_ratio + (1.0 - self.min_ratio) * cos)
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
        let mut opt = AdamW::new(vec![("w".into(), w.shallow_clone())], &cfg);
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
    fn clipping_scales_to_the_max_norm_and_reports_the_original() {
        let w = Tensor::from_slice(&[0.0f32, 0.0]).set_requires_grad(true);
        (&w * Tensor::from_slice(&[3.0f32, 4.0])).sum(Kind::Float).backward();
        let mut opt = AdamW::new(vec![("w".into(), w.shallow_clone())], &OptimConfig::default());
        let norm = opt.clip_grad_norm(1.0).unwrap();
        assert!((norm - 5.0).abs() < 1e-6);
        assert!((opt.grad_norm().unwrap() - 1.0).abs() < 1e-4);
    }

    #[test]
    fn warmup_then_cosine_reaches_the_floor() {
        let cfg = OptimConfig {
            lr: 1.0,
            lr_warmup_steps: Some(2),
            lr_scheduler_type: "cosine".into(),
            min_lr_ratio: 0.1,
            ..OptimConfig::default()
        };
        let s = LrSchedule::new(&cfg, 10);
        assert_eq!(s.lr(0), 0.5);
        assert_eq!(s.lr(1), 1.0);
        assert!((s.lr(2) - 1.0).abs() < 1e-9);
        assert!((s.lr(10) - 0.1).abs() < 1e-9);
        let constant = LrSchedule::new(&OptimConfig { lr: 0.3, ..OptimConfig::default() }, 10);
        assert_eq!(constant.lr(7), 0.3);
    }
}
