//! Fuzzing what the model crate reads from a checkpoint with proptest: HF `config.json` (`ModelConfig::from_json`
//! and `from_file`) and safetensors weights, from bytes (`CausalLm::load_safetensors_bytes`, what a rollout
//! worker receives) and from files (`CausalLm::load_weights`: `model.safetensors` or shards named by
//! `model.safetensors.index.json`). Real libtorch, a micro model so that each case stays cheap.
//!
//! Inputs are random bytes and valid examples mutated structurally (a JSON value replaced, removed, swapped,
//! nested; a safetensors header edited and re-framed) and byte by byte. Properties: no panic; an error names the
//! field, tensor or file it is about; a refused weight set leaves the model's weights untouched; an accepted
//! config builds a model that runs; configs and weights round trip exactly.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

#[path = "../../wire/tests/fuzz_support/json.rs"]
mod json_mutate;
#[path = "../../wire/tests/fuzz_support/bytes.rs"]
mod mutate;

use std::collections::BTreeMap;
use std::path::Path;

use jetrl_model::{CausalLm, DType, ModelConfig, ModelError, RopeScaling, WEIGHTS_FILE, WEIGHTS_INDEX_FILE};
use proptest::prelude::*;
use serde_json::{json, Value};
use tch::{Device, Kind, Tensor};

fn config() -> ProptestConfig {
    // One torch thread: the micro model's ops are all dispatch, and a pool per test thread on a small machine
    // only adds contention (the CLI suite measured 7x).
    tch::set_num_threads(1);
    mutate::fuzz_config(concat!(env!("CARGO_MANIFEST_DIR"), "/proptest-regressions/fuzz.txt"))
}

// ---------------------------------------------------------------------------------------------------------------
// config.json

fn micro_config() -> Value {
    json!({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 24, "hidden_size": 16,
        "intermediate_size": 24, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": false,
        "eos_token_id": [2, 0], "bos_token_id": null, "pad_token_id": 0, "hidden_act": "silu",
        "torch_dtype": "float32"
    })
}

fn config_seeds() -> Vec<Value> {
    let hf_sample = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden/hf-sample/llama/config.json");
    let hf_sample: Value =
        serde_json::from_str(&std::fs::read_to_string(hf_sample).expect("hf-sample config.json")).expect("JSON");
    vec![
        micro_config(),
        hf_sample,
        json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32, "hidden_size": 16,
            "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 128, "attention_bias": true, "mlp_bias": true, "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64},
            "eos_token_id": 2
        }),
        json!({
            "architectures": ["Qwen3ForCausalLM"], "vocab_size": 40, "hidden_size": 16, "intermediate_size": 24,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8,
            "rope_parameters": {"full_attention": {"rope_theta": 1000000.0, "rope_type": "linear", "factor": 2.0}},
            "layer_types": ["full_attention", "full_attention"], "use_sliding_window": false
        }),
    ]
}

/// Words an error about config.json uses to say what it is about.
const CONFIG_SUBJECTS: &[&str] = &[
    "model_type",
    "architecture",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope",
    "partial_rotary_factor",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "hidden_act",
    "sliding",
    "layer_types",
    "eos_token_id",
    "bos_token_id",
    "pad_token_id",
    "sizes overflow",
    "config.json",
];

/// The validated facts of a config, for comparing two of them (the raw JSON aside).
fn facts(cfg: &ModelConfig) -> String {
    let ModelConfig {
        architecture,
        vocab_size,
        hidden_size,
        intermediate_size,
        num_hidden_layers,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        max_position_embeddings,
        rms_norm_eps,
        rope_theta,
        rope_scaling,
        tie_word_embeddings,
        qkv_bias,
        o_bias,
        mlp_bias,
        qk_norm,
        eos_token_ids,
        bos_token_id,
        pad_token_id,
        ..
    } = cfg;
    format!(
        "{architecture:?} {vocab_size} {hidden_size} {intermediate_size} {num_hidden_layers} {num_attention_heads} \
         {num_key_value_heads} {head_dim} {max_position_embeddings} {rms_norm_eps:e} {rope_theta:e} {rope_scaling:?} \
         {tie_word_embeddings} {qkv_bias} {o_bias} {mlp_bias} {qk_norm} {eos_token_ids:?} {bos_token_id:?} \
         {pad_token_id:?}"
    )
}

