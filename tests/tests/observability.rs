//! What on-call sees of a running job: `jetrl status` (text, `--json`, `--watch`) under the read-only `status`
//! identity, and every service's Prometheus endpoint against the Grafana dashboard. One tiny job, the five
//! services as processes under their own least-privilege identities (deploy/nats/gen.sh), a real nats-server.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use jetrl_bus::publish::Outgoing;
use jetrl_tests::bin;
use jetrl_tests::secure_nats::SecureNats;
use serde_json::Value;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A child process killed on drop.
struct Service(Child);

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The five services of a job, each under its own identity, with its metrics on a known port.
struct Job {
    dir: tempfile::TempDir,
    services: Vec<(String, Service)>,
    /// service binary → its metrics address
    metrics: BTreeMap<&'static str, String>,
}

/// (identity, binary, the section of its `metrics_addr` = its heartbeat's service name)
const SERVICES: [(&str, &str, &str); 5] = [
    ("checkpoint-sync", "jetrl-checkpoint-sync", "checkpoint"),
    ("replay-buffer", "jetrl-replay-buffer", "buffer"),
    ("reward-service", "jetrl-reward-service", "reward"),
    ("rollout-worker", "jetrl-rollout-worker", "rollout"),
    ("trainer", "jetrl-trainer", "trainer"),
];

