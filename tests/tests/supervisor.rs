//! `jetrl run` as a supervisor, tried as a user would: the real `jetrl` binary starts its own nats-server and the
//! five services as processes on the tiny job; processes are killed with SIGKILL once the run has reached a step
//! (polled in `metrics.jsonl`), never after a sleep.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use jetrl_tests::{bin, job_yaml};

/// One `jetrl run` of the tiny job, its console captured in a file.
struct JetrlRun {
    dir: tempfile::TempDir,
    child: Child,
}

impl JetrlRun {
    /// Starts `jetrl run --quiet` on the test job (base + `extra` YAML).
    fn start(extra: &str) -> Self {
        Self::start_with(extra, &[])
    }

    /// [`JetrlRun::start`] with more arguments for `jetrl run` (`--nats-url …`).
    fn start_with(extra: &str, args: &[&str]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let extra = format!("model: {{init_preset: tiny}}\n{extra}");
        // jetrl run starts its own nats-server and overrides nats.url (unless given --nats-url)
        let config = dir.path().join("job.yaml");
        std::fs::write(&config, job_yaml(dir.path(), "nats://127.0.0.1:1", &extra)).unwrap();
        let console = std::fs::File::create(dir.path().join("console.txt")).unwrap();
        let child = Command::new(bin("jetrl"))
            .arg("run")
            .arg(&config)
            .arg("--quiet")
            .args(args)
            // the services log at the job's level (info): the test reads their start-up lines
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(console.try_clone().unwrap())
            .stderr(console)
            .spawn()
            .unwrap();
        Self { dir, child }
    }

    fn run_dir(&self) -> PathBuf {
        self.dir.path().join("run")
    }

