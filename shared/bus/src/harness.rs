//! A real `nats-server -js` for tests and for `jetrl run`: a free port on 127.0.0.1, a temporary store
//! directory, `max_payload` raised to 8 MiB (so a 2 MB trajectory fits in one message), killed on drop; with
//! [`NatsServer::start_with_auth`], only the users of a generated `auth.conf` may connect.

use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::BusError;

/// The server's max_payload: big enough for long trajectories (the NATS default is 1 MiB).
pub const MAX_PAYLOAD_BYTES: usize = 8 * 1024 * 1024;

pub struct NatsServer {
    binary: PathBuf,
    port: u16,
    /// holds the JetStream store and the log; removed on drop unless the caller owns the directory
    dir: Option<tempfile::TempDir>,
    root: PathBuf,
    child: Option<Child>,
    max_payload: usize,
    /// more configuration written at every start: accounts and users, a profiling port
    auth: Option<String>,
    /// environment of the server process at every start (e.g. `GOMEMLIMIT`, the Go runtime's soft memory limit)
    env: Vec<(String, String)>,
}

impl NatsServer {
    /// Starts a server on a free port with a fresh temporary store.
    pub fn start() -> Result<Self, BusError> {
        Self::in_temp_dir(free_port()?, MAX_PAYLOAD_BYTES, None)
    }

    /// Starts a server as [`NatsServer::start`] does, with another `max_payload` (tests of oversized messages).
    pub fn start_with_max_payload(max_payload: usize) -> Result<Self, BusError> {
        Self::in_temp_dir(free_port()?, max_payload, None)
    }

    /// Starts a server as [`NatsServer::start`] does, on `port` (see [`free_port`]), that lets in only the users
    /// of `auth`: nats-server configuration naming accounts, users, passwords and permissions, such as the
    /// `server/auth.conf` deploy/nats/gen.sh writes. It is part of the server's configuration at every start
    /// ([`NatsServer::restart`] too), and that file is readable by its owner only.
    pub fn start_with_auth(port: u16, auth: &Path) -> Result<Self, BusError> {
        let auth = std::fs::read_to_string(auth).map_err(|e| BusError::Server(format!("{}: {e}", auth.display())))?;
        Self::in_temp_dir(port, MAX_PAYLOAD_BYTES, Some(auth))
    }

    /// Starts a server as [`NatsServer::start`] does with `extra` added to its configuration (at every start), e.g.
    /// `prof_port: <port>` for a benchmark that reads the broker's heap.
    pub fn start_with_config(extra: &str) -> Result<Self, BusError> {
        Self::start_with_config_and_env(extra, Vec::new())
    }

    /// Starts a server as [`NatsServer::start_with_config`] does, its process given `env` (at every start), e.g.
    /// `GOMEMLIMIT` for a benchmark that runs the broker under a memory limit as a deployment does.
    pub fn start_with_config_and_env(extra: &str, env: Vec<(String, String)>) -> Result<Self, BusError> {
        let mut server = Self::unstarted(free_port()?, MAX_PAYLOAD_BYTES, Some(format!("{extra}\n")))?;
        server.env = env;
        server.launched()
    }

    /// Starts a server whose store lives in `root` (kept after drop), e.g. a run directory.
    pub fn start_in(root: &Path) -> Result<Self, BusError> {
        std::fs::create_dir_all(root).map_err(|e| BusError::Server(format!("{}: {e}", root.display())))?;
        let server = Self {
            binary: find_binary()?,
            port: free_port()?,
            dir: None,
            root: root.to_path_buf(),
            child: None,
            max_payload: MAX_PAYLOAD_BYTES,
            auth: None,
            env: Vec::new(),
        };
        server.launched()
    }

    fn in_temp_dir(port: u16, max_payload: usize, auth: Option<String>) -> Result<Self, BusError> {
        Self::unstarted(port, max_payload, auth)?.launched()
    }

    /// A server with a fresh temporary store, not started yet.
    fn unstarted(port: u16, max_payload: usize, auth: Option<String>) -> Result<Self, BusError> {
        let dir = tempfile::Builder::new()
            .prefix("jetrl-nats-")
            .tempdir()
            .map_err(|e| BusError::Server(format!("temp dir: {e}")))?;
        let root = dir.path().to_path_buf();
        Ok(Self { binary: find_binary()?, port, dir: Some(dir), root, child: None, max_payload, auth, env: Vec::new() })
    }

    fn launched(mut self) -> Result<Self, BusError> {
        self.spawn()?;
        Ok(self)
    }

