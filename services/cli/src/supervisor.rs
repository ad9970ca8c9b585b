//! Keeps a job's service processes running, as systemd's `Restart=on-failure` does in a deployment.
//!
//! - [`RestartPolicy`] and [`RestartHistory`]: the pure decision (restart after which delay, or give up on a
//!   crash loop), unit-tested without processes or clocks of their own.
//! - [`Supervisor`]: the processes. [`Supervisor::poll`] reaps exited services, decides with the policy, starts
//!   due restarts and returns what happened as [`Event`]s; `jetrl run` shows them and decides when the job ends.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use jetrl_config::SupervisorConfig;
use tokio::process::{Child, Command};

/// Backoff and crash-loop limits (`run.supervisor.*`).
#[derive(Debug, Clone, PartialEq)]
pub struct RestartPolicy {
    pub initial_delay: Duration,
    pub max_delay: Duration,
    /// a run at least this long resets the backoff to `initial_delay`
    pub healthy_after: Duration,
    /// restarts allowed within `window`; the next failure in the window is a crash loop
    pub max_restarts: u32,
    pub window: Duration,
}

impl RestartPolicy {
    pub fn from_config(cfg: &SupervisorConfig) -> Self {
        let secs = |s: f64| Duration::try_from_secs_f64(s).unwrap_or(Duration::MAX);
        Self {
            initial_delay: secs(cfg.restart_delay_s),
            max_delay: secs(cfg.max_restart_delay_s),
            healthy_after: secs(cfg.healthy_after_s),
            max_restarts: cfg.max_restarts,
            window: secs(cfg.restart_window_s),
        }
    }
}

/// What to do about a service that has just exited abnormally.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// start it again after `delay`; `restarts_in_window` counts this one
    Restart { delay: Duration, restarts_in_window: u32 },
    /// it already needed `restarts` restarts within the policy's window: stop the job
    CrashLoop { restarts: u32 },
}

/// The failures of one service so far.
#[derive(Debug, Default)]
pub struct RestartHistory {
    /// failures since the last healthy run: the backoff exponent
    consecutive_failures: u32,
    /// when each restart within the window was decided
    recent_restarts: VecDeque<Instant>,
}

impl RestartHistory {
    /// Records that the service started at `started` failed at `exited`, and decides.
    pub fn on_failure(&mut self, policy: &RestartPolicy, started: Instant, exited: Instant) -> Verdict {
        if exited.saturating_duration_since(started) >= policy.healthy_after {
            self.consecutive_failures = 0;
        }
        while self.recent_restarts.front().is_some_and(|t| exited.saturating_duration_since(*t) > policy.window) {
            self.recent_restarts.pop_front();
        }
        let in_window = u32::try_from(self.recent_restarts.len()).unwrap_or(u32::MAX);
        if in_window >= policy.max_restarts {
            return Verdict::CrashLoop { restarts: in_window };
        }
        let factor = 2u32.saturating_pow(self.consecutive_failures);
        let delay = policy.initial_delay.saturating_mul(factor).min(policy.max_delay);
        self.consecutive_failures = self.consecutive_failures.saturating_add(1);
        self.recent_restarts.push_back(exited);
        Verdict::Restart { delay, restarts_in_window: in_window + 1 }
    }
}

/// How to start one service.
#[derive(Debug, Clone)]
pub struct ServiceSpec {
    /// the name on the console and in `logs/<name>.log`
    pub name: String,
    pub binary: PathBuf,
    pub args: Vec<OsString>,
    pub log: PathBuf,
    /// services that live and die together (the trainer's ranks, docs/scale-out.md): when one fails, the others are
    /// stopped and all restart together
    pub group: Option<String>,
    /// variables set for this service on top of jetrl run's environment (a rollout worker's
    /// `CUDA_VISIBLE_DEVICES`)
    pub env: Vec<(String, String)>,
}

