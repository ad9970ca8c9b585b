//! The continuous-batching engine: its log-probs are the trainer's, its batching changes nothing a sequence
//! sees, and its group forks, seeds, stops, penalties, weight swaps and abort/resume behave as documented.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

mod common;

use std::sync::Arc;

use common::*;
use jetrl_model::engine::Detokenizer;
use jetrl_model::{
    token_log_probs, CausalLm, DType, Engine, EngineConfig, Finish, LogprobsMode, Prefix, Request, Sampling,
    SequenceOutput, Tokenizer,
};
use tch::{Device, Tensor};

fn model() -> CausalLm {
    CausalLm::load(&hf_sample_llama(), Device::Cpu, DType::F32).unwrap()
}

fn engine(max_num_seqs: usize) -> Engine {
    let config = EngineConfig { max_num_seqs, max_model_len: 128, seed: 11, ..EngineConfig::default() };
    Engine::new(model(), config).unwrap()
}

fn prompts() -> Vec<Vec<u32>> {
    vec![vec![1, 87, 85, 266, 201, 57], vec![5, 9], vec![223, 231, 35, 47, 260, 71, 92, 267, 31, 130, 128], vec![42]]
}

fn sampled(max_tokens: usize, seed: u64) -> Sampling {
    Sampling { temperature: 1.0, max_tokens, seed: Some(seed), ..Sampling::default() }
}

fn diff_one(a: &[f32], b: &[f32]) -> Diff {
    diff(&[a.to_vec()], &[b.to_vec()])
}

/// Outputs sorted by (request, sample index).
fn by_request(mut outs: Vec<SequenceOutput>) -> Vec<SequenceOutput> {
    outs.sort_by_key(|o| (o.request, o.index));
    outs
}

/// The trainer's recomputation: one unpadded forward over prompt ++ tokens, `log_softmax(logits / T)`.
fn recompute(model: &CausalLm, prompt: &[u32], tokens: &[u32], temperature: f64) -> Vec<f32> {
    let ids: Vec<i64> = prompt.iter().chain(tokens).map(|&t| i64::from(t)).collect();
    let input = Tensor::from_slice(&ids).unsqueeze(0);
    let logits = tch::no_grad(|| model.forward(&input, &input.ones_like())).unwrap();
    let lp = token_log_probs(&logits, &input, temperature).unwrap();
    (0..tokens.len()).map(|j| lp.double_value(&[0, (prompt.len() - 1 + j) as i64]) as f32).collect()
}

/// Greedy decoding by the training forward, one full forward per token: the argmax of the last position and its
/// log-prob at temperature 1. The reference the engine's greedy path is checked against.
fn greedy_by_forward(model: &CausalLm, prompt: &[u32], max_tokens: usize) -> (Vec<u32>, Vec<f32>) {
    let mut ids: Vec<i64> = prompt.iter().map(|&t| i64::from(t)).collect();
    let (mut tokens, mut logprobs) = (Vec::new(), Vec::new());
    for _ in 0..max_tokens {
        let input = Tensor::from_slice(&ids).unsqueeze(0);
        let logits = tch::no_grad(|| model.forward(&input, &input.ones_like())).unwrap().select(1, -1);
        let next = logits.argmax(-1, false).int64_value(&[0]);
        logprobs.push(logits.log_softmax(-1, tch::Kind::Float).double_value(&[0, next]) as f32);
        tokens.push(u32::try_from(next).unwrap());
        ids.push(next);
    }
    (tokens, logprobs)
}

