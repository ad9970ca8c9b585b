//! The decoder's building blocks, one struct per layer, each created under a `VarStore` path that mirrors the
//! HF tensor name (`model.layers.0.self_attn.q_proj.weight`), so checkpoints load without renaming.
//!
//! Parameters are created uninitialised: [`crate::CausalLm`] either copies a checkpoint over them or fills them
//! with the HF initialisation, and never exposes a model in between.

use tch::nn::Path;
use tch::{Kind, Tensor};

use crate::adapter::Adapter;
use crate::config::{ModelConfig, RopeScaling};
use crate::error::Result;

/// Adds an uninitialised trainable parameter of the path's kind and device.
fn param(vs: &Path, name: &str, dims: &[i64]) -> Result<Tensor> {
    let tensor = Tensor::f_empty(dims, (vs.kind(), vs.device()))?;
    Ok(vs.add(name, tensor, true))
}

/// `y = x Wᵀ (+ b)`, with the weight stored `[out, in]` as in PyTorch.
#[derive(Debug)]
pub struct Linear {
    pub(crate) weight: Tensor,
    pub(crate) bias: Option<Tensor>,
    /// a LoRA adapter on this layer ([`crate::lora`])
    pub(crate) lora: Option<Adapter>,
}

impl Linear {
    pub fn new(vs: Path, in_features: i64, out_features: i64, bias: bool) -> Result<Self> {
        let weight = param(&vs, "weight", &[out_features, in_features])?;
        let bias = if bias { Some(param(&vs, "bias", &[out_features])?) } else { None };
        Ok(Linear { weight, bias, lora: None })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = x.f_linear(&self.weight, self.bias.as_ref())?;
        match &self.lora {
            Some(adapter) => adapter.add_to(x, y),
            None => Ok(y),
        }
    }
}

/// RMSNorm as HF computes it: statistics in f32, the result cast back before the weight multiplies it, so bf16
/// models round at the same place as transformers.
#[derive(Debug)]
pub struct RmsNorm {
    pub(crate) weight: Tensor,
    pub(crate) eps: f64,
}

impl RmsNorm {
    pub fn new(vs: Path, size: i64, eps: f64) -> Result<Self> {
        Ok(RmsNorm { weight: param(&vs, "weight", &[size])?, eps })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let input_kind = x.kind();
        let x = x.f_to_kind(Kind::Float)?;
        let variance = x.f_pow_tensor_scalar(2)?.f_mean_dim(-1, true, Kind::Float)?;
        let normed = x.f_mul(&variance.f_add_scalar(self.eps)?.f_rsqrt()?)?.f_to_kind(input_kind)?;
        Ok(self.weight.f_mul(&normed)?)
    }
}

/// Rotary position embedding. Frequencies are computed once (in f32, the same ops as transformers so long
/// contexts round alike); cos/sin are computed per call from explicit positions, which is what lets padded
/// batches and the KV cache use any position layout.
#[derive(Debug)]
pub struct RotaryEmbedding {
    /// `[head_dim / 2]`, f32, on the model's device.
    inv_freq: Tensor,
}

impl RotaryEmbedding {
    pub fn new(cfg: &ModelConfig, device: tch::Device) -> Result<Self> {
        let dim = cfg.head_dim;
        let exponent = Tensor::f_arange_start(0, dim, (Kind::Int64, device))?
            .f_slice(0, 0, dim, 2)?
            .f_to_kind(Kind::Float)?
            .f_div_scalar(dim as f64)?;
        let inv_freq = Tensor::f_pow_scalar(cfg.rope_theta, &exponent)?.f_reciprocal()?;
        let inv_freq = match cfg.rope_scaling {
            RopeScaling::None => inv_freq,
            RopeScaling::Linear { factor } => inv_freq.f_div_scalar(factor)?,
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                llama3_inv_freq(&inv_freq, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)?
            }
        };
        Ok(RotaryEmbedding { inv_freq })
    }

    /// `cos`, `sin` of shape `[B, 1, T, head_dim]` in `kind`, for positions `[B, T]` (integer).
    pub fn cos_sin(&self, positions: &Tensor, kind: Kind) -> Result<(Tensor, Tensor)> {
        let freqs = positions.f_to_kind(Kind::Float)?.f_unsqueeze(-1)?.f_mul(&self.inv_freq)?;
        let emb = Tensor::f_cat(&[&freqs, &freqs], -1)?.f_unsqueeze(1)?;
        Ok((emb.f_cos()?.f_to_kind(kind)?, emb.f_sin()?.f_to_kind(kind)?))
    }
}

