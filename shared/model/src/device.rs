//! Device and dtype strings as they appear in service configs (`cpu`, `cuda:1`, `bf16`).

use std::fmt;
use std::str::FromStr;

use jetrl_config::{DeviceSpec, ModelDtype};
use tch::{Device, Kind};

use crate::error::{ModelError, Result};

/// Parses `cpu`, `cuda` (device 0) or `cuda:N` into a [`Device`], checking that the CUDA device exists so a
/// misconfigured service fails at start-up rather than on its first tensor.
pub fn parse_device(spec: &str) -> Result<Device> {
    let spec = spec.trim();
    if spec.eq_ignore_ascii_case("cpu") {
        return Ok(Device::Cpu);
    }
    let index = if spec.eq_ignore_ascii_case("cuda") {
        0
    } else if let Some(rest) = spec.strip_prefix("cuda:") {
        rest.parse::<usize>().map_err(|_| {
            ModelError::Device(format!("`{spec}`: the CUDA index after `cuda:` must be a non-negative integer"))
        })?
    } else {
        return Err(ModelError::Device(format!("`{spec}` is not a device: expected `cpu`, `cuda` or `cuda:N`")));
    };
    let visible = if tch::Cuda::is_available() { tch::Cuda::device_count() as usize } else { 0 };
    if index >= visible {
        return Err(ModelError::Device(format!(
            "`{spec}` requested but {visible} CUDA device(s) are visible to libtorch"
        )));
    }
    Ok(Device::Cuda(index))
}

/// The device of a configured [`DeviceSpec`] (`model.device`): `auto` is CUDA device 0 when libtorch sees one,
/// else the CPU; an explicit CUDA device must exist.
pub fn resolve_device(spec: DeviceSpec) -> Result<Device> {
    match spec {
        DeviceSpec::Cpu => Ok(Device::Cpu),
        DeviceSpec::Auto => Ok(if tch::Cuda::is_available() { Device::Cuda(0) } else { Device::Cpu }),
        DeviceSpec::Cuda(index) => parse_device(&format!("cuda:{index}")),
    }
}

/// The floating-point precision the parameters are held in.
///
/// Only the two precisions training and rollout use: f32 (reference, CPU) and bf16 (GPU).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum DType {
    #[default]
    F32,
    BF16,
}

impl DType {
    /// The libtorch kind of this dtype.
    pub fn kind(self) -> Kind {
        match self {
            DType::F32 => Kind::Float,
            DType::BF16 => Kind::BFloat16,
        }
    }

    /// The name HF writes in `config.json` (`dtype` / `torch_dtype`).
    pub fn hf_name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::BF16 => "bfloat16",
        }
    }

    /// The dtype of a libtorch kind, if it is one the model can hold.
    pub fn from_kind(kind: Kind) -> Option<DType> {
        match kind {
            Kind::Float => Some(DType::F32),
            Kind::BFloat16 => Some(DType::BF16),
            _ => None,
        }
    }
}

impl FromStr for DType {
    type Err = ModelError;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "f32" | "float32" | "float" | "fp32" => Ok(DType::F32),
            "bf16" | "bfloat16" => Ok(DType::BF16),
            other => Err(ModelError::Config(format!("dtype `{other}` is not supported: expected `f32` or `bf16`"))),
        }
    }
}

impl From<ModelDtype> for DType {
    fn from(dtype: ModelDtype) -> Self {
        match dtype {
            ModelDtype::F32 => DType::F32,
            ModelDtype::Bf16 => DType::BF16,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
        })
    }
}

/// Sets this process's torch intra-op and inter-op thread counts (each only when given) and logs what torch then
/// uses. Call it before any tensor work: torch fixes a thread's pool size on its first use.
pub fn set_torch_threads(intra_op: Option<usize>, inter_op: Option<usize>) {
    if let Some(n) = intra_op {
        tch::set_num_threads(i32::try_from(n).unwrap_or(i32::MAX));
    }
    if let Some(n) = inter_op {
        tch::set_num_interop_threads(i32::try_from(n).unwrap_or(i32::MAX));
    }
    tracing::info!(
        torch_threads = tch::get_num_threads(),
        torch_interop_threads = tch::get_num_interop_threads(),
        "torch threads"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_parses_and_garbage_is_rejected_with_the_input_named() {
        assert_eq!(parse_device("cpu").unwrap(), Device::Cpu);
        assert_eq!(parse_device(" CPU ").unwrap(), Device::Cpu);
        let err = parse_device("tpu:0").unwrap_err().to_string();
        assert!(err.contains("tpu:0"), "{err}");
        let err = parse_device("cuda:x").unwrap_err().to_string();
        assert!(err.contains("cuda:x"), "{err}");
    }

    #[test]
    fn cuda_index_beyond_visible_devices_is_an_error() {
        let err = parse_device("cuda:4096").unwrap_err().to_string();
        assert!(err.contains("cuda:4096") && err.contains("visible"), "{err}");
    }

    #[test]
    fn dtype_strings_parse_to_kinds() {
        assert_eq!("f32".parse::<DType>().unwrap().kind(), Kind::Float);
        assert_eq!("bfloat16".parse::<DType>().unwrap().kind(), Kind::BFloat16);
        assert!("f16".parse::<DType>().is_err());
        assert_eq!(DType::BF16.to_string(), "bf16");
    }
}