fn check_accepted_config(cfg: &ModelConfig) -> Result<(), TestCaseError> {
    for size in [cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.head_dim] {
        prop_assert!(size > 0, "{}", facts(cfg));
    }
    prop_assert!(cfg.num_attention_heads > 0 && cfg.num_key_value_heads > 0);
    prop_assert_eq!(cfg.num_attention_heads % cfg.num_key_value_heads, 0);
    prop_assert_eq!(cfg.head_dim % 2, 0);
    prop_assert!(cfg.max_position_embeddings > 0, "{}", facts(cfg));
    prop_assert!(cfg.rms_norm_eps >= 0.0, "{}", facts(cfg));
    prop_assert!(cfg.rope_theta.is_finite() && cfg.rope_theta > 0.0);
    match cfg.rope_scaling {
        RopeScaling::None => {}
        RopeScaling::Linear { factor } => prop_assert!(factor.is_finite() && factor > 0.0, "{}", facts(cfg)),
        RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
            for value in [factor, low_freq_factor, high_freq_factor, original_max_position_embeddings] {
                prop_assert!(value.is_finite() && value > 0.0, "{}", facts(cfg));
            }
            prop_assert!(low_freq_factor != high_freq_factor, "{}", facts(cfg));
        }
    }
    let params = cfg.parameter_count().map_err(|e| TestCaseError::fail(e.to_string()))?;
    // Round trip: the JSON written with a saved model reads back as the same config.
    let again = ModelConfig::from_json(cfg.to_json(DType::BF16)).map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert_eq!(facts(&again), facts(cfg));
    // A small accepted config builds a model that runs (a large one would only cost time and memory here).
    if params <= 40_000 && cfg.num_hidden_layers <= 4 {
        let model = CausalLm::random(cfg.clone(), Device::Cpu, DType::F32, 0.02)
            .map_err(|e| TestCaseError::fail(format!("accepted config does not build: {e}: {}", facts(cfg))))?;
        let last = (cfg.vocab_size - 1).min(i64::from(u32::MAX)) as u32;
        let logprobs = jetrl_model::log_probs_of(&model, &[0, last, 0])
            .map_err(|e| TestCaseError::fail(format!("accepted config does not run: {e}: {}", facts(cfg))))?;
        prop_assert_eq!(logprobs.len(), 2);
    }
    Ok(())
}

