//! The rollout workers (`rollout.*`): sampling, the engine's budget, multi-turn agents and tools.

use serde::{Deserialize, Serialize};

use crate::{AgentLoop, EngineKwargs, LogprobsMode, RolloutName, ToolCallFormat, ToolName, TruncateSide, VllmConfig};

/// verl's `rollout.val_kwargs.*`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ValKwargs {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: i32,
    pub n: u32,
}

impl Default for ValKwargs {
    fn default() -> Self {
        Self { temperature: 0.0, top_p: 1.0, top_k: -1, n: 1 }
    }
}

/// verl's `rollout.*` plus the rollout-worker service settings.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RolloutConfig {
    /// the inference engine (verl's key): `jetrl` (in the worker's process) or `vllm` (a `vllm serve`)
    pub name: RolloutName,
    pub n: u32,
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: i32,
    pub repetition_penalty: f32,
    /// default: data.max_response_length
    pub max_new_tokens: Option<u32>,
    pub val_kwargs: ValKwargs,
    /// sequences decoded together (the engine's batch budget)
    pub max_num_seqs: u32,
    /// prompt groups a worker holds at once (pulled but not yet acknowledged)
    pub max_inflight_groups: u32,
    /// how many worker processes `jetrl run` starts
    pub workers: u32,
    /// this instance's name in heartbeats; default: hostname-pid
    pub instance_id: Option<String>,
    pub metrics_addr: String,
    pub heartbeat_interval_s: f64,
    /// a worker whose last heartbeat is older than this counts as gone (left out of weight-sync waits; its
    /// in-flight groups are redelivered after `ack_wait_s`); at least 3 × `heartbeat_interval_s`
    pub heartbeat_timeout_s: f64,
    /// redelivery delay of a task whose worker went silent (in-progress acks keep long groups alive)
    pub ack_wait_s: f64,
    /// positions per sequence in the engine's KV cache (context + response); default
    /// data.max_prompt_length + the response budget (multi-turn tool output counts towards it)
    pub max_model_len: Option<u32>,
    /// token positions in the preallocated KV cache, over all sequences; the engine runs
    /// min(max_num_seqs, kv_cache_tokens / max_model_len) sequences at once. Default: max_num_seqs rows,
    /// capped by kv_cache_memory_gb
    pub kv_cache_tokens: Option<u64>,
    /// memory cap of the default KV budget (ignored when kv_cache_tokens is set)
    pub kv_cache_memory_gb: f64,
    /// decode eagerly on CUDA instead of replaying one CUDA graph per batch bucket (vLLM's and verl's
    /// `enforce_eager`; graphs take a little memory and a capture per new shape). The CPU is always eager.
    pub enforce_eager: bool,
    /// verl's `enable_rollout_routing_replay`: the rollout returns the experts each token of an MoE policy was
    /// routed to, and the trajectories carry them (what `actor.router_replay.mode: R3` replays)
    pub enable_rollout_routing_replay: bool,
    /// sampling seed of the worker's engine (requests without their own seed); default run.seed mixed with the
    /// instance id, so workers draw different streams
    pub seed: Option<u64>,
    pub logprobs_mode: LogprobsMode,
    pub multi_turn: MultiTurnConfig,
    pub agent: AgentConfig,
    /// torch intra-op threads; null = `OMP_NUM_THREADS` if set, else every core this process may use
    /// (`jetrl run` passes an even share of the host's cores between the trainer and its rollout workers)
    pub torch_threads: Option<u32>,
    /// torch inter-op threads; null = 1 on the CPU (jetrl runs no parallel graph), torch's default on CUDA
    pub torch_interop_threads: Option<u32>,
    /// tokio worker threads; null = one per core (`jetrl run` passes 2)
    pub tokio_threads: Option<u32>,
    /// vLLM: the fraction of each device's memory for weights, activations and KV cache (verl's key)
    pub gpu_memory_utilization: f64,
    /// vLLM: devices one server spans with tensor parallelism (the worker's visible devices, this many)
    pub tensor_model_parallel_size: u32,
    /// vLLM: tokens one scheduler step processes at most; null = vLLM's default
    pub max_num_batched_tokens: Option<u32>,
    /// vLLM: prefill long prompts in chunks between decode steps
    pub enable_chunked_prefill: bool,
    /// vLLM: reuse the KV of shared prompt prefixes (a group's n samples share their prompt)
    pub enable_prefix_caching: bool,
    /// colocate_async: the engine releases its KV cache while the trainer steps (vLLM sleeps: weights and cache)
    pub free_cache_engine: bool,
    /// engine arguments passed through as they are (verl's `engine_kwargs.vllm.*`)
    pub engine_kwargs: EngineKwargs,
    /// how the worker reaches vLLM (`rollout.name: vllm`)
    pub vllm: VllmConfig,
}

