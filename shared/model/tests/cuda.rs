//! The model on a CUDA device agrees with the CPU. Compiled only with the `cuda-tests` feature (a GPU host); a
//! test here fails when libtorch sees no CUDA device.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

mod common;

use common::*;
use jetrl_model::{
    log_probs_of, parse_device, token_log_probs, CausalLm, DType, Engine, EngineConfig, Packed, Request, Sampling,
};
use tch::{Device, Kind, Tensor};

fn cuda() -> Device {
    assert!(tch::Cuda::is_available(), "the cuda-tests feature is on, but libtorch sees no CUDA device");
    parse_device("cuda:0").expect("cuda:0 parses when CUDA is available")
}

#[test]
fn cuda_f32_log_probs_match_the_hf_reference() {
    let device = cuda();
    let dir = hf_sample_llama();
    let reference = read_reference(&dir);
    let model = CausalLm::load(&dir, device, DType::F32).unwrap();
    let ours: Vec<Vec<f32>> = reference.sequences.iter().map(|ids| log_probs_of(&model, ids).unwrap()).collect();
    let d = diff(&ours, &reference.logprobs);
    println!("cuda f32 vs transformers: max {:.3e} mean {:.3e}", d.max, d.mean);
    // TF32 matmuls may be enabled on the GPU: allow a little more than the CPU tolerance.
    assert!(d.max <= 2e-3 && d.mean <= 1e-4, "{d:?}");
}

#[test]
fn cuda_bf16_engine_log_probs_match_cuda_bf16_forward() {
    let device = cuda();
    let load = || CausalLm::load(&hf_sample_llama(), device, DType::BF16).unwrap();
    let prompts = [vec![1u32, 87, 85, 266], vec![5, 9], vec![223, 231, 35, 47, 260, 71, 92]];
    let config = EngineConfig { max_num_seqs: 4, max_model_len: 64, seed: 5, ..EngineConfig::default() };
    let mut engine = Engine::new(load(), config).unwrap();
    for (i, prompt) in prompts.iter().enumerate() {
        let sampling = Sampling { temperature: 1.0, max_tokens: 12, seed: Some(i as u64), ..Sampling::default() };
        engine.add_request(i as u64, Request::new(prompt.clone(), 1, sampling)).unwrap();
    }
    let outs = engine.run_to_completion().unwrap();
    assert_eq!(outs.len(), prompts.len());
    let model = load();
    let mut diffs = Vec::new();
    for o in &outs {
        let p = &prompts[o.request as usize];
        let full = [p.clone(), o.tokens.clone()].concat();
        let lp = log_probs_of(&model, &full).unwrap();
        let recomputed = lp[p.len() - 1..].to_vec();
        diffs.push((o.logprobs.clone(), recomputed));
    }
    let (a, b): (Vec<_>, Vec<_>) = diffs.into_iter().unzip();
    let d = diff(&a, &b);
    println!("cuda bf16 generation vs forward: max {:.3e} mean {:.3e}", d.max, d.mean);
    // bf16 rounds differently between one-token decode steps and a full forward.
    assert!(d.mean <= 5e-2, "{d:?}");
}

/// A packed row in bf16 on CUDA runs the flash varlen kernel: its log-probs are the padded batch's (bf16
/// tolerance) and gradients reach the weights.
#[test]
fn cuda_bf16_packed_rows_use_flash_varlen_and_match_the_padded_batch() {
    let device = cuda();
    let model = CausalLm::load(&hf_sample_llama(), device, DType::BF16).unwrap();
    let sequences: Vec<Vec<i64>> = vec![vec![1, 87, 85, 266, 201], vec![57, 12], vec![40, 7, 9, 301, 11, 2, 5]];
    let mut expected = Vec::new();
    for s in &sequences {
        let ids = Tensor::from_slice(s).view([1, -1]);
        let mask = ids.ones_like();
        let lp = token_log_probs(&model.forward(&ids, &mask).unwrap(), &ids, 1.0).unwrap();
        expected.extend(Vec::<f32>::try_from(lp.get(0).to_device(Device::Cpu)).unwrap());
    }
    let packed_ids: Vec<i64> = sequences.iter().flatten().copied().collect();
    let lens: Vec<i64> = sequences.iter().map(|s| s.len() as i64).collect();
    let packed_ids = Tensor::from_slice(&packed_ids).view([1, -1]);
    let hidden = model.forward_hidden_packed(&Packed { input_ids: &packed_ids, lens: &lens }).unwrap();
    let lp = token_log_probs(&model.lm_head(&hidden).unwrap(), &packed_ids, 1.0).unwrap();
    let all = Vec::<f32>::try_from(lp.get(0).to_device(Device::Cpu)).unwrap();
    let mut got = Vec::new();
    let mut start = 0;
    for s in &sequences {
        got.extend_from_slice(&all[start..start + s.len() - 1]);
        start += s.len();
    }
    let d = got.iter().zip(&expected).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    println!("cuda bf16 packed (flash varlen) vs one sequence at a time: max |Δ| {d:.3e}");
    assert_eq!(got.len(), expected.len());
    assert!(d <= 5e-2, "packed vs single-sequence log-probs differ by {d}");
    lp.sum(Kind::Float).backward();
    let grad = model.parameters()["model.layers.0.self_attn.q_proj.weight"].grad();
    assert!(grad.defined() && grad.abs().sum(Kind::Float).double_value(&[]) > 0.0, "no gradient through the kernel");
}

#[test]
fn cuda_graph_decode_samples_what_eager_decode_samples() {
    let device = cuda();
    let prompts = [vec![1u32, 87, 85, 266], vec![5, 9], vec![223, 231, 35, 47, 260, 71, 92]];
    let run = |enforce_eager: bool| {
        let model = CausalLm::load(&hf_sample_llama(), device, DType::BF16).unwrap();
        let config =
            EngineConfig { max_num_seqs: 6, max_model_len: 64, seed: 5, enforce_eager, ..EngineConfig::default() };
        let mut engine = Engine::new(model, config).unwrap();
        for (i, prompt) in prompts.iter().enumerate() {
            let sampling = Sampling { temperature: 1.0, max_tokens: 10 + 7 * i, ..Sampling::default() };
            engine.add_request(i as u64, Request::new(prompt.clone(), 2, sampling)).unwrap();
        }
        let mut outs = engine.run_to_completion().unwrap();
        outs.sort_by_key(|o| (o.request, o.index));
        (outs, engine.stats())
    };
    let (graph, stats) = run(false);
    let (eager, eager_stats) = run(true);
    assert!(stats.graphs > 0, "the default decode on CUDA replays graphs: {stats:?}");
    assert_eq!(eager_stats.graphs, 0);
    for (a, b) in graph.iter().zip(&eager) {
        assert_eq!(a.tokens, b.tokens, "request {} sample {}", a.request, a.index);
        let d = diff(std::slice::from_ref(&a.logprobs), std::slice::from_ref(&b.logprobs));
        // the same kernels on the same shapes: only a batch padded to its bucket can change a reduction's order
        assert!(d.max <= 2e-2, "{d:?}");
    }
}
