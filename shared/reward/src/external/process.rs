//! One running user-function process: spawned under its limits, fed request lines, read for answers, killed
//! with its whole process group when it misbehaves.

use std::collections::VecDeque;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

use super::protocol::{read_response_line, ResponseLine};
use super::ExternalError;
use crate::failure::ScoreFailure;
use crate::result::{truncate_for_message, RewardResult};

/// A longer line is not an answer we are willing to buffer.
const MAX_LINE_BYTES: u64 = 64 << 20;
/// stderr lines kept to explain a crash.
const STDERR_TAIL_LINES: usize = 8;

/// How to start the function: the final argv (with any isolation wrapper) and its limits.
#[derive(Debug, Clone)]
pub struct LaunchSpec {
    pub argv: Vec<String>,
    /// RLIMIT_AS in bytes; `None` = inherit
    pub address_space_limit: Option<u64>,
}

/// A batch's answer: per-item results, or one failure for the whole batch.
pub type BatchAnswer = Result<Vec<Result<RewardResult, ScoreFailure>>, ScoreFailure>;

pub struct UserFunctionProcess {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    /// the process group to kill: the function may have started helpers of its own
    process_group: Option<i32>,
    /// the last stderr lines, quoted in crash reports
    stderr_tail: Arc<Mutex<VecDeque<String>>>,
    /// the stderr forwarder, awaited (briefly) after a crash so the tail holds the dying words
    stderr_forwarder: Option<tokio::task::JoinHandle<()>>,
}

