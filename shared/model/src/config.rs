//! The model configuration, read straight from an HF `config.json`.
//!
//! Both layouts HF has written are accepted: the older one with `rope_theta` (and `rope_scaling`) at the top
//! level, and the transformers-5 one with a `rope_parameters` object. The original JSON is kept so a saved
//! checkpoint carries every field it was loaded with.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use crate::device::DType;
use crate::error::{ModelError, Result};

/// The decoder families this crate implements. They share one layer structure and differ in biases, q/k norm,
/// RoPE scaling and (the MoE families) a sparse mixture-of-experts feed-forward in place of the MLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// Qwen2 / Qwen2.5: bias on q/k/v, none on o and the MLP.
    Qwen2,
    /// Llama 2 / 3: biases as `attention_bias` / `mlp_bias` say; optional Llama-3 RoPE scaling.
    Llama,
    /// Qwen3: per-head RMSNorm on q and k before RoPE, explicit `head_dim`.
    Qwen3,
    /// Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (`qkv_bias`), routed experts plus a shared
    /// expert behind a sigmoid gate.
    Qwen2Moe,
    /// Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention, routed experts without a shared one.
    Qwen3Moe,
}

impl Architecture {
    /// The HF `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Architecture::Qwen2 => "qwen2",
            Architecture::Llama => "llama",
            Architecture::Qwen3 => "qwen3",
            Architecture::Qwen2Moe => "qwen2_moe",
            Architecture::Qwen3Moe => "qwen3_moe",
        }
    }

    fn from_model_type(model_type: &str) -> Option<Self> {
        match model_type {
            "qwen2" => Some(Architecture::Qwen2),
            "llama" => Some(Architecture::Llama),
            "qwen3" => Some(Architecture::Qwen3),
            "qwen2_moe" => Some(Architecture::Qwen2Moe),
            "qwen3_moe" => Some(Architecture::Qwen3Moe),
            _ => None,
        }
    }

    fn from_class_name(class: &str) -> Option<Self> {
        match class {
            "Qwen2ForCausalLM" => Some(Architecture::Qwen2),
            "LlamaForCausalLM" => Some(Architecture::Llama),
            "Qwen3ForCausalLM" => Some(Architecture::Qwen3),
            "Qwen2MoeForCausalLM" => Some(Architecture::Qwen2Moe),
            "Qwen3MoeForCausalLM" => Some(Architecture::Qwen3Moe),
            _ => None,
        }
    }
}

/// How RoPE frequencies are rescaled for long contexts.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE (`rope_type: default`).
    None,
    /// Position interpolation: every inverse frequency divided by `factor`.
    Linear { factor: f64 },
    /// Llama 3.1: low frequencies divided by `factor`, high ones kept, a smooth ramp between.
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_max_position_embeddings: f64 },
}

/// The sparse feed-forward of an MoE checkpoint (transformers' `Qwen2MoeSparseMoeBlock` /
/// `Qwen3MoeSparseMoeBlock`).
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    /// `num_experts` (transformers 5 also writes it as `num_local_experts`)
    pub num_experts: i64,
    /// `num_experts_per_tok`: the experts each token is routed to
    pub top_k: i64,
    /// `moe_intermediate_size`: each routed expert's MLP width
    pub moe_intermediate_size: i64,
    /// `norm_topk_prob`: the top-k routing probabilities are renormalised to sum to one
    pub norm_topk_prob: bool,
    /// `shared_expert_intermediate_size` (Qwen2-MoE): a dense expert every token passes through, scaled by
    /// `sigmoid(shared_expert_gate(x))`
    pub shared_expert_intermediate_size: Option<i64>,
    /// `decoder_sparse_step`: layer `l` is sparse when `(l + 1) % step == 0` and `l` is not in `mlp_only_layers`;
    /// the others keep a dense MLP of `intermediate_size`
    pub decoder_sparse_step: i64,
    /// `mlp_only_layers`, sorted, without duplicates
    pub mlp_only_layers: Vec<i64>,
    /// the number of layers in all
    layers: i64,
    /// `router_aux_loss_coef` as the checkpoint states it (transformers' default for its own training loss;
    /// the RL trainer's coefficient is `actor.moe_aux_loss_coeff`)
    pub router_aux_loss_coef: f64,
}

