//! The two forward passes of the engine over the slot cache, built from the model's own layers so rollout and
//! training compute the same function.
//!
//! - [`prefill`]: one sequence's context into one slot (causal attention over the new tokens only: a slot is
//!   always filled from position 0, the engine keeps no cross-request prefix cache).
//! - [`decode`]: one token for each of the slots `0..batch`, each at its own position: keys and values are
//!   written in place at `(slot, position)` and each slot attends to its own `0..=position`. Its shapes depend
//!   on `(batch, width)` only and its inputs sit in fixed device tensors ([`DecodeInputs`]), so on CUDA it is
//!   captured once per shape and replayed as a graph (`graphs.rs`).

use tch::{Device, Kind, Tensor};

use crate::decoder::FeedForward;
use crate::engine::cache::SlotCache;
use crate::error::{ModelError, Result};
use crate::layers::{Attend, Attention, KvWrite, LayerKv, RmsNorm};
use crate::model::CausalLm;

/// Runs `ids` through the model into slot `slot` (positions `0..len`) and returns the f32 logits `[1, V]` of the
/// last position (the distribution of the first new token). A context longer than `chunk` tokens is prefilled
/// `chunk` tokens at a time, each chunk attending to the keys and values the earlier ones wrote, so the attention
/// scores of one pass are `chunk × len` at most, not `len × len`.
pub(crate) fn prefill(model: &CausalLm, cache: &mut SlotCache, slot: i64, ids: &[u32], chunk: usize) -> Result<Tensor> {
    let t = ids.len() as i64;
    if t == 0 || t > cache.max_len {
        return Err(ModelError::Generation(format!(
            "a context of {t} tokens does not fit a KV slot of {} positions",
            cache.max_len
        )));
    }
    let device = model.device();
    let chunk = chunk.max(1) as i64;
    tch::no_grad(|| {
        let ids: Vec<i64> = ids.iter().map(|&id| i64::from(id)).collect();
        let mut start = 0;
        loop {
            let c = chunk.min(t - start);
            let input =
                Tensor::from_slice(&ids[start as usize..(start + c) as usize]).f_view([1, c])?.f_to_device(device)?;
            let positions = Tensor::f_arange_start(start, start + c, (Kind::Int64, device))?;
            let (cos, sin) = model.rotary.cos_sin(&positions.f_unsqueeze(0)?, model.dtype().kind())?;
            // query i (position start + i) sees keys 0..=start + i
            let keys = Tensor::f_arange(start + c, (Kind::Int64, device))?;
            let mask = keys.f_unsqueeze(0)?.f_le_tensor(&positions.f_unsqueeze(1)?)?.f_view([1, 1, c, start + c])?;
            let mut x = Tensor::f_embedding(&model.embed_tokens, &input, -1, false, false)?;
            for (layer, kv) in model.layers.iter().zip(cache.layers.iter_mut()) {
                // A one-row view of the slot: the layer writes positions start..start + c of this row in place.
                let mut row = LayerKv { k: kv.k.f_narrow(0, slot, 1)?, v: kv.v.f_narrow(0, slot, 1)? };
                x = layer.forward(&x, &cos, &sin, Attend::Mask(&mask), Some(KvWrite::At(&mut row, start)))?;
            }
            start += c;
            if start == t {
                let last = model.norm.forward(&x.f_narrow(1, c - 1, 1)?)?;
                return Ok(model.lm_head(&last)?.f_squeeze_dim(1)?);
            }
        }
    })
}

