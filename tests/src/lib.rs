//! Helpers for jetrl's cross-service tests: a real `nats-server` per test, a tiny real model, and the real
//! service binaries started as processes (`cargo build --bins` must have run; the test command does).

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use jetrl_bus::GroupStore;
pub use jetrl_bus::NatsServer;
use jetrl_wire::v1::GroupStatus;

pub mod bench;
pub mod cluster_sim;
pub mod secure_nats;
pub mod sim;

/// Path of a workspace binary (`target/<profile>/<name>`), located from the test executable.
/// Sum of every sample of the metric family `family` (lines starting with it) in a Prometheus text page.
pub fn metric_family_sum(page: &str, family: &str) -> f64 {
    page.lines()
        .filter(|l| l.starts_with(family))
        .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
        .sum()
}

pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // tests live in target/<profile>/deps/, binaries (benchmarks too) in target/<profile>/
    let dir = exe.parent().expect("executable dir");
    let path = if dir.ends_with("deps") { dir.parent().unwrap_or(dir).join(name) } else { dir.join(name) };
    assert!(path.exists(), "{} not found: build the binaries first (cargo build --bins)", path.display());
    path
}

/// A temporary directory for a test's files; kept (and named on stderr) when `JETRL_TEST_KEEP` is set, to read
/// a failed run's logs and store afterwards.
pub fn test_dir(what: &str) -> tempfile::TempDir {
    let mut dir = tempfile::Builder::new().prefix(&format!("jetrl-{what}-")).tempdir().expect("tempdir");
    if std::env::var_os("JETRL_TEST_KEEP").is_some() {
        dir.disable_cleanup(true);
        eprintln!("{what}: files kept in {}", dir.path().display());
    }
    dir
}

/// The `RUST_LOG` of the service processes a test starts: `JETRL_TEST_LOG` when set (e.g.
/// `info,jetrl_bus=debug`), else `info`.
pub fn service_log_filter() -> String {
    std::env::var("JETRL_TEST_LOG").unwrap_or_else(|_| "info".to_string())
}

/// A job directory with a tiny model and a config file, a NATS server (its own, or shared with other jobs), and
/// service processes.
pub struct TestJob {
    pub nats: Arc<NatsServer>,
    pub dir: tempfile::TempDir,
    pub config: PathBuf,
    children: Vec<(String, Child)>,
}

/// The base job for tests: a digit task (reverse 4) on a small budget. `extra` is YAML merged over it (top-level
/// sections replace the base's keys one level down).
pub fn job_yaml(dir: &Path, nats_url: &str, extra: &str) -> String {
    let base = format!(
        r#"
nats: {{url: "{nats_url}", connect_timeout_s: 20}}
run: {{name: test, dir: "{run}", seed: 1}}
model: {{path: "{model}"}}
data:
  task: {{name: reverse, min_len: 4, max_len: 4, train_size: 5000, val_size: 16}}
  train_batch_size: 8
  max_prompt_length: 32
  max_response_length: 5
rollout: {{n: 4, ack_wait_s: 3, heartbeat_interval_s: 0.5}}
actor: {{optim: {{lr: 1.0e-3, weight_decay: 0.0}}}}
trainer: {{total_training_steps: 3, weight_sync_timeout_s: 60}}
"#,
        run = dir.join("run").display(),
        model = dir.join("model").display(),
    );
    let mut doc: serde_yaml::Value = serde_yaml::from_str(&base).expect("base yaml");
    if !extra.trim().is_empty() {
        let over: serde_yaml::Value = serde_yaml::from_str(extra).expect("extra yaml");
        if let (Some(d), Some(o)) = (doc.as_mapping_mut(), over.as_mapping()) {
            for (k, v) in o {
                match (d.get_mut(k).and_then(|x| x.as_mapping_mut()), v.as_mapping()) {
                    (Some(dm), Some(vm)) => {
                        for (kk, vv) in vm {
                            dm.insert(kk.clone(), vv.clone());
                        }
                    }
                    _ => {
                        d.insert(k.clone(), v.clone());
                    }
                }
            }
        }
    }
    serde_yaml::to_string(&doc).expect("yaml")
}