#[test]
fn engine_logprobs_match_the_trainers_recompute_within_1e4_on_cpu_f32() {
    let mut engine = engine(3);
    let temps = [1.0f32, 0.7, 0.0, 1.3];
    for (i, prompt) in prompts().into_iter().enumerate() {
        let sampling = Sampling { temperature: temps[i], max_tokens: 40, seed: Some(i as u64), ..Sampling::default() };
        engine.add_request(i as u64, Request::new(prompt, 2, sampling)).unwrap();
    }
    let outs = engine.run_to_completion().unwrap();
    assert_eq!(outs.len(), 8);
    let model = model();
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    for o in &outs {
        let r = o.request as usize;
        assert_eq!(o.tokens.len(), 40, "no EOS configured: every sequence runs to max_tokens");
        assert_eq!(o.finish, Finish::Length);
        let t = if temps[r] == 0.0 { 1.0 } else { f64::from(temps[r]) };
        theirs.push(recompute(&model, &prompts()[r], &o.tokens, t));
        ours.push(o.logprobs.clone());
    }
    let d = diff(&ours, &theirs);
    println!("engine vs trainer recompute: mean {:.3e} max {:.3e} over {} tokens", d.mean, d.max, d.count);
    assert!(d.mean <= 1e-4, "{d:?}");
    assert!(d.max <= 1e-3, "{d:?}");
}

#[test]
fn greedy_engine_output_follows_the_argmax_of_the_training_forward_whatever_the_batch_size() {
    let model = model();
    let reference: Vec<(Vec<u32>, Vec<f32>)> = prompts().iter().map(|p| greedy_by_forward(&model, p, 20)).collect();
    for slots in [1, 2, 4] {
        let mut engine = engine(slots);
        for (i, prompt) in prompts().into_iter().enumerate() {
            engine.add_request(i as u64, Request::new(prompt, 1, Sampling::greedy(20))).unwrap();
        }
        let outs = by_request(engine.run_to_completion().unwrap());
        assert_eq!(outs.len(), reference.len());
        for (o, (tokens, logprobs)) in outs.iter().zip(&reference) {
            assert_eq!(&o.tokens, tokens, "slots={slots} request {}", o.request);
            let d = diff_one(&o.logprobs, logprobs);
            assert!(d.max <= 1e-4, "slots={slots}: {d:?}");
        }
    }
}

#[test]
fn new_sequences_join_between_steps_and_finished_ones_leave_at_once() {
    let mut engine = engine(2);
    let lengths = [3usize, 9, 5, 7, 2];
    for (i, &len) in lengths.iter().enumerate() {
        engine.add_request(i as u64, Request::new(prompts()[i % 4].clone(), 1, sampled(len, i as u64))).unwrap();
    }
    let mut finished_at = vec![0usize; lengths.len()];
    let mut step = 0;
    while engine.has_work() {
        let stats = engine.stats();
        assert!(stats.running <= 2, "never more sequences than slots");
        let outs = engine.step().unwrap();
        step += 1;
        let after = engine.stats();
        for o in outs {
            assert_eq!(o.tokens.len(), lengths[o.request as usize]);
            finished_at[o.request as usize] = step;
        }
        assert!(after.running + after.waiting <= lengths.len());
    }
    // Two slots: requests 0 and 1 start at once; 2 joins the step after 0 leaves (step 4), 3 after 2 leaves,
    // 4 after 1 leaves. A sequence needs one step per token, so the schedule is exact.
    assert_eq!(finished_at, vec![3, 9, 8, 15, 11]);
    assert_eq!(engine.stats().running, 0);
}

#[test]
fn batching_does_not_change_a_seeded_sequence() {
    let alone = {
        let mut e = engine(1);
        e.add_request(7, Request::new(prompts()[2].clone(), 1, sampled(30, 99))).unwrap();
        e.run_to_completion().unwrap().remove(0)
    };
    let mut e = engine(4);
    for (i, prompt) in prompts().into_iter().enumerate() {
        e.add_request(i as u64, Request::new(prompt, 1, sampled(10 + 5 * i, i as u64 + 1000))).unwrap();
    }
    e.add_request(7, Request::new(prompts()[2].clone(), 1, sampled(30, 99))).unwrap();
    let crowded = e.run_to_completion().unwrap().into_iter().find(|o| o.request == 7).unwrap();
    assert_eq!(alone.tokens, crowded.tokens);
    assert!(diff(&[alone.logprobs], &[crowded.logprobs]).max <= 1e-4);
}