/// Prefills several contexts in one forward pass: packed end to end in one row (positions restarting at 0 with
/// each, attention within each), each one's keys and values written into its own slot (`slots[i]`, positions
/// `0..len`). Returns each context's f32 logits `[1, V]` at its last position. The caller keeps the total within
/// the prefill chunk; each context must fit its slot.
pub(crate) fn prefill_packed(
    model: &CausalLm,
    cache: &mut SlotCache,
    slots: &[i64],
    contexts: &[&[u32]],
) -> Result<Vec<Tensor>> {
    let lens: Vec<i64> = contexts.iter().map(|c| c.len() as i64).collect();
    if slots.len() != contexts.len() || lens.iter().any(|&l| l == 0 || l > cache.max_len) {
        return Err(ModelError::Generation(format!(
            "a packed prefill of contexts {lens:?} into slots {slots:?} does not fit slots of {} positions",
            cache.max_len
        )));
    }
    let total: i64 = lens.iter().sum();
    let kv_heads = model.config().num_key_value_heads;
    let device = model.device();
    let ids: Vec<i64> = contexts.iter().flat_map(|c| c.iter().map(|&id| i64::from(id))).collect();
    let positions: Vec<i64> = lens.iter().flat_map(|&l| 0..l).collect();
    let mut rows: Vec<i64> = Vec::with_capacity((total * kv_heads) as usize);
    for (&slot, &len) in slots.iter().zip(&lens) {
        for p in 0..len {
            rows.extend((0..kv_heads).map(|h| (slot * kv_heads + h) * cache.max_len + p));
        }
    }
    let mut last = Vec::with_capacity(lens.len());
    let mut end = 0;
    for &len in &lens {
        end += len;
        last.push(end - 1);
    }
    tch::no_grad(|| {
        let input = Tensor::from_slice(&ids).f_view([1, total])?.f_to_device(device)?;
        let positions = Tensor::from_slice(&positions).f_view([1, total])?.f_to_device(device)?;
        let rows = Tensor::from_slice(&rows).f_to_device(device)?;
        let (cos, sin) = model.rotary.cos_sin(&positions, model.dtype().kind())?;
        let mut x = Tensor::f_embedding(&model.embed_tokens, &input, -1, false, false)?;
        for (layer, kv) in model.layers.iter().zip(cache.layers.iter_mut()) {
            x = layer.forward(&x, &cos, &sin, Attend::Packed(&lens), Some(KvWrite::Scatter(kv, &rows)))?;
        }
        let last = Tensor::from_slice(&last).f_to_device(device)?;
        let ends = model.norm.forward(&x.f_index_select(1, &last)?)?;
        let logits = model.lm_head(&ends)?.f_squeeze_dim(0)?;
        Ok((0..lens.len() as i64).map(|i| logits.f_narrow(0, i, 1)).collect::<std::result::Result<Vec<_>, _>>()?)
    })
}

/// What the decode step precomputes once per engine: fused projection weights and the RoPE table.
///
/// Decoding one token per row on a small model is bound by the number of tensor operations, not by FLOPs, so
/// q/k/v become one matmul and gate/up another. The fused weights are not copies: [`fuse`] moves each layer's
/// parameters into the fused storage and points the original tensors at views of it, so a weight swap (which
/// copies into the original tensors) updates the fused weights too, and memory does not grow.
#[derive(Debug)]
pub(crate) struct Fused {
    layers: Vec<FusedLayer>,
    /// `[max_len, head_dim]` cos, and sin with its first half negated (`rotate_half(x) * sin` =
    /// `roll(x, D/2) * sin_signed`), computed with the model's own RoPE so values are bit-identical.
    cos: Tensor,
    sin_signed: Tensor,
}

#[derive(Debug)]
struct FusedLayer {
    /// `[q_out + 2 kv_out, hidden]` and its bias (Qwen2)
    qkv_weight: Tensor,
    qkv_bias: Option<Tensor>,
    /// `[2 intermediate, hidden]`, or `None` when the MLP has biases (Llama `mlp_bias`: kept unfused)
    gate_up_weight: Option<Tensor>,
}

