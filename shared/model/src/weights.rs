//! safetensors in and out: memory-mapped checkpoint files (single or sharded), in-memory weight blobs for
//! rollout workers, and a streaming writer that never holds more than one converted tensor at a time.
//!
//! Every load validates the whole set (names, shapes, dtypes) before the first copy, so a bad file or blob
//! leaves the model's weights untouched.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use serde_json::Value;
use tch::{Device, Kind, Tensor};

use crate::error::{ModelError, Result};

/// File name of a single-file checkpoint.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// File name of the index of a sharded checkpoint.
pub const WEIGHTS_INDEX_FILE: &str = "model.safetensors.index.json";

/// What to do with checkpoint tensors the model has no parameter for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Extra {
    /// HF checkpoints may carry buffers (`rotary_emb.inv_freq`) or a redundant tied `lm_head`: skip them.
    Ignore,
    /// A weight blob from our own `to_safetensors_bytes` must match exactly: anything else is a bug upstream.
    Reject,
}

fn kind_of(dtype: Dtype) -> Option<Kind> {
    match dtype {
        Dtype::F32 => Some(Kind::Float),
        Dtype::BF16 => Some(Kind::BFloat16),
        Dtype::F16 => Some(Kind::Half),
        _ => None,
    }
}

fn dtype_name(kind: Kind) -> Result<&'static str> {
    match kind {
        Kind::Float => Ok("F32"),
        Kind::BFloat16 => Ok("BF16"),
        Kind::Half => Ok("F16"),
        other => Err(ModelError::Config(format!("cannot store tensors of kind {other:?} in safetensors"))),
    }
}

/// The memory-mapped files of one checkpoint directory, in a stable order.
pub(crate) struct CheckpointFiles {
    files: Vec<(PathBuf, Mmap)>,
}

impl CheckpointFiles {
    /// Maps `model.safetensors`, or every shard named by `model.safetensors.index.json`.
    pub(crate) fn open(dir: &Path) -> Result<Self> {
        let index = dir.join(WEIGHTS_INDEX_FILE);
        let paths = if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|e| ModelError::io(&index, e))?;
            let value: Value =
                serde_json::from_str(&text).map_err(|e| ModelError::json(index.display().to_string(), e))?;
            let Some(map) = value.get("weight_map").and_then(Value::as_object) else {
                return Err(ModelError::Safetensors {
                    location: index.display().to_string(),
                    reason: "no `weight_map` object".into(),
                });
            };
            let mut shards: Vec<String> = Vec::new();
            for (name, file) in map {
                // A shard is a file of this directory: an index naming `../x` or `/dev/zero` would read elsewhere.
                let plain = |f: &str| {
                    let mut parts = Path::new(f).components();
                    matches!((parts.next(), parts.next()), (Some(std::path::Component::Normal(_)), None))
                };
                let Some(file) = file.as_str().filter(|f| plain(f)) else {
                    return Err(ModelError::Safetensors {
                        location: index.display().to_string(),
                        reason: format!("weight_map entry for `{name}` is not a file name in the directory: {file}"),
                    });
                };
                if !shards.iter().any(|s| s == file) {
                    shards.push(file.to_string());
                }
            }
            shards.sort();
            shards.into_iter().map(|f| dir.join(f)).collect()
        } else {
            vec![dir.join(WEIGHTS_FILE)]
        };
        let mut files = Vec::with_capacity(paths.len());
        for path in paths {
            // Only regular files: opening a FIFO would block, and a directory or device is no checkpoint.
            let metadata = std::fs::metadata(&path).map_err(|e| ModelError::io(&path, e))?;
            if !metadata.is_file() {
                return Err(ModelError::Safetensors {
                    location: path.display().to_string(),
                    reason: "not a regular file".into(),
                });
            }
            let file = std::fs::File::open(&path).map_err(|e| ModelError::io(&path, e))?;
            // SAFETY: the mapping is read-only and lives only while loading; a checkpoint being rewritten under
            // a running load is outside what any loader can guard against.
            #[allow(unsafe_code)]
            let mmap = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(&path, e))?;
            files.push((path, mmap));
        }
        Ok(CheckpointFiles { files })
    }

    /// Parses the headers and copies every parameter in.
    pub(crate) fn load_into(&self, params: &BTreeMap<String, Tensor>, location: &str) -> Result<()> {
        let mut parsed = Vec::with_capacity(self.files.len());
        for (path, mmap) in &self.files {
            let st = SafeTensors::deserialize(mmap)
                .map_err(|e| ModelError::Safetensors { location: path.display().to_string(), reason: e.to_string() })?;
            parsed.push(st);
        }
        let mut views = HashMap::new();
        for st in &parsed {
            for (name, view) in st.iter() {
                views.insert(name.to_string(), view);
            }
        }
        copy_views(params, &views, location, Extra::Ignore)
    }
}

