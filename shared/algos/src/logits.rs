//! Per-token quantities from logits `[.., vocab]`: entropy, log-probabilities of chosen ids, and Σπ².
//! Half-precision logits are promoted to f32 first (softmax and log-softmax in bf16 lose too much).

use tch::{Kind, Tensor};

use crate::AlgoError;

/// The logits in at least f32.
fn promoted(logits: &Tensor) -> Tensor {
    match logits.kind() {
        Kind::Half | Kind::BFloat16 => logits.to_kind(Kind::Float),
        _ => logits.shallow_clone(),
    }
}

fn check_logits(logits: &Tensor) -> Result<(), AlgoError> {
    if logits.dim() == 0 {
        return Err(AlgoError::Logits("logits must have a vocabulary dimension, got a scalar".into()));
    }
    crate::util::check_float("logits", logits).map_err(AlgoError::Logits)
}

/// Entropy of the categorical distribution of every position: `logsumexp(z) − Σ softmax(z)·z`.
pub fn entropy_from_logits(logits: &Tensor) -> Tensor {
    let z = promoted(logits);
    let probs = z.softmax(-1, None::<Kind>);
    z.logsumexp(-1, false) - (&probs * &z).sum_dim_intlist(-1, false, None::<Kind>)
}

/// [`entropy_from_logits`] for logits of untrusted kind and rank.
pub fn f_entropy_from_logits(logits: &Tensor) -> Result<Tensor, AlgoError> {
    check_logits(logits)?;
    Ok(entropy_from_logits(logits))
}

/// `log softmax(z)[id]` for every position (`ids` has the shape of `logits` without the last dimension).
///
/// Panics like a tensor op on an id outside the vocabulary; [`f_logprobs_from_logits`] checks first.
pub fn logprobs_from_logits(logits: &Tensor, ids: &Tensor) -> Tensor {
    let z = promoted(logits);
    let chosen = z.gather(-1, &ids.to_kind(Kind::Int64).unsqueeze(-1), false).squeeze_dim(-1);
    chosen - z.logsumexp(-1, false)
}

/// [`logprobs_from_logits`] for inputs of untrusted shape and range.
pub fn f_logprobs_from_logits(logits: &Tensor, ids: &Tensor) -> Result<Tensor, AlgoError> {
    check_logits(logits)?;
    let size = logits.size();
    let (lead, vocab) = size.split_at(size.len() - 1);
    if ids.size() != lead {
        return Err(AlgoError::Logits(format!(
            "ids must have shape {lead:?} (logits without the vocab dimension), got {:?}",
            ids.size()
        )));
    }
    if ids.device() != logits.device() {
        return Err(AlgoError::Logits(format!("ids are on {:?}, logits on {:?}", ids.device(), logits.device())));
    }
    if ids.numel() > 0 {
        let ids = ids.to_kind(Kind::Int64);
        let (lo, hi) = (crate::util::item(&ids.min()), crate::util::item(&ids.max()));
        if lo < 0.0 || hi >= vocab[0] as f64 {
            return Err(AlgoError::Logits(format!("ids must be in [0, {}), got values in [{lo}, {hi}]", vocab[0])));
        }
    }
    Ok(logprobs_from_logits(logits, ids))
}

/// `Σ_v π_v²` per position, the path-variance ingredient of the optimal-token-baseline estimators.
pub fn sum_pi_squared_from_logits(logits: &Tensor) -> Tensor {
    promoted(logits).softmax(-1, None::<Kind>).square().sum_dim_intlist(-1, false, None::<Kind>)
}
