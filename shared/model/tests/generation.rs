//! Generation, the KV cache and the training forward agree with each other on the same weights.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

mod common;

use common::*;
use jetrl_model::{generate, token_log_probs, CausalLm, DType, FinishReason, Generation, ModelError, SamplingParams};
use tch::{Device, Kind, Tensor};

/// libtorch's generator is process-global: tests that seed and sample hold this so parallel tests do not draw
/// from it in between.
static RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn rng_guard() -> std::sync::MutexGuard<'static, ()> {
    RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn model() -> CausalLm {
    CausalLm::load(&hf_sample_llama(), Device::Cpu, DType::F32).unwrap()
}

fn prompts() -> Vec<Vec<u32>> {
    vec![vec![1, 87, 85, 266, 201, 57], vec![5, 9], vec![223, 231, 35, 47, 260, 71, 92, 267, 31, 130, 128], vec![42]]
}

/// Recomputes each row's generated-token log-probs with `forward` on `prompt ++ tokens`, right-padded into one
/// batch, at the row's temperature.
fn recompute(model: &CausalLm, prompts: &[Vec<u32>], gens: &[Generation], temps: &[f64]) -> Vec<Vec<f32>> {
    let rows: Vec<Vec<u32>> = prompts.iter().zip(gens).map(|(p, g)| [p.clone(), g.tokens.clone()].concat()).collect();
    let width = rows.iter().map(Vec::len).max().unwrap();
    let b = rows.len();
    let mut ids = vec![0i64; b * width];
    let mut mask = vec![0i64; b * width];
    for (r, row) in rows.iter().enumerate() {
        for (j, &id) in row.iter().enumerate() {
            ids[r * width + j] = i64::from(id);
            mask[r * width + j] = 1;
        }
    }
    let ids = Tensor::from_slice(&ids).view([b as i64, width as i64]);
    let mask = Tensor::from_slice(&mask).view([b as i64, width as i64]);
    let logits = tch::no_grad(|| model.forward(&ids, &mask)).unwrap();
    (0..b)
        .map(|r| {
            let lp = token_log_probs(&logits.narrow(0, r as i64, 1), &ids.narrow(0, r as i64, 1), temps[r]).unwrap();
            let start = prompts[r].len() - 1;
            (0..gens[r].tokens.len()).map(|j| lp.double_value(&[0, (start + j) as i64]) as f32).collect()
        })
        .collect()
}

#[test]
fn generation_logprobs_match_forward_recompute_for_a_ragged_batch() {
    let _rng = rng_guard();
    let model = model();
    let prompts = prompts();
    let params = vec![
        SamplingParams { temperature: 0.7, max_new_tokens: 24, ..Default::default() },
        SamplingParams { temperature: 0.0, max_new_tokens: 17, ..Default::default() },
        SamplingParams { temperature: 1.3, top_p: 0.9, top_k: 50, max_new_tokens: 30, ..Default::default() },
        SamplingParams { temperature: 1.0, top_k: 5, max_new_tokens: 9, ..Default::default() },
    ];
    tch::manual_seed(7);
    let gens = generate(&model, &prompts, &params, &[]).unwrap();
    for (g, p) in gens.iter().zip(&params) {
        assert_eq!(g.tokens.len(), p.max_new_tokens, "no EOS given, every row runs to its length");
        assert_eq!(g.finish, FinishReason::Length);
        assert_eq!(g.logprobs.len(), g.tokens.len());
    }
    let temps: Vec<f64> = params.iter().map(|p| f64::from(p.temperature)).collect();
    let recomputed = recompute(&model, &prompts, &gens, &temps);
    let generated: Vec<Vec<f32>> = gens.iter().map(|g| g.logprobs.clone()).collect();
    let d = diff(&generated, &recomputed);
    println!("generation vs forward log-probs: max {:.3e} mean {:.3e} over {}", d.max, d.mean, d.count);
    assert!(d.mean <= 1e-4, "{d:?}");
    assert!(d.max <= 1e-3, "{d:?}");
}

