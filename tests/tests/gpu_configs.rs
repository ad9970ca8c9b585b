//! The first real job's configurations (`configs/verl-gsm8k-qwen2.5-7b*.yaml`, verl's GSM8K GRPO on Qwen2.5-7B
//! for one host of 8 × 80 GB GPUs) cannot run here. What can be checked is their arithmetic: each loads through
//! `jetrl run --verl`'s translation, lays out its GPUs as `jetrl run` will, and what each GPU holds — computed from
//! the configuration's own numbers and Qwen2.5-7B's shapes — fits on 80 GB with headroom and is the figure
//! docs/gpu-host.md states.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

const GIB: f64 = (1u64 << 30) as f64;

/// Qwen2.5-7B-Instruct's config.json: hidden_size 3584, intermediate_size 18944, 28 layers, 28 attention heads
/// (head_dim 128), 4 key-value heads, vocabulary 152064, untied embeddings.
struct Shapes {
    hidden: f64,
    intermediate: f64,
    layers: f64,
    kv_heads: f64,
    head_dim: f64,
    vocab: f64,
}

const QWEN25_7B: Shapes =
    Shapes { hidden: 3584.0, intermediate: 18944.0, layers: 28.0, kv_heads: 4.0, head_dim: 128.0, vocab: 152064.0 };

impl Shapes {
    /// Parameters: embeddings and LM head (untied), per layer q/o (hidden²), k/v (hidden × kv width) with their
    /// biases, the three MLP matrices and two norms, and the final norm: 7.62 B.
    fn params(&self) -> f64 {
        let kv = self.kv_heads * self.head_dim;
        let attention = 2.0 * self.hidden * self.hidden + 2.0 * self.hidden * kv + self.hidden + 2.0 * kv;
        let mlp = 3.0 * self.hidden * self.intermediate;
        2.0 * self.vocab * self.hidden + self.layers * (attention + mlp + 2.0 * self.hidden) + self.hidden
    }

    /// LoRA parameters of rank r on every linear layer: r × (in + out) each.
    fn lora_params(&self, rank: f64) -> f64 {
        let kv = self.kv_heads * self.head_dim;
        let per_layer =
            2.0 * (self.hidden + self.hidden) + 2.0 * (self.hidden + kv) + 3.0 * (self.hidden + self.intermediate);
        rank * per_layer * self.layers
    }

    /// KV cache bytes per token position (K and V, every layer, bf16).
    fn kv_bytes_per_token(&self) -> f64 {
        2.0 * self.layers * self.kv_heads * self.head_dim * 2.0
    }
}

/// Per process: the CUDA context and libraries' own allocations.
const CONTEXT_GIB: f64 = 1.0;
/// The rollout engine's working memory beside weights and KV cache (decode activations, logits, graphs).
const ENGINE_WORKSPACE_GIB: f64 = 2.0;
/// What a figure may reach on an 80 GB GPU (79.6 GiB): 10 % is left to the allocator's fragmentation.
const BUDGET_GIB: f64 = 72.0;

#[derive(Debug)]
struct Memory {
    trainer_gpus: usize,
    rollout_gpus: usize,
    /// one trainer rank's GPU (with its colocated worker, when they share)
    trainer_gib: f64,
    /// one rollout worker's GPU (the same GPU as a rank's in the hybrid layout)
    rollout_gib: f64,
    colocated: bool,
    kv_rows: f64,
}