/// Loads a safetensors blob held in memory into `params`.
pub(crate) fn load_bytes(params: &BTreeMap<String, Tensor>, bytes: &[u8]) -> Result<()> {
    let location = "weight bytes";
    let st = SafeTensors::deserialize(bytes)
        .map_err(|e| ModelError::Safetensors { location: location.into(), reason: e.to_string() })?;
    let views: HashMap<String, TensorView<'_>> = st.iter().map(|(n, v)| (n.to_string(), v)).collect();
    copy_views(params, &views, location, Extra::Reject)
}

fn copy_views(
    params: &BTreeMap<String, Tensor>,
    views: &HashMap<String, TensorView<'_>>,
    location: &str,
    extra: Extra,
) -> Result<()> {
    // Validate everything first so a bad checkpoint cannot leave the model half-overwritten.
    for (name, param) in params {
        let Some(view) = views.get(name) else {
            return Err(ModelError::MissingTensor { name: name.clone(), location: location.into() });
        };
        let found: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
        let expected = param.size();
        if found != expected {
            return Err(ModelError::TensorShape { name: name.clone(), expected, found });
        }
        if kind_of(view.dtype()).is_none() {
            return Err(ModelError::Weights {
                name: name.clone(),
                reason: format!("dtype {:?} is not a float dtype (expected F32, BF16 or F16)", view.dtype()),
            });
        }
    }
    let mut unexpected: Vec<&String> = views.keys().filter(|n| !params.contains_key(*n)).collect();
    unexpected.sort();
    if let Some(first) = unexpected.first() {
        match extra {
            Extra::Reject => {
                return Err(ModelError::Weights {
                    name: (*first).clone(),
                    reason: format!("not a parameter of this model ({} unexpected tensor(s))", unexpected.len()),
                })
            }
            Extra::Ignore => tracing::debug!(count = unexpected.len(), first = %first, "ignoring extra tensors"),
        }
    }

    tch::no_grad(|| {
        for (name, param) in params {
            let Some(view) = views.get(name) else { continue };
            let Some(kind) = kind_of(view.dtype()) else { continue };
            let wrap = |e: tch::TchError| ModelError::Weights { name: name.clone(), reason: e.to_string() };
            let src = Tensor::f_from_data_size(view.data(), &param.size(), kind).map_err(wrap)?;
            let mut dst = param.shallow_clone();
            dst.f_copy_(&src).map_err(wrap)?;
        }
        Ok(())
    })
}

