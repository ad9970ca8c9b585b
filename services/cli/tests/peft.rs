//! LoRA adapters against the real PEFT and transformers (python, CPU, f32): an adapter jetrl writes loads in
//! `PeftModel.from_pretrained` with the log-probs `jetrl logprobs --lora` gives; an adapter PEFT writes loads
//! through `jetrl logprobs --lora` and through a job's `model.lora_adapter_path` with PEFT's log-probs; `jetrl
//! export --merge` writes a model transformers loads with the adapted log-probs. Ignored by a plain `cargo test`
//! (python with transformers and peft is needed); `./dev.sh test` installs both and runs them.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use std::path::{Path, PathBuf};
use std::process::Command;

use jetrl_model::{log_probs_of, CausalLm, DType, LoraSpec, Targets};
use serde_json::Value;
use tch::Device;

const TOL: f64 = 1e-5;

fn python() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let python = std::env::var_os("JETRL_PYTHON").map(PathBuf::from).unwrap_or_else(|| root.join(".venv/bin/python"));
    let check = Command::new(&python).args(["-c", "import transformers, peft"]).output();
    match check {
        Ok(out) if out.status.success() => python,
        other => panic!(
            "this test needs python with transformers and peft ({}): run `scripts/setup.sh transformers peft` \
             (./dev.sh test does) or set JETRL_PYTHON",
            match other {
                Ok(out) => String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or("").to_string(),
                Err(e) => e.to_string(),
            }
        ),
    }
}

/// Runs the reference script; its stdout as JSON (or null when it prints nothing).
fn reference(args: &[&str]) -> Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/peft_reference.py");
    let out = Command::new(python()).arg(script).args(args).output().unwrap();
    assert!(out.status.success(), "peft_reference.py {args:?} failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    if text.trim().is_empty() {
        Value::Null
    } else {
        serde_json::from_str(text.trim().lines().last().unwrap()).unwrap()
    }
}

fn sequences() -> Vec<Vec<u32>> {
    vec![vec![1, 5, 9, 12, 30, 7, 2], vec![3, 44, 17, 8], vec![10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
}

/// `jetrl logprobs --model MODEL [--lora ADAPTER]` on [`sequences`].
fn jetrl_logprobs(model: &Path, lora: Option<&Path>) -> Vec<Vec<f64>> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_jetrl"));
    cmd.args(["logprobs", "--model"]).arg(model);
    if let Some(dir) = lora {
        cmd.arg("--lora").arg(dir);
    }
    let input: String = sequences().iter().map(|ids| format!("{{\"ids\": {ids:?}}}\n")).collect();
    let child = cmd.stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped()).spawn().unwrap();
    std::io::Write::write_all(&mut child.stdin.as_ref().unwrap(), input.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "jetrl logprobs failed");
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_value(serde_json::from_str::<Value>(l).unwrap()["logprobs"].clone()).unwrap())
        .collect()
}

fn max_diff(a: &[Vec<f64>], b: &Value) -> f64 {
    let b: Vec<Vec<f64>> = serde_json::from_value(b.clone()).unwrap();
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(&b)
        .flat_map(|(x, y)| {
            assert_eq!(x.len(), y.len());
            x.iter().zip(y).map(|(p, q)| (p - q).abs())
        })
        .fold(0.0, f64::max)
}

fn ids_json() -> String {
    serde_json::to_string(&sequences()).unwrap()
}

/// A tiny base model (written by jetrl, in HF's layout) in a fresh directory.
fn base(root: &Path) -> PathBuf {
    let dir = root.join("base");
    jetrl_model::init_model("tiny", &dir, 11).unwrap();
    dir
}