#[test]
fn greedy_generation_follows_the_argmax_of_forward() {
    let model = model();
    let prompts = prompts();
    let params = [SamplingParams { temperature: 0.0, max_new_tokens: 12, ..Default::default() }];
    let gens = generate(&model, &prompts, &params, &[]).unwrap();
    for (prompt, g) in prompts.iter().zip(&gens) {
        let mut ids: Vec<i64> = prompt.iter().map(|&t| i64::from(t)).collect();
        for &token in &g.tokens {
            let input = Tensor::from_slice(&ids).unsqueeze(0);
            let logits = tch::no_grad(|| model.forward(&input, &input.ones_like())).unwrap();
            let next = logits.select(1, -1).argmax(-1, false).int64_value(&[0]);
            assert_eq!(i64::from(token), next);
            ids.push(next);
        }
    }
    let again = generate(&model, &prompts, &params, &[]).unwrap();
    assert_eq!(gens, again, "greedy decoding is deterministic");
}

#[test]
fn each_row_stops_at_its_own_stop_token_which_is_included() {
    let model = model();
    let prompts = prompts();
    let greedy = SamplingParams { temperature: 0.0, max_new_tokens: 10, ..Default::default() };
    let free = generate(&model, &prompts, std::slice::from_ref(&greedy), &[]).unwrap();
    // Row 0 stops at its 3rd greedy token via stop_token_ids; row 2 at its 5th via the EOS list.
    let stop0 = free[0].tokens[2];
    let eos = free[2].tokens[4];
    let params: Vec<SamplingParams> = (0..prompts.len())
        .map(|r| SamplingParams { stop_token_ids: if r == 0 { vec![stop0] } else { vec![] }, ..greedy.clone() })
        .collect();
    let gens = generate(&model, &prompts, &params, &[eos]).unwrap();
    let first = |tokens: &[u32], t: u32| tokens.iter().position(|&x| x == t);
    let cut0 = first(&free[0].tokens, stop0).unwrap().min(first(&free[0].tokens, eos).unwrap_or(usize::MAX));
    assert_eq!(gens[0].tokens, free[0].tokens[..=cut0]);
    assert_eq!(gens[0].finish, FinishReason::Stop);
    let cut2 = first(&free[2].tokens, eos).unwrap();
    assert_eq!(gens[2].tokens, free[2].tokens[..=cut2]);
    assert_eq!(gens[2].finish, FinishReason::Stop);
    for r in [1, 3] {
        match first(&free[r].tokens, eos) {
            Some(cut) => assert_eq!(gens[r].tokens, free[r].tokens[..=cut]),
            None => assert_eq!(gens[r], free[r]),
        }
    }
}

#[test]
fn seeded_sampling_is_reproducible() {
    let _rng = rng_guard();
    let model = model();
    let params = [SamplingParams { temperature: 1.0, max_new_tokens: 16, ..Default::default() }];
    tch::manual_seed(123);
    let a = generate(&model, &prompts(), &params, &[]).unwrap();
    tch::manual_seed(123);
    let b = generate(&model, &prompts(), &params, &[]).unwrap();
    assert_eq!(a, b);
    tch::manual_seed(124);
    let c = generate(&model, &prompts(), &params, &[]).unwrap();
    assert_ne!(a, c);
}

#[test]
fn top_k_one_sampling_equals_greedy() {
    let _rng = rng_guard();
    let model = model();
    let greedy = generate(
        &model,
        &prompts(),
        &[SamplingParams { temperature: 0.0, max_new_tokens: 8, ..Default::default() }],
        &[],
    )
    .unwrap();
    tch::manual_seed(1);
    let topk = generate(
        &model,
        &prompts(),
        &[SamplingParams { temperature: 1.0, top_k: 1, max_new_tokens: 8, ..Default::default() }],
        &[],
    )
    .unwrap();
    for (g, k) in greedy.iter().zip(&topk) {
        assert_eq!(g.tokens, k.tokens);
    }
}