/// Writes `tensors` (sorted by name) as safetensors, converting each to `kind` (or keeping its own when
/// `None`) and copying one tensor at a time to the CPU.
pub(crate) fn write_safetensors<W: Write>(
    tensors: &BTreeMap<String, Tensor>,
    kind: Option<Kind>,
    mut out: W,
) -> Result<()> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({ "format": "pt" }));
    let mut offset = 0usize;
    for (name, tensor) in tensors {
        let kind = kind.unwrap_or(tensor.kind());
        let shape = tensor.size();
        let nbytes = tensor.numel() * kind.elt_size_in_bytes();
        header.insert(
            name.clone(),
            serde_json::json!({
                "dtype": dtype_name(kind)?,
                "shape": shape,
                "data_offsets": [offset, offset + nbytes],
            }),
        );
        offset += nbytes;
    }
    let mut header =
        serde_json::to_vec(&Value::Object(header)).map_err(|e| ModelError::json("safetensors header", e))?;
    // The data section must start 8-byte aligned; the format pads the header with spaces.
    header.resize(header.len().next_multiple_of(8), b' ');
    let io = |e: std::io::Error| ModelError::Safetensors { location: "output".into(), reason: e.to_string() };
    out.write_all(&(header.len() as u64).to_le_bytes()).map_err(io)?;
    out.write_all(&header).map_err(io)?;
    let mut buf = Vec::new();
    for (name, tensor) in tensors {
        let kind = kind.unwrap_or(tensor.kind());
        let wrap = |e: tch::TchError| ModelError::Weights { name: name.clone(), reason: e.to_string() };
        let cpu = tensor.f_detach().and_then(|t| t.f_to_device(Device::Cpu)).and_then(|t| t.f_to_kind(kind));
        let cpu = cpu.and_then(|t| t.f_contiguous()).map_err(wrap)?;
        let numel = cpu.numel();
        buf.resize(numel * kind.elt_size_in_bytes(), 0);
        cpu.f_copy_data_u8(&mut buf, numel).map_err(wrap)?;
        out.write_all(&buf).map_err(io)?;
    }
    out.flush().map_err(io)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> BTreeMap<String, Tensor> {
        let mut p = BTreeMap::new();
        p.insert("a.weight".to_string(), Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0]).view([2, 2]));
        p.insert("b.bias".to_string(), Tensor::from_slice(&[0.5f32, -0.5]));
        p
    }

    #[test]
    fn written_bytes_parse_with_the_safetensors_crate_and_round_trip() {
        let src = params();
        let mut bytes = Vec::new();
        write_safetensors(&src, Some(Kind::BFloat16), &mut bytes).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.tensor("a.weight").unwrap().dtype(), Dtype::BF16);
        assert_eq!(st.tensor("b.bias").unwrap().shape(), &[2]);

        let dst: BTreeMap<String, Tensor> = src
            .iter()
            .map(|(k, t)| (k.clone(), Tensor::zeros(t.size().as_slice(), (Kind::Float, Device::Cpu))))
            .collect();
        load_bytes(&dst, &bytes).unwrap();
        for (name, t) in &src {
            assert_eq!(f64::try_from(dst[name].f_sub(t).unwrap().abs().max()).unwrap(), 0.0, "{name}");
        }
    }

    #[test]
    fn missing_and_misshaped_tensors_are_named_and_nothing_is_copied() {
        let src = params();
        let mut bytes = Vec::new();
        write_safetensors(&src, None, &mut bytes).unwrap();

        let mut dst = BTreeMap::new();
        dst.insert("a.weight".to_string(), Tensor::zeros([2, 2], (Kind::Float, Device::Cpu)));
        dst.insert("b.bias".to_string(), Tensor::zeros([3], (Kind::Float, Device::Cpu)));
        let err = load_bytes(&dst, &bytes).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, ModelError::TensorShape { .. }), "{msg}");
        assert!(msg.contains("b.bias") && msg.contains("[3]") && msg.contains("[2]"), "{msg}");
        assert_eq!(f64::try_from(dst["a.weight"].abs().sum(Kind::Float)).unwrap(), 0.0);

        dst.insert("c.weight".to_string(), Tensor::zeros([1], (Kind::Float, Device::Cpu)));
        dst.insert("b.bias".to_string(), Tensor::zeros([2], (Kind::Float, Device::Cpu)));
        let err = load_bytes(&dst, &bytes).unwrap_err();
        assert!(matches!(&err, ModelError::MissingTensor { name, .. } if name == "c.weight"), "{err}");
    }

    #[test]
    fn unexpected_tensor_in_a_weight_blob_is_rejected() {
        let src = params();
        let mut bytes = Vec::new();
        write_safetensors(&src, None, &mut bytes).unwrap();
        let mut dst = BTreeMap::new();
        dst.insert("a.weight".to_string(), Tensor::zeros([2, 2], (Kind::Float, Device::Cpu)));
        let err = load_bytes(&dst, &bytes).unwrap_err();
        assert!(err.to_string().contains("b.bias"), "{err}");
    }
}
