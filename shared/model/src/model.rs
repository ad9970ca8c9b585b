//! The causal language model: embedding, decoder layers, final norm and LM head, with parameters in a
//! `VarStore` named exactly like the HF checkpoint.

use std::collections::BTreeMap;
use std::path::Path;

use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

use crate::adapter::LoraState;
use crate::config::ModelConfig;
use crate::decoder::DecoderLayer;
use crate::device::DType;
use crate::error::{ModelError, Result};
use crate::layers::{Attend, RmsNorm, RotaryEmbedding};
use crate::weights::{self, CheckpointFiles};

/// File name of the model configuration in a checkpoint directory.
pub const CONFIG_FILE: &str = "config.json";

/// A decoder-only LM (Qwen2, Llama or Qwen3) held in libtorch.
///
/// `Tensor` is `Send` but not `Sync`, so a model lives on one thread; services feed it through channels.
#[derive(Debug)]
pub struct CausalLm {
    config: ModelConfig,
    dtype: DType,
    /// Owns every parameter under its HF name; an optimizer iterates `trainable_variables()`.
    vs: VarStore,
    /// `[vocab, hidden]`, `model.embed_tokens.weight`.
    pub(crate) embed_tokens: Tensor,
    pub(crate) layers: Vec<DecoderLayer>,
    pub(crate) norm: RmsNorm,
    /// `lm_head.weight`, or the embedding matrix itself when the checkpoint ties them.
    lm_head: Tensor,
    pub(crate) rotary: RotaryEmbedding,
    /// LoRA adapters, when attached ([`crate::lora`])
    pub(crate) lora: Option<LoraState>,
}

impl CausalLm {
    /// Creates the layer structure with uninitialised parameters; callers fill them before returning the model.
    fn build(config: ModelConfig, device: Device, dtype: DType) -> Result<Self> {
        let mut vs = VarStore::new(device);
        vs.set_kind(dtype.kind());
        let root = vs.root();
        let model = &root / "model";
        let embed_tokens = {
            let path = &model / "embed_tokens";
            let t = Tensor::f_empty([config.vocab_size, config.hidden_size], (dtype.kind(), device))?;
            path.add("weight", t, true)
        };
        let layers = (0..config.num_hidden_layers)
            .map(|i| DecoderLayer::new(&model / "layers" / i, &config, i as usize))
            .collect::<Result<Vec<_>>>()?;
        let norm = RmsNorm::new(&model / "norm", config.hidden_size, config.rms_norm_eps)?;
        let lm_head = if config.tie_word_embeddings {
            embed_tokens.shallow_clone()
        } else {
            let t = Tensor::f_empty([config.vocab_size, config.hidden_size], (dtype.kind(), device))?;
            (&root / "lm_head").add("weight", t, true)
        };
        let rotary = RotaryEmbedding::new(&config, device)?;
        Ok(CausalLm { config, dtype, vs, embed_tokens, layers, norm, lm_head, rotary, lora: None })
    }

    /// Loads an HF checkpoint directory: `config.json` and `model.safetensors` (or shards listed in
    /// `model.safetensors.index.json`), converting the stored dtype to `dtype`.
    pub fn load(dir: &Path, device: Device, dtype: DType) -> Result<Self> {
        let config = ModelConfig::from_file(&dir.join(CONFIG_FILE))?;
        let mut model = Self::build(config, device, dtype)?;
        model.load_weights(dir)?;
        Ok(model)
    }

    /// A model with HF's initialisation: normal(0, `init_std`) for linear and embedding weights, ones for norms,
    /// zeros for biases. Seeded by the caller's `tch::manual_seed`.
    pub fn random(config: ModelConfig, device: Device, dtype: DType, init_std: f64) -> Result<Self> {
        let model = Self::build(config, device, dtype)?;
        tch::no_grad(|| -> Result<()> {
            for (name, mut param) in model.parameters() {
                if name.ends_with("norm.weight") {
                    let _ = param.f_fill_(1.0)?;
                } else if name.ends_with(".bias") {
                    let _ = param.f_zero_()?;
                } else {
                    let _ = param.f_normal_(0.0, init_std)?;
                }
            }
            Ok(())
        })?;
        Ok(model)
    }

    /// Replaces the weights with those of a checkpoint directory of the same shape.
    pub fn load_weights(&mut self, dir: &Path) -> Result<()> {
        CheckpointFiles::open(dir)?.load_into(&self.parameters(), &dir.display().to_string())
    }

    /// Writes `model.safetensors` (HF names, no `lm_head` when tied) and `config.json` into `dir`.
    pub fn save(&self, dir: &Path) -> Result<()> {
        self.save_as(dir, self.dtype)
    }

