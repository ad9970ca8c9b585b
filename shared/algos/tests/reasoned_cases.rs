//! Cases worked out by hand from verl's definitions: the edges the random golden vectors rarely hit
//! (singleton groups, empty rows, each dual-clip branch, multi-output sessions, micro-batch splits).

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use jetrl_algos::*;
use tch::{Device, Kind, Tensor};

fn t2(rows: &[&[f64]]) -> Tensor {
    let width = rows.first().map_or(0, |r| r.len()) as i64;
    let flat: Vec<f64> = rows.iter().flat_map(|r| r.iter().copied()).collect();
    Tensor::from_slice(&flat).reshape([rows.len() as i64, width])
}

fn v2(t: &Tensor) -> Vec<Vec<f64>> {
    Vec::<Vec<f64>>::try_from(&t.to_kind(Kind::Double)).expect("2-D tensor")
}

fn scalar(t: &Tensor) -> f64 {
    t.double_value(&[])
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 + 1e-9 * b.abs()
}

/// Masked means divide by `n + 1e-8`, so a metric of 1 reads as 0.99999999.
fn metric(value: Option<f64>) -> f64 {
    let value = value.expect("the loss reports this metric");
    (value * 1e6).round() / 1e6
}

fn assert_rows(actual: &Tensor, expected: &[&[f64]]) {
    let actual = v2(actual);
    assert_eq!(actual.len(), expected.len(), "{actual:?}");
    for (a, e) in actual.iter().zip(expected) {
        assert!(a.iter().zip(e.iter()).all(|(x, y)| close(*x, *y)), "got {actual:?}, expected {expected:?}");
    }
}

fn uids(ids: &[&str]) -> Vec<String> {
    ids.iter().map(|s| s.to_string()).collect()
}

// ---------------------------------------------------------------- advantages

#[test]
fn grpo_singleton_group_keeps_its_score_over_one_plus_f32_epsilon() {
    let rewards = t2(&[&[0.0, 2.0], &[1.0, 0.0], &[3.0, 0.0]]);
    let mask = t2(&[&[1.0, 1.0], &[1.0, 0.0], &[1.0, 1.0]]);
    let index = uids(&["solo", "pair", "pair"]);
    let inputs = AdvantageInputs { index: Some(&index), ..AdvantageInputs::new(&rewards, &mask) };
    let (adv, returns) = compute_advantage(AdvantageEstimator::Grpo, &inputs, &AdvantageConfig::default()).unwrap();
    // singleton: mean 0, std 1 (verl's f32 `1 + 1e-6`); pair {1, 3}: mean 2, std √2
    let solo = 2.0 / f64::from(1.0f32 + 1e-6f32);
    let pair = 1.0 / (2f64.sqrt() + 1e-6);
    assert_rows(&adv, &[&[solo, solo], &[-pair, 0.0], &[pair, pair]]);
    assert_rows(&returns, &[&[solo, solo], &[-pair, 0.0], &[pair, pair]]);

    let dr_grpo = AdvantageConfig { norm_adv_by_std_in_grpo: false, ..AdvantageConfig::default() };
    let (adv, _) = compute_advantage(AdvantageEstimator::Grpo, &inputs, &dr_grpo).unwrap();
    assert_rows(&adv, &[&[2.0, 2.0], &[-1.0, 0.0], &[1.0, 1.0]]);
}

#[test]
fn rloo_singleton_keeps_its_score_but_rloo_vectorized_gives_zero() {
    let rewards = t2(&[&[5.0], &[1.0], &[2.0], &[6.0]]);
    let mask = t2(&[&[1.0], &[1.0], &[1.0], &[1.0]]);
    let index = uids(&["a", "b", "b", "b"]);
    let inputs = AdvantageInputs { index: Some(&index), ..AdvantageInputs::new(&rewards, &mask) };
    let cfg = AdvantageConfig::default();
    let (rloo, _) = compute_advantage(AdvantageEstimator::Rloo, &inputs, &cfg).unwrap();
    // leave-one-out: 1 − (2+6)/2 = −3, 2 − 3.5 = −1.5, 6 − 1.5 = 4.5
    assert_rows(&rloo, &[&[5.0], &[-3.0], &[-1.5], &[4.5]]);
    let (vectorized, _) = compute_advantage(AdvantageEstimator::RlooVectorized, &inputs, &cfg).unwrap();
    assert_rows(&vectorized, &[&[0.0], &[-3.0], &[-1.5], &[4.5]]);
}

