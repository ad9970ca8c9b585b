//! Configuration for every jetrl service.
//!
//! One YAML file describes a whole job ([`JobConfig`]): each service reads the sections it needs. Values are
//! layered, later wins:
//!
//! 1. the YAML file,
//! 2. environment variables `JETRL__SECTION__KEY=value` (double underscores between path parts),
//! 3. command-line overrides `section.key=value` (the value is parsed as YAML: `3`, `1e-4`, `true`, `[1, 2]`).
//!
//! Unknown keys are rejected and every error names the key's path (`trainer.optim.lrr`), so a typo never
//! silently falls back to a default.

mod algo;
mod buffer;
mod checkpoint;
mod data;
mod job;
mod load;
mod log;
mod model;
mod nats;
mod reward;
mod rollout;
mod run;
mod trainer;
mod values;
pub mod verl;
mod vllm;

pub use algo::*;
pub use buffer::*;
pub use checkpoint::*;
pub use data::*;
pub use job::*;
pub use load::{from_value, load, load_value, section_overrides, ConfigError};
pub use log::*;
pub use model::*;
pub use nats::*;
pub use reward::*;
pub use rollout::*;
pub use run::*;
pub use trainer::*;
pub use values::*;
pub use verl::{load_verl, VerlJob};
pub use vllm::*;

/// Returns `Err(ConfigError::Invalid)` naming `path` unless `ok`.
pub fn ensure(ok: bool, path: &str, message: impl Into<String>) -> Result<(), ConfigError> {
    if ok {
        Ok(())
    } else {
        Err(ConfigError::Invalid { path: path.to_string(), message: message.into() })
    }
}