/// Something the supervisor did or saw, for the console and `supervisor.jsonl`.
#[derive(Debug)]
pub enum Event {
    /// the trainer exited 0: the job is done
    TrainerFinished,
    /// a service other than the trainer exited 0 on its own; as with `Restart=on-failure`, it stays stopped
    ExitedCleanly { service: String },
    /// a service exited abnormally (or could not be started) and will start again after `delay`
    Restarting { service: String, status: String, delay: Duration, restarts: u32 },
    /// a scheduled restart happened
    Restarted { service: String, pid: Option<u32> },
    /// stopped because `failed`, of the same group, failed: it restarts with it
    StoppedWithGroup { service: String, failed: String },
    /// a service exited with a permanent error ([`jetrl_telemetry::EXIT_PERMANENT`]): not restarted, the job ends
    Failed { service: String, log: PathBuf, log_tail: String },
    /// a service failed more often than the policy allows: the job ends
    CrashLoop { service: String, status: String, restarts: u32, log: PathBuf, log_tail: String },
}

/// One supervised service.
struct Supervised {
    spec: ServiceSpec,
    child: Option<Child>,
    started: Instant,
    /// a restart decided and not yet due
    restart_at: Option<Instant>,
    history: RestartHistory,
    /// restarts so far, for the end-of-job count
    restarts: u32,
    /// killed because another member of its group failed: its exit is not a failure of its own
    stopped_with_group: bool,
}

pub struct Supervisor {
    services: Vec<Supervised>,
    policy: RestartPolicy,
    /// the service whose clean exit ends the job
    trainer: String,
}

/// Lines of a crashed service's log shown on the console.
pub const LOG_TAIL_LINES: usize = 20;

impl Supervisor {
    pub fn new(policy: RestartPolicy, trainer: &str) -> Self {
        Self { services: Vec::new(), policy, trainer: trainer.to_string() }
    }

    /// Starts a service for the first time (its log file is truncated).
    ///
    /// Children are started from the calling thread, and PR_SET_PDEATHSIG fires when *that thread* ends: call
    /// this (and [`Supervisor::poll`]) from a thread that lives as long as the job (`jetrl run`'s main thread).
    /// Returns its process id.
    pub fn start(&mut self, spec: ServiceSpec) -> anyhow::Result<Option<u32>> {
        let log = std::fs::File::create(&spec.log)?;
        let child = spawn(&spec, log)?;
        let pid = child.id();
        self.services.push(Supervised {
            spec,
            child: Some(child),
            started: Instant::now(),
            restart_at: None,
            history: RestartHistory::default(),
            restarts: 0,
            stopped_with_group: false,
        });
        Ok(pid)
    }

    /// Reaps exited services, decides what to do about each, and starts the restarts that are due.
    pub fn poll(&mut self, now: Instant) -> Vec<Event> {
        let mut events = Vec::new();
        // (group, the member that failed, when the group restarts)
        let mut failed_groups: Vec<(String, String, Option<Instant>)> = Vec::new();
        for s in &mut self.services {
            if let Some(child) = s.child.as_mut() {
                let status = match child.try_wait() {
                    Ok(Some(status)) => status,
                    Ok(None) => continue,
                    Err(e) => {
                        tracing::warn!(service = %s.spec.name, error = %e, "cannot query the process");
                        continue;
                    }
                };
                s.child = None;
                if std::mem::take(&mut s.stopped_with_group) {
                    continue;
                }
                if status.success() {
                    events.push(if s.spec.name == self.trainer {
                        Event::TrainerFinished
                    } else {
                        Event::ExitedCleanly { service: s.spec.name.clone() }
                    });
                    continue;
                }
                // a permanent error (a bad job, a missing dataset) fails the same way on every restart
                let event = if status.code() == Some(jetrl_telemetry::EXIT_PERMANENT) {
                    Event::Failed {
                        service: s.spec.name.clone(),
                        log: s.spec.log.clone(),
                        log_tail: log_tail(&s.spec.log, LOG_TAIL_LINES),
                    }
                } else {
                    decide(s, &self.policy, describe(status), now)
                };
                if let (Event::Restarting { .. }, Some(group)) = (&event, &s.spec.group) {
                    failed_groups.push((group.clone(), s.spec.name.clone(), s.restart_at));
                }
                events.push(event);
            }
        }
        for (group, failed, at) in failed_groups {
            for s in self.services.iter_mut().filter(|s| s.spec.group.as_ref() == Some(&group) && s.spec.name != failed)
            {
                if let Some(pid) = s.child.as_ref().and_then(Child::id) {
                    signal(pid, libc::SIGKILL);
                    s.stopped_with_group = true;
                    events.push(Event::StoppedWithGroup { service: s.spec.name.clone(), failed: failed.clone() });
                }
                s.restart_at = at;
            }
        }
        for s in &mut self.services {
            // a member stopped with its group restarts once its old process is reaped
            if s.child.is_none() && s.restart_at.is_some_and(|at| at <= now) {
                s.restart_at = None;
                s.restarts += 1;
                match respawn(&s.spec, s.restarts) {
                    Ok(child) => {
                        events.push(Event::Restarted { service: s.spec.name.clone(), pid: child.id() });
                        s.child = Some(child);
                        s.started = now;
                    }
                    Err(e) => {
                        s.started = now;
                        events.push(decide(s, &self.policy, format!("could not be started: {e:#}"), now));
                    }
                }
            }
        }
        events
    }

