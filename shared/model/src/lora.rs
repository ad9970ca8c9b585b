//! LoRA adapters in PEFT's layout: a frozen base in the model's dtype, and for each adapted linear layer two
//! f32 matrices `A` `[r, in]` and `B` `[out, r]` so that `y = x Wᵀ + b + (α/r)·(x Aᵀ) Bᵀ` (PEFT's `Linear`
//! forward: the input cast to the adapter's dtype, the sum cast back to the base output's).
//!
//! - Training: [`CausalLm::add_lora`] attaches adapters (PEFT's initialisation: `A` Kaiming-uniform, `B` zero, so a
//!   new adapter changes nothing) in their own `VarStore` and freezes the base; [`CausalLm::set_lora_enabled`]
//!   switches them off for the reference policy (the base, with no second copy of the model).
//! - Files: [`CausalLm::save_lora`] / [`CausalLm::load_lora`] read and write an `adapter_config.json` and
//!   `adapter_model.safetensors` that `peft.PeftModel.from_pretrained` loads (keys
//!   `base_model.model.<module>.lora_A.weight`).
//! - Weight sync: [`CausalLm::lora_to_safetensors_bytes`] is what a trainer publishes per version; a rollout
//!   engine merges it into its working weights with a [`LoraMerger`], which keeps the base weights of the adapted
//!   layers on the host (decode then runs the plain fused model: no adapter matmuls per token).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use serde_json::{json, Value};
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

use crate::adapter::{Adapter, LoraState};
pub use crate::adapter::{LoraSpec, Targets};
use crate::decoder::FeedForward;
use crate::error::{ModelError, Result};
use crate::layers::{Linear, Mlp};
use crate::model::CausalLm;
use crate::weights;

/// The adapter config file of a PEFT adapter directory.
pub const ADAPTER_CONFIG_FILE: &str = "adapter_config.json";
/// The adapter weights file of a PEFT adapter directory.
pub const ADAPTER_WEIGHTS_FILE: &str = "adapter_model.safetensors";
/// The prefix PEFT's `PeftModelForCausalLM` puts before the base model's module names in saved keys.
const PEFT_PREFIX: &str = "base_model.model.";

/// What a PEFT `adapter_config.json` says, as far as jetrl reads it.
#[derive(Debug, Clone)]
pub struct AdapterConfig {
    pub spec: LoraSpec,
    pub base_model_name_or_path: Option<String>,
    /// the modules the adapter trains in full beside its LoRA matrices (PEFT's `modules_to_save`; a `TOKEN_CLS`
    /// adapter lists its classifier heads, `score` among them)
    pub modules_to_save: Vec<String>,
}