    /// [`Self::save`] with the weights converted to `dtype` (the config says so too).
    pub fn save_as(&self, dir: &Path, dtype: DType) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
        let path = dir.join(weights::WEIGHTS_FILE);
        let file = std::fs::File::create(&path).map_err(|e| ModelError::io(&path, e))?;
        weights::write_safetensors(&self.parameters(), Some(dtype.kind()), std::io::BufWriter::new(file))?;
        let config_path = dir.join(CONFIG_FILE);
        let json = serde_json::to_string_pretty(&self.config.to_json(dtype))
            .map_err(|e| ModelError::json("config.json", e))?;
        std::fs::write(&config_path, json + "\n").map_err(|e| ModelError::io(&config_path, e))
    }

    /// All weights as one safetensors blob in the model's dtype (what a trainer ships to rollout workers).
    pub fn to_safetensors_bytes(&self) -> Result<Vec<u8>> {
        self.to_safetensors_bytes_as(self.dtype)
    }

    /// All weights as one safetensors blob converted to `dtype` (e.g. an f32 trainer shipping bf16).
    pub fn to_safetensors_bytes_as(&self, dtype: DType) -> Result<Vec<u8>> {
        let mut bytes = Vec::new();
        weights::write_safetensors(&self.parameters(), Some(dtype.kind()), &mut bytes)?;
        Ok(bytes)
    }

    /// Swaps in weights from a blob made by [`Self::to_safetensors_bytes`]: the tensor names must be exactly the
    /// model's parameters, shapes must match, dtypes must be float (converted to the model's dtype). Copies in
    /// place under `no_grad`, so optimizer references and the `VarStore` stay valid. Validation happens before
    /// any copy.
    pub fn load_safetensors_bytes(&mut self, bytes: &[u8]) -> Result<()> {
        weights::load_bytes(&self.parameters(), bytes)
    }

    /// Parameters by HF name, sorted (shallow clones: writing into them writes into the model).
    pub fn parameters(&self) -> BTreeMap<String, Tensor> {
        self.vs.variables().into_iter().collect()
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn device(&self) -> Device {
        self.vs.device()
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The parameter store, for an optimizer (`nn::AdamW.build(model.var_store(), lr)`).
    pub fn var_store(&self) -> &VarStore {
        &self.vs
    }

    /// Mutable access, e.g. to `freeze()` a reference model. Changing the store's kind or device is not
    /// supported: load the model again instead.
    pub fn var_store_mut(&mut self) -> &mut VarStore {
        &mut self.vs
    }

    /// Logits `[B, T, V]` in f32 for a padded batch. `input_ids` `[B, T]` (integer), `attention_mask` `[B, T]`
    /// (1 = token, 0 = padding; left or right padding). Autograd flows when parameters require grad.
    pub fn forward(&self, input_ids: &Tensor, attention_mask: &Tensor) -> Result<Tensor> {
        self.lm_head(&self.forward_hidden(input_ids, attention_mask)?)
    }

    /// The final normed hidden states `[B, T, H]` (model dtype), for a value head sharing the trunk.
    ///
    /// Positions are `cumsum(mask) - 1` (clamped at 0), so a row's first real token is position 0 whatever the
    /// padding side. Each query attends causally to real tokens; a padding query attends to itself only, which
    /// keeps its row finite (its output is meaningless and must be masked by the caller).
    pub fn forward_hidden(&self, input_ids: &Tensor, attention_mask: &Tensor) -> Result<Tensor> {
        let (mut x, cos, sin, mask) = self.embed(input_ids, attention_mask)?;
        for layer in &self.layers {
            x = layer.forward(&x, &cos, &sin, Attend::Mask(&mask), None)?;
        }
        self.norm.forward(&x)
    }

    /// The final normed hidden states `[1, N, H]` of sequences packed end to end in one row (no padding):
    /// positions restart at 0 with every sequence and no token attends across sequences, so each token's state is
    /// the one a padded batch gives it. Autograd flows when parameters require grad.
    pub fn forward_hidden_packed(&self, packed: &Packed<'_>) -> Result<Tensor> {
        let (mut x, cos, sin) = self.embed_packed(packed)?;
        for layer in &self.layers {
            x = layer.forward(&x, &cos, &sin, Attend::Packed(packed.lens), None)?;
        }
        self.norm.forward(&x)
    }

    /// The embeddings and RoPE's cos and sin of a packed row (positions `0..len` of each sequence in turn).
    fn embed_packed(&self, packed: &Packed<'_>) -> Result<(Tensor, Tensor, Tensor)> {
        let n: i64 = packed.lens.iter().sum();
        if packed.input_ids.size() != [1, n] || packed.lens.iter().any(|&l| l <= 0) {
            return Err(ModelError::Input(format!(
                "packed input_ids has shape {:?}; the sequence lengths {:?} need [1, {n}], each at least 1",
                packed.input_ids.size(),
                packed.lens
            )));
        }
        let device = self.device();
        let positions: Vec<i64> = packed.lens.iter().flat_map(|&l| 0..l).collect();
        let positions = Tensor::f_from_slice(&positions)?.f_view([1, n])?.f_to_device(device)?;
        let (cos, sin) = self.rotary.cos_sin(&positions, self.dtype.kind())?;
        let input_ids = packed.input_ids.f_to_device(device)?;
        let embedded = Tensor::f_embedding(&self.embed_tokens, &input_ids, -1, false, false)?;
        Ok((embedded, cos, sin))
    }

    /// What every layer of a padded batch's forward pass shares: the embeddings, RoPE's cos and sin at each
    /// token's position (`cumsum(mask) - 1`, clamped at 0) and the boolean attention mask.
    fn embed(&self, input_ids: &Tensor, attention_mask: &Tensor) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
        let (_, t) = check_2d(input_ids, "input_ids")?;
        check_same_shape(attention_mask, "attention_mask", input_ids)?;
        let device = self.device();
        let input_ids = input_ids.f_to_device(device)?;
        let key_mask = attention_mask.f_to_device(device)?.f_ne(0)?;
        let positions = key_mask.f_cumsum(1, Kind::Int64)?.f_sub_scalar(1)?.f_clamp_min(0)?;
        let mask = attention_mask_4d(&key_mask, 0, t)?;
        let (cos, sin) = self.rotary.cos_sin(&positions, self.dtype.kind())?;
        let embedded = Tensor::f_embedding(&self.embed_tokens, &input_ids, -1, false, false)?;
        Ok((embedded, cos, sin, mask))
    }

    /// Projects hidden states `[..., H]` to f32 logits `[..., V]`.
    pub fn lm_head(&self, hidden: &Tensor) -> Result<Tensor> {
        Ok(hidden.f_linear(&self.lm_head, None::<&Tensor>)?.f_to_kind(Kind::Float)?)
    }
}