impl MoeConfig {
    /// Whether decoder layer `layer` has the sparse block.
    pub fn is_sparse(&self, layer: usize) -> bool {
        let layer = layer as i64;
        self.is_stepped(layer) && self.mlp_only_layers.binary_search(&layer).is_err()
    }

    /// How many layers are sparse (counted without visiting every layer: a config may claim any count).
    pub fn sparse_layer_count(&self) -> i64 {
        let stepped = self.layers / self.decoder_sparse_step;
        let excluded = self.mlp_only_layers.iter().filter(|&&l| self.is_stepped(l)).count() as i64;
        stepped - excluded
    }

    fn is_stepped(&self, layer: i64) -> bool {
        (0..self.layers).contains(&layer) && (layer + 1) % self.decoder_sparse_step == 0
    }
}

/// A validated model configuration.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub vocab_size: i64,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_hidden_layers: i64,
    pub num_attention_heads: i64,
    pub num_key_value_heads: i64,
    pub head_dim: i64,
    pub max_position_embeddings: i64,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    /// `lm_head` shares the embedding matrix (no `lm_head.weight` in the checkpoint).
    pub tie_word_embeddings: bool,
    /// Bias on q/k/v projections.
    pub qkv_bias: bool,
    /// Bias on the attention output projection.
    pub o_bias: bool,
    /// Bias on gate/up/down projections.
    pub mlp_bias: bool,
    /// Qwen3's per-head RMSNorm on q and k.
    pub qk_norm: bool,
    /// The mixture-of-experts layout (Qwen2-MoE, Qwen3-MoE); `None` for dense models.
    pub moe: Option<MoeConfig>,
    /// `eos_token_id` from config.json (a fallback when generation_config.json has none).
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    pub pad_token_id: Option<u32>,
    /// The JSON this was read from, written back unchanged (except the dtype) when the model is saved.
    raw: Value,
}

/// The fields read from `config.json`; everything else is kept in `raw` only.
#[derive(Deserialize)]
struct RawConfig {
    model_type: Option<String>,
    architectures: Option<Vec<String>>,
    vocab_size: Option<i64>,
    hidden_size: Option<i64>,
    intermediate_size: Option<i64>,
    num_hidden_layers: Option<i64>,
    num_attention_heads: Option<i64>,
    num_key_value_heads: Option<i64>,
    head_dim: Option<i64>,
    max_position_embeddings: Option<i64>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
    partial_rotary_factor: Option<f64>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    qkv_bias: Option<bool>,
    mlp_bias: Option<bool>,
    num_experts: Option<i64>,
    num_local_experts: Option<i64>,
    num_experts_per_tok: Option<i64>,
    moe_intermediate_size: Option<i64>,
    norm_topk_prob: Option<bool>,
    shared_expert_intermediate_size: Option<i64>,
    decoder_sparse_step: Option<i64>,
    mlp_only_layers: Option<Vec<i64>>,
    router_aux_loss_coef: Option<f64>,
    hidden_act: Option<String>,
    use_sliding_window: Option<bool>,
    layer_types: Option<Vec<String>>,
    eos_token_id: Option<Value>,
    bos_token_id: Option<Value>,
    pad_token_id: Option<Value>,
}

/// Reads an HF token-id field that may be null, an integer or a list of integers.
pub(crate) fn token_ids(value: Option<&Value>, field: &str) -> Result<Vec<u32>> {
    let as_id = |v: &Value| {
        v.as_u64()
            .and_then(|id| u32::try_from(id).ok())
            .ok_or_else(|| ModelError::Config(format!("`{field}` must be a token id or a list of them, got {v}")))
    };
    match value {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(items)) => items.iter().map(as_id).collect(),
        Some(v) => Ok(vec![as_id(v)?]),
    }
}

fn required(value: Option<i64>, field: &str) -> Result<i64> {
    match value {
        Some(v) if v > 0 => Ok(v),
        Some(v) => Err(ModelError::Config(format!("`{field}` must be positive, got {v}"))),
        None => Err(ModelError::Config(format!("`{field}` is missing"))),
    }
}

fn get_f64(map: &Value, key: &str) -> Option<f64> {
    map.get(key).and_then(Value::as_f64)
}