impl UserFunctionProcess {
    pub fn spawn(spec: &LaunchSpec) -> Result<Self, ExternalError> {
        let (program, args) = spec.argv.split_first().ok_or(ExternalError::EmptyCommand)?;
        let mut command = Command::new(program);
        command
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Protocol lines must not sit in a pipe buffer.
            .env("PYTHONUNBUFFERED", "1")
            .kill_on_drop(true)
            .process_group(0);
        if let Some(limit) = spec.address_space_limit {
            // SAFETY: the closure runs in the forked child before exec and only calls setrlimit, which is
            // async-signal-safe; it touches no memory shared with the parent.
            #[allow(unsafe_code)]
            unsafe {
                command.pre_exec(move || {
                    let rlimit = libc::rlimit { rlim_cur: limit as libc::rlim_t, rlim_max: limit as libc::rlim_t };
                    if libc::setrlimit(libc::RLIMIT_AS, &rlimit) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let mut child = command.spawn().map_err(|source| ExternalError::Spawn { program: program.clone(), source })?;
        let (Some(stdin), Some(stdout), Some(stderr)) = (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            return Err(ExternalError::Spawn {
                program: program.clone(),
                source: std::io::Error::other("stdio pipes were not created"),
            });
        };
        let pid = child.id();
        let stderr_tail = Arc::new(Mutex::new(VecDeque::with_capacity(STDERR_TAIL_LINES)));
        let stderr_forwarder = tokio::spawn(forward_stderr(stderr, pid, Arc::clone(&stderr_tail)));
        tracing::info!(pid, program = %program, "started user reward function");
        Ok(Self {
            child,
            stdin,
            stdout: BufReader::new(stdout),
            process_group: pid.and_then(|pid| i32::try_from(pid).ok()),
            stderr_tail,
            stderr_forwarder: Some(stderr_forwarder),
        })
    }

    /// Whether the process is still running (it may have died while idle).
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Sends one request line and waits for its answer. A process-level fault (timeout, crash, unreadable
    /// output) comes back as `Err`: the caller must then discard this process.
    pub async fn exchange(
        &mut self,
        line: &[u8],
        id: u64,
        item_count: usize,
        timeout: Duration,
    ) -> Result<BatchAnswer, ExternalError> {
        match tokio::time::timeout(timeout, self.write_then_read(line, id, item_count)).await {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(ExternalError::Crashed { .. })) | Ok(Err(ExternalError::Write(_))) => {
                Err(ExternalError::Crashed { detail: self.exit_detail().await })
            }
            Ok(Err(other)) => Err(other),
            Err(_) => Err(ExternalError::Timeout { after: timeout }),
        }
    }

    async fn write_then_read(&mut self, line: &[u8], id: u64, item_count: usize) -> Result<BatchAnswer, ExternalError> {
        self.stdin.write_all(line).await.map_err(ExternalError::Write)?;
        self.stdin.write_all(b"\n").await.map_err(ExternalError::Write)?;
        self.stdin.flush().await.map_err(ExternalError::Write)?;
        let mut buffer = Vec::new();
        loop {
            buffer.clear();
            let read = (&mut self.stdout).take(MAX_LINE_BYTES).read_until(b'\n', &mut buffer).await;
            match read {
                Ok(0) => return Err(ExternalError::Crashed { detail: String::new() }),
                Ok(_) if buffer.last() != Some(&b'\n') && buffer.len() as u64 >= MAX_LINE_BYTES => {
                    return Err(ExternalError::LineTooLong { limit: MAX_LINE_BYTES })
                }
                Ok(_) => {}
                Err(source) => return Err(ExternalError::Read(source)),
            }
            let text = String::from_utf8_lossy(&buffer);
            match read_response_line(text.trim_end(), id, item_count) {
                ResponseLine::Answer(answer) => return Ok(answer),
                ResponseLine::Unrelated => {
                    tracing::debug!(line = %truncate_for_message(text.trim_end()), "skipped a non-protocol stdout line");
                }
            }
        }
    }

    /// The exit status (waiting briefly for it) and the last stderr lines.
    async fn exit_detail(&mut self) -> String {
        let status = match tokio::time::timeout(Duration::from_secs(1), self.child.wait()).await {
            Ok(Ok(status)) => status.to_string(),
            Ok(Err(e)) => format!("exit status unknown: {e}"),
            Err(_) => "closed its output but is still running".to_string(),
        };
        if let Some(forwarder) = self.stderr_forwarder.take() {
            // stderr reaches end of file once the process is gone (unless a helper it started keeps it open).
            let _ = tokio::time::timeout(Duration::from_millis(500), forwarder).await;
        }
        let tail = self.stderr_tail.lock().map(|lines| lines.iter().cloned().collect::<Vec<_>>().join(" | "));
        match tail {
            Ok(tail) if !tail.is_empty() => format!("{status}; stderr: {tail}"),
            _ => status,
        }
    }

    /// Kills the whole process group now; the child is reaped in the background.
    pub fn kill(&mut self) {
        if let Some(group) = self.process_group.take() {
            if matches!(self.child.try_wait(), Ok(None)) {
                // SAFETY: plain syscall on a process group id we created (`process_group(0)` makes the child's
                // pid its group id); the child is not yet reaped, so the id cannot have been reused.
                #[allow(unsafe_code)]
                unsafe {
                    libc::kill(-group, libc::SIGKILL);
                }
            }
        }
        let _ = self.child.start_kill();
    }
}

impl Drop for UserFunctionProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

async fn forward_stderr(stderr: tokio::process::ChildStderr, pid: Option<u32>, tail: Arc<Mutex<VecDeque<String>>>) {
    // Bounded reads: a function printing megabytes without a newline must not grow our memory.
    const STDERR_CHUNK_BYTES: u64 = 16 << 10;
    let mut reader = BufReader::new(stderr);
    let mut buffer = Vec::new();
    loop {
        buffer.clear();
        match (&mut reader).take(STDERR_CHUNK_BYTES).read_until(b'\n', &mut buffer).await {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        let line = truncate_for_message(String::from_utf8_lossy(&buffer).trim_end());
        tracing::info!(pid, "reward function: {line}");
        if let Ok(mut tail) = tail.lock() {
            if tail.len() == STDERR_TAIL_LINES {
                tail.pop_front();
            }
            tail.push_back(line);
        }
    }
}
