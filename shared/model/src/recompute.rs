//! The log-probabilities a trainer recomputes: `log_softmax(logits / T)` of the tokens a sequence holds, on the
//! training forward ([`CausalLm::forward`]). The rollout engine records the same quantity for each sampled token
//! (see [`crate::engine`]), so off-policy corrections compare like with like.

use tch::{Device, Kind, Tensor};

use crate::error::{ModelError, Result};
use crate::model::CausalLm;

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
