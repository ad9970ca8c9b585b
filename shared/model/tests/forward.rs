//! The training forward: differentiable through every parameter, finite on padded rows. (Its agreement with
//! transformers is `hf_sample.rs`; with the rollout engine, `engine.rs`.)

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

mod common;

use common::*;
use jetrl_model::{token_log_probs, CausalLm, DType};
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
