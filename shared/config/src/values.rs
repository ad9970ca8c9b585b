//! One file: every enumerated value of the configuration, each listed once, so the allowed values are seen together.
//!
//! The allowed values of every enumerated configuration key, each listed once.
//!
//! A key whose value is one of a fixed set of names is a Rust enum here: the YAML spelling of each variant is
//! written once (with verl's aliases), deserialising an unknown name fails with the key's path and the allowed
//! names (`config key `trainer.mode`: unknown variant `asyn`, expected one of `sync`, `colocate_async`, ...`), and
//! code downstream matches on variants instead of comparing strings. Crates that own the behaviour of a value
//! (the RL math, the engine, the dataset) use these types directly.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A name that is not one of a key's allowed values.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {what} {value:?}; expected one of: {expected}")]
pub struct UnknownValue {
    /// what kind of value was expected (`trainer.mode`, `loss aggregation`, ...)
    pub what: &'static str,
    pub value: String,
    /// the allowed spellings, comma separated
    pub expected: String,
}

/// Declares a configuration enum: variants with their YAML spelling (and aliases), `ALL`, `as_str`, `Display`,
/// `FromStr` (naming the allowed values) and serde through the same spellings. With `accept = f`, deserialising
/// (loading a config) also passes each value through `f(value) -> Result<(), String>`, which may refuse a known
/// name with its reason.
macro_rules! config_enum {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident ($what:literal $(, accept = $accept:path)?) {
            $( $(#[$vmeta:meta])* $variant:ident = $text:literal $(| $alias:literal)* ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        $vis enum $name {
            $( $(#[$vmeta])* $variant ),+
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The canonical spelling (what a job file and `job.yaml` say).
            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text),+
                }
            }

            /// The allowed spellings, comma separated (for error messages).
            pub fn expected() -> String {
                let names: &[&[&str]] = &[$(&[$text $(, $alias)*]),+];
                names.iter().flat_map(|n| n.iter()).copied().collect::<Vec<_>>().join(", ")
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $name {
            type Err = UnknownValue;

            fn from_str(s: &str) -> Result<Self, Self::Err> {
                match s {
                    $($text $(| $alias)* => Ok($name::$variant),)+
                    other => Err(UnknownValue { what: $what, value: other.to_string(), expected: Self::expected() }),
                }
            }
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.serialize_str(self.as_str())
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                let text = String::deserialize(deserializer)?;
                let value: $name = text.parse().map_err(|e: UnknownValue| serde::de::Error::custom(e.to_string()))?;
                $( $accept(value).map_err(serde::de::Error::custom)?; )?
                Ok(value)
            }
        }
    };
}

config_enum! {
    /// `trainer.mode`: the schedule of rollout and training (verl V1's three trainers).
    pub enum TrainerMode ("trainer.mode") {
        /// submit a batch, wait for all of it, train, publish weights: strictly on-policy
        Sync = "sync",
        /// one device shared by the trainer and one rollout worker; rollout pauses while the trainer updates
        ColocateAsync = "colocate_async",
        /// trainer and rollout workers on their own devices; rollout never stops except to swap weights
        SeparateAsync = "separate_async",
    }
}

impl TrainerMode {
    pub fn is_async(self) -> bool {
        self != TrainerMode::Sync
    }
}

config_enum! {
    /// `buffer.max_off_policy_strategy`.
    pub enum OffPolicyStrategy ("buffer.max_off_policy_strategy") {
        /// evict finished groups with span > threshold and refill as many
        Drop = "drop",
        /// never evict; hold sampling while an in-flight group has span >= threshold
        Wait = "wait",
    }
}

config_enum! {
    /// `checkpoint.transport`: where weight blobs go between the trainer and rollout workers.
    pub enum WeightTransportKind ("checkpoint.transport") {
        /// the JetStream object store (works across hosts)
        ObjectStore = "object_store",
        /// a file in `checkpoint.shared_dir`, a directory every reader mounts (same node or a shared filesystem)
        SharedFs = "shared_fs",
    }
}

config_enum! {
    /// `trainer.resume_mode`.
    pub enum ResumeMode ("trainer.resume_mode") {
        /// the latest checkpoint under `default_local_dir`, if any
        Auto = "auto",
        /// exactly `trainer.resume_from_path`
        ResumePath = "resume_path" | "path",
        /// start fresh
        Disable = "disable",
    }
}

config_enum! {
    /// `model.dtype`: the precision weights are held and shipped in.
    pub enum ModelDtype ("model.dtype") {
        F32 = "f32" | "float32" | "fp32",
        Bf16 = "bf16" | "bfloat16",
    }
}

impl ModelDtype {
    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            ModelDtype::F32 => 4,
            ModelDtype::Bf16 => 2,
        }
    }
}