    /// Every service running now, with its process id.
    pub fn running(&self) -> Vec<(String, u32)> {
        self.services
            .iter()
            .filter_map(|s| s.child.as_ref().and_then(Child::id).map(|pid| (s.spec.name.clone(), pid)))
            .collect()
    }

    /// Restarts per service so far (services never restarted are left out).
    pub fn restart_counts(&self) -> Vec<(String, u32)> {
        self.services.iter().filter(|s| s.restarts > 0).map(|s| (s.spec.name.clone(), s.restarts)).collect()
    }

    /// SIGTERM to every running service, then waits (up to `grace`) so each can settle what it holds; SIGKILL
    /// for stragglers. Pending restarts are dropped.
    pub async fn stop_all(&mut self, grace: Duration) {
        for s in &mut self.services {
            s.restart_at = None;
            if let Some(pid) = s.child.as_ref().and_then(Child::id) {
                signal(pid, libc::SIGTERM);
            }
        }
        let deadline = Instant::now() + grace;
        for s in &mut self.services {
            let Some(child) = s.child.as_mut() else { continue };
            let left = deadline.saturating_duration_since(Instant::now());
            if tokio::time::timeout(left, child.wait()).await.is_err() {
                eprintln!("{} did not stop in time; killing it", s.spec.name);
                let _ = child.kill().await;
            }
        }
    }
}

/// Applies the policy to a failure of `s` and schedules its restart.
fn decide(s: &mut Supervised, policy: &RestartPolicy, status: String, now: Instant) -> Event {
    match s.history.on_failure(policy, s.started, now) {
        Verdict::Restart { delay, restarts_in_window } => {
            s.restart_at = Some(now + delay);
            Event::Restarting { service: s.spec.name.clone(), status, delay, restarts: restarts_in_window }
        }
        Verdict::CrashLoop { restarts } => Event::CrashLoop {
            service: s.spec.name.clone(),
            status,
            restarts,
            log: s.spec.log.clone(),
            log_tail: log_tail(&s.spec.log, LOG_TAIL_LINES),
        },
    }
}

/// `exit status: 1`, `signal: 9 (SIGKILL)`.
pub fn describe(status: ExitStatus) -> String {
    status.to_string()
}

pub fn signal(pid: u32, signal: libc::c_int) {
    if let Ok(pid) = libc::pid_t::try_from(pid) {
        // SAFETY: kill(2) with a pid we spawned and a valid signal has no memory-safety preconditions.
        #[allow(unsafe_code)]
        unsafe {
            libc::kill(pid, signal);
        }
    }
}

/// Starts again with the log appended to, after a line saying so (the crash's last lines stay above it).
fn respawn(spec: &ServiceSpec, restart: u32) -> anyhow::Result<Child> {
    let mut log = std::fs::OpenOptions::new().create(true).append(true).open(&spec.log)?;
    writeln!(log, "----- jetrl run: restart {restart} of {} -----", spec.name)?;
    spawn(spec, log)
}