    fn console(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("console.txt")).unwrap_or_default()
    }

    fn log(&self, service: &str) -> String {
        std::fs::read_to_string(self.run_dir().join("logs").join(format!("{service}.log"))).unwrap_or_default()
    }

    /// `<run.dir>/supervisor.jsonl`.
    fn journal(&self) -> Vec<serde_json::Value> {
        read_lines(&self.run_dir().join("supervisor.jsonl"))
    }

    fn steps(&self) -> usize {
        read_lines(&self.run_dir().join("metrics.jsonl")).len()
    }

    /// Waits until `done` holds, failing with the console after `timeout`.
    fn wait_until(&mut self, what: &str, timeout: Duration, done: impl Fn(&Self) -> bool) {
        let started = Instant::now();
        while !done(self) {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("jetrl run exited ({status}) before {what}; console:\n{}", self.console());
            }
            assert!(started.elapsed() < timeout, "no {what} after {timeout:?}; console:\n{}", self.console());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The pid `jetrl run` recorded when it started `service`.
    fn pid(&self, service: &str) -> libc::pid_t {
        let started = self.journal().into_iter().find(|e| e["event"] == "started" && e["service"] == service);
        started.and_then(|e| e["pid"].as_i64()).and_then(|p| libc::pid_t::try_from(p).ok()).unwrap_or_else(|| {
            panic!("no pid recorded for {service}: {:?}", self.journal());
        })
    }

    /// The configuration file of the nats-server `jetrl run` started (or restarted) last, from its command line.
    fn nats_conf(&self) -> PathBuf {
        let last = self
            .journal()
            .into_iter()
            .rev()
            .find(|e| e["service"] == "nats-server" && (e["event"] == "started" || e["event"] == "restarted"));
        let pid =
            last.and_then(|e| e["pid"].as_i64()).unwrap_or_else(|| panic!("no nats-server: {:?}", self.journal()));
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
        let args: Vec<String> = cmdline.split(|&b| b == 0).map(|a| String::from_utf8_lossy(a).into_owned()).collect();
        let at = args.iter().position(|a| a == "-c").unwrap_or_else(|| panic!("nats-server {args:?}"));
        PathBuf::from(&args[at + 1])
    }

    /// The embedded server's URL (its port from the journal).
    fn nats_url(&self) -> String {
        let started = self.journal().into_iter().find(|e| e["event"] == "started" && e["service"] == "nats-server");
        format!("nats://127.0.0.1:{}", started.unwrap()["port"])
    }

    fn wait(&mut self, timeout: Duration) -> ExitStatus {
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                started.elapsed() < timeout,
                "jetrl run still running after {timeout:?}; console:\n{}",
                self.console()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for JetrlRun {
    fn drop(&mut self) {
        // SIGTERM: jetrl run stops its services and its nats-server
        kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline && matches!(self.child.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn read_lines(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path).unwrap_or_default().lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
}

fn kill(pid: libc::pid_t, signal: libc::c_int) {
    // SAFETY: kill(2) on a pid this test started (directly or through jetrl run).
    #[allow(unsafe_code)]
    unsafe {
        libc::kill(pid, signal);
    }
}

fn unix_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs_f64()
}

/// Connects to `url` with no credentials; the error when the server refuses.
fn connect_anonymously(url: &str) -> Option<async_nats::ConnectError> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async_nats::connect(url)).err()
}

/// The embedded server is as secure as a deployment's: `jetrl run` generates one user per service for the run
/// (deploy/nats/gen.sh's least-privilege permissions) and starts nats-server on loopback with them; a client
/// without credentials is refused, every service connects as its own user and nothing is refused to any, the
/// read-only identity serves `jetrl status`, and no password reaches a command line, the console, job.yaml or a
/// log.
#[test]
#[ignore = "slow tier: jetrl run supervising real processes and a broker that dies"]
fn the_embedded_nats_server_lets_in_only_the_runs_own_users() {
    let mut run = JetrlRun::start("");
    run.wait_until("the jetrl status line on the console", Duration::from_secs(60), |r| {
        r.console().contains("status --config")
    });
    let conf_path = run.nats_conf();
    let conf = std::fs::read_to_string(&conf_path).unwrap();
    for needed in ["host: 127.0.0.1", "accounts {", "\"JETRL_test\"", "user: \"test-trainer\"", "permissions: {"] {
        assert!(conf.contains(needed), "{} lacks {needed:?}:\n{conf}", conf_path.display());
    }
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&conf_path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the server's configuration holds passwords");

    let refused = connect_anonymously(&run.nats_url()).expect("a client without credentials is refused");
    assert_eq!(refused.kind(), async_nats::ConnectErrorKind::AuthorizationViolation, "{refused}");

    // each service's command line names its identity and its password file, never a password
    let nats_dir = run.run_dir().join("nats");
    let passwords: Vec<String> = std::fs::read_dir(nats_dir.join("clients"))
        .unwrap()
        .filter_map(|d| std::fs::read_to_string(d.unwrap().path().join("password")).ok())
        .collect();
    assert_eq!(passwords.len(), 7, "one password per identity");
    let mut running = 0;
    for service in ["trainer", "rollout-0", "reward-0", "replay-buffer", "checkpoint-sync"] {
        let cmdline = std::fs::read(format!("/proc/{}/cmdline", run.pid(service))).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if cmdline.is_empty() {
            continue; // it has finished already
        }
        assert!(cmdline.contains("nats.user=test-") && cmdline.contains("nats.password_file="), "{cmdline}");
        assert!(!passwords.iter().any(|p| cmdline.contains(p.as_str())), "a password on {service}'s command line");
        running += 1;
    }
    assert!(running > 0, "every service had exited before the check");

    // the console names the status identity's file, and jetrl status reads the job with it
    let status_file = nats_dir.join("status.yaml");
    assert!(run.console().contains(&format!("status --config {}", status_file.display())), "{}", run.console());
    let out = Command::new(bin("jetrl")).arg("status").arg("--config").arg(&status_file).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && text.contains("job: test"), "jetrl status:\n{text}");

    let status = run.wait(Duration::from_secs(120));
    let console = run.console();
    assert!(status.success(), "jetrl run failed ({status}); console:\n{console}");
    assert!(console.contains("(started by jetrl run: loopback only, one user per service)"), "{console}");
    for (service, user) in [
        ("trainer", "trainer"),
        ("rollout-0", "rollout-worker"),
        ("reward-0", "reward-service"),
        ("replay-buffer", "replay-buffer"),
        ("checkpoint-sync", "checkpoint-sync"),
    ] {
        let log = run.log(service);
        let connected = log.lines().find(|l| l.contains("connected to NATS")).unwrap_or_default();
        assert!(connected.contains(&format!("user \"test-{user}\"")), "{service} connected as:\n{log}");
        assert!(!log.contains("permissions violation"), "{service} was refused something:\n{log}");
    }
    let mut written = vec![console, std::fs::read_to_string(run.run_dir().join("job.yaml")).unwrap()];
    for file in ["supervisor.jsonl", "nats/status.yaml"] {
        written.push(std::fs::read_to_string(run.run_dir().join(file)).unwrap());
    }
    for log in std::fs::read_dir(run.run_dir().join("logs")).unwrap() {
        written.push(std::fs::read_to_string(log.unwrap().path()).unwrap());
    }
    for password in &passwords {
        assert!(!written.iter().any(|text| text.contains(password.as_str())), "a password was written out");
    }
}

