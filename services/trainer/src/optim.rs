//! AdamW over one flat buffer of trainable parameters, its state sharded over the trainer's ranks (ZeRO-2), with
//! per-group weight decay and verl's learning-rate schedules.
//!
//! The parameters are laid end to end in one flat index space (padded to a multiple of the world size); rank `r`
//! owns the slice `[r·S, (r+1)·S)`. At each update the gradients are flattened and reduce-scattered (summed: the
//! loss of every rank is already its share of the global loss) into the rank's fp32 shard, the global norm is one
//! scalar all-reduce, AdamW runs on the shard (fp32 master weights and both moments exist on that rank only), and
//! the updated shard is all-gathered back into every rank's parameters. With one rank the collectives are the
//! identity and the arithmetic is `torch.optim.AdamW`'s single-tensor path.
//!
//! Groups: matrices and embeddings decay; 1-D parameters (biases, norm scales) do not — the usual transformer
//! practice, so decay never shrinks a norm's gain towards zero.

use std::collections::BTreeMap;
use std::path::Path;

use jetrl_config::OptimConfig;
use jetrl_torch_ext::{fused_adamw, AdamWStep, DistError};
use tch::{Device, Kind, Tensor};

use crate::checkpoint::{
    optimizer_shard_file, read_json, read_tensors, write_json, write_tensors, CheckpointError, OptimizerMeta,
    OPTIMIZER_FILE, OPTIMIZER_META_FILE,
};
use crate::dist::Comm;

#[derive(Debug, thiserror::Error)]
pub enum OptimError {
    #[error("optimizer: {0}")]
    Torch(#[from] tch::TchError),
    #[error("optimizer: {0}")]
    Dist(#[from] DistError),
    #[error("optimizer state: {0}")]
    State(String),
    /// the optimizer files of a checkpoint are missing or do not fit this model and world size
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
}

impl OptimError {
    /// A stable, low-cardinality label for metrics and logs: the stage that failed.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Torch(..) => "torch",
            Self::Dist(..) => "dist",
            Self::State(..) => "state",
            Self::Checkpoint(..) => "checkpoint",
        }
    }
}

/// One parameter's place in the flat index space.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    pub name: String,
    pub offset: i64,
    pub numel: i64,
    /// weight decay applies (matrices and embeddings)
    pub decays: bool,
}

/// The flat index space of a parameter list and this rank's shard of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlatLayout {
    pub slots: Vec<Slot>,
    /// parameters' elements in all
    pub total: i64,
    /// `total` rounded up to a multiple of the world size
    pub padded: i64,
    /// elements per rank
    pub shard: i64,
    /// this rank's first element
    pub start: i64,
}

impl FlatLayout {
    pub fn new(params: &[(String, Tensor)], rank: usize, world: usize) -> Self {
        let mut slots = Vec::with_capacity(params.len());
        let mut offset = 0;
        for (name, p) in params {
            let numel = p.numel() as i64;
            slots.push(Slot { name: name.clone(), offset, numel, decays: p.dim() >= 2 });
            offset += numel;
        }
        let world = world.max(1) as i64;
        let shard = (offset + world - 1) / world;
        Self { slots, total: offset, padded: shard * world, shard, start: rank as i64 * shard }
    }

    /// The parts of decaying parameters inside this rank's shard, as (start, length) in shard coordinates, adjacent
    /// parameters merged into one range (one in-place multiply each).
    fn decaying_ranges(&self) -> Vec<(i64, i64)> {
        let (lo, hi) = (self.start, self.start + self.shard);
        let mut ranges: Vec<(i64, i64)> = Vec::new();
        for s in self.slots.iter().filter(|s| s.decays) {
            let (a, b) = (s.offset.max(lo), (s.offset + s.numel).min(hi));
            if a >= b {
                continue;
            }
            match ranges.last_mut() {
                Some((start, len)) if *start + *len == a - lo => *len += b - a,
                _ => ranges.push((a - lo, b - a)),
            }
        }
        ranges
    }
}