#[test]
fn kv_cache_steps_reproduce_the_full_forward() {
    let model = model();
    let seq: Vec<i64> = (0..20).map(|i| (i * 37 + 11) % 400).collect();
    // Two rows: row 1 is the same sequence left-padded by 3.
    let pad = 3usize;
    let width = seq.len() + pad;
    let mut ids = vec![0i64; 2 * width];
    let mut mask = vec![0i64; 2 * width];
    for (j, &t) in seq.iter().enumerate() {
        ids[j] = t;
        mask[j] = 1;
        ids[width + pad + j] = t;
        mask[width + pad + j] = 1;
    }
    let ids = Tensor::from_slice(&ids).view([2, width as i64]);
    let mask = Tensor::from_slice(&mask).view([2, width as i64]);
    let full = tch::no_grad(|| model.forward(&ids, &mask)).unwrap();

    let positions = (mask.cumsum(1, Kind::Int64) - 1).clamp_min(0);
    let mut cache = model.new_cache(2, width as i64).unwrap();
    let mut chunks = Vec::new();
    let mut start = 0i64;
    for len in [7i64, 1, 5, 1, 1, 8] {
        let logits = model
            .forward_step(
                &ids.narrow(1, start, len),
                &positions.narrow(1, start, len),
                &mut cache,
                &mask.narrow(1, 0, start + len),
            )
            .unwrap();
        chunks.push(logits);
        start += len;
    }
    assert_eq!(start, width as i64);
    assert_eq!(cache.len(), width as i64);
    let stepped = Tensor::cat(&chunks, 1);
    // Compare at real tokens only (padding outputs are meaningless).
    let real = mask.unsqueeze(-1).to_kind(Kind::Bool);
    let delta = (stepped - &full).abs().masked_select(&real).max().double_value(&[]);
    println!("KV-cache steps vs full forward: max |Δlogit| {delta:.3e}");
    assert!(delta < 1e-4, "{delta}");
    // The left-padded row equals the unpadded one.
    let row0 = full.narrow(0, 0, 1).narrow(1, 0, seq.len() as i64);
    let row1 = full.narrow(0, 1, 1).narrow(1, pad as i64, seq.len() as i64);
    assert!((row0 - row1).abs().max().double_value(&[]) < 1e-4);

    let err = model
        .forward_step(&ids.narrow(1, 0, 1), &positions.narrow(1, 0, 1), &mut cache, &mask.narrow(1, 0, 1))
        .unwrap_err();
    assert!(matches!(err, ModelError::Generation(_)), "a full cache refuses more tokens: {err}");
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

#[test]
fn invalid_requests_are_rejected_with_generation_errors() {
    let model = model();
    let ok = SamplingParams::default();
    let bad = |prompts: &[Vec<u32>], params: &[SamplingParams]| generate(&model, prompts, params, &[]).unwrap_err();
    assert!(matches!(bad(&[vec![]], std::slice::from_ref(&ok)), ModelError::Generation(_)));
    assert!(matches!(bad(&[vec![1, 100_000]], std::slice::from_ref(&ok)), ModelError::Generation(_)));
    assert!(matches!(bad(&[vec![1], vec![2]], &[ok.clone(), ok.clone(), ok.clone()]), ModelError::Generation(_)));
    let neg = SamplingParams { temperature: -1.0, ..ok.clone() };
    assert!(matches!(bad(&[vec![1]], &[neg]), ModelError::Generation(_)));
    let zero = SamplingParams { max_new_tokens: 0, ..ok };
    let out = generate(&model, &[vec![1, 2]], &[zero], &[]).unwrap();
    assert!(out[0].tokens.is_empty() && out[0].finish == FinishReason::Length);
}

#[test]
fn bf16_generation_runs_and_reports_finite_logprobs() {
    let _rng = rng_guard();
    let model = CausalLm::load(&hf_sample_llama(), Device::Cpu, DType::BF16).unwrap();
    tch::manual_seed(3);
    let gens =
        generate(&model, &prompts(), &[SamplingParams { max_new_tokens: 6, ..Default::default() }], &[]).unwrap();
    for g in gens {
        assert_eq!(g.tokens.len(), 6);
        assert!(g.logprobs.iter().all(|lp| lp.is_finite() && *lp <= 0.0));
    }
}