impl RolloutConfig {
    /// How long a stopping worker lets its in-flight groups finish before it naks them: `ack_wait_s`, between
    /// 1 and 30 s (a supervisor's stop grace allows at least this much more than its own margin).
    pub fn drain(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.ack_wait_s.clamp(1.0, 30.0))
    }
}

impl Default for RolloutConfig {
    fn default() -> Self {
        Self {
            name: RolloutName::default(),
            n: 1,
            temperature: 1.0,
            top_p: 1.0,
            top_k: -1,
            repetition_penalty: 1.0,
            max_new_tokens: None,
            val_kwargs: ValKwargs::default(),
            max_num_seqs: 256,
            max_inflight_groups: 64,
            workers: 1,
            instance_id: None,
            metrics_addr: "127.0.0.1:0".into(),
            heartbeat_interval_s: 1.0,
            heartbeat_timeout_s: 10.0,
            ack_wait_s: 30.0,
            max_model_len: None,
            kv_cache_tokens: None,
            kv_cache_memory_gb: 4.0,
            enforce_eager: false,
            enable_rollout_routing_replay: false,
            seed: None,
            logprobs_mode: LogprobsMode::Processed,
            multi_turn: MultiTurnConfig::default(),
            agent: AgentConfig::default(),
            torch_threads: None,
            torch_interop_threads: None,
            tokio_threads: None,
            gpu_memory_utilization: 0.5,
            tensor_model_parallel_size: 1,
            max_num_batched_tokens: None,
            enable_chunked_prefill: true,
            enable_prefix_caching: true,
            free_cache_engine: true,
            engine_kwargs: EngineKwargs::default(),
            vllm: VllmConfig::default(),
        }
    }
}

/// verl's `rollout.multi_turn.*`: the tool agent loop (`tool_agent`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MultiTurnConfig {
    /// model turns per trajectory at most (none: until no tool call or the response budget)
    pub max_assistant_turns: Option<u32>,
    /// tool-response turns per trajectory at most
    pub max_user_turns: Option<u32>,
    /// tool calls of one turn run concurrently; calls beyond this are ignored
    pub max_parallel_calls: u32,
    /// characters of one tool response kept
    pub max_tool_response_length: u32,
    pub tool_response_truncate_side: TruncateSide,
    /// tool-call syntax the model writes
    pub format: ToolCallFormat,
    /// built-in tools offered to `tool_agent` rows; a row's `extra_info.tool_selection` narrows the list
    pub tools: Vec<ToolName>,
    /// seconds one tool call may take before it counts as failed (error text, reward 0)
    pub tool_timeout_s: f64,
    /// the python tool: interpreter, wall-clock limit, address-space limit, bytes of stdout+stderr kept
    pub python_bin: String,
    pub python_timeout_s: f64,
    pub python_memory_mb: u64,
    pub python_max_output_bytes: u64,
}

impl Default for MultiTurnConfig {
    fn default() -> Self {
        Self {
            max_assistant_turns: None,
            max_user_turns: None,
            max_parallel_calls: 1,
            max_tool_response_length: 256,
            tool_response_truncate_side: TruncateSide::Middle,
            format: ToolCallFormat::Hermes,
            tools: vec![ToolName::Calculator, ToolName::Python],
            tool_timeout_s: 30.0,
            python_bin: "python3".into(),
            python_timeout_s: 10.0,
            python_memory_mb: 512,
            python_max_output_bytes: 16 * 1024,
        }
    }
}

/// verl's `rollout.agent.*`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AgentConfig {
    /// the agent loop of rows without `agent_name`
    pub default_agent_loop: AgentLoop,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self { default_agent_loop: AgentLoop::SingleTurn }
    }
}