fn check_config_error(err: &ModelError) -> Result<(), TestCaseError> {
    let text = err.to_string();
    match err {
        ModelError::Config(reason) => {
            prop_assert!(CONFIG_SUBJECTS.iter().any(|s| reason.contains(s)), "names no field: {}", text);
        }
        ModelError::Json { .. } | ModelError::Io { .. } => prop_assert!(text.contains("config.json"), "{}", text),
        other => prop_assert!(false, "config.json gave a {:?}", other),
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------------------------
// safetensors

/// A micro model (untied, so `lm_head.weight` exists): ~1,500 parameters.
fn micro_model(seed: i64) -> CausalLm {
    tch::manual_seed(seed);
    let cfg = ModelConfig::from_json(micro_config()).expect("the micro config is valid");
    CausalLm::random(cfg, Device::Cpu, DType::F32, 0.5).expect("the micro model builds")
}

/// The weight blobs of a micro model in both dtypes a trainer ships.
fn blob_seeds() -> Vec<Vec<u8>> {
    let model = micro_model(1);
    vec![
        model.to_safetensors_bytes().expect("f32 blob"),
        model.to_safetensors_bytes_as(DType::BF16).expect("bf16 blob"),
    ]
}

/// A blob split into its header (JSON) and data.
fn split_blob(blob: &[u8]) -> Option<(Value, Vec<u8>)> {
    let n = usize::try_from(u64::from_le_bytes(blob.get(..8)?.try_into().ok()?)).ok()?;
    let header = serde_json::from_slice(blob.get(8..8usize.checked_add(n)?)?).ok()?;
    Some((header, blob[8 + n..].to_vec()))
}

fn frame_blob(header: &Value, data: &[u8]) -> Vec<u8> {
    let header = header.to_string().into_bytes();
    let mut blob = (header.len() as u64).to_le_bytes().to_vec();
    blob.extend_from_slice(&header);
    blob.extend_from_slice(data);
    blob
}

/// A blob: random bytes, byte-mutated, or with its header edited structurally and re-framed (the length
/// prefix right, so the edit reaches the header's validation), its data cut or extended.
fn blob_input() -> impl Strategy<Value = Vec<u8>> {
    let parts: Vec<(Value, Vec<u8>)> = blob_seeds().iter().filter_map(|b| split_blob(b)).collect();
    let headers: Vec<Value> = parts.iter().map(|(h, _)| h.clone()).collect();
    let data = parts.into_iter().map(|(_, d)| d).collect::<Vec<_>>();
    let reframed = (
        json_mutate::json_mutated(headers),
        proptest::sample::select(data),
        prop_oneof![3 => Just(0i64), 1 => -64i64..64],
    )
        .prop_map(|(header, mut data, resize)| {
            let len = (data.len() as i64 + resize).max(0) as usize;
            data.resize(len, 0x3f);
            frame_blob(&header, &data)
        });
    prop_oneof![
        1 => mutate::random_bytes(64),
        2 => mutate::mutated(blob_seeds(), mutate::JSON_TOKENS),
        4 => reframed,
    ]
}

/// The model's weights as bits, to compare before and after a load.
fn snapshot(model: &CausalLm) -> BTreeMap<String, Vec<u32>> {
    model
        .parameters()
        .into_iter()
        .map(|(name, t)| {
            let values = Vec::<f32>::try_from(t.flatten(0, -1)).expect("f32 parameters");
            (name, values.into_iter().map(f32::to_bits).collect())
        })
        .collect()
}

/// Checks a load's outcome: refused → weights untouched and the error names the tensor or the container;
/// accepted → every parameter holds exactly the blob's tensor (converted to f32).
fn check_load(
    model: &CausalLm,
    before: &BTreeMap<String, Vec<u32>>,
    result: Result<(), ModelError>,
    blobs: &[&[u8]],
) -> Result<(), TestCaseError> {
    let names: Vec<String> = before.keys().cloned().collect();
    match result {
        Err(err) => {
            prop_assert_eq!(&snapshot(model), before, "a refused load changed the weights: {}", err);
            match &err {
                ModelError::MissingTensor { name, .. } | ModelError::TensorShape { name, .. } => {
                    prop_assert!(names.contains(name), "{}", err)
                }
                ModelError::Weights { name, reason } => prop_assert!(!name.is_empty() && !reason.is_empty()),
                ModelError::Safetensors { location, reason } => {
                    prop_assert!(!location.is_empty() && !reason.is_empty())
                }
                ModelError::Io { .. } | ModelError::Json { .. } => {}
                other => prop_assert!(false, "unexpected error kind: {:?}", other),
            }
        }
        Ok(()) => {
            let mut views = BTreeMap::new();
            let parsed: Vec<_> = blobs.iter().filter_map(|b| safetensors::SafeTensors::deserialize(b).ok()).collect();
            for st in &parsed {
                for (name, view) in st.tensors() {
                    views.insert(name, view);
                }
            }
            let after = snapshot(model);
            for name in &names {
                let view = views.get(name).ok_or_else(|| TestCaseError::fail(format!("{name} loaded from nowhere")))?;
                let kind = match view.dtype() {
                    safetensors::Dtype::F32 => Kind::Float,
                    safetensors::Dtype::BF16 => Kind::BFloat16,
                    safetensors::Dtype::F16 => Kind::Half,
                    other => return Err(TestCaseError::fail(format!("{name}: {other:?} was accepted"))),
                };
                let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
                let expected = Tensor::f_from_data_size(view.data(), &shape, kind)
                    .and_then(|t| t.f_to_kind(Kind::Float))
                    .and_then(|t| t.f_flatten(0, -1))
                    .and_then(Vec::<f32>::try_from)
                    .map_err(|e| TestCaseError::fail(format!("{name}: {e}")))?;
                let expected: Vec<u32> = expected.into_iter().map(f32::to_bits).collect();
                prop_assert_eq!(&after[name], &expected, "{} does not hold the blob's values", name);
            }
        }
    }
    Ok(())
}

/// `model.safetensors.index.json` naming two shards, each holding every tensor (the loader merges them).
fn index_seed(names: &[String]) -> Value {
    let map: serde_json::Map<String, Value> = names
        .iter()
        .enumerate()
        .map(|(i, name)| (name.clone(), json!(format!("model-0000{}-of-00002.safetensors", 1 + i % 2))))
        .collect();
    json!({"metadata": {"total_size": 1}, "weight_map": map})
}

/// The files an index names, in the order a loader reads them (sorted; later ones win for a tensor named
/// twice), as far as they exist.
fn shards_named_by(index: &[u8], dir: &Path) -> Vec<Vec<u8>> {
    let Ok(index) = serde_json::from_slice::<Value>(index) else { return Vec::new() };
    let Some(map) = index.get("weight_map").and_then(Value::as_object) else { return Vec::new() };
    let names: std::collections::BTreeSet<&str> = map.values().filter_map(Value::as_str).collect();
    names.into_iter().filter_map(|name| std::fs::read(dir.join(name)).ok()).collect()
}

#[derive(Debug, Clone)]
enum Checkpoint {
    Single(Vec<u8>),
    Sharded { index: Vec<u8>, shards: Vec<(String, Vec<u8>)> },
}

fn checkpoint_input() -> impl Strategy<Value = Checkpoint> {
    let names: Vec<String> = micro_model(1).parameters().into_keys().collect();
    let index = mutate::mutated(vec![index_seed(&names).to_string().into_bytes()], mutate::JSON_TOKENS);
    let structural_index = json_mutate::json_mutated(vec![index_seed(&names)]).prop_map(|v| v.to_string().into_bytes());
    let shard_name = prop_oneof![
        4 => Just("model-00001-of-00002.safetensors".to_string()),
        4 => Just("model-00002-of-00002.safetensors".to_string()),
        1 => "[a-z./-]{0,12}",
    ];
    prop_oneof![
        3 => blob_input().prop_map(Checkpoint::Single),
        2 => (
            prop_oneof![index, structural_index],
            proptest::collection::vec((shard_name, blob_input()), 0..3),
        )
            .prop_map(|(index, shards)| Checkpoint::Sharded { index, shards }),
    ]
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn config_json_is_validated_or_refused_naming_the_field(input in json_mutate::json_bytes(config_seeds(), 128)) {
        thread_local!(static SCRATCH: mutate::Scratch = mutate::Scratch::new());
        let path = SCRATCH.with(|s| s.next_dir()).join("config.json");
        std::fs::write(&path, &input).expect("writing config.json");
        let from_file = ModelConfig::from_file(&path);
        match serde_json::from_slice::<Value>(&input) {
            Ok(value) => {
                let from_json = ModelConfig::from_json(value);
                prop_assert_eq!(
                    from_json.as_ref().map(facts).map_err(ToString::to_string),
                    from_file.as_ref().map(facts).map_err(ToString::to_string)
                );
                match from_json {
                    Ok(cfg) => check_accepted_config(&cfg)?,
                    Err(err) => check_config_error(&err)?,
                }
            }
            Err(_) => {
                let err = from_file.err().ok_or_else(|| TestCaseError::fail("invalid JSON accepted"))?;
                let text = err.to_string();
                prop_assert!(text.contains("config.json"), "the error names the file: {}", text);
            }
        }
    }

    #[test]
    fn weight_bytes_load_exactly_or_are_refused_leaving_the_weights_untouched(blob in blob_input()) {
        thread_local!(static MODEL: std::cell::RefCell<CausalLm> = std::cell::RefCell::new(micro_model(2)));
        MODEL.with(|model| {
            let mut model = model.borrow_mut();
            let before = snapshot(&model);
            let result = model.load_safetensors_bytes(&blob);
            check_load(&model, &before, result, &[&blob])
        })?;
    }

    #[test]
    fn checkpoint_files_load_exactly_or_are_refused_leaving_the_weights_untouched(checkpoint in checkpoint_input()) {
        thread_local!(static MODEL: std::cell::RefCell<CausalLm> = std::cell::RefCell::new(micro_model(3)));
        thread_local!(static SCRATCH: mutate::Scratch = mutate::Scratch::new());
        let dir = SCRATCH.with(|s| s.next_dir());
        let blobs: Vec<Vec<u8>> = match &checkpoint {
            Checkpoint::Single(blob) => {
                std::fs::write(dir.join(WEIGHTS_FILE), blob).expect("writing the checkpoint");
                vec![blob.clone()]
            }
            Checkpoint::Sharded { index, shards } => {
                std::fs::write(dir.join(WEIGHTS_INDEX_FILE), index).expect("writing the index");
                for (name, blob) in shards {
                    // only plain names inside the checkpoint directory
                    if !name.is_empty() && !name.contains('/') && name != "." && name != ".." {
                        let _ = std::fs::write(dir.join(name), blob);
                    }
                }
                shards_named_by(index, &dir)
            }
        };
        MODEL.with(|model| {
            let mut model = model.borrow_mut();
            let before = snapshot(&model);
            let result = model.load_weights(&dir);
            let blobs: Vec<&[u8]> = blobs.iter().map(Vec::as_slice).collect();
            check_load(&model, &before, result, &blobs)
        })?;
    }
}

// ---------------------------------------------------------------------------------------------------------------
// The seeds are valid, and the crashes found stay fixed.

#[test]
fn seed_configs_and_blobs_are_valid() {
    for seed in config_seeds() {
        check_accepted_config(&ModelConfig::from_json(seed).unwrap()).unwrap();
    }
    let mut model = micro_model(4);
    for blob in blob_seeds() {
        let before = snapshot(&model);
        let result = model.load_safetensors_bytes(&blob);
        assert!(result.is_ok(), "{result:?}");
        check_load(&model, &before, result, &[&blob]).unwrap();
    }
}

fn with(mut base: Value, key: &str, value: Value) -> Value {
    base[key] = value;
    base
}

fn config_error(value: Value) -> String {
    match ModelConfig::from_json(value) {
        Ok(cfg) => panic!("accepted: {}", facts(&cfg)),
        Err(err) => err.to_string(),
    }
}

/// Found by this suite: sizes whose products overflow i64 were accepted, and building the model then panicked
/// on the overflow (`num_attention_heads * head_dim`).
#[test]
fn a_config_whose_sizes_overflow_is_refused_before_any_model_is_built() {
    let huge = with(micro_config(), "head_dim", json!(1i64 << 62));
    let err = config_error(huge);
    assert!(err.contains("sizes overflow") && err.contains("head_dim 4611686018427387904"), "{err}");
    let err = config_error(with(micro_config(), "vocab_size", json!(i64::MAX)));
    assert!(err.contains("sizes overflow"), "{err}");
}

/// Found by this suite: a context of zero or fewer positions, a negative norm epsilon and RoPE factors that
/// divide by zero were accepted (and gave inf/NaN logits).
#[test]
fn non_positive_context_eps_and_rope_factors_are_refused_naming_the_field() {
    for positions in [0, -1] {
        let err = config_error(with(micro_config(), "max_position_embeddings", json!(positions)));
        assert!(err.contains("`max_position_embeddings` must be positive"), "{err}");
    }
    let err = config_error(with(micro_config(), "rms_norm_eps", json!(-1e-6)));
    assert!(err.contains("`rms_norm_eps` must not be negative"), "{err}");
    let linear = |factor: Value| with(micro_config(), "rope_scaling", json!({"rope_type": "linear", "factor": factor}));
    for factor in [json!(0), json!(-2.0)] {
        let err = config_error(linear(factor));
        assert!(err.contains("`factor` must be positive"), "{err}");
    }
    let llama3 = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 2.0,
        "original_max_position_embeddings": 64});
    let err = config_error(with(micro_config(), "rope_scaling", llama3.clone()));
    assert!(err.contains("`low_freq_factor` and `high_freq_factor` must differ"), "{err}");
    let mut no_context = llama3;
    no_context["high_freq_factor"] = json!(4.0);
    no_context["original_max_position_embeddings"] = json!(-8);
    let err = config_error(with(micro_config(), "rope_scaling", no_context));
    assert!(err.contains("`original_max_position_embeddings` must be positive"), "{err}");
}