#[test]
#[ignore = "slow tier: against peft and transformers (python with both: `./dev.sh test` installs them)"]
fn a_jetrl_adapter_loads_in_peft_and_a_merged_export_in_transformers() {
    let root = tempfile::tempdir().unwrap();
    let base = base(root.path());
    let adapter = root.path().join("adapter");
    tch::manual_seed(5);
    let mut model = CausalLm::load(&base, Device::Cpu, DType::F32).unwrap();
    model.add_lora(&LoraSpec::new(4, 8.0, Targets::AllLinear, vec!["layers.1.mlp.up_proj".into()])).unwrap();
    tch::no_grad(|| {
        for (name, mut t) in model.lora_parameters() {
            if name.contains("lora_B") {
                let _ = t.normal_(0.0, 0.1);
            }
        }
    });
    model.save_lora(&adapter, &base.display().to_string()).unwrap();

    let ours = jetrl_logprobs(&base, Some(&adapter));
    let plain = jetrl_logprobs(&base, None);
    let peft = reference(&["score", base.to_str().unwrap(), adapter.to_str().unwrap(), &ids_json()]);
    let d = max_diff(&ours, &peft);
    println!("jetrl adapter: jetrl logprobs --lora vs PeftModel: max |Δ| {d:.3e}");
    assert!(d <= TOL, "max |Δ| {d} > {TOL}");
    assert!(max_diff(&plain, &peft) > 1e-3, "the adapter changes the log-probs (else the test shows nothing)");
    // the same in process, as the trainer computes them
    let direct: Vec<Vec<f64>> =
        sequences().iter().map(|ids| log_probs_of(&model, ids).unwrap().into_iter().map(f64::from).collect()).collect();
    assert!(max_diff(&direct, &peft) <= TOL);

    let merged = root.path().join("merged");
    let out = Command::new(env!("CARGO_BIN_EXE_jetrl"))
        .args(["export", "--merge", "--model"])
        .arg(&base)
        .arg("--lora")
        .arg(&adapter)
        .arg("--out")
        .arg(&merged)
        .output()
        .unwrap();
    assert!(out.status.success(), "jetrl export failed: {}", String::from_utf8_lossy(&out.stderr));
    assert!(merged.join("tokenizer.json").is_file(), "the export carries the base's tokenizer");
    let transformers = reference(&["score-plain", merged.to_str().unwrap(), &ids_json()]);
    let d = max_diff(&ours, &transformers);
    println!("merged export in transformers vs the adapter: max |Δ| {d:.3e}");
    assert!(d <= TOL, "max |Δ| {d} > {TOL}");
}

#[test]
#[ignore = "slow tier: against peft and transformers (python with both: `./dev.sh test` installs them)"]
fn a_peft_adapter_loads_through_logprobs_and_lora_adapter_path() {
    let root = tempfile::tempdir().unwrap();
    let base = base(root.path());
    let adapter = root.path().join("peft-adapter");
    reference(&["make", base.to_str().unwrap(), adapter.to_str().unwrap()]);
    let peft = reference(&["score", base.to_str().unwrap(), adapter.to_str().unwrap(), &ids_json()]);

    let ours = jetrl_logprobs(&base, Some(&adapter));
    let d = max_diff(&ours, &peft);
    println!("PEFT adapter: jetrl logprobs --lora vs PeftModel: max |Δ| {d:.3e}");
    assert!(d <= TOL, "max |Δ| {d} > {TOL}");
    assert!(max_diff(&jetrl_logprobs(&base, None), &peft) > 1e-3, "the adapter changes the log-probs");

    // a job's model section, as the trainer reads it
    let mut cfg = jetrl_config::ModelConfig {
        path: base.display().to_string(),
        lora_rank: 8,
        lora_alpha: 16.0,
        lora_adapter_path: Some(adapter.display().to_string()),
        ..Default::default()
    };
    let mut model = CausalLm::load(&base, Device::Cpu, DType::F32).unwrap();
    model.attach_configured_lora(&cfg, 0).unwrap();
    let (spec, modules) = model.lora_spec().unwrap();
    assert_eq!((spec.rank, modules.len()), (8, 3 * model.config().num_hidden_layers as usize));
    let direct: Vec<Vec<f64>> =
        sequences().iter().map(|ids| log_probs_of(&model, ids).unwrap().into_iter().map(f64::from).collect()).collect();
    assert!(max_diff(&direct, &peft) <= TOL);
    // a rank that is not the adapter's is refused, naming both
    cfg.lora_rank = 16;
    let mut model = CausalLm::load(&base, Device::Cpu, DType::F32).unwrap();
    let err = model.attach_configured_lora(&cfg, 0).unwrap_err().to_string();
    assert!(err.contains("r 8") && err.contains("lora_rank is 16"), "{err}");
}