/// Decoupled-weight-decay Adam (Loshchilov & Hutter), the arithmetic of `torch.optim.AdamW`'s single-tensor
/// path, on this rank's shard of the flat parameters. Moments and master weights are fp32 whatever the model's
/// dtype, so small updates are not lost to bf16 rounding; the model holds the rounded copy.
pub struct AdamW {
    params: Vec<(String, Tensor)>,
    layout: FlatLayout,
    comm: Comm,
    /// `[padded]` f32 work buffer: the flattened gradients going into the reduce-scatter, then (with several
    /// ranks) the updated parameters coming out of the all-gather. Not state.
    flat: Tensor,
    /// `[shard]` f32: this rank's share of the summed, clipped gradient (filled by [`AdamW::clip_grad_norm`])
    grad: Tensor,
    /// whether `grad` holds the current gradients (the last `clip_grad_norm` came after the last step)
    reduced: bool,
    /// `[shard]` f32 master weights of this rank's shard (padding stays zero)
    master: Tensor,
    /// `[shard]` first and second moments
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    /// the step count as the fused kernel reads it: a float32 scalar on the shard's device
    step_count: Tensor,
    decaying: Vec<(i64, i64)>,
    /// optimizer steps taken (the bias-correction exponent)
    pub step: u64,
    betas: (f64, f64),
    eps: f64,
    weight_decay: f64,
}

impl AdamW {
    /// An optimizer for one rank alone.
    pub fn new(params: Vec<(String, Tensor)>, cfg: &OptimConfig) -> Result<Self, OptimError> {
        Self::sharded(params, cfg, Comm::Solo)
    }

    /// An optimizer whose state is sharded over the ranks of `comm`. Every rank must hold the same parameters
    /// (same names, shapes and values) in the same order.
    pub fn sharded(params: Vec<(String, Tensor)>, cfg: &OptimConfig, comm: Comm) -> Result<Self, OptimError> {
        let layout = FlatLayout::new(&params, comm.rank(), comm.world());
        let device = params.first().map_or(Device::Cpu, |(_, p)| p.device());
        let opts = (Kind::Float, device);
        let flat = Tensor::f_zeros([layout.padded], opts)?;
        let master = tch::no_grad(|| -> Result<Tensor, OptimError> {
            let full = Tensor::f_zeros([layout.padded], opts)?;
            for ((_, p), slot) in params.iter().zip(&layout.slots) {
                full.f_narrow(0, slot.offset, slot.numel)?.f_copy_(&p.f_detach()?.f_reshape([-1])?)?;
            }
            Ok(full.f_narrow(0, layout.start, layout.shard)?.f_contiguous()?.f_detach_copy()?)
        })?;
        Ok(Self {
            decaying: layout.decaying_ranges(),
            grad: Tensor::f_zeros([layout.shard], opts)?,
            reduced: false,
            exp_avg: Tensor::f_zeros([layout.shard], opts)?,
            exp_avg_sq: Tensor::f_zeros([layout.shard], opts)?,
            step_count: Tensor::f_zeros([], opts)?,
            master,
            flat,
            params,
            layout,
            comm,
            step: 0,
            betas: (cfg.betas[0], cfg.betas[1]),
            eps: cfg.eps,
            weight_decay: cfg.weight_decay,
        })
    }

    pub fn layout(&self) -> &FlatLayout {
        &self.layout
    }

    /// Bytes of optimizer state this rank holds (fp32 master weights and both moments of its shard).
    pub fn state_bytes(&self) -> u64 {
        3 * 4 * self.layout.shard as u64
    }

    pub fn zero_grad(&mut self) {
        for (_, p) in &mut self.params {
            let mut grad = p.grad();
            if grad.defined() {
                let _ = grad.detach_().zero_();
            }
        }
        self.reduced = false;
    }