#[test]
fn a_group_is_prefilled_once_and_its_samples_fork_the_prompt() {
    let mut e = engine(8);
    let prompt = prompts()[2].clone();
    e.add_request(1, Request::new(prompt.clone(), 6, sampled(12, 5))).unwrap();
    let outs = by_request(e.run_to_completion().unwrap());
    assert_eq!(e.stats().prefill_tokens, prompt.len() as u64, "one prefill for six samples");
    assert_eq!(outs.iter().map(|o| o.index).collect::<Vec<_>>(), (0..6).collect::<Vec<_>>());
    let distinct: std::collections::BTreeSet<Vec<u32>> = outs.iter().map(|o| o.tokens.clone()).collect();
    assert!(distinct.len() >= 5, "samples draw from different streams: {distinct:?}");
    // Each fork computes what a lone request for that sample computes.
    let model = model();
    for o in &outs {
        let d = diff_one(&o.logprobs, &recompute(&model, &prompt, &o.tokens, 1.0));
        assert!(d.max <= 1e-3 && d.mean <= 1e-4, "{d:?}");
    }
    // A group larger than the free slots is admitted in parts, forking from a running sibling.
    let mut small = engine(2);
    small.add_request(1, Request::new(prompt.clone(), 5, sampled(12, 5))).unwrap();
    let parts = by_request(small.run_to_completion().unwrap());
    assert_eq!(parts.len(), 5);
    for (a, b) in parts.iter().zip(&outs) {
        assert_eq!(a.tokens, b.tokens, "sample {} is the same whether forked now or later", a.index);
    }
}

#[test]
fn abort_returns_the_prefix_and_resume_continues_it_as_if_never_interrupted() {
    let prompt = prompts()[0].clone();
    let whole = {
        let mut e = engine(2);
        e.add_request(1, Request::new(prompt.clone(), 2, sampled(24, 3))).unwrap();
        by_request(e.run_to_completion().unwrap())
    };
    let mut e = engine(2);
    e.add_request(1, Request::new(prompt.clone(), 2, sampled(24, 3))).unwrap();
    for _ in 0..9 {
        assert!(e.step().unwrap().is_empty());
    }
    let partial = e.abort(1).unwrap();
    assert_eq!(partial.len(), 2);
    assert!(!e.has_work());
    for (p, w) in partial.iter().zip(&whole) {
        assert_eq!(p.finish, Finish::Aborted);
        assert_eq!(p.tokens.len(), 9);
        assert_eq!(p.tokens[..], w.tokens[..9]);
    }
    // Resume sample 1 only, after a weight "swap" to version 3 with the same weights.
    let bytes = e.model().to_safetensors_bytes().unwrap();
    e.load_weights(&bytes, 3).unwrap();
    let p = &partial[1];
    let resume = Request {
        prompt: prompt.clone(),
        n: 1,
        sampling: sampled(24, 3),
        resume: Some(Prefix {
            tokens: p.tokens.clone(),
            logprobs: p.logprobs.clone(),
            min_version: p.min_version,
            max_version: p.max_version,
            version_runs: p.version_runs.clone(),
        }),
        first_sample: 1,
    };
    e.add_request(2, resume).unwrap();
    let done = e.run_to_completion().unwrap().remove(0);
    assert_eq!(done.index, 1);
    assert_eq!(done.tokens, whole[1].tokens, "the resumed sequence is the uninterrupted one");
    assert!(diff_one(&done.logprobs, &whole[1].logprobs).max <= 1e-4);
    assert_eq!((done.min_version, done.max_version), (0, 3), "the prefix keeps its version, new tokens are v3");
}

