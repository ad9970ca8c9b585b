//! What the actor update computes besides the gradient step, on the real tiny model.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use std::collections::BTreeMap;

use jetrl_config::JobConfig;
use jetrl_trainer::actor::{Actor, ActorHandle, OldPolicy};
use jetrl_trainer::batch::{RankBatch, Sample};
use jetrl_trainer::dist::Comm;
use jetrl_trainer::error::ActorError;
use tch::Tensor;

/// Two prompt groups of two trajectories with different scores (non-zero advantages).
fn batch() -> Vec<Sample> {
    let mut out = Vec::new();
    for (g, prompt) in [vec![5u32, 9, 14], vec![21, 7]].into_iter().enumerate() {
        for (session, response) in [vec![3u32, 8, 12], vec![30, 4]].into_iter().enumerate() {
            out.push(Sample {
                key: format!("g{g}_{session}_0"),
                uid: format!("g{g}"),
                prompt: prompt.clone(),
                response_mask: vec![1; response.len()],
                rollout_logprobs: vec![-4.0; response.len()],
                response,
                score: session as f64,
                ..Sample::default()
            });
        }
    }
    out
}

/// Trains one step (two mini-batches, so the second is scored by weights the first has moved) and returns the
/// metrics and the weights it ends with.
fn train(model: &std::path::Path, calculate_entropy: bool) -> (BTreeMap<String, f64>, BTreeMap<String, Tensor>) {
    let mut cfg = JobConfig::default();
    cfg.model.path = model.display().to_string();
    cfg.actor.optim.lr = 1e-2;
    cfg.actor.ppo_mini_batch_size = Some(1);
    cfg.actor.entropy_coeff = 0.0;
    cfg.actor.calculate_entropy = calculate_entropy;
    let mut actor = Actor::new(&cfg, 1, None, Comm::Solo).unwrap();
    let metrics = actor.train(&RankBatch::whole(batch()), 1, OldPolicy::Current).unwrap().metrics;
    let weights = actor.model().parameters().into_iter().map(|(k, v)| (k, v.detach().copy())).collect();
    (metrics, weights)
}

/// verl's `calculate_entropy = actor.calculate_entropy or entropy_coeff != 0`: with the flag and no entropy bonus
/// the update computes the entropy for its metrics (`actor/entropy`, `actor/entropy_loss`) and trains exactly as
/// without it.
#[test]
fn calculate_entropy_reports_the_updates_entropy_without_changing_the_update() {
    let dir = tempfile::tempdir().unwrap();
    jetrl_model::init_model("tiny", dir.path(), 3).unwrap();
    let (plain, plain_weights) = train(dir.path(), false);
    let (with, with_weights) = train(dir.path(), true);
    assert!(!plain.contains_key("actor/entropy_loss"), "no entropy in the update unless asked: {plain:?}");
    let old_pass = plain["actor/entropy"];
    let update = with["actor/entropy_loss"];
    assert!(update.is_finite() && update > 0.0, "{with:?}");
    assert_eq!(with["actor/entropy"], update, "actor/entropy comes from the update when it computes it");
    assert_ne!(update, old_pass, "the second mini-batch is scored after the first moved the weights");
    for (name, w) in &plain_weights {
        let diff = f64::try_from((w - &with_weights[name]).abs().max()).unwrap();
        assert!(diff == 0.0, "{name}: the entropy metric changed the update by {diff}");
    }
}

/// One PPO step (GAE with a critic, entropy bonus 0.01, critic lr 1e-2) of `cfg` on [`batch`]: its metrics and
/// the actor's weights after it.
fn ppo_step(mut cfg: JobConfig) -> (BTreeMap<String, f64>, BTreeMap<String, Tensor>) {
    cfg.actor.entropy_coeff = 0.01;
    cfg.algorithm.adv_estimator = jetrl_config::AdvantageEstimator::Gae;
    cfg.critic.optim.lr = 1e-2;
    let mut actor = Actor::new(&cfg, 1, None, Comm::Solo).unwrap();
    let metrics = actor.train(&RankBatch::whole(batch()), 1, OldPolicy::Current).unwrap().metrics;
    let weights = actor.model().parameters().into_iter().map(|(k, v)| (k, v.detach().copy())).collect();
    (metrics, weights)
}

