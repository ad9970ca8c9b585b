//! Fuzzing the job configuration loader with proptest: YAML job files (random, byte-mutated, and structurally
//! mutated from the demo job, the deployment job and a dump of every key with its default) and `key=value`
//! overrides (paths of real keys and mangled ones, YAML values of every kind), through `load_value` and
//! `JobConfig::load` (typing and validation).
//!
//! Properties: no panic, bounded time, an error that names the file, the override or the key path it is about,
//! and an override of a real key reads back exactly as the YAML value it was given.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

#[path = "../../wire/tests/fuzz_support/json.rs"]
mod json_mutate;
#[path = "../../wire/tests/fuzz_support/bytes.rs"]
mod mutate;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use jetrl_config::{load_value, ConfigError, JobConfig};
use proptest::prelude::*;
use serde_json::Value;

fn config() -> ProptestConfig {
    mutate::fuzz_config(concat!(env!("CARGO_MANIFEST_DIR"), "/proptest-regressions/fuzz.txt"))
}

fn repo_file(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(relative)
}

/// Every key of a job with its default value, as YAML.
fn default_job_yaml() -> String {
    serde_yaml::to_string(&JobConfig::default()).expect("the default job serialises")
}

fn seed_texts() -> Vec<String> {
    let mut texts = vec![default_job_yaml()];
    for file in ["configs/demo.yaml", "deploy/job.yaml"] {
        texts.push(std::fs::read_to_string(repo_file(file)).expect("a job file of the repository"));
    }
    texts
}

fn seed_values() -> Vec<Value> {
    seed_texts().iter().map(|t| serde_yaml::from_str(t).expect("seed job files are YAML")).collect()
}

/// Top-level sections: an error's key path starts with one of these (or is `<root>`).
fn sections() -> Vec<String> {
    match serde_json::to_value(JobConfig::default()) {
        Ok(Value::Object(map)) => map.keys().cloned().collect(),
        _ => Vec::new(),
    }
}

/// Dotted paths of every leaf of the default job (what an override can name).
fn leaf_paths() -> Vec<String> {
    fn walk(value: &Value, at: &str, out: &mut Vec<String>) {
        match value {
            Value::Object(map) if !map.is_empty() => {
                for (key, child) in map {
                    let path = if at.is_empty() { key.clone() } else { format!("{at}.{key}") };
                    walk(child, &path, out);
                }
            }
            _ => out.push(at.to_string()),
        }
    }
    let mut out = Vec::new();
    walk(&serde_json::to_value(JobConfig::default()).unwrap_or_default(), "", &mut out);
    out
}

const YAML_TOKENS: &[&[u8]] = &[
    b":",
    b": ",
    b"- ",
    b"\n",
    b"\n  ",
    b"  ",
    b"\t",
    b"#",
    b"{",
    b"}",
    b"[",
    b"]",
    b",",
    b"&a ",
    b"*a",
    b"<<: *a",
    b"!!binary ",
    b"!!str ",
    b"!!int ",
    b"!custom ",
    b"---\n",
    b"...\n",
    b"|\n",
    b">-\n",
    b"'",
    b"\"",
    b"~",
    b"null",
    b"true",
    b"yes",
    b"0x1f",
    b"0o17",
    b"1e999",
    b".nan",
    b".inf",
    b"-.inf",
    b"18446744073709551616",
    b"-1",
    b"%YAML 1.2\n",
    b"? ",
    b"\xef\xbb\xbf",
    b"\xff",
    b"\x00",
];

const OVERRIDE_VALUES: &[&str] = &[
    "3",
    "-1",
    "0",
    "1e-4",
    "1e999",
    ".nan",
    ".inf",
    "true",
    "yes",
    "null",
    "~",
    "",
    "[1, 2]",
    "{a: 1}",
    "'quoted'",
    "\"\"",
    "&a x",
    "*a",
    "!!binary aGk=",
    "18446744073709551616",
    "-9223372036854775809",
    "sync",
    "drop",
    "grpo",
    "object_store",
    "[",
    "{",
    "a: b: c",
    "- x",
    "x\ny",
    "{{ x }}",
    "=",
    "a=b",
    "[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]",
];