#[test]
fn weights_swap_between_steps_without_dropping_sequences() {
    let mut e = engine(4);
    for i in 0..3u64 {
        e.add_request(i, Request::new(prompts()[i as usize].clone(), 1, sampled(16, i))).unwrap();
    }
    for _ in 0..5 {
        e.step().unwrap();
    }
    let other = {
        let m = model();
        tch::no_grad(|| {
            for (_, mut p) in m.parameters() {
                let _ = p.g_add_(&(p.randn_like() * 0.05));
            }
        });
        m.to_safetensors_bytes().unwrap()
    };
    e.load_weights(&other, 1).unwrap();
    assert_eq!(e.stats().running, 3, "in-flight sequences survive the swap");
    let outs = e.run_to_completion().unwrap();
    assert_eq!(outs.len(), 3);
    for o in outs {
        assert_eq!(o.tokens.len(), 16);
        assert_eq!((o.min_version, o.max_version), (0, 1));
    }
    e.add_request(9, Request::new(prompts()[0].clone(), 1, sampled(20, 9))).unwrap();
    let fresh = e.run_to_completion().unwrap().remove(0);
    assert_eq!((fresh.min_version, fresh.max_version), (1, 1));
    // The swapped weights are the ones decoding: log-probs match a model loaded from the same blob.
    let mut swapped = model();
    swapped.load_safetensors_bytes(&other).unwrap();
    let d = diff_one(&fresh.logprobs, &recompute(&swapped, &prompts()[0], &fresh.tokens, 1.0));
    assert!(d.max <= 1e-3 && d.mean <= 1e-4, "{d:?}");
    assert_eq!(e.model().to_safetensors_bytes().unwrap(), other, "the engine's parameters are the blob's");
}

#[test]
fn stop_token_ids_eos_and_stop_strings_end_a_sequence_with_the_stopping_token_kept() {
    let tokenizer = Arc::new(Tokenizer::from_dir(&hf_sample_llama()).unwrap());
    let free = {
        let mut e = engine(1);
        e.add_request(0, Request::new(prompts()[0].clone(), 1, Sampling::greedy(30))).unwrap();
        e.run_to_completion().unwrap().remove(0)
    };
    let decode = {
        let tokenizer = tokenizer.clone();
        let f: Detokenizer = Arc::new(move |ids: &[u32]| tokenizer.decode(ids, true).ok());
        f
    };
    let run = |sampling: Sampling, eos: Vec<u32>| {
        let config =
            EngineConfig { max_num_seqs: 2, max_model_len: 128, eos_token_ids: eos, ..EngineConfig::default() };
        let mut e = Engine::new(model(), config).unwrap().with_detokenizer(decode.clone());
        e.add_request(0, Request::new(prompts()[0].clone(), 1, sampling)).unwrap();
        e.run_to_completion().unwrap().remove(0)
    };
    let stop_token = free.tokens[4];
    let first = free.tokens.iter().position(|&t| t == stop_token).unwrap();
    let o = run(Sampling { stop_token_ids: vec![stop_token], ..Sampling::greedy(30) }, vec![]);
    assert_eq!(o.tokens, free.tokens[..=first]);
    assert_eq!(o.finish, Finish::StopToken(stop_token));

    let o = run(Sampling::greedy(30), vec![stop_token]);
    assert_eq!(o.finish, Finish::Eos(stop_token));
    let o = run(Sampling { ignore_eos: true, ..Sampling::greedy(30) }, vec![stop_token]);
    assert_eq!(o.tokens, free.tokens, "ignore_eos runs past EOS");

    // A stop string made of the text of tokens 6..8 ends the sequence at token 8.
    let text = tokenizer.decode(&free.tokens[6..9], true).unwrap();
    assert!(!text.is_empty());
    let full = tokenizer.decode(&free.tokens, true).unwrap();
    let o = run(Sampling { stop: vec![text.clone()], ..Sampling::greedy(30) }, vec![]);
    assert_eq!(o.finish, Finish::StopString(text.clone()));
    // it ends at the first token whose text completes the stop string, that token kept
    let first =
        (0..free.tokens.len()).find(|&k| tokenizer.decode(&free.tokens[..=k], true).unwrap().contains(&text)).unwrap();
    assert!(first <= 8, "the text of tokens 6..8 is complete at token 8 at the latest");
    assert_eq!(o.tokens, free.tokens[..=first]);
    assert!(full.starts_with(&tokenizer.decode(&o.tokens, true).unwrap()));
}