/// What a forward pass with gradient checkpointing keeps for its backward: each decoder layer's input and
/// nothing from inside the layers ([`CausalLm::forward_hidden_checkpointed`]).
pub struct Checkpoints {
    /// the embeddings, still in the autograd graph (the embedding weights' gradient flows from here)
    embedded: Tensor,
    /// each decoder layer's input, detached
    inputs: Vec<Tensor>,
    /// the last decoder layer's output as a leaf that requires grad: the final norm and everything after it
    /// build on it, so their backward pass leaves its gradient here
    last: Tensor,
    cos: Tensor,
    sin: Tensor,
    attending: Attending,
}

/// What the layers of a checkpointed forward attend with, kept for their second run.
enum Attending {
    Mask(Tensor),
    Packed(Vec<i64>),
}

impl Attending {
    fn attend(&self) -> Attend<'_> {
        match self {
            Self::Mask(mask) => Attend::Mask(mask),
            Self::Packed(lens) => Attend::Packed(lens),
        }
    }
}

/// Sequences packed end to end in one row for a forward pass without padding ([`CausalLm::forward_hidden_packed`]).
#[derive(Debug, Clone, Copy)]
pub struct Packed<'a> {
    /// `[1, N]` token ids, the sequences one after another
    pub input_ids: &'a Tensor,
    /// each sequence's length, in order (they sum to N)
    pub lens: &'a [i64],
}

impl std::fmt::Debug for Checkpoints {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Checkpoints({} layers)", self.inputs.len())
    }
}

impl CausalLm {
    /// [`Self::forward_hidden`] with gradient checkpointing (verl's `enable_gradient_checkpointing`): the decoder
    /// layers run without autograd and keep only their inputs; [`Self::backward_checkpointed`] runs each again,
    /// one at a time, in the backward pass. Call that right after the backward pass of whatever was computed from
    /// the returned hidden states: it carries their gradient on through the layers and the embeddings. The
    /// gradients are those of the plain forward (the layers recompute the same values).
    pub fn forward_hidden_checkpointed(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
    ) -> Result<(Tensor, Checkpoints)> {
        let (embedded, cos, sin, mask) = self.embed(input_ids, attention_mask)?;
        self.checkpointed_layers(embedded, cos, sin, Attending::Mask(mask))
    }

    /// [`Self::forward_hidden_packed`] with gradient checkpointing, as [`Self::forward_hidden_checkpointed`].
    pub fn forward_hidden_packed_checkpointed(&self, packed: &Packed<'_>) -> Result<(Tensor, Checkpoints)> {
        let (embedded, cos, sin) = self.embed_packed(packed)?;
        self.checkpointed_layers(embedded, cos, sin, Attending::Packed(packed.lens.to_vec()))
    }