/// Llama 3.1 frequency rescaling (transformers' `_compute_llama3_parameters`): long wavelengths are divided by
/// `factor`, short ones kept, and a smooth interpolation in between.
fn llama3_inv_freq(inv_freq: &Tensor, factor: f64, low: f64, high: f64, old_context: f64) -> Result<Tensor> {
    let low_freq_wavelen = old_context / low;
    let high_freq_wavelen = old_context / high;
    let wavelen = inv_freq.f_reciprocal()?.f_mul_scalar(2.0 * std::f64::consts::PI)?;
    let long = wavelen.f_gt(low_freq_wavelen)?;
    // torch.where(cond, a, b) is a.where_self(cond, b) in tch
    let scaled = inv_freq.f_div_scalar(factor)?.f_where_self(&long, inv_freq)?;
    let smooth = wavelen.f_reciprocal()?.f_mul_scalar(old_context)?.f_sub_scalar(low)?.f_div_scalar(high - low)?;
    let smoothed =
        smooth.f_neg()?.f_add_scalar(1.0)?.f_mul(&scaled)?.f_div_scalar(factor)?.f_add(&smooth.f_mul(&scaled)?)?;
    let medium = wavelen.f_ge(high_freq_wavelen)?.f_logical_and(&wavelen.f_le(low_freq_wavelen)?)?;
    Ok(smoothed.f_where_self(&medium, &scaled)?)
}

/// `x * cos + rotate_half(x) * sin`, where `rotate_half` swaps the two halves of the head dimension and negates
/// the second (the HF convention, not the interleaved one).
fn apply_rotary(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let half = x.size().last().copied().unwrap_or(0) / 2;
    let x1 = x.f_narrow(-1, 0, half)?;
    let x2 = x.f_narrow(-1, half, half)?;
    let rotated = Tensor::f_cat(&[&x2.f_neg()?, &x1], -1)?;
    Ok(x.f_mul(cos)?.f_add(&rotated.f_mul(sin)?)?)
}

/// One layer's slice of the KV cache: `[B, kv_heads, max_len, head_dim]` keys and values, written in place.
#[derive(Debug)]
pub struct LayerKv {
    pub(crate) k: Tensor,
    pub(crate) v: Tensor,
}

/// Where a forward pass writes its keys and values (the rollout engine's KV cache).
#[derive(Debug)]
pub enum KvWrite<'a> {
    /// At positions `offset..offset + T` of this cache view (one row); attention runs over positions
    /// `0..offset + T` of it (with [`Attend::Mask`]).
    At(&'a mut LayerKv, i64),
    /// A packed row ([`Attend::Packed`]): the keys and values of token `t`, kv head `h` go to row
    /// `rows[t * kv_heads + h]` of the whole cache viewed as `[slots * kv_heads * max_len, head_dim]`; attention
    /// stays within the packed row.
    Scatter(&'a mut LayerKv, &'a Tensor),
}