#[test]
fn repetition_penalty_is_applied_to_prompt_and_generated_tokens_as_in_hf() {
    let penalty = 1.8f32;
    let mut e = engine(2);
    let prompt = prompts()[0].clone();
    e.add_request(0, Request::new(prompt.clone(), 1, Sampling { repetition_penalty: penalty, ..Sampling::greedy(12) }))
        .unwrap();
    // A second row without a penalty shares the batch and must be unaffected.
    e.add_request(1, Request::new(prompt.clone(), 1, Sampling::greedy(12))).unwrap();
    let outs = by_request(e.run_to_completion().unwrap());
    let model = model();
    let mut ids: Vec<i64> = prompt.iter().map(|&t| i64::from(t)).collect();
    for (j, &token) in outs[0].tokens.iter().enumerate() {
        let input = Tensor::from_slice(&ids).unsqueeze(0);
        let logits = tch::no_grad(|| model.forward(&input, &input.ones_like())).unwrap().select(1, -1).squeeze();
        let mut v = Vec::<f32>::try_from(&logits).unwrap();
        let mut seen = ids.clone();
        seen.sort_unstable();
        seen.dedup();
        for &t in &seen {
            let x = &mut v[t as usize];
            *x = if *x > 0.0 { *x / penalty } else { *x * penalty };
        }
        let best = v.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(i, _)| i).unwrap();
        assert_eq!(token as usize, best, "token {j}");
        let lse = v.iter().map(|x| f64::from(*x).exp()).sum::<f64>().ln();
        assert!((f64::from(outs[0].logprobs[j]) - (f64::from(v[best]) - lse)).abs() < 1e-4, "processed log-prob {j}");
        ids.push(i64::from(token));
    }
    let (plain, _) = greedy_by_forward(&model, &prompt, 12);
    assert_eq!(outs[1].tokens, plain);
    assert_ne!(outs[0].tokens, outs[1].tokens, "the penalty changed something");
}

#[test]
fn truncated_sampling_keeps_only_the_nucleus_and_reports_processed_logprobs() {
    let mut e = engine(4);
    let prompt = prompts()[1].clone();
    e.add_request(0, Request::new(prompt.clone(), 1, Sampling { top_k: 1, ..sampled(10, 1) })).unwrap();
    e.add_request(1, Request::new(prompt.clone(), 1, Sampling::greedy(10))).unwrap();
    e.add_request(2, Request::new(prompt.clone(), 3, Sampling { top_p: 0.5, top_k: 20, ..sampled(10, 2) })).unwrap();
    let outs = by_request(e.run_to_completion().unwrap());
    assert_eq!(outs[0].tokens, outs[1].tokens, "top-k 1 is greedy");
    assert!(outs[0].logprobs.iter().all(|&l| l.abs() < 1e-6), "a one-token nucleus has probability 1");
    let model = model();
    for o in &outs[2..] {
        let full = recompute(&model, &prompt, &o.tokens, 1.0);
        for (p, f) in o.logprobs.iter().zip(&full) {
            assert!(*p >= f - 1e-5, "the renormalised nucleus gives each kept token at least its full probability");
        }
    }

    let config = EngineConfig {
        max_num_seqs: 2,
        max_model_len: 128,
        logprobs_mode: LogprobsMode::Raw,
        ..EngineConfig::default()
    };
    let mut raw = Engine::new(model, config).unwrap();
    raw.add_request(0, Request::new(prompt.clone(), 1, Sampling { temperature: 0.5, ..sampled(10, 4) })).unwrap();
    let o = raw.run_to_completion().unwrap().remove(0);
    let d = diff(&[o.logprobs], &[recompute(raw.model(), &prompt, &o.tokens, 1.0)]);
    assert!(d.max <= 1e-4, "raw log-probs ignore the temperature: {d:?}");
}