config_enum! {
    /// `data.truncation`: what happens to a prompt over `data.max_prompt_length`.
    pub enum Truncation ("data.truncation") {
        /// refuse the row
        Error = "error",
        /// keep the last `max` tokens
        Left = "left",
        /// keep the first `max` tokens
        Right = "right",
        /// keep the first `max/2` and the last `max - max/2`
        Middle = "middle",
    }
}

config_enum! {
    /// `rollout.multi_turn.tool_response_truncate_side`.
    pub enum TruncateSide ("rollout.multi_turn.tool_response_truncate_side") {
        /// keep the start
        Left = "left",
        /// keep the end
        Right = "right",
        /// keep both ends
        Middle = "middle",
    }
}

config_enum! {
    /// `data.task.name`: the built-in synthetic tasks (digit strings).
    pub enum TaskName ("data.task.name") {
        Reverse = "reverse",
        Sort = "sort",
        Copy = "copy",
        /// `37*58=` → `2146`: the calculator tool's task (the answer is scored on the response's last line)
        Multiply = "multiply",
    }
}

config_enum! {
    /// How token losses become one scalar (verl `loss_agg_mode`).
    #[derive(Default)]
    pub enum AggMode ("loss_agg_mode") {
        /// `Σ L·m / batch_num_tokens` (verl's default).
        #[default]
        TokenMean = "token-mean",
        /// `Σ L·m`.
        TokenSum = "token-sum",
        /// mean over sequences of the per-sequence token sum.
        SeqMeanTokenSum = "seq-mean-token-sum",
        /// as `SeqMeanTokenSum`, divided by `loss_scale_factor` (default: the padded response length), Dr.GRPO.
        SeqMeanTokenSumNorm = "seq-mean-token-sum-norm",
        /// mean over sequences of the per-sequence token mean.
        SeqMeanTokenMean = "seq-mean-token-mean",
    }
}

config_enum! {
    /// verl's advantage estimators (`algorithm.adv_estimator`).
    pub enum AdvantageEstimator ("advantage estimator") {
        Gae = "gae",
        Grpo = "grpo",
        GrpoVectorized = "grpo_vectorized",
        GrpoPassk = "grpo_passk",
        Rloo = "rloo",
        RlooVectorized = "rloo_vectorized",
        Opo = "opo",
        ReinforcePlusPlus = "reinforce_plus_plus",
        ReinforcePlusPlusBaseline = "reinforce_plus_plus_baseline",
        Remax = "remax",
        Gpg = "gpg",
        Gdpo = "gdpo",
        OptimalTokenBaseline = "optimal_token_baseline",
        TirOptimalTokenBaseline = "tir_optimal_token_baseline",
    }
}

impl AdvantageEstimator {
    /// Whether the estimator needs a critic's values (verl's `need_critic` default).
    pub fn needs_critic(self) -> bool {
        self == Self::Gae
    }

    /// Whether rows are compared within their uid group (so `index` is required).
    pub fn needs_groups(self) -> bool {
        !matches!(self, Self::Gae | Self::ReinforcePlusPlus | Self::Remax)
    }

    /// Whether the estimator reads Σπ² per token (`actor.calculate_sum_pi_squared` is forced on).
    pub fn needs_sum_pi_squared(self) -> bool {
        matches!(self, Self::OptimalTokenBaseline | Self::TirOptimalTokenBaseline)
    }
}

config_enum! {
    /// verl's `actor.policy_loss.loss_mode`.
    #[derive(Default)]
    pub enum PolicyLossMode ("policy loss mode") {
        /// PPO clip with dual clip for negative advantages.
        #[default]
        Vanilla = "vanilla",
        /// Sequence-level ratio (GSPO); always aggregated `seq-mean-token-mean`.
        Gspo = "gspo",
        /// Soft sigmoid gate instead of a clip (SAPO); always aggregated `seq-mean-token-mean`.
        Sapo = "sapo",
        /// `−log π·A` (GPG).
        Gpg = "gpg",
        /// PPO clip with a random few high-covariance tokens detached (Clip-Cov).
        ClipCov = "clip_cov",
        /// `−Aρ` plus `|Δ|` on the top-covariance tokens (KL-Cov).
        KlCov = "kl_cov",
        /// Geometric-mean ratio per sequence (GMPO).
        GeoMean = "geo_mean",
        /// Clipped, detached IS weight on `−A·log π` (CISPO).
        Cispo = "cispo",
        /// Divergence-masked policy gradient with the binary total variation (DPPO-TV).
        DppoTv = "dppo_tv",
        /// Divergence-masked policy gradient with the binary KL (DPPO-KL).
        DppoKl = "dppo_kl",
        /// `−(log π·A − ½β·Δ²)` (DRO).
        Dro = "dro",
        /// Old = rollout log-probs; PPO clip or REINFORCE with rollout correction.
        BypassMode = "bypass_mode",
    }
}

