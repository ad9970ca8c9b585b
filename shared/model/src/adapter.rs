//! What a LoRA adapter is ([`LoraSpec`]) and the state it leaves on a model: one [`Adapter`] per adapted linear
//! layer and the model's [`LoraState`]. A leaf that the layers and the model import; the adapter operations on
//! [`crate::CausalLm`] live in `lora`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tch::nn::VarStore;
use tch::Tensor;

use crate::error::{ModelError, Result};

/// Which linear layers get adapters (PEFT's `target_modules`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Targets {
    /// every linear layer of the decoder (not the LM head), as PEFT's `all-linear`
    AllLinear,
    /// module names: a module is adapted when its full name equals one or ends with `.` + one (PEFT's rule)
    Names(Vec<String>),
}

/// What a LoRA adapter is: rank, scale and the layers it adapts.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraSpec {
    pub rank: i64,
    pub alpha: f64,
    pub targets: Targets,
    /// module names left out even when `targets` names them (PEFT's `exclude_modules`, same matching rule)
    pub exclude: Vec<String>,
    /// scale by `alpha / sqrt(rank)` instead of `alpha / rank` (PEFT's `use_rslora`)
    pub use_rslora: bool,
}

impl LoraSpec {
    pub fn new(rank: i64, alpha: f64, targets: Targets, exclude: Vec<String>) -> Self {
        Self { rank, alpha, targets, exclude, use_rslora: false }
    }

    /// The factor of `B A` in the forward pass.
    pub fn scale(&self) -> f64 {
        if self.use_rslora {
            self.alpha / (self.rank as f64).sqrt()
        } else {
            self.alpha / self.rank as f64
        }
    }

    fn check(&self) -> Result<()> {
        if self.rank <= 0 || !self.alpha.is_finite() || self.alpha <= 0.0 {
            return Err(ModelError::Config(format!(
                "a LoRA adapter needs rank >= 1 and alpha > 0, got rank {} and alpha {}",
                self.rank, self.alpha
            )));
        }
        if matches!(&self.targets, Targets::Names(names) if names.is_empty()) {
            return Err(ModelError::Config("LoRA target_modules names no module".into()));
        }
        Ok(())
    }

    /// The full names of the modules this spec adapts among `modules` (the model's linear layers), in order.
    /// A target or exclude name that matches none of them is refused with the names the model has.
    pub fn resolve(&self, modules: &[String]) -> Result<Vec<String>> {
        self.check()?;
        let matches = |module: &str, name: &str| module == name || module.ends_with(&format!(".{name}"));
        let unknown = |names: &[String], what: &str| -> Result<()> {
            if let Some(bad) = names.iter().find(|n| !modules.iter().any(|m| matches(m, n))) {
                let mut short: Vec<&str> = modules.iter().filter_map(|m| m.rsplit('.').next()).collect();
                short.sort_unstable();
                short.dedup();
                return Err(ModelError::Config(format!(
                    "LoRA {what} `{bad}` names no linear layer of this model; it has {} (or `all-linear`)",
                    short.join(", ")
                )));
            }
            Ok(())
        };
        if let Targets::Names(names) = &self.targets {
            unknown(names, "target_modules")?;
        }
        unknown(&self.exclude, "exclude_modules")?;
        let chosen: Vec<String> = modules
            .iter()
            .filter(|m| match &self.targets {
                Targets::AllLinear => true,
                Targets::Names(names) => names.iter().any(|n| matches(m, n)),
            })
            .filter(|m| !self.exclude.iter().any(|n| matches(m, n)))
            .cloned()
            .collect();
        if chosen.is_empty() {
            return Err(ModelError::Config("LoRA: exclude_modules leaves no module to adapt".into()));
        }
        Ok(chosen)
    }
}

/// One linear layer's adapter (on the layer itself).
#[derive(Debug)]
pub(crate) struct Adapter {
    /// `[r, in]`, f32
    pub(crate) a: Tensor,
    /// `[out, r]`, f32
    pub(crate) b: Tensor,
    pub(crate) scale: f64,
    pub(crate) enabled: Arc<AtomicBool>,
}

impl Adapter {
    /// `base + scale · (x Aᵀ) Bᵀ`, computed in the adapter's dtype and cast back to the base output's.
    pub(crate) fn add_to(&self, x: &Tensor, base: Tensor) -> Result<Tensor> {
        if !self.enabled.load(Ordering::Relaxed) {
            return Ok(base);
        }
        let kind = base.kind();
        let delta =
            x.f_to_kind(self.a.kind())?.f_linear(&self.a, None::<&Tensor>)?.f_linear(&self.b, None::<&Tensor>)?;
        Ok(base.f_add(&delta.f_mul_scalar(self.scale)?)?.f_to_kind(kind)?)
    }
}

/// The adapters a model carries.
#[derive(Debug)]
pub(crate) struct LoraState {
    pub(crate) spec: LoraSpec,
    /// the adapted modules' full names, in the model's order
    pub(crate) modules: Vec<String>,
    /// `A` and `B` of every adapted module, named `<module>.lora_A.weight` / `<module>.lora_B.weight`, f32
    pub(crate) vs: VarStore,
    pub(crate) enabled: Arc<AtomicBool>,
}