impl TestJob {
    /// Starts NATS, writes the tiny model and `job.yaml` (base + `extra`).
    pub fn new(extra: &str) -> Self {
        Self::on(Arc::new(NatsServer::start().expect("nats-server")), extra)
    }

    /// A job on an existing NATS server (two jobs side by side need different `run.name`s in `extra`).
    pub fn on(nats: Arc<NatsServer>, extra: &str) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        jetrl_model::init_model("tiny", &dir.path().join("model"), 1).expect("tiny model");
        let config = dir.path().join("job.yaml");
        std::fs::write(&config, job_yaml(dir.path(), &nats.url(), extra)).expect("write job.yaml");
        Self { nats, dir, config, children: Vec::new() }
    }

    pub fn config(&self) -> jetrl_config::JobConfig {
        jetrl_config::JobConfig::load(Some(&self.config), &[]).expect("job config")
    }

    pub fn run_dir(&self) -> PathBuf {
        self.dir.path().join("run")
    }

    /// Starts a service binary with this job's config and `extra` overrides; logs go to `<dir>/<name>.log`.
    pub fn spawn(&mut self, name: &str, binary: &str, extra: &[&str]) {
        let log = std::fs::File::create(self.dir.path().join(format!("{name}.log"))).expect("log file");
        let child = Command::new(bin(binary))
            .arg("--config")
            .arg(&self.config)
            .args(extra)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {binary}: {e}"));
        self.children.push((name.to_string(), child));
    }

    /// Starts checkpoint-sync, the replay buffer, `rewards` reward services and `rollouts` rollout workers.
    pub fn spawn_services(&mut self, rollouts: usize, rewards: usize) {
        self.spawn("checkpoint-sync", "jetrl-checkpoint-sync", &[]);
        self.spawn("replay-buffer", "jetrl-replay-buffer", &[]);
        for i in 0..rewards {
            self.spawn(&format!("reward-{i}"), "jetrl-reward-service", &[&format!("reward.instance_id=reward-{i}")]);
        }
        for i in 0..rollouts {
            self.spawn(&format!("rollout-{i}"), "jetrl-rollout-worker", &[&format!("rollout.instance_id=rollout-{i}")]);
        }
    }

    fn child(&mut self, name: &str) -> &mut Child {
        &mut self.children.iter_mut().find(|(n, _)| n == name).unwrap_or_else(|| panic!("no process {name}")).1
    }

    /// Waits for a process to exit; panics with its log after `timeout`.
    pub fn wait(&mut self, name: &str, timeout: Duration) -> ExitStatus {
        let started = Instant::now();
        loop {
            if let Some(status) = self.child(name).try_wait().expect("try_wait") {
                return status;
            }
            if started.elapsed() > timeout {
                panic!("{name} still running after {timeout:?}; log:\n{}", self.log(name));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The process id of a started process.
    pub fn pid(&mut self, name: &str) -> u32 {
        self.child(name).id()
    }

    /// SIGKILL: the process dies without settling anything.
    pub fn kill(&mut self, name: &str) {
        let child = self.child(name);
        let _ = child.kill();
        let _ = child.wait();
    }

    /// SIGTERM: the process shuts down gracefully.
    pub fn terminate(&mut self, name: &str) {
        let pid = self.child(name).id() as libc::pid_t;
        // SAFETY: kill(2) on a pid we spawned.
        #[allow(unsafe_code)]
        unsafe {
            libc::kill(pid, libc::SIGTERM);
        }
    }

    pub fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("{name}.log"))).unwrap_or_default()
    }

    /// Step metrics written by the trainer.
    pub fn metrics(&self) -> Vec<serde_json::Value> {
        std::fs::read_to_string(self.run_dir().join("metrics.jsonl"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }
}

impl Drop for TestJob {
    fn drop(&mut self) {
        for (_, child) in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::thread::panicking() {
            for (name, _) in &self.children {
                eprintln!("----- {name} log -----\n{}", self.log(name));
            }
        }
    }
}

/// The demo job (`configs/demo.yaml`) through `jetrl run --quiet`, its run directory `<dir>/<name>` and
/// `run.name` `<name>` (underscores as dashes), with `overrides` after those; returns the run directory. Panics
/// with the console output when the run fails or outlasts `timeout`.
pub fn demo_run(dir: &Path, name: &str, overrides: &[String], timeout: Duration) -> PathBuf {
    demo_run_of("demo.yaml", dir, name, overrides, timeout)
}

/// The lines of a run directory's `metrics.jsonl` (none when it has none yet).
pub fn run_metrics(run_dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// [`demo_run`] of another job file of `configs/` (`demo-lora.yaml`).
pub fn demo_run_of(config: &str, dir: &Path, name: &str, overrides: &[String], timeout: Duration) -> PathBuf {
    let run_dir = dir.join(name);
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs").join(config);
    let mut args = vec![
        "run".to_string(),
        config.display().to_string(),
        format!("run.dir={}", run_dir.display()),
        format!("run.name={}", name.replace('_', "-")),
    ];
    args.extend(overrides.iter().cloned());
    args.push("--quiet".into());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (status, output) = run_binary("jetrl", &args, timeout);
    assert!(status.success(), "jetrl run ({name}) failed:\n{output}");
    run_dir
}

/// Runs a binary to completion with arguments; returns (status, stdout+stderr).
pub fn run_binary(binary: &str, args: &[&str], timeout: Duration) -> (ExitStatus, String) {
    let out_file = tempfile::NamedTempFile::new().expect("tempfile");
    let mut child = Command::new(bin(binary))
        .args(args)
        .stdin(Stdio::null())
        .stdout(out_file.reopen().expect("reopen"))
        .stderr(out_file.reopen().expect("reopen"))
        .spawn()
        .expect("spawn");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        if started.elapsed() > timeout {
            let _ = child.kill();
            panic!("{binary} {args:?} did not finish within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    (status, std::fs::read_to_string(out_file.path()).unwrap_or_default())
}

/// What a benchmark program printed, and how it ended.
pub struct BenchRun {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
}

/// Runs a benchmark program (`command`, its environment set) in its own process group, stdout and stderr kept
/// apart (the last stdout line is its JSON); after `limit` the whole group (services, nats-server, workers) is
/// killed and the test fails with what it printed.
pub fn run_bench(mut command: Command, limit: Duration) -> BenchRun {
    use std::os::unix::process::CommandExt;
    let log = tempfile::NamedTempFile::new().expect("tempfile");
    let what = format!("{:?}", command.get_program());
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log.reopen().expect("reopen"))
        .process_group(0)
        .spawn()
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let mut stdout = child.stdout.take().expect("stdout");
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = std::io::Read::read_to_string(&mut stdout, &mut text);
        text
    });
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        if started.elapsed() > limit {
            // SAFETY: kill(2) on the process group this function created, with a valid signal number.
            #[allow(unsafe_code)]
            unsafe {
                libc::kill(-(child.id() as libc::pid_t), libc::SIGKILL);
            }
            let _ = child.wait();
            panic!("{what} did not finish in {limit:?}:\n{}", std::fs::read_to_string(log.path()).unwrap_or_default());
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let stdout = reader.join().unwrap_or_default();
    let stderr = std::fs::read_to_string(log.path()).unwrap_or_default();
    BenchRun { status, stdout, stderr, elapsed: started.elapsed() }
}

/// Every group record of the job, train and validation: the live ones in GROUPS and those archived to LEDGER.
pub async fn group_records(store: &GroupStore) -> Vec<GroupStatus> {
    let mut out = Vec::new();
    for partition in [jetrl_wire::subjects::TRAIN_PARTITION, jetrl_wire::subjects::VAL_PARTITION] {
        out.extend(store.records(partition).await.expect("group records (GROUPS and the ledger archive)"));
    }
    out
}
