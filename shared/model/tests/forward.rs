//! The training forward: differentiable through every parameter, finite on padded rows. (Its agreement with
//! transformers is `hf_sample.rs`; with the rollout engine, `engine.rs`.)

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

mod common;

use common::*;
use jetrl_model::{token_log_probs, CausalLm, DType, Packed};
use tch::{Device, Kind, Tensor};

fn model() -> CausalLm {
    CausalLm::load(&hf_sample_llama(), Device::Cpu, DType::F32).unwrap()
}

#[test]
fn forward_is_differentiable_through_every_parameter() {
    let model = model();
    let ids = Tensor::from_slice(&[1i64, 87, 85, 266, 201, 57, 0, 0]).view([2, 4]);
    let mask = Tensor::from_slice(&[1i64, 1, 1, 1, 0, 1, 1, 1]).view([2, 4]);
    let logits = model.forward(&ids, &mask).unwrap();
    let lp = token_log_probs(&logits, &ids, 1.0).unwrap();
    let loss = -(lp * mask.narrow(1, 1, 3).to_kind(Kind::Float)).sum(Kind::Float);
    loss.backward();
    let params = model.parameters();
    assert_eq!(model.var_store().trainable_variables().len(), params.len());
    for (name, p) in params {
        let grad = p.grad();
        assert!(grad.defined(), "{name} has no gradient");
        assert!(bool::try_from(grad.isfinite().all()).unwrap(), "{name} gradient is not finite");
        assert!(grad.abs().sum(Kind::Float).double_value(&[]) > 0.0, "{name} gradient is zero");
    }
}

#[test]
fn fully_padded_and_padded_query_rows_stay_finite() {
    let model = model();
    let ids = Tensor::from_slice(&[0i64, 0, 0, 5, 6, 0]).view([2, 3]);
    let mask = Tensor::from_slice(&[0i64, 0, 0, 1, 1, 0]).view([2, 3]);
    let logits = tch::no_grad(|| model.forward(&ids, &mask)).unwrap();
    assert!(bool::try_from(logits.isfinite().all()).unwrap());
    assert_eq!(logits.kind(), Kind::Float);
    assert_eq!(logits.size(), vec![2, 3, 400]);
}

/// Gradient checkpointing changes when activations are computed, not what the gradients are: every parameter's
/// gradient equals the plain backward pass's (≤ 1e-6 in f32), on a padded batch.
#[test]
fn gradient_checkpointing_gives_the_plain_gradients() {
    let ids = Tensor::from_slice(&[1i64, 87, 85, 266, 201, 57, 0, 0, 0, 12, 40, 7]).view([3, 4]);
    let mask = Tensor::from_slice(&[1i64, 1, 1, 1, 0, 1, 1, 1, 0, 1, 1, 1]).view([3, 4]);
    let weights = Tensor::from_slice(&[1.0f32, 0.5, -2.0]).view([3, 1]);
    let loss_of = |hidden: &Tensor, model: &CausalLm| {
        let lp = token_log_probs(&model.lm_head(hidden).unwrap(), &ids, 0.7).unwrap();
        -(lp * mask.narrow(1, 1, 3).to_kind(Kind::Float) * &weights).sum(Kind::Float)
    };
    let plain = model();
    loss_of(&plain.forward_hidden(&ids, &mask).unwrap(), &plain).backward();
    let checkpointed = model();
    let (hidden, checkpoints) = checkpointed.forward_hidden_checkpointed(&ids, &mask).unwrap();
    loss_of(&hidden, &checkpointed).backward();
    checkpointed.backward_checkpointed(checkpoints).unwrap();
    let (a, b) = (plain.parameters(), checkpointed.parameters());
    let mut worst = (0.0f64, String::new());
    for (name, p) in &a {
        let (ga, gb) = (p.grad(), b[name].grad());
        assert!(ga.defined() && gb.defined(), "{name}: a gradient is missing");
        let d = f64::try_from((&ga - &gb).abs().max()).unwrap();
        if d > worst.0 {
            worst = (d, name.clone());
        }
    }
    println!("checkpointed vs plain gradients: max |Δ| {:.2e} ({})", worst.0, worst.1);
    assert!(worst.0 <= 1e-6, "gradients differ by {} in {}", worst.0, worst.1);
}