impl AdapterConfig {
    /// Reads `dir/adapter_config.json`, refusing what jetrl's adapters cannot represent (DoRA, bias training,
    /// per-layer ranks, `fan_in_fan_out`, `layers_to_transform`, a regex target) with the key that asked for it.
    pub fn read(dir: &Path) -> Result<Self> {
        let path = dir.join(ADAPTER_CONFIG_FILE);
        let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
        let value: Value = serde_json::from_str(&text).map_err(|e| ModelError::json(path.display().to_string(), e))?;
        let bad = |key: &str, why: &str| ModelError::Config(format!("{}: `{key}` {why}", path.display()));
        let peft_type = value.get("peft_type").and_then(Value::as_str).unwrap_or("LORA");
        if peft_type != "LORA" {
            return Err(bad("peft_type", &format!("is {peft_type}; jetrl loads LORA adapters only")));
        }
        let rank = value.get("r").and_then(Value::as_i64).ok_or_else(|| bad("r", "is missing or not an integer"))?;
        let alpha = value
            .get("lora_alpha")
            .and_then(Value::as_f64)
            .ok_or_else(|| bad("lora_alpha", "is missing or not a number"))?;
        let targets = match value.get("target_modules") {
            Some(Value::String(s)) if s == "all-linear" => Targets::AllLinear,
            Some(Value::String(s)) => {
                return Err(bad("target_modules", &format!("is the pattern {s:?}; jetrl needs a list of module names")))
            }
            Some(Value::Array(items)) => {
                let mut names = items
                    .iter()
                    .map(|v| v.as_str().map(str::to_string))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| bad("target_modules", "must list strings"))?;
                names.sort();
                Targets::Names(names)
            }
            _ => return Err(bad("target_modules", "is missing")),
        };
        let exclude = match value.get("exclude_modules") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(items)) => items.iter().filter_map(|v| v.as_str().map(str::to_string)).collect(),
            Some(_) => return Err(bad("exclude_modules", "must be a list of module names")),
        };
        let truthy = |key: &str| value.get(key).and_then(Value::as_bool).unwrap_or(false);
        for key in ["use_dora", "fan_in_fan_out"] {
            if truthy(key) {
                return Err(bad(key, "is true; jetrl's adapters are plain LoRA on [out, in] weights"));
            }
        }
        if value.get("bias").and_then(Value::as_str).is_some_and(|b| b != "none") {
            return Err(bad("bias", "is not \"none\"; jetrl trains no biases with an adapter"));
        }
        for key in ["rank_pattern", "alpha_pattern"] {
            if value.get(key).and_then(Value::as_object).is_some_and(|m| !m.is_empty()) {
                return Err(bad(key, "sets per-layer values; jetrl needs one rank and alpha"));
            }
        }
        if value.get("layers_to_transform").is_some_and(|v| !v.is_null()) {
            return Err(bad("layers_to_transform", "is set; jetrl adapts whole modules only"));
        }
        let modules_to_save = match value.get("modules_to_save") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| v.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| bad("modules_to_save", "must list strings"))?,
            Some(_) => return Err(bad("modules_to_save", "must be a list of module names")),
        };
        let mut spec = LoraSpec::new(rank, alpha, targets, exclude);
        spec.use_rslora = truthy("use_rslora");
        let base_model_name_or_path = value.get("base_model_name_or_path").and_then(Value::as_str).map(str::to_string);
        Ok(Self { spec, base_model_name_or_path, modules_to_save })
    }
}