/// Moves q/k/v and gate/up weights of every layer into fused tensors (see [`Fused`]) and builds the RoPE table.
pub(crate) fn fuse(model: &mut CausalLm, max_len: i64) -> Result<Fused> {
    let kind = model.dtype().kind();
    let device = model.device();
    let mut layers = Vec::with_capacity(model.layers.len());
    tch::no_grad(|| -> Result<()> {
        for layer in &mut model.layers {
            let attn = &mut layer.self_attn;
            let parts = [&mut attn.q_proj, &mut attn.k_proj, &mut attn.v_proj];
            let qkv_weight = share(parts.map(|l| &mut l.weight))?;
            let [q, k, v] = [&mut attn.q_proj, &mut attn.k_proj, &mut attn.v_proj];
            let qkv_bias = match (&mut q.bias, &mut k.bias, &mut v.bias) {
                (Some(qb), Some(kb), Some(vb)) => Some(share([qb, kb, vb])?),
                _ => None,
            };
            let gate_up_weight = match &mut layer.mlp {
                FeedForward::Dense(mlp) if mlp.gate_proj.bias.is_none() && mlp.up_proj.bias.is_none() => {
                    Some(share([&mut mlp.gate_proj.weight, &mut mlp.up_proj.weight])?)
                }
                _ => None,
            };
            layers.push(FusedLayer { qkv_weight, qkv_bias, gate_up_weight });
        }
        Ok(())
    })?;
    let positions = Tensor::f_arange(max_len, (Kind::Int64, device))?.f_unsqueeze(0)?;
    let (cos, sin) = model.rotary.cos_sin(&positions, kind)?;
    let d = model.config().head_dim;
    let half = d / 2;
    let sign = Tensor::f_cat(
        &[Tensor::f_full([half], -1.0, (kind, device))?, Tensor::f_ones([d - half], (kind, device))?],
        0,
    )?;
    Ok(Fused { layers, cos: cos.f_view([max_len, d])?, sin_signed: sin.f_mul(&sign)?.f_view([max_len, d])? })
}

/// Concatenates `parts` along dim 0 into new storage and re-points each part at its slice of it.
fn share<const N: usize>(parts: [&mut Tensor; N]) -> Result<Tensor> {
    let fused = Tensor::f_cat(&parts.iter().map(|p| p.shallow_clone()).collect::<Vec<_>>(), 0)?;
    let mut offset = 0;
    for part in parts {
        let rows = part.size().first().copied().unwrap_or(0);
        part.f_set_data(&fused.f_narrow(0, offset, rows)?)?;
        offset += rows;
    }
    Ok(fused)
}

/// The input of every decode step, refilled in place before it runs (a captured CUDA graph reads exactly these
/// memory locations): one int64 tensor on the model's device holding, for a step over `b` slots, the slots'
/// newest tokens `[0, b)`, their positions `[b, 2b)` and the flat KV cache row each (slot, kv head) writes at
/// `[2b, 2b + b * kv_heads)`. The layout depends on `b` only, as a graph does.
#[derive(Debug)]
pub(crate) struct DecodeInputs {
    values: Tensor,
    kv_heads: i64,
    max_len: i64,
}

impl DecodeInputs {
    pub(crate) fn new(model: &CausalLm, slots: i64, max_len: i64) -> Result<Self> {
        let kv_heads = model.config().num_key_value_heads;
        let values = Tensor::f_zeros([slots * (2 + kv_heads)], (Kind::Int64, model.device()))?;
        Ok(DecodeInputs { values, kv_heads, max_len })
    }

    /// Writes a step over `ids.len()` slots. On CUDA the values go through pinned memory with a non-blocking
    /// copy, ordered before the decode on the same stream; the host does not wait.
    pub(crate) fn fill(&mut self, ids: &[i64], positions: &[i64]) -> Result<()> {
        let b = ids.len() as i64;
        let mut host = Vec::with_capacity(ids.len() * (2 + self.kv_heads as usize));
        host.extend_from_slice(ids);
        host.extend_from_slice(positions);
        for (slot, &position) in positions.iter().enumerate() {
            let first = slot as i64 * self.kv_heads;
            host.extend((first..first + self.kv_heads).map(|row| row * self.max_len + position));
        }
        let host = Tensor::from_slice(&host);
        let device = self.values.device();
        let staged = match device {
            Device::Cpu => host,
            _ => host.f_pin_memory(device)?.f_to_device_(device, Kind::Int64, true, false)?,
        };
        self.values.f_narrow(0, 0, b * (2 + self.kv_heads))?.f_copy_(&staged)?;
        Ok(())
    }