/// Which keys each query of a forward pass attends to.
#[derive(Debug, Clone, Copy)]
pub enum Attend<'a> {
    /// a boolean mask `[B, 1, T, S]`, true = may attend (padded batches, the KV cache)
    Mask(&'a Tensor),
    /// one row of sequences packed end to end, of these lengths: each token attends causally within its own
    /// sequence (no padding, no mask)
    Packed(&'a [i64]),
}

/// Multi-head attention with grouped key/value heads, optional q/k/v/o biases and optional per-head q/k RMSNorm
/// (Qwen3).
#[derive(Debug)]
pub struct Attention {
    pub(crate) q_proj: Linear,
    pub(crate) k_proj: Linear,
    pub(crate) v_proj: Linear,
    pub(crate) o_proj: Linear,
    pub(crate) q_norm: Option<RmsNorm>,
    pub(crate) k_norm: Option<RmsNorm>,
    pub(crate) num_heads: i64,
    pub(crate) num_kv_heads: i64,
    pub(crate) head_dim: i64,
}

impl Attention {
    pub fn new(vs: Path, cfg: &ModelConfig) -> Result<Self> {
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        let q_out = cfg.num_attention_heads * d;
        let kv_out = cfg.num_key_value_heads * d;
        let (q_norm, k_norm) = if cfg.qk_norm {
            (
                Some(RmsNorm::new(&vs / "q_norm", d, cfg.rms_norm_eps)?),
                Some(RmsNorm::new(&vs / "k_norm", d, cfg.rms_norm_eps)?),
            )
        } else {
            (None, None)
        };
        Ok(Attention {
            q_proj: Linear::new(&vs / "q_proj", h, q_out, cfg.qkv_bias)?,
            k_proj: Linear::new(&vs / "k_proj", h, kv_out, cfg.qkv_bias)?,
            v_proj: Linear::new(&vs / "v_proj", h, kv_out, cfg.qkv_bias)?,
            o_proj: Linear::new(&vs / "o_proj", q_out, h, cfg.o_bias)?,
            q_norm,
            k_norm,
            num_heads: cfg.num_attention_heads,
            num_kv_heads: cfg.num_key_value_heads,
            head_dim: d,
        })
    }

    /// `x`: `[B, T, H]`; `attend`: a mask `[B, 1, T, S]` (true = may attend) or the lengths of the sequences
    /// packed into one row (`B` = 1). With a cache, this call's keys and values are also written there (see
    /// [`KvWrite`]).
    pub fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        attend: Attend<'_>,
        cache: Option<KvWrite<'_>>,
    ) -> Result<Tensor> {
        let (b, t, _) = x.size3()?;
        let q = self.q_proj.forward(x)?.f_view([b, t, self.num_heads, self.head_dim])?;
        let k = self.k_proj.forward(x)?.f_view([b, t, self.num_kv_heads, self.head_dim])?;
        let v = self.v_proj.forward(x)?.f_view([b, t, self.num_kv_heads, self.head_dim])?;
        let q = match &self.q_norm {
            Some(norm) => norm.forward(&q)?,
            None => q,
        };
        let k = match &self.k_norm {
            Some(norm) => norm.forward(&k)?,
            None => k,
        };
        let q = apply_rotary(&q.f_transpose(1, 2)?, cos, sin)?;
        let k = apply_rotary(&k.f_transpose(1, 2)?, cos, sin)?;
        let v = v.f_transpose(1, 2)?;
        let (k, v) = match cache {
            None => (k, v),
            Some(KvWrite::At(kv, offset)) => {
                kv.k.f_narrow(2, offset, t)?.f_copy_(&k)?;
                kv.v.f_narrow(2, offset, t)?.f_copy_(&v)?;
                (kv.k.f_narrow(2, 0, offset + t)?, kv.v.f_narrow(2, 0, offset + t)?)
            }
            Some(KvWrite::Scatter(kv, rows)) => {
                let d = self.head_dim;
                for (cache, new) in [(&mut kv.k, &k), (&mut kv.v, &v)] {
                    let (slots, heads, len, _) = cache.size4()?;
                    let mut flat = cache.f_view([slots * heads * len, d])?;
                    // [1, kv_heads, T, D] → token-major rows (t, h)
                    let _ = flat.f_index_copy_(0, rows, &new.f_transpose(1, 2)?.f_reshape([t * heads, d])?)?;
                }
                (k, v)
            }
        };
        let scale = 1.0 / (self.head_dim as f64).sqrt();
        let grouped = self.num_heads != self.num_kv_heads;
        let y = match attend {
            Attend::Mask(mask) => {
                Tensor::f_scaled_dot_product_attention(&q, &k, &v, Some(mask), 0.0, false, scale, grouped)?
            }
            // CUDA in bf16/fp16: the flash kernel over the packed row, told where each sequence starts
            Attend::Packed(lens) if flash_varlen_applies(&q, self.head_dim) => {
                let y = flash_varlen(&q, &k, &v, lens, scale)?;
                return self.o_proj.forward(&y.f_reshape([b, t, self.num_heads * self.head_dim])?);
            }
            // elsewhere each sequence on its own, causal, with no mask: the attention of a padded batch without
            // its padding (on the CPU the cheapest exact path: SDPA's math kernel on the unpadded slice)
            Attend::Packed(lens) => {
                let mut parts = Vec::with_capacity(lens.len());
                let mut start = 0;
                for &len in lens {
                    let (qs, ks, vs) =
                        (q.f_narrow(2, start, len)?, k.f_narrow(2, start, len)?, v.f_narrow(2, start, len)?);
                    parts.push(Tensor::f_scaled_dot_product_attention(
                        &qs,
                        &ks,
                        &vs,
                        None::<&Tensor>,
                        0.0,
                        true,
                        scale,
                        grouped,
                    )?);
                    start += len;
                }
                Tensor::f_cat(&parts, 2)?
            }
        };
        let y = y.f_transpose(1, 2)?.f_reshape([b, t, self.num_heads * self.head_dim])?;
        self.o_proj.forward(&y)
    }
}

