//! Batched sampling with the KV cache, and the log-probabilities a trainer recomputes.
//!
//! The behaviour log-prob recorded for each sampled token is `log_softmax(logits / T)` over the full vocabulary
//! (T = 1 for greedy), before any top-k/top-p truncation: the quantity a trainer recomputes with
//! [`CausalLm::forward`] and [`token_log_probs`] on the same weights, so off-policy corrections compare like
//! with like.

use tch::{Device, Kind, Tensor};

use crate::error::{ModelError, Result};
use crate::model::CausalLm;

/// How one row is sampled.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; 0 means greedy (argmax, log-probs at T = 1).
    pub temperature: f32,
    /// Nucleus mass kept, in (0, 1]; 1 disables.
    pub top_p: f32,
    /// Most likely tokens kept; `<= 0` disables.
    pub top_k: i64,
    /// Tokens generated at most (the stop token counts).
    pub max_new_tokens: usize,
    /// Extra ids that end this row, besides the model's EOS ids.
    pub stop_token_ids: Vec<u32>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams { temperature: 1.0, top_p: 1.0, top_k: -1, max_new_tokens: 256, stop_token_ids: Vec::new() }
    }
}

/// Why a row stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// It produced an EOS or stop token (the last element of `tokens`).
    Stop,
    /// It reached `max_new_tokens`.
    Length,
}

/// One row's output.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    pub tokens: Vec<u32>,
    /// `logprobs[i]` = log-prob of `tokens[i]` under `log_softmax(logits / T)`, f32.
    pub logprobs: Vec<f32>,
    pub finish: FinishReason,
}