#[test]
fn the_kv_budget_sets_how_many_sequences_run_and_max_tokens_is_clamped_to_the_slot() {
    let config = EngineConfig {
        max_num_seqs: 8,
        max_model_len: 32,
        kv_cache_tokens: Some(3 * 32 + 5),
        ..EngineConfig::default()
    };
    let mut e = Engine::new(model(), config.clone()).unwrap();
    assert_eq!(e.slots(), 3);
    assert_eq!(Engine::kv_cache_bytes(e.model(), &config), 3 * 32 * 2 * 2 * 2 * 16 * 4);
    for i in 0..5u64 {
        e.add_request(i, Request::new(prompts()[2].clone(), 1, sampled(1000, i))).unwrap();
    }
    e.step().unwrap();
    assert_eq!(e.stats().running, 3);
    assert_eq!(e.stats().waiting, 2);
    let outs = e.run_to_completion().unwrap();
    for o in outs {
        assert_eq!(o.finish, Finish::Length);
        assert_eq!(o.tokens.len() + prompts()[2].len(), 32, "the slot holds prompt + output");
    }
    let too_long = Request::new(vec![5; 32], 1, sampled(4, 0));
    assert!(e.add_request(99, too_long).is_err(), "a context filling the slot is refused");
    assert!(Engine::new(model(), EngineConfig { kv_cache_tokens: Some(10), max_model_len: 32, ..config }).is_err());
}

#[test]
fn aborting_waiting_and_freeing_the_cache_leave_a_usable_engine() {
    let mut e = engine(1);
    e.add_request(0, Request::new(prompts()[0].clone(), 1, sampled(50, 0))).unwrap();
    e.add_request(1, Request::new(prompts()[1].clone(), 2, sampled(50, 1))).unwrap();
    e.step().unwrap();
    let all = e.abort_all().unwrap();
    assert_eq!(all.len(), 3);
    assert_eq!(all.iter().filter(|o| o.tokens.is_empty()).count(), 2, "never admitted: empty");
    assert!(all.iter().all(|o| o.finish == Finish::Aborted));
    e.free_cache().unwrap();
    e.add_request(2, Request::new(prompts()[1].clone(), 1, Sampling::greedy(5))).unwrap();
    let o = e.run_to_completion().unwrap().remove(0);
    assert_eq!(o.tokens.len(), 5);
    assert!(e.add_request(3, Request::new(vec![], 1, Sampling::greedy(5))).is_err());
    assert!(e.add_request(3, Request::new(vec![1_000_000], 1, Sampling::greedy(5))).is_err());
}

/// Engine log-probs against the training forward for one checkpoint directory (sampled, a GRPO group, a
/// ragged second request).
fn check_fidelity(dir: &std::path::Path) {
    let load = || CausalLm::load(dir, Device::Cpu, DType::F32).unwrap();
    let vocab = load().config().vocab_size as u32;
    let prompts: Vec<Vec<u32>> = vec![(3..20).map(|i| (i * 7) % vocab).collect(), vec![5 % vocab, 9 % vocab]];
    let config = EngineConfig { max_num_seqs: 4, max_model_len: 64, seed: 3, ..EngineConfig::default() };
    let mut e = Engine::new(load(), config).unwrap();
    e.add_request(0, Request::new(prompts[0].clone(), 3, sampled(30, 1))).unwrap();
    e.add_request(1, Request::new(prompts[1].clone(), 2, Sampling { temperature: 0.8, ..sampled(25, 2) })).unwrap();
    let outs = e.run_to_completion().unwrap();
    let model = load();
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    for o in &outs {
        let t = if o.request == 0 { 1.0 } else { 0.8 };
        theirs.push(recompute(&model, &prompts[o.request as usize], &o.tokens, t));
        ours.push(o.logprobs.clone());
    }
    let d = diff(&ours, &theirs);
    println!("{}: engine vs forward mean {:.3e} max {:.3e} over {}", dir.display(), d.mean, d.max, d.count);
    assert!(d.mean <= 1e-4 && d.max <= 1e-3, "{}: {d:?}", dir.display());
}

