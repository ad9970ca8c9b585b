//! The actor on a mixture-of-experts policy: router replay R2 and the load-balancing loss in the update, and
//! both refused on a dense model.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use std::collections::BTreeMap;

use jetrl_config::{JobConfig, RouterReplayMode};
use jetrl_model::{CausalLm, DType};
use jetrl_trainer::actor::{Actor, OldPolicy};
use jetrl_trainer::batch::{RankBatch, Sample};
use jetrl_trainer::dist::Comm;
use tch::{Device, Tensor};

/// Two prompt groups of two trajectories with different scores, in the digits vocabulary.
fn batch() -> Vec<Sample> {
    let mut out = Vec::new();
    for (g, prompt) in [vec![5u32, 9, 14, 3], vec![11, 7]].into_iter().enumerate() {
        for (session, response) in [vec![3u32, 8, 12], vec![10, 4]].into_iter().enumerate() {
            out.push(Sample {
                key: format!("g{g}_{session}_0"),
                uid: format!("g{g}"),
                prompt: prompt.clone(),
                response_mask: vec![1; response.len()],
                rollout_logprobs: vec![-2.0; response.len()],
                response,
                score: session as f64,
                ..Sample::default()
            });
        }
    }
    out
}

fn config(model: &std::path::Path, mode: RouterReplayMode, aux: f64) -> JobConfig {
    let mut cfg = JobConfig::default();
    cfg.model.path = model.display().to_string();
    cfg.actor.optim.lr = 1e-2;
    cfg.actor.ppo_mini_batch_size = Some(1);
    cfg.actor.router_replay.mode = mode;
    cfg.actor.moe_aux_loss_coeff = aux;
    cfg
}

/// One step (two mini-batches, so the second is scored by weights the first moved): metrics and final weights.
fn step(cfg: &JobConfig) -> (BTreeMap<String, f64>, BTreeMap<String, Tensor>) {
    let mut actor = Actor::new(cfg, 1, None, Comm::Solo).unwrap();
    let metrics = actor.train(&RankBatch::whole(batch()), 1, OldPolicy::Current).unwrap().metrics;
    let weights = actor.model().parameters().into_iter().map(|(k, v)| (k, v.detach().copy())).collect();
    (metrics, weights)
}

fn max_diff(a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>, filter: &str) -> f64 {
    a.iter()
        .filter(|(name, _)| name.contains(filter))
        .map(|(name, w)| f64::try_from((w - &b[name]).abs().max()).unwrap())
        .fold(0.0, f64::max)
}

#[test]
fn the_load_balancing_loss_is_reported_and_trains_the_routers_and_r2_runs_the_update_on_replayed_routes() {
    let dir = tempfile::tempdir().unwrap();
    jetrl_model::init_model("tiny-digits-moe", dir.path(), 3).unwrap();
    // routers near ties, so that one update moves some tokens to other experts
    let model = CausalLm::load(dir.path(), Device::Cpu, DType::F32).unwrap();
    tch::no_grad(|| {
        for (name, mut p) in model.parameters() {
            if name.ends_with("mlp.gate.weight") {
                let _ = p.g_mul_scalar_(0.01);
            }
        }
    });
    model.save(dir.path()).unwrap();
    let (plain, plain_w) = step(&config(dir.path(), RouterReplayMode::Disabled, 0.0));
    assert!(!plain.contains_key("actor/moe_aux_loss"), "no aux loss unless asked: {plain:?}");

    let (aux, aux_w) = step(&config(dir.path(), RouterReplayMode::Disabled, 0.5));
    let value = aux["actor/moe_aux_loss"];
    // E · Σ f·P is k (= 2) for a balanced router, more for the random-init routers here
    assert!(value.is_finite() && value >= 1.9, "{aux:?}");
    assert!(max_diff(&plain_w, &aux_w, "mlp.gate.weight") > 1e-6, "the aux loss moves the routers");

    let (r2, r2_w) = step(&config(dir.path(), RouterReplayMode::R2, 0.0));
    for key in ["actor/pg_loss", "actor/ppo_kl", "actor/grad_norm"] {
        assert!(r2[key].is_finite(), "{key}: {r2:?}");
    }
    // the first mini-batch sees the weights π_old saw (the same routes either way); the second is scored after the
    // first moved the routers, and without replay some of its tokens change experts
    let moved = max_diff(&plain_w, &r2_w, "");
    println!("largest weight difference, R2 against no replay: {moved:.3e}");
    assert!(moved > 1e-6, "R2 must change the second mini-batch's update");
}

#[test]
fn router_replay_and_the_aux_loss_on_a_dense_model_are_refused_by_key() {
    let dir = tempfile::tempdir().unwrap();
    jetrl_model::init_model("tiny-digits", dir.path(), 3).unwrap();
    for cfg in [config(dir.path(), RouterReplayMode::R2, 0.0), config(dir.path(), RouterReplayMode::Disabled, 0.01)] {
        let err = Actor::new(&cfg, 1, None, Comm::Solo).err().unwrap().to_string();
        assert!(err.contains("actor.router_replay.mode") && err.contains("mixture-of-experts"), "{err}");
    }
}
