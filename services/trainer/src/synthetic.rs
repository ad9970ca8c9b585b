//! Fixed synthetic training batches and the job that trains on them, without NATS: what the trainer's own tests
//! (`tests/resume_equivalence.rs`), the data-parallel helper (`jetrl-trainer-dp`: `tests/data_parallel.rs`,
//! `just bench dp`) use to compare runs that must train alike.

use std::path::Path;

use jetrl_config::JobConfig;
use rand::{Rng, SeedableRng};

use crate::batch::Sample;

/// The batch of `step`: `groups` prompt groups of 4 trajectories, responses of 2 to `max_response - 1` tokens,
/// scores in {0, 0.25, ..., 1}, behaviour log-probs near a uniform policy's; a pure function of its arguments.
pub fn batch(step: u64, groups: usize, max_response: usize) -> Vec<Sample> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1000 + step);
    let mut out = Vec::new();
    for g in 0..groups {
        let uid = format!("s{step}g{g}");
        let prompt: Vec<u32> = (0..rng.gen_range(3..7)).map(|_| rng.gen_range(3..60)).collect();
        for session in 0..4 {
            let len = rng.gen_range(2..max_response.max(3));
            let response: Vec<u32> = (0..len).map(|_| rng.gen_range(3..60)).collect();
            out.push(Sample {
                key: format!("{uid}_{session}_0"),
                uid: uid.clone(),
                prompt: prompt.clone(),
                response,
                response_mask: vec![1; len],
                rollout_logprobs: (0..len).map(|_| -rng.gen_range(3.5f32..4.5)).collect(),
                score: f64::from(rng.gen_range(0..=4u8)) / 4.0,
                ..Sample::default()
            });
        }
    }
    out
}

/// A job on the model at `model` with every piece of state that must carry across a resume or agree across ranks
/// in play: shuffled mini-batches of 2 groups split into micro-batches of 30 tokens, 2 PPO epochs, warmup + cosine
/// LR, weight decay, an entropy bonus, KL loss and an adaptive in-reward KL against the reference; with `critic`,
/// GAE, a critic with a warm-up of 2 steps and token-level rollout correction.
pub fn job_config(model: &Path, critic: bool) -> JobConfig {
    let mut cfg = JobConfig::default();
    cfg.model.path = model.display().to_string();
    cfg.run.seed = 5;
    cfg.rollout.temperature = 0.9;
    cfg.actor.optim.lr = 1e-3;
    cfg.actor.optim.weight_decay = 0.01;
    cfg.actor.optim.lr_warmup_steps = Some(1);
    cfg.actor.optim.lr_scheduler_type = jetrl_config::LrSchedulerType::Cosine;
    cfg.actor.optim.min_lr_ratio = 0.1;
    cfg.actor.ppo_mini_batch_size = Some(2);
    cfg.actor.ppo_epochs = 2;
    cfg.actor.shuffle = true;
    cfg.actor.ppo_max_token_len = 30;
    cfg.actor.entropy_coeff = 0.01;
    cfg.actor.use_kl_loss = true;
    cfg.algorithm.use_kl_in_reward = true;
    cfg.algorithm.kl_ctrl.kind = jetrl_config::KlCtrlType::Adaptive;
    cfg.algorithm.kl_ctrl.kl_coef = 0.05;
    if critic {
        cfg.algorithm.adv_estimator = jetrl_config::AdvantageEstimator::Gae;
        cfg.algorithm.lam = 0.95;
        cfg.critic.optim.lr = 1e-3;
        cfg.trainer.critic_warmup = 2;
        cfg.algorithm.rollout_correction = Some(jetrl_config::RolloutCorrectionConfig {
            rollout_is: Some(jetrl_config::RolloutIsLevel::Token),
            ..Default::default()
        });
    }
    cfg
}
