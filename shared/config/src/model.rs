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
        validate_lora("model", self.lora_rank, self.lora_alpha, &self.target_modules, self.exclude_modules.as_ref())
    }
}

/// The LoRA keys under `section` (`model`, `critic.model`): alpha and the module names, when `rank` is not 0.
pub(crate) fn validate_lora(
    section: &str,
    rank: u32,
    alpha: f64,
    target_modules: &ModuleList,
    exclude_modules: Option<&ModuleList>,
) -> Result<(), ConfigError> {
    if rank == 0 {
        return Ok(());
    }
    let key = |name: &str| format!("{section}.{name}");
    ensure(alpha.is_finite() && alpha > 0.0, &key("lora_alpha"), "must be > 0")?;
    let targets = target_modules.names();
    ensure(!targets.is_empty(), &key("target_modules"), "names no module (use all-linear or a list)")?;
    ensure(
        !target_modules.is_all_linear() || targets.len() == 1,
        &key("target_modules"),
        "is all-linear or a list of module names, not both",
    )?;
    // every name must end in a linear layer the decoders have; the model, once loaded, checks the whole name
    for (name, list) in [("target_modules", Some(target_modules)), ("exclude_modules", exclude_modules)] {
        let names = list.map(ModuleList::names).unwrap_or_default();
        for module in names.iter().filter(|n| *n != "all-linear") {
            let last = module.rsplit('.').next().unwrap_or(module);
            ensure(
                LINEAR_MODULES.contains(&last),
                &key(name),
                format!(
                    "`{module}` names no linear layer of a Qwen2, Llama or Qwen3 decoder; they are {} (or all-linear)",
                    LINEAR_MODULES.join(", ")
                ),
            )?;
        }
    }
    Ok(())
}

/// verl's `critic.model.*` that jetrl reads: LoRA on the critic's trunk (the trunk is `model.path`'s model). The
/// value head trains in full beside the adapters, as PEFT's `modules_to_save` does for verl's `TOKEN_CLS` critic.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CriticModelConfig {
    /// LoRA rank of the critic's trunk (verl `critic.model.lora_rank`; 0 = the whole critic trains): the trunk
    /// stays frozen, f32 adapters and the value head train, and checkpoints carry the adapters and the head only
    /// (PEFT's layout, `critic/lora_adapter/`)
    pub lora_rank: u32,
    /// LoRA alpha (verl `critic.model.lora_alpha`): the adapter's output is scaled by alpha / rank
    pub lora_alpha: f64,
    /// the trunk's linear layers that get adapters (verl `critic.model.target_modules`): `all-linear` (every
    /// linear layer of the decoder; the value head is never one) or a list of module names as PEFT matches them
    pub target_modules: ModuleList,
}

impl Default for CriticModelConfig {
    fn default() -> Self {
        Self { lora_rank: 0, lora_alpha: 16.0, target_modules: ModuleList::One("all-linear".into()) }
    }
}

impl CriticModelConfig {
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        validate_lora("critic.model", self.lora_rank, self.lora_alpha, &self.target_modules, None)
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