/// With two rollout workers, one killed is restarted and the run completes: the job does not end with it.
#[test]
#[ignore = "slow tier: jetrl run supervising real processes and a broker that dies"]
fn a_killed_rollout_worker_is_restarted_and_the_run_completes() {
    let steps = 30;
    let mut run = JetrlRun::start(&format!(
        "rollout: {{workers: 2}}\ntrainer: {{total_training_steps: {steps}}}\nrun: {{supervisor: {{restart_delay_s: 0.2}}}}"
    ));
    run.wait_until("step 2", Duration::from_secs(90), |r| r.steps() >= 2);
    kill(run.pid("rollout-1"), libc::SIGKILL);
    run.wait_until("a restart of rollout-1", Duration::from_secs(30), |r| {
        r.journal().iter().any(|e| e["event"] == "restarted" && e["service"] == "rollout-1")
    });
    let status = run.wait(Duration::from_secs(120));
    let console = run.console();
    assert!(status.success(), "jetrl run failed ({status}); console:\n{console}");
    assert_eq!(run.steps(), steps, "console:\n{console}");
    assert!(console.contains("rollout-1 was killed (signal: 9 (SIGKILL)); restarting in 0.2s"), "{console}");
    assert!(console.contains("restarts: rollout-1 ×1"), "{console}");
    let journal = run.journal();
    let exit = journal.iter().find(|e| e["event"] == "exit" && e["service"] == "rollout-1").unwrap();
    assert_eq!(exit["status"], "signal: 9 (SIGKILL)");
    assert_eq!(exit["action"], "restart");
    let end = journal.last().unwrap();
    assert_eq!((end["event"].as_str(), end["outcome"].as_str()), (Some("end"), Some("finished")), "{journal:?}");
    assert_eq!(end["restarts"]["rollout-1"], 1, "{journal:?}");
    // the second incarnation really started (each start logs the torch threads it was given)
    let log = run.log("rollout-1");
    assert_eq!(log.matches("torch threads").count(), 2, "{log}");
    assert!(log.contains("----- jetrl run: restart 1 of rollout-1 -----"), "{log}");
    // the job file the services read shares the host's cores between the 3 torch processes
    let job: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(run.run_dir().join("job.yaml")).unwrap()).unwrap();
    let cores = std::thread::available_parallelism().unwrap().get() as u64;
    let share = (cores / 3).max(1);
    assert_eq!(job["rollout"]["torch_threads"].as_u64(), Some(share), "{job:?}");
    assert_eq!(job["trainer"]["torch_threads"].as_u64(), Some(share), "{job:?}");
    assert_eq!(job["reward"]["tokio_threads"].as_u64(), Some(2.min(cores)), "{job:?}");
}