    /// The gradients summed over the ranks into this rank's shard; returns the global L2 norm (one scalar
    /// all-reduce of the shards' squared norms).
    fn reduce(&mut self) -> Result<f64, OptimError> {
        tch::no_grad(|| -> Result<(), OptimError> {
            for ((_, p), slot) in self.params.iter().zip(&self.layout.slots) {
                let grad = p.grad();
                let mut dst = self.flat.f_narrow(0, slot.offset, slot.numel)?;
                if grad.defined() {
                    dst.f_copy_(&grad.f_reshape([-1])?)?;
                } else {
                    let _ = dst.f_zero_()?;
                }
            }
            if self.layout.padded > self.layout.total {
                let _ = self.flat.f_narrow(0, self.layout.total, self.layout.padded - self.layout.total)?.f_zero_()?;
            }
            Ok(())
        })?;
        self.comm.reduce_scatter_sum(&mut self.grad, &self.flat)?;
        self.reduced = true;
        let mut squares = [f64::try_from(self.grad.f_square()?.f_sum(Kind::Double)?)?];
        // on the gradients' device: NCCL reduces device memory only
        self.comm.all_reduce_f64(&mut squares, self.grad.device())?;
        Ok(squares[0].sqrt())
    }

    /// Global L2 norm of all gradients (over every rank's contribution), before clipping.
    pub fn grad_norm(&mut self) -> Result<f64, OptimError> {
        self.reduce()
    }

    /// Sums the gradients over the ranks and scales them so their global norm is at most `max_norm` (torch
    /// `clip_grad_norm_`: coefficient `max_norm / (norm + 1e-6)`, applied only when below 1); returns the norm
    /// before clipping. Every rank must call it (it is a collective), then [`AdamW::step`].
    pub fn clip_grad_norm(&mut self, max_norm: f64) -> Result<f64, OptimError> {
        let norm = self.reduce()?;
        if max_norm > 0.0 && norm.is_finite() {
            let coef = max_norm / (norm + 1e-6);
            if coef < 1.0 {
                let _ = self.grad.f_mul_scalar_(coef)?;
            }
        }
        Ok(norm)
    }

    /// One AdamW update at learning rate `lr` on the gradients [`AdamW::clip_grad_norm`] reduced (reduced here
    /// when it was not called), then the updated parameters gathered into every rank's model.
    pub fn step(&mut self, lr: f64) -> Result<(), OptimError> {
        if !self.reduced {
            self.reduce()?;
        }
        self.step += 1;
        tch::no_grad(|| -> Result<(), OptimError> {
            if self.weight_decay > 0.0 {
                for &(start, len) in &self.decaying {
                    let _ = self.master.f_narrow(0, start, len)?.f_mul_scalar_(1.0 - lr * self.weight_decay)?;
                }
            }
            // The moments and the update in one pass of ATen's fused AdamW (torch.optim.AdamW(fused=True)), the
            // decay applied above per parameter group; the step count is written on the device (no sync).
            let _ = self.step_count.f_fill_(self.step as f64)?;
            let settings = AdamWStep { lr, beta1: self.betas.0, beta2: self.betas.1, weight_decay: 0.0, eps: self.eps };
            fused_adamw(
                &mut self.master,
                &self.grad,
                &mut self.exp_avg,
                &mut self.exp_avg_sq,
                &self.step_count,
                settings,
            )
            .map_err(|e| OptimError::State(e.to_string()))?;
            Ok(())
        })?;
        self.reduced = false;
        self.scatter_master_into_params()
    }

    /// Every rank's master shard into every rank's parameters (rounded to the parameters' dtype).
    fn scatter_master_into_params(&mut self) -> Result<(), OptimError> {
        let full = if self.comm.world() == 1 {
            self.master.shallow_clone()
        } else {
            self.comm.all_gather(&mut self.flat, &self.master)?;
            self.flat.shallow_clone()
        };
        tch::no_grad(|| -> Result<(), OptimError> {
            for ((_, p), slot) in self.params.iter_mut().zip(&self.layout.slots) {
                p.f_copy_(&full.f_narrow(0, slot.offset, slot.numel)?.f_view_as(p)?)?;
            }
            Ok(())
        })
    }