/// SplitMix64: the adapters' initialisation stream.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A uniform draw in [0, 1) from 53 random bits.
fn unit(bits: u64) -> f64 {
    (bits >> 11) as f64 / (1u64 << 53) as f64
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// The module a tensor belongs to (`score` of `score.weight`).
fn module_of(tensor: &str) -> &str {
    tensor.rsplit_once('.').map_or(tensor, |(module, _)| module)
}

/// The name of a module's adapter tensor (`which` is `lora_A` or `lora_B`).
fn tensor_name(module: &str, which: &str) -> String {
    format!("{module}.{which}.weight")
}

impl CausalLm {
    /// Every linear layer of the decoder that an adapter can target, with its full name
    /// (`model.layers.0.self_attn.q_proj`), in order. In an MoE layer these are each expert's projections
    /// (`mlp.experts.3.up_proj`) and the shared expert's; the router and the shared expert's gate are left alone.
    pub(crate) fn linears_mut(&mut self) -> Vec<(String, &mut Linear)> {
        fn mlp_linears<'a>(out: &mut Vec<(String, &'a mut Linear)>, prefix: &str, mlp: &'a mut Mlp) {
            for (name, linear) in
                [("gate_proj", &mut mlp.gate_proj), ("up_proj", &mut mlp.up_proj), ("down_proj", &mut mlp.down_proj)]
            {
                out.push((format!("{prefix}.{name}"), linear));
            }
        }
        let mut out = Vec::new();
        for (i, layer) in self.layers.iter_mut().enumerate() {
            let prefix = format!("model.layers.{i}");
            let attn = &mut layer.self_attn;
            for (name, linear) in [
                ("self_attn.q_proj", &mut attn.q_proj),
                ("self_attn.k_proj", &mut attn.k_proj),
                ("self_attn.v_proj", &mut attn.v_proj),
                ("self_attn.o_proj", &mut attn.o_proj),
            ] {
                out.push((format!("{prefix}.{name}"), linear));
            }
            match &mut layer.mlp {
                FeedForward::Dense(mlp) => mlp_linears(&mut out, &format!("{prefix}.mlp"), mlp),
                FeedForward::Sparse(moe) => {
                    for (e, expert) in moe.experts.iter_mut().enumerate() {
                        mlp_linears(&mut out, &format!("{prefix}.mlp.experts.{e}"), expert);
                    }
                    if let Some((shared, _)) = &mut moe.shared_expert {
                        mlp_linears(&mut out, &format!("{prefix}.mlp.shared_expert"), shared);
                    }
                }
            }
        }
        out
    }

    /// The full names of the decoder's linear layers.
    pub fn linear_modules(&mut self) -> Vec<String> {
        self.linears_mut().into_iter().map(|(name, _)| name).collect()
    }

    /// Attaches new adapters (`A` Kaiming-uniform as PEFT initialises it, `B` zero, so the model's outputs do not
    /// change) and freezes the base: from here the trainable parameters are the adapters'
    /// ([`Self::trainable_parameters`]). `A` is drawn from `seed` alone (not libtorch's process-wide
    /// generator), so every trainer rank, and a run and its repeat, start from the same adapter.
    pub fn add_lora_seeded(&mut self, spec: &LoraSpec, seed: u64) -> Result<()> {
        if self.lora.is_some() {
            return Err(ModelError::Config("the model already has a LoRA adapter".into()));
        }
        let modules = spec.resolve(&self.linear_modules())?;
        let device = self.device();
        let vs = VarStore::new(device);
        let enabled = Arc::new(AtomicBool::new(true));
        let scale = spec.scale();
        let root = vs.root();
        tch::no_grad(|| -> Result<()> {
            for (name, linear) in self.linears_mut() {
                if !modules.contains(&name) {
                    continue;
                }
                let [out_features, in_features] = <[i64; 2]>::try_from(linear.weight.size())
                    .map_err(|_| ModelError::Config(format!("{name}.weight is not a matrix")))?;
                let bound = 1.0 / (in_features as f64).sqrt();
                let mut state = seed ^ fnv1a(name.as_bytes());
                let values: Vec<f32> = (0..spec.rank * in_features)
                    .map(|_| ((2.0 * unit(splitmix64(&mut state)) - 1.0) * bound) as f32)
                    .collect();
                let a = Tensor::f_from_slice(&values)?.f_view([spec.rank, in_features])?.f_to_device(device)?;
                let b = Tensor::f_zeros([out_features, spec.rank], (Kind::Float, device))?;
                let mut path = &root / "model";
                for part in name.strip_prefix("model.").unwrap_or(&name).split('.') {
                    path = &path / part;
                }
                let a = (&path / "lora_A").add("weight", a, true);
                let b = (&path / "lora_B").add("weight", b, true);
                linear.lora = Some(Adapter { a, b, scale, enabled: enabled.clone() });
            }
            Ok(())
        })?;
        self.var_store_mut().freeze();
        self.lora = Some(LoraState { spec: spec.clone(), modules, vs, enabled });
        Ok(())
    }

    /// [`Self::add_lora_seeded`] with seed 0.
    pub fn add_lora(&mut self, spec: &LoraSpec) -> Result<()> {
        self.add_lora_seeded(spec, 0)
    }

    /// The adapter's spec and the modules it adapts, when the model has one.
    pub fn lora_spec(&self) -> Option<(&LoraSpec, &[String])> {
        self.lora.as_ref().map(|l| (&l.spec, l.modules.as_slice()))
    }

    /// The adapter tensors by name (`model.layers.0.self_attn.q_proj.lora_A.weight`), empty without an adapter.
    pub fn lora_parameters(&self) -> BTreeMap<String, Tensor> {
        self.lora.as_ref().map(|l| l.vs.variables().into_iter().collect()).unwrap_or_default()
    }

    /// What an optimizer trains: the adapters when the model has them, else every parameter.
    pub fn trainable_parameters(&self) -> BTreeMap<String, Tensor> {
        if self.lora.is_some() {
            self.lora_parameters()
        } else {
            self.parameters()
        }
    }

    /// Switches the adapters off (the base model: a LoRA run's reference policy) or on again.
    pub fn set_lora_enabled(&self, enabled: bool) {
        if let Some(lora) = &self.lora {
            lora.enabled.store(enabled, Ordering::Relaxed);
        }
    }

    /// The adapter tensors as one safetensors blob (f32, jetrl's names): what a trainer publishes per version.
    pub fn lora_to_safetensors_bytes(&self) -> Result<Vec<u8>> {
        let mut bytes = Vec::new();
        weights::write_safetensors(&self.lora_parameters(), None, &mut bytes)?;
        Ok(bytes)
    }

    /// Swaps in adapter tensors from [`Self::lora_to_safetensors_bytes`]' blob (the names exactly the adapter's).
    pub fn load_lora_bytes(&mut self, bytes: &[u8]) -> Result<()> {
        if self.lora.is_none() {
            return Err(ModelError::Config("LoRA weights for a model without an adapter".into()));
        }
        weights::load_bytes(&self.lora_parameters(), bytes)
    }

    /// Writes the adapter as PEFT does: `adapter_config.json` (with `base_model_name_or_path`) and
    /// `adapter_model.safetensors` (f32, keys `base_model.model.<module>.lora_A.weight`).
    pub fn save_lora(&self, dir: &Path, base_model_name_or_path: &str) -> Result<()> {
        self.save_lora_with_modules(dir, base_model_name_or_path, "CAUSAL_LM", &BTreeMap::new())
    }

    /// [`Self::save_lora`] for a PEFT model of `task_type` that also trains `modules_to_save` in full (tensors
    /// outside the model, by name: `score.weight`), as PEFT saves a `TOKEN_CLS` model's head: their tensors in
    /// `adapter_model.safetensors` as `base_model.model.score.weight`, their modules listed in `modules_to_save`.
    pub fn save_lora_with_modules(
        &self,
        dir: &Path,
        base_model_name_or_path: &str,
        task_type: &str,
        modules_to_save: &BTreeMap<String, Tensor>,
    ) -> Result<()> {
        let Some(lora) = &self.lora else {
            return Err(ModelError::Config("the model has no LoRA adapter to save".into()));
        };
        std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
        let peft_named = self.peft_named(modules_to_save);
        let path = dir.join(ADAPTER_WEIGHTS_FILE);
        let file = std::fs::File::create(&path).map_err(|e| ModelError::io(&path, e))?;
        weights::write_safetensors(&peft_named, None, std::io::BufWriter::new(file))?;
        let spec = &lora.spec;
        let mut targets: Vec<&str> = lora.modules.iter().filter_map(|m| m.rsplit('.').next()).collect();
        targets.sort_unstable();
        targets.dedup();
        let mut saved: Vec<&str> = modules_to_save.keys().map(|name| module_of(name)).collect();
        saved.dedup();
        // the modules themselves are recorded by their short names; `exclude_modules` keeps any layer-specific cut
        let config = json!({
            "peft_type": "LORA",
            "task_type": task_type,
            "base_model_name_or_path": base_model_name_or_path,
            "r": spec.rank,
            "lora_alpha": spec.alpha,
            "lora_dropout": 0.0,
            "target_modules": targets,
            "exclude_modules": if spec.exclude.is_empty() { Value::Null } else { json!(spec.exclude) },
            "bias": "none",
            "use_rslora": spec.use_rslora,
            "use_dora": false,
            "fan_in_fan_out": false,
            "init_lora_weights": true,
            "inference_mode": true,
            "modules_to_save": if saved.is_empty() { Value::Null } else { json!(saved) },
            "layers_to_transform": Value::Null,
            "rank_pattern": {},
            "alpha_pattern": {},
        });
        let config_path = dir.join(ADAPTER_CONFIG_FILE);
        let text = serde_json::to_string_pretty(&config).map_err(|e| ModelError::json("adapter_config.json", e))?;
        std::fs::write(&config_path, text + "\n").map_err(|e| ModelError::io(&config_path, e))
    }

    /// The adapter tensors and `modules_to_save`'s under the names PEFT saves them by (`base_model.model.…`).
    fn peft_named(&self, modules_to_save: &BTreeMap<String, Tensor>) -> BTreeMap<String, Tensor> {
        self.lora_parameters()
            .into_iter()
            .chain(modules_to_save.iter().map(|(name, t)| (name.clone(), t.shallow_clone())))
            .map(|(name, t)| (format!("{PEFT_PREFIX}{name}"), t))
            .collect()
    }

    /// Attaches the PEFT adapter saved in `dir` (see [`Self::save_lora`]; PEFT's own `save_pretrained` writes the
    /// same layout). Every tensor is checked before any is used. An adapter that trains modules in full
    /// (`modules_to_save`) is refused: a causal LM's has nowhere to put them.
    pub fn load_lora(&mut self, dir: &Path) -> Result<AdapterConfig> {
        self.load_lora_with_modules(dir, &BTreeMap::new())
    }

    /// [`Self::load_lora`] of an adapter saved with [`Self::save_lora_with_modules`] (or by PEFT, for a
    /// `TOKEN_CLS` model): `modules_to_save`'s tensors (outside the model, by name: `score.weight`) are read from
    /// the adapter file too. The config's `modules_to_save` must list each of their modules (it may list others
    /// the file holds no tensors of, as PEFT's classifier names); any tensor of the file that is neither an
    /// adapter's nor one of these is refused by name.
    pub fn load_lora_with_modules(
        &mut self,
        dir: &Path,
        modules_to_save: &BTreeMap<String, Tensor>,
    ) -> Result<AdapterConfig> {
        let config = AdapterConfig::read(dir)?;
        let config_path = dir.join(ADAPTER_CONFIG_FILE);
        let mut wanted: Vec<&str> = modules_to_save.keys().map(|name| module_of(name)).collect();
        wanted.dedup();
        if wanted.is_empty() && !config.modules_to_save.is_empty() {
            return Err(ModelError::Config(format!(
                "{}: `modules_to_save` is {:?}; this model has no module outside the adapted layers to load",
                config_path.display(),
                config.modules_to_save
            )));
        }
        if let Some(missing) = wanted.iter().find(|m| !config.modules_to_save.iter().any(|s| s == *m)) {
            return Err(ModelError::Config(format!(
                "{}: `modules_to_save` is {:?}, without `{missing}`, which this model trains in full",
                config_path.display(),
                config.modules_to_save
            )));
        }
        let path = dir.join(ADAPTER_WEIGHTS_FILE);
        let bytes = std::fs::read(&path).map_err(|e| ModelError::io(&path, e))?;
        self.add_lora(&config.spec)?;
        if let Err(e) = weights::load_bytes(&self.peft_named(modules_to_save), &bytes) {
            self.remove_lora();
            return Err(ModelError::Safetensors { location: path.display().to_string(), reason: e.to_string() });
        }
        Ok(config)
    }

    /// Drops the adapters and makes the base trainable again.
    fn remove_lora(&mut self) {
        for (_, linear) in self.linears_mut() {
            linear.lora = None;
        }
        self.lora = None;
        self.var_store_mut().unfreeze();
    }

    /// Folds the adapters into the base weights (`W += scale · B A`, computed in f32, stored in the model's
    /// dtype) and drops them: a plain model that `save` writes as an HF directory (`jetrl export --merge`).
    pub fn merge_lora(&mut self) -> Result<()> {
        if self.lora.is_none() {
            return Err(ModelError::Config("the model has no LoRA adapter to merge".into()));
        }
        tch::no_grad(|| -> Result<()> {
            for (_, linear) in self.linears_mut() {
                if let Some(adapter) = &linear.lora {
                    let delta = adapter.b.f_matmul(&adapter.a)?.f_mul_scalar(adapter.scale)?;
                    let merged = linear.weight.f_to_kind(Kind::Float)?.f_add(&delta)?;
                    linear.weight.f_copy_(&merged)?;
                }
            }
            Ok(())
        })?;
        self.remove_lora();
        Ok(())
    }
}

