//! `trainer.logger` against the real things: a real `mlflow server` (sqlite store and proxied artifacts in a
//! temporary directory) read back through MLflow's own Python client, wandb in offline mode read back from its
//! run file, TensorBoard's event files read back by the `tensorboard` package's own reader, and verl's `file`
//! logger. Each job is the shortest of the suite (the tiny model, a few steps, the five
//! services as processes on a real nats-server). A tracker that is down must not stop training: the MLflow server
//! is killed in the middle of a second job, which must finish and say what it lost.
//!
//! The MLflow, wandb and TensorBoard tests need the repository's Python (`.venv`) with `mlflow` (the server too),
//! `wandb` and `tensorboard`: `./dev.sh test` installs them. Without them a test fails, saying what to install.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use jetrl_tests::{bin, TestJob};
use serde_json::Value;

/// The repository's Python when it has one, else `python3`.
fn python() -> PathBuf {
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python");
    if venv.exists() {
        venv
    } else {
        PathBuf::from("python3")
    }
}

/// Fails the test unless `python()` imports every module of `modules`.
fn require_python(modules: &str) {
    let out = Command::new(python()).args(["-c", &format!("import {modules}")]).output().unwrap();
    assert!(
        out.status.success(),
        "{} cannot import {modules} (`./dev.sh test` installs what the suite needs):\n{}",
        python().display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The job of every test here: the base test job (tiny model, reverse-4 task, batch 8 × 4 samples) with
/// `steps` steps and `logger`.
fn job(steps: u32, logger: &str) -> TestJob {
    job_with(steps, logger, "")
}

/// [`job`] with more `trainer` keys (`extra`, `key: value, …`).
fn job_with(steps: u32, logger: &str, extra: &str) -> TestJob {
    TestJob::new(&format!(
        "trainer: {{total_training_steps: {steps}, logger: {logger}, project_name: jetrl-trackers, \
         experiment_name: tracked, {extra}}}"
    ))
}

/// How many validation generations the validating jobs hand their trackers (`trainer.log_val_generations`).
const VAL_GENERATIONS: usize = 3;

/// The trainer keys of a job that validates after steps 2 and 3 (`test_freq` 2, and the last step), dumps every
/// validation generation to `dump` (`validation_data_dir`) and hands [`VAL_GENERATIONS`] to the trackers.
fn validating(dump: &Path) -> String {
    format!("test_freq: 2, log_val_generations: {VAL_GENERATIONS}, validation_data_dir: \"{}\"", dump.display())
}

/// verl's `_maybe_log_val_generations` pick, its own code (numpy's seeded shuffle) over the generations a
/// validation dumped (`<validation_data_dir>/<step>.jsonl`): `[[input, output, score], …]`.
const VERL_PICK: &str = r#"
import json, sys
import numpy as np
rows = [json.loads(line) for line in open(sys.argv[1])]
samples = list(zip([r["input"] for r in rows], [r["output"] for r in rows], [r["score"] for r in rows]))
samples.sort(key=lambda x: x[0])
rng = np.random.RandomState(42)
rng.shuffle(samples)
print(json.dumps({"rows": len(rows), "picked": samples[:int(sys.argv[2])]}))
"#;

/// The validation generations verl would log at `step` of a job run with [`validating`]`(dump)`, after
/// checking that the dump holds every validation prompt's generation.
fn verl_pick(job: &TestJob, dump: &Path, step: u64) -> Vec<Value> {
    let file = dump.join(format!("{step}.jsonl"));
    let pick = python_json(VERL_PICK, &[file.to_str().unwrap(), &VAL_GENERATIONS.to_string()], &[]);
    assert_eq!(
        pick["rows"],
        job.config().data.task.unwrap().val_size,
        "{} holds every validation prompt",
        file.display()
    );
    pick["picked"].as_array().unwrap().clone()
}

/// The trainer of `job` as a process with `env` added; its log is `<job dir>/trainer.log`.
fn spawn_trainer(job: &TestJob, env: &[(&str, OsString)]) -> Child {
    let log = std::fs::File::create(job.dir.path().join("trainer.log")).unwrap();
    let mut command = Command::new(bin("jetrl-trainer"));
    command.arg("--config").arg(&job.config).env("RUST_LOG", "info");
    for (key, value) in env {
        command.env(key, value);
    }
    command.stdin(Stdio::null()).stdout(log.try_clone().unwrap()).stderr(log).spawn().unwrap()
}

/// Waits for the trainer to exit; kills it and fails with its log after `timeout`.
fn wait_trainer(job: &TestJob, trainer: &mut Child, timeout: Duration) -> ExitStatus {
    let started = Instant::now();
    loop {
        if let Some(status) = trainer.try_wait().unwrap() {
            return status;
        }
        if started.elapsed() > timeout {
            let _ = trainer.kill();
            panic!("trainer still running after {timeout:?}; log:\n{}", trainer_log(job));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn trainer_log(job: &TestJob) -> String {
    std::fs::read_to_string(job.dir.path().join("trainer.log")).unwrap_or_default()
}

/// Runs a Python snippet with `args`; its last stdout line as JSON.
fn python_json(snippet: &str, args: &[&str], env: &[(&str, &str)]) -> Value {
    let out = Command::new(python()).arg("-c").arg(snippet).args(args).envs(env.iter().copied()).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "python failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_str(stdout.lines().last().unwrap_or_default()).unwrap()
}

/// A `mlflow server` in its own process group (killed whole on drop), its stores in `dir`.
struct MlflowServer {
    child: Child,
    uri: String,
}

impl MlflowServer {
    /// Starts it; it answers later (`wait_ready`): the test makes its job meanwhile.
    fn start(dir: &Path) -> Self {
        let port = jetrl_bus::harness::free_ports(1).unwrap()[0];
        let mlflow = python().with_file_name("mlflow");
        let log = std::fs::File::create(dir.join("mlflow-server.log")).unwrap();
        let child = Command::new(mlflow)
            .arg("server")
            .arg("--backend-store-uri")
            .arg(format!("sqlite:///{}", dir.join("mlflow.db").display()))
            .arg("--artifacts-destination")
            .arg(dir.join("artifacts"))
            .args(["--host", "127.0.0.1", "--port", &port.to_string(), "--workers", "1"])
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .process_group(0)
            .spawn()
            .unwrap();
        Self { child, uri: format!("http://127.0.0.1:{port}") }
    }

    /// `GET path` (HTTP/1.0): the whole response, head and body; `None` without one.
    fn get(&self, path: &str) -> Option<String> {
        use std::io::{Read, Write};
        let mut stream = std::net::TcpStream::connect(self.uri.trim_start_matches("http://")).ok()?;
        stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        stream.write_all(format!("GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").as_bytes()).ok()?;
        let mut response = String::new();
        stream.read_to_string(&mut response).ok()?;
        Some(response)
    }

    /// Waits until `/health` answers 200.
    fn wait_ready(&mut self, dir: &Path, timeout: Duration) {
        let started = Instant::now();
        loop {
            if self.get("/health").is_some_and(|r| r.starts_with("HTTP/1.1 200") || r.starts_with("HTTP/1.0 200")) {
                return;
            }
            let log = || std::fs::read_to_string(dir.join("mlflow-server.log")).unwrap_or_default();
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("mlflow server exited ({status}):\n{}", log());
            }
            assert!(started.elapsed() < timeout, "mlflow server not ready after {timeout:?}:\n{}", log());
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// SIGKILL to the server and its workers.
    fn kill(&mut self) {
        // SAFETY: kill(2) on the process group this test created, with a valid signal number.
        #[allow(unsafe_code)]
        unsafe {
            libc::kill(-(self.child.id() as libc::pid_t), libc::SIGKILL);
        }
        let _ = self.child.wait();
    }
}

impl Drop for MlflowServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The run `tracked` of the experiment `jetrl-trackers`, read through MLflow's client: status, params, the
/// history of every metric (step → value), artifact paths.
const MLFLOW_READ: &str = r#"
import json, sys, tempfile
from mlflow.tracking import MlflowClient
client = MlflowClient(tracking_uri=sys.argv[1])
experiment = client.get_experiment_by_name("jetrl-trackers")
runs = client.search_runs([experiment.experiment_id])
out = {"runs": len(runs)}
run = runs[0]
out["run_id"] = run.info.run_id
out["name"] = run.info.run_name
out["status"] = run.info.status
out["params"] = run.data.params
out["history"] = {key: {str(m.step): m.value for m in client.get_metric_history(run.info.run_id, key)}
                  for key in run.data.metrics}
out["artifacts"] = sorted(a.path for a in client.list_artifacts(run.info.run_id))
out["val_generations"] = {}
with tempfile.TemporaryDirectory() as tmp:
    for path in out["artifacts"]:
        if path.startswith("val_step"):
            out["val_generations"][path] = json.load(open(client.download_artifacts(run.info.run_id, path, tmp)))
print(json.dumps(out))
"#;

/// (a) and (c): a job with `trainer.logger=[console,mlflow]` against a real `mlflow server`, read back through
/// MLflow's client: the config as params, every step's metrics under verl's names, the reward curve and the
/// summary as artifacts, each validation's generations as verl's `val_step<step>.json` artifact, the run FINISHED. Then a second job whose server is killed after its first step: it
/// trains every step, and its log says what the tracker lost.
#[test]
#[ignore = "slow tier: two short jobs against a real mlflow server, one of them killed mid-run"]
fn mlflow_gets_params_every_step_and_artifacts_and_a_killed_server_never_stops_training() {
    require_python("mlflow.server, flask_cors, sqlalchemy, alembic, huey, graphene, aiohttp");
    let store = tempfile::tempdir().unwrap();
    let mut server = MlflowServer::start(store.path());
    let dump = tempfile::tempdir().unwrap();
    let mut first = job_with(3, "[console, mlflow]", &validating(dump.path()));
    // the services start once the server answers: they wait for the trainer's topology for nats.connect_timeout_s
    // (20 s here), and the server's start (Python imports, its database) can take longer on a loaded machine
    server.wait_ready(store.path(), Duration::from_secs(240));
    first.spawn_services(1, 1);
    let env = [("MLFLOW_TRACKING_URI", OsString::from(&server.uri))];
    let mut trainer = spawn_trainer(&first, &env);
    let status = wait_trainer(&first, &mut trainer, Duration::from_secs(300));
    assert!(status.success(), "trainer failed:\n{}", trainer_log(&first));

    let run = python_json(MLFLOW_READ, &[&server.uri], &[]);
    assert_eq!(run["runs"], 1, "{run}");
    assert_eq!((run["name"].as_str(), run["status"].as_str()), (Some("tracked"), Some("FINISHED")), "{run}");
    let params = run["params"].as_object().unwrap();
    assert_eq!(params["trainer.project_name"], "jetrl-trackers");
    assert_eq!(params["data.train_batch_size"], "8");
    assert_eq!(params["trainer.logger"], r#"["console","mlflow"]"#);
    assert!(params.len() > 100, "the whole config, in several batches of 100: {} params", params.len());
    // every step, every key of metrics.jsonl, the same values
    let lines = first.metrics();
    assert_eq!(lines.len(), 3);
    let history = run["history"].as_object().unwrap();
    for line in &lines {
        let step = line["training/global_step"].as_f64().unwrap() as u64;
        for (key, value) in line.as_object().unwrap() {
            let key = key.replace('@', "_at_");
            let logged = history.get(&key).and_then(|h| h[step.to_string()].as_f64());
            assert_eq!(logged, value.as_f64(), "{key} at step {step}");
        }
    }
    assert_eq!(history["critic/score/mean"].as_object().unwrap().len(), 3, "one value per step");
    assert_eq!(
        run["artifacts"],
        serde_json::json!(["reward_curve.svg", "summary.json", "val_step2.json", "val_step3.json"])
    );
    for step in [2, 3] {
        let expected: Vec<Value> = verl_pick(&first, dump.path(), step)
            .iter()
            .map(|s| serde_json::json!({"input": s[0], "output": s[1], "score": s[2]}))
            .collect();
        assert_eq!(run["val_generations"][format!("val_step{step}.json")], Value::Array(expected), "step {step}");
    }
    let kept: Value =
        serde_json::from_str(&std::fs::read_to_string(first.run_dir().join("mlflow_run.json")).unwrap()).unwrap();
    assert_eq!(kept["run_id"], run["run_id"], "the run directory names its MLflow run (a resume continues it)");
    drop(first);

    // (c) the server dies once it has a step of the second job: training goes on, the log says what was lost
    const STEPS: usize = 40;
    let mut second = job(STEPS as u32, "[console, mlflow]");
    second.spawn_services(1, 1);
    let mut trainer = spawn_trainer(&second, &env);
    let started = Instant::now();
    let run_file = second.run_dir().join("mlflow_run.json");
    loop {
        let run: Option<Value> = std::fs::read_to_string(&run_file).ok().and_then(|t| serde_json::from_str(&t).ok());
        let history = run.and_then(|run| {
            let id = run["run_id"].as_str()?.to_string();
            server.get(&format!("/api/2.0/mlflow/metrics/get-history?run_id={id}&metric_key=critic%2Fscore%2Fmean"))
        });
        if history.is_some_and(|h| h.contains("\"step\"")) {
            break;
        }
        assert!(trainer.try_wait().unwrap().is_none(), "trainer ended early:\n{}", trainer_log(&second));
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "no step in MLflow after 300 s:\n{}",
            trainer_log(&second)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    server.kill();
    let killed_at = second.metrics().len();
    let status = wait_trainer(&second, &mut trainer, Duration::from_secs(300));
    let log = trainer_log(&second);
    assert!(status.success(), "trainer failed:\n{log}");
    assert!(killed_at < STEPS, "the server was killed after the last step ({killed_at}): a job too short");
    assert_eq!(second.metrics().len(), STEPS, "every step trained:\n{log}");
    assert!(log.contains("not delivered") && log.contains("mlflow"), "no warning about the lost steps:\n{log}");
    assert!(log.contains("the end of the run not recorded"), "{log}");
    assert!(
        !log.contains(&format!("{STEPS} of {STEPS} steps not delivered")),
        "steps before the kill were delivered:\n{log}"
    );
}

/// The offline run's records, read from its `.wandb` file (a LevelDB-style log of protobuf records, read with
/// wandb's own protobuf types): project, name, config keys, every history row, the table file each `val/generations`
/// of a row names, the exit code, saved files.
const WANDB_READ: &str = r#"
import glob, json, os, struct, sys
from wandb.proto import wandb_internal_pb2 as pb

def records(path):
    data = open(path, "rb").read()
    assert data[:4] == b":W&B", data[:7]
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        payload = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            yield payload
        elif kind == 2:
            buf = payload
        elif kind == 3:
            buf += payload
        elif kind == 4:
            yield buf + payload

runs = glob.glob(os.path.join(sys.argv[1], "wandb", "offline-run-*"))
out = {"runs": len(runs), "history": {}, "config": [], "tables": {}}
for record in records(glob.glob(os.path.join(runs[0], "run-*.wandb"))[0]):
    r = pb.Record()
    r.ParseFromString(record)
    kind = r.WhichOneof("record_type")
    if kind == "run":
        out["project"], out["name"], out["id"] = r.run.project, r.run.display_name, r.run.run_id
        out["config"] += [u.key for u in r.run.config.update]
    elif kind == "config":
        out["config"] += [u.key for u in r.config.update]
    elif kind == "history":
        row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
        out["history"][str(row["_step"])] = row
        # a table is a file of the run, its fields (`path`, `_type`, ...) nested under the key
        if row.get("val/generations/_type") == "table-file":
            table = os.path.join(runs[0], "files", row["val/generations/path"])
            out["tables"][str(row["_step"])] = json.load(open(table))
    elif kind == "exit":
        out["exit_code"] = r.exit.exit_code
out["files"] = sorted(os.listdir(os.path.join(runs[0], "files")))
print(json.dumps(out))
"#;

/// (b) `trainer.logger=[console,wandb]` with `WANDB_MODE=offline`: the bridge logs every step's metrics under
/// verl's names, the config, the reward curve, and each validation's generations as verl's `val/generations`
/// table; read back from the offline run file.
#[test]
#[ignore = "slow tier: a short job logging to wandb offline, read back from the run file"]
fn wandb_offline_run_has_every_step_and_the_config() {
    require_python("wandb, wandb.proto.wandb_internal_pb2");
    let wandb_dir = tempfile::tempdir().unwrap();
    let dump = tempfile::tempdir().unwrap();
    let mut job = job_with(3, "[console, wandb]", &validating(dump.path()));
    job.spawn_services(1, 1);
    let env = [
        ("WANDB_MODE", OsString::from("offline")),
        ("WANDB_DIR", wandb_dir.path().as_os_str().to_owned()),
        ("JETRL_PYTHON", python().into_os_string()),
    ];
    let mut trainer = spawn_trainer(&job, &env);
    let status = wait_trainer(&job, &mut trainer, Duration::from_secs(300));
    let log = trainer_log(&job);
    assert!(status.success(), "trainer failed:\n{log}");
    assert!(log.contains("wandb run started"), "{log}");

    let run = python_json(WANDB_READ, &[wandb_dir.path().to_str().unwrap()], &[]);
    assert_eq!(run["runs"], 1, "{run}");
    assert_eq!((run["project"].as_str(), run["name"].as_str()), (Some("jetrl-trackers"), Some("tracked")));
    let kept = std::fs::read_to_string(job.run_dir().join("wandb_run_id")).unwrap();
    assert_eq!(run["id"].as_str(), Some(kept.trim()), "the run directory names its wandb run (a resume continues it)");
    let config: Vec<&str> = run["config"].as_array().unwrap().iter().filter_map(Value::as_str).collect();
    assert!(["trainer", "actor", "data", "rollout"].iter().all(|k| config.contains(k)), "{config:?}");
    let history = run["history"].as_object().unwrap();
    let lines = job.metrics();
    assert_eq!((lines.len(), history.len()), (3, 3), "{run}");
    for line in &lines {
        let step = line["training/global_step"].as_f64().unwrap() as u64;
        let row = &history[&step.to_string()];
        for (key, value) in line.as_object().unwrap() {
            assert_eq!(row[key].as_f64(), value.as_f64(), "{key} at step {step}");
        }
    }
    // verl's table: one row per validation (step, then input_i, output_i, score_i), earlier rows kept
    let mut columns = vec![Value::from("step")];
    for i in 1..=VAL_GENERATIONS {
        columns.extend(["input", "output", "score"].map(|name| Value::from(format!("{name}_{i}"))));
    }
    let mut rows = Vec::new();
    for step in [2u64, 3] {
        let mut row = vec![Value::from(step)];
        row.extend(verl_pick(&job, dump.path(), step).iter().flat_map(|s| s.as_array().unwrap().clone()));
        rows.push(Value::Array(row));
        let table = &run["tables"][step.to_string()];
        assert_eq!(
            (&table["columns"], &table["data"]),
            (&Value::Array(columns.clone()), &Value::Array(rows.clone())),
            "step {step}: {}",
            history[&step.to_string()]
        );
    }
    assert_eq!(run["tables"].as_object().unwrap().len(), 2, "val/generations only where the job validated");
    assert_eq!(run["exit_code"], 0, "{run}");
    let files = run["files"].as_array().unwrap();
    assert!(files.contains(&"reward_curve.svg".into()) && files.contains(&"summary.json".into()), "{files:?}");
}

/// Every scalar of the event files in a directory, read by TensorBoard's own `EventAccumulator` (every point
/// kept: `size_guidance` 0): tag → step → value.
const TENSORBOARD_READ: &str = r#"
import json, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator, SCALARS
events = EventAccumulator(sys.argv[1], size_guidance={SCALARS: 0})
events.Reload()
print(json.dumps({tag: {str(e.step): e.value for e in events.Scalars(tag)} for tag in events.Tags()[SCALARS]}))
"#;

/// (e) `trainer.logger=[console,tensorboard]`: the event files of a short job, read by TensorBoard's reader, hold
/// every step's metrics under verl's tags, each the float32 of metrics.jsonl's value.
#[test]
#[ignore = "slow tier: a short job logging to TensorBoard, read back by the tensorboard package"]
fn tensorboard_reads_every_step_under_verls_tags() {
    require_python("tensorboard.backend.event_processing.event_accumulator");
    let mut job = job(3, "[console, tensorboard]");
    job.spawn_services(1, 1);
    let mut trainer = spawn_trainer(&job, &[]);
    let status = wait_trainer(&job, &mut trainer, Duration::from_secs(300));
    assert!(status.success(), "trainer failed:\n{}", trainer_log(&job));

    let dir = job.run_dir().join("tensorboard");
    let scalars = python_json(TENSORBOARD_READ, &[dir.to_str().unwrap()], &[]);
    let lines = job.metrics();
    assert_eq!(lines.len(), 3);
    for tag in ["critic/score/mean", "actor/pg_loss", "response_length/mean", "actor/entropy", "timing_s/step"] {
        let steps = scalars[tag].as_object().unwrap_or_else(|| panic!("no {tag} in {scalars}"));
        assert_eq!(steps.keys().collect::<Vec<_>>(), ["1", "2", "3"], "{tag}");
    }
    for line in &lines {
        let step = line["training/global_step"].as_f64().unwrap() as u64;
        for (tag, value) in line.as_object().unwrap() {
            let read = scalars[tag][step.to_string()].as_f64();
            assert_eq!(read, value.as_f64().map(|v| f64::from(v as f32)), "{tag} at step {step}");
        }
    }
    let tags: std::collections::BTreeSet<&String> = scalars.as_object().unwrap().keys().collect();
    let keys: std::collections::BTreeSet<&String> = lines.iter().flat_map(|l| l.as_object().unwrap().keys()).collect();
    assert_eq!(tags, keys, "the event files hold metrics.jsonl's keys, no more");
}

/// (d) verl's `file` logger writes `{"step": n, "data": {...}}` per step at `VERL_FILE_LOGGER_PATH`; and a
/// `wandb` logger whose Python has no wandb package is said once at start-up while the job trains to its end.
#[test]
#[ignore = "slow tier: a short job with verl's file logger, and wandb asked of a Python without it"]
fn file_logger_writes_verls_lines_and_a_missing_wandb_is_said_once_while_training_goes_on() {
    let job = job(3, "[console, file, wandb]");
    // a Python without site-packages: `import wandb` fails there
    let no_wandb = job.dir.path().join("python-without-wandb");
    std::fs::write(&no_wandb, format!("#!/bin/sh\nexec {} -S \"$@\"\n", python().display())).unwrap();
    std::fs::set_permissions(&no_wandb, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let path = job.dir.path().join("verl-file-logger").join("metrics.jsonl");
    let env = [("VERL_FILE_LOGGER_PATH", path.clone().into_os_string()), ("JETRL_PYTHON", no_wandb.into_os_string())];
    let mut job = job;
    job.spawn_services(1, 1);
    let mut trainer = spawn_trainer(&job, &env);
    let status = wait_trainer(&job, &mut trainer, Duration::from_secs(300));
    let log = trainer_log(&job);
    assert!(status.success(), "trainer failed:\n{log}");

    let text = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let jsonl = job.metrics();
    assert_eq!((lines.len(), jsonl.len()), (3, 3));
    for (n, (line, metrics)) in lines.iter().zip(&jsonl).enumerate() {
        assert!(text.lines().nth(n).unwrap().starts_with(&format!("{{\"step\":{},\"data\":{{", n + 1)), "{text}");
        assert_eq!(line.as_object().unwrap().len(), 2, "step and data only: {line}");
        // metrics.jsonl leaves out what is not finite; verl's file writes it as null
        let mut data = line["data"].as_object().unwrap().clone();
        data.retain(|_, v| !v.is_null());
        assert_eq!(&Value::Object(data), metrics, "the data of step {} is metrics.jsonl's line", n + 1);
    }
    assert_eq!(log.matches("the wandb Python package is not importable").count(), 1, "{log}");
}
