//! The replay buffer (`buffer.*`): staleness and its strategy, re-reads.

use serde::{Deserialize, Serialize};

use crate::OffPolicyStrategy;

/// The replay buffer (verl `trainer.v1.sampler.*`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BufferConfig {
    pub metrics_addr: String,
    pub max_off_policy_threshold: u64,
    pub max_off_policy_strategy: OffPolicyStrategy,
    pub sync_refill_failed_groups: bool,
    /// seconds a sample request may wait, with nothing coming in, before the buffer reads the group records and
    /// rewards again from the stores (doubling up to 10×, while it finds nothing); 0 = never
    pub reread_after_s: f64,
    /// tokio worker threads; null = one per core (`jetrl run` passes 2)
    pub tokio_threads: Option<u32>,
}

impl Default for BufferConfig {
    fn default() -> Self {
        Self {
            metrics_addr: "127.0.0.1:0".into(),
            max_off_policy_threshold: 8,
            max_off_policy_strategy: OffPolicyStrategy::Drop,
            sync_refill_failed_groups: false,
            reread_after_s: 30.0,
            tokio_threads: None,
        }
    }
}