/// Keeps the base weights of a model's adapted layers (on the host) and writes `base + scale · B A` into the
/// model for each adapter version a trainer publishes: a rollout engine's way of applying adapter-only weight
/// sync without adapter matmuls in its decode step.
#[derive(Debug)]
pub struct LoraMerger {
    spec: LoraSpec,
    /// `(module, base weight on the host, [out, in])`
    base: Vec<(String, Tensor)>,
}

impl LoraMerger {
    /// Copies the base weights of the modules `spec` adapts in `model` to the host.
    pub fn new(model: &mut CausalLm, spec: &LoraSpec) -> Result<Self> {
        let modules = spec.resolve(&model.linear_modules())?;
        let mut base = Vec::with_capacity(modules.len());
        for (name, linear) in model.linears_mut() {
            if modules.contains(&name) {
                base.push((name, linear.weight.to(Device::Cpu).f_detach_copy()?));
            }
        }
        Ok(Self { spec: spec.clone(), base })
    }

    /// Bytes of base weights kept on the host.
    pub fn host_bytes(&self) -> u64 {
        self.base.iter().map(|(_, t)| (t.numel() * t.kind().elt_size_in_bytes()) as u64).sum()
    }

    /// Writes `base + scale · B A` into the model for the adapter in `bytes` (a blob of
    /// [`CausalLm::lora_to_safetensors_bytes`]). The blob is checked whole (names, shapes) before any weight is
    /// written.
    pub fn apply(&self, model: &mut CausalLm, bytes: &[u8]) -> Result<()> {
        let mut adapters = BTreeMap::new();
        for (name, base) in &self.base {
            let size = base.size();
            let (out_features, in_features) = (size[0], size[1]);
            adapters.insert(
                tensor_name(name, "lora_A"),
                Tensor::f_zeros([self.spec.rank, in_features], (Kind::Float, Device::Cpu))?,
            );
            adapters.insert(
                tensor_name(name, "lora_B"),
                Tensor::f_zeros([out_features, self.spec.rank], (Kind::Float, Device::Cpu))?,
            );
        }
        weights::load_bytes(&adapters, bytes)?;
        let scale = self.spec.scale();
        let device = model.device();
        let mut base = self.base.iter().peekable();
        tch::no_grad(|| -> Result<()> {
            for (name, linear) in model.linears_mut() {
                let Some((_, w0)) = base.next_if(|(n, _)| *n == name) else { continue };
                let (a, b) = (&adapters[&tensor_name(&name, "lora_A")], &adapters[&tensor_name(&name, "lora_B")]);
                if linear.weight.kind() == Kind::Float {
                    // in place: the base, then the low-rank product added by one addmm
                    linear.weight.f_copy_(w0)?;
                    let (a, b) = (a.f_to_device(device)?, b.f_mul_scalar(scale)?.f_to_device(device)?);
                    let _ = linear.weight.f_addmm_(&b, &a)?;
                } else {
                    // summed in f32, rounded once to the model's dtype
                    let delta = b.f_matmul(a)?.f_mul_scalar(scale)?;
                    let merged = w0.f_to_kind(Kind::Float)?.f_add(&delta)?.f_to_device(device)?;
                    linear.weight.f_copy_(&merged)?;
                }
            }
            Ok(())
        })
    }
}