/// Found by this suite: type errors said what type was expected but not of which field, and a config.json
/// holding no object named nothing.
#[test]
fn type_errors_name_the_field_and_a_non_object_is_named() {
    let err = config_error(with(micro_config(), "vocab_size", json!(1.5)));
    assert!(err.contains("`vocab_size`: invalid type: floating point `1.5`"), "{err}");
    let err = config_error(with(micro_config(), "architectures", json!("Qwen2ForCausalLM")));
    assert!(err.contains("`architectures`"), "{err}");
    assert_eq!(config_error(json!([1, 2])), "config: config.json must hold a JSON object, not an array");
}

/// Found reading the loader while fuzzing it: the index could name any path (`../x`, `/dev/zero`), and a FIFO
/// where a shard should be blocked the load for ever.
#[test]
fn an_index_naming_a_file_outside_the_directory_or_not_a_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let blob = blob_seeds().remove(0);
    std::fs::write(dir.path().join("outside.safetensors"), &blob).unwrap();
    let checkpoint = dir.path().join("checkpoint");
    std::fs::create_dir(&checkpoint).unwrap();
    let mut model = micro_model(5);
    let names: Vec<String> = model.parameters().into_keys().collect();
    for bad in ["../outside.safetensors", "/dev/zero", "", "."] {
        let index = json!({"weight_map": {names[0].clone(): bad}});
        std::fs::write(checkpoint.join(WEIGHTS_INDEX_FILE), index.to_string()).unwrap();
        let err = model.load_weights(&checkpoint).unwrap_err().to_string();
        assert!(err.contains("is not a file name in the directory"), "{bad:?}: {err}");
    }
    let fifo = checkpoint.join("model-00001-of-00001.safetensors");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success());
    let index = json!({"weight_map": {names[0].clone(): "model-00001-of-00001.safetensors"}});
    std::fs::write(checkpoint.join(WEIGHTS_INDEX_FILE), index.to_string()).unwrap();
    let err = model.load_weights(&checkpoint).unwrap_err().to_string();
    assert!(err.contains("not a regular file"), "{err}");
}
