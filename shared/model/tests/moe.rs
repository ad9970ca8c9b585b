//! The mixture-of-experts model without transformers: router replay (routes recorded by one forward and replayed
//! in another), what replay does to the log-prob gap between a "rollout" and a "trainer" on a router near ties, the load-balancing loss's gradient, and LoRA on the experts. (Fidelity to transformers is in
//! `transformers_checkpoints.rs`.)

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use jetrl_model::{load_balancing_loss, CausalLm, DType, LoraSpec, ModelConfig, Targets};
use serde_json::json;
use tch::{Device, Kind, Tensor};

fn config() -> ModelConfig {
    ModelConfig::from_json(json!({
        "model_type": "qwen3_moe", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": true,
    }))
    .unwrap()
}

fn model(seed: i64, dtype: DType) -> CausalLm {
    tch::manual_seed(seed);
    CausalLm::random(config(), Device::Cpu, dtype, 0.1).unwrap()
}

fn batch() -> (Tensor, Tensor) {
    let ids: Vec<i64> = (0..40).map(|i| (i * 37 + 5) % 96).collect();
    let ids = Tensor::from_slice(&ids).view([2, 20]);
    (ids.shallow_clone(), ids.ones_like())
}

/// Each position's log-prob of the next token, `[B, T - 1]`.
fn logprobs(model: &CausalLm, ids: &Tensor, mask: &Tensor) -> Tensor {
    let logits = tch::no_grad(|| model.forward(ids, mask)).unwrap();
    jetrl_model::token_log_probs(&logits.narrow(1, 0, 19), &ids.narrow(1, 1, 19), 1.0).unwrap()
}

#[test]
fn recorded_routes_replay_to_the_same_output_and_other_routes_change_it() {
    let m = model(1, DType::F32);
    let (ids, mask) = batch();
    m.record_routes(true);
    let plain = logprobs(&m, &ids, &mask);
    let routes = m.take_routes().unwrap();
    m.record_routes(false);
    assert_eq!(routes.len(), 2, "both layers are sparse");
    assert_eq!(routes[0].size(), [40, 2], "[B*T, top_k] per layer");

    m.set_router_replay(Some(routes.iter().map(Tensor::shallow_clone).collect())).unwrap();
    let replayed = logprobs(&m, &ids, &mask);
    assert_eq!(f64::try_from((&replayed - &plain).abs().max()).unwrap(), 0.0, "replaying the router's own choice");

    let other: Vec<Tensor> = routes.iter().map(|r| (r + 1).remainder(8)).collect();
    m.set_router_replay(Some(other)).unwrap();
    let moved = logprobs(&m, &ids, &mask);
    assert!(f64::try_from((&moved - &plain).abs().max()).unwrap() > 1e-3, "other experts give other outputs");

    m.set_router_replay(None).unwrap();
    assert_eq!(f64::try_from((&logprobs(&m, &ids, &mask) - &plain).abs().max()).unwrap(), 0.0, "replay cleared");
}

#[test]
fn replayed_routes_of_the_wrong_shape_or_count_are_refused_by_name() {
    let m = model(2, DType::F32);
    let (ids, mask) = batch();
    let err = m.set_router_replay(Some(vec![Tensor::zeros([40, 2], (Kind::Int64, Device::Cpu))])).unwrap_err();
    assert!(err.to_string().contains("2 sparse layers"), "{err}");
    let short = || Tensor::zeros([39, 2], (Kind::Int64, Device::Cpu));
    m.set_router_replay(Some(vec![short(), short()])).unwrap();
    let err = tch::no_grad(|| m.forward(&ids, &mask)).unwrap_err().to_string();
    assert!(err.contains("[39, 2]") && err.contains("40 tokens"), "{err}");
}

/// R3's point, at CPU shapes: a rollout engine's numerics differ slightly from the trainer's (other kernels, other
/// precision; here the same f32 weights with noise of 1e-4), and on a router near ties that flips some tokens to
/// other experts, whose outputs differ by far more than the numerics. Replaying the rollout's routes in the
/// trainer removes that part of the rollout-vs-trainer log-prob gap.
#[test]
fn replaying_the_rollouts_routes_shrinks_the_rollout_trainer_gap_on_a_router_near_ties() {
    let trainer = model(3, DType::F32);
    let rollout = model(3, DType::F32);
    tch::no_grad(|| {
        for ((name, mut t), (_, mut r)) in trainer.parameters().into_iter().zip(rollout.parameters()) {
            if name.ends_with("mlp.gate.weight") {
                let _ = t.g_mul_scalar_(0.01); // router logits within a few thousandths of each other
            }
            let noise = t.randn_like().g_mul_scalar(1e-4);
            r.copy_(&(&t + noise));
        }
    });
    let (ids, mask) = batch();

    rollout.record_routes(true);
    let rollout_lp = logprobs(&rollout, &ids, &mask);
    let routes = rollout.take_routes().unwrap();
    trainer.record_routes(true);
    let free = logprobs(&trainer, &ids, &mask);
    let trainer_routes = trainer.take_routes().unwrap();
    trainer.record_routes(false);
    trainer.set_router_replay(Some(routes.iter().map(Tensor::shallow_clone).collect())).unwrap();
    let replayed = logprobs(&trainer, &ids, &mask);

    let flipped: i64 =
        routes.iter().zip(&trainer_routes).map(|(a, b)| i64::try_from(a.ne_tensor(b).sum(Kind::Int64)).unwrap()).sum();
    let gap = |lp: &Tensor| f64::try_from((lp - &rollout_lp).abs().mean(Kind::Float)).unwrap();
    let (without, with) = (gap(&free), gap(&replayed));
    println!(
        "routes that differ: {flipped} of 160; mean |Δlogprob| rollout vs trainer: {without:.3e} free, {with:.3e} \
         replayed"
    );
    assert!(flipped > 0, "the near-tie router must route some tokens differently");
    assert!(with < 0.5 * without, "replay must at least halve the gap: {with} vs {without}");
}

