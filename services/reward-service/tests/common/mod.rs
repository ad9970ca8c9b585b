//! Helpers for the reward service's integration tests: a real nats-server, trajectories and score requests
//! published the way a rollout worker publishes them, the REWARDS stream read back, the service as a real process
//! or in-process.

#![allow(dead_code)] // each test file uses a different subset

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use jetrl_bus::publish::Outgoing;
use jetrl_bus::{score, Bus, NatsServer};
use jetrl_config::JobConfig;
use jetrl_wire::keys::TrajectoryKey;
use jetrl_wire::packed;
use jetrl_wire::v1::{Reward, Timings, Trajectory};

/// nats-server, a connection to it, and a scratch directory.
pub struct Harness {
    pub nats: NatsServer,
    pub bus: Bus,
    pub dir: tempfile::TempDir,
}

impl Harness {
    pub async fn start() -> Self {
        let nats = NatsServer::start().expect("nats-server");
        let mut cfg = JobConfig::default();
        cfg.nats.url = nats.url();
        let bus = Bus::connect_job(&cfg, "reward-service-test").await.expect("connect");
        bus.declare_topology().await.expect("topology");
        Self { nats, bus, dir: tempfile::tempdir().expect("tempdir") }
    }

    /// A job configuration pointing at this server, for in-process `run`.
    pub fn config(&self) -> JobConfig {
        let mut cfg = JobConfig::default();
        cfg.nats.url = self.nats.url();
        cfg.model.path = self.dir.path().join("no-model").display().to_string();
        cfg
    }

    /// Writes a job file for the service binary: this server, a built-in task (the job needs one), no policy
    /// model, plus `reward_yaml` as the `reward:` section.
    pub fn job_file(&self, name: &str, reward_yaml: &str) -> PathBuf {
        let path = self.dir.path().join(format!("{name}.yaml"));
        let text = format!(
            "nats: {{url: \"{}\", connect_timeout_s: 20}}\nmodel: {{path: \"{}\"}}\ndata: {{task: {{name: reverse}}}}\nreward:\n{}\n",
            self.nats.url(),
            self.dir.path().join("no-model").display(),
            reward_yaml.lines().map(|line| format!("  {line}")).collect::<Vec<_>>().join("\n"),
        );
        std::fs::write(&path, text).expect("write job file");
        path
    }

    /// Publishes trajectories the way a rollout worker does: each group's trajectories into TRAJ, then its score
    /// request into SCORE. Returns the request ids, by uid.
    pub async fn publish(&self, trajectories: &[Trajectory]) -> HashMap<String, String> {
        let mut groups: Vec<(String, Vec<Trajectory>)> = Vec::new();
        for traj in trajectories {
            match groups.iter_mut().find(|(uid, _)| *uid == traj.uid) {
                Some((_, group)) => group.push(traj.clone()),
                None => groups.push((traj.uid.clone(), vec![traj.clone()])),
            }
        }
        let mut ids = HashMap::new();
        for (uid, group) in groups {
            let (_, id) = score::publish_group(&self.bus, &group[0].partition, &uid, &group).await.expect("publish");
            ids.insert(uid, id.expect("not empty"));
        }
        ids
    }

    /// Publishes raw bytes as the score request of group `uid`, after a stored trajectory `{uid}_0_0` (what a
    /// corrupted request looks like).
    pub async fn publish_raw_request(&self, uid: &str, payload: Vec<u8>) {
        let traj = trajectory(uid, 0);
        let subject = self.bus.names().traj_subject("train", uid);
        self.bus.publish_durable(Outgoing::protobuf(subject, Some(traj.key.clone()), &traj)).await.expect("publish");
        let subject = self.bus.names().score_subject("train", uid);
        let outgoing = Outgoing::new(subject, Some(format!("{uid}.bad")), payload.into());
        self.bus.publish_durable(outgoing).await.expect("publish");
    }

    /// Every reward in the REWARDS stream, in stream order.
    pub async fn all_rewards(&self) -> Vec<Reward> {
        score::stored_rewards(&self.bus).await.expect("REWARDS read")
    }

    /// Rewards in the REWARDS stream.
    pub async fn stored_rewards(&self) -> usize {
        self.all_rewards().await.len()
    }