    /// Overwrites the tokens of `slots` (int64 on the device) in a step over `b` slots with `tokens`, on the
    /// device: the newest tokens of sequences whose last sample the host has not read yet.
    pub(crate) fn set_ids(&mut self, b: i64, slots: &Tensor, tokens: &Tensor) -> Result<()> {
        let _ = self.values.f_narrow(0, 0, b)?.f_index_copy_(0, slots, tokens)?;
        Ok(())
    }

    fn ids(&self, b: i64) -> Result<Tensor> {
        Ok(self.values.f_narrow(0, 0, b)?)
    }

    fn positions(&self, b: i64) -> Result<Tensor> {
        Ok(self.values.f_narrow(0, b, b)?)
    }

    fn cache_rows(&self, b: i64) -> Result<Tensor> {
        Ok(self.values.f_narrow(0, 2 * b, b * self.kv_heads)?)
    }
}

/// One decode step over slots `0..batch` of `inputs`: each slot's token is written into its KV row at its
/// position, and the slot attends to its own positions `0..=position` within the first `width` of the row.
/// Returns f32 logits `[batch, V]`. Every shape is fixed by `(batch, width)` and nothing reads the host, so one
/// CUDA graph per `(batch, width)` replays it. A slot that holds no decoding sequence is given the position
/// `max_len - 1`, which no context reaches (a context leaves at least one position free): its garbage lands
/// where its own next sequence writes before it reads.
///
/// Written for per-step overhead (the loop a rollout spends its time in): fused projections, a RoPE table
/// lookup, one new token per slot so `[B, 1, heads, D]` is viewed as `[B, heads, 1, D]` without a transpose, and
/// keys and values written with one `index_copy_` each over a flat view of the cache.
pub(crate) fn decode(
    model: &CausalLm,
    fused: &Fused,
    cache: &mut SlotCache,
    inputs: &DecodeInputs,
    batch: i64,
    width: i64,
) -> Result<Tensor> {
    if batch <= 0 || batch > cache.slots || width <= 0 || width > cache.max_len {
        return Err(ModelError::Generation(format!(
            "decode step of {batch} slots over {width} positions does not fit {} slots of {} positions",
            cache.slots, cache.max_len
        )));
    }
    let head_dim = model.config().head_dim;
    let b = batch;
    let device = model.device();
    tch::no_grad(|| {
        let input = inputs.ids(b)?.f_view([b, 1])?;
        let pos = inputs.positions(b)?;
        let cos = fused.cos.f_index_select(0, &pos)?.f_view([b, 1, 1, head_dim])?;
        let sin_signed = fused.sin_signed.f_index_select(0, &pos)?.f_view([b, 1, 1, head_dim])?;
        // Slot r may attend to key positions 0..=pos[r].
        let mask = Tensor::f_arange(width, (Kind::Int64, device))?
            .f_unsqueeze(0)?
            .f_le_tensor(&pos.f_unsqueeze(1)?)?
            .f_view([b, 1, 1, width])?;
        let slots = inputs.cache_rows(b)?;
        let step =
            DecodeStep { mask: &mask, slots: &slots, cos: &cos, sin_signed: &sin_signed, b, width, half: head_dim / 2 };
        let mut x = Tensor::f_embedding(&model.embed_tokens, &input, -1, false, false)?;
        for ((layer, f), kv) in model.layers.iter().zip(&fused.layers).zip(cache.layers.iter_mut()) {
            let attn = decode_attention(&layer.self_attn, f, &norm(&layer.input_layernorm, &x)?, kv, &step)?;
            x = x.f_add(&attn)?;
            let h = norm(&layer.post_attention_layernorm, &x)?;
            let mlp = match (&f.gate_up_weight, &layer.mlp) {
                (Some(w), FeedForward::Dense(mlp)) => {
                    let inter = w.size()[0] / 2;
                    let gate_up = h.f_linear(w, None::<&Tensor>)?;
                    let act = gate_up.f_narrow(-1, 0, inter)?.f_silu()?.f_mul(&gate_up.f_narrow(-1, inter, inter)?)?;
                    mlp.down_proj.forward(&act)?
                }
                (_, ffn) => ffn.forward(&h)?,
            };
            x = x.f_add(&mlp)?;
        }
        Ok(model.lm_head(&norm(&model.norm, &x)?)?.f_squeeze_dim(1)?)
    })
}