impl ModelConfig {
    /// Reads and validates `config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
        let value: Value = serde_json::from_str(&text).map_err(|e| ModelError::json(path.display().to_string(), e))?;
        Self::from_json(value)
    }

    /// Validates an already parsed `config.json`.
    pub fn from_json(raw: Value) -> Result<Self> {
        let kind = match &raw {
            Value::Object(_) => None,
            Value::Null => Some("null"),
            Value::Bool(_) => Some("a boolean"),
            Value::Number(_) => Some("a number"),
            Value::String(_) => Some("a string"),
            Value::Array(_) => Some("an array"),
        };
        if let Some(kind) = kind {
            return Err(ModelError::Config(format!("config.json must hold a JSON object, not {kind}")));
        }
        // The path names the field: serde_json's own message says only what type it expected.
        let cfg: RawConfig = serde_path_to_error::deserialize(&raw).map_err(|e| {
            let path = e.path().to_string();
            ModelError::Config(format!("`{path}`: {}", e.into_inner()))
        })?;
        let architecture = Self::architecture(&cfg)?;

        if let Some(act) = &cfg.hidden_act {
            if act != "silu" && act != "swish" {
                return Err(ModelError::Config(format!("hidden_act `{act}` is not supported (only silu)")));
            }
        }
        let sliding = cfg.use_sliding_window.unwrap_or(false)
            || cfg.layer_types.iter().flatten().any(|t| t == "sliding_attention");
        if sliding {
            return Err(ModelError::Config("sliding-window attention is not supported".into()));
        }

        let hidden_size = required(cfg.hidden_size, "hidden_size")?;
        let num_attention_heads = required(cfg.num_attention_heads, "num_attention_heads")?;
        let num_key_value_heads = match cfg.num_key_value_heads {
            None => num_attention_heads,
            some => required(some, "num_key_value_heads")?,
        };
        if num_attention_heads % num_key_value_heads != 0 {
            return Err(ModelError::Config(format!(
                "num_attention_heads ({num_attention_heads}) is not a multiple of num_key_value_heads \
                 ({num_key_value_heads})"
            )));
        }
        let head_dim = match cfg.head_dim {
            Some(d) => required(Some(d), "head_dim")?,
            None if hidden_size % num_attention_heads == 0 => hidden_size / num_attention_heads,
            None => {
                return Err(ModelError::Config(format!(
                    "hidden_size ({hidden_size}) is not a multiple of num_attention_heads ({num_attention_heads}) \
                     and no head_dim is given"
                )))
            }
        };
        if head_dim % 2 != 0 {
            return Err(ModelError::Config(format!("head_dim ({head_dim}) must be even for RoPE")));
        }

        let (rope_theta, rope_scaling) = Self::rope(&cfg)?;
        let (qkv_bias, o_bias, mlp_bias, qk_norm) = match architecture {
            Architecture::Qwen2 => (true, false, false, false),
            Architecture::Llama => {
                let attn = cfg.attention_bias.unwrap_or(false);
                (attn, attn, cfg.mlp_bias.unwrap_or(false), false)
            }
            Architecture::Qwen3 | Architecture::Qwen3Moe => {
                let attn = cfg.attention_bias.unwrap_or(false);
                (attn, attn, false, true)
            }
            Architecture::Qwen2Moe => (cfg.qkv_bias.unwrap_or(true), false, false, false),
        };
        let num_hidden_layers = required(cfg.num_hidden_layers, "num_hidden_layers")?;
        let moe = match architecture {
            Architecture::Qwen2Moe | Architecture::Qwen3Moe => Self::moe(&cfg, architecture, num_hidden_layers)?,
            _ => None,
        };
        let single_id =
            |v: Option<&Value>, field: &str| -> Result<Option<u32>> { Ok(token_ids(v, field)?.first().copied()) };

        let rms_norm_eps = cfg.rms_norm_eps.unwrap_or(1e-6);
        if rms_norm_eps < 0.0 {
            return Err(ModelError::Config(format!("`rms_norm_eps` must not be negative, got {rms_norm_eps}")));
        }
        let config = ModelConfig {
            architecture,
            vocab_size: required(cfg.vocab_size, "vocab_size")?,
            hidden_size,
            intermediate_size: required(cfg.intermediate_size, "intermediate_size")?,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            max_position_embeddings: match cfg.max_position_embeddings {
                None => 2048,
                given => required(given, "max_position_embeddings")?,
            },
            rms_norm_eps,
            rope_theta,
            rope_scaling,
            tie_word_embeddings: cfg.tie_word_embeddings.unwrap_or(false),
            qkv_bias,
            o_bias,
            mlp_bias,
            qk_norm,
            moe,
            eos_token_ids: token_ids(cfg.eos_token_id.as_ref(), "eos_token_id")?,
            bos_token_id: single_id(cfg.bos_token_id.as_ref(), "bos_token_id")?,
            pad_token_id: single_id(cfg.pad_token_id.as_ref(), "pad_token_id")?,
            raw,
        };
        config.parameter_count()?;
        Ok(config)
    }

    /// The number of parameters, counting every optional bias and norm (an upper bound), or an error when the
    /// sizes overflow `i64`: the products are tensor shapes, and an overflow would panic while building the
    /// model instead of refusing the config.
    pub fn parameter_count(&self) -> Result<i64> {
        let overflow = || {
            ModelError::Config(format!(
                "the sizes overflow: vocab_size {}, hidden_size {}, intermediate_size {}, num_hidden_layers {}, \
                 num_attention_heads {}, num_key_value_heads {}, head_dim {}",
                self.vocab_size,
                self.hidden_size,
                self.intermediate_size,
                self.num_hidden_layers,
                self.num_attention_heads,
                self.num_key_value_heads,
                self.head_dim
            ))
        };
        let mul = |a: i64, b: i64| a.checked_mul(b).ok_or_else(overflow);
        let add = |terms: &[i64]| terms.iter().try_fold(0i64, |sum, &t| sum.checked_add(t)).ok_or_else(overflow);
        let (hidden, head_dim) = (self.hidden_size, self.head_dim);
        let q_out = mul(self.num_attention_heads, head_dim)?;
        let kv_out = mul(self.num_key_value_heads, head_dim)?;
        let attention = add(&[
            mul(hidden, q_out)?,
            mul(mul(hidden, kv_out)?, 2)?,
            mul(q_out, hidden)?,
            add(&[q_out, mul(kv_out, 2)?, hidden])?, // biases
            mul(hidden, 2)?,                         // the two norms
            mul(head_dim, 2)?,                       // q/k norms
        ])?;
        let mlp = |width: i64| -> Result<i64> {
            add(&[mul(mul(hidden, width)?, 3)?, add(&[mul(width, 2)?, hidden])?])
            // with biases
        };
        let dense = mlp(self.intermediate_size)?;
        let (sparse_layers, sparse) = match &self.moe {
            Some(moe) => {
                let shared = match moe.shared_expert_intermediate_size {
                    Some(width) => add(&[mlp(width)?, hidden])?,
                    None => 0,
                };
                let experts = mul(mlp(moe.moe_intermediate_size)?, moe.num_experts)?;
                (moe.sparse_layer_count(), add(&[experts, mul(moe.num_experts, hidden)?, shared])?)
            }
            None => (0, 0),
        };
        let layers = add(&[
            mul(attention, self.num_hidden_layers)?,
            mul(dense, self.num_hidden_layers - sparse_layers)?,
            mul(sparse, sparse_layers)?,
        ])?;
        let embeddings = mul(mul(self.vocab_size, hidden)?, 2)?;
        add(&[layers, embeddings, hidden])
    }

    /// The sparse layout of an MoE checkpoint, or `None` when it routes nowhere (`num_experts` 0, or every layer
    /// dense): then it is the dense model its attention names.
    fn moe(cfg: &RawConfig, architecture: Architecture, layers: i64) -> Result<Option<MoeConfig>> {
        let num_experts = cfg.num_experts.or(cfg.num_local_experts).unwrap_or(0);
        if num_experts < 0 {
            return Err(ModelError::Config(format!("`num_experts` must not be negative, got {num_experts}")));
        }
        let step = match cfg.decoder_sparse_step {
            None => 1,
            step => required(step, "decoder_sparse_step")?,
        };
        let mut mlp_only_layers = cfg.mlp_only_layers.clone().unwrap_or_default();
        mlp_only_layers.sort_unstable();
        mlp_only_layers.dedup();
        let probe = MoeConfig {
            num_experts,
            top_k: 0,
            moe_intermediate_size: 0,
            norm_topk_prob: false,
            shared_expert_intermediate_size: None,
            decoder_sparse_step: step,
            mlp_only_layers,
            router_aux_loss_coef: 0.0,
            layers,
        };
        if num_experts == 0 || probe.sparse_layer_count() == 0 {
            return Ok(None);
        }
        let top_k = required(cfg.num_experts_per_tok, "num_experts_per_tok")?;
        if top_k > num_experts {
            return Err(ModelError::Config(format!(
                "`num_experts_per_tok` ({top_k}) is larger than `num_experts` ({num_experts})"
            )));
        }
        let shared_expert_intermediate_size = match architecture {
            Architecture::Qwen2Moe => {
                Some(required(cfg.shared_expert_intermediate_size, "shared_expert_intermediate_size")?)
            }
            _ => None,
        };
        Ok(Some(MoeConfig {
            num_experts,
            top_k,
            moe_intermediate_size: required(cfg.moe_intermediate_size, "moe_intermediate_size")?,
            // transformers' defaults: Qwen2-MoE false, Qwen3-MoE true
            norm_topk_prob: cfg.norm_topk_prob.unwrap_or(architecture == Architecture::Qwen3Moe),
            shared_expert_intermediate_size,
            router_aux_loss_coef: cfg.router_aux_loss_coef.unwrap_or(0.001),
            ..probe
        }))
    }

    fn architecture(cfg: &RawConfig) -> Result<Architecture> {
        if let Some(model_type) = &cfg.model_type {
            return Architecture::from_model_type(model_type).ok_or_else(|| {
                ModelError::Config(format!(
                    "unsupported architecture: model_type `{model_type}` (supported: qwen2, llama, qwen3, qwen2_moe, \
                     qwen3_moe)"
                ))
            });
        }
        match cfg.architectures.as_deref() {
            Some([class, ..]) => Architecture::from_class_name(class).ok_or_else(|| {
                ModelError::Config(format!(
                    "unsupported architecture `{class}` (supported: Qwen2ForCausalLM, LlamaForCausalLM, \
                     Qwen3ForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM)"
                ))
            }),
            _ => Err(ModelError::Config("neither `model_type` nor `architectures` names the architecture".into())),
        }
    }

    /// RoPE base and scaling from either layout: `rope_parameters` (transformers 5, possibly holding the
    /// scaling keys itself or a nested `rope_scaling`) or top-level `rope_theta` + `rope_scaling`.
    fn rope(cfg: &RawConfig) -> Result<(f64, RopeScaling)> {
        let mut params = cfg.rope_parameters.clone().filter(|v| v.is_object());
        // Per-layer-type parameters: the decoders here only have full attention.
        if let Some(full) = params.as_ref().and_then(|p| p.get("full_attention")).filter(|v| v.is_object()) {
            params = Some(full.clone());
        }
        let theta = params.as_ref().and_then(|p| get_f64(p, "rope_theta")).or(cfg.rope_theta).unwrap_or(10_000.0);
        if !(theta.is_finite() && theta > 0.0) {
            return Err(ModelError::Config(format!("rope_theta must be positive, got {theta}")));
        }
        let partial = params.as_ref().and_then(|p| get_f64(p, "partial_rotary_factor")).or(cfg.partial_rotary_factor);
        if let Some(factor) = partial {
            if factor != 1.0 {
                return Err(ModelError::Config(format!("partial_rotary_factor {factor} is not supported")));
            }
        }

        let has_type = |v: &Value| v.get("rope_type").or_else(|| v.get("type")).is_some_and(|t| !t.is_null());
        let scaling = params
            .as_ref()
            .and_then(|p| p.get("rope_scaling").filter(|v| v.is_object()).cloned())
            .or_else(|| params.clone().filter(|p| has_type(p)))
            .or_else(|| cfg.rope_scaling.clone().filter(|v| v.is_object()));
        let Some(scaling) = scaling else { return Ok((theta, RopeScaling::None)) };
        let rope_type = scaling
            .get("rope_type")
            .or_else(|| scaling.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("default")
            .to_string();
        // Every factor divides a frequency or a wavelength: zero or a negative one gives inf/NaN logits.
        let need = |key: &str| {
            let value = get_f64(&scaling, key)
                .ok_or_else(|| ModelError::Config(format!("rope type `{rope_type}` needs a numeric `{key}`")))?;
            if value.is_finite() && value > 0.0 {
                Ok(value)
            } else {
                Err(ModelError::Config(format!("rope type `{rope_type}`: `{key}` must be positive, got {value}")))
            }
        };
        let scaling = match rope_type.as_str() {
            "default" => RopeScaling::None,
            "linear" => RopeScaling::Linear { factor: need("factor")? },
            "llama3" => {
                let (low_freq_factor, high_freq_factor) = (need("low_freq_factor")?, need("high_freq_factor")?);
                if low_freq_factor == high_freq_factor {
                    // the smoothing between the two divides by their difference
                    return Err(ModelError::Config(format!(
                        "rope type `llama3`: `low_freq_factor` and `high_freq_factor` must differ, both are \
                         {low_freq_factor}"
                    )));
                }
                let original = get_f64(&scaling, "original_max_position_embeddings")
                    .or(cfg.max_position_embeddings.map(|v| v as f64))
                    .ok_or_else(|| {
                        ModelError::Config("rope type `llama3` needs `original_max_position_embeddings`".into())
                    })?;
                if !(original.is_finite() && original > 0.0) {
                    return Err(ModelError::Config(format!(
                        "rope type `llama3`: `original_max_position_embeddings` must be positive, got {original}"
                    )));
                }
                RopeScaling::Llama3 {
                    factor: need("factor")?,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_position_embeddings: original,
                }
            }
            other => {
                return Err(ModelError::Config(format!(
                    "rope type `{other}` is not supported (supported: default, linear, llama3)"
                )))
            }
        };
        Ok((theta, scaling))
    }

    /// The original `config.json`, with the dtype fields set to `dtype` so HF loads saved weights as saved.
    pub fn to_json(&self, dtype: DType) -> Value {
        let mut raw = self.raw.clone();
        if let Some(map) = raw.as_object_mut() {
            if map.contains_key("torch_dtype") {
                map.insert("torch_dtype".into(), Value::from(dtype.hf_name()));
            }
            map.insert("dtype".into(), Value::from(dtype.hf_name()));
        }
        raw
    }

    /// The JSON this config was read from.
    pub fn raw(&self) -> &Value {
        &self.raw
    }

    /// Number of query heads sharing one key/value head.
    pub fn kv_groups(&self) -> i64 {
        self.num_attention_heads / self.num_key_value_heads
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base(model_type: &str) -> Value {
        json!({
            "model_type": model_type, "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        })
    }

    #[test]
    fn rope_theta_is_read_from_either_layout() {
        let mut old = base("qwen2");
        old["rope_theta"] = json!(1000.0);
        assert_eq!(ModelConfig::from_json(old).unwrap().rope_theta, 1000.0);
        let mut new = base("llama");
        new["rope_parameters"] = json!({"rope_theta": 500000.0, "rope_type": "default"});
        let cfg = ModelConfig::from_json(new).unwrap();
        assert_eq!(cfg.rope_theta, 500000.0);
        assert_eq!(cfg.rope_scaling, RopeScaling::None);
    }

    #[test]
    fn llama3_scaling_is_read_from_rope_scaling_or_rope_parameters() {
        let scaling = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
        let expected = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        };
        let mut old = base("llama");
        old["rope_theta"] = json!(500000.0);
        old["rope_scaling"] = scaling.clone();
        assert_eq!(ModelConfig::from_json(old).unwrap().rope_scaling, expected);

        let mut new = base("llama");
        let mut params = scaling;
        params["rope_theta"] = json!(500000.0);
        new["rope_parameters"] = params;
        let cfg = ModelConfig::from_json(new).unwrap();
        assert_eq!(cfg.rope_scaling, expected);
        assert_eq!(cfg.rope_theta, 500000.0);
    }

    #[test]
    fn unknown_architecture_is_named_in_the_error() {
        let err = ModelConfig::from_json(base("mixtral")).unwrap_err().to_string();
        assert!(err.contains("mixtral"), "{err}");
        let mut by_class = base("x");
        by_class.as_object_mut().unwrap().remove("model_type");
        by_class["architectures"] = json!(["GPTNeoXForCausalLM"]);
        let err = ModelConfig::from_json(by_class).unwrap_err().to_string();
        assert!(err.contains("GPTNeoXForCausalLM"), "{err}");
    }

    #[test]
    fn biases_and_qk_norm_follow_the_architecture() {
        let q2 = ModelConfig::from_json(base("qwen2")).unwrap();
        assert!(q2.qkv_bias && !q2.o_bias && !q2.mlp_bias && !q2.qk_norm);
        let mut llama = base("llama");
        llama["attention_bias"] = json!(true);
        llama["mlp_bias"] = json!(true);
        let llama = ModelConfig::from_json(llama).unwrap();
        assert!(llama.qkv_bias && llama.o_bias && llama.mlp_bias);
        let mut q3 = base("qwen3");
        q3["head_dim"] = json!(8);
        let q3 = ModelConfig::from_json(q3).unwrap();
        assert!(q3.qk_norm && !q3.qkv_bias && q3.head_dim == 8);
    }

    #[test]
    fn eos_token_id_may_be_an_int_or_a_list() {
        let mut cfg = base("qwen2");
        cfg["eos_token_id"] = json!([2, 0]);
        assert_eq!(ModelConfig::from_json(cfg.clone()).unwrap().eos_token_ids, vec![2, 0]);
        cfg["eos_token_id"] = json!(7);
        assert_eq!(ModelConfig::from_json(cfg).unwrap().eos_token_ids, vec![7]);
    }

    #[test]
    fn saved_config_keeps_unknown_fields_and_records_the_dtype() {
        let mut cfg = base("qwen2");
        cfg["torch_dtype"] = json!("float32");
        cfg["custom"] = json!({"x": 1});
        let out = ModelConfig::from_json(cfg).unwrap().to_json(DType::BF16);
        assert_eq!(out["torch_dtype"], "bfloat16");
        assert_eq!(out["dtype"], "bfloat16");
        assert_eq!(out["custom"]["x"], 1);
    }

    fn moe_json(model_type: &str) -> Value {
        let mut cfg = base(model_type);
        cfg["num_hidden_layers"] = json!(4);
        cfg["num_experts"] = json!(8);
        cfg["num_experts_per_tok"] = json!(2);
        cfg["moe_intermediate_size"] = json!(8);
        cfg["shared_expert_intermediate_size"] = json!(16);
        cfg
    }

    #[test]
    fn moe_layers_follow_decoder_sparse_step_and_mlp_only_layers() {
        let mut cfg = moe_json("qwen3_moe");
        cfg["decoder_sparse_step"] = json!(2);
        cfg["mlp_only_layers"] = json!([3, 3]);
        let parsed = ModelConfig::from_json(cfg).unwrap();
        let moe = parsed.moe.as_ref().unwrap();
        assert_eq!((0..4).map(|l| moe.is_sparse(l)).collect::<Vec<_>>(), [false, true, false, false]);
        assert_eq!(moe.sparse_layer_count(), 1);
        assert!(moe.norm_topk_prob && moe.shared_expert_intermediate_size.is_none(), "qwen3_moe's defaults");
        let qwen2 = ModelConfig::from_json(moe_json("qwen2_moe")).unwrap();
        let moe = qwen2.moe.as_ref().unwrap();
        assert!(!moe.norm_topk_prob && moe.shared_expert_intermediate_size == Some(16) && qwen2.qkv_bias);
    }

    #[test]
    fn num_local_experts_is_read_as_num_experts_and_no_experts_is_a_dense_model() {
        let mut cfg = moe_json("qwen3_moe");
        let experts = cfg.as_object_mut().unwrap().remove("num_experts").unwrap();
        cfg["num_local_experts"] = experts;
        assert_eq!(ModelConfig::from_json(cfg.clone()).unwrap().moe.unwrap().num_experts, 8);
        cfg["num_local_experts"] = json!(0);
        assert!(ModelConfig::from_json(cfg).unwrap().moe.is_none());
    }

    #[test]
    fn impossible_moe_layouts_are_refused_by_key() {
        let mut cfg = moe_json("qwen3_moe");
        cfg["num_experts_per_tok"] = json!(9);
        let err = ModelConfig::from_json(cfg).unwrap_err().to_string();
        assert!(err.contains("num_experts_per_tok") && err.contains("9"), "{err}");
        let mut cfg = moe_json("qwen2_moe");
        cfg.as_object_mut().unwrap().remove("shared_expert_intermediate_size");
        let err = ModelConfig::from_json(cfg).unwrap_err().to_string();
        assert!(err.contains("shared_expert_intermediate_size"), "{err}");
        // a claimed layer count is counted, not visited
        let mut cfg = moe_json("qwen3_moe");
        cfg["num_hidden_layers"] = json!(i64::MAX / 4);
        let err = ModelConfig::from_json(cfg).unwrap_err().to_string();
        assert!(err.contains("overflow"), "{err}");
    }
}
