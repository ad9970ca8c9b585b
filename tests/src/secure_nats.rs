//! A nats-server running the least-privilege configuration deploy/nats/gen.sh generates (TLS with client
//! certificates, one user per service, the generated permissions), on a free loopback port with a temporary
//! store, killed on drop; and a three-node cluster of them ([`SecureCluster`], gen.sh --cluster).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use jetrl_config::NatsConfig;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Starts `nats-server -c conf`, logging to `log`.
fn spawn_server(conf: &Path, log: &Path) -> Child {
    Command::new(jetrl_bus::harness::find_binary().expect("nats-server"))
        .arg("-c")
        .arg(conf)
        .arg("-l")
        .arg(log)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("starting nats-server")
}

/// Waits (20 s at most) until `log` holds `needle` `times` times.
fn wait_for_log_n(log: &Path, needle: &str, times: usize) {
    let started = Instant::now();
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if text.matches(needle).count() >= times {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "nats-server: no {needle:?} in {}:\n{text}",
            log.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn wait_for_log(log: &Path, needle: &str) {
    wait_for_log_n(log, needle, 1)
}

/// `user`'s NATS settings from the `nats.yaml` gen.sh wrote, loaded through the job configuration as a service
/// loads them.
fn identity_from(file: &Path) -> NatsConfig {
    let job: jetrl_config::JobConfig = jetrl_config::load(Some(file), &[]).expect("generated nats.yaml loads");
    NatsConfig { connect_timeout_s: 20.0, ..job.nats }
}

/// A `nats.yaml`'s settings as command-line overrides (`nats.user=...`), as `jetrl run` hands them to a service.
fn overrides_from(file: &Path) -> Vec<String> {
    jetrl_config::section_overrides(file, "nats").expect("a nats.yaml with a nats section")
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
        let port = jetrl_bus::harness::free_port().expect("a free port");
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
        let child = spawn_server(&server_dir.join("nats.conf"), &dir.path().join("nats.log"));
        let server = Self { dir, port, child };
        wait_for_log(&server.dir.path().join("nats.log"), "Server is ready");
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
        identity_from(&self.identity_file(user))
    }

    /// `user`'s NATS settings as command-line overrides (`nats.user=...`).
    pub fn overrides(&self, user: &str) -> Vec<String> {
        overrides_from(&self.identity_file(user))
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

/// One node of a [`SecureCluster`].
struct Node {
    name: String,
    conf: PathBuf,
    log: PathBuf,
    child: Option<Child>,
}

/// Three nats-server processes on loopback as one JetStream cluster, with the configuration deploy/nats/gen.sh
/// --cluster generates (routes over TLS, client TLS, the least-privilege users), free ports and temporary
/// stores; killed on drop. The nodes are `localhost-<port>` (route certificates are checked by DNS name).
pub struct SecureCluster {
    dir: tempfile::TempDir,
    nodes: Vec<Node>,
}

impl SecureCluster {
    pub fn start() -> Self {
        let dir = crate::test_dir("cluster");
        let out = dir.path().join("generated");
        let server_dir = out.join("server");
        // six distinct ports, chosen together
        let chosen = jetrl_bus::harness::free_ports(6).expect("free ports");
        let ports: Vec<(u16, u16)> = chosen.chunks(2).map(|pair| (pair[0], pair[1])).collect();
        let spec: Vec<String> = ports.iter().map(|(client, route)| format!("localhost:{client}:{route}")).collect();
        gen(&[
            "--out",
            &out.display().to_string(),
            "--install-dir",
            &server_dir.display().to_string(),
            "--store-dir",
            &dir.path().join("jetstream").display().to_string(),
            "--listen",
            "127.0.0.1:4222",
            "--monitor",
            "off",
            "--cluster",
            &spec.join(","),
        ]);
        let nodes = ports
            .iter()
            .map(|(client, _)| {
                let name = format!("localhost-{client}");
                Node {
                    conf: server_dir.join(format!("cluster-{name}.conf")),
                    log: dir.path().join(format!("{name}.log")),
                    name,
                    child: None,
                }
            })
            .collect();
        let mut cluster = Self { dir, nodes };
        for i in 0..cluster.nodes.len() {
            let node = &mut cluster.nodes[i];
            node.child = Some(spawn_server(&node.conf, &node.log));
        }
        for node in &cluster.nodes {
            wait_for_log(&node.log, "Server is ready");
        }
        cluster
    }

    /// The nodes' server names.
    pub fn nodes(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.name.clone()).collect()
    }

    fn node(&mut self, name: &str) -> &mut Node {
        self.nodes.iter_mut().find(|n| n.name == name).unwrap_or_else(|| panic!("no node {name}"))
    }

    /// SIGKILL: the node dies without a word to the others.
    pub fn kill(&mut self, name: &str) {
        if let Some(mut child) = self.node(name).child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts a killed node again, with its configuration and its store.
    pub fn restart(&mut self, name: &str) {
        let node = self.node(name);
        assert!(node.child.is_none(), "{name} is running");
        let ready_before = std::fs::read_to_string(&node.log).unwrap_or_default().matches("Server is ready").count();
        node.child = Some(spawn_server(&node.conf, &node.log));
        wait_for_log_n(&node.log, "Server is ready", ready_before + 1);
    }

    pub fn log(&self, name: &str) -> String {
        self.nodes
            .iter()
            .find(|n| n.name == name)
            .map(|n| std::fs::read_to_string(&n.log).unwrap_or_default())
            .unwrap_or_default()
    }

    /// Every node's log lines about refused publishes and subscriptions.
    pub fn violations(&self) -> Vec<String> {
        self.nodes()
            .iter()
            .flat_map(|n| {
                self.log(n).lines().filter(|l| l.contains(" Violation")).map(str::to_string).collect::<Vec<_>>()
            })
            .collect()
    }

    /// A scratch directory that lives as long as the cluster.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The `nats.yaml` gen.sh wrote for `user` (its URL lists every node; replicas 3).
    pub fn identity_file(&self, user: &str) -> PathBuf {
        self.dir.path().join("generated/clients").join(user).join("nats.yaml")
    }

    pub fn identity(&self, user: &str) -> NatsConfig {
        identity_from(&self.identity_file(user))
    }

    pub fn overrides(&self, user: &str) -> Vec<String> {
        overrides_from(&self.identity_file(user))
    }

    pub async fn connect(&self, user: &str) -> jetrl_bus::Bus {
        let names = jetrl_wire::subjects::Names::new("jetrl").expect("the default namespace");
        jetrl_bus::Bus::connect(&self.identity(user), &names, &format!("test-{user}"))
            .await
            .unwrap_or_else(|e| panic!("{user}: {e}"))
    }
}

impl Drop for SecureCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            if let Some(mut child) = node.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        if std::thread::panicking() {
            for node in &self.nodes {
                let log = std::fs::read_to_string(&node.log).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(60).collect();
                eprintln!("----- {} log (last 60 lines) -----", node.name);
                for line in tail.iter().rev() {
                    eprintln!("{line}");
                }
            }
        }
    }
}

/// A service process killed (and waited for) on drop.
pub struct Service(pub Child);

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts every service of a job but the trainer, each under its own identity, with `spawn(identity, binary)`.
pub fn all_but_the_trainer(spawn: &impl Fn(&str, &str) -> Service) -> Vec<Service> {
    [
        ("checkpoint-sync", "jetrl-checkpoint-sync"),
        ("replay-buffer", "jetrl-replay-buffer"),
        ("reward-service", "jetrl-reward-service"),
        ("rollout-worker", "jetrl-rollout-worker"),
    ]
    .iter()
    .map(|(user, binary)| spawn(user, binary))
    .collect()
}

/// Starts `binary` with `deploy/job.yaml`, the job's `key=value` arguments and `identity` (its NATS overrides),
/// logging to `<log_dir>/<user>.log`.
pub fn spawn_service(log_dir: &Path, user: &str, binary: &str, job: &[String], identity: &[String]) -> Service {
    let file = std::fs::File::create(log_dir.join(format!("{user}.log"))).expect("log");
    let child = Command::new(crate::bin(binary))
        .arg("--config")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/job.yaml"))
        .args(job)
        .args(identity)
        .env("RUST_LOG", crate::service_log_filter())
        .stdin(Stdio::null())
        .stdout(file.try_clone().expect("log"))
        .stderr(file)
        .spawn()
        .expect("spawn");
    Service(child)
}