#[test]
fn the_load_balancing_loss_is_e_times_k_over_e_squared_when_balanced_and_its_gradient_reaches_the_router() {
    // every token's probabilities uniform: f_e = k / E, P_e = 1 / E, loss = E · E · k / E² = k
    let logits = Tensor::zeros([6, 4], (Kind::Float, Device::Cpu));
    let loss = load_balancing_loss(&[logits], 2, None).unwrap().double_value(&[]);
    assert!((loss - 2.0).abs() < 1e-6, "{loss}");

    let m = model(4, DType::F32);
    let (ids, mask) = batch();
    m.collect_router_logits(true);
    let _ = m.forward(&ids, &mask).unwrap();
    let logits = m.take_router_logits();
    assert_eq!(logits.len(), 2);
    load_balancing_loss(&logits, 2, Some(&mask)).unwrap().backward();
    let grad = m.parameters()["model.layers.0.mlp.gate.weight"].grad();
    assert!(grad.defined() && f64::try_from(grad.abs().sum(Kind::Float)).unwrap() > 0.0);
}

#[test]
fn lora_targets_every_experts_projections_and_the_adapter_saves_under_their_names() {
    let mut m = model(5, DType::F32);
    let names = m.linear_modules();
    assert!(names.contains(&"model.layers.1.mlp.experts.7.down_proj".to_string()));
    assert!(!names.iter().any(|n| n.ends_with("mlp.gate")), "the router is not a LoRA target");
    m.add_lora(&LoraSpec::new(4, 8.0, Targets::AllLinear, vec![])).unwrap();
    let adapters = m.lora_parameters();
    assert!(adapters.contains_key("model.layers.0.mlp.experts.3.up_proj.lora_A.weight"));
    assert_eq!(adapters.len(), 2 * (2 * 4 + 2 * 8 * 3), "q/k/v/o and 8 experts × 3 per layer, A and B each");
    let dir = tempfile::tempdir().unwrap();
    m.save_lora(dir.path(), "base").unwrap();
    let mut again = model(5, DType::F32);
    again.load_lora(dir.path()).unwrap();
    assert_eq!(again.lora_parameters().len(), adapters.len());
}

/// The rollout side of R3: the engine returns the experts every token was routed to (prompt prefill and each
/// decode step, forks sharing their prompt's), and they are the routes a training forward over the same tokens
/// chooses.
#[test]
fn the_engine_returns_each_tokens_routes_as_the_training_forward_routes_them() {
    use jetrl_model::{Engine, EngineConfig, Request, Sampling};
    let config = EngineConfig {
        max_num_seqs: 4,
        max_model_len: 64,
        seed: 1,
        return_routed_experts: true,
        prefill_chunk: 8, // the 11-token prompt is prefilled in chunks, the short one packed
        ..EngineConfig::default()
    };
    // one set of weights for both sides, from disk: tests in this binary run in parallel and libtorch's seed is
    // the process's
    let dir = tempfile::tempdir().unwrap();
    model(6, DType::F32).save(dir.path()).unwrap();
    let load = || CausalLm::load(dir.path(), Device::Cpu, DType::F32).unwrap();
    let mut engine = Engine::new(load(), config).unwrap();
    let prompts: Vec<Vec<u32>> = vec![(3..14).collect(), vec![40, 41, 42]];
    let sampling = Sampling { temperature: 1.0, max_tokens: 9, ignore_eos: true, ..Sampling::default() };
    engine.add_request(0, Request::new(prompts[0].clone(), 3, sampling.clone())).unwrap();
    engine.add_request(1, Request::new(prompts[1].clone(), 1, sampling)).unwrap();
    let outputs = engine.run_to_completion().unwrap();
    assert_eq!(outputs.len(), 4);

    let trainer = load();
    let (mut same, mut all) = (0usize, 0usize);
    for out in &outputs {
        let ids: Vec<u32> = prompts[out.request as usize].iter().chain(&out.tokens).copied().collect();
        assert_eq!(out.routed_experts.len(), (ids.len() - 1) * 2 * 2, "every token but the last, 2 layers × top 2");
        let input = Tensor::from_slice(&ids.iter().map(|&i| i64::from(i)).collect::<Vec<_>>()).unsqueeze(0);
        trainer.record_routes(true);
        let _ = tch::no_grad(|| trainer.forward(&input, &input.ones_like())).unwrap();
        let routes = Tensor::stack(&trainer.take_routes().unwrap(), 1); // [tokens, layers, k]
        trainer.record_routes(false);
        let expected: Vec<i64> = Vec::try_from(routes.narrow(0, 0, ids.len() as i64 - 1).reshape([-1])).unwrap();
        all += expected.len();
        same += expected.iter().zip(&out.routed_experts).filter(|(a, b)| **a == i64::from(**b)).count();
    }
    println!("engine routes equal to the training forward's: {same} of {all}");
    assert!(same as f64 >= 0.99 * all as f64, "{same} of {all}");
}
