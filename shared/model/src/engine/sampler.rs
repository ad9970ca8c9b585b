//! One sampling step for a batch of rows, each with its own parameters and its own random stream.
//!
//! Order (vLLM's): repetition penalty → temperature → top-k → top-p → draw. A draw is the inverse CDF at one
//! uniform number per row from the row's seeded stream, so a sequence's tokens depend on its seed and its
//! logits only, not on which other sequences share the batch. Greedy rows take the argmax at temperature 1.
//!
//! The log-prob returned per token follows [`LogprobsMode`]: `Processed` (vLLM's and verl's
//! `processed_logprobs`) is the log-prob under the distribution actually sampled from — after penalty,
//! temperature and truncation; with verl's defaults (top-p 1, top-k off, no penalty) this is
//! `log_softmax(logits / T)`, what the trainer recomputes. `Raw` is `log_softmax(logits)` before any processing.

use tch::{Device, Kind, Tensor};

use crate::engine::LogprobsMode;
use crate::error::Result;

/// Per-row sampling settings of one step.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RowSampling {
    pub(crate) temperature: f32,
    pub(crate) top_p: f32,
    pub(crate) top_k: i64,
    pub(crate) repetition_penalty: f32,
}

impl RowSampling {
    pub(crate) fn greedy(&self) -> bool {
        self.temperature == 0.0
    }

    fn truncates(&self, vocab: i64) -> bool {
        !self.greedy() && ((self.top_k > 0 && self.top_k < vocab) || self.top_p < 1.0)
    }
}

/// Picks one token per row of f32 `logits` `[B, V]`: int64 tokens and f32 log-probs `[B]`, left on the logits'
/// device (the engine reads them when it needs them, not at every step). `uniforms[r]` in (0, 1] drives row r's
/// draw; `presence` `[B, V]` bool marks tokens already in row r's context (needed only when some row has a
/// penalty).
pub(crate) fn sample(
    logits: &Tensor,
    rows: &[RowSampling],
    uniforms: &[f64],
    presence: Option<&Tensor>,
    mode: LogprobsMode,
) -> Result<(Tensor, Tensor)> {
    let b = rows.len() as i64;
    let (_, vocab) = logits.size2()?;
    let device = logits.device();
    let host = |t: Tensor| -> Result<Tensor> { Ok(if device == Device::Cpu { t } else { t.f_to_device(device)? }) };
    let column = |values: Vec<f32>| -> Result<Tensor> { host(Tensor::from_slice(&values).f_view([b, 1])?) };
    let raw = logits.f_to_kind(Kind::Float)?;
    let mut processed = raw.shallow_clone();
    if let Some(presence) = presence.filter(|_| rows.iter().any(|r| r.repetition_penalty != 1.0)) {
        let penalty = column(rows.iter().map(|r| r.repetition_penalty).collect())?;
        let penalized = processed.f_div(&penalty)?.f_where_self(&processed.f_gt(0.0)?, &processed.f_mul(&penalty)?)?;
        processed = penalized.f_where_self(presence, &processed)?;
    }
    let greedy_count = rows.iter().filter(|r| r.greedy()).count();
    if rows.iter().any(|r| !r.greedy() && r.temperature != 1.0) {
        let temperatures = column(rows.iter().map(|r| if r.greedy() { 1.0 } else { r.temperature }).collect())?;
        processed = processed.f_div(&temperatures)?;
    }
    // Greedy rows of a mixed batch take index 0 of the sorted order, or the argmax.
    let greedy_mask = if greedy_count > 0 && greedy_count < rows.len() {
        let flags: Vec<bool> = rows.iter().map(RowSampling::greedy).collect();
        Some(host(Tensor::from_slice(&flags).f_view([b, 1])?)?)
    } else {
        None
    };
    let u = || -> Result<Tensor> { host(Tensor::from_slice(uniforms).f_view([b, 1])?) };

    let (tokens, chosen) = if greedy_count == rows.len() {
        let tokens = processed.f_argmax(-1, true)?;
        let chosen = processed.f_log_softmax(-1, Kind::Float)?.f_gather(1, &tokens, false)?;
        (tokens, chosen)
    } else if !rows.iter().any(|r| r.truncates(vocab)) {
        let log_probs = processed.f_log_softmax(-1, Kind::Float)?;
        let mut tokens = draw(&log_probs, &u()?)?;
        if let Some(greedy) = &greedy_mask {
            tokens = processed.f_argmax(-1, true)?.f_where_self(greedy, &tokens)?;
        }
        let chosen = log_probs.f_gather(1, &tokens, false)?;
        (tokens, chosen)
    } else {
        // Truncation happens in descending order (stable, so ties keep argmax's first-index choice).
        let (mut sorted, order) = processed.f_sort_stable(true, -1, true)?;
        let off = |r: &RowSampling| r.greedy() || !r.truncates(vocab);
        let k: Vec<i64> =
            rows.iter().map(|r| if off(r) || r.top_k <= 0 || r.top_k >= vocab { vocab } else { r.top_k }).collect();
        let ranks = Tensor::f_arange(vocab, (Kind::Int64, device))?.f_unsqueeze(0)?;
        let k = host(Tensor::from_slice(&k).f_view([b, 1])?)?;
        sorted = sorted.f_masked_fill(&ranks.f_ge_tensor(&k)?, f64::NEG_INFINITY)?;
        if rows.iter().any(|r| !off(r) && r.top_p < 1.0) {
            // HF and vLLM drop a token once the mass ranked above it reaches p (the top token always stays).
            let p = column(rows.iter().map(|r| if off(r) || r.top_p >= 1.0 { 2.0 } else { r.top_p }).collect())?;
            let probs = sorted.f_softmax(-1, Kind::Float)?;
            let before = probs.f_cumsum(-1, Kind::Float)?.f_sub(&probs)?;
            sorted = sorted.f_masked_fill(&before.f_ge_tensor(&p)?, f64::NEG_INFINITY)?;
        }
        let log_probs = sorted.f_log_softmax(-1, Kind::Float)?;
        let mut index = draw(&log_probs, &u()?)?;
        if let Some(greedy) = &greedy_mask {
            index = index.f_zeros_like()?.f_where_self(greedy, &index)?;
        }
        (order.f_gather(1, &index, false)?, log_probs.f_gather(1, &index, false)?)
    };
    let chosen = match mode {
        LogprobsMode::Processed => chosen,
        LogprobsMode::Raw => raw.f_log_softmax(-1, Kind::Float)?.f_gather(1, &tokens, false)?,
    };
    Ok((tokens.f_view([b])?, chosen.f_view([b])?))
}

/// Inverse-CDF draw `[B, 1]`: the first index whose cumulative probability reaches `u × total`. Tokens of zero
/// probability are never picked (their CDF equals their predecessor's); f64 keeps the tail of a large
/// vocabulary from rounding away.
fn draw(log_probs: &Tensor, u: &Tensor) -> Result<Tensor> {
    let (_, vocab) = log_probs.size2()?;
    let cdf = log_probs.f_exp()?.f_cumsum(-1, Kind::Double)?;
    let total = cdf.f_narrow(1, vocab - 1, 1)?;
    let target = u.f_mul(&total)?;
    Ok(target.f_searchsorted(&cdf, false, false, "left", None::<Tensor>)?.f_clamp_max(vocab - 1)?)
}
