//! `reward.*`: the reward service and its scorers (verl's `reward.*` keys where verl has them).

use serde::{Deserialize, Serialize};

/// The reward service: how it runs and how it scores.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RewardConfig {
    /// how many reward-service processes `jetrl run` starts
    pub workers: u32,
    pub instance_id: Option<String>,
    pub metrics_addr: String,
    /// trajectories pulled and scored concurrently
    pub max_inflight: u32,
    pub ack_wait_s: f64,
}

impl Default for RewardConfig {
    fn default() -> Self {
        Self { workers: 1, instance_id: None, metrics_addr: "127.0.0.1:0".into(), max_inflight: 256, ack_wait_s: 30.0 }
    }
}
