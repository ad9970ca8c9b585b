//! Shared helpers for the integration tests: reference files, the python+transformers toolchain (needed only by
//! the `#[ignore]`d tests that `./dev.sh test` runs), and comparisons against transformers' log-probs.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use jetrl_model::{log_probs_of, token_log_probs, CausalLm, DType, Tokenizer};
use serde::Deserialize;
use tch::{Device, Kind, Tensor};

/// The tolerance the golden README sets for f32 CPU log-probs.
pub const LOGPROB_TOL: f32 = 1e-4;

pub fn repo_root() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join("..");
    root.canonicalize().unwrap_or(root)
}

/// `tests/golden/hf-sample/llama`, written by transformers 5.
pub fn hf_sample_llama() -> PathBuf {
    repo_root().join("tests/golden/hf-sample/llama")
}

#[derive(Deserialize)]
pub struct ChatCase {
    /// minijinja values keep object keys in file order, as Python's dicts do.
    pub messages: Vec<minijinja::Value>,
    #[serde(default)]
    pub tools: Option<Vec<minijinja::Value>>,
    pub add_generation_prompt: bool,
    pub ids: Vec<u32>,
}

#[derive(Deserialize)]
pub struct Reference {
    pub sequences: Vec<Vec<u32>>,
    pub logprobs: Vec<Vec<f32>>,
    #[serde(default)]
    pub chat: Vec<ChatCase>,
    /// transformers' load-balancing loss of each sequence's forward (MoE checkpoints)
    #[serde(default)]
    pub aux_loss: Vec<f32>,
}

pub fn read_reference(dir: &Path) -> Reference {
    let text = std::fs::read_to_string(dir.join("reference.json")).expect("reference.json");
    serde_json::from_str(&text).expect("reference.json parses")
}

/// Max and mean absolute difference over all values.
#[derive(Debug, Default, Clone, Copy)]
pub struct Diff {
    pub max: f32,
    pub mean: f32,
    pub count: usize,
}

pub fn diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> Diff {
    assert_eq!(a.len(), b.len(), "different number of sequences");
    let mut d = Diff::default();
    let mut sum = 0.0f64;
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.len(), y.len(), "different sequence lengths");
        for (p, q) in x.iter().zip(y) {
            let e = (p - q).abs();
            d.max = d.max.max(e);
            sum += f64::from(e);
            d.count += 1;
        }
    }
    d.mean = if d.count > 0 { (sum / d.count as f64) as f32 } else { 0.0 };
    d
}

/// Log-probs of every reference sequence, one unpadded sequence at a time.
pub fn per_sequence_logprobs(model: &CausalLm, sequences: &[Vec<u32>]) -> Vec<Vec<f32>> {
    sequences.iter().map(|ids| log_probs_of(model, ids).expect("log_probs_of")).collect()
}

/// Log-probs of all sequences run as one padded batch (left or right padding), read back at real positions.
pub fn batched_logprobs(model: &CausalLm, sequences: &[Vec<u32>], left_pad: bool) -> Vec<Vec<f32>> {
    let width = sequences.iter().map(Vec::len).max().unwrap_or(0);
    let b = sequences.len();
    let mut ids = vec![0i64; b * width];
    let mut mask = vec![0i64; b * width];
    for (r, seq) in sequences.iter().enumerate() {
        let start = if left_pad { width - seq.len() } else { 0 };
        for (j, &id) in seq.iter().enumerate() {
            ids[r * width + start + j] = i64::from(id);
            mask[r * width + start + j] = 1;
        }
    }
    let ids = Tensor::from_slice(&ids).view([b as i64, width as i64]);
    let mask = Tensor::from_slice(&mask).view([b as i64, width as i64]);
    let logits = tch::no_grad(|| model.forward(&ids, &mask)).expect("forward");
    assert!(bool::try_from(logits.isfinite().all()).unwrap(), "padded rows produced non-finite logits");
    let lp = token_log_probs(&logits, &ids, 1.0).expect("token_log_probs");
    sequences
        .iter()
        .enumerate()
        .map(|(r, seq)| {
            let start = if left_pad { width - seq.len() } else { 0 };
            (0..seq.len().saturating_sub(1)).map(|j| lp.double_value(&[r as i64, (start + j) as i64]) as f32).collect()
        })
        .collect()
}