    /// This rank's state as flat tensors for its checkpoint shard: `exp_avg`, `exp_avg_sq`, `master`, each the
    /// `[shard]` slice of the flat index space starting at `layout().start`. The step count is saved by the caller.
    pub fn state_tensors(&self) -> Vec<(String, Tensor)> {
        vec![
            ("exp_avg".into(), self.exp_avg.shallow_clone()),
            ("exp_avg_sq".into(), self.exp_avg_sq.shallow_clone()),
            ("master".into(), self.master.shallow_clone()),
        ]
    }

    /// This rank's `[shard]` slice of a `[total]` tensor of the flat index space (padding zero).
    pub fn shard_of_full(&self, full: &Tensor) -> Result<Tensor, OptimError> {
        if full.numel() as i64 != self.layout.total {
            return Err(OptimError::State(format!(
                "saved state of {} elements for parameters of {}: saved for another model",
                full.numel(),
                self.layout.total
            )));
        }
        let padded = Tensor::f_zeros([self.layout.padded], (Kind::Float, full.device()))?;
        padded.f_narrow(0, 0, self.layout.total)?.f_copy_(&full.f_reshape([-1])?)?;
        Ok(padded.f_narrow(0, self.layout.start, self.layout.shard)?.f_contiguous()?)
    }

    /// Restores this rank's state from its `[shard]` slices of `exp_avg`, `exp_avg_sq` and `master` (however many
    /// ranks saved them); the master weights are gathered into every rank's (rounded) model parameters, so every
    /// rank must call it.
    pub fn load_shard_state(&mut self, shard: &BTreeMap<String, Tensor>, step: u64) -> Result<(), OptimError> {
        for (name, dst) in
            [("exp_avg", &mut self.exp_avg), ("exp_avg_sq", &mut self.exp_avg_sq), ("master", &mut self.master)]
        {
            let src = shard.get(name).ok_or_else(|| OptimError::State(format!("no {name} in the saved state")))?;
            if src.numel() as i64 != self.layout.shard {
                return Err(OptimError::State(format!(
                    "{name}: {} elements for a shard of {}",
                    src.numel(),
                    self.layout.shard
                )));
            }
            tch::no_grad(|| dst.f_copy_(&src.f_reshape([-1])?))?;
        }
        self.step = step;
        self.reduced = false;
        self.scatter_master_into_params()
    }

    /// [`AdamW::load_shard_state`] from the whole `[total]` flat state.
    pub fn load_full_state(&mut self, full: &BTreeMap<String, Tensor>, step: u64) -> Result<(), OptimError> {
        let mut shard = BTreeMap::new();
        for name in ["exp_avg", "exp_avg_sq", "master"] {
            let t = full.get(name).ok_or_else(|| OptimError::State(format!("no {name} in the saved state")))?;
            shard.insert(name.to_string(), self.shard_of_full(t)?);
        }
        self.load_shard_state(&shard, step)
    }