config_enum! {
    /// The estimator of KL(π‖π_ref) per token, from Δ = log π − log π_ref (Schulman's k1/k2/k3).
    pub enum KlEstimator ("kl estimator") {
        /// `kl` / `k1`: Δ.
        K1 = "k1" | "kl",
        /// `abs`: |Δ|.
        Abs = "abs",
        /// `mse` / `k2`: ½Δ².
        K2 = "k2" | "mse",
        /// `low_var_kl` / `k3`: `exp(x) − x − 1` with `x = clamp(−Δ, ±20)`, the result clamped to [−10, 10].
        K3 = "k3" | "low_var_kl",
    }
}

/// A KL type as written in the config (`algorithm.kl_penalty`, `actor.kl_loss_type`): an estimator, optionally
/// with verl's `+` suffix (straight-through: the value of the estimator with the gradient of k2, which is the
/// unbiased KL gradient).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KlPenalty {
    pub estimator: KlEstimator,
    pub straight_through: bool,
}

impl KlPenalty {
    pub const fn new(estimator: KlEstimator) -> Self {
        Self { estimator, straight_through: false }
    }
}

impl FromStr for KlPenalty {
    type Err = UnknownValue;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (base, straight_through) = match s.strip_suffix('+') {
            Some(base) => (base, true),
            None => (s, false),
        };
        let estimator: KlEstimator = base.parse().map_err(|_| UnknownValue {
            what: "kl penalty",
            value: s.to_string(),
            expected: format!(
                "{}, each optionally with a `+` suffix (`full` is not implemented, as in verl)",
                KlEstimator::expected()
            ),
        })?;
        // k2's gradient is already the one the `+` forms borrow.
        let straight_through = straight_through && estimator != KlEstimator::K2;
        Ok(Self { estimator, straight_through })
    }
}

impl fmt::Display for KlPenalty {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.estimator, if self.straight_through { "+" } else { "" })
    }
}

impl Serialize for KlPenalty {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for KlPenalty {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(|e: UnknownValue| serde::de::Error::custom(e.to_string()))
    }
}

config_enum! {
    /// `algorithm.kl_ctrl.type`.
    pub enum KlCtrlType ("algorithm.kl_ctrl.type") {
        Fixed = "fixed",
        Adaptive = "adaptive",
    }
}

config_enum! {
    /// `algorithm.pf_ppo.reweight_method`.
    pub enum PfPpoMethod ("algorithm.pf_ppo.reweight_method") {
        /// `|score|^weight_pow`
        Pow = "pow",
        /// 1 for the batch's best and worst scores, 0 otherwise
        MaxMin = "max_min",
        /// 0.4 for the best score, 0.1 otherwise
        MaxRandom = "max_random",
    }
}

config_enum! {
    /// `algorithm.rollout_correction.rollout_is`: the level of the importance weights.
    pub enum RolloutIsLevel ("algorithm.rollout_correction.rollout_is") {
        Token = "token",
        Sequence = "sequence",
    }
}

config_enum! {
    /// `algorithm.rollout_correction.loss_type`: the loss of bypass mode.
    #[derive(Default)]
    pub enum BypassLossType ("algorithm.rollout_correction.loss_type") {
        /// PPO clip on π_θ/π_rollout; the ratio already corrects, so no IS weights are applied
        #[default]
        PpoClip = "ppo_clip",
        /// `−A·log π·w_IS`
        Reinforce = "reinforce",
    }
}

config_enum! {
    /// `actor.optim.lr_scheduler_type`.
    pub enum LrSchedulerType ("optim.lr_scheduler_type") {
        Constant = "constant",
        Cosine = "cosine",
    }
}

config_enum! {
    /// `rollout.logprobs_mode`: which log-prob is recorded per sampled token.
    #[derive(Default)]
    pub enum LogprobsMode ("rollout.logprobs_mode") {
        /// under the distribution sampled from: after repetition penalty, temperature, top-k and top-p
        #[default]
        Processed = "processed_logprobs",
        /// `log_softmax` of the model's logits, before any processing
        Raw = "raw_logprobs",
    }
}

