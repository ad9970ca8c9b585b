//! A nats-server running the least-privilege configuration deploy/nats/gen.sh generates (TLS with client
//! certificates, one user per service, the generated permissions), on a free loopback port with a temporary
//! store, killed on drop.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use jetrl_config::NatsConfig;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Runs deploy/nats/gen.sh with `args`; panics with its output unless it succeeds. Returns its output.
pub fn gen(args: &[&str]) -> String {
    let out = Command::new("bash").arg(repo().join("deploy/nats/gen.sh")).args(args).output().expect("bash");
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "gen.sh {args:?} failed:\n{text}");
    text
}

pub struct SecureNats {
    dir: tempfile::TempDir,
    port: u16,
    child: Child,
}

impl SecureNats {
    /// Generates a deployment for namespace `jetrl` (hosts 127.0.0.1, localhost and nats, as gen.sh's default)
    /// into a temporary directory and starts nats-server with it.
    pub fn start() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("free port");
        let out = dir.path().join("generated");
        let server_dir = out.join("server");
        gen(&[
            "--out",
            &out.display().to_string(),
            "--install-dir",
            &server_dir.display().to_string(),
            "--store-dir",
            &dir.path().join("jetstream").display().to_string(),
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--monitor",
            "off",
        ]);
        let child = Command::new(jetrl_bus::harness::find_binary().expect("nats-server"))
            .arg("-c")
            .arg(server_dir.join("nats.conf"))
            .arg("-l")
            .arg(dir.path().join("nats.log"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting nats-server");
        let server = Self { dir, port, child };
        let started = Instant::now();
        while !server.log().contains("Server is ready") {
            assert!(started.elapsed() < Duration::from_secs(20), "nats-server not ready:\n{}", server.log());
            std::thread::sleep(Duration::from_millis(20));
        }
        server
    }

    pub fn url(&self) -> String {
        format!("tls://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// A scratch directory that lives as long as the server.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// What gen.sh wrote (`server/`, `clients/`, `ca/`).
    pub fn generated(&self) -> PathBuf {
        self.dir.path().join("generated")
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("nats.log")).unwrap_or_default()
    }

    /// The server's log lines about refused publishes and subscriptions.
    pub fn violations(&self) -> Vec<String> {
        self.log().lines().filter(|l| l.contains(" Violation")).map(str::to_string).collect()
    }

    /// The `nats.yaml` gen.sh wrote for `user` (a job-file section, as `jetrl status --config` reads it).
    pub fn identity_file(&self, user: &str) -> PathBuf {
        self.generated().join("clients").join(user).join("nats.yaml")
    }

    /// `user`'s NATS settings, loaded through the job configuration as a service loads them.
    pub fn identity(&self, user: &str) -> NatsConfig {
        let job: jetrl_config::JobConfig =
            jetrl_config::load(Some(&self.identity_file(user)), &[]).expect("generated nats.yaml loads");
        NatsConfig { connect_timeout_s: 20.0, ..job.nats }
    }

    /// `user`'s NATS settings as command-line overrides (`nats.user=...`).
    pub fn overrides(&self, user: &str) -> Vec<String> {
        let text = std::fs::read_to_string(self.identity_file(user)).expect("nats.yaml");
        let doc: serde_yaml::Value = serde_yaml::from_str(&text).expect("yaml");
        let section = doc["nats"].as_mapping().expect("a nats section");
        section
            .iter()
            .map(|(k, v)| format!("nats.{}={}", k.as_str().unwrap_or_default(), v.as_str().unwrap_or_default()))
            .collect()
    }

    pub async fn connect(&self, user: &str) -> jetrl_bus::Bus {
        let names = jetrl_wire::subjects::Names::new("jetrl").expect("the default namespace");
        jetrl_bus::Bus::connect(&self.identity(user), &names, &format!("test-{user}"))
            .await
            .unwrap_or_else(|e| panic!("{user}: {e}"))
    }
}

impl Drop for SecureNats {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("----- nats-server log -----\n{}", self.log());
        }
    }
}
