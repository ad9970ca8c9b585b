//! The model (`model.*`): where it is, its precision and device, LoRA and the memory levers.

use serde::{Deserialize, Serialize};

use crate::{ensure, ConfigError, DeviceSpec, ModelDtype, ModelPreset};

/// The policy model (an HF model directory).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// HF-format directory: config.json, *.safetensors, tokenizer.json
    pub path: String,
    /// if set and `path` has no model, `jetrl run` writes a random-init model of this preset there
    pub init_preset: Option<ModelPreset>,
    /// `cpu`, `cuda`, `cuda:N` or `auto`
    pub device: DeviceSpec,
    pub dtype: ModelDtype,
    /// recompute each decoder layer's activations in the backward pass instead of keeping them (verl
    /// `actor_rollout_ref.model.enable_gradient_checkpointing`; here for the actor and the critic): less memory
    /// per micro-batch, about one more forward pass of compute per update
    pub enable_gradient_checkpointing: bool,
    /// pack each micro-batch's sequences end to end in one row, without padding, in the trainer's forward passes
    /// (verl `actor_rollout_ref.model.use_remove_padding`; the actor, π_old / reference log-probs and the critic):
    /// the same log-probs and values, no compute spent on padding
    pub use_remove_padding: bool,
    /// LoRA rank (verl `actor_rollout_ref.model.lora_rank`; 0 = full fine-tuning): the base stays frozen in
    /// `dtype`, f32 adapters train, the reference policy is the base with the adapters off, and weight sync and
    /// checkpoints carry the adapters only (PEFT's layout, `actor/lora_adapter/`)
    pub lora_rank: u32,
    /// LoRA alpha (verl `actor_rollout_ref.model.lora_alpha`): the adapter's output is scaled by alpha / rank
    pub lora_alpha: f64,
    /// the linear layers that get adapters (verl `actor_rollout_ref.model.target_modules`): `all-linear` or a
    /// list of module names as PEFT matches them (`q_proj`, `self_attn.o_proj`, ...)
    pub target_modules: ModuleList,
    /// modules left without adapters (verl `actor_rollout_ref.model.exclude_modules`), same matching
    pub exclude_modules: Option<ModuleList>,
    /// start from this PEFT adapter directory instead of a new adapter (verl
    /// `actor_rollout_ref.model.lora_adapter_path`); its rank and alpha must be `lora_rank` and `lora_alpha`
    pub lora_adapter_path: Option<String>,
}

/// The linear layers of every decoder jetrl loads (what LoRA can adapt).
pub const LINEAR_MODULES: [&str; 7] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"];

/// Module names as PEFT and verl take them: one string (`all-linear`, or one name) or a list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ModuleList {
    One(String),
    Many(Vec<String>),
}

impl ModuleList {
    /// The names, `all-linear` included as a name.
    pub fn names(&self) -> Vec<String> {
        match self {
            Self::One(name) => vec![name.clone()],
            Self::Many(names) => names.clone(),
        }
    }

    /// Whether this is PEFT's `all-linear`.
    pub fn is_all_linear(&self) -> bool {
        self.names().iter().any(|n| n == "all-linear")
    }
}

impl ModelConfig {
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        if self.lora_rank == 0 {
            return Ok(());
        }
        ensure(self.lora_alpha.is_finite() && self.lora_alpha > 0.0, "model.lora_alpha", "must be > 0")?;
        let targets = self.target_modules.names();
        ensure(!targets.is_empty(), "model.target_modules", "names no module (use all-linear or a list)")?;
        ensure(
            !self.target_modules.is_all_linear() || targets.len() == 1,
            "model.target_modules",
            "is all-linear or a list of module names, not both",
        )?;
        // every name must end in a linear layer the decoders have; the model, once loaded, checks the whole name
        let lists = [
            ("model.target_modules", Some(&self.target_modules)),
            ("model.exclude_modules", self.exclude_modules.as_ref()),
        ];
        for (key, list) in lists {
            let names = list.map(ModuleList::names).unwrap_or_default();
            for name in names.iter().filter(|n| *n != "all-linear") {
                let last = name.rsplit('.').next().unwrap_or(name);
                ensure(
                    LINEAR_MODULES.contains(&last),
                    key,
                    format!(
                        "`{name}` names no linear layer of a Qwen2, Llama or Qwen3 decoder; they are {} (or all-linear)",
                        LINEAR_MODULES.join(", ")
                    ),
                )?;
            }
        }
        Ok(())
    }
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            path: "runs/models/tiny".into(),
            init_preset: None,
            device: DeviceSpec::Cpu,
            dtype: ModelDtype::F32,
            enable_gradient_checkpointing: false,
            use_remove_padding: false,
            lora_rank: 0,
            lora_alpha: 16.0,
            target_modules: ModuleList::One("all-linear".into()),
            exclude_modules: None,
            lora_adapter_path: None,
        }
    }
}
