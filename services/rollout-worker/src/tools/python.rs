//! `python`: runs model-written code in a subprocess. The sandbox is resource limits, not isolation:
//! `python -I` (no environment, no user site) in an empty temporary directory with a minimal environment; an
//! address-space limit, a CPU-time limit, a file-size limit and no core dumps (setrlimit in the child); a wall-clock
//! timeout that kills the whole process group; stdout and stderr read up to a byte cap. It does not stop the code
//! from reading files or opening sockets: run workers in a container (deploy/) when the policy is untrusted.

use std::process::Stdio;
use std::time::Duration;

use futures::future::BoxFuture;
use serde_json::{json, Value};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};

use super::{Tool, ToolError, ToolOutput};

/// What one run may use.
#[derive(Debug, Clone)]
pub struct PythonLimits {
    pub bin: String,
    pub timeout: Duration,
    pub memory_bytes: u64,
    pub max_output_bytes: usize,
}

#[derive(Debug, Clone)]
pub struct PythonTool {
    limits: PythonLimits,
}

impl PythonTool {
    pub fn new(limits: PythonLimits) -> Self {
        PythonTool { limits }
    }

    async fn run(&self, code: &str) -> Result<ToolOutput, ToolError> {
        let limits = &self.limits;
        let dir = tempfile::tempdir().map_err(|e| ToolError::Start(format!("temporary directory: {e}")))?;
        let mut command = tokio::process::Command::new(&limits.bin);
        command
            .args(["-I", "-"])
            .current_dir(dir.path())
            .env_clear()
            .env("PATH", "/usr/local/bin:/usr/bin:/bin")
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .env("PYTHONIOENCODING", "utf-8")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let memory = limits.memory_bytes;
        let cpu_seconds = limits.timeout.as_secs() + 1;
        let file_bytes = (limits.max_output_bytes as u64).max(1 << 20);
        // SAFETY: the closure runs in the forked child before exec and only calls async-signal-safe libc
        // functions (setpgid, setrlimit) on values computed before the fork.
        #[allow(unsafe_code)]
        unsafe {
            command.pre_exec(move || {
                // Own process group, so the timeout can kill children the code spawns too.
                libc::setpgid(0, 0);
                let limit = |resource, value: u64| {
                    let rlim = libc::rlimit { rlim_cur: value as libc::rlim_t, rlim_max: value as libc::rlim_t };
                    libc::setrlimit(resource, &rlim)
                };
                limit(libc::RLIMIT_AS, memory);
                limit(libc::RLIMIT_CPU, cpu_seconds);
                limit(libc::RLIMIT_FSIZE, file_bytes);
                limit(libc::RLIMIT_CORE, 0);
                Ok(())
            });
        }
        let mut child = command.spawn().map_err(|e| ToolError::Start(format!("{}: {e}", limits.bin)))?;
        let pid = child.id();
        let stdin = child.stdin.take();
        let stdout = child.stdout.take();
        let stderr = child.stderr.take();
        let cap = limits.max_output_bytes;
        let work = async {
            if let Some(mut stdin) = stdin {
                // A child that exits without reading its input closes the pipe: not an error of the tool.
                let _ = stdin.write_all(code.as_bytes()).await;
                drop(stdin);
            }
            let (out, err) = tokio::join!(read_capped(stdout, cap), read_capped(stderr, cap));
            let status = child.wait().await;
            (out, err, status)
        };
        let (out, err, status) = match tokio::time::timeout(limits.timeout, work).await {
            Ok(done) => done,
            Err(_) => {
                if let Some(pid) = pid {
                    // SAFETY: signalling the child's own process group (created by setpgid above).
                    #[allow(unsafe_code)]
                    unsafe {
                        libc::kill(-(pid as i32), libc::SIGKILL);
                    }
                }
                return Err(ToolError::Timeout(limits.timeout.as_secs_f64()));
            }
        };
        let status = status.map_err(|e| ToolError::Execution(format!("waiting for python: {e}")))?;
        let mut text = out.text;
        if !err.text.is_empty() {
            if !text.is_empty() && !text.ends_with('\n') {
                text.push('\n');
            }
            text.push_str(&err.text);
        }
        if out.truncated || err.truncated {
            text.push_str(&format!("\n...(output truncated at {cap} bytes)"));
        }
        if status.success() {
            Ok(ToolOutput::text(text))
        } else {
            let why = match status.code() {
                Some(code) => format!("exit status {code}"),
                None => "killed by a signal (a resource limit?)".to_string(),
            };
            Err(ToolError::Execution(if text.is_empty() { why } else { format!("{why}\n{text}") }))
        }
    }
}

struct Captured {
    text: String,
    truncated: bool,
}

/// Reads a pipe to its end, keeping the first `cap` bytes (the rest is drained so the child never blocks).
async fn read_capped(pipe: Option<impl AsyncRead + Unpin>, cap: usize) -> Captured {
    let mut kept = Vec::new();
    let mut truncated = false;
    if let Some(mut pipe) = pipe {
        let mut buf = [0u8; 8192];
        loop {
            match pipe.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let room = cap.saturating_sub(kept.len());
                    kept.extend_from_slice(&buf[..n.min(room)]);
                    truncated |= n > room;
                }
            }
        }
    }
    Captured { text: String::from_utf8_lossy(&kept).into_owned(), truncated }
}

impl Tool for PythonTool {
    fn name(&self) -> &str {
        "python"
    }

    fn schema(&self) -> Value {
        json!({
            "type": "function",
            "function": {
                "name": "python",
                "description": "Run a Python 3 program and return what it prints (stdout, then stderr).",
                "parameters": {
                    "type": "object",
                    "properties": {"code": {"type": "string", "description": "the program; print the results"}},
                    "required": ["code"],
                },
            },
        })
    }

    fn call(&self, arguments: Value) -> BoxFuture<'_, Result<ToolOutput, ToolError>> {
        Box::pin(async move {
            let code = match &arguments {
                Value::Object(map) => map.get("code").and_then(Value::as_str).map(str::to_string),
                Value::String(s) => Some(s.clone()),
                _ => None,
            }
            .ok_or_else(|| ToolError::Arguments("expected {\"code\": \"...\"}".into()))?;
            self.run(&code).await
        })
    }
}
