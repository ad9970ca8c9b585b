//! The NATS server `jetrl run` starts when it is given no `--nats-url`: bound to 127.0.0.1, and secure as a
//! deployment's: one user per service with the least-privilege permissions of deploy/nats/gen.sh (run from the
//! copy built into jetrl, so the rules live in one place), fresh passwords for every run. No TLS (`gen.sh
//! --no-tls`): every client is on this host, over loopback. Each service is told its identity as `nats.user=`,
//! `nats.password_file=` and `nats.inbox_prefix=` overrides; no password is on a command line, in job.yaml or in
//! a log.

use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Context;
use jetrl_bus::NatsServer;
use jetrl_config::NatsConfig;

/// deploy/nats/gen.sh, written to `<run.dir>/nats/gen.sh` and run with bash.
const GEN_SH: &str = include_str!("../../../deploy/nats/gen.sh");

/// The identities gen.sh generated for one run: `<run.dir>/nats/clients/<user>/{password,nats.yaml}` (users
/// `trainer`, `rollout-worker`, `reward-service`, `replay-buffer`, `checkpoint-sync`, `status`, `admin`) and the
/// server's side, `server/auth.conf`.
pub struct Identities {
    /// `<run.dir>/nats`
    dir: PathBuf,
}

/// Generates the job's identities into `<run_dir>/nats` and starts nats-server on a free loopback port with
/// them (and a temporary JetStream store).
pub fn start(run_dir: &Path, namespace: &str) -> anyhow::Result<(NatsServer, Identities)> {
    let port = jetrl_bus::harness::free_port()?;
    let identities = Identities::generate(&run_dir.join("nats"), namespace, port)?;
    let server = NatsServer::start_with_auth(port, &identities.dir.join("server/auth.conf"))?;
    Ok((server, identities))
}

impl Identities {
    fn generate(dir: &Path, namespace: &str, port: u16) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .with_context(|| format!("making {} private", dir.display()))?;
        let script = dir.join("gen.sh");
        let _ = std::fs::remove_file(&script);
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o700)
            .open(&script)
            .and_then(|mut file| std::io::Write::write_all(&mut file, GEN_SH.as_bytes()))
            .with_context(|| format!("writing {}", script.display()))?;
        let out = Command::new("bash")
            .arg(&script)
            .arg("--out")
            .arg(dir)
            .args(["--namespace", namespace, "--no-tls", "--hosts", "127.0.0.1", "--monitor", "off"])
            .args(["--listen", &format!("127.0.0.1:{port}")])
            // new passwords for every run: a run directory used again does not reuse the last run's
            .args(["--rotate", "passwords"])
            .output()
            .with_context(|| format!("running {} with bash", script.display()))?;
        anyhow::ensure!(
            out.status.success(),
            "{} failed ({}):\n{}{}",
            script.display(),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        // gen.sh's nats.conf is for a server installed on its own; the embedded server's configuration is
        // jetrl_bus::harness's, with the users of auth.conf
        let _ = std::fs::remove_file(dir.join("server/nats.conf"));
        Ok(Self { dir: dir.to_path_buf() })
    }

    /// `user`'s `nats.yaml`: a job-file `nats:` section with its URL, user, password file and reply prefix.
    fn identity_file(&self, user: &str) -> PathBuf {
        self.dir.join("clients").join(user).join("nats.yaml")
    }

    /// `user`'s identity as `nats.key=value` overrides (the password stays in its file).
    pub fn overrides(&self, user: &str) -> anyhow::Result<Vec<String>> {
        Ok(jetrl_config::section_overrides(&self.identity_file(user), "nats")?)
    }

    /// Writes `<run.dir>/nats/status.yaml`: the read-only `status` identity's `nats:` section with the job's
    /// namespace, for `jetrl status --config <it>`. Returns its path.
    pub fn write_status_file(&self, namespace: &str) -> anyhow::Result<PathBuf> {
        let from = self.identity_file("status");
        let text = std::fs::read_to_string(&from).with_context(|| format!("reading {}", from.display()))?;
        let mut doc: serde_yaml::Value = serde_yaml::from_str(&text)?;
        let nats = doc
            .get_mut("nats")
            .and_then(serde_yaml::Value::as_mapping_mut)
            .with_context(|| format!("{} has no nats: section", from.display()))?;
        nats.insert("namespace".into(), namespace.into());
        let path = self.dir.join("status.yaml");
        let text = format!(
            "# the job's read-only NATS identity, while `jetrl run` runs its server: jetrl status --config {}\n{}",
            path.display(),
            serde_yaml::to_string(&doc)?
        );
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        Ok(path)
    }
}

/// The job's `nats` section for the embedded server: its URL and the job's namespace, replicas and timeouts.
/// Credentials and TLS settings the job file names are for another server; each service gets its own identity
/// on its command line instead.
pub fn job_settings(job: &NatsConfig, url: &str) -> NatsConfig {
    NatsConfig {
        url: url.to_string(),
        namespace: job.namespace.clone(),
        replicas: job.replicas,
        connect_timeout_s: job.connect_timeout_s,
        request_timeout_s: job.request_timeout_s,
        ..NatsConfig::default()
    }
}
