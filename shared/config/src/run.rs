//! The run as a whole (`run.*`) and how `jetrl run` supervises its services (`run.supervisor.*`).

use serde::{Deserialize, Serialize};

use crate::{ensure, ConfigError};

/// Where a run writes its outputs.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunConfig {
    pub name: String,
    /// run directory: metrics.jsonl, reward curve, checkpoints, logs
    pub dir: String,
    pub seed: u64,
    /// how `jetrl run` restarts a service that exits abnormally
    pub supervisor: SupervisorConfig,
}

impl Default for RunConfig {
    fn default() -> Self {
        Self { name: "jetrl".into(), dir: "runs/jetrl".into(), seed: 42, supervisor: SupervisorConfig::default() }
    }
}

/// `jetrl run`'s restart policy, after systemd's `Restart=on-failure` with `StartLimitBurst`: a service that
/// exits non-zero or is killed by a signal is started again after a delay that doubles per consecutive failure;
/// a service that needs more than `max_restarts` restarts within `restart_window_s` is crash-looping and ends
/// the job.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SupervisorConfig {
    /// delay before the first restart after a failure
    pub restart_delay_s: f64,
    /// the doubling delay stops growing here
    pub max_restart_delay_s: f64,
    /// a service that ran at least this long before failing starts again from `restart_delay_s`
    pub healthy_after_s: f64,
    /// restarts allowed within `restart_window_s`; one more failure in the window ends the job (0 = any
    /// abnormal exit ends it)
    pub max_restarts: u32,
    pub restart_window_s: f64,
    /// a running service whose heartbeat has not come for this long while NATS was reachable is hung (stopped,
    /// deadlocked): it is killed and restarted like one that crashed (0 = never). Judged only after its first
    /// heartbeat, so a long start-up (a model load) is not taken for a hang
    pub hang_after_s: f64,
}

impl Default for SupervisorConfig {
    fn default() -> Self {
        Self {
            restart_delay_s: 1.0,
            max_restart_delay_s: 30.0,
            healthy_after_s: 60.0,
            max_restarts: 5,
            restart_window_s: 120.0,
            hang_after_s: 120.0,
        }
    }
}

impl SupervisorConfig {
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        let positive = |v: f64| v > 0.0 && v.is_finite();
        ensure(positive(self.restart_delay_s), "run.supervisor.restart_delay_s", "must be > 0")?;
        ensure(
            positive(self.max_restart_delay_s) && self.max_restart_delay_s >= self.restart_delay_s,
            "run.supervisor.max_restart_delay_s",
            format!("must be >= run.supervisor.restart_delay_s ({})", self.restart_delay_s),
        )?;
        ensure(
            self.healthy_after_s >= 0.0 && self.healthy_after_s.is_finite(),
            "run.supervisor.healthy_after_s",
            "must be >= 0",
        )?;
        ensure(positive(self.restart_window_s), "run.supervisor.restart_window_s", "must be > 0")?;
        ensure(
            self.hang_after_s >= 0.0 && self.hang_after_s.is_finite(),
            "run.supervisor.hang_after_s",
            "must be >= 0 (0 = never)",
        )
    }
}

/// A thread count key: null picks a default, an explicit value must be at least 1.
pub(crate) fn ensure_threads(value: Option<u32>, path: &str) -> Result<(), ConfigError> {
    ensure(value != Some(0), path, "must be >= 1 (null = the default)")
}
