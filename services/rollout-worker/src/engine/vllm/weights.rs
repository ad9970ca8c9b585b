//! A weight version as files vLLM reads: the trainer's blob (safetensors, HF names) as `model.safetensors` in a
//! directory of its own beside the checkpoint's `config.json` (`reload_weights` reads it), or, with LoRA, a PEFT
//! adapter directory (`adapter_config.json` and `adapter_model.safetensors` with PEFT's key prefix) for
//! `/v1/load_lora_adapter`. The blob's tensor data is written as it came; only a LoRA blob's header is rewritten
//! (its names).
//!
//! A checkpoint whose output layer is tied to its embeddings is served untied ([`serving_dir`]): vLLM's CPU backend
//! packs the output layer's weight for its GEMM kernel when the model loads, and an in-place reload of a tied model
//! updates the embeddings but never repacks that copy, so every version after the first would sample from the
//! first version's output layer. The served directory says `tie_word_embeddings: false` and carries
//! `lm_head.weight` (the embeddings' values) in a file of its own, and so does every version written for it: the
//! same numbers, each layer reloaded.

use std::path::{Path, PathBuf};

use jetrl_model::lora::{ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE};
use jetrl_model::LoraSpec;
use serde_json::{json, Map, Value};

use super::VllmError;

/// The prefix PEFT's saved keys carry before the base model's module names.
const PEFT_PREFIX: &str = "base_model.model.";
/// Versions kept on disk (the newest ones): a reload in flight never loses its files.
const KEEP: u64 = 2;

/// The embeddings' tensor name in HF checkpoints, and the output layer's.
const EMBEDDINGS: &str = "model.embed_tokens.weight";
const LM_HEAD: &str = "lm_head.weight";
/// The file that carries the untied output layer.
const LM_HEAD_FILE: &str = "lm_head.safetensors";

/// The directory vLLM serves: `model_dir` itself, or (tied embeddings) `work_dir/base`, the checkpoint's files
/// linked, its config untied and the output layer written out. Returns it and whether versions must carry the
/// output layer too.
pub fn serving_dir(model_dir: &Path, work_dir: &Path) -> Result<(PathBuf, bool), VllmError> {
    let fail = |message: String| VllmError::Weights { version: 0, message };
    let config_path = model_dir.join("config.json");
    let text = std::fs::read_to_string(&config_path).map_err(|e| fail(format!("{}: {e}", config_path.display())))?;
    let mut config: Value = serde_json::from_str(&text).map_err(|e| fail(format!("{}: {e}", config_path.display())))?;
    if config.get("tie_word_embeddings").and_then(Value::as_bool) != Some(true) {
        return Ok((model_dir.to_path_buf(), false));
    }
    let base = work_dir.join("base");
    if base.exists() {
        std::fs::remove_dir_all(&base).map_err(|e| fail(format!("{}: {e}", base.display())))?;
    }
    std::fs::create_dir_all(&base).map_err(|e| fail(format!("{}: {e}", base.display())))?;
    let model_dir = std::fs::canonicalize(model_dir).map_err(|e| fail(format!("{}: {e}", model_dir.display())))?;
    let index_name = "model.safetensors.index.json";
    let entries = std::fs::read_dir(&model_dir).map_err(|e| fail(format!("{}: {e}", model_dir.display())))?;
    for entry in entries.flatten() {
        let name = entry.file_name();
        if name == "config.json" || name == index_name {
            continue;
        }
        std::os::unix::fs::symlink(entry.path(), base.join(&name))
            .map_err(|e| fail(format!("linking {}: {e}", entry.path().display())))?;
    }
    config["tie_word_embeddings"] = Value::Bool(false);
    let text = serde_json::to_vec_pretty(&config).map_err(|e| fail(e.to_string()))?;
    std::fs::write(base.join("config.json"), text).map_err(|e| fail(format!("config.json: {e}")))?;
    // the file that holds the embeddings: the index names it, else model.safetensors
    let index_path = model_dir.join(index_name);
    let shard = if index_path.exists() {
        let text = std::fs::read_to_string(&index_path).map_err(|e| fail(format!("{}: {e}", index_path.display())))?;
        let mut index: Value =
            serde_json::from_str(&text).map_err(|e| fail(format!("{}: {e}", index_path.display())))?;
        let shard = index["weight_map"][EMBEDDINGS]
            .as_str()
            .ok_or_else(|| fail(format!("{}: no {EMBEDDINGS}", index_path.display())))?
            .to_string();
        index["weight_map"][LM_HEAD] = Value::String(LM_HEAD_FILE.into());
        let text = serde_json::to_vec_pretty(&index).map_err(|e| fail(e.to_string()))?;
        std::fs::write(base.join(index_name), text).map_err(|e| fail(format!("{index_name}: {e}")))?;
        shard
    } else {
        "model.safetensors".to_string()
    };
    let shard_path = model_dir.join(&shard);
    let bytes = std::fs::read(&shard_path).map_err(|e| fail(format!("{}: {e}", shard_path.display())))?;
    let head = lm_head_file(&bytes).map_err(|m| fail(format!("{}: {m}", shard_path.display())))?;
    std::fs::write(base.join(LM_HEAD_FILE), head).map_err(|e| fail(format!("{LM_HEAD_FILE}: {e}")))?;
    Ok((base, true))
}