/// Loads `dir` on the CPU in f32 and checks it against its `reference.json`: per-sequence and padded-batch
/// log-probs within [`LOGPROB_TOL`], chat ids exactly. Returns the per-sequence diff.
pub fn check_against_reference(dir: &Path) -> Diff {
    let reference = read_reference(dir);
    let model = CausalLm::load(dir, Device::Cpu, DType::F32).expect("model loads");
    let ours = per_sequence_logprobs(&model, &reference.sequences);
    let d = diff(&ours, &reference.logprobs);
    println!("{}: per-sequence |Δlogprob| max {:.3e} mean {:.3e} over {}", dir.display(), d.max, d.mean, d.count);
    assert!(d.max <= LOGPROB_TOL, "{}: max |Δ| {} > {LOGPROB_TOL}", dir.display(), d.max);
    for left in [true, false] {
        let batched = batched_logprobs(&model, &reference.sequences, left);
        let db = diff(&batched, &reference.logprobs);
        println!("  padded batch (left={left}): max {:.3e} mean {:.3e}", db.max, db.mean);
        assert!(db.max <= LOGPROB_TOL, "{} padded (left={left}): max |Δ| {}", dir.display(), db.max);
    }
    if !reference.chat.is_empty() {
        let tokenizer = Tokenizer::from_dir(dir).expect("tokenizer loads");
        for (i, case) in reference.chat.iter().enumerate() {
            let ids = match &case.tools {
                Some(tools) => {
                    tokenizer.apply_chat_template_with_tools(&case.messages, tools, case.add_generation_prompt)
                }
                None => tokenizer.apply_chat_template(&case.messages, case.add_generation_prompt),
            }
            .expect("chat template renders");
            if ids != case.ids {
                let ours = tokenizer.decode(&ids, false).unwrap_or_default();
                let theirs = tokenizer.decode(&case.ids, false).unwrap_or_default();
                panic!("{} chat case {i}: ids differ\nours:   {ours:?}\ntheirs: {theirs:?}", dir.display());
            }
        }
    }
    d
}

/// The project's python, which must import transformers: the tests that call this are `#[ignore]`d (so a plain
/// `cargo test` counts them as ignored) and `./dev.sh test`, which installs transformers, runs them with
/// `--include-ignored`. Asked for and missing is a failure, never a silent pass.
pub fn python_with_transformers() -> PathBuf {
    static PYTHON: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let found = PYTHON.get_or_init(|| {
        let python =
            std::env::var_os("JETRL_PYTHON").map(PathBuf::from).unwrap_or_else(|| repo_root().join(".venv/bin/python"));
        match Command::new(&python).args(["-c", "import transformers"]).output() {
            Ok(out) if out.status.success() => Ok(python),
            Ok(out) => Err(format!(
                "`{} -c \"import transformers\"` failed: {}",
                python.display(),
                String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or("")
            )),
            Err(err) => Err(format!("cannot run {}: {err}", python.display())),
        }
    });
    match found {
        Ok(python) => python.clone(),
        Err(why) => panic!(
            "this test needs python with transformers ({why}): run `scripts/setup.sh transformers` (./dev.sh test does) \
             or set JETRL_PYTHON"
        ),
    }
}

pub fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/make_hf_checkpoints.py")
}

/// Builds the transformers reference checkpoints once per test binary (reused across runs while the script is
/// unchanged). Needs python with transformers ([`python_with_transformers`]).
pub fn hf_checkpoints() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let python = python_with_transformers();
        let source = std::fs::read(script()).expect("script readable");
        let stamp = format!("{:016x}", fnv1a(&source));
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("hf-checkpoints");
        let stamp_file = dir.join("STAMP");
        if std::fs::read_to_string(&stamp_file).ok().as_deref() == Some(stamp.as_str()) {
            return dir;
        }
        let _ = std::fs::remove_dir_all(&dir);
        let out = Command::new(&python).arg(script()).arg("build").arg(&dir).output().expect("python runs");
        assert!(out.status.success(), "make_hf_checkpoints.py build failed:\n{}", String::from_utf8_lossy(&out.stderr));
        std::fs::write(&stamp_file, stamp).expect("stamp written");
        dir
    })
    .clone()
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf29ce484222325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100000001b3))
}

/// Tensor → Vec<f32> helper.
pub fn to_vec(t: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(t.to_kind(Kind::Float).flatten(0, -1)).expect("f32 vector")
}