    /// The whole flat state (`[total]` each) from the checkpoint format of one rank before sharding: tensors named
    /// `exp_avg.<param>`, `exp_avg_sq.<param>` and, for parameters held below fp32, `master.<param>`.
    pub fn full_state_from_named(
        &self,
        tensors: Vec<(String, Tensor)>,
    ) -> Result<BTreeMap<String, Tensor>, OptimError> {
        let named: BTreeMap<String, Tensor> = tensors.into_iter().collect();
        let params: BTreeMap<&str, &Tensor> = self.params.iter().map(|(n, t)| (n.as_str(), t)).collect();
        for name in named.keys() {
            let param = ["exp_avg_sq.", "exp_avg.", "master."].iter().find_map(|p| name.strip_prefix(p));
            match param {
                Some(param) if params.contains_key(param) => {}
                Some(param) => return Err(OptimError::State(format!("state for unknown parameter {param}"))),
                None => return Err(OptimError::State(format!("unexpected tensor {name}"))),
            }
        }
        let mut out = BTreeMap::new();
        for prefix in ["exp_avg", "exp_avg_sq", "master"] {
            let full = Tensor::f_zeros([self.layout.total], (Kind::Float, Device::Cpu))?;
            for ((name, p), slot) in self.params.iter().zip(&self.layout.slots) {
                let value = match named.get(&format!("{prefix}.{name}")) {
                    Some(t) => t.shallow_clone(),
                    // fp32 parameters kept no master: the parameter is it; moments absent: never stepped
                    None if prefix == "master" => p.f_detach()?.f_to_device(Device::Cpu)?,
                    None => continue,
                };
                if value.numel() as i64 != slot.numel {
                    return Err(OptimError::State(format!(
                        "{prefix}.{name} has shape {:?}, the parameter has {:?}",
                        value.size(),
                        p.size()
                    )));
                }
                tch::no_grad(|| full.f_narrow(0, slot.offset, slot.numel)?.f_copy_(&value.f_reshape([-1])?))?;
            }
            out.insert(prefix.to_string(), full);
        }
        Ok(out)
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

// The optimizer's part of a checkpoint directory: the file layout (names, `optimizer.json`) is `checkpoint`'s, the
// re-sharding from any saved world size onto this rank's slice of the flat space is the layout's, here.

/// Writes this rank's optimizer shard into a model directory of a checkpoint (`actor/`, `critic/`); rank 0 also
/// writes `optimizer.json`.
pub fn save_optimizer(dir: &Path, optim: &AdamW, rank: usize, world: usize) -> Result<(), CheckpointError> {
    std::fs::create_dir_all(dir).map_err(|e| CheckpointError::io(dir, e))?;
    write_tensors(&dir.join(optimizer_shard_file(rank, world)), &optim.state_tensors())?;
    if rank == 0 {
        let meta = OptimizerMeta { step: optim.step, world_size: world as u32, numel: optim.layout().total };
        write_json(&dir.join(OPTIMIZER_META_FILE), &meta)?;
    }
    Ok(())
}

/// Restores an optimizer's state from a model directory of a checkpoint, whatever world size saved it: this rank
/// reads the shard files that overlap its own shard (one, when the world size is the same) and takes its slice. A
/// missing or malformed file fails with its path. Every rank must call it (the parameters are gathered).
pub fn load_optimizer(dir: &Path, optim: &mut AdamW) -> Result<(), OptimError> {
    let meta: OptimizerMeta = read_json(&dir.join(OPTIMIZER_META_FILE))?;
    let layout = optim.layout().clone();
    let state = if meta.numel == 0 {
        let tensors = read_tensors(&dir.join(OPTIMIZER_FILE))?;
        let full = optim.full_state_from_named(tensors)?;
        let mut shard = std::collections::BTreeMap::new();
        for (name, t) in &full {
            shard.insert(name.clone(), optim.shard_of_full(t)?);
        }
        shard
    } else {
        if meta.numel != layout.total {
            return Err(OptimError::Checkpoint(CheckpointError::format(
                &dir.join(OPTIMIZER_META_FILE),
                format!("optimizer state of {} elements; this model has {} parameters", meta.numel, layout.total),
            )));
        }
        let saved_world = i64::from(meta.world_size.max(1));
        let saved_shard = (meta.numel + saved_world - 1) / saved_world;
        // this rank's elements of the flat space, without its padding
        let (lo, hi) = (layout.start.min(layout.total), (layout.start + layout.shard).min(layout.total));
        let mut shard: std::collections::BTreeMap<String, Tensor> = std::collections::BTreeMap::new();
        for name in ["exp_avg", "exp_avg_sq", "master"] {
            shard.insert(
                name.to_string(),
                Tensor::f_zeros([layout.shard], (Kind::Float, Device::Cpu)).map_err(CheckpointError::from)?,
            );
        }
        for r in 0..saved_world {
            let (a, b) = ((r * saved_shard).max(lo), ((r + 1) * saved_shard).min(hi));
            if a >= b {
                continue;
            }
            let path = dir.join(optimizer_shard_file(r as usize, saved_world as usize));
            if !path.exists() {
                return Err(OptimError::Checkpoint(CheckpointError::format(
                    &path,
                    format!("missing: the optimizer was saved by {saved_world} ranks, one shard file each"),
                )));
            }
            let saved: std::collections::BTreeMap<String, Tensor> = read_tensors(&path)?.into_iter().collect();
            for (name, dst) in shard.iter_mut() {
                let src = saved.get(name).ok_or_else(|| {
                    OptimError::Checkpoint(CheckpointError::format(&path, format!("has no tensor {name}")))
                })?;
                if src.numel() as i64 != saved_shard {
                    return Err(OptimError::Checkpoint(CheckpointError::format(
                        &path,
                        format!(
                            "{name} has {} elements, a shard of {saved_world} ranks has {saved_shard}",
                            src.numel()
                        ),
                    )));
                }
                let piece = src.f_narrow(0, a - r * saved_shard, b - a).map_err(CheckpointError::from)?;
                dst.f_narrow(0, a - layout.start, b - a)
                    .and_then(|mut d| d.f_copy_(&piece))
                    .map_err(CheckpointError::from)?;
            }
        }
        shard
    };
    optim.load_shard_state(&state, meta.step)?;
    Ok(())
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
        let clipped = f64::try_from(opt.grad.norm()).unwrap();
        assert!((clipped - 1.0).abs() < 1e-4, "{clipped}");
    }

    /// Updates far below bf16's resolution at 1.0 (2^-8) must accumulate in the fp32 master, and show up in
    /// the bf16 parameter once they add up.
    #[test]
    fn bf16_parameters_accumulate_small_updates_in_fp32_master_weights() {
        let w = Tensor::ones([2, 2], (Kind::BFloat16, tch::Device::Cpu)).set_requires_grad(true);
        let cfg = OptimConfig { lr: 1e-3, weight_decay: 0.0, ..OptimConfig::default() };
        let mut opt = AdamW::new(vec![("w".into(), w.shallow_clone())], &cfg).unwrap();
        for _ in 0..20 {
            opt.zero_grad();
            w.sum(Kind::Float).backward();
            opt.step(1e-3).unwrap();
        }
        let master = opt.state_tensors().into_iter().find(|(n, _)| n == "master").unwrap().1;
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
                    opt.load_full_state(&state, step).unwrap();
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
        let err = opt.full_state_from_named(vec![("exp_avg.v".into(), Tensor::zeros([2], (Kind::Float, Device::Cpu)))]);
        assert!(matches!(err, Err(OptimError::State(_))));
        let short = BTreeMap::from([("exp_avg".to_string(), Tensor::zeros([3], (Kind::Float, Device::Cpu)))]);
        assert!(matches!(opt.load_full_state(&short, 1), Err(OptimError::State(_))));
    }

    #[test]
    fn the_flat_layout_pads_to_the_world_and_gives_each_rank_its_decaying_ranges() {
        let params = vec![
            ("a".to_string(), Tensor::zeros([2, 3], (Kind::Float, Device::Cpu))),
            ("b".to_string(), Tensor::zeros([5], (Kind::Float, Device::Cpu))),
        ];
        let l0 = FlatLayout::new(&params, 0, 2);
        let l1 = FlatLayout::new(&params, 1, 2);
        assert_eq!((l0.total, l0.padded, l0.shard, l0.start, l1.start), (11, 12, 6, 0, 6));
        assert_eq!(l0.decaying_ranges(), vec![(0, 6)]);
        assert!(l1.decaying_ranges().is_empty());
        let l = FlatLayout::new(&params, 1, 4);
        assert_eq!((l.shard, l.start, l.decaying_ranges()), (3, 3, vec![(0, 3)]));
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