impl Job {
    fn start(nats: &SecureNats, steps: u32) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let model = dir.path().join("model");
        jetrl_model::init_model("tiny-digits", &model, 1).expect("model");
        let mut job = Self { dir, services: Vec::new(), metrics: BTreeMap::new() };
        // one metrics port per service, chosen together so no two are the same
        let ports = jetrl_bus::harness::free_ports(SERVICES.len()).expect("free ports");
        for ((user, binary, section), port) in SERVICES.into_iter().zip(ports) {
            let addr = format!("127.0.0.1:{port}");
            job.metrics.insert(section, addr.clone());
            let log = std::fs::File::create(job.dir.path().join(format!("{user}.log"))).expect("log");
            let child = Command::new(bin(binary))
                .arg("--config")
                .arg(repo().join("deploy/job.yaml"))
                .args([
                    format!("run.dir={}", job.dir.path().join("run").display()),
                    format!("model.path={}", model.display()),
                    format!("trainer.total_training_steps={steps}"),
                    "trainer.test_freq=-1".into(),
                    "data.train_batch_size=4".into(),
                    "rollout.n=2".into(),
                    "rollout.heartbeat_interval_s=0.5".into(),
                    format!("{section}.metrics_addr={addr}"),
                ])
                .args(nats.overrides(user))
                .env("RUST_LOG", "info")
                .stdin(Stdio::null())
                .stdout(log.try_clone().expect("log"))
                .stderr(log)
                .spawn()
                .expect("spawn");
            job.services.push((user.to_string(), Service(child)));
        }
        job
    }

    fn logs(&self) -> String {
        SERVICES
            .iter()
            .map(|(user, _, _)| {
                let log = std::fs::read_to_string(self.dir.path().join(format!("{user}.log"))).unwrap_or_default();
                format!("----- {user} -----\n{log}\n")
            })
            .collect()
    }

    fn steps_done(&self) -> usize {
        std::fs::read_to_string(self.dir.path().join("run/metrics.jsonl")).unwrap_or_default().lines().count()
    }

    fn wait_for_step(&self, step: usize) {
        let started = Instant::now();
        while self.steps_done() < step {
            assert!(started.elapsed() < Duration::from_secs(240), "step {step} never came:\n{}", self.logs());
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn trainer(&mut self) -> &mut Child {
        &mut self.services.iter_mut().find(|(u, _)| u == "trainer").expect("trainer").1 .0
    }
}

/// Runs `jetrl status` with the status identity and `args`.
fn status(nats: &SecureNats, args: &[&str]) -> (bool, String) {
    let out = Command::new(bin("jetrl"))
        .arg("status")
        .arg("--config")
        .arg(nats.identity_file("status"))
        .args(args)
        .output()
        .expect("jetrl status");
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

/// Runs `jetrl status --watch` for `for_s` seconds; returns its output.
fn watch(nats: &SecureNats, args: &[&str], for_s: f64) -> String {
    let mut child = Command::new(bin("jetrl"))
        .arg("status")
        .arg("--config")
        .arg(nats.identity_file("status"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("jetrl status --watch");
    std::thread::sleep(Duration::from_secs_f64(for_s));
    assert!(child.try_wait().expect("try_wait").is_none(), "--watch exited by itself");
    let _ = child.kill();
    let out = child.wait_with_output().expect("output");
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// The sample names of a Prometheus text exposition, with the label sets each appears with.
fn exported(body: &str) -> BTreeMap<String, Vec<BTreeMap<String, String>>> {
    let mut out: BTreeMap<String, Vec<BTreeMap<String, String>>> = BTreeMap::new();
    for line in body.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()) {
        let end = line.find(['{', ' ']).unwrap_or(line.len());
        let name = line[..end].to_string();
        let mut labels = BTreeMap::new();
        if line[end..].starts_with('{') {
            let inner = &line[end + 1..line.find('}').unwrap_or(line.len())];
            for pair in inner.split("\",") {
                if let Some((k, v)) = pair.split_once("=\"") {
                    labels.insert(k.trim().to_string(), v.trim_end_matches('"').to_string());
                }
            }
        }
        out.entry(name).or_default().push(labels);
    }
    out
}

/// A selector in a PromQL expression: a metric name (or a `__name__=~` regex) and its equality label matchers.
#[derive(Debug)]
struct Selector {
    name: Option<String>,
    name_regex: Option<String>,
    labels: BTreeMap<String, String>,
}

/// Every selector of a PromQL expression (metric names are the identifiers that start with `jetrl_`, as every
/// jetrl metric does; a bare `{__name__=~"..."}` selector counts too).
fn selectors(expr: &str) -> Vec<Selector> {
    let mut out = Vec::new();
    let bytes = expr.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let rest = &expr[i..];
        let starts_name =
            rest.starts_with("jetrl_") && (i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_'));
        if starts_name || rest.starts_with("{__name__") {
            let name_len = if starts_name {
                rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(rest.len())
            } else {
                0
            };
            let name = starts_name.then(|| rest[..name_len].to_string());
            let mut labels = BTreeMap::new();
            let mut name_regex = None;
            let after = &rest[name_len..];
            let mut consumed = name_len;
            if after.starts_with('{') {
                let close = after.find('}').expect("closing brace");
                for matcher in after[1..close].split(',').filter(|m| !m.trim().is_empty()) {
                    if let Some((k, v)) = matcher.split_once("=~") {
                        if k.trim() == "__name__" {
                            name_regex = Some(v.trim().trim_matches('"').to_string());
                        }
                    } else if let Some((k, v)) = matcher.split_once('=') {
                        labels.insert(k.trim().to_string(), v.trim().trim_matches('"').to_string());
                    }
                }
                consumed += close + 1;
            }
            out.push(Selector { name, name_regex, labels });
            i += consumed.max(1);
        } else {
            i += 1;
        }
    }
    out
}

/// `pattern` (a PromQL `=~` regex over the whole name, only `.` and `.*` used) matches `name`.
fn regex_matches(pattern: &str, name: &str) -> bool {
    match pattern.split_once(".*") {
        Some((prefix, suffix)) => {
            name.len() >= prefix.len() + suffix.len() && name.starts_with(prefix) && name.ends_with(suffix)
        }
        None => pattern == name,
    }
}

async fn scrape(addr: &str) -> String {
    jetrl_telemetry::scrape(addr.parse().expect("address")).await.unwrap_or_default()
}

/// Steps of the job: enough that the trainer is still running while everything is checked.
const STEPS: u64 = 24;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetrl_status_and_the_dashboard_show_a_running_job() {
    let nats = SecureNats::start();
    let mut job = Job::start(&nats, STEPS as u32);
    tokio::task::block_in_place(|| job.wait_for_step(1));

    // Messages the services refuse (sent as admin: no service identity may send them), so that the malformed
    // and failure counters the dashboard plots exist.
    let admin = nats.connect("admin").await;
    let names = admin.names().clone();
    let garbage = Bytes::from_static(&[0xff, 0xff, 0xff, 0x01]);
    admin.publish_durable(Outgoing::new(names.prompt_subject("train"), None, garbage.clone())).await.unwrap();
    admin.publish_durable(Outgoing::new(names.score_subject("train", "junk"), None, garbage)).await.unwrap();

    // every metric the dashboard's queries name is exported by some service
    let dashboard: Value =
        serde_json::from_str(&std::fs::read_to_string(repo().join("deploy/grafana/dashboards/jetrl.json")).unwrap())
            .unwrap();
    let exprs: Vec<String> = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().unwrap().iter().map(|t| t["expr"].as_str().unwrap().to_string()))
        .collect();
    assert!(exprs.len() >= 12, "{exprs:?}");
    // what any service exported at any scrape (a counter appears once it counts)
    let mut all = BTreeMap::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        for addr in job.metrics.values() {
            for (name, series) in exported(&scrape(addr).await) {
                all.entry(name).or_insert_with(Vec::new).extend(series);
            }
        }
        let missing: Vec<String> = exprs
            .iter()
            .flat_map(|expr| selectors(expr).into_iter().map(move |sel| (expr, sel)))
            .filter(|(_, sel)| {
                let candidates: Vec<&Vec<BTreeMap<String, String>>> = match (&sel.name, &sel.name_regex) {
                    (Some(name), _) => all.get(name).into_iter().collect(),
                    (None, Some(re)) => all.iter().filter(|(n, _)| regex_matches(re, n)).map(|(_, s)| s).collect(),
                    (None, None) => Vec::new(),
                };
                !candidates
                    .iter()
                    .flat_map(|s| s.iter())
                    .any(|labels| sel.labels.iter().all(|(k, v)| labels.get(k) == Some(v)))
            })
            .map(|(expr, sel)| format!("{sel:?} in {expr}"))
            .collect();
        if missing.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the dashboard queries metrics no service exports:\n{}\nexported: {:?}",
            missing.join("\n"),
            all.keys().collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(job.steps_done() < STEPS as usize, "the trainer finished before its metrics were checked");

    // --json: one object with everything on-call needs. The trainer's heartbeat is written every
    // `heartbeat_interval_s` (0.5 s here), so the beat read just after step 1 may be one from before it: the
    // status is read until the heartbeat shows a finished step (a trainer whose beats never carry a step fails).
    let deadline = Instant::now() + Duration::from_secs(10);
    let s = loop {
        let (ok, text) = status(&nats, &["--json"]);
        assert!(ok, "jetrl status --json:\n{text}\n{}", job.logs());
        let s: Value =
            serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("not one JSON object ({e}):\n{text}"));
        if s["trainer"]["step"].as_u64().is_some_and(|step| step >= 1) || Instant::now() > deadline {
            break s;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(s["job"], "jetrl");
    let trainer = &s["trainer"];
    assert!(trainer["step"].as_u64().unwrap() >= 1 && trainer["total_steps"] == STEPS, "{trainer}");
    assert!(trainer["step_seconds"].as_f64().unwrap() > 0.0 && trainer["reward"].is_number(), "{trainer}");
    assert!(trainer["steps_per_s"].as_f64().unwrap() > 0.0, "{trainer}");
    assert_eq!(s["health"]["ok"], true, "{}\n{}", s["health"], job.logs());
    let services: BTreeSet<&str> =
        s["services"].as_array().unwrap().iter().map(|v| v["service"].as_str().unwrap()).collect();
    assert_eq!(services, SERVICES.iter().map(|(_, _, section)| *section).collect(), "every service heartbeats");
    assert!(s["groups"]["sampled"].as_u64().unwrap() >= 4, "{}", s["groups"]);
    let trained: u64 = s["staleness"]["trained"].as_object().unwrap().values().map(|n| n.as_u64().unwrap()).sum();
    assert!(trained >= 4, "{}", s["staleness"]);
    let workers: Vec<&Value> = s["weight_versions"].as_object().unwrap().values().collect();
    assert_eq!(workers.iter().map(|w| w.as_array().unwrap().len()).sum::<usize>(), 1, "{}", s["weight_versions"]);
    let consumers = s["consumers"].as_array().unwrap();
    assert_eq!(consumers.len(), 2);
    for c in consumers {
        assert!(c.get("error").is_none() && c["num_pending"].is_u64() && c["num_ack_pending"].is_u64(), "{c}");
    }
    assert_eq!(s["dead_letters"]["stream"], "JETRL_jetrl_DLQ");
    assert_eq!(s["dead_letters"]["exists"], true, "{}", s["dead_letters"]);
    let streams = s["streams"].as_array().unwrap();
    assert_eq!(streams.len(), 11);
    assert!(streams.iter().all(|st| st.get("error").is_none() && st["replicas"] == 1), "{streams:?}");

    // the text form, and --watch refreshing (JSON lines with --json)
    let (ok, text) = status(&nats, &[]);
    assert!(ok, "{text}");
    for needed in ["trainer: step ", "health: ok", "services:", "staleness (steps behind", "consumers:", "streams:"] {
        assert!(text.contains(needed), "jetrl status lacks {needed:?}:\n{text}");
    }
    let lines = watch(&nats, &["--json", "--watch", "0.3"], 2.5);
    let snapshots: Vec<Value> = lines.lines().map(|l| serde_json::from_str(l).expect("a JSON line")).collect();
    assert!(snapshots.len() >= 3, "--watch 0.3 for 2.5 s printed {} snapshots:\n{lines}", snapshots.len());
    assert!(snapshots.windows(2).all(|w| w[0]["unix_ms"].as_i64() < w[1]["unix_ms"].as_i64()), "refreshed");

    let started = Instant::now();
    let exit = loop {
        if let Some(exit) = job.trainer().try_wait().unwrap() {
            break exit;
        }
        assert!(started.elapsed() < Duration::from_secs(240), "the trainer did not finish");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(exit.success(), "the trainer failed:\n{}", job.logs());
    assert!(nats.violations().is_empty(), "refused: {:?}", nats.violations());
    // a trainer that finished says so in its last heartbeat, with its last step
    let (_, text) = status(&nats, &["--json"]);
    let s: Value = serde_json::from_str(text.trim()).unwrap();
    let trainer = s["services"].as_array().unwrap().iter().find(|v| v["service"] == "trainer").cloned();
    assert_eq!(trainer.map(|t| t["state"].clone()), Some(Value::from("stopped")), "{text}");
    assert_eq!(s["trainer"]["step"], STEPS, "{text}");
}

#[test]
fn dashboard_selectors_are_read_from_promql() {
    let sel = selectors(r#"histogram_quantile(0.9, sum by (le) (rate(jetrl_rollout_weight_swap_seconds_bucket[5m])))"#);
    assert_eq!(sel.len(), 1);
    assert_eq!(sel[0].name.as_deref(), Some("jetrl_rollout_weight_swap_seconds_bucket"));
    let sel = selectors(r#"jetrl_trainer_metric{name="timing_s/update_weights"}"#);
    assert_eq!(sel[0].labels.get("name").map(String::as_str), Some("timing_s/update_weights"));
    let sel = selectors(r#"sum by (source) ({__name__=~"jetrl_.*_malformed_messages_total"})"#);
    assert_eq!(sel.len(), 1);
    assert_eq!(sel[0].name_regex.as_deref(), Some("jetrl_.*_malformed_messages_total"));
    assert!(regex_matches("jetrl_.*_malformed_messages_total", "jetrl_reward_malformed_messages_total"));
    assert!(!regex_matches("jetrl_.*_malformed_messages_total", "jetrl_reward_failures_total"));
    let body = "# TYPE x counter\nx{a=\"1\",b=\"2\"} 3\ny 1\n";
    let e = exported(body);
    assert_eq!(e["x"][0].get("b").map(String::as_str), Some("2"));
    assert!(e.contains_key("y"));
}