/// A safetensors file holding one tensor, `lm_head.weight`: the embeddings of `blob`, bytes as they are.
fn lm_head_file(blob: &[u8]) -> Result<Vec<u8>, String> {
    let (header, data) = split(blob)?;
    let info = header.get(EMBEDDINGS).ok_or(format!("no {EMBEDDINGS}"))?;
    let offsets: Vec<usize> = info["data_offsets"]
        .as_array()
        .map(|a| a.iter().filter_map(|v| v.as_u64()).map(|v| v as usize).collect())
        .unwrap_or_default();
    let [start, end] = offsets[..] else { return Err(format!("{EMBEDDINGS}: no data offsets")) };
    let bytes = data.get(start..end).ok_or(format!("{EMBEDDINGS}: offsets past the data"))?;
    let mut entry = info.clone();
    entry["data_offsets"] = json!([0, bytes.len()]);
    let mut head = Map::new();
    head.insert(LM_HEAD.to_string(), entry);
    Ok(with_header(head, bytes))
}

/// A safetensors file of `header` (offsets into `data`) and `data`.
fn with_header(header: Map<String, Value>, data: &[u8]) -> Vec<u8> {
    let mut head = serde_json::to_vec(&Value::Object(header)).unwrap_or_default();
    // safetensors pads its header with spaces to a multiple of 8 bytes
    while !head.len().is_multiple_of(8) {
        head.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + head.len() + data.len());
    out.extend_from_slice(&(head.len() as u64).to_le_bytes());
    out.extend_from_slice(&head);
    out.extend_from_slice(data);
    out
}

/// Writes `blob` as version `version` under `work_dir`; returns the directory vLLM is to load. `untied`: the
/// served model has its own output layer, written from the blob's embeddings.
pub fn write_version(
    work_dir: &Path,
    model_dir: &Path,
    lora: Option<&LoraSpec>,
    untied: bool,
    blob: &[u8],
    version: u64,
) -> Result<PathBuf, VllmError> {
    let fail = |message: String| VllmError::Weights { version, message };
    let dir = work_dir.join(format!("v{version}"));
    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(|e| fail(format!("{}: {e}", dir.display())))?;
    }
    std::fs::create_dir_all(&dir).map_err(|e| fail(format!("{}: {e}", dir.display())))?;
    let write = |name: &str, bytes: &[u8]| {
        let path = dir.join(name);
        std::fs::write(&path, bytes).map_err(|e| fail(format!("{}: {e}", path.display())))
    };
    match lora {
        None => {
            write("model.safetensors", blob)?;
            let config = model_dir.join("config.json");
            let text = std::fs::read(&config).map_err(|e| fail(format!("{}: {e}", config.display())))?;
            if untied {
                let mut parsed: Value =
                    serde_json::from_slice(&text).map_err(|e| fail(format!("{}: {e}", config.display())))?;
                parsed["tie_word_embeddings"] = Value::Bool(false);
                write("config.json", &serde_json::to_vec_pretty(&parsed).map_err(|e| fail(e.to_string()))?)?;
                write(LM_HEAD_FILE, &lm_head_file(blob).map_err(fail)?)?;
            } else {
                write("config.json", &text)?;
            }
        }
        Some(spec) => {
            let (renamed, modules) = peft_names(blob).map_err(fail)?;
            write(ADAPTER_WEIGHTS_FILE, &renamed)?;
            let config = adapter_config(spec, &modules, model_dir);
            let text = serde_json::to_vec_pretty(&config).map_err(|e| fail(e.to_string()))?;
            write(ADAPTER_CONFIG_FILE, &text)?;
        }
    }
    Ok(dir)
}

