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

/// The routes a forward of `model` over each sample's prompt and response chooses, token-major, as a rollout
/// engine returns them (every token but the last), with `shift` added to every expert modulo 8.
fn with_routes(model: &std::path::Path, shift: u16) -> Vec<Sample> {
    let m = CausalLm::load(model, Device::Cpu, DType::F32).unwrap();
    let mut samples = batch();
    for s in &mut samples {
        let ids: Vec<i64> = s.prompt.iter().chain(&s.response).map(|&t| i64::from(t)).collect();
        let input = Tensor::from_slice(&ids).unsqueeze(0);
        m.record_routes(true);
        let _ = tch::no_grad(|| m.forward(&input, &input.ones_like())).unwrap();
        let routes = Tensor::stack(&m.take_routes().unwrap(), 1).narrow(0, 0, ids.len() as i64 - 1);
        let routes: Vec<i64> = Vec::try_from(routes.reshape([-1])).unwrap();
        s.routed_experts = routes.into_iter().map(|e| (e as u16 + shift) % 8).collect();
        s.routes_layout = (2, 2);
    }
    samples
}

fn r3_step(model: &std::path::Path, samples: Vec<Sample>) -> Result<BTreeMap<String, f64>, String> {
    let mut cfg = config(model, RouterReplayMode::R3, 0.0);
    cfg.rollout.enable_rollout_routing_replay = true;
    let mut actor = Actor::new(&cfg, 1, None, Comm::Solo).unwrap();
    actor.train(&RankBatch::whole(samples), 1, OldPolicy::Current).map(|o| o.metrics).map_err(|e| e.to_string())
}

#[test]
fn r3_computes_pi_old_on_the_rollouts_routes_and_refuses_trajectories_without_them() {
    let dir = tempfile::tempdir().unwrap();
    jetrl_model::init_model("tiny-digits-moe", dir.path(), 4).unwrap();
    let (free, _) = step(&config(dir.path(), RouterReplayMode::Disabled, 0.0));
    // the rollout routed as the trainer does: π_old is the free forward's, bit for bit
    let same = r3_step(dir.path(), with_routes(dir.path(), 0)).unwrap();
    assert_eq!(same["actor/entropy"], free["actor/entropy"], "{same:?}");
    // other routes: π_old is computed on them
    let moved = r3_step(dir.path(), with_routes(dir.path(), 1)).unwrap();
    assert_ne!(moved["actor/entropy"], free["actor/entropy"], "R3 must replay the rollout's routes");

    let err = r3_step(dir.path(), batch()).unwrap_err();
    assert!(err.contains("carries no routed experts") && err.contains("enable_rollout_routing_replay"), "{err}");
    let mut wrong = with_routes(dir.path(), 0);
    wrong[0].routes_layout = (3, 2);
    let err = r3_step(dir.path(), wrong).unwrap_err();
    assert!(err.contains("3 layers × 2") && err.contains("model routes 2 layers"), "{err}");
}