config_enum! {
    /// `rollout.name`: which inference engine a rollout worker drives.
    #[derive(Default)]
    pub enum RolloutName ("rollout.name", accept = RolloutName::accept) {
        /// jetrl's engine, in the worker's process (tch): the CPU path, exact log-probs, the demo
        #[default]
        Jetrl = "jetrl",
        /// a `vllm serve` the worker starts and supervises (or the one `rollout.vllm.url` names)
        Vllm = "vllm",
        /// refused: no SGLang backend is built
        Sglang = "sglang",
    }
}

impl RolloutName {
    fn accept(self) -> Result<(), String> {
        match self {
            RolloutName::Sglang => {
                Err("`sglang` is not supported: no SGLang backend is built; the engines are jetrl and vllm".into())
            }
            _ => Ok(()),
        }
    }
}

config_enum! {
    /// `rollout.vllm.update_mode`: what happens to requests in flight when a new weight version reaches vLLM.
    #[derive(Default)]
    pub enum VllmUpdateMode ("rollout.vllm.update_mode") {
        /// abort them, load, and continue each from the tokens it had (partial rollout, as jetrl's engine does):
        /// every token's version is exact
        #[default]
        Abort = "abort",
        /// keep them in vLLM across the update (`/pause?mode=keep`, as PipelineRL): they continue under the new
        /// weights; a trajectory's versions are the span from its first to its last token
        Keep = "keep",
    }
}

config_enum! {
    /// `rollout.agent.default_agent_loop` (and a row's `agent_name`).
    pub enum AgentLoop ("agent loop") {
        /// one generation per session
        SingleTurn = "single_turn_agent" | "single_turn",
        /// verl's ReAct loop with tool calls
        Tool = "tool_agent" | "tool",
    }
}

config_enum! {
    /// `rollout.multi_turn.format`: the tool-call syntax the model writes.
    pub enum ToolCallFormat ("rollout.multi_turn.format") {
        /// `<tool_call>{json}</tool_call>`
        Hermes = "hermes",
    }
}

config_enum! {
    /// `rollout.multi_turn.tools`: the built-in tools.
    pub enum ToolName ("rollout.multi_turn.tools") {
        Calculator = "calculator",
        Python = "python",
    }
}

config_enum! {
    /// `trainer.logger`: verl's logger backends. jetrl writes `console`, `jsonl`, `tensorboard`, `file` (verl's
    /// JSONL file logger), `mlflow` (MLflow's REST API) and `wandb` (the `wandb` Python package in a subprocess);
    /// a config naming one of the others is refused at load with the reason ([`Logger::unsupported_reason`]).
    pub enum Logger ("trainer.logger", accept = Logger::accept) {
        Console = "console",
        Jsonl = "jsonl",
        Tensorboard = "tensorboard",
        Wandb = "wandb",
        Swanlab = "swanlab",
        Mlflow = "mlflow",
        VemlpWandb = "vemlp_wandb",
        Clearml = "clearml",
        Trackio = "trackio",
        File = "file",
    }
}

impl Logger {
    /// Why jetrl does not write this backend; `None` for those it writes.
    pub fn unsupported_reason(self) -> Option<&'static str> {
        match self {
            Logger::Console | Logger::Jsonl | Logger::Tensorboard | Logger::File | Logger::Mlflow | Logger::Wandb => {
                None
            }
            Logger::Swanlab => Some("jetrl has no SwanLab bridge"),
            Logger::VemlpWandb => Some("jetrl has no bridge to the Volcengine ML platform's wandb"),
            Logger::Clearml => Some("jetrl has no ClearML bridge"),
            Logger::Trackio => Some("jetrl has no Trackio bridge"),
        }
    }

    /// Whether jetrl writes this backend (a config naming any other is refused at load).
    pub fn is_supported(self) -> bool {
        self.unsupported_reason().is_none()
    }

    /// Refuses, at config load, a backend jetrl does not write, with the reason and what it writes instead.
    fn accept(self) -> Result<(), String> {
        match self.unsupported_reason() {
            None => Ok(()),
            Some(reason) => {
                let written: Vec<&str> = Logger::ALL.iter().filter(|l| l.is_supported()).map(|l| l.as_str()).collect();
                Err(format!("`{self}` is not supported: {reason}; jetrl writes {}", written.join(", ")))
            }
        }
    }
}

config_enum! {
    /// `log.format`.
    pub enum LogFormat ("log.format") {
        Text = "text",
        Json = "json",
    }
}