fn memory_of(config: &str) -> Memory {
    // as `jetrl run --verl` reads it: verl's hybrid engine gets one rollout worker per trainer GPU
    let job = jetrl_config::load_verl(Some(&repo().join(config)), &[])
        .and_then(|job| job.with_hybrid_workers())
        .unwrap_or_else(|e| panic!("{config}: {e}"));
    let separate = job.rollout_gpus() == jetrl_config::verl::layout::RolloutGpus::Apart;
    let cfg = job.typed().unwrap_or_else(|e| panic!("{config}: {e}"));
    let s = QWEN25_7B;
    let p = s.params();
    let ranks = f64::from(cfg.trainer.n_gpus_per_node);
    let bf16 = 2.0 * p;
    // the trainer rank: ZeRO-2, the whole bf16 model on every rank, its 1/N of fp32 master weights and both AdamW
    // moments; full gradients in bf16 before the reduce-scatter. LoRA: the frozen base, f32 adapters with their
    // gradients and moments (16 bytes each, unsharded); the reference is the base with adapters off.
    let lora = f64::from(cfg.model.lora_rank);
    let mut trainer = if lora > 0.0 {
        bf16 + 16.0 * s.lora_params(lora)
    } else {
        let reference = if cfg.actor.use_kl_loss { bf16 } else { 0.0 };
        bf16 + bf16 + 12.0 * p / ranks + reference
    };
    // activations of one micro-batch of ppo_max_token_len tokens with gradient checkpointing: each layer's bf16
    // input kept, plus one layer's MLP recomputed (gate, up and their product); log-probs are vocabulary-chunked
    assert!(cfg.model.enable_gradient_checkpointing, "{config}: the arithmetic assumes gradient checkpointing");
    let tokens = f64::from(cfg.actor.ppo_max_token_len);
    trainer += tokens * s.hidden * 2.0 * s.layers + tokens * s.intermediate * 2.0 * 3.0;
    let trainer_gib = trainer / GIB + CONTEXT_GIB;
    // a rollout worker: the bf16 model, and its KV cache of min(max_num_seqs, kv_cache_memory_gb / row) rows of
    // max_prompt_length + max_response_length positions
    let row = f64::from(cfg.data.max_prompt_length + cfg.data.max_response_length) * s.kv_bytes_per_token();
    let rows = f64::from(cfg.rollout.max_num_seqs).min((cfg.rollout.kv_cache_memory_gb * GIB / row).floor());
    let rollout_gib = (bf16 + rows * row) / GIB + ENGINE_WORKSPACE_GIB + CONTEXT_GIB;
    Memory {
        trainer_gpus: cfg.trainer.n_gpus_per_node as usize,
        rollout_gpus: cfg.rollout.workers as usize,
        trainer_gib: if separate { trainer_gib } else { trainer_gib + rollout_gib },
        rollout_gib,
        colocated: !separate,
        kv_rows: rows,
    }
}

#[test]
fn qwen25_7b_has_the_parameter_count_its_model_card_gives() {
    let billions = QWEN25_7B.params() / 1e9;
    assert!((billions - 7.62).abs() < 0.01, "{billions}");
}

#[test]
fn the_7b_gsm8k_configs_fit_their_gpus_as_docs_gpu_host_says() {
    let doc = std::fs::read_to_string(repo().join("docs/gpu-host.md")).unwrap();
    // full fine-tuning: 6 training GPUs, 2 rollout GPUs (verl's fully-async keys)
    let full = memory_of("configs/verl-gsm8k-qwen2.5-7b.yaml");
    assert!(!full.colocated, "{full:?}");
    assert_eq!(full.trainer_gpus + full.rollout_gpus, 8, "{full:?}");
    // LoRA: 8 GPUs that train and roll out (verl's hybrid engine)
    let lora = memory_of("configs/verl-gsm8k-qwen2.5-7b-lora.yaml");
    assert!(lora.colocated && lora.trainer_gpus == 8 && lora.rollout_gpus == 8, "{lora:?}");
    for (what, m) in [("full", &full), ("lora", &lora)] {
        for gib in [m.trainer_gib, m.rollout_gib] {
            assert!(gib <= BUDGET_GIB, "{what}: {gib:.1} GiB on one GPU is over {BUDGET_GIB} GiB: {m:?}");
            let figure = format!("{gib:.1} GiB");
            assert!(doc.contains(&figure), "{what}: docs/gpu-host.md does not state {figure}: {m:?}");
        }
        let rows = format!("{} sequences", m.kv_rows);
        assert!(doc.contains(&rows), "{what}: docs/gpu-host.md does not state {rows}: {m:?}");
    }
}
