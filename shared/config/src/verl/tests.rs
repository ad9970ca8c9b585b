#![allow(clippy::unwrap_used)]

use super::*;
use crate::{AdvantageEstimator, Logger, TrainerMode};

/// verl's GRPO example (`examples/grpo_trainer/run_qwen2-7b_seq_balance.sh`), its argument list as the shell
/// hands it to `python3 -m verl.trainer.main_ppo`, with the paths of this test.
fn seq_balance_example(model: &str, data: &str) -> Vec<String> {
    [
        "algorithm.adv_estimator=grpo",
        &format!("data.train_files={data}/train.parquet"),
        &format!("data.val_files={data}/test.parquet"),
        "data.return_raw_chat=True",
        "data.train_batch_size=1024",
        "data.max_prompt_length=512",
        "data.max_response_length=1024",
        "data.filter_overlong_prompts=True",
        "data.truncation=error",
        &format!("actor_rollout_ref.model.path={model}"),
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.actor.ppo_mini_batch_size=256",
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24000",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.name=sglang",
        "actor_rollout_ref.rollout.mode=async",
        "actor_rollout_ref.rollout.multi_turn.format=hermes",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
        "actor_rollout_ref.rollout.n=5",
        "actor_rollout_ref.ref.fsdp_config.param_offload=True",
        "algorithm.use_kl_in_reward=False",
        "trainer.critic_warmup=0",
        "trainer.logger=[console,wandb]",
        "trainer.project_name=verl_grpo_example_gsm8k",
        "trainer.experiment_name=qwen2_7b_function_rm_kl1e-3",
        "trainer.val_before_train=False",
        "trainer.n_gpus_per_node=8",
        "trainer.nnodes=1",
        "trainer.save_freq=20",
        "trainer.test_freq=5",
        "trainer.total_epochs=15",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn load(args: &[String]) -> Result<(VerlJob, JobConfig), ConfigError> {
    let job = load_verl(None, args)?;
    let cfg = job.typed()?;
    Ok((job, cfg))
}

fn with(mut args: Vec<String>, more: &[&str]) -> Vec<String> {
    args.extend(more.iter().map(|s| s.to_string()));
    args
}

fn error(args: &[String]) -> String {
    match load(args) {
        Ok(_) => panic!("{args:?} loaded"),
        Err(err) => err.to_string(),
    }
}

#[test]
fn every_default_has_a_fate() {
    for (path, _) in hydra::leaves(&defaults()) {
        let key = keys::lookup(&path).unwrap_or_else(|| panic!("{path} has no entry in keys.rs"));
        assert!(!matches!(key.fate, Fate::Jetrl), "{path}");
    }
}

#[test]
fn every_mapped_key_is_a_jetrl_key() {
    let jetrl = serde_json::to_value(JobConfig::default()).unwrap();
    let has = |path: &str| {
        let mut node = &jetrl;
        for part in path.split('.') {
            match node.get(part) {
                Some(next) => node = next,
                // an optional section (null by default) holds any of its keys
                None => return node.is_null(),
            }
        }
        true
    };
    for key in keys::KEYS {
        if let Fate::Map(to) | Fate::MapSet(to) | Fate::Convert(to, _) = key.fate {
            assert!(has(to), "{} maps to {to}, which jetrl does not have", key.verl);
        }
    }
}

#[test]
fn verls_grpo_example_runs_with_only_the_launcher_replaced() {
    // the example rolls out on SGLang, which jetrl has no backend for: refused by name, before anything starts
    let err = error(&seq_balance_example("/m/qwen", "/d/gsm8k"));
    assert!(err.contains("actor_rollout_ref.rollout.name") && err.contains("sglang"), "{err}");
    // the user's `$@` picks an engine jetrl has
    let (job, cfg) =
        load(&with(seq_balance_example("/m/qwen", "/d/gsm8k"), &["actor_rollout_ref.rollout.name=vllm"])).unwrap();
    assert_eq!(cfg.rollout.name, crate::RolloutName::Vllm);
    // verl's vLLM keys the example set mean what they mean in verl
    assert_eq!(cfg.rollout.tensor_model_parallel_size, 2);
    assert_eq!(cfg.rollout.gpu_memory_utilization, 0.6);
    assert_eq!(cfg.algorithm.adv_estimator, AdvantageEstimator::Grpo);
    assert_eq!(cfg.data.train_files, vec!["/d/gsm8k/train.parquet".to_string()]);
    assert_eq!(cfg.data.max_response_length, 1024);
    assert_eq!(cfg.model.path, "/m/qwen");
    assert!(cfg.model.use_remove_padding && cfg.model.enable_gradient_checkpointing);
    assert_eq!(cfg.actor.optim.lr, 1e-6);
    assert_eq!(cfg.actor.ppo_mini_batch_size, Some(256));
    assert_eq!(cfg.actor.ppo_max_token_len, 24_000);
    assert!(cfg.actor.use_kl_loss);
    assert_eq!(cfg.rollout.n, 5);
    assert_eq!(cfg.trainer.logger, vec![Logger::Console, Logger::Wandb]);
    assert_eq!(cfg.trainer.project_name, "verl_grpo_example_gsm8k");
    assert_eq!(cfg.run.name, "qwen2_7b_function_rm_kl1e-3");
    assert_eq!(cfg.run.dir, "runs/verl_grpo_example_gsm8k/qwen2_7b_function_rm_kl1e-3");
    assert_eq!(cfg.trainer.n_gpus_per_node, 8);
    assert_eq!(cfg.trainer.save_freq, 20);
    assert_eq!(cfg.trainer.mode, TrainerMode::Sync);
    assert!(cfg.model.device.to_string().starts_with("cuda"));
    // verl's defaults where the example says nothing, not jetrl's
    assert_eq!(cfg.actor.optim.weight_decay, 0.01);
    assert_eq!(cfg.actor.clip_ratio_high(), 0.2);
    assert_eq!(
        cfg.trainer.default_local_dir.as_deref(),
        Some("checkpoints/verl_grpo_example_gsm8k/qwen2_7b_function_rm_kl1e-3")
    );
    let line = job.ignored_line().unwrap();
    for key in
        ["actor_rollout_ref.rollout.mode", "actor_rollout_ref.actor.fsdp_config.param_offload", "data.return_raw_chat"]
    {
        assert!(line.contains(key), "{key} not in {line}");
    }
    // a key verl's default set but the user did not is not listed
    assert!(!line.contains("max_num_batched_tokens"), "{line}");
}

#[test]
fn unset_keys_take_verls_defaults() {
    let args = vec![
        "trainer.device=cpu".to_string(),
        "data.train_files=x.parquet".into(),
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4".into(),
        "critic.ppo_micro_batch_size_per_gpu=4".into(),
    ];
    let (_, cfg) = load(&args).unwrap();
    assert_eq!(cfg.actor.ppo_mini_batch_size, Some(256));
    assert_eq!(cfg.data.train_batch_size, 1024);
    assert_eq!(cfg.algorithm.adv_estimator, AdvantageEstimator::Gae);
    assert_eq!(cfg.trainer.total_epochs, 30);
    assert!(cfg.trainer.val_before_train);
    // 4 responses of at most 512 + 512 tokens per micro-batch
    assert_eq!(cfg.actor.ppo_max_token_len, 4 * 1024);
    assert_eq!(cfg.critic.ppo_max_token_len, Some(4 * 1024));
    assert_eq!(cfg.model.device.to_string(), "cpu");
}

#[test]
fn a_file_in_verls_tree_with_jetrl_sections_and_overrides_over_it() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("job.yaml");
    std::fs::write(
        &file,
        "defaults:\n  - ppo_trainer\n  - _self_\nactor_rollout_ref:\n  actor:\n    ppo_micro_batch_size_per_gpu: 8\n    \
         optim:\n      lr: 3e-6\n  rollout:\n    n: 4\n    workers: 2\ndata:\n  train_files: [a.parquet, b.parquet]\n\
         algorithm:\n  adv_estimator: grpo\ntrainer:\n  device: cpu\n  v1:\n    trainer_mode: separate_async\n    \
         separate_async:\n      parameter_sync_step: 4\nnats:\n  url: nats://10.0.0.1:4222\nbuffer:\n  reread_after_s: 5\n",
    )
    .unwrap();
    let job =
        load_verl(Some(&file), &["actor_rollout_ref.actor.optim.lr=1e-5".into(), "~data.val_files".into()]).unwrap();
    let cfg = job.typed().unwrap();
    assert_eq!(cfg.actor.optim.lr, 1e-5);
    assert_eq!(cfg.rollout.n, 4);
    assert_eq!(cfg.rollout.workers, 2);
    assert_eq!(cfg.data.train_files.len(), 2);
    assert!(cfg.data.val_files.is_empty());
    assert_eq!(cfg.trainer.mode, TrainerMode::SeparateAsync);
    assert_eq!(cfg.trainer.separate_async.parameter_sync_step, 4);
    assert_eq!(cfg.nats.url, "nats://10.0.0.1:4222");
    assert_eq!(cfg.buffer.reread_after_s, 5.0);
    assert!(job.ignored_line().unwrap().contains("defaults"));
}

#[test]
fn refusals_name_the_key_the_value_and_why() {
    let base = vec![
        "trainer.device=cpu".to_string(),
        "algorithm.adv_estimator=grpo".into(),
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4".into(),
    ];
    let err = error(&with(base.clone(), &["actor_rollout_ref.actor.strategy=megatron"]));
    assert!(
        err.contains("actor_rollout_ref.actor.strategy") && err.contains("megatron") && err.contains("data parallel"),
        "{err}"
    );
    let err = error(&with(base.clone(), &["reward_model.enable=True"]));
    assert!(err.contains("reward_model.enable") && err.contains("reward.reward_model.url"), "{err}");
    let err = error(&with(base.clone(), &["trainer.device=npu"]));
    assert!(err.contains("trainer.device") && err.contains("npu"), "{err}");
    // a typo in a section jetrl shares is named as the user wrote it
    let err = error(&with(base.clone(), &["actor_rollout_ref.rollout.wrkers=2"]));
    assert!(err.contains("actor_rollout_ref.rollout.wrkers"), "{err}");
    let err = error(&with(base.clone(), &["actor_rollout_ref.actor.clip_ratio_c=0.5"]));
    assert!(err.contains("actor_rollout_ref.actor.clip_ratio_c"), "{err}");
    let err = error(&with(base.clone(), &["bogus.key=1"]));
    assert!(err.contains("bogus.key") && err.contains("without --verl"), "{err}");
    assert!(matches!(load_verl(None, &["actor_rollout_ref.actor.lr".into()]), Err(ConfigError::BadOverride(_))));
}

/// verl's critic LoRA keys (`critic.model.lora_rank`, `lora_alpha`, `target_modules`) land in jetrl's
/// `critic.model`; a bad module is named by verl's key; an adapter to load is refused.
#[test]
fn the_critics_lora_keys_map_to_critic_model() {
    let base = vec![
        "trainer.device=cpu".to_string(),
        "algorithm.adv_estimator=gae".into(),
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4".into(),
        "critic.ppo_micro_batch_size_per_gpu=4".into(),
    ];
    let (_, cfg) = load(&with(
        base.clone(),
        &["critic.model.lora_rank=8", "critic.model.lora_alpha=32", "critic.model.target_modules=[q_proj,v_proj]"],
    ))
    .unwrap();
    assert_eq!((cfg.critic.model.lora_rank, cfg.critic.model.lora_alpha), (8, 32.0));
    assert_eq!(cfg.critic.model.target_modules.names(), ["q_proj", "v_proj"]);
    assert_eq!(cfg.model.lora_rank, 0, "the actor's LoRA is its own");
    let err = error(&with(base.clone(), &["critic.model.lora_rank=8", "critic.model.target_modules=[qkv]"]));
    assert!(err.contains("critic.model.target_modules") && err.contains("`qkv`"), "{err}");
    let err = error(&with(base, &["critic.model.lora_rank=8", "+critic.model.lora_adapter_path=/a/critic"]));
    assert!(err.contains("critic.model.lora_adapter_path"), "{err}");
}

#[test]
fn a_mode_key_set_in_another_mode_is_refused_with_the_key_to_set() {
    let base = vec![
        "trainer.device=cpu".to_string(),
        "algorithm.adv_estimator=grpo".into(),
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4".into(),
        "data.train_batch_size=1024".into(),
    ];
    let err = error(&with(
        base.clone(),
        &["trainer.v1.trainer_mode=separate_async", "trainer.v1.colocate_async.num_warmup_batches=2"],
    ));
    assert!(
        err.contains("trainer.v1.colocate_async.num_warmup_batches")
            && err.contains("trainer.v1.separate_async.num_warmup_batches"),
        "{err}"
    );
    let err = error(&with(
        base.clone(),
        &["trainer.v1.trainer_mode=colocate_async", "trainer.v1.separate_async.num_warmup_batches=2"],
    ));
    assert!(err.contains("trainer.v1.colocate_async.num_warmup_batches"), "{err}");
    let (_, cfg) = load(&with(
        base,
        &["trainer.v1.trainer_mode=separate_async", "trainer.v1.separate_async.num_warmup_batches=2"],
    ))
    .unwrap();
    assert_eq!(cfg.trainer.separate_async.num_warmup_batches, 2);
}

#[test]
fn batch_checks_name_every_key_involved() {
    let base = vec!["trainer.device=cpu".to_string(), "algorithm.adv_estimator=grpo".into()];
    let err = error(&base);
    assert!(err.contains("ppo_micro_batch_size_per_gpu") && err.contains("use_dynamic_bsz"), "{err}");
    let err = error(&with(
        base.clone(),
        &["actor_rollout_ref.actor.ppo_micro_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"],
    ));
    assert!(err.contains("both"), "{err}");
    let err = error(&with(
        base.clone(),
        &["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3", "actor_rollout_ref.rollout.n=1"],
    ));
    for key in [
        "actor_rollout_ref.actor.ppo_mini_batch_size",
        "actor_rollout_ref.rollout.n",
        "trainer.n_gpus_per_node",
        "ppo_micro_batch_size_per_gpu",
    ] {
        assert!(err.contains(key), "{key}: {err}");
    }
    let err =
        error(&with(base.clone(), &["actor_rollout_ref.actor.use_dynamic_bsz=True", "data.train_batch_size=128"]));
    assert!(err.contains("data.train_batch_size (128)") && err.contains("ppo_mini_batch_size (256)"), "{err}");
    let err = error(&with(base, &["actor_rollout_ref.actor.use_dynamic_bsz=True", "data.train_batch_size=3"]));
    assert!(err.contains("data.train_batch_size (3)") && err.contains("ranks"), "{err}");
}

#[test]
fn the_docs_table_is_the_codes() {
    let docs = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/configuration.md")).unwrap();
    let table = table_markdown();
    assert!(
        docs.contains(&table),
        "docs/configuration.md lacks the current verl key table; paste the output of table_markdown():\n{table}"
    );
}

/// verl's other GRPO example (`examples/grpo_trainer/run_qwen2-7b.sh`): the older, global micro-batch keys and
/// FSDP keys verl has since dropped (`grad_offload`) load as verl reads them.
#[test]
fn verls_older_example_with_global_micro_batches_loads() {
    let args: Vec<String> = "algorithm.adv_estimator=grpo data.train_files=/d/train.parquet data.val_files=/d/test.parquet \
        data.train_batch_size=1024 data.val_batch_size=1312 data.max_prompt_length=512 data.max_response_length=512 \
        actor_rollout_ref.model.path=/m/Qwen2-7B-Instruct actor_rollout_ref.actor.optim.lr=1e-6 \
        actor_rollout_ref.actor.ppo_mini_batch_size=256 actor_rollout_ref.actor.ppo_micro_batch_size=128 \
        actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.model.enable_gradient_checkpointing=True \
        actor_rollout_ref.actor.fsdp_config.param_offload=False actor_rollout_ref.actor.fsdp_config.grad_offload=False \
        actor_rollout_ref.actor.fsdp_config.optimizer_offload=False actor_rollout_ref.rollout.log_prob_micro_batch_size=128 \
        actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.name=vllm \
        actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=5 \
        actor_rollout_ref.ref.log_prob_micro_batch_size=128 actor_rollout_ref.ref.fsdp_config.param_offload=True \
        algorithm.kl_ctrl.kl_coef=0.001 trainer.critic_warmup=0 trainer.logger=[console,wandb] \
        trainer.project_name=verl_grpo_example_gsm8k trainer.experiment_name=deepseek_llm_7b_function_rm \
        trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.save_freq=-1 trainer.total_epochs=15"
        .split_whitespace()
        .map(str::to_string)
        .collect();
    let (job, cfg) = load(&args).unwrap();
    // 128 responses a micro-batch over 8 ranks: 16 per rank, of at most 512 + 512 tokens
    assert_eq!(cfg.actor.ppo_max_token_len, 16 * 1024);
    assert_eq!(cfg.data.val_batch_size, Some(1312));
    let line = job.ignored_line().unwrap();
    assert!(line.contains("fsdp_config.grad_offload") && line.contains("ref.log_prob_micro_batch_size"), "{line}");
    // at this machine's sizes the global micro-batch no longer divides a rank's mini-batch: verl's check, named
    let small = with(
        args,
        &["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.n_gpus_per_node=1"],
    );
    let err = error(&small);
    assert!(
        err.contains("actor_rollout_ref.actor.ppo_micro_batch_size") && err.contains("20 responses per rank"),
        "{err}"
    );
}

/// verl's DAPO recipe (`recipe/dapo/test_dapo_7b_math.sh`), its arguments to `verl.trainer.main_ppo` with the
/// script's values, and the paths of this test.
fn dapo_recipe() -> Vec<String> {
    "data.train_files=/d/dapo-math-17k.parquet data.val_files=/d/aime-2024.parquet data.prompt_key=prompt \
     data.truncation=left data.max_prompt_length=2048 data.max_response_length=8192 data.train_batch_size=512 \
     actor_rollout_ref.rollout.n=16 algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=False \
     algorithm.kl_ctrl.kl_coef=0.0 actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.actor.kl_loss_coef=0.0 \
     actor_rollout_ref.actor.clip_ratio_low=0.2 actor_rollout_ref.actor.clip_ratio_high=0.28 \
     actor_rollout_ref.actor.clip_ratio_c=10.0 actor_rollout_ref.model.use_remove_padding=True \
     +actor_rollout_ref.model.override_config.max_position_embeddings=32768 \
     actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True \
     actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20480 \
     actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=30720 \
     actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=30720 actor_rollout_ref.model.path=/m/Qwen2.5-Math-7B \
     actor_rollout_ref.model.enable_gradient_checkpointing=True actor_rollout_ref.actor.optim.lr=1e-6 \
     actor_rollout_ref.actor.optim.lr_warmup_steps=10 actor_rollout_ref.actor.optim.weight_decay=0.1 \
     actor_rollout_ref.actor.ppo_mini_batch_size=32 actor_rollout_ref.actor.fsdp_config.param_offload=True \
     actor_rollout_ref.actor.fsdp_config.optimizer_offload=True actor_rollout_ref.actor.entropy_coeff=0 \
     actor_rollout_ref.actor.grad_clip=1.0 actor_rollout_ref.actor.loss_agg_mode=token-mean \
     actor_rollout_ref.actor.ulysses_sequence_parallel_size=4 actor_rollout_ref.rollout.gpu_memory_utilization=0.80 \
     actor_rollout_ref.rollout.tensor_model_parallel_size=4 actor_rollout_ref.rollout.enable_chunked_prefill=True \
     actor_rollout_ref.rollout.max_num_batched_tokens=10240 actor_rollout_ref.rollout.temperature=1.0 \
     actor_rollout_ref.rollout.top_p=1.0 actor_rollout_ref.rollout.top_k=-1 \
     actor_rollout_ref.rollout.val_kwargs.temperature=1.0 actor_rollout_ref.rollout.val_kwargs.top_p=0.7 \
     actor_rollout_ref.rollout.val_kwargs.top_k=-1 actor_rollout_ref.rollout.val_kwargs.do_sample=True \
     actor_rollout_ref.rollout.val_kwargs.n=1 actor_rollout_ref.ref.fsdp_config.param_offload=True \
     actor_rollout_ref.ref.ulysses_sequence_parallel_size=4 actor_rollout_ref.actor.fsdp_config.fsdp_size=32 \
     reward_model.reward_manager=dapo +reward_model.reward_kwargs.overlong_buffer_cfg.enable=True \
     +reward_model.reward_kwargs.overlong_buffer_cfg.len=4096 \
     +reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0 \
     +reward_model.reward_kwargs.overlong_buffer_cfg.log=False +reward_model.reward_kwargs.max_resp_len=8192 \
     trainer.logger=['console','wandb'] trainer.project_name=DAPO trainer.experiment_name=DAPO-Qwen2.5-7b-MATH-0527a1 \
     trainer.n_gpus_per_node=8 trainer.nnodes=8 trainer.val_before_train=True trainer.test_freq=10 \
     trainer.save_freq=10 trainer.total_epochs=10 trainer.total_training_steps=200 \
     trainer.default_local_dir=/c/DAPO trainer.resume_mode=auto trainer.log_val_generations=10"
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

/// What the recipe needs that jetrl refuses (Ulysses, a model config override, an experiment name with a `.` as the
/// job's NATS namespace), undone by the user's arguments.
const DAPO_ON_JETRL: &[&str] = &[
    "nats.namespace=dapo",
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size=1",
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size=1",
    "~actor_rollout_ref.model.override_config.max_position_embeddings",
];

#[test]
fn dapo_recipes_overlong_penalty_is_honoured() {
    let err = error(&dapo_recipe());
    assert!(err.contains("ulysses_sequence_parallel_size") || err.contains("override_config"), "{err}");
    let (job, cfg) = load(&with(dapo_recipe(), DAPO_ON_JETRL)).unwrap();
    let kwargs = &cfg.reward.reward_kwargs;
    let buffer = &kwargs.overlong_buffer_cfg;
    assert!(buffer.enable && !buffer.log);
    assert_eq!((buffer.len, buffer.penalty_factor, kwargs.max_resp_len), (4096, 1.0, Some(8192)));
    let line = job.ignored_line().unwrap();
    assert!(!line.contains("reward_kwargs"), "{line}");
    // recipe.dapo.main_dapo's own spelling (verl's tests/special_e2e/run_dapo.sh): the response budget is the data's
    let mut older: Vec<String> = with(dapo_recipe(), DAPO_ON_JETRL)
        .into_iter()
        .filter(|arg| !arg.starts_with("+reward_model.reward_kwargs"))
        .collect();
    older.extend(
        [
            "reward_model.overlong_buffer.enable=True",
            "reward_model.overlong_buffer.len=128",
            "data.max_response_length=2048",
        ]
        .map(String::from),
    );
    let (_, cfg) = load(&older).unwrap();
    let kwargs = &cfg.reward.reward_kwargs;
    assert!(kwargs.overlong_buffer_cfg.enable);
    assert_eq!((kwargs.overlong_buffer_cfg.len, kwargs.max_resp_len), (128, Some(2048)));
}

#[test]
fn dapo_kwargs_without_the_dapo_manager_or_their_budget_are_refused_by_verls_key() {
    let recipe = with(dapo_recipe(), DAPO_ON_JETRL);
    let err = error(&with(recipe.clone(), &["reward_model.reward_manager=naive"]));
    assert!(err.contains("reward_model.reward_kwargs") && err.contains("reward_model.reward_manager=dapo"), "{err}");
    let err = error(&with(recipe, &["~reward_model.reward_kwargs.max_resp_len"]));
    assert!(err.contains("reward_model.reward_kwargs.max_resp_len") && err.contains("required"), "{err}");
}

#[test]
fn keys_that_change_what_is_learned_are_refused_not_ignored() {
    let base = with(dapo_recipe(), DAPO_ON_JETRL);
    for (arg, named) in [
        ("+actor_rollout_ref.ref.router_replay.mode=R3", "router replay"),
        ("+actor_rollout_ref.rollout.agent.custom_async_server.path=/p/server.py", "rollout servers"),
        ("+critic.model.override_config.hidden_dropout=0.1", "config.json"),
        ("+critic.model.tokenizer_path=/m/other", "tokenizer"),
        ("+reward_model.reward_loop_module_path=/p/manager.py", "reward managers"),
    ] {
        let key = arg.trim_start_matches('+').split(['=']).next().unwrap();
        let key = key.strip_suffix(".hidden_dropout").unwrap_or(key);
        let err = error(&with(base.clone(), &[arg]));
        assert!(err.contains(key) && err.contains(named), "{arg}: {err}");
    }
    // the actor's tokenizer loads; verl generates up to the rollout's response length, as jetrl's max_new_tokens
    let (_, cfg) = load(&with(
        base,
        &["actor_rollout_ref.rollout.response_length=4096", "+critic.model.tokenizer_path=/m/Qwen2.5-Math-7B"],
    ))
    .unwrap();
    assert_eq!((cfg.data.max_response_length, cfg.max_new_tokens()), (8192, 4096));
}

#[test]
fn keys_inside_a_mapped_mapping_map_below_its_jetrl_key() {
    let args = with(dapo_recipe(), &[DAPO_ON_JETRL, &["+custom_reward_function.reward_kwargs.scale=2"]].concat());
    let (_, cfg) = load(&args).unwrap();
    assert_eq!(cfg.reward.custom_reward_function.reward_kwargs["scale"], serde_json::json!(2));
}

#[test]
fn image_and_video_columns_are_verls_keys() {
    let (_, cfg) = load(&with(dapo_recipe(), &[DAPO_ON_JETRL, &["data.image_key=pictures"]].concat())).unwrap();
    assert_eq!((cfg.data.image_key.as_str(), cfg.data.video_key.as_str()), ("pictures", "videos"));
}