    /// Waits until REWARDS holds at least `count` rewards.
    pub async fn wait_for_rewards(&self, count: usize, timeout: Duration) {
        let started = Instant::now();
        loop {
            let stored = self.stored_rewards().await;
            if stored >= count {
                return;
            }
            assert!(started.elapsed() < timeout, "only {stored} of {count} rewards after {timeout:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Every reward of REWARDS, grouped by trajectory key.
    pub async fn rewards_by_key(&self) -> HashMap<String, Vec<Reward>> {
        let mut by_key: HashMap<String, Vec<Reward>> = HashMap::new();
        for reward in self.all_rewards().await {
            by_key.entry(reward.key.clone()).or_default().push(reward);
        }
        by_key
    }
}

/// Trajectory `index` of group `uid`: a jetrl/reverse answer, correct when `index` is even.
pub fn trajectory(uid: &str, session: u32) -> Trajectory {
    let response = if session & 1 == 0 { "4321" } else { "1234" };
    Trajectory {
        key: TrajectoryKey::new(uid.to_string(), session, 0).to_string(),
        uid: uid.into(),
        session_id: session,
        partition: "train".into(),
        prompt_ids: packed::pack_u32(&[1, 2, 4, 7, 8, 3, 2, 5]),
        response_ids: packed::pack_u32(&[9, 3]),
        response_mask: packed::pack_u8(&[1, 1]),
        logprobs: packed::pack_f32(&[-0.1, -0.2]),
        timings: Some(Timings { completed_unix_ms: jetrl_wire::now_unix_ms(), ..Timings::default() }),
        response_text: response.into(),
        data_source: "jetrl/reverse".into(),
        ground_truth: "4321".into(),
        extra_info_json: "{\"index\": 1}".into(),
        ..Trajectory::default()
    }
}

/// `groups` groups of `n` trajectories each.
pub fn trajectories(groups: usize, n: u32) -> Vec<Trajectory> {
    (0..groups).flat_map(|g| (0..n).map(move |s| trajectory(&format!("grp{g}"), s))).collect()
}

/// A free TCP address on the loopback interface (for a metrics endpoint).
pub fn free_addr() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("addr")
}

pub async fn scrape(addr: SocketAddr) -> String {
    jetrl_telemetry::scrape(addr).await.unwrap_or_default()
}

/// The value of the sample `name{labels}` (labels as written, e.g. `reason="timeout"`; empty for none).
pub fn sample(page: &str, name: &str, labels: &str) -> Option<f64> {
    let wanted = if labels.is_empty() { name.to_string() } else { format!("{name}{{{labels}}}") };
    page.lines().find(|line| line.split(' ').next() == Some(wanted.as_str()))?.rsplit(' ').next()?.parse().ok()
}

/// A reward-service process; killed (SIGKILL) when dropped.
pub struct ServiceProcess {
    pub child: Child,
    pub log: PathBuf,
}

impl ServiceProcess {
    pub fn spawn(job: &Path, log: PathBuf, overrides: &[String]) -> Self {
        let file = std::fs::File::create(&log).expect("log file");
        let child = Command::new(env!("CARGO_BIN_EXE_jetrl-reward-service"))
            .arg("--config")
            .arg(job)
            .args(overrides)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(file.try_clone().expect("log"))
            .stderr(file)
            .spawn()
            .expect("start jetrl-reward-service");
        Self { child, log }
    }

    /// SIGKILL, as a crash: nothing is settled.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for ServiceProcess {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            eprintln!("----- {} -----\n{}", self.log.display(), self.log());
        }
    }
}

/// The user-function tests run python3, a prerequisite of the project (`scripts/setup.sh` stops without it):
/// missing here is a failure.
pub fn require_python3() {
    let found = Command::new("python3").args(["-c", "pass"]).status().is_ok_and(|s| s.success());
    assert!(found, "this test runs a user function in python3, which does not run here");
}

/// A user function that appends every key it is asked to score to `log` (one line each, before scoring), then
/// sleeps `delay_s` per request and scores 1.0.
pub const SLOW_LOGGING_FUNCTION: &str = r#"
import json, sys, time
log_path, delay = sys.argv[1], float(sys.argv[2])
out = sys.stdout
sys.stdout = sys.stderr
for line in sys.stdin:
    request = json.loads(line)
    with open(log_path, "a") as log:
        for item in request["items"]:
            log.write(item["key"] + "\n")
    time.sleep(delay)
    out.write(json.dumps({"id": request["id"], "results": [1.0 for _ in request["items"]]}) + "\n")
    out.flush()
"#;

/// Writes [`SLOW_LOGGING_FUNCTION`] into `dir`; returns the `custom_reward_function.command` and the log path.
pub fn slow_logging_function(dir: &Path, delay_s: f64) -> (Vec<String>, PathBuf) {
    let script = dir.join("slow_function.py");
    std::fs::write(&script, SLOW_LOGGING_FUNCTION).expect("write function");
    let log = dir.join("scored.log");
    let command =
        vec!["python3".to_string(), script.display().to_string(), log.display().to_string(), delay_s.to_string()];
    (command, log)
}

/// How many times each key was handed to the user function.
pub fn scored_counts(log: &Path) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for key in std::fs::read_to_string(log).unwrap_or_default().lines().filter(|l| !l.is_empty()) {
        *counts.entry(key.to_string()).or_insert(0) += 1;
    }
    counts
}