/// Removes the versions older than the newest [`KEEP`].
pub fn prune(work_dir: &Path, newest: u64) {
    let Ok(entries) = std::fs::read_dir(work_dir) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(version) = name.to_str().and_then(|n| n.strip_prefix('v')).and_then(|v| v.parse::<u64>().ok()) else {
            continue;
        };
        if version + KEEP <= newest {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// The adapter blob with PEFT's key names (`base_model.model.<module>.lora_A.weight`), and the short names of the
/// modules it adapts (`q_proj`, …).
fn peft_names(blob: &[u8]) -> Result<(Vec<u8>, Vec<String>), String> {
    let (header, data) = split(blob)?;
    let mut renamed = Map::new();
    let mut modules: Vec<String> = Vec::new();
    for (name, info) in header {
        if name == "__metadata__" {
            renamed.insert(name, info);
            continue;
        }
        let module = name
            .strip_suffix(".lora_A.weight")
            .or_else(|| name.strip_suffix(".lora_B.weight"))
            .ok_or_else(|| format!("{name:?} is not a LoRA tensor (…lora_A.weight / …lora_B.weight)"))?;
        if let Some(short) = module.rsplit('.').next() {
            if !modules.iter().any(|m| m == short) {
                modules.push(short.to_string());
            }
        }
        renamed.insert(format!("{PEFT_PREFIX}{name}"), info);
    }
    modules.sort();
    Ok((with_header(renamed, data), modules))
}

/// A safetensors blob's header (name → dtype, shape, offsets) and its data.
fn split(blob: &[u8]) -> Result<(Map<String, Value>, &[u8]), String> {
    let len_bytes: [u8; 8] = blob.get(..8).and_then(|b| b.try_into().ok()).ok_or("blob shorter than 8 bytes")?;
    let len = usize::try_from(u64::from_le_bytes(len_bytes)).map_err(|_| "header length")?;
    let end = 8usize.checked_add(len).filter(|&e| e <= blob.len()).ok_or("header runs past the blob")?;
    let header: Value = serde_json::from_slice(&blob[8..end]).map_err(|e| format!("header: {e}"))?;
    match header {
        Value::Object(map) => Ok((map, &blob[end..])),
        _ => Err("header is not a JSON object".into()),
    }
}

/// PEFT's `adapter_config.json` for vLLM.
fn adapter_config(spec: &LoraSpec, modules: &[String], model_dir: &Path) -> Value {
    json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": model_dir.display().to_string(),
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": 0.0,
        "target_modules": modules,
        "bias": "none",
        "use_rslora": spec.use_rslora,
        "use_dora": false,
        "fan_in_fan_out": false,
        "inference_mode": true,
        "modules_to_save": Value::Null,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// A safetensors blob of f32 tensors named `names`, each of one element.
    fn blob(names: &[&str]) -> Vec<u8> {
        let mut header = Map::new();
        for (i, name) in names.iter().enumerate() {
            header.insert(name.to_string(), json!({"dtype": "F32", "shape": [1], "data_offsets": [i * 4, i * 4 + 4]}));
        }
        let mut h = serde_json::to_vec(&Value::Object(header)).unwrap();
        while !h.len().is_multiple_of(8) {
            h.push(b' ');
        }
        let mut out = (h.len() as u64).to_le_bytes().to_vec();
        out.extend(h);
        for i in 0..names.len() {
            out.extend((i as f32).to_le_bytes());
        }
        out
    }

    #[test]
    fn an_adapter_blob_gets_peft_names_and_keeps_its_data() {
        let names = ["model.layers.0.self_attn.q_proj.lora_A.weight", "model.layers.0.mlp.up_proj.lora_B.weight"];
        let (renamed, modules) = peft_names(&blob(&names)).unwrap();
        let (header, data) = split(&renamed).unwrap();
        assert!(header.contains_key("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"));
        assert!(header.contains_key("base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"));
        assert_eq!(modules, vec!["q_proj".to_string(), "up_proj".to_string()]);
        assert_eq!(data, &blob(&names)[blob(&names).len() - 8..]);
    }

    #[test]
    fn a_blob_that_is_not_an_adapter_is_refused() {
        assert!(peft_names(&blob(&["model.embed_tokens.weight"])).unwrap_err().contains("not a LoRA tensor"));
        assert!(peft_names(b"short").is_err());
        let mut bad = blob(&["x.lora_A.weight"]);
        bad[0] = 0xff;
        assert!(peft_names(&bad).is_err());
    }

    #[test]
    fn a_tied_model_is_served_untied_and_its_versions_carry_the_output_layer() {
        let work = tempfile::tempdir().unwrap();
        let model = tempfile::tempdir().unwrap();
        let weights = blob(&["model.embed_tokens.weight", "model.norm.weight"]);
        std::fs::write(model.path().join("model.safetensors"), &weights).unwrap();
        std::fs::write(model.path().join("tokenizer.json"), "{}").unwrap();
        std::fs::write(model.path().join("config.json"), r#"{"tie_word_embeddings": true, "vocab_size": 1}"#).unwrap();
        let (served, untied) = serving_dir(model.path(), work.path()).unwrap();
        assert!(untied);
        let config: Value =
            serde_json::from_str(&std::fs::read_to_string(served.join("config.json")).unwrap()).unwrap();
        assert_eq!(config["tie_word_embeddings"], json!(false));
        assert_eq!(config["vocab_size"], json!(1));
        assert!(served.join("tokenizer.json").exists() && served.join("model.safetensors").exists());
        let head = std::fs::read(served.join(LM_HEAD_FILE)).unwrap();
        let (header, data) = split(&head).unwrap();
        assert_eq!(header.keys().collect::<Vec<_>>(), vec!["lm_head.weight"]);
        // the embeddings' bytes (the first tensor of the blob: 0.0f32)
        assert_eq!(data, &0f32.to_le_bytes());
        let version = write_version(work.path(), model.path(), None, true, &weights, 1).unwrap();
        assert_eq!(std::fs::read(version.join(LM_HEAD_FILE)).unwrap(), head);
        // an untied checkpoint is served as it is
        std::fs::write(model.path().join("config.json"), r#"{"tie_word_embeddings": false}"#).unwrap();
        assert_eq!(serving_dir(model.path(), work.path()).unwrap(), (model.path().to_path_buf(), false));
    }

    #[test]
    fn versions_are_written_and_old_ones_pruned() {
        let dir = tempfile::tempdir().unwrap();
        let model = tempfile::tempdir().unwrap();
        std::fs::write(model.path().join("config.json"), "{}").unwrap();
        for v in 1..=4 {
            let out = write_version(dir.path(), model.path(), None, false, &blob(&["w"]), v).unwrap();
            assert!(out.join("model.safetensors").exists() && out.join("config.json").exists());
            prune(dir.path(), v);
        }
        let mut left: Vec<String> =
            std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        left.sort();
        assert_eq!(left, vec!["v3".to_string(), "v4".to_string()]);
    }
}