    fn spawn(&mut self) -> Result<(), BusError> {
        let conf = self.root.join("nats.conf");
        let log = self.root.join("nats.log");
        let store = self.root.join("jetstream");
        let mut text = format!(
            "host: 127.0.0.1\nport: {}\nmax_payload: {}\njetstream {{\n  store_dir: {:?}\n}}\n",
            self.port,
            self.max_payload,
            store.display().to_string()
        );
        if let Some(auth) = &self.auth {
            text.push_str(auth);
        }
        write_private(&conf, &text).map_err(|e| BusError::Server(format!("{}: {e}", conf.display())))?;
        let _ = std::fs::remove_file(&log);
        let mut command = Command::new(&self.binary);
        // The server must not outlive the process that started it (a test or `jetrl run` killed hard).
        die_with_parent(&mut command);
        let child = command
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .arg("-c")
            .arg(&conf)
            .arg("-l")
            .arg(&log)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| BusError::Server(format!("cannot start {}: {e}", self.binary.display())))?;
        self.child = Some(child);
        self.wait_ready(&log)
    }

    fn wait_ready(&mut self, log: &Path) -> Result<(), BusError> {
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(20) {
            if let Ok(text) = std::fs::read_to_string(log) {
                if text.contains("Server is ready") {
                    return Ok(());
                }
            }
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    let mut stderr = String::new();
                    if let Some(mut pipe) = child.stderr.take() {
                        let _ = pipe.read_to_string(&mut stderr);
                    }
                    let logged = std::fs::read_to_string(log).unwrap_or_default();
                    return Err(BusError::Server(format!("exited with {status} before ready: {stderr}{logged}")));
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err(BusError::Server(format!("not ready after 20s (log: {})", log.display())))
    }

    /// The server's process id (while it runs).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The directory holding the store, config and log.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// How the server ended, once it has died on its own (a crash, an OOM kill); `None` while it runs and
    /// after `kill` or `stop`. A supervisor polls this and calls `restart`.
    pub fn exit_status(&mut self) -> Option<std::process::ExitStatus> {
        self.child.as_mut().and_then(|child| child.try_wait().ok().flatten())
    }

    /// The server's log file (rewritten at each start).
    pub fn log_path(&self) -> PathBuf {
        self.root.join("nats.log")
    }

    /// Kills the server (SIGKILL, as a crash would) and starts it again on the same port and store.
    pub fn restart(&mut self) -> Result<(), BusError> {
        self.kill();
        self.spawn()
    }

    /// Stops the server abruptly; `restart` brings it back.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stops the server gracefully (SIGTERM), waiting up to 5 s.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let pid = child.id().to_string();
            let _ = Command::new("kill").arg("-TERM").arg(&pid).status();
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
        // TempDir (if any) removes the store when dropped after this.
        let _ = self.dir.take();
    }
}

/// Writes `text` to `path`, readable and writable by its owner only (it may hold passwords).
fn write_private(path: &Path, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let mut file = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(path)?;
    // an older file keeps its mode: make it private before writing
    file.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    file.write_all(text.as_bytes())
}

/// A port on 127.0.0.1 that nothing listens on now (the kernel's choice), for a server started soon after.
pub fn free_port() -> Result<u16, BusError> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| BusError::Server(format!("no free port: {e}")))?;
    listener.local_addr().map(|a| a.port()).map_err(|e| BusError::Server(format!("no free port: {e}")))
}

/// `n` distinct ports on 127.0.0.1 that nothing listens on now: each listener is held until all are chosen, so no
/// two are the same (ports chosen one at a time with [`free_port`] can repeat: a three-node cluster once got one
/// node's route port equal to another's client port, and that node did not start).
pub fn free_ports(n: usize) -> Result<Vec<u16>, BusError> {
    let listeners = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").map_err(|e| BusError::Server(format!("no free port: {e}"))))
        .collect::<Result<Vec<_>, _>>()?;
    listeners
        .iter()
        .map(|l| l.local_addr().map(|a| a.port()).map_err(|e| BusError::Server(format!("no free port: {e}"))))
        .collect()
}

/// Makes the process `command` starts get SIGKILL when the thread that starts it ends (PR_SET_PDEATHSIG; Linux
/// only, elsewhere nothing): a child of a test or benchmark that is killed hard does not outlive it. Start the
/// child from a thread that lives as long as the caller (the main thread), not from a pooled one.
pub fn die_with_parent(command: &mut Command) {
    signal_when_parent_dies(command, libc::SIGKILL);
}

/// Like [`die_with_parent`] with another signal (`jetrl run` gives its services SIGTERM, so they settle what they
/// hold).
pub fn signal_when_parent_dies(command: &mut Command, signal: libc::c_int) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: prctl(PR_SET_PDEATHSIG) is async-signal-safe and touches no memory of the parent.
        #[allow(unsafe_code)]
        unsafe {
            command.pre_exec(move || {
                libc::prctl(libc::PR_SET_PDEATHSIG, signal);
                Ok(())
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (command, signal);
}

/// Finds `nats-server`: `$JETRL_NATS_SERVER`, then `.venv/bin/nats-server` in this checkout (where
/// scripts/setup.sh installs it) or above the current directory/executable, then `$PATH`.
pub fn find_binary() -> Result<PathBuf, BusError> {
    if let Some(path) = std::env::var_os("JETRL_NATS_SERVER") {
        return Ok(PathBuf::from(path));
    }
    let mut starts: Vec<PathBuf> = vec![PathBuf::from(env!("CARGO_MANIFEST_DIR"))];
    if let Ok(dir) = std::env::current_dir() {
        starts.push(dir);
    }
    if let Ok(exe) = std::env::current_exe() {
        starts.push(exe);
    }
    for start in starts {
        for dir in start.ancestors() {
            let candidate = dir.join(".venv/bin/nats-server");
            if candidate.is_file() {
                return Ok(candidate);
            }
        }
    }
    if let Some(paths) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&paths) {
            let candidate = dir.join("nats-server");
            if candidate.is_file() {
                return Ok(candidate);
            }
        }
    }
    Err(BusError::Server(
        "nats-server not found: run scripts/setup.sh (installs it into .venv) or set JETRL_NATS_SERVER".into(),
    ))
}