config_enum! {
    /// `model.init_preset`: the random-init models `jetrl run` can create.
    pub enum ModelPreset ("model.init_preset") {
        /// a 2-layer Qwen2-architecture model with a character vocabulary
        Tiny = "tiny",
        /// the same with a digits-only vocabulary (the demo)
        TinyDigits = "tiny-digits",
        /// `tiny-digits` with a trained model's output scale (final norm weight 4): the base of the LoRA demo,
        /// which cannot train the final norm
        TinyDigitsLora = "tiny-digits-lora",
        /// a 2-layer Qwen3-MoE model (8 experts, 2 per token) with the digits vocabulary (the MoE demo)
        TinyDigitsMoe = "tiny-digits-moe",
        /// `tiny-digits` with `*` and two added tokens that write a Hermes calculator call (the tool demo)
        TinyTools = "tiny-tools",
    }
}

/// `model.device`: `cpu`, `cuda` (device 0), `cuda:N`, or `auto` (CUDA device 0 when libtorch sees one, else
/// the CPU).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum DeviceSpec {
    #[default]
    Cpu,
    Cuda(usize),
    Auto,
}

impl FromStr for DeviceSpec {
    type Err = UnknownValue;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || UnknownValue {
            what: "model.device",
            value: s.to_string(),
            expected: "cpu, cuda, cuda:N (N a device index), auto".into(),
        };
        match s.trim() {
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" => Ok(DeviceSpec::Cuda(0)),
            "auto" => Ok(DeviceSpec::Auto),
            other => other.strip_prefix("cuda:").and_then(|i| i.parse().ok()).map(DeviceSpec::Cuda).ok_or_else(bad),
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Cpu => f.write_str("cpu"),
            DeviceSpec::Cuda(i) => write!(f, "cuda:{i}"),
            DeviceSpec::Auto => f.write_str("auto"),
        }
    }
}

impl Serialize for DeviceSpec {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for DeviceSpec {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(|e: UnknownValue| serde::de::Error::custom(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_spelling_round_trips_and_aliases_parse_to_the_canonical_value() {
        for mode in TrainerMode::ALL {
            assert_eq!(mode.as_str().parse::<TrainerMode>().unwrap(), *mode);
        }
        assert_eq!("path".parse::<ResumeMode>().unwrap(), ResumeMode::ResumePath);
        assert_eq!("low_var_kl".parse::<KlEstimator>().unwrap(), KlEstimator::K3);
        let st: KlPenalty = "k3+".parse().unwrap();
        assert!(st.straight_through);
        assert_eq!(st.to_string(), "k3+");
        assert!(!"mse+".parse::<KlPenalty>().unwrap().straight_through, "k2's + is a no-op");
        assert_eq!("cuda:3".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cuda(3));
        assert_eq!("cuda".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cuda(0));
    }

    #[test]
    fn an_unknown_value_names_what_was_expected() {
        let err = "asyn".parse::<TrainerMode>().unwrap_err().to_string();
        assert!(err.contains("asyn") && err.contains("colocate_async") && err.contains("separate_async"), "{err}");
        let err = "k4+".parse::<KlPenalty>().unwrap_err().to_string();
        assert!(err.contains("k4+") && err.contains("low_var_kl"), "{err}");
        let err = "tpu:0".parse::<DeviceSpec>().unwrap_err().to_string();
        assert!(err.contains("tpu:0") && err.contains("cuda:N"), "{err}");
    }

    #[test]
    fn loggers_jetrl_does_not_write_are_refused_when_deserialised_with_the_reason() {
        let ok: Vec<Logger> = serde_json::from_str(r#"["console", "file", "mlflow", "wandb"]"#).unwrap();
        assert_eq!(ok, [Logger::Console, Logger::File, Logger::Mlflow, Logger::Wandb]);
        for name in ["swanlab", "vemlp_wandb", "clearml", "trackio"] {
            let err = serde_json::from_str::<Logger>(&format!("{name:?}")).unwrap_err().to_string();
            assert!(err.contains(name) && err.contains("not supported") && err.contains("mlflow"), "{err}");
            assert!(!name.parse::<Logger>().unwrap().is_supported());
        }
    }

    #[test]
    fn serde_uses_the_same_spellings() {
        let mode: TrainerMode = serde_json::from_value(serde_json::json!("separate_async")).unwrap();
        assert_eq!(mode, TrainerMode::SeparateAsync);
        assert_eq!(serde_json::to_value(ResumeMode::ResumePath).unwrap(), serde_json::json!("resume_path"));
        let err = serde_json::from_value::<AggMode>(serde_json::json!("mean")).unwrap_err().to_string();
        assert!(err.contains("token-mean"), "{err}");
    }
}