#[test]
fn fully_masked_row_gets_zero_advantage_but_still_counts_in_its_group() {
    // verl groups by uid only: the empty row's score (0) is part of the group mean.
    let rewards = t2(&[&[0.0, 0.0], &[4.0, 0.0]]);
    let mask = t2(&[&[0.0, 0.0], &[1.0, 1.0]]);
    let index = uids(&["g", "g"]);
    let inputs = AdvantageInputs { index: Some(&index), ..AdvantageInputs::new(&rewards, &mask) };
    let cfg = AdvantageConfig { norm_adv_by_std_in_grpo: false, ..AdvantageConfig::default() };
    let (adv, _) = compute_advantage(AdvantageEstimator::Grpo, &inputs, &cfg).unwrap();
    assert_rows(&adv, &[&[0.0, 0.0], &[2.0, 2.0]]);
}

#[test]
fn opo_baseline_is_length_weighted() {
    let rewards = t2(&[&[1.0, 0.0, 0.0], &[0.0, 0.0, 4.0]]);
    let mask = t2(&[&[1.0, 0.0, 0.0], &[1.0, 1.0, 1.0]]);
    let index = uids(&["g", "g"]);
    let inputs = AdvantageInputs { index: Some(&index), ..AdvantageInputs::new(&rewards, &mask) };
    let (adv, _) = compute_advantage(AdvantageEstimator::Opo, &inputs, &AdvantageConfig::default()).unwrap();
    // b = (1·1 + 3·4) / 4 = 3.25
    assert_rows(&adv, &[&[-2.25, 0.0, 0.0], &[0.75, 0.75, 0.75]]);
}

#[test]
fn remax_subtracts_the_greedy_baseline_from_the_reward_to_go() {
    let rewards = t2(&[&[1.0, 2.0, 3.0]]);
    let mask = t2(&[&[1.0, 1.0, 0.0]]);
    let baselines = Tensor::from_slice(&[0.5f64]);
    let inputs = AdvantageInputs { reward_baselines: Some(&baselines), ..AdvantageInputs::new(&rewards, &mask) };
    let (adv, returns) = compute_advantage(AdvantageEstimator::Remax, &inputs, &AdvantageConfig::default()).unwrap();
    assert_rows(&returns, &[&[3.0, 2.0, 0.0]]);
    assert_rows(&adv, &[&[2.5, 1.5, 0.0]]);
}

#[test]
fn gae_carries_value_and_advantage_across_masked_observation_tokens() {
    // One valid token, an observation token, one valid token: with γ = λ = 1 the observation is skipped.
    let rewards = t2(&[&[0.0, 5.0, 1.0], &[0.0, 0.0, 2.0]]);
    let values = t2(&[&[0.5, 9.0, 0.25], &[0.0, 0.0, 0.0]]);
    let mask = t2(&[&[1.0, 0.0, 1.0], &[1.0, 1.0, 1.0]]);
    let inputs = AdvantageInputs { values: Some(&values), ..AdvantageInputs::new(&rewards, &mask) };
    let (_, returns) = compute_advantage(AdvantageEstimator::Gae, &inputs, &AdvantageConfig::default()).unwrap();
    // t=2: δ = 1 − 0.25 → A = 0.75; t=1 (masked): carries A=0.75, nextV=0.25; t=0: δ = 0 + 0.25 − 0.5, A = 0.5
    // (the masked token's reward 5 enters its own δ but is never carried)
    let r = v2(&returns);
    assert!(close(r[0][2], 1.0) && close(r[0][0], 1.0), "{r:?}");
}

#[test]
fn multi_trajectory_grpo_uses_each_sessions_final_output_and_broadcasts_it() {
    // uid u: session 0 has outputs 0 and 1 (final = index 1, score 3); session 1 has one output (score 1).
    let keys = uids(&["u_0_0", "u_0_1", "u_1_0"]);
    let rewards = t2(&[&[7.0, 0.0], &[0.0, 3.0], &[1.0, 0.0]]);
    let mask = t2(&[&[1.0, 1.0], &[1.0, 1.0], &[1.0, 0.0]]);
    let inputs = AdvantageInputs { keys: Some(&keys), ..AdvantageInputs::new(&rewards, &mask) };
    let cfg = AdvantageConfig { norm_adv_by_std_in_grpo: false, ..AdvantageConfig::default() };
    let (adv, returns) = compute_advantage(AdvantageEstimator::Grpo, &inputs, &cfg).unwrap();
    // group of the two finals {3, 1}: mean 2; the non-final row 0 gets its session's +1, ignoring its own 7
    assert_rows(&adv, &[&[1.0, 1.0], &[1.0, 1.0], &[-1.0, 0.0]]);
    assert_rows(&returns, &[&[1.0, 1.0], &[1.0, 1.0], &[-1.0, 0.0]]);
}