fn spawn(spec: &ServiceSpec, log: std::fs::File) -> anyhow::Result<Child> {
    anyhow::ensure!(spec.binary.exists(), "{} not found (build the workspace: cargo build)", spec.binary.display());
    let mut command = Command::new(&spec.binary);
    // If `jetrl run` itself dies (even by SIGKILL), its services get SIGTERM and settle what they hold.
    jetrl_bus::harness::signal_when_parent_dies(command.as_std_mut(), libc::SIGTERM);
    let child = command
        .args(&spec.args)
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| anyhow::anyhow!("starting {}: {e}", spec.binary.display()))?;
    Ok(child)
}

/// The last `lines` lines of a log file (reading at most its last 64 KiB).
pub fn log_tail(path: &Path, lines: usize) -> String {
    const MAX_BYTES: u64 = 64 * 1024;
    let Ok(mut file) = std::fs::File::open(path) else { return String::new() };
    let len = file.metadata().map_or(0, |m| m.len());
    if file.seek(SeekFrom::Start(len.saturating_sub(MAX_BYTES))).is_err() {
        return String::new();
    }
    let mut bytes = Vec::new();
    if file.read_to_end(&mut bytes).is_err() {
        return String::new();
    }
    let text = String::from_utf8_lossy(&bytes);
    let all = without_backtraces(text.lines());
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// The lines with each Rust backtrace (a panic's or an `anyhow` error's) folded into one line: under
/// `RUST_BACKTRACE=1` a failed service's last lines would otherwise be frames, the error above them.
fn without_backtraces<'a>(lines: impl Iterator<Item = &'a str>) -> Vec<&'a str> {
    let mut kept = Vec::new();
    let mut in_backtrace = false;
    for line in lines {
        let trimmed = line.trim_start();
        if trimmed.eq_ignore_ascii_case("stack backtrace:") {
            in_backtrace = true;
            kept.push("(backtrace omitted)");
            continue;
        }
        let frame =
            trimmed.split_once(':').is_some_and(|(n, _)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
        let location = line.starts_with(' ') && trimmed.starts_with("at ");
        let note = trimmed.starts_with("note: Some details are omitted");
        if in_backtrace && (frame || location || note || trimmed.is_empty()) {
            continue;
        }
        in_backtrace = false;
        kept.push(line);
    }
    kept
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn policy() -> RestartPolicy {
        RestartPolicy::from_config(&SupervisorConfig::default())
    }

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    /// A service that dies right after each start: 1 s, 2 s, 4 s, ... capped at 30 s.
    #[test]
    fn delay_doubles_per_consecutive_failure_up_to_the_cap() {
        let policy = RestartPolicy { max_restarts: 100, window: secs(1), ..policy() };
        let mut history = RestartHistory::default();
        let t0 = Instant::now();
        let mut now = t0;
        let mut delays = Vec::new();
        for _ in 0..7 {
            match history.on_failure(&policy, now, now + secs(1)) {
                Verdict::Restart { delay, .. } => {
                    delays.push(delay.as_secs());
                    now += secs(1) + delay;
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(delays, [1, 2, 4, 8, 16, 30, 30]);
    }

    #[test]
    fn a_healthy_run_resets_the_backoff() {
        let policy = policy();
        let mut history = RestartHistory::default();
        let t0 = Instant::now();
        assert!(
            matches!(history.on_failure(&policy, t0, t0 + secs(1)), Verdict::Restart { delay, .. } if delay == secs(1))
        );
        assert!(
            matches!(history.on_failure(&policy, t0 + secs(2), t0 + secs(3)), Verdict::Restart { delay, .. } if delay == secs(2))
        );
        // ran 60 s (healthy_after) before failing again: back to 1 s
        let started = t0 + secs(5);
        let verdict = history.on_failure(&policy, started, started + secs(60));
        assert!(matches!(verdict, Verdict::Restart { delay, .. } if delay == secs(1)), "{verdict:?}");
    }

    /// Five restarts within two minutes are allowed; the sixth failure in the window is a crash loop.
    #[test]
    fn more_failures_than_the_limit_within_the_window_is_a_crash_loop() {
        let policy = policy();
        let mut history = RestartHistory::default();
        let t0 = Instant::now();
        for i in 1..=5u32 {
            let at = t0 + secs(u64::from(i) * 10);
            let verdict = history.on_failure(&policy, at - secs(1), at);
            assert!(
                matches!(verdict, Verdict::Restart { restarts_in_window, .. } if restarts_in_window == i),
                "{verdict:?}"
            );
        }
        let verdict = history.on_failure(&policy, t0 + secs(59), t0 + secs(60));
        assert_eq!(verdict, Verdict::CrashLoop { restarts: 5 });
    }

    /// Failures spread wider than the window never add up to a crash loop.
    #[test]
    fn failures_older_than_the_window_are_forgotten() {
        let policy = policy();
        let mut history = RestartHistory::default();
        let t0 = Instant::now();
        for i in 0..20u64 {
            let at = t0 + secs(i * 30);
            let verdict = history.on_failure(&policy, at - secs(1), at);
            assert!(matches!(verdict, Verdict::Restart { .. }), "failure {i}: {verdict:?}");
        }
    }

    #[test]
    fn zero_restarts_allowed_means_the_first_failure_ends_the_job() {
        let policy = RestartPolicy { max_restarts: 0, ..policy() };
        let t0 = Instant::now();
        assert_eq!(RestartHistory::default().on_failure(&policy, t0, t0), Verdict::CrashLoop { restarts: 0 });
    }

    #[test]
    fn log_tail_keeps_the_last_lines() {
        let path = std::env::temp_dir().join(format!("jetrl-log-tail-{}.log", std::process::id()));
        let text: String = (0..100).map(|i| format!("line {i}\n")).collect();
        std::fs::write(&path, text).unwrap();
        let tail = log_tail(&path, 3);
        let _ = std::fs::remove_file(&path);
        assert_eq!(tail, "line 97\nline 98\nline 99");
        assert_eq!(log_tail(Path::new("/nonexistent/log"), 3), "");
    }

    /// Under RUST_BACKTRACE=1 the error comes before dozens of frames: the tail shows the error.
    #[test]
    fn log_tail_folds_backtraces_so_the_error_shows() {
        let log = "starting\nError: metrics endpoint: cannot bind 256.0.0.1:1\n\nStack backtrace:\n   0: anyhow::error\n             at /src/error.rs:1:1\n  17: main\n  18: _start\n";
        assert_eq!(
            without_backtraces(log.lines()),
            ["starting", "Error: metrics endpoint: cannot bind 256.0.0.1:1", "", "(backtrace omitted)"]
        );
        let panic = "thread 'main' panicked at src/main.rs:1:1:\nboom\nstack backtrace:\n   0: rust_begin_unwind\nnote: Some details are omitted, run with `RUST_BACKTRACE=full` for a verbose backtrace.\nnext line";
        assert_eq!(
            without_backtraces(panic.lines()),
            ["thread 'main' panicked at src/main.rs:1:1:", "boom", "(backtrace omitted)", "next line"]
        );
    }

    /// A service that exits with the permanent-error status is not restarted; one that exits 1 is.
    #[tokio::test]
    async fn a_permanent_error_ends_the_job_and_an_ordinary_one_restarts() {
        let dir = tempfile::tempdir().unwrap();
        let spec = |name: &str, code: i32| ServiceSpec {
            name: name.into(),
            binary: "/bin/sh".into(),
            args: vec!["-c".into(), format!("exit {code}").into()],
            log: dir.path().join(format!("{name}.log")),
            group: None,
            env: Vec::new(),
        };
        let mut supervisor = Supervisor::new(policy(), "trainer");
        supervisor.start(spec("trainer", jetrl_telemetry::EXIT_PERMANENT)).unwrap();
        supervisor.start(spec("reward", 1)).unwrap();
        let mut events = Vec::new();
        let deadline = Instant::now() + secs(10);
        while events.len() < 2 && Instant::now() < deadline {
            events.extend(supervisor.poll(Instant::now()));
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(
            events.iter().any(|e| matches!(e, Event::Failed { service, .. } if service == "trainer")),
            "{events:?}"
        );
        assert!(
            events.iter().any(|e| matches!(e, Event::Restarting { service, .. } if service == "reward")),
            "{events:?}"
        );
    }
}