/// The model's RMSNorm; in f32 its two dtype casts are no-ops and are skipped (same ops, same rounding).
fn norm(norm: &RmsNorm, x: &Tensor) -> Result<Tensor> {
    if x.kind() != Kind::Float {
        return norm.forward(x);
    }
    let variance = x.f_pow_tensor_scalar(2)?.f_mean_dim(-1, true, Kind::Float)?;
    Ok(norm.weight.f_mul(&x.f_mul(&variance.f_add_scalar(norm.eps)?.f_rsqrt()?)?)?)
}

/// What every layer of one decode step shares.
struct DecodeStep<'a> {
    /// `[B, 1, 1, width]` bool
    mask: &'a Tensor,
    /// `[B * kv_heads]` rows of the flat cache view to write
    slots: &'a Tensor,
    /// `[B, 1, 1, D]`
    cos: &'a Tensor,
    sin_signed: &'a Tensor,
    b: i64,
    width: i64,
    half: i64,
}

/// `x * cos + rotate_half(x) * sin`, as `x * cos + roll(x, D/2) * sin_signed`.
fn rotary(x: &Tensor, step: &DecodeStep) -> Result<Tensor> {
    Ok(x.f_mul(step.cos)?.f_add(&x.f_roll([step.half], [-1])?.f_mul(step.sin_signed)?)?)
}

/// The attention block of [`Attention::forward`] for one new token per row at per-row positions.
fn decode_attention(
    attn: &Attention,
    fused: &FusedLayer,
    x: &Tensor,
    kv: &mut LayerKv,
    step: &DecodeStep,
) -> Result<Tensor> {
    let (b, d) = (step.b, attn.head_dim);
    let (q_out, kv_out) = (attn.num_heads * d, attn.num_kv_heads * d);
    let qkv = x.f_linear(&fused.qkv_weight, fused.qkv_bias.as_ref())?;
    let q = qkv.f_narrow(-1, 0, q_out)?.f_view([b, attn.num_heads, 1, d])?;
    let k = qkv.f_narrow(-1, q_out, kv_out)?.f_view([b, attn.num_kv_heads, 1, d])?;
    let v = qkv.f_narrow(-1, q_out + kv_out, kv_out)?;
    let q = match &attn.q_norm {
        Some(norm) => norm.forward(&q)?,
        None => q,
    };
    let k = match &attn.k_norm {
        Some(norm) => norm.forward(&k)?,
        None => k,
    };
    let q = rotary(&q, step)?;
    let k = rotary(&k, step)?;
    for (cache, new) in [(&mut kv.k, &k), (&mut kv.v, &v)] {
        let (s, h, l, _) = cache.size4()?;
        let mut flat = cache.f_view([s * h * l, d])?;
        let _ = flat.f_index_copy_(0, step.slots, &new.f_reshape([b * attn.num_kv_heads, d])?)?;
    }
    let keys = kv.k.f_narrow(0, 0, b)?.f_narrow(2, 0, step.width)?;
    let values = kv.v.f_narrow(0, 0, b)?.f_narrow(2, 0, step.width)?;
    let scale = 1.0 / (d as f64).sqrt();
    // Grouped heads without repeating keys and values: with one query token, the query heads that share a kv head
    // are that head's queries (head h reads kv head h / group, as the training forward's repeat does), so
    // `[B, heads, 1, D]` is `[B, kv_heads, group, D]` against `[B, kv_heads, width, D]`. The mask `[B, 1, 1,
    // width]` broadcasts over both. With a mask, SDPA runs its memory-efficient kernel on CUDA (flash takes no
    // mask) and its math kernel on the CPU.
    let group = attn.num_heads / attn.num_kv_heads;
    let q = q.f_reshape([b, attn.num_kv_heads, group, d])?;
    let y = Tensor::f_scaled_dot_product_attention(&q, &keys, &values, Some(step.mask), 0.0, false, scale, false)?;
    attn.o_proj.forward(&y.f_reshape([b, 1, attn.num_heads * d])?)
}