#[test]
fn engine_matches_the_training_forward_on_the_tiny_qwen2_preset() {
    let dir = tempfile::tempdir().unwrap();
    jetrl_model::init_model("tiny", dir.path(), 5).unwrap();
    check_fidelity(dir.path());
}

#[test]
#[ignore = "slow tier: against transformers (python with transformers: `./dev.sh test` installs it)"]
fn engine_matches_the_training_forward_on_every_transformers_layout() {
    let root = hf_checkpoints();
    for name in ["qwen2_tied", "qwen2_untied", "llama", "qwen3", "qwen2_moe", "qwen3_moe"] {
        check_fidelity(&root.join(name));
    }
}

#[test]
fn a_bf16_engine_samples_close_to_the_f32_model() {
    let dir = tempfile::tempdir().unwrap();
    jetrl_model::init_model("tiny", dir.path(), 6).unwrap();
    let model = CausalLm::load(dir.path(), Device::Cpu, DType::BF16).unwrap();
    let config = EngineConfig { max_num_seqs: 4, max_model_len: 64, seed: 2, ..EngineConfig::default() };
    let mut e = Engine::new(model, config).unwrap();
    let prompt: Vec<u32> = (3..15).collect();
    e.add_request(0, Request::new(prompt.clone(), 3, sampled(20, 1))).unwrap();
    let outs = e.run_to_completion().unwrap();
    let f32_model = CausalLm::load(dir.path(), Device::Cpu, DType::F32).unwrap();
    let ours: Vec<Vec<f32>> = outs.iter().map(|o| o.logprobs.clone()).collect();
    let theirs: Vec<Vec<f32>> = outs.iter().map(|o| recompute(&f32_model, &prompt, &o.tokens, 1.0)).collect();
    let d = diff(&ours, &theirs);
    println!("bf16 engine vs f32 forward: mean {:.3e} max {:.3e}", d.mean, d.max);
    assert!(d.mean < 0.05 && d.max < 0.5, "{d:?}");
}