/// A service that is alive but does nothing (SIGSTOP: no exit for the supervisor to see) is found by its missing
/// heartbeats, killed and restarted; the run completes.
#[test]
#[ignore = "slow tier: jetrl run supervising real processes and a broker that dies"]
fn a_stopped_reward_service_is_found_hung_killed_and_restarted_and_the_run_completes() {
    let steps = 30;
    let mut run = JetrlRun::start(&format!(
        "trainer: {{total_training_steps: {steps}}}\nrun: {{supervisor: {{restart_delay_s: 0.2, hang_after_s: 4}}}}"
    ));
    run.wait_until("step 2", Duration::from_secs(90), |r| r.steps() >= 2);
    let stopped = run.pid("reward-0");
    kill(stopped, libc::SIGSTOP);
    let frozen = Instant::now();
    run.wait_until("a restart of reward-0", Duration::from_secs(60), |r| {
        r.journal().iter().any(|e| e["event"] == "restarted" && e["service"] == "reward-0")
    });
    let found_after = frozen.elapsed();
    let status = run.wait(Duration::from_secs(120));
    let console = run.console();
    assert!(status.success(), "jetrl run failed ({status}); console:\n{console}");
    assert_eq!(run.steps(), steps, "console:\n{console}");
    assert!(
        console.contains(&format!("reward-0 (pid {stopped}) has sent no heartbeat for")),
        "the console names the hung service: {console}"
    );
    // judged on the heartbeats (every 0.5 s in the test job), not before the window, not long after it
    assert!(found_after >= Duration::from_secs(4) && found_after < Duration::from_secs(20), "{found_after:?}");
    let journal = run.journal();
    let hung = journal.iter().find(|e| e["event"] == "hung").unwrap_or_else(|| panic!("{journal:?}"));
    assert_eq!((hung["service"].as_str(), hung["pid"].as_i64()), (Some("reward-0"), Some(i64::from(stopped))));
    let exit = journal.iter().find(|e| e["event"] == "exit" && e["service"] == "reward-0").unwrap();
    assert_eq!((exit["status"].as_str(), exit["action"].as_str()), (Some("signal: 9 (SIGKILL)"), Some("restart")));
    assert_eq!(journal.iter().filter(|e| e["event"] == "hung").count(), 1, "only the stopped one: {journal:?}");
}

/// A service that fails at every start (here: an address it cannot bind) is restarted with backoff until it
/// passes the crash-loop limit; then the job ends non-zero, naming it and showing its last log lines.
#[test]
#[ignore = "slow tier: jetrl run supervising real processes and a broker that dies"]
fn a_service_that_always_fails_crash_loops_and_ends_the_job_naming_it() {
    let mut run = JetrlRun::start(
        "reward: {metrics_addr: \"256.0.0.1:1\"}\n\
         run: {supervisor: {restart_delay_s: 0.1, max_restart_delay_s: 0.2, max_restarts: 2}}",
    );
    let status = run.wait(Duration::from_secs(120));
    let console = run.console();
    assert_eq!(status.code(), Some(1), "{console}");
    assert!(console.contains("reward-0 is crash-looping: it exited with exit status: 1 after 2 restarts"), "{console}");
    // the tail of its log, with the reason
    assert!(console.contains("cannot bind 256.0.0.1:1"), "{console}");
    assert!(console.contains("job stopped: reward-0 is crash-looping"), "{console}");
    let journal = run.journal();
    let restarts: Vec<f64> = journal
        .iter()
        .filter(|e| e["event"] == "exit" && e["service"] == "reward-0")
        .map(|e| e["delay_s"].as_f64().unwrap())
        .collect();
    assert_eq!(restarts, [0.1, 0.2], "backoff doubles to its cap: {journal:?}");
    assert!(journal.iter().any(|e| e["event"] == "crash_loop" && e["service"] == "reward-0"), "{journal:?}");
    assert_eq!(journal.last().unwrap()["outcome"], "failed");
}