impl SamplingParams {
    fn validate(&self, row: usize) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(ModelError::Generation(format!(
                "row {row}: temperature must be finite and >= 0, got {}",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(ModelError::Generation(format!("row {row}: top_p must be in (0, 1], got {}", self.top_p)));
        }
        Ok(())
    }

    fn greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// Samples continuations for a batch of prompts, each row with its own parameters (`params` has one entry per
/// prompt, or a single entry for all). Rows are left-padded into one batch and decoded together with a KV
/// cache; each row stops at its own EOS (`eos_ids`) or stop token, which is included in its tokens. Runs
/// without autograd; sampling uses torch's generator on the model's device (seed it with `tch::manual_seed`).
pub fn generate(
    model: &CausalLm,
    prompts: &[Vec<u32>],
    params: &[SamplingParams],
    eos_ids: &[u32],
) -> Result<Vec<Generation>> {
    if prompts.is_empty() {
        return Ok(Vec::new());
    }
    if params.len() != prompts.len() && params.len() != 1 {
        return Err(ModelError::Generation(format!(
            "{} prompts but {} sampling parameter sets (give one per prompt, or one for all)",
            prompts.len(),
            params.len()
        )));
    }
    let row_params: Vec<&SamplingParams> =
        (0..prompts.len()).map(|i| if params.len() == 1 { &params[0] } else { &params[i] }).collect();
    let vocab = model.config().vocab_size;
    for (i, (prompt, p)) in prompts.iter().zip(&row_params).enumerate() {
        p.validate(i)?;
        if prompt.is_empty() {
            return Err(ModelError::Generation(format!("row {i}: the prompt is empty")));
        }
        if let Some(bad) = prompt.iter().find(|&&id| i64::from(id) >= vocab) {
            return Err(ModelError::Generation(format!("row {i}: token id {bad} is outside the vocabulary ({vocab})")));
        }
    }
    tch::no_grad(|| decode(model, prompts, &row_params, eos_ids))
}

fn decode(
    model: &CausalLm,
    prompts: &[Vec<u32>],
    params: &[&SamplingParams],
    eos_ids: &[u32],
) -> Result<Vec<Generation>> {
    let device = model.device();
    let batch = prompts.len();
    let b = batch as i64;
    let prompt_lens: Vec<i64> = prompts.iter().map(|p| p.len() as i64).collect();
    let width = prompt_lens.iter().copied().max().unwrap_or(0);
    let max_new = params.iter().map(|p| p.max_new_tokens).max().unwrap_or(0);
    let mut out = vec![Generation { tokens: Vec::new(), logprobs: Vec::new(), finish: FinishReason::Length }; batch];
    let mut done: Vec<bool> = params.iter().map(|p| p.max_new_tokens == 0).collect();
    if done.iter().all(|&d| d) {
        return Ok(out);
    }
    let total = width + max_new as i64;

    // Left padding puts every row's last prompt token in the same column, so one slice gives the next logits.
    let mut ids = vec![0i64; batch * width as usize];
    let mut mask = vec![0i64; batch * total as usize];
    for (r, prompt) in prompts.iter().enumerate() {
        let pad = (width - prompt_lens[r]) as usize;
        for (j, &id) in prompt.iter().enumerate() {
            ids[r * width as usize + pad + j] = i64::from(id);
            mask[r * total as usize + pad + j] = 1;
        }
    }
    let key_mask = Tensor::from_slice(&mask).f_view([b, total])?.f_to_device(device)?;
    let prompt_ids = Tensor::from_slice(&ids).f_view([b, width])?.f_to_device(device)?;
    let prompt_mask = key_mask.f_narrow(1, 0, width)?;
    let positions = prompt_mask.f_cumsum(1, Kind::Int64)?.f_sub_scalar(1)?.f_clamp_min(0)?;
    let mut cache = model.new_cache(b, total)?;
    let hidden = model.forward_step_hidden(&prompt_ids, &positions, &mut cache, &prompt_mask)?;
    let mut logits = model.lm_head(&hidden.f_narrow(1, width - 1, 1)?)?.f_squeeze_dim(1)?;

    let sampler = Sampler::new(params, model.config().vocab_size, device)?;
    let mut next_positions = prompt_lens;
    for step in 0..max_new {
        let (tokens, logprobs) = sampler.sample(&logits)?;
        for r in 0..batch {
            if done[r] {
                continue;
            }
            let token = u32::try_from(tokens[r])
                .map_err(|_| ModelError::Generation(format!("sampled an invalid token id {}", tokens[r])))?;
            out[r].tokens.push(token);
            out[r].logprobs.push(logprobs[r]);
            if eos_ids.contains(&token) || params[r].stop_token_ids.contains(&token) {
                out[r].finish = FinishReason::Stop;
                done[r] = true;
            } else if out[r].tokens.len() >= params[r].max_new_tokens {
                done[r] = true;
            }
        }
        if done.iter().all(|&d| d) {
            break;
        }
        // Finished rows keep decoding in lockstep (their output is discarded); their new slots are masked out.
        let slot = width + step as i64;
        let active: Vec<i64> = done.iter().map(|&d| i64::from(!d)).collect();
        key_mask.f_narrow(1, slot, 1)?.f_copy_(&Tensor::from_slice(&active).f_view([b, 1])?)?;
        let step_ids = Tensor::from_slice(&tokens).f_view([b, 1])?.f_to_device(device)?;
        let step_positions = Tensor::from_slice(&next_positions).f_view([b, 1])?.f_to_device(device)?;
        for p in &mut next_positions {
            *p += 1;
        }
        let hidden =
            model.forward_step_hidden(&step_ids, &step_positions, &mut cache, &key_mask.f_narrow(1, 0, slot + 1)?)?;
        logits = model.lm_head(&hidden)?.f_squeeze_dim(1)?;
    }
    Ok(out)
}

/// Per-row sampling settings as tensors, built once per batch.
struct Sampler {
    /// `[B, 1]` f32: the row's temperature, 1 for greedy rows.
    temperatures: Tensor,
    /// `[B]` bool, when some rows are greedy and others sample.
    greedy: Option<Tensor>,
    any_sampled: bool,
    /// `[B, 1]` i64 keep-counts (vocab size where off), when any row uses top-k.
    top_k: Option<Tensor>,
    /// `[B, 1]` f32 nucleus mass (2 where off), when any row uses top-p.
    top_p: Option<Tensor>,
    vocab: i64,
}

impl Sampler {
    fn new(params: &[&SamplingParams], vocab: i64, device: Device) -> Result<Self> {
        let b = params.len() as i64;
        let column_f32 = |values: Vec<f32>| -> Result<Tensor> {
            Ok(Tensor::from_slice(&values).f_view([b, 1])?.f_to_device(device)?)
        };
        let temperatures = column_f32(params.iter().map(|p| if p.greedy() { 1.0 } else { p.temperature }).collect())?;
        let greedy_rows: Vec<bool> = params.iter().map(|p| p.greedy()).collect();
        let any_sampled = greedy_rows.iter().any(|&g| !g);
        let greedy = if any_sampled && greedy_rows.iter().any(|&g| g) {
            Some(Tensor::from_slice(&greedy_rows).f_to_device(device)?)
        } else {
            None
        };
        let sampled = || params.iter().filter(|p| !p.greedy());
        let top_k = if sampled().any(|p| p.top_k > 0 && p.top_k < vocab) {
            let ks: Vec<i64> =
                params.iter().map(|p| if p.top_k > 0 && p.top_k < vocab { p.top_k } else { vocab }).collect();
            Some(Tensor::from_slice(&ks).f_view([b, 1])?.f_to_device(device)?)
        } else {
            None
        };
        let top_p = if sampled().any(|p| p.top_p < 1.0) {
            Some(column_f32(params.iter().map(|p| if p.top_p < 1.0 { p.top_p } else { 2.0 }).collect())?)
        } else {
            None
        };
        Ok(Sampler { temperatures, greedy, any_sampled, top_k, top_p, vocab })
    }

    /// Picks one token per row from f32 logits `[B, V]`; returns the tokens and their log-probs under the
    /// untruncated tempered distribution.
    fn sample(&self, logits: &Tensor) -> Result<(Vec<i64>, Vec<f32>)> {
        let scaled = logits.f_to_kind(Kind::Float)?.f_div(&self.temperatures)?;
        let log_probs = scaled.f_log_softmax(-1, Kind::Float)?;
        let argmax = scaled.f_argmax(-1, false)?;
        let tokens = if self.any_sampled {
            let probs = self.truncate(&scaled)?.f_softmax(-1, Kind::Float)?;
            let sampled = probs.f_multinomial(1, false)?.f_squeeze_dim(1)?;
            match &self.greedy {
                Some(greedy) => argmax.f_where_self(greedy, &sampled)?,
                None => sampled,
            }
        } else {
            argmax
        };
        let chosen = log_probs.f_gather(1, &tokens.f_unsqueeze(1)?, false)?.f_squeeze_dim(1)?;
        let tokens = Vec::<i64>::try_from(tokens.f_to_device(Device::Cpu)?)?;
        let chosen = Vec::<f32>::try_from(chosen.f_to_device(Device::Cpu)?)?;
        Ok((tokens, chosen))
    }

    /// Masks logits outside each row's top-k, then outside its top-p nucleus (of the renormalised top-k).
    fn truncate(&self, scaled: &Tensor) -> Result<Tensor> {
        if self.top_k.is_none() && self.top_p.is_none() {
            return Ok(scaled.shallow_clone());
        }
        let (mut sorted, order) = scaled.f_sort(-1, true)?;
        if let Some(k) = &self.top_k {
            let ranks = Tensor::f_arange(self.vocab, (Kind::Int64, scaled.device()))?.f_unsqueeze(0)?;
            sorted = sorted.f_masked_fill(&ranks.f_ge_tensor(k)?, f64::NEG_INFINITY)?;
        }
        if let Some(p) = &self.top_p {
            let probs = sorted.f_softmax(-1, Kind::Float)?;
            // Mass strictly before each token: the first token is always kept.
            let before = probs.f_cumsum(-1, Kind::Float)?.f_sub(&probs)?;
            sorted = sorted.f_masked_fill(&before.f_gt_tensor(p)?, f64::NEG_INFINITY)?;
        }
        Ok(scaled.f_scatter(-1, &order, &sorted)?)
    }
}

/// `out[b, t] = log_softmax(logits[b, t] / temperature)[input_ids[b, t + 1]]`, shape `[B, T - 1]`, f32 and
/// differentiable: the trainer's recomputation of behaviour log-probs. A temperature of 0 (greedy) counts as 1.
pub fn token_log_probs(logits: &Tensor, input_ids: &Tensor, temperature: f64) -> Result<Tensor> {
    let (b, t, _) = logits.size3()?;
    if input_ids.size() != [b, t] {
        return Err(ModelError::Input(format!(
            "input_ids has shape {:?}, logits {:?}: expected input_ids [{b}, {t}]",
            input_ids.size(),
            logits.size()
        )));
    }
    if t < 2 {
        return Ok(Tensor::f_zeros([b, 0], (Kind::Float, logits.device()))?);
    }
    let mut predictions = logits.f_narrow(1, 0, t - 1)?.f_to_kind(Kind::Float)?;
    if temperature > 0.0 && temperature != 1.0 {
        predictions = predictions.f_div_scalar(temperature)?;
    }
    let targets = input_ids.f_narrow(1, 1, t - 1)?.f_to_device(logits.device())?.f_to_kind(Kind::Int64)?;
    Ok(predictions.f_log_softmax(-1, Kind::Float)?.f_gather(-1, &targets.f_unsqueeze(-1)?, false)?.f_squeeze_dim(-1)?)
}

/// `out[t] = log p(ids[t + 1] | ids[..=t])` in f32 for one unpadded sequence (`ids.len() - 1` values).
pub fn log_probs_of(model: &CausalLm, ids: &[u32]) -> Result<Vec<f32>> {
    if ids.len() < 2 {
        return Ok(Vec::new());
    }
    let vocab = model.config().vocab_size;
    if let Some(bad) = ids.iter().find(|&&id| i64::from(id) >= vocab) {
        return Err(ModelError::Input(format!("token id {bad} is outside the vocabulary ({vocab})")));
    }
    tch::no_grad(|| {
        let ids: Vec<i64> = ids.iter().map(|&id| i64::from(id)).collect();
        let input = Tensor::from_slice(&ids).f_unsqueeze(0)?;
        let mask = input.f_ones_like()?;
        let logits = model.forward(&input, &mask)?;
        let out = token_log_probs(&logits, &input, 1.0)?.f_squeeze_dim(0)?;
        Ok(Vec::<f32>::try_from(out.f_to_device(Device::Cpu)?)?)
    })
}
