//! `jetrl export --merge`: a base model with a LoRA adapter folded into its weights, written as an HF model
//! directory (config, safetensors, the base's tokenizer files).

use std::path::{Path, PathBuf};

use jetrl_model::{CausalLm, DType, ModelError};
use tch::Device;

#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("the base model {dir}: {source}")]
    Base {
        dir: PathBuf,
        #[source]
        source: ModelError,
    },
    #[error("the adapter {dir}: {source}")]
    Adapter {
        dir: PathBuf,
        #[source]
        source: ModelError,
    },
    #[error("writing {dir}: {source}")]
    Write {
        dir: PathBuf,
        #[source]
        source: ModelError,
    },
}

impl ExportError {
    /// A stable, low-cardinality label for metrics and logs: the stage that failed.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Base { .. } => "base",
            Self::Adapter { .. } => "adapter",
            Self::Write { .. } => "write",
        }
    }
}

/// The dtype a model directory's `config.json` names (`torch_dtype`, or `dtype` in newer transformers), when it is
/// one jetrl loads; f32 otherwise.
fn own_dtype(model_dir: &Path) -> DType {
    let text = std::fs::read_to_string(model_dir.join(jetrl_model::CONFIG_FILE)).unwrap_or_default();
    let value: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
    ["torch_dtype", "dtype"]
        .iter()
        .find_map(|k| value.get(*k).and_then(|v| v.as_str()).and_then(|s| s.parse().ok()))
        .unwrap_or(DType::F32)
}

/// Loads `model` in f32, applies the adapter at `lora`, folds it in (`W += scale · B A` in f32), and writes the
/// result in `dtype` (the base's own by default) to `out` with the base's tokenizer files. Returns a line for the
/// user.
pub fn merge(model: &Path, lora: &Path, out: &Path, dtype: Option<DType>) -> Result<String, ExportError> {
    let base = |source| ExportError::Base { dir: model.to_path_buf(), source };
    let dtype = dtype.unwrap_or_else(|| own_dtype(model));
    let mut lm = CausalLm::load(model, Device::Cpu, DType::F32).map_err(base)?;
    let adapter = lm.load_lora(lora).map_err(|source| ExportError::Adapter { dir: lora.to_path_buf(), source })?;
    lm.merge_lora().map_err(|source| ExportError::Adapter { dir: lora.to_path_buf(), source })?;
    let write = |source| ExportError::Write { dir: out.to_path_buf(), source };
    lm.save_as(out, dtype).map_err(write)?;
    jetrl_model::copy_side_files(model, out).map_err(write)?;
    Ok(format!(
        "merged the rank-{} adapter {} into {} and wrote {} ({dtype:?})",
        adapter.spec.rank,
        lora.display(),
        model.display(),
        out.display()
    ))
}
