//! Weight distribution and checkpoint-sync (`checkpoint.*`).

use serde::{Deserialize, Serialize};

use crate::WeightTransportKind;

/// Weight distribution (checkpoint-sync). Durable checkpoints are the trainer's (`trainer.save_freq`,
/// `trainer.default_local_dir`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointConfig {
    pub metrics_addr: String,
    pub transport: WeightTransportKind,
    pub shared_dir: Option<String>,
    /// weight versions kept in the store (older blobs are deleted)
    pub keep_versions: u32,
    /// object-store chunk size
    pub chunk_bytes: u32,
    /// tokio worker threads; null = one per core (`jetrl run` passes 2)
    pub tokio_threads: Option<u32>,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        Self {
            metrics_addr: "127.0.0.1:0".into(),
            transport: WeightTransportKind::ObjectStore,
            shared_dir: None,
            keep_versions: 2,
            chunk_bytes: 8 << 20,
            tokio_threads: None,
        }
    }
}