/// `model.enable_gradient_checkpointing` trains exactly as without it, the actor and (PPO) the critic: the same
/// weights and the same metrics after a step of two mini-batches.
#[test]
fn gradient_checkpointing_trains_the_actor_and_critic_exactly_as_without_it() {
    let dir = tempfile::tempdir().unwrap();
    jetrl_model::init_model("tiny", dir.path(), 3).unwrap();
    let run = |checkpointing: bool| {
        let mut cfg = JobConfig::default();
        cfg.model.path = dir.path().display().to_string();
        cfg.model.enable_gradient_checkpointing = checkpointing;
        cfg.actor.optim.lr = 1e-2;
        cfg.actor.ppo_mini_batch_size = Some(1);
        ppo_step(cfg)
    };
    let (plain, plain_weights) = run(false);
    let (checkpointed, checkpointed_weights) = run(true);
    for (name, w) in &plain_weights {
        let d = f64::try_from((w - &checkpointed_weights[name]).abs().max()).unwrap();
        assert!(d <= 1e-6, "{name}: |Δ| {d}");
    }
    for key in ["actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm"] {
        let (a, b) = (plain[key], checkpointed[key]);
        assert!((a - b).abs() <= 1e-6 * a.abs().max(1.0), "{key}: {a} vs {b}");
    }
}

/// `model.use_remove_padding` trains as the padded micro-batches do (the rows have different prompt and response
/// lengths, so the padded path pads both), with and without gradient checkpointing: what the step computes before
/// updating (π_old log-probs, values, advantages, entropy) and the losses and gradient norms of its update within
/// 1e-5, the weights after it within 1e-4 (AdamW divides by √v: a gradient element near zero that the two paths
/// sum in another order moves its weight by up to lr, here 1e-2, so weights agree less closely than gradients).
#[test]
fn packed_micro_batches_train_the_actor_and_critic_as_padded_ones() {
    let dir = tempfile::tempdir().unwrap();
    jetrl_model::init_model("tiny", dir.path(), 3).unwrap();
    let run = |packed: bool, checkpointing: bool| {
        let mut cfg = JobConfig::default();
        cfg.model.path = dir.path().display().to_string();
        cfg.model.use_remove_padding = packed;
        cfg.model.enable_gradient_checkpointing = checkpointing;
        cfg.actor.optim.lr = 1e-2;
        // one update each (the whole batch): its gradients are compared, not the second update's (which starts
        // from weights the first moved apart)
        cfg.actor.ppo_mini_batch_size = None;
        ppo_step(cfg)
    };
    let (padded, padded_weights) = run(false, false);
    for checkpointing in [false, true] {
        let (packed, packed_weights) = run(true, checkpointing);
        for (name, w) in &padded_weights {
            let d = f64::try_from((w - &packed_weights[name]).abs().max()).unwrap();
            assert!(d <= 1e-4, "{name}: |Δ| {d} (checkpointing {checkpointing})");
        }
        for (key, a) in &padded {
            let b = packed[key];
            assert!((a - b).abs() <= 1e-5 * a.abs().max(1.0), "{key}: {a} vs {b} (checkpointing {checkpointing})");
        }
    }
}

/// A job that panics on the actor thread reaches its caller as `ActorError::Panicked` with the panic's message,
/// and so does every later call (the thread is gone), instead of an "actor thread has stopped" that says nothing.
#[test]
fn a_panic_on_the_actor_thread_reaches_its_caller_with_its_message() {
    let dir = tempfile::tempdir().unwrap();
    jetrl_model::init_model("tiny", dir.path(), 3).unwrap();
    let mut cfg = JobConfig::default();
    cfg.model.path = dir.path().display().to_string();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let actor = ActorHandle::spawn(cfg, 1, None, Comm::Solo, 0).unwrap();
        assert_eq!(actor.call(|_| 7).await.unwrap(), 7);
        let first = actor.call(|_| -> u32 { panic!("ran out of {}", "patience") }).await.unwrap_err();
        assert!(matches!(&first, ActorError::Panicked(m) if m == "ran out of patience"), "{first:?}");
        let later = actor.call(|_| 7).await.unwrap_err();
        assert!(matches!(&later, ActorError::Panicked(m) if m == "ran out of patience"), "{later:?}");
    });
}
