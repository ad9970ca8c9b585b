//! The fate of every verl key `jetrl run --verl` meets: mapped to jetrl's key, refused (it changes what is learned
//! and jetrl cannot do it), ignored (it tunes another engine or the cluster), read by a rule over several keys,
//! or one of jetrl's own keys. docs/configuration.md's table is [`table_markdown`]'s output (a test checks it).

use serde_json::Value;

/// What becomes of a verl key.
#[derive(Debug, Clone, Copy)]
pub enum Fate {
    /// does what verl's does, as this jetrl key (a null leaves jetrl's default)
    Map(&'static str),
    /// as this jetrl key when the user sets it; verl's default is not applied (jetrl's default stays)
    MapSet(&'static str),
    /// as this jetrl key, through a conversion
    Convert(&'static str, Conv),
    /// accepted with these values (verl's default among them); any other is refused, for this reason
    Only(&'static [&'static str], &'static str),
    /// tunes another engine or the cluster: ignored, and listed at start-up when set
    Ignore(&'static str),
    /// read by a rule over several keys (what it does)
    Rule(&'static str),
    /// one of jetrl's own sections, settable in the same file
    Jetrl,
}

/// Conversions of [`Fate::Convert`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Conv {
    /// a path or a list of paths, `~` expanded, as a list
    FileList,
    /// a path, `~` expanded
    Path,
    /// verl's `-1` (unset) as null
    NegativeIsNull,
}

impl Conv {
    pub fn apply(self, value: &Value) -> Result<Value, String> {
        match self {
            Conv::Path => match value {
                Value::String(s) => Ok(Value::String(expand_home(s))),
                other => Ok(other.clone()),
            },
            Conv::FileList => match value {
                Value::String(s) => Ok(Value::Array(vec![Value::String(expand_home(s))])),
                Value::Array(items) => items
                    .iter()
                    .map(|v| match v {
                        Value::String(s) => Ok(Value::String(expand_home(s))),
                        other => Err(format!("a file list holds paths, not {other}")),
                    })
                    .collect::<Result<Vec<_>, _>>()
                    .map(Value::Array),
                Value::Null => Ok(Value::Array(vec![])),
                other => Err(format!("expected a path or a list of paths, got {other}")),
            },
            Conv::NegativeIsNull => match value.as_f64() {
                Some(v) if v < 0.0 => Ok(Value::Null),
                _ => Ok(value.clone()),
            },
        }
    }
}

/// `~/x` as `$HOME/x`.
pub fn expand_home(path: &str) -> String {
    match (path.strip_prefix("~/"), std::env::var("HOME")) {
        (Some(rest), Ok(home)) => format!("{}/{rest}", home.trim_end_matches('/')),
        _ => path.to_string(),
    }
}

/// A verl key (or a subtree: `prefix.*`) and its fate.
#[derive(Debug, Clone, Copy)]
pub struct Key {
    pub verl: &'static str,
    pub fate: Fate,
}

const fn k(verl: &'static str, fate: Fate) -> Key {
    Key { verl, fate }
}

use Fate::{Convert, Ignore, Jetrl, Map, MapSet, Only, Rule};

const ENGINE: &str = "tunes verl's inference engine; jetrl passes vLLM settings through rollout.engine_kwargs.vllm";
const FSDP: &str = "tunes FSDP; jetrl's trainer ranks are data parallel with ZeRO-2 sharding (trainer.n_gpus_per_node)";
const PROFILER: &str = "verl's profiler";
const RAY: &str = "Ray's resources; jetrl's services are processes that meet over NATS";
const MICRO: &str = "micro-batches: with the other micro-batch keys, sets jetrl's token budget per micro-batch";
const REF_MICRO: &str =
    "the reference policy's micro-batches; jetrl computes reference log-probs in the trainer with the actor's budget";
const STRATEGY: &str =
    "megatron's tensor and pipeline parallel training is not built: jetrl's trainer is data parallel (FSDP-like ZeRO-2)";
const ROUTER_REPLAY: &str =
    "the reference policy routes by its own router; router replay in it (verl's ref.router_replay) is not built";
const MULTI_MODAL: &str =
    "read only for rows with images or videos, which jetrl refuses when it loads the data (data.image_key, data.video_key)";
const ONE_DEVICE: &str = "sequence parallelism (Ulysses) is not built: one sequence stays on one device";

/// Every verl key jetrl reads, in verl's order.
pub static KEYS: &[Key] = &[
    // actor_rollout_ref.model
    k("actor_rollout_ref.model.path", Convert("model.path", Conv::Path)),
    k("actor_rollout_ref.model.enable_gradient_checkpointing", Map("model.enable_gradient_checkpointing")),
    k("actor_rollout_ref.model.use_remove_padding", Map("model.use_remove_padding")),
    k("actor_rollout_ref.model.lora_rank", Map("model.lora_rank")),
    k("actor_rollout_ref.model.lora_alpha", Map("model.lora_alpha")),
    k("actor_rollout_ref.model.target_modules", Map("model.target_modules")),
    k("actor_rollout_ref.model.exclude_modules", Map("model.exclude_modules")),
    k("actor_rollout_ref.model.lora_adapter_path", Convert("model.lora_adapter_path", Conv::Path)),
    k(
        "actor_rollout_ref.model.custom_chat_template",
        Only(&["null"], "jetrl applies the chat template of the model directory's tokenizer_config.json"),
    ),
    k(
        "actor_rollout_ref.model.external_lib",
        Only(&["null"], "jetrl runs the architectures it implements in Rust; no Python model library is imported"),
    ),
    k(
        "actor_rollout_ref.model.override_config",
        Only(&["{}"], "jetrl reads the model's config.json as it is; edit the model directory instead"),
    ),
    k("actor_rollout_ref.model.use_shm", Ignore("copies the model through /dev/shm; jetrl reads it from disk")),
    k("actor_rollout_ref.model.enable_activation_offload", Ignore("activation offload to the CPU is not built")),
    k("actor_rollout_ref.model.use_liger", Ignore("Liger kernels; jetrl's own kernels run")),
    k("actor_rollout_ref.model.use_fused_kernels", Ignore("verl's fused kernels; jetrl's own kernels run")),
    k("actor_rollout_ref.model.fused_kernel_options.*", Ignore("verl's fused kernels; jetrl's own kernels run")),
    k("actor_rollout_ref.model.trust_remote_code", Ignore("jetrl never runs a model's remote code")),
    // actor_rollout_ref.actor
    k("actor_rollout_ref.actor.strategy", Only(&["fsdp", "fsdp2"], STRATEGY)),
    k("actor_rollout_ref.actor.ppo_mini_batch_size", Map("actor.ppo_mini_batch_size")),
    k("actor_rollout_ref.actor.ppo_micro_batch_size", Rule(MICRO)),
    k("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", Rule(MICRO)),
    k("actor_rollout_ref.actor.use_dynamic_bsz", Rule(MICRO)),
    k("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", Rule(MICRO)),
    k("actor_rollout_ref.actor.clip_ratio", Map("actor.clip_ratio")),
    k("actor_rollout_ref.actor.clip_ratio_low", Map("actor.clip_ratio_low")),
    k("actor_rollout_ref.actor.clip_ratio_high", Map("actor.clip_ratio_high")),
    k("actor_rollout_ref.actor.clip_ratio_c", Map("actor.clip_ratio_c")),
    k("actor_rollout_ref.actor.tau_pos", Map("actor.tau_pos")),
    k("actor_rollout_ref.actor.tau_neg", Map("actor.tau_neg")),
    k("actor_rollout_ref.actor.policy_loss.loss_mode", Map("actor.policy_loss.loss_mode")),
    k("actor_rollout_ref.actor.policy_loss.clip_cov_ratio", Map("actor.policy_loss.clip_cov_ratio")),
    k("actor_rollout_ref.actor.policy_loss.clip_cov_lb", Map("actor.policy_loss.clip_cov_lb")),
    k("actor_rollout_ref.actor.policy_loss.clip_cov_ub", Map("actor.policy_loss.clip_cov_ub")),
    k("actor_rollout_ref.actor.policy_loss.kl_cov_ratio", Map("actor.policy_loss.kl_cov_ratio")),
    k("actor_rollout_ref.actor.policy_loss.ppo_kl_coef", Map("actor.policy_loss.ppo_kl_coef")),
    k("actor_rollout_ref.actor.policy_loss.dro_beta", Map("actor.policy_loss.dro_beta")),
    k("actor_rollout_ref.actor.loss_agg_mode", Map("actor.loss_agg_mode")),
    k("actor_rollout_ref.actor.loss_scale_factor", Map("actor.loss_scale_factor")),
    k("actor_rollout_ref.actor.entropy_coeff", Map("actor.entropy_coeff")),
    k("actor_rollout_ref.actor.calculate_entropy", Map("actor.calculate_entropy")),
    k("actor_rollout_ref.actor.calculate_sum_pi_squared", Map("actor.calculate_sum_pi_squared")),
    k("actor_rollout_ref.actor.router_replay.mode", Map("actor.router_replay.mode")),
    k("actor_rollout_ref.rollout.enable_rollout_routing_replay", Map("rollout.enable_rollout_routing_replay")),
    k(
        "actor_rollout_ref.actor.megatron.override_transformer_config.moe_aux_loss_coeff",
        Map("actor.moe_aux_loss_coeff"),
    ),
    k("actor_rollout_ref.actor.use_kl_loss", Map("actor.use_kl_loss")),
    k("actor_rollout_ref.actor.kl_loss_coef", Map("actor.kl_loss_coef")),
    k("actor_rollout_ref.actor.kl_loss_type", Map("actor.kl_loss_type")),
    k("actor_rollout_ref.actor.ppo_epochs", Map("actor.ppo_epochs")),
    k("actor_rollout_ref.actor.shuffle", Map("actor.shuffle")),
    k("actor_rollout_ref.actor.data_loader_seed", Map("actor.data_loader_seed")),
    k("actor_rollout_ref.actor.grad_clip", Map("actor.grad_clip")),
    k("actor_rollout_ref.actor.optim.lr", Map("actor.optim.lr")),
    k("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio", Map("actor.optim.lr_warmup_steps_ratio")),
    k("actor_rollout_ref.actor.optim.lr_warmup_steps", Convert("actor.optim.lr_warmup_steps", Conv::NegativeIsNull)),
    k("actor_rollout_ref.actor.optim.weight_decay", Map("actor.optim.weight_decay")),
    k("actor_rollout_ref.actor.optim.betas", Map("actor.optim.betas")),
    k("actor_rollout_ref.actor.optim.eps", Map("actor.optim.eps")),
    k("actor_rollout_ref.actor.optim.min_lr_ratio", Map("actor.optim.min_lr_ratio")),
    k("actor_rollout_ref.actor.optim.warmup_style", Map("actor.optim.lr_scheduler_type")),
    k("actor_rollout_ref.actor.optim.lr_scheduler_type", Map("actor.optim.lr_scheduler_type")),
    k("actor_rollout_ref.actor.optim.clip_grad", Map("actor.grad_clip")),
    k("actor_rollout_ref.actor.optim.num_cycles", Only(&["0.5"], "jetrl's cosine schedule is half a cycle")),
    k(
        "actor_rollout_ref.actor.optim.total_training_steps",
        Ignore("set by the trainer from trainer.total_training_steps, as verl does"),
    ),
    k("actor_rollout_ref.actor.optim.optimizer", Only(&["AdamW"], "jetrl's optimizer is AdamW")),
    k("actor_rollout_ref.actor.use_torch_compile", Ignore("torch.compile; jetrl runs libtorch kernels directly")),
    k("actor_rollout_ref.actor.ulysses_sequence_parallel_size", Only(&["1"], ONE_DEVICE)),
    k("actor_rollout_ref.actor.entropy_from_logits_with_chunking", Ignore("jetrl computes the entropy in chunks")),
    k("actor_rollout_ref.actor.entropy_checkpointing", Ignore("jetrl computes the entropy in chunks")),
    k("actor_rollout_ref.actor.use_fused_kernels", Ignore("verl's fused kernels; jetrl's own kernels run")),
    k("actor_rollout_ref.actor.use_remove_padding", Ignore("set by actor_rollout_ref.model.use_remove_padding")),
    k("actor_rollout_ref.actor.fsdp_config.*", Ignore(FSDP)),
    k("actor_rollout_ref.actor.checkpoint.*", Ignore("jetrl's checkpoints always hold the model, optimizer and state")),
    k("actor_rollout_ref.actor.profiler.*", Ignore(PROFILER)),
    // actor_rollout_ref.ref
    k("actor_rollout_ref.ref.log_prob_micro_batch_size", Ignore(REF_MICRO)),
    k("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", Ignore(REF_MICRO)),
    k("actor_rollout_ref.ref.log_prob_use_dynamic_bsz", Ignore(REF_MICRO)),
    k("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", Ignore(REF_MICRO)),
    k("actor_rollout_ref.ref.ulysses_sequence_parallel_size", Only(&["1"], ONE_DEVICE)),
    k("actor_rollout_ref.ref.fsdp_config.*", Ignore(FSDP)),
    k("actor_rollout_ref.ref.profiler.*", Ignore(PROFILER)),
    k("actor_rollout_ref.ref.router_replay.mode", Only(&["disabled"], ROUTER_REPLAY)),
    k("actor_rollout_ref.ref.*", Ignore("the reference policy runs in jetrl's trainer beside the actor")),
    // actor_rollout_ref.rollout
    k("actor_rollout_ref.rollout.name", MapSet("rollout.name")),
    k("actor_rollout_ref.rollout.mode", Ignore("jetrl's rollouts are always asynchronous requests to the engine")),
    k("actor_rollout_ref.rollout.temperature", Map("rollout.temperature")),
    k("actor_rollout_ref.rollout.top_k", Map("rollout.top_k")),
    k("actor_rollout_ref.rollout.top_p", Map("rollout.top_p")),
    k("actor_rollout_ref.rollout.repetition_penalty", Map("rollout.repetition_penalty")),
    k("actor_rollout_ref.rollout.do_sample", Rule("false samples greedily (rollout.temperature=0)")),
    k("actor_rollout_ref.rollout.n", Map("rollout.n")),
    k("actor_rollout_ref.rollout.seed", Map("rollout.seed")),
    k("actor_rollout_ref.rollout.logprobs_mode", Map("rollout.logprobs_mode")),
    k("actor_rollout_ref.rollout.max_model_len", Map("rollout.max_model_len")),
    k("actor_rollout_ref.rollout.max_num_seqs", Map("rollout.max_num_seqs")),
    k("actor_rollout_ref.rollout.enforce_eager", Map("rollout.enforce_eager")),
    k(
        "actor_rollout_ref.rollout.ignore_eos",
        Only(&["false"], "changes what is generated; jetrl's engine stops a sequence at its end-of-sequence token"),
    ),
    k(
        "actor_rollout_ref.rollout.prompt_length",
        Ignore("verl pads prompts to it; jetrl's prompts are filtered or cut at data.max_prompt_length"),
    ),
    k("actor_rollout_ref.rollout.response_length", Map("rollout.max_new_tokens")),
    k("actor_rollout_ref.rollout.dtype", Ignore("the rollout runs in the model's dtype (model.dtype, set by trainer.device)")),
    k("actor_rollout_ref.rollout.gpu_memory_utilization", MapSet("rollout.gpu_memory_utilization")),
    k("actor_rollout_ref.rollout.tensor_model_parallel_size", MapSet("rollout.tensor_model_parallel_size")),
    k("actor_rollout_ref.rollout.free_cache_engine", MapSet("rollout.free_cache_engine")),
    k("actor_rollout_ref.rollout.max_num_batched_tokens", MapSet("rollout.max_num_batched_tokens")),
    k("actor_rollout_ref.rollout.enable_chunked_prefill", MapSet("rollout.enable_chunked_prefill")),
    k("actor_rollout_ref.rollout.enable_prefix_caching", MapSet("rollout.enable_prefix_caching")),
    k("actor_rollout_ref.rollout.load_format", Ignore(ENGINE)),
    k("actor_rollout_ref.rollout.cudagraph_capture_sizes", Ignore(ENGINE)),
    k("actor_rollout_ref.rollout.disable_log_stats", Ignore(ENGINE)),
    k("actor_rollout_ref.rollout.update_weights_bucket_megabytes", Ignore("jetrl's weights move in checkpoint.chunk_bytes chunks")),
    k("actor_rollout_ref.rollout.calculate_log_probs", Ignore("jetrl's rollouts always record their log-probs")),
    k("actor_rollout_ref.rollout.log_prob_micro_batch_size", Ignore(REF_MICRO)),
    k("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", Ignore(REF_MICRO)),
    k("actor_rollout_ref.rollout.log_prob_use_dynamic_bsz", Ignore(REF_MICRO)),
    k("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", Ignore(REF_MICRO)),
    k("actor_rollout_ref.rollout.val_kwargs.temperature", Map("rollout.val_kwargs.temperature")),
    k("actor_rollout_ref.rollout.val_kwargs.top_k", Map("rollout.val_kwargs.top_k")),
    k("actor_rollout_ref.rollout.val_kwargs.top_p", Map("rollout.val_kwargs.top_p")),
    k("actor_rollout_ref.rollout.val_kwargs.n", Map("rollout.val_kwargs.n")),
    k("actor_rollout_ref.rollout.val_kwargs.do_sample", Rule("false validates greedily (rollout.val_kwargs.temperature=0)")),
    k("actor_rollout_ref.rollout.multi_turn.enable", Rule("true runs the tool agent loop (rollout.agent.default_agent_loop=tool_agent)")),
    k("actor_rollout_ref.rollout.multi_turn.max_assistant_turns", Map("rollout.multi_turn.max_assistant_turns")),
    k("actor_rollout_ref.rollout.multi_turn.max_user_turns", Map("rollout.multi_turn.max_user_turns")),
    k("actor_rollout_ref.rollout.multi_turn.max_parallel_calls", Map("rollout.multi_turn.max_parallel_calls")),
    k("actor_rollout_ref.rollout.multi_turn.max_tool_response_length", Map("rollout.multi_turn.max_tool_response_length")),
    k("actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side", Map("rollout.multi_turn.tool_response_truncate_side")),
    k("actor_rollout_ref.rollout.multi_turn.format", Map("rollout.multi_turn.format")),
    k(
        "actor_rollout_ref.rollout.multi_turn.tool_config_path",
        Only(&["null"], "jetrl's tools are built in (rollout.multi_turn.tools: calculator, python); Python tool classes are not loaded"),
    ),
    k(
        "actor_rollout_ref.rollout.multi_turn.interaction_config_path",
        Only(&["null"], "simulated-user interactions are not built"),
    ),
    k(
        "actor_rollout_ref.rollout.multi_turn.*",
        Ignore("tokenization checks of verl's agent loop, and settings only its SGLang rollout reads (SGLang is refused)"),
    ),
    k("actor_rollout_ref.rollout.agent.default_agent_loop", Map("rollout.agent.default_agent_loop")),
    k("actor_rollout_ref.rollout.agent.num_workers", Ignore("verl's agent-loop Ray actors; jetrl's loops are tasks of the rollout worker")),
    k(
        "actor_rollout_ref.rollout.agent.agent_loop_config_path",
        Only(&["null"], "custom Python agent loops are not loaded; jetrl has single_turn_agent and tool_agent"),
    ),
    k(
        "actor_rollout_ref.rollout.agent.custom_async_server.path",
        Only(&["null"], "custom Python rollout servers are not loaded; rollout.name picks the engine"),
    ),
    k("actor_rollout_ref.rollout.agent.*", Ignore("verl's agent-loop Ray actors")),
    k("actor_rollout_ref.rollout.trace.*", Ignore("verl's rollout tracing")),
    k("actor_rollout_ref.rollout.profiler.*", Ignore(PROFILER)),
    k("actor_rollout_ref.rollout.multi_stage_wake_up", Ignore(ENGINE)),
    k("actor_rollout_ref.rollout.over_sample_rate", Only(&["0"], "over-sampling and cutting rollouts is not built")),
    k("actor_rollout_ref.rollout.skip_rollout", Only(&["false"], "replaying dumped rollouts is not built")),
    k("actor_rollout_ref.rollout.skip_dump_dir", Ignore("replaying dumped rollouts is not built")),
    k("actor_rollout_ref.rollout.layered_summon", Ignore(FSDP)),
    k("actor_rollout_ref.hybrid_engine", Ignore("jetrl picks where rollouts run by trainer.v1.trainer_mode")),
    k("actor_rollout_ref.nccl_timeout", Map("trainer.dist.timeout_s")),
    // data
    k("data.tokenizer", Only(&["null"], "jetrl tokenizes with the model directory's tokenizer")),
    k("data.use_shm", Ignore("copies data through /dev/shm; jetrl reads it from disk")),
    k("data.train_files", Convert("data.train_files", Conv::FileList)),
    k("data.val_files", Convert("data.val_files", Conv::FileList)),
    k("data.train_max_samples", Map("data.train_max_samples")),
    k("data.val_max_samples", Map("data.val_max_samples")),
    k("data.prompt_key", Map("data.prompt_key")),
    k("data.reward_fn_key", Only(&["data_source"], "jetrl's reward service picks the scorer by the row's data_source")),
    k("data.max_prompt_length", Map("data.max_prompt_length")),
    k("data.max_response_length", Map("data.max_response_length")),
    k("data.train_batch_size", Map("data.train_batch_size")),
    k("data.val_batch_size", Map("data.val_batch_size")),
    k("data.shuffle", Map("data.shuffle")),
    k("data.seed", Map("data.seed")),
    k("data.validation_shuffle", Map("data.validation_shuffle")),
    k("data.filter_overlong_prompts", Map("data.filter_overlong_prompts")),
    k("data.truncation", Map("data.truncation")),
    k("data.return_raw_input_ids", Ignore("what verl's dataloader hands its workers; jetrl's rows go over NATS")),
    k("data.return_raw_chat", Ignore("what verl's dataloader hands its workers; jetrl's rows go over NATS")),
    k("data.return_full_prompt", Ignore("what verl's dataloader hands its workers; jetrl's rows go over NATS")),
    k("data.dataloader_num_workers", Ignore("verl's dataloader processes")),
    k("data.filter_overlong_prompts_workers", Ignore("verl's dataloader processes")),
    k("data.image_key", Map("data.image_key")),
    k("data.video_key", Map("data.video_key")),
    k("data.return_multi_modal_inputs", Ignore(MULTI_MODAL)),
    k("data.image_patch_size", Ignore(MULTI_MODAL)),
    k("data.trust_remote_code", Ignore("jetrl never runs a dataset's remote code")),
    k("data.custom_cls.path", Only(&["null"], "custom Python dataset classes are not loaded")),
    k("data.custom_cls.*", Ignore("custom Python dataset classes are not loaded")),
    k("data.sampler.class_path", Only(&["null"], "custom Python samplers are not loaded")),
    k("data.sampler.*", Ignore("custom Python samplers are not loaded")),
    k("data.datagen.path", Only(&["null"], "dynamic data generation is not built")),
    k("data.datagen.*", Ignore("dynamic data generation is not built")),
    k(
        "data.apply_chat_template_kwargs",
        Only(&["{}"], "jetrl applies the model's chat template with its defaults"),
    ),
    // critic
    k("critic.strategy", Only(&["fsdp", "fsdp2"], STRATEGY)),
    k("critic.enable", Map("critic.enable")),
    k("critic.optim.lr", Map("critic.optim.lr")),
    k("critic.optim.lr_warmup_steps_ratio", Map("critic.optim.lr_warmup_steps_ratio")),
    k("critic.optim.lr_warmup_steps", Convert("critic.optim.lr_warmup_steps", Conv::NegativeIsNull)),
    k("critic.optim.weight_decay", Map("critic.optim.weight_decay")),
    k("critic.optim.betas", Map("critic.optim.betas")),
    k("critic.optim.eps", Map("critic.optim.eps")),
    k("critic.optim.min_lr_ratio", Map("critic.optim.min_lr_ratio")),
    k("critic.optim.warmup_style", Map("critic.optim.lr_scheduler_type")),
    k("critic.optim.lr_scheduler_type", Map("critic.optim.lr_scheduler_type")),
    k("critic.optim.clip_grad", Map("critic.grad_clip")),
    k("critic.optim.total_training_steps", Ignore("set by the trainer from trainer.total_training_steps, as verl does")),
    k("critic.model.path", Rule("jetrl's critic starts from the actor's model: another path is refused")),
    k("critic.model.tokenizer_path", Rule("jetrl's critic reads the actor's tokens: another path is refused")),
    k(
        "critic.model.override_config",
        Only(&["{}"], "jetrl reads the model's config.json as it is; edit the model directory instead"),
    ),
    k(
        "critic.model.external_lib",
        Only(&["null"], "jetrl runs the architectures it implements in Rust; no Python model library is imported"),
    ),
    k("critic.model.lora_rank", Map("critic.model.lora_rank")),
    k("critic.model.lora_alpha", Map("critic.model.lora_alpha")),
    k("critic.model.target_modules", Map("critic.model.target_modules")),
    k(
        "critic.model.lora_adapter_path",
        Only(&["null"], "the critic's adapter starts new or from a jetrl checkpoint; loading another is not built"),
    ),
    k("critic.model.fsdp_config.*", Ignore(FSDP)),
    k("critic.model.*", Ignore("the critic runs with the actor's model settings")),
    k("critic.ppo_mini_batch_size", Map("critic.ppo_mini_batch_size")),
    k("critic.ppo_micro_batch_size", Rule(MICRO)),
    k("critic.ppo_micro_batch_size_per_gpu", Rule(MICRO)),
    k("critic.use_dynamic_bsz", Rule(MICRO)),
    k("critic.ppo_max_token_len_per_gpu", Rule(MICRO)),
    k("critic.forward_micro_batch_size", Ignore(REF_MICRO)),
    k("critic.forward_micro_batch_size_per_gpu", Ignore(REF_MICRO)),
    k("critic.forward_max_token_len_per_gpu", Ignore(REF_MICRO)),
    k("critic.ppo_epochs", Map("critic.ppo_epochs")),
    k("critic.shuffle", Map("critic.shuffle")),
    k("critic.cliprange_value", Map("critic.cliprange_value")),
    k("critic.loss_agg_mode", Map("critic.loss_agg_mode")),
    k("critic.loss_scale_factor", Map("critic.loss_scale_factor")),
    k("critic.data_loader_seed", Map("critic.data_loader_seed")),
    k("critic.ulysses_sequence_parallel_size", Only(&["1"], ONE_DEVICE)),
    k("critic.grad_clip", Map("critic.grad_clip")),
    k("critic.rollout_n", Ignore("set from actor_rollout_ref.rollout.n")),
    k("critic.checkpoint.*", Ignore("jetrl's checkpoints always hold the model, optimizer and state")),
    k("critic.profiler.*", Ignore(PROFILER)),
    // reward_model, custom_reward_function
    k(
        "reward_model.enable",
        Only(
            &["false"],
            "jetrl scores with a reward-model server (reward.reward_model.url: vLLM, SGLang or TEI), not an in-process FSDP model",
        ),
    ),
    k("reward_model.reward_manager", Only(&["naive", "dapo"], "jetrl's reward service scores like verl's naive manager (dapo: with reward.reward_kwargs.overlong_buffer_cfg)")),
    k("reward_model.sandbox_fusion.url", Only(&["null"], "Sandbox Fusion scoring is not built; jetrl's code scorer runs the tests itself")),
    k(
        "reward_model.reward_kwargs.*",
        Rule("read by reward_model.reward_manager=dapo, as reward.reward_kwargs.* (same keys); refused with another manager"),
    ),
    k(
        "reward_model.overlong_buffer.*",
        Rule("recipe.dapo.main_dapo's spelling: as reward.reward_kwargs.overlong_buffer_cfg.*, max_resp_len = data.max_response_length"),
    ),
    k("reward_model.reward_loop_source", Only(&["register"], "custom Python reward managers are not loaded")),
    k("reward_model.reward_loop_module_path", Only(&["null"], "custom Python reward managers are not loaded")),
    k("reward_model.*", Ignore("settings of verl's in-process reward model (reward_model.enable is refused)")),
    k("custom_reward_function.path", Convert("reward.custom_reward_function.path", Conv::Path)),
    k("custom_reward_function.name", Map("reward.custom_reward_function.name")),
    k("custom_reward_function.reward_kwargs", Map("reward.custom_reward_function.reward_kwargs")),
    // algorithm
    k("algorithm.gamma", Map("algorithm.gamma")),
    k("algorithm.lam", Map("algorithm.lam")),
    k("algorithm.adv_estimator", Map("algorithm.adv_estimator")),
    k("algorithm.norm_adv_by_std_in_grpo", Map("algorithm.norm_adv_by_std_in_grpo")),
    k("algorithm.use_kl_in_reward", Map("algorithm.use_kl_in_reward")),
    k("algorithm.kl_penalty", Map("algorithm.kl_penalty")),
    k("algorithm.kl_ctrl.type", Map("algorithm.kl_ctrl.type")),
    k("algorithm.kl_ctrl.kl_coef", Map("algorithm.kl_ctrl.kl_coef")),
    k("algorithm.kl_ctrl.horizon", Map("algorithm.kl_ctrl.horizon")),
    k("algorithm.kl_ctrl.target_kl", Map("algorithm.kl_ctrl.target_kl")),
    k("algorithm.use_pf_ppo", Map("algorithm.use_pf_ppo")),
    k("algorithm.pf_ppo.reweight_method", Map("algorithm.pf_ppo.reweight_method")),
    k("algorithm.pf_ppo.weight_pow", Map("algorithm.pf_ppo.weight_pow")),
    k("algorithm.filter_groups.enable", Map("algorithm.filter_groups.enable")),
    k("algorithm.filter_groups.metric", Map("algorithm.filter_groups.metric")),
    k("algorithm.filter_groups.max_num_gen_batches", Map("algorithm.filter_groups.max_num_gen_batches")),
    k("algorithm.filter_groups.max_inflight_gen_batches", Map("algorithm.filter_groups.max_inflight_gen_batches")),
    k("algorithm.rollout_correction.*", Rule("the subtree as algorithm.rollout_correction (same keys)")),
    k("algorithm.gdpo_reward_keys", Map("algorithm.gdpo_reward_keys")),
    k("algorithm.gdpo_reward_weights", Map("algorithm.gdpo_reward_weights")),
    // trainer
    k("trainer.balance_batch", Ignore("jetrl's ranks split each batch by tokens (balanced) always")),
    k("trainer.total_epochs", Map("trainer.total_epochs")),
    k("trainer.total_training_steps", Map("trainer.total_training_steps")),
    k("trainer.project_name", Map("trainer.project_name")),
    k("trainer.experiment_name", Rule("trainer.experiment_name, run.name, and run.dir runs/<project_name>/<experiment_name> unless run.* is set")),
    k("trainer.logger", Map("trainer.logger")),
    k("trainer.log_val_generations", Map("trainer.log_val_generations")),
    k("trainer.rollout_data_dir", Convert("trainer.rollout_data_dir", Conv::Path)),
    k("trainer.validation_data_dir", Convert("trainer.validation_data_dir", Conv::Path)),
    k("trainer.nnodes", Map("trainer.nnodes")),
    k("trainer.n_gpus_per_node", Map("trainer.n_gpus_per_node")),
    k("trainer.save_freq", Map("trainer.save_freq")),
    k("trainer.esi_redundant_time", Ignore("verl's elastic-server instance expiry")),
    k("trainer.resume_mode", Map("trainer.resume_mode")),
    k("trainer.resume_from_path", Convert("trainer.resume_from_path", Conv::Path)),
    k("trainer.val_before_train", Map("trainer.val_before_train")),
    k("trainer.val_only", Map("trainer.val_only")),
    k("trainer.test_freq", Map("trainer.test_freq")),
    k("trainer.critic_warmup", Map("trainer.critic_warmup")),
    k("trainer.default_hdfs_dir", Only(&["null"], "copying checkpoints to HDFS is not built")),
    k("trainer.del_local_ckpt_after_load", Ignore("jetrl keeps its local checkpoints (trainer.max_actor_ckpt_to_keep prunes)")),
    k("trainer.default_local_dir", Convert("trainer.default_local_dir", Conv::Path)),
    k("trainer.max_actor_ckpt_to_keep", Map("trainer.max_actor_ckpt_to_keep")),
    k("trainer.max_critic_ckpt_to_keep", Map("trainer.max_critic_ckpt_to_keep")),
    k("trainer.ray_wait_register_center_timeout", Ignore(RAY)),
    k("trainer.device", Rule("cuda trains on the GPU in bf16 (model.device=cuda, model.dtype=bf16); cpu on the CPU in f32; npu is refused")),
    k("trainer.use_legacy_worker_impl", Ignore("verl's worker implementations")),
    k("trainer.use_v1", Only(&["true"], "jetrl runs verl V1's trainer modes (trainer.v1.trainer_mode)")),
    k("trainer.v1.trainer_mode", Map("trainer.mode")),
    k("trainer.v1.colocate_async.*", Rule("trainer.colocate_async.* (same keys), refused in another mode")),
    k("trainer.v1.separate_async.*", Rule("trainer.separate_async.* (same keys), refused in another mode")),
    k("trainer.v1.sampler.max_off_policy_threshold", Map("buffer.max_off_policy_threshold")),
    k("trainer.v1.sampler.max_off_policy_strategy", Map("buffer.max_off_policy_strategy")),
    k("trainer.v1.sampler.sync_refill_failed_groups", Map("buffer.sync_refill_failed_groups")),
    k("trainer.v1.sampler.custom_sampler.path", Only(&["null"], "custom Python samplers are not loaded")),
    k("trainer.v1.sampler.*", Ignore("custom Python samplers are not loaded")),
    // verl's fully-async recipe: rollout GPUs apart from the trainer's (jetrl run puts one worker on each)
    k("rollout.n_gpus_per_node", Map("rollout.workers")),
    k("rollout.nnodes", Ignore("jetrl run starts this host's rollout workers; other rollout hosts run their own (docs/deploy.md)")),
    k("global_profiler.*", Ignore(PROFILER)),
    k("ray_kwargs.*", Ignore(RAY)),
    k("ray_init.*", Ignore(RAY)),
    k("transfer_queue.*", Ignore("jetrl's data plane is NATS JetStream")),
    // jetrl's own sections
    k("nats.*", Jetrl),
    k("run.*", Jetrl),
    k("buffer.*", Jetrl),
    k("checkpoint.*", Jetrl),
    k("log.*", Jetrl),
    k("reward.*", Jetrl),
];

/// verl sections whose keys verl does not have pass through as jetrl's key of the same name in this section
/// (`actor_rollout_ref.rollout.workers` is `rollout.workers`); the typed load refuses what jetrl lacks too.
pub static SECTIONS: &[(&str, &str)] = &[
    ("actor_rollout_ref.model.", "model."),
    ("actor_rollout_ref.actor.", "actor."),
    ("actor_rollout_ref.rollout.", "rollout."),
    ("data.", "data."),
    ("algorithm.", "algorithm."),
    ("critic.", "critic."),
    ("trainer.", "trainer."),
];

/// The entry for a dotted verl path: an exact key first, then a key whose value is a mapping that holds it
/// (`critic.model.override_config` holds `critic.model.override_config.hidden_dropout`), then the longest
/// `prefix.*` that holds it.
pub fn lookup(path: &str) -> Option<&'static Key> {
    let below = |key: &&Key| path.strip_prefix(key.verl).is_some_and(|rest| rest.starts_with('.'));
    KEYS.iter().find(|key| key.verl == path).or_else(|| KEYS.iter().find(below)).or_else(|| {
        KEYS.iter()
            .filter(|key| {
                key.verl
                    .strip_suffix(".*")
                    .is_some_and(|prefix| path.strip_prefix(prefix).is_some_and(|rest| rest.starts_with('.')))
            })
            .max_by_key(|key| key.verl.len())
    })
}

/// A value as the table and the refusals write it (`null`, `true`, `fsdp`, `{}`).
pub fn spelling(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        Value::Null => "null".into(),
        Value::Object(map) if map.is_empty() => "{}".into(),
        other => other.to_string(),
    }
}

/// The table of docs/configuration.md: one row per entry.
pub fn table_markdown() -> String {
    let mut out = String::from("| verl key | fate | jetrl key, or why |\n|---|---|---|\n");
    for key in KEYS {
        let (fate, what) = match key.fate {
            Map(to) => ("mapped".to_string(), format!("`{to}`")),
            MapSet(to) => ("mapped when set".to_string(), format!("`{to}` (verl's default is not applied)")),
            Convert(to, conv) => {
                let how = match conv {
                    Conv::FileList => "a path or a list of paths, `~` expanded",
                    Conv::Path => "`~` expanded",
                    Conv::NegativeIsNull => "-1 = unset",
                };
                ("mapped".to_string(), format!("`{to}` ({how})"))
            }
            Only(values, why) => {
                let allowed: Vec<String> = values.iter().map(|v| format!("`{v}`")).collect();
                (format!("refused unless {}", allowed.join(" or ")), why.to_string())
            }
            Ignore(why) => ("ignored".to_string(), why.to_string()),
            Rule(what) => ("rule".to_string(), what.to_string()),
            Jetrl => ("jetrl's".to_string(), "jetrl's own section, as in a jetrl job file".to_string()),
        };
        out.push_str(&format!("| `{}` | {fate} | {what} |\n", key.verl));
    }
    out
}