fn yaml_input() -> impl Strategy<Value = String> {
    let texts: Vec<Vec<u8>> = seed_texts().into_iter().map(String::into_bytes).collect();
    let structural = json_mutate::json_mutated(seed_values())
        .prop_map(|value| serde_yaml::to_string(&value).unwrap_or_else(|e| format!("# {e}")));
    // JSON is YAML in flow style: structural mutations written that way nest flow collections
    let flow = json_mutate::json_mutated(seed_values()).prop_map(|value| value.to_string());
    prop_oneof![
        1 => mutate::random_bytes(200).prop_map(|b| mutate::lossy(&b)),
        3 => mutate::mutated(texts, YAML_TOKENS).prop_map(|b| mutate::lossy(&b)),
        3 => structural,
        1 => flow,
    ]
}

fn override_input() -> impl Strategy<Value = String> {
    let value = prop_oneof![
        3 => proptest::sample::select(OVERRIDE_VALUES).prop_map(str::to_string),
        1 => any::<String>(),
        1 => any::<i64>().prop_map(|v| v.to_string()),
        1 => any::<f64>().prop_map(|v| v.to_string()),
    ];
    let key = prop_oneof![
        4 => proptest::sample::select(leaf_paths()),
        1 => "[a-z_.]{0,20}",
        1 => any::<String>(),
        1 => proptest::sample::select(leaf_paths()).prop_map(|p| format!("{p}.extra")),
        1 => proptest::sample::select(leaf_paths()).prop_map(|p| format!(" {p} ")),
    ];
    prop_oneof![
        6 => (key, value).prop_map(|(k, v)| format!("{k}={v}")),
        1 => any::<String>(),
    ]
}

/// Where the cases of one test write their job file.
struct JobFile(mutate::Scratch);

impl JobFile {
    fn new() -> Self {
        JobFile(mutate::Scratch::new())
    }

    fn write(&self, text: &str) -> PathBuf {
        let path = self.0.next_dir().join("job.yaml");
        std::fs::write(&path, text).expect("writing the job file");
        path
    }
}

/// Every error names what it is about: the file, the override, or a key path under a real section.
fn check_error(err: &ConfigError, file: &Path, overrides: &[String], sections: &[String]) -> Result<(), TestCaseError> {
    let text = err.to_string();
    match err {
        ConfigError::Read { path, message } => {
            prop_assert_eq!(path, &file.display().to_string());
            prop_assert!(!message.is_empty());
        }
        ConfigError::BadOverride(item) => prop_assert!(overrides.contains(item), "{}", text),
        ConfigError::Merge(message) => prop_assert!(!message.is_empty()),
        ConfigError::Invalid { path, message } => {
            // The path of an unknown key is the key itself (quoted in the message); any other path starts at a
            // section.
            let section = path.split(['.', '[']).next().unwrap_or_default();
            let unknown_key = message.starts_with("unknown field") && message.contains(&format!("`{path}`"));
            prop_assert!(
                path == "<root>" || sections.iter().any(|s| s == section) || unknown_key,
                "the key path {:?} is under no section: {}",
                path,
                text
            );
            prop_assert!(!message.is_empty(), "{}", text);
        }
    }
    Ok(())
}

/// A case must finish well within this (a hang shows up as a failure naming the input, not a stuck suite).
const CASE_LIMIT: Duration = Duration::from_secs(5);

