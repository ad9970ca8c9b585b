//! Per-token quantities from logits `[.., vocab]`: entropy, log-probabilities of chosen ids, and Σπ².
//! Half-precision logits are promoted to f32 first (softmax and log-softmax in bf16 lose too much). Without
//! autograd (scoring a batch: π_old, the reference, metrics) the positions are taken [`CHUNK_ELEMENTS`] logits at
//! a time, so no `[tokens × vocab]` f32 copy and softmax exist at once; with autograd the backward pass needs the
//! whole promoted tensor anyway, and it is computed in one piece.

use tch::{Kind, Tensor};

use crate::AlgoError;

/// The logits in at least f32.
fn promoted(logits: &Tensor) -> Tensor {
    match logits.kind() {
        Kind::Half | Kind::BFloat16 => logits.to_kind(Kind::Float),
        _ => logits.shallow_clone(),
    }
}

/// Logits promoted at a time by a pass without autograd (256 MiB of f32).
pub const CHUNK_ELEMENTS: i64 = 1 << 26;

/// `per_rows` over the positions of `logits` (and their `ids`) in chunks of at most `limit` logits, when no
/// gradient flows and there is more than that; the per-position results concatenated in the leading shape.
fn in_chunks(
    logits: &Tensor,
    ids: Option<&Tensor>,
    limit: i64,
    per_rows: impl Fn(&Tensor, Option<&Tensor>) -> Tensor,
) -> Tensor {
    let size = logits.size();
    let vocab = size.last().copied().unwrap_or(1).max(1);
    if logits.requires_grad() || logits.numel() as i64 <= limit || size.len() < 2 {
        return per_rows(logits, ids);
    }
    let flat = logits.reshape([-1, vocab]);
    let flat_ids = ids.map(|i| i.reshape([-1]));
    let n = flat.size()[0];
    let rows = (limit / vocab).max(1);
    let mut parts = Vec::with_capacity((n / rows + 1) as usize);
    let mut start = 0;
    while start < n {
        let len = rows.min(n - start);
        let chunk_ids = flat_ids.as_ref().map(|i| i.narrow(0, start, len));
        parts.push(per_rows(&flat.narrow(0, start, len), chunk_ids.as_ref()));
        start += len;
    }
    Tensor::cat(&parts, 0).reshape(&size[..size.len() - 1])
}

fn check_logits(logits: &Tensor) -> Result<(), AlgoError> {
    if logits.dim() == 0 {
        return Err(AlgoError::Logits("logits must have a vocabulary dimension, got a scalar".into()));
    }
    crate::util::check_float("logits", logits).map_err(AlgoError::Logits)
}

/// Entropy of the categorical distribution of every position: `logsumexp(z) − Σ softmax(z)·z`.
pub fn entropy_from_logits(logits: &Tensor) -> Tensor {
    entropy_limited(logits, CHUNK_ELEMENTS)
}

fn entropy_limited(logits: &Tensor, limit: i64) -> Tensor {
    in_chunks(logits, None, limit, |chunk, _| {
        let z = promoted(chunk);
        let probs = z.softmax(-1, None::<Kind>);
        z.logsumexp(-1, false) - (&probs * &z).sum_dim_intlist(-1, false, None::<Kind>)
    })
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
    logprobs_limited(logits, ids, CHUNK_ELEMENTS)
}

fn logprobs_limited(logits: &Tensor, ids: &Tensor, limit: i64) -> Tensor {
    in_chunks(logits, Some(ids), limit, |chunk, chunk_ids| {
        let ids = chunk_ids.map_or_else(|| ids.shallow_clone(), Tensor::shallow_clone);
        let z = promoted(chunk);
        let chosen = z.gather(-1, &ids.to_kind(Kind::Int64).unsqueeze(-1), false).squeeze_dim(-1);
        chosen - z.logsumexp(-1, false)
    })
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
    in_chunks(logits, None, CHUNK_ELEMENTS, |chunk, _| {
        promoted(chunk).softmax(-1, None::<Kind>).square().sum_dim_intlist(-1, false, None::<Kind>)
    })
}

#[cfg(test)]
mod tests {
    use tch::{Device, Kind, Tensor};

    use super::*;

    #[test]
    fn without_autograd_chunks_of_positions_give_the_one_piece_values() {
        tch::manual_seed(3);
        let logits = Tensor::randn([3, 5, 11], (Kind::BFloat16, Device::Cpu));
        let ids = Tensor::randint(11, [3, 5], (Kind::Int64, Device::Cpu));
        let whole = logprobs_limited(&logits, &ids, i64::MAX);
        // 22 logits a chunk: two positions at a time, the last chunk one position
        let chunked = logprobs_limited(&logits, &ids, 22);
        assert_eq!(chunked.size(), vec![3, 5]);
        assert_eq!(
            Vec::<f32>::try_from(whole.reshape([-1])).unwrap(),
            Vec::<f32>::try_from(chunked.reshape([-1])).unwrap()
        );
        let (e1, e2) = (entropy_limited(&logits, i64::MAX), entropy_limited(&logits, 22));
        assert_eq!(Vec::<f32>::try_from(e1.reshape([-1])).unwrap(), Vec::<f32>::try_from(e2.reshape([-1])).unwrap());
        // with autograd the tensor is taken whole, and the gradient flows
        let trained = logits.to_kind(Kind::Float).set_requires_grad(true);
        logprobs_limited(&trained, &ids, 22).sum(Kind::Float).backward();
        assert!(trained.grad().defined());
    }
}