    /// The decoder layers without autograd, each one's input kept, then the final norm on a leaf.
    fn checkpointed_layers(
        &self,
        embedded: Tensor,
        cos: Tensor,
        sin: Tensor,
        attending: Attending,
    ) -> Result<(Tensor, Checkpoints)> {
        let mut inputs = Vec::with_capacity(self.layers.len());
        let mut x = embedded.f_detach()?;
        tch::no_grad(|| -> Result<()> {
            for layer in &self.layers {
                let next = layer.forward(&x, &cos, &sin, attending.attend(), None)?;
                inputs.push(std::mem::replace(&mut x, next));
            }
            Ok(())
        })?;
        let last = x.f_detach()?.set_requires_grad(true);
        let hidden = self.norm.forward(&last)?;
        Ok((hidden, Checkpoints { embedded, inputs, last, cos, sin, attending }))
    }

    /// The rest of the backward pass of a [`Self::forward_hidden_checkpointed`]: from the gradient the caller's
    /// backward left on the last layer's output, each layer (last first) is run again with autograd and
    /// back-propagated (`Σ y·g` has gradient `g` in `y`), then the embeddings. Parameter gradients accumulate as
    /// in a plain backward pass.
    pub fn backward_checkpointed(&self, checkpoints: Checkpoints) -> Result<()> {
        let Checkpoints { embedded, inputs, last, cos, sin, attending } = checkpoints;
        let mut grad = last.grad();
        if !grad.defined() {
            return Ok(());
        }
        for (layer, input) in self.layers.iter().zip(inputs).rev() {
            let x = input.set_requires_grad(true);
            let y = layer.forward(&x, &cos, &sin, attending.attend(), None)?;
            y.f_mul(&grad)?.f_sum(Kind::Float)?.f_backward()?;
            grad = x.grad();
            if !grad.defined() {
                return Ok(());
            }
        }
        if embedded.requires_grad() {
            embedded.f_mul(&grad)?.f_sum(Kind::Float)?.f_backward()?;
        }
        Ok(())
    }
}

/// Copies the tokenizer and generation files of an HF model directory into `out` (everything but the weights
/// and `config.json`, which [`CausalLm::save`] writes itself), so `out` is a complete model directory.
pub fn copy_side_files(model_dir: &Path, out: &Path) -> Result<()> {
    let entries = std::fs::read_dir(model_dir).map_err(|e| ModelError::io(model_dir, e))?;
    for entry in entries.flatten() {
        let path = entry.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else { continue };
        let is_weights = name.ends_with(".safetensors") || name.ends_with(".safetensors.index.json");
        if !path.is_file() || is_weights || name == CONFIG_FILE {
            continue;
        }
        std::fs::copy(&path, out.join(name)).map_err(|e| ModelError::io(&path, e))?;
    }
    Ok(())
}

fn check_2d(t: &Tensor, what: &str) -> Result<(i64, i64)> {
    match t.size().as_slice() {
        &[b, l] if b > 0 && l > 0 => Ok((b, l)),
        other => Err(ModelError::Input(format!("{what} must be a non-empty [batch, len] tensor, got shape {other:?}"))),
    }
}

/// `t` (named `what`) must have the shape of `input_ids`.
fn check_same_shape(t: &Tensor, what: &str, input_ids: &Tensor) -> Result<()> {
    if t.size() != input_ids.size() {
        return Err(ModelError::Input(format!(
            "{what} has shape {:?} but input_ids has {:?}",
            t.size(),
            input_ids.size()
        )));
    }
    Ok(())
}

/// The boolean attention mask `[B, 1, T, S]` for `T` queries at slots `offset..offset+T` over `S` key slots:
/// a query sees earlier-or-same slots that hold real tokens, and always itself, so no row is fully masked
/// (an all-false row would make softmax produce NaN for padding queries).
fn attention_mask_4d(key_mask: &Tensor, offset: i64, t: i64) -> Result<Tensor> {
    let s = key_mask.size().get(1).copied().unwrap_or(0);
    let device = key_mask.device();
    let query_slots = Tensor::f_arange_start(offset, offset + t, (Kind::Int64, device))?.f_unsqueeze(1)?;
    let key_slots = Tensor::f_arange(s, (Kind::Int64, device))?.f_unsqueeze(0)?;
    let causal = key_slots.f_le_tensor(&query_slots)?;
    let own = key_slots.f_eq_tensor(&query_slots)?;
    let keys = key_mask.f_unsqueeze(1)?.f_unsqueeze(1)?;
    Ok(causal.f_logical_and(&keys)?.f_logical_or(&own)?)
}