proptest! {
    #![proptest_config(config())]

    #[test]
    fn job_files_and_overrides_load_or_name_the_problem(
        yaml in yaml_input(),
        overrides in proptest::collection::vec(override_input(), 0..3),
    ) {
        thread_local!(static FILE: JobFile = JobFile::new());
        let sections = sections();
        FILE.with(|job| {
            let file = job.write(&yaml);
            let started = Instant::now();
            let typed = JobConfig::load(Some(&file), &overrides);
            prop_assert!(started.elapsed() < CASE_LIMIT, "took {:?}", started.elapsed());
            if let Err(err) = &typed {
                check_error(err, &file, &overrides, &sections)?;
            }
            Ok(())
        })?;
    }

    #[test]
    fn an_override_of_a_real_key_reads_back_as_its_yaml_value(
        path in prop_oneof![
            4 => proptest::sample::select(leaf_paths()),
            // a free-form map: user keys keep their spelling
            1 => "reward\\.reward_kwargs\\.[A-Za-z][A-Za-z0-9_]{0,8}",
        ],
        value in prop_oneof![
            proptest::sample::select(OVERRIDE_VALUES).prop_map(str::to_string),
            any::<i64>().prop_map(|v| v.to_string()),
            "[a-z][a-z_]{0,10}",
        ],
    ) {
        let item = format!("{path}={value}");
        match load_value(None, std::slice::from_ref(&item)) {
            Ok(merged) => {
                let pointer = format!("/{}", path.replace('.', "/"));
                let expected: Value = match serde_yaml::from_str::<serde_yaml::Value>(&value) {
                    Ok(yaml) => serde_json::to_value(yaml).unwrap_or(Value::String(value.clone())),
                    Err(_) => Value::String(value.clone()),
                };
                prop_assert_eq!(merged.pointer(&pointer), Some(&expected), "override {:?}", item);
            }
            Err(err) => check_error(&err, Path::new(""), std::slice::from_ref(&item), &sections())?,
        }
    }
}

#[test]
fn seed_job_files_load() {
    let job = JobFile::new();
    for text in seed_texts().iter().skip(1) {
        JobConfig::load(Some(&job.write(text)), &[]).unwrap();
    }
}

/// YAML whose aliases expand to 9^9 nodes (the "billion laughs").
fn alias_bomb() -> String {
    let mut yaml = String::from("l0: &l0 [x, x, x, x, x, x, x, x, x]\n");
    for level in 1..9 {
        let refs = vec![format!("*l{}", level - 1); 9].join(", ");
        yaml.push_str(&format!("l{level}: &l{level} [{refs}]\n"));
    }
    yaml
}

#[test]
fn an_alias_bomb_in_a_job_file_or_an_override_is_refused_quickly() {
    let job = JobFile::new();
    let started = Instant::now();
    let err = JobConfig::load(Some(&job.write(&alias_bomb())), &[]).unwrap_err();
    assert!(matches!(err, ConfigError::Read { .. }), "{err}");
    let bomb_value = alias_bomb().replace('\n', ", ");
    let item = format!("reward.reward_kwargs.x={{{bomb_value}}}");
    let result = JobConfig::load(Some(&job.write("data: {task: {name: copy}}\n")), std::slice::from_ref(&item));
    assert!(started.elapsed() < CASE_LIMIT, "took {:?}", started.elapsed());
    let err = result.unwrap_err();
    assert!(err.to_string().contains("reward.reward_kwargs"), "{err}");
}

/// Found by this suite: serde_yaml's parser takes time quadratic in the nesting of flow collections, so a
/// 200 KB job file of `[[[…` took 80 s to be refused; yaml-rust2 now refuses it first.
#[test]
fn deeply_nested_yaml_is_refused_quickly() {
    let job = JobFile::new();
    for depth in [200, 100_000] {
        for (open, close) in [("[", "]"), ("{a: ", "}")] {
            let nested = format!("{}{}", open.repeat(depth), close.repeat(depth));
            let started = Instant::now();
            let err = JobConfig::load(Some(&job.write(&format!("reward:\n  reward_kwargs:\n    x: {nested}\n"))), &[])
                .unwrap_err();
            assert!(matches!(&err, ConfigError::Read { path, .. } if path.ends_with("job.yaml")), "{err}");
            assert!(err.to_string().contains("recursion limit exceeded"), "depth {depth}: {err}");
            // too deep for YAML, an override value is taken as text, as any value that is not YAML
            let merged = load_value(None, &[format!("reward.reward_kwargs.x={nested}")]).unwrap();
            assert!(merged["reward"]["reward_kwargs"]["x"].is_string() || depth == 200);
            assert!(started.elapsed() < CASE_LIMIT, "{open} x {depth} took {:?}", started.elapsed());
        }
    }
}