/// Sequences packed end to end in one row (positions restarting, attention within each sequence) give every token
/// the log-probability a padded batch gives it (≤ 1e-5 in f32), with and without gradient checkpointing, and
/// the same gradients.
#[test]
fn a_packed_row_gives_the_padded_batchs_log_probs_and_gradients() {
    let sequences: Vec<Vec<i64>> = vec![vec![1, 87, 85, 266, 201], vec![57, 12], vec![40, 7, 9, 301, 11, 2, 5]];
    let width = sequences.iter().map(Vec::len).max().unwrap();
    // padded: left-padded rows
    let mut ids = vec![0i64; sequences.len() * width];
    let mut mask = vec![0i64; sequences.len() * width];
    for (i, s) in sequences.iter().enumerate() {
        let offset = i * width + width - s.len();
        ids[offset..offset + s.len()].copy_from_slice(s);
        mask[offset..offset + s.len()].iter_mut().for_each(|m| *m = 1);
    }
    let ids = Tensor::from_slice(&ids).view([sequences.len() as i64, width as i64]);
    let mask = Tensor::from_slice(&mask).view([sequences.len() as i64, width as i64]);
    let packed_ids: Vec<i64> = sequences.iter().flatten().copied().collect();
    let lens: Vec<i64> = sequences.iter().map(|s| s.len() as i64).collect();
    let packed_ids = Tensor::from_slice(&packed_ids).view([1, -1]);
    let packed = Packed { input_ids: &packed_ids, lens: &lens };

    let padded_model = model();
    let padded = token_log_probs(&padded_model.forward(&ids, &mask).unwrap(), &ids, 1.0).unwrap();
    let mut expected = Vec::new();
    for (i, s) in sequences.iter().enumerate() {
        let row = Vec::<f32>::try_from(padded.get(i as i64)).unwrap();
        expected.extend_from_slice(&row[width - s.len()..]);
    }
    // a prediction counts where both its position and its target are tokens
    let both = (mask.narrow(1, 1, width as i64 - 1) * mask.narrow(1, 0, width as i64 - 1)).to_kind(Kind::Float);
    (&padded * both).sum(Kind::Float).backward();

    for checkpointing in [false, true] {
        let m = model();
        let (hidden, checkpoints) = if checkpointing {
            let (h, c) = m.forward_hidden_packed_checkpointed(&packed).unwrap();
            (h, Some(c))
        } else {
            (m.forward_hidden_packed(&packed).unwrap(), None)
        };
        let lp = token_log_probs(&m.lm_head(&hidden).unwrap(), &packed_ids, 1.0).unwrap();
        // the last token of a sequence predicts the next sequence's first: not a log-prob of either
        let mut got = Vec::new();
        let all = Vec::<f32>::try_from(lp.get(0)).unwrap();
        let mut start = 0usize;
        let mut keep = vec![0f32; all.len()];
        for s in &sequences {
            got.extend_from_slice(&all[start..start + s.len() - 1]);
            keep[start..start + s.len() - 1].iter_mut().for_each(|k| *k = 1.0);
            start += s.len();
        }
        let d = got.iter().zip(&expected).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        println!(
            "packed (checkpointing {checkpointing}) vs padded log-probs: max |Δ| {d:.2e} over {} tokens",
            got.len()
        );
        assert_eq!(got.len(), expected.len());
        assert!(d <= 1e-5, "packed vs padded log-probs differ by {d}");
        (lp * Tensor::from_slice(&keep).view([1, -1])).sum(Kind::Float).backward();
        if let Some(c) = checkpoints {
            m.backward_checkpointed(c).unwrap();
        }
        let reference = padded_model.parameters();
        for (name, p) in m.parameters() {
            let g = f64::try_from((p.grad() - reference[&name].grad()).abs().max()).unwrap();
            assert!(g <= 1e-5, "{name}: gradients differ by {g} (checkpointing {checkpointing})");
        }
    }
}