#[test]
fn malformed_trajectory_key_is_rejected_with_the_key_in_the_message() {
    let keys = uids(&["no-separators"]);
    let rewards = t2(&[&[1.0]]);
    let inputs = AdvantageInputs { keys: Some(&keys), ..AdvantageInputs::new(&rewards, &rewards) };
    let err = compute_advantage(AdvantageEstimator::Grpo, &inputs, &AdvantageConfig::default()).unwrap_err();
    assert!(err.to_string().contains("no-separators"), "{err}");
}

#[test]
fn grpo_passk_rejects_singleton_groups() {
    let rewards = t2(&[&[1.0], &[0.0], &[1.0]]);
    let mask = t2(&[&[1.0], &[1.0], &[1.0]]);
    let index = uids(&["a", "a", "b"]);
    let inputs = AdvantageInputs { index: Some(&index), ..AdvantageInputs::new(&rewards, &mask) };
    let err = compute_advantage(AdvantageEstimator::GrpoPassk, &inputs, &AdvantageConfig::default()).unwrap_err();
    assert!(matches!(err, AlgoError::Advantage { estimator: "grpo_passk", .. }), "{err}");
}

#[test]
fn grouped_estimator_without_uids_names_the_missing_input() {
    let rewards = t2(&[&[1.0]]);
    let err = compute_advantage(
        AdvantageEstimator::Rloo,
        &AdvantageInputs::new(&rewards, &rewards),
        &AdvantageConfig::default(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("index"), "{err}");
}

#[test]
fn estimator_names_round_trip_and_unknown_names_are_reported() {
    for &estimator in AdvantageEstimator::ALL {
        assert_eq!(estimator.as_str().parse::<AdvantageEstimator>().unwrap(), estimator);
    }
    let err = "grpo++".parse::<AdvantageEstimator>().unwrap_err();
    assert!(err.to_string().contains("grpo++"), "{err}");
    for &mode in PolicyLossMode::ALL {
        assert_eq!(mode.as_str().parse::<PolicyLossMode>().unwrap(), mode);
    }
    assert!("ppo".parse::<PolicyLossMode>().unwrap_err().to_string().contains("\"ppo\""));
    for &mode in AggMode::ALL {
        assert_eq!(mode.as_str().parse::<AggMode>().unwrap(), mode);
    }
}

// ---------------------------------------------------------------- policy losses

fn vanilla_case(advantage: f64, log_ratio: f64) -> (f64, PolicyLossMetrics) {
    let old = t2(&[&[-1.0]]);
    let log_prob = &old + log_ratio;
    let adv = t2(&[&[advantage]]);
    let mask = t2(&[&[1.0]]);
    let inputs = PolicyLossInputs {
        old_log_prob: &old,
        log_prob: &log_prob,
        advantages: &adv,
        response_mask: &mask,
        rollout_is_weights: None,
    };
    let params = PolicyLossParams { clip_ratio: 0.2, clip_ratio_c: 3.0, ..PolicyLossParams::default() };
    let (loss, metrics) =
        compute_policy_loss(PolicyLossMode::Vanilla, &inputs, &params, &GlobalBatchInfo::default()).unwrap();
    (scalar(&loss), metrics)
}

#[test]
fn dual_clip_caps_the_loss_of_negative_advantages_at_c_times_advantage() {
    // A = −1, ρ = e² ≈ 7.39 > c = 3: the loss is −A·c = 3 and counts as a lower clip.
    let (loss, metrics) = vanilla_case(-1.0, 2.0);
    assert!(close(loss, 3.0), "{loss}");
    assert_eq!(metric(metrics.pg_clipfrac_lower), 1.0);
    assert_eq!(metric(metrics.pg_clipfrac), 0.0);
    // A = −1, ρ = 2 (between 1+ε and c): the unclipped −Aρ = 2 is the larger loss and stays.
    let (loss, metrics) = vanilla_case(-1.0, 2f64.ln());
    assert!(close(loss, 2.0), "{loss}");
    assert_eq!(metric(metrics.pg_clipfrac_lower), 0.0);
    // A = +1, ρ = 2: clipped to 1.2, loss −1.2, an upper clip; dual clip never applies to A > 0.
    let (loss, metrics) = vanilla_case(1.0, 2f64.ln());
    assert!(close(loss, -1.2), "{loss}");
    assert_eq!(metric(metrics.pg_clipfrac), 1.0);
    assert_eq!(metric(metrics.pg_clipfrac_lower), 0.0);
    // ppo_kl is the mean of −Δ
    assert_eq!(metric(metrics.ppo_kl), metric(Some(-(2f64.ln()))));
}

#[test]
fn vanilla_rejects_a_dual_clip_bound_not_above_one() {
    let x = t2(&[&[0.0]]);
    let inputs = PolicyLossInputs {
        old_log_prob: &x,
        log_prob: &x,
        advantages: &x,
        response_mask: &x,
        rollout_is_weights: None,
    };
    let params = PolicyLossParams { clip_ratio_c: 1.0, ..PolicyLossParams::default() };
    let err = compute_policy_loss(PolicyLossMode::Vanilla, &inputs, &params, &GlobalBatchInfo::default()).unwrap_err();
    assert!(err.to_string().contains("clip_ratio_c"), "{err}");
}

#[test]
fn clip_ratio_bounds_fall_back_to_clip_ratio_from_the_actor_config() {
    let actor = jetrl_config::ActorConfig { clip_ratio: 0.3, clip_ratio_high: Some(0.28), ..Default::default() };
    let params = PolicyLossParams::from_config(&actor).unwrap();
    assert_eq!((params.low(), params.high()), (0.3, 0.28));
}

#[test]
fn policy_loss_is_differentiable_in_f32_and_stays_f32() {
    let old = Tensor::from_slice(&[-1.0f32, -2.0, -0.5, -1.5]).reshape([2, 2]);
    let log_prob = (&old + 0.1).detach().set_requires_grad(true);
    let adv = Tensor::from_slice(&[1.0f32, -1.0, 0.5, 2.0]).reshape([2, 2]);
    let mask = Tensor::ones([2, 2], (Kind::Float, Device::Cpu));
    let inputs = PolicyLossInputs {
        old_log_prob: &old,
        log_prob: &log_prob,
        advantages: &adv,
        response_mask: &mask,
        rollout_is_weights: None,
    };
    for &mode in PolicyLossMode::ALL {
        if matches!(mode, PolicyLossMode::BypassMode | PolicyLossMode::Dro) {
            continue;
        }
        let (loss, _) =
            compute_policy_loss(mode, &inputs, &PolicyLossParams::default(), &GlobalBatchInfo::default()).unwrap();
        assert_eq!(loss.kind(), Kind::Float, "{mode}");
        let grad = Tensor::run_backward(&[&loss], &[&log_prob], false, false);
        assert!(v2(&grad[0]).iter().flatten().any(|g| *g != 0.0), "{mode} has no gradient");
    }
}

#[test]
fn clip_cov_pick_is_deterministic_per_seed_and_zeroes_clip_num_tokens() {
    let old = Tensor::zeros([4, 8], (Kind::Double, Device::Cpu));
    let log_prob = Tensor::from_slice(&(0..32).map(|i| -0.01 * i as f64).collect::<Vec<_>>()).reshape([4, 8]);
    let adv =
        Tensor::from_slice(&(0..32).map(|i| if i % 2 == 0 { 3.0 } else { -3.0 }).collect::<Vec<_>>()).reshape([4, 8]);
    let mask = Tensor::ones([4, 8], (Kind::Double, Device::Cpu));
    let inputs = PolicyLossInputs {
        old_log_prob: &old,
        log_prob: &log_prob,
        advantages: &adv,
        response_mask: &mask,
        rollout_is_weights: None,
    };
    let params = |seed| PolicyLossParams {
        clip_cov_ratio: 0.1,
        clip_cov_lb: -10.0,
        clip_cov_ub: 10.0,
        seed,
        ..PolicyLossParams::default()
    };
    let run = |seed| {
        compute_policy_loss(PolicyLossMode::ClipCov, &inputs, &params(seed), &GlobalBatchInfo::default()).unwrap()
    };
    let (a, ma) = run(1);
    let (b, mb) = run(1);
    assert_eq!(scalar(&a), scalar(&b));
    // clip_num = int(0.1·32) = 3 of 32 tokens
    assert_eq!(metric(ma.pg_clipfrac), metric(Some(3.0 / 32.0)), "{ma:?}");
    assert_eq!(ma, mb);
}

#[test]
fn bypass_mode_without_rollout_correction_is_an_error() {
    let x = t2(&[&[-1.0]]);
    let inputs = PolicyLossInputs {
        old_log_prob: &x,
        log_prob: &x,
        advantages: &x,
        response_mask: &x,
        rollout_is_weights: None,
    };
    let err = compute_policy_loss(
        PolicyLossMode::BypassMode,
        &inputs,
        &PolicyLossParams::default(),
        &GlobalBatchInfo::default(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("rollout_correction"), "{err}");
}

/// verl's `apply_bypass_mode`: with `rollout_correction.bypass_mode` on, the actor's loss is `bypass_mode`.
#[test]
fn rollout_correction_bypass_makes_the_actor_loss_bypass_mode() {
    let actor = jetrl_config::ActorConfig::default();
    let mut correction = jetrl_config::RolloutCorrectionConfig::default();
    let plain = ActorLossParams::from_config(&actor, Some(&correction)).unwrap();
    assert_eq!(plain.mode, PolicyLossMode::Vanilla);
    correction.bypass_mode = true;
    let bypass = ActorLossParams::from_config(&actor, Some(&correction)).unwrap();
    assert_eq!(bypass.mode, PolicyLossMode::BypassMode);
    assert!(bypass.policy.rollout_correction.is_some());
}

#[test]
fn policy_loss_rejects_mismatched_shapes_naming_the_input() {
    let a = t2(&[&[0.0, 0.0]]);
    let b = t2(&[&[0.0]]);
    let inputs = PolicyLossInputs {
        old_log_prob: &a,
        log_prob: &a,
        advantages: &b,
        response_mask: &a,
        rollout_is_weights: None,
    };
    let err = compute_policy_loss(
        PolicyLossMode::Vanilla,
        &inputs,
        &PolicyLossParams::default(),
        &GlobalBatchInfo::default(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("advantages"), "{err}");
}

#[test]
fn actor_loss_adds_kl_and_subtracts_the_entropy_bonus() {
    let old = t2(&[&[-1.0, -1.0]]);
    let log_prob = t2(&[&[-1.0, -1.0]]);
    let reference = t2(&[&[-2.0, -1.0]]);
    let adv = t2(&[&[1.0, 1.0]]);
    let mask = t2(&[&[1.0, 1.0]]);
    let entropy = t2(&[&[0.5, 1.5]]);
    let params = ActorLossParams {
        mode: PolicyLossMode::Vanilla,
        policy: PolicyLossParams::default(),
        entropy_coeff: 0.1,
        use_kl_loss: true,
        kl_loss_coef: 0.5,
        kl_loss_type: "k1".parse().unwrap(),
    };
    let inputs = ActorLossInputs {
        policy: PolicyLossInputs {
            old_log_prob: &old,
            log_prob: &log_prob,
            advantages: &adv,
            response_mask: &mask,
            rollout_is_weights: None,
        },
        entropy: Some(&entropy),
        ref_log_prob: Some(&reference),
    };
    let (loss, metrics) = compute_actor_loss(&inputs, &params, &GlobalBatchInfo::default()).unwrap();
    // pg = −1 (ρ = 1), entropy mean 1, k1 mean (1 + 0)/2 = 0.5: −1 − 0.1·1 + 0.5·0.5
    assert!(close(scalar(&loss), -0.85), "{}", scalar(&loss));
    assert_eq!(metric(metrics.entropy_loss), 1.0);
    assert_eq!(metric(metrics.kl_loss), 0.5);
    assert!(metrics.to_map().contains_key("actor/pg_clipfrac"));
}

// ---------------------------------------------------------------- aggregation

#[test]
fn fully_masked_row_is_excluded_from_the_sequence_mean() {
    let loss = t2(&[&[1.0, 1.0], &[5.0, 5.0], &[3.0, 1.0]]);
    let mask = t2(&[&[1.0, 1.0], &[0.0, 0.0], &[1.0, 0.0]]);
    let info = GlobalBatchInfo::default();
    let agg = |mode| scalar(&agg_loss(&loss, &mask, mode, &info).unwrap());
    assert!(close(agg(AggMode::TokenMean), 5.0 / 3.0));
    assert!(close(agg(AggMode::TokenSum), 5.0));
    assert!(close(agg(AggMode::SeqMeanTokenSum), 2.5));
    assert!(close(agg(AggMode::SeqMeanTokenSumNorm), 1.25));
    assert!((agg(AggMode::SeqMeanTokenMean) - 2.0).abs() < 1e-7);
}

#[test]
fn batch_without_valid_tokens_aggregates_to_zero_instead_of_nan() {
    let loss = t2(&[&[1.0, 2.0]]);
    let mask = t2(&[&[0.0, 0.0]]);
    for &mode in AggMode::ALL {
        assert_eq!(scalar(&agg_loss(&loss, &mask, mode, &GlobalBatchInfo::default()).unwrap()), 0.0, "{mode}");
    }
}

#[test]
fn micro_batches_with_global_counts_sum_to_the_whole_batch_loss_and_gradient() {
    let values: Vec<f64> = (0..24).map(|i| ((i * 37) % 11) as f64 / 3.0 - 1.5).collect();
    let mask_values: Vec<f64> = (0..24).map(|i| if (i * 7) % 5 == 0 || i % 6 > 3 { 0.0 } else { 1.0 }).collect();
    let whole = Tensor::from_slice(&values).reshape([4, 6]).set_requires_grad(true);
    let mask = Tensor::from_slice(&mask_values).reshape([4, 6]);
    let tokens = scalar(&mask.sum(Kind::Double));
    let sequences = 4.0;
    for &mode in AggMode::ALL {
        let info_whole = GlobalBatchInfo { loss_scale_factor: Some(6.0), ..GlobalBatchInfo::default() };
        let full = agg_loss(&whole, &mask, mode, &info_whole).unwrap();
        let full_grad = Tensor::run_backward(&[&full], &[&whole], false, false).remove(0);
        let info = GlobalBatchInfo {
            dp_size: 1,
            batch_num_tokens: Some(tokens),
            global_batch_size: Some(sequences),
            loss_scale_factor: Some(6.0),
        };
        let parts = whole.split(2, 0);
        let masks = mask.split(2, 0);
        let split: Tensor = parts.iter().zip(&masks).map(|(p, m)| agg_loss(p, m, mode, &info).unwrap()).sum();
        let split_grad = Tensor::run_backward(&[&split], &[&whole], false, false).remove(0);
        assert!(close(scalar(&split), scalar(&full)), "{mode}: {} vs {}", scalar(&split), scalar(&full));
        let (a, b) = (v2(&split_grad), v2(&full_grad));
        assert!(a.iter().flatten().zip(b.iter().flatten()).all(|(x, y)| close(*x, *y)), "{mode}");
    }
}

#[test]
fn data_parallel_aggregation_requires_global_counts() {
    let x = t2(&[&[1.0]]);
    let info = GlobalBatchInfo { dp_size: 2, ..GlobalBatchInfo::default() };
    assert!(agg_loss(&x, &x, AggMode::TokenMean, &info).unwrap_err().to_string().contains("batch_num_tokens"));
    assert!(agg_loss(&x, &x, AggMode::SeqMeanTokenSum, &info).unwrap_err().to_string().contains("global_batch_size"));
    assert_eq!(scalar(&agg_loss(&x, &x, AggMode::TokenSum, &info).unwrap()), 2.0);
}

// ---------------------------------------------------------------- KL

#[test]
fn straight_through_kl_has_the_value_of_k3_and_the_gradient_of_k2() {
    let logprob = t2(&[&[-1.0, -0.2]]).set_requires_grad(true);
    let reference = t2(&[&[-1.5, -0.7]]);
    let plus: KlPenalty = "k3+".parse().unwrap();
    let value = kl_penalty(&logprob, &reference, plus);
    let k3 = kl_penalty(&logprob, &reference, "low_var_kl".parse().unwrap());
    assert_rows(&value, &v2(&k3).iter().map(Vec::as_slice).collect::<Vec<_>>());
    let grad = Tensor::run_backward(&[&value.sum(Kind::Double)], &[&logprob], false, false).remove(0);
    assert_rows(&grad, &[&[0.5, 0.5]]); // d/dx ½(x − ref)² = Δ
    assert!(!"mse+".parse::<KlPenalty>().unwrap().straight_through);
    assert!("full".parse::<KlPenalty>().unwrap_err().to_string().contains("full"));
}

#[test]
fn k3_is_clamped_to_ten() {
    let value = kl_penalty(&t2(&[&[0.0]]), &t2(&[&[30.0]]), "k3".parse().unwrap());
    assert_eq!(scalar(&value.sum(Kind::Double)), 10.0);
}

#[test]
fn kl_in_reward_penalises_valid_tokens_and_updates_the_controller() {
    let scores = t2(&[&[0.0, 1.0], &[2.0, 0.0]]);
    let old = t2(&[&[-1.0, -1.0], &[-1.0, -1.0]]);
    let reference = t2(&[&[-1.5, -2.0], &[-1.2, -9.0]]);
    let mask = t2(&[&[1.0, 1.0], &[1.0, 0.0]]);
    let mut controller = KlController::adaptive(0.1, 0.1, 100.0).unwrap();
    let (rewards, metrics) =
        apply_kl_penalty(&scores, &old, &reference, &mask, "kl".parse().unwrap(), &mut controller).unwrap();
    // kl = old − ref = [[0.5, 1], [0.2, (masked)]]; rewards = scores − 0.1·kl·mask
    assert_rows(&rewards, &[&[-0.05, 0.9], &[1.98, 0.0]]);
    // per-row masked means 0.75 and 0.2 → 0.475
    assert!((metrics.current_kl - 0.475).abs() < 1e-7, "{metrics:?}");
    assert_eq!(metrics.coefficient, 0.1);
    // error clip(0.475/0.1 − 1) = 0.2 → β·(1 + 0.2·2/100)
    assert!(close(controller.value(), 0.1 * 1.004), "{}", controller.value());
}

#[test]
fn kl_controller_state_survives_a_serde_round_trip() {
    let mut controller = KlController::from_config(&jetrl_config::KlCtrlConfig {
        kind: jetrl_config::KlCtrlType::Adaptive,
        kl_coef: 0.05,
        horizon: 1000.0,
        target_kl: 0.1,
    })
    .unwrap();
    controller.update(0.3, 50);
    let json = serde_json::to_string(&controller).unwrap();
    let restored: KlController = serde_json::from_str(&json).unwrap();
    assert_eq!(restored, controller);
    assert!(json.contains("\"type\":\"adaptive\""), "{json}");
    let bad =
        jetrl_config::KlCtrlConfig { kind: jetrl_config::KlCtrlType::Adaptive, horizon: 0.0, ..Default::default() };
    assert!(KlController::from_config(&bad).unwrap_err().to_string().contains("horizon"));
}

// ---------------------------------------------------------------- value loss, logits

#[test]
fn value_loss_takes_the_larger_of_the_clipped_and_unclipped_errors() {
    // v = 2, V_old = 0, c = 0.5 → clipped 0.5; R = 0: errors 4 and 0.25 → 4; R = 3: errors 1 and 6.25 → 6.25
    let vpreds = t2(&[&[2.0, 2.0]]);
    let values = t2(&[&[0.0, 0.0]]);
    let returns = t2(&[&[0.0, 3.0]]);
    let mask = t2(&[&[1.0, 1.0]]);
    let (loss, metrics) =
        compute_value_loss(&vpreds, &returns, &values, &mask, 0.5, AggMode::TokenSum, &GlobalBatchInfo::default())
            .unwrap();
    assert!(close(scalar(&loss), 0.5 * (4.0 + 6.25)));
    assert!((metrics.vf_clipfrac - 0.5).abs() < 1e-7);
    assert!((metrics.vpred_mean - 2.0).abs() < 1e-7);
}

#[test]
fn entropy_of_uniform_logits_is_log_vocab_and_bf16_is_computed_in_f32() {
    let logits = Tensor::zeros([2, 3, 8], (Kind::BFloat16, Device::Cpu));
    let entropy = entropy_from_logits(&logits);
    assert_eq!(entropy.kind(), Kind::Float);
    assert!((entropy.double_value(&[1, 2]) - 8f64.ln()).abs() < 1e-6);
    let ids = Tensor::from_slice(&[0i64, 7, 3, 1, 2, 5]).reshape([2, 3]);
    let logprobs = logprobs_from_logits(&logits, &ids);
    assert!((logprobs.double_value(&[0, 1]) + 8f64.ln()).abs() < 1e-6);
    let bad = Tensor::from_slice(&[8i64, 0, 0, 0, 0, 0]).reshape([2, 3]);
    assert!(f_logprobs_from_logits(&logits, &bad).unwrap_err().to_string().contains("[0, 8)"));
}

// ---------------------------------------------------------------- rollout correction

#[test]
fn truncated_is_clamps_and_icepop_zeroes_out_of_range_weights() {
    // log ratios ln 3, ln 0.5, 0 on valid tokens; the last token is padding
    let old = t2(&[&[3f64.ln(), 0.5f64.ln(), 0.0, 5.0]]);
    let rollout = t2(&[&[0.0, 0.0, 0.0, 0.0]]);
    let mask = t2(&[&[1.0, 1.0, 1.0, 0.0]]);
    let tis = RolloutCorrectionParams { rollout_is: Some(IsLevel::Token), ..RolloutCorrectionParams::default() };
    let out = compute_rollout_correction(&old, &rollout, &mask, &tis).unwrap();
    assert_rows(out.weights.as_ref().unwrap(), &[&[2.0, 0.5, 1.0, 0.0]]);
    let icepop = RolloutCorrectionParams {
        rollout_is: Some(IsLevel::Token),
        is_threshold: IsThreshold::parse(&jetrl_config::ThresholdSpec::Text("0.6_2.5".into())).unwrap(),
        ..RolloutCorrectionParams::default()
    };
    let out = compute_rollout_correction(&old, &rollout, &mask, &icepop).unwrap();
    assert_rows(out.weights.as_ref().unwrap(), &[&[0.0, 0.0, 1.0, 0.0]]);
    assert!(out.metrics.contains_key("rollout_corr/rollout_is_oob_ratio"));
}

#[test]
fn sequence_rejection_drops_every_token_of_a_divergent_sequence() {
    let old = t2(&[&[0.0, 0.0], &[0.0, 2.0]]);
    let rollout = t2(&[&[0.0, 0.0], &[0.0, 0.0]]);
    let mask = t2(&[&[1.0, 1.0], &[1.0, 1.0]]);
    let params = RolloutCorrectionParams {
        rejection: parse_rejection("seq_max_k2", Some(&jetrl_config::ThresholdSpec::Number(1.0))).unwrap(),
        ..RolloutCorrectionParams::default()
    };
    let out = compute_rollout_correction(&old, &rollout, &mask, &params).unwrap();
    assert!(out.weights.is_none());
    assert_rows(&out.response_mask, &[&[1.0, 1.0], &[0.0, 0.0]]);
    assert_eq!(metric(Some(out.metrics["rollout_corr/rollout_rs_seq_masked_fraction"])), 0.5);
    assert!(parse_rejection("seq_max_k1", Some(&jetrl_config::ThresholdSpec::Number(1.0))).is_err());
    assert!(parse_rejection("token_k2", None).unwrap_err().to_string().contains("rollout_rs_threshold"));
}

// ---------------------------------------------------------------- golden checker, PF-PPO

#[test]
fn golden_checker_rejects_a_tampered_case_and_names_unknown_variants() {
    let case = serde_json::json!({
        "fn": "agg_loss", "name": "token-sum", "config": {},
        "inputs": {"loss_mat": [[1.0, 2.0]], "loss_mask": [[1.0, 1.0]]},
        "expected": {"loss": 3.0}
    });
    golden::check_case(&case).unwrap();
    let mut tampered = case.clone();
    tampered["expected"]["loss"] = serde_json::json!(3.01);
    assert!(golden::check_case(&tampered).unwrap_err().contains("loss"));
    let mut unknown = case.clone();
    unknown["name"] = serde_json::json!("token-median");
    assert!(golden::check_case(&unknown).unwrap_err().contains("token-median"));
    let mut family = case;
    family["fn"] = serde_json::json!("entropy_bonus");
    assert!(golden::check_case(&family).unwrap_err().contains("entropy_bonus"));
}

#[test]
fn pf_ppo_max_min_draws_only_the_extreme_rows() {
    let scores = [0.5, 2.0, 1.0, -1.0];
    assert_eq!(pf_ppo_weights(&scores, PfPpoReweight::MaxMin), vec![0.0, 1.0, 0.0, 1.0]);
    let rows = pf_ppo_resample(&scores, PfPpoReweight::MaxMin, 3).unwrap();
    assert_eq!(rows.len(), 4);
    assert!(rows.iter().all(|r| *r == 1 || *r == 3), "{rows:?}");
    assert_eq!(rows, pf_ppo_resample(&scores, PfPpoReweight::MaxMin, 3).unwrap());
}