#[test]
fn the_gpu_paths_bucketed_shapes_and_deferred_stop_checks_change_no_sequence() {
    // The GPU path's shapes and its late reads run eagerly here: batches padded to 1, 2, 4, 8 slots with free
    // slots decoding at the scratch position, attention widths rounded up, rows moved down only when the bucket
    // can shrink, and each step's tokens read after the next step ran (a sequence that stopped decodes once more
    // and that token is dropped). Stop tokens end most sequences early; one request is aborted mid-way.
    let run = |gpu_path: bool| {
        let config = EngineConfig {
            max_num_seqs: 7,
            max_model_len: 64,
            seed: 11,
            bucketed: Some(gpu_path),
            defer_stop_checks: Some(gpu_path),
            ..EngineConfig::default()
        };
        let mut e = Engine::new(model(), config).unwrap();
        let mut outs = Vec::new();
        let mut id = 0u64;
        for round in 0..3 {
            for (i, prompt) in prompts().into_iter().enumerate() {
                let n = 1 + (i + round) % 3;
                let penalty = if i == 1 { 1.3 } else { 1.0 };
                let stops = if i % 2 == 0 { (0..300).step_by(5).collect() } else { Vec::new() };
                let sampling = Sampling {
                    repetition_penalty: penalty,
                    stop_token_ids: stops,
                    ..sampled(3 + 7 * ((i + round) % 4), id)
                };
                e.add_request(id, Request::new(prompt, n, sampling)).unwrap();
                id += 1;
            }
            for _ in 0..4 {
                outs.extend(e.step().unwrap());
            }
            if round == 1 {
                outs.extend(e.abort(3).unwrap());
            }
        }
        outs.extend(e.run_to_completion().unwrap());
        (by_request(outs), e.stats())
    };
    let (exact, exact_stats) = run(false);
    let (gpu, stats) = run(true);
    assert_eq!(exact.len(), gpu.len());
    assert!(exact.iter().any(|o| o.finish == Finish::Aborted));
    assert!(exact.iter().filter(|o| matches!(o.finish, Finish::StopToken(_))).count() >= 3, "stop tokens end some");
    for (a, b) in exact.iter().zip(&gpu) {
        assert_eq!((a.request, a.index, &a.tokens, &a.finish), (b.request, b.index, &b.tokens, &b.finish));
        let d = diff_one(&a.logprobs, &b.logprobs);
        assert!(d.max <= 1e-5, "request {} sample {}: {d:?}", a.request, a.index);
        assert_eq!(a.version_runs, b.version_runs);
    }
    assert_eq!(exact_stats.generated_tokens, stats.generated_tokens, "dropped tokens are not counted");
    // every sequence's first token comes from its prefill, the rest from decode steps; with exact shapes the only
    // slot decoded for nothing is one admitted that step below a decoding one (it samples from its prefill)
    let sequences = exact.iter().filter(|o| !o.tokens.is_empty()).count() as u64;
    assert_eq!(exact_stats.decoded_rows, exact_stats.generated_tokens - sequences);
    assert!(stats.decoded_rows > exact_stats.decoded_rows, "a late read decodes a stopped sequence once more");
    assert!(exact_stats.decoded_slots <= exact_stats.decoded_rows + sequences, "{exact_stats:?}");
    assert!(stats.decoded_slots > exact_stats.decoded_slots, "buckets pad: {stats:?}");
    assert!(
        stats.moved_rows < exact_stats.moved_rows,
        "{} moves bucketed, {} exact",
        stats.moved_rows,
        exact_stats.moved_rows
    );
    assert_eq!(stats.graphs, 0, "no CUDA graph on the CPU");
}

#[test]
fn contexts_prefilled_together_or_in_chunks_sample_what_one_at_a_time_samples() {
    // 2048: the five contexts admitted in the first step share one packed pass (the last request gets one of its
    // two slots), and its second sample is prefilled again once its sibling has left; 16: the long context alone
    // in chunks of 16, the others packed up to 16 tokens; 4: every context alone, in chunks of 4.
    let run = |prefill_chunk: usize| {
        let config =
            EngineConfig { max_num_seqs: 6, max_model_len: 96, seed: 11, prefill_chunk, ..EngineConfig::default() };
        let mut e = Engine::new(model(), config).unwrap();
        let long: Vec<u32> = (0..50u32).map(|i| 3 + (i * 37) % 250).collect();
        e.add_request(0, Request::new(long, 2, sampled(12, 5))).unwrap();
        for (i, prompt) in prompts().into_iter().take(3).enumerate() {
            e.add_request(1 + i as u64, Request::new(prompt, 1, sampled(12, 6 + i as u64))).unwrap();
        }
        e.add_request(9, Request::new(prompts()[3].clone(), 2, sampled(12, 9))).unwrap();
        (by_request(e.run_to_completion().unwrap()), e.stats())
    };
    let (packed, stats) = run(2048);
    assert_eq!(stats.prefill_passes, 2, "{stats:?}");
    for chunk in [16, 4] {
        let (other, other_stats) = run(chunk);
        assert_eq!(stats.prefill_tokens, other_stats.prefill_tokens);
        assert!(other_stats.prefill_passes > stats.prefill_passes, "chunk {chunk}: {other_stats:?}");
        assert_eq!(packed.len(), other.len());
        for (a, b) in packed.iter().zip(&other) {
            assert_eq!(a.tokens, b.tokens, "chunk {chunk}: request {} sample {}", a.request, a.index);
            let d = diff_one(&a.logprobs, &b.logprobs);
            assert!(d.max <= 1e-5, "chunk {chunk}: {d:?}");
        }
    }
}