/// Whether a packed row's attention runs on the flash varlen kernel: CUDA tensors in bf16 or fp16 and a head
/// size the kernel takes (a multiple of 8, at most 256).
fn flash_varlen_applies(q: &Tensor, head_dim: i64) -> bool {
    q.device().is_cuda() && matches!(q.kind(), Kind::BFloat16 | Kind::Half) && head_dim % 8 == 0 && head_dim <= 256
}

/// Causal attention of sequences packed in one row by the flash varlen kernel: `q` `[1, heads, T, D]`, `k`, `v`
/// `[1, kv_heads, T, D]` → `[1, T, heads, D]` (grouped heads are the kernel's own).
fn flash_varlen(q: &Tensor, k: &Tensor, v: &Tensor, lens: &[i64], scale: f64) -> Result<Tensor> {
    let tokens_first = |x: &Tensor| -> Result<Tensor> { Ok(x.f_squeeze_dim(0)?.f_transpose(0, 1)?.f_contiguous()?) };
    let mut ends = Vec::with_capacity(lens.len() + 1);
    ends.push(0i32);
    for &len in lens {
        ends.push(ends.last().copied().unwrap_or(0) + len as i32);
    }
    let cu_seqlens = Tensor::f_from_slice(&ends)?.f_to_device(q.device())?;
    let max_len = lens.iter().copied().max().unwrap_or(0);
    let y = jetrl_torch_ext::flash_attention_varlen(
        &tokens_first(q)?,
        &tokens_first(k)?,
        &tokens_first(v)?,
        &cu_seqlens,
        max_len,
        scale,
    )
    .map_err(|e| tch::TchError::Torch(e.to_string()))?;
    Ok(y.f_unsqueeze(0)?)
}

/// SwiGLU feed-forward: `down(silu(gate(x)) * up(x))`.
#[derive(Debug)]
pub struct Mlp {
    pub(crate) gate_proj: Linear,
    pub(crate) up_proj: Linear,
    pub(crate) down_proj: Linear,
}

impl Mlp {
    pub fn new(vs: Path, cfg: &ModelConfig) -> Result<Self> {
        Self::with_width(vs, cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
    }

    /// An MLP `hidden → width → hidden` (an MoE expert, or the shared expert).
    pub fn with_width(vs: Path, hidden: i64, width: i64, bias: bool) -> Result<Self> {
        Ok(Mlp {
            gate_proj: Linear::new(&vs / "gate_proj", hidden, width, bias)?,
            up_proj: Linear::new(&vs / "up_proj", hidden, width, bias)?,
            down_proj: Linear::new(&vs / "down_proj", width, hidden, bias)?,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let gate = self.gate_proj.forward(x)?.f_silu()?;
        self.down_proj.forward(&gate.f_mul(&self.up_proj.forward(x)?)?)
    }
}