/// The broker dies: the console says so within seconds, jetrl run restarts its nats-server on the same port with
/// the same JetStream store, and the run completes.
#[test]
#[ignore = "slow tier: jetrl run supervising real processes and a broker that dies"]
fn a_killed_embedded_nats_server_is_reported_at_once_and_restarted_with_its_store() {
    let steps = 20;
    let mut run = JetrlRun::start(&format!("trainer: {{total_training_steps: {steps}}}"));
    run.wait_until("step 2", Duration::from_secs(90), |r| r.steps() >= 2);
    let killed_at = unix_now();
    kill(run.pid("nats-server"), libc::SIGKILL);
    run.wait_until("a broker outage on the console", Duration::from_secs(10), |r| {
        r.console().contains("unreachable since")
    });
    run.wait_until("the restart", Duration::from_secs(30), |r| {
        r.journal().iter().any(|e| e["event"] == "restarted" && e["service"] == "nats-server")
    });
    // the restarted server still lets in only the run's users
    let conf = std::fs::read_to_string(run.nats_conf()).unwrap();
    assert!(conf.contains("user: \"test-trainer\""), "{conf}");
    let refused = connect_anonymously(&run.nats_url()).expect("a client without credentials is refused");
    assert_eq!(refused.kind(), async_nats::ConnectErrorKind::AuthorizationViolation, "{refused}");
    let status = run.wait(Duration::from_secs(180));
    let console = run.console();
    assert!(status.success(), "jetrl run failed ({status}); console:\n{console}");
    assert_eq!(run.steps(), steps, "console:\n{console}");
    let journal = run.journal();
    let outage = journal.iter().find(|e| e["event"] == "nats_unreachable").unwrap();
    let noticed_after = outage["t"].as_f64().unwrap() - killed_at;
    assert!(noticed_after < 3.0, "the outage was reported {noticed_after:.1}s after the kill");
    assert!(console.contains("NATS at nats://127.0.0.1:"), "{console}");
    assert!(console.contains("nats-server restarted on port"), "{console}");
    assert!(journal.iter().any(|e| e["event"] == "nats_reachable"), "{journal:?}");
}

/// The broker is gone for good (a server jetrl run did not start, killed) and the user stops the job: every
/// service leaves within a few seconds without the broker work it could not do (a worker's drain, the reward
/// service's batches, the trainer's ledger and lease), none is killed for outliving the stop's grace, and each
/// says what it left.
#[test]
#[ignore = "slow tier: jetrl run supervising real processes and a broker that dies"]
fn a_job_stopped_while_its_broker_is_gone_stops_without_waiting_for_it() {
    let mut nats = jetrl_bus::NatsServer::start().unwrap();
    let url = nats.url();
    let mut run = JetrlRun::start_with("trainer: {total_training_steps: 200}", &["--nats-url", &url]);
    run.wait_until("step 2", Duration::from_secs(90), |r| r.steps() >= 2);
    nats.kill();
    run.wait_until("a broker outage on the console", Duration::from_secs(10), |r| {
        r.console().contains("unreachable since")
    });
    let stopped_at = Instant::now();
    kill(run.child.id() as libc::pid_t, libc::SIGTERM);
    let status = run.wait(Duration::from_secs(60));
    let took = stopped_at.elapsed();
    let console = run.console();
    assert!(!console.contains("did not stop in time"), "a service outlived the grace: {console}");
    // each waits at most jetrl_bus::SETTLE_RECONNECT (5 s) for the broker, the trainer its heartbeat's 3 s more
    assert!(took < Duration::from_secs(15), "stopping took {took:?}; console:\n{console}");
    assert!(console.contains("job stopped: interrupted"), "{console} ({status})");
    let trainer = run.log("trainer");
    assert!(trainer.contains("NATS unreachable: ledger.jsonl not written"), "{trainer}");
    assert!(trainer.contains("trainer stopped by shutdown"), "{trainer}");
    for (service, stopped) in [
        ("rollout-0", "rollout worker stopped"),
        ("reward-0", "reward service stopped"),
        ("checkpoint-sync", "checkpoint-sync stopped"),
    ] {
        let log = run.log(service);
        assert!(log.contains(stopped), "{service}: {log}");
    }
}