/// The adapter a job's `model` section asks for (`lora_rank` 0: none).
pub fn spec_of(cfg: &jetrl_config::ModelConfig) -> Option<LoraSpec> {
    spec_from_keys(cfg.lora_rank, cfg.lora_alpha, &cfg.target_modules, cfg.exclude_modules.as_ref())
}

/// The adapter of the critic's trunk (`critic.model`; `lora_rank` 0: none).
pub fn critic_spec_of(cfg: &jetrl_config::CriticModelConfig) -> Option<LoraSpec> {
    spec_from_keys(cfg.lora_rank, cfg.lora_alpha, &cfg.target_modules, None)
}

fn spec_from_keys(
    rank: u32,
    alpha: f64,
    targets: &jetrl_config::ModuleList,
    exclude: Option<&jetrl_config::ModuleList>,
) -> Option<LoraSpec> {
    if rank == 0 {
        return None;
    }
    let targets = if targets.is_all_linear() { Targets::AllLinear } else { Targets::Names(targets.names()) };
    let exclude = exclude.map(|m| m.names()).unwrap_or_default();
    Some(LoraSpec::new(i64::from(rank), alpha, targets, exclude))
}

impl CausalLm {
    /// Attaches the adapter a job's `model` section asks for: the one at `lora_adapter_path` (its rank and alpha
    /// must be the job's), or a new one. Nothing without `lora_rank`.
    pub fn attach_configured_lora(&mut self, cfg: &jetrl_config::ModelConfig, seed: u64) -> Result<()> {
        let Some(spec) = spec_of(cfg) else { return Ok(()) };
        match &cfg.lora_adapter_path {
            Some(dir) => {
                let read = self.load_lora(Path::new(dir))?;
                if read.spec.rank != spec.rank || read.spec.alpha != spec.alpha {
                    self.remove_lora();
                    return Err(ModelError::Config(format!(
                        "model.lora_adapter_path {dir} has r {} and lora_alpha {}, but model.lora_rank is {} and \
                         model.lora_alpha {}",
                        read.spec.rank, read.spec.alpha, spec.rank, spec.alpha
                    )));
                }
                Ok(())
            }
            None => self.add_lora_seeded(&spec, seed),
        }
    }
}
