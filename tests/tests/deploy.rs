//! The deploy files (docker compose, systemd, NATS, Prometheus): no Docker engine runs on the CI machines,
//! so these tests parse the files and run the same commands they run, against a real nats-server with the
//! least-privilege configuration deploy/nats/gen.sh generates. systemd units are checked with
//! `systemd-analyze verify` where it is installed.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use jetrl_tests::bin;
use jetrl_tests::secure_nats::{gen, SecureNats};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn yaml(path: &str) -> serde_yaml::Value {
    let text = std::fs::read_to_string(repo().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"));
    let mut doc: serde_yaml::Value = serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{path} is not YAML: {e}"));
    doc.apply_merge().expect("merge keys");
    doc
}

/// Later wins; mappings merge key by key (compose's rule for `environment`, `deploy`, ...), anything else is
/// replaced.
fn merge(base: &mut serde_yaml::Value, over: &serde_yaml::Value) {
    match (base.as_mapping_mut(), over.as_mapping()) {
        (Some(b), Some(o)) => {
            for (k, v) in o {
                match b.get_mut(k) {
                    Some(existing) => merge(existing, v),
                    None => {
                        b.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        _ => *base = over.clone(),
    }
}

fn compose(overlays: &[&str]) -> serde_yaml::Value {
    let mut doc = yaml("deploy/docker-compose.yml");
    for overlay in overlays {
        merge(&mut doc, &yaml(overlay));
    }
    doc
}

/// `${VAR:-default}` → default (the value with no variable set), as compose interpolates.
fn interpolate(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let end = rest[start..].find('}').map(|e| start + e).expect("closing brace");
        let inner = &rest[start + 2..end];
        out.push_str(inner.split_once(":-").map(|(_, d)| d).unwrap_or_default());
        rest = &rest[end + 1..];
    }
    out + rest
}

/// A compose service built from the jetrl image.
struct ComposeService {
    argv: Vec<String>,
    /// `environment` then each `env_file`'s variables (relative to deploy/, `./nats/generated` → `generated`)
    env: BTreeMap<String, String>,
    /// secret target (`/run/secrets/<target>`) → host file
    secrets: BTreeMap<String, PathBuf>,
}

/// Host path of a compose-relative source: `./nats/generated/...` lives in `generated`, anything else in deploy/.
fn host_path(source: &str, generated: &Path) -> PathBuf {
    match source.strip_prefix("./nats/generated/") {
        Some(rest) => generated.join(rest),
        None => repo().join("deploy").join(source),
    }
}

impl ComposeService {
    /// A one-shot shell step (model-init) rather than a service binary.
    fn is_shell(&self) -> bool {
        self.argv[0] == "sh"
    }
}

/// Every service of the jetrl image (the image the Dockerfile builds), by name.
fn jetrl_services(doc: &serde_yaml::Value, generated: &Path) -> BTreeMap<String, ComposeService> {
    let secret_files: BTreeMap<String, PathBuf> = doc["secrets"]
        .as_mapping()
        .expect("top-level secrets")
        .iter()
        .map(|(k, v)| (k.as_str().expect("name").to_string(), host_path(v["file"].as_str().expect("file"), generated)))
        .collect();
    let mut out = BTreeMap::new();
    for (name, svc) in doc["services"].as_mapping().expect("services") {
        if svc["image"].as_str() != Some("jetrl:latest") {
            continue;
        }
        let argv: Vec<String> =
            svc["command"].as_sequence().expect("command").iter().map(|v| v.as_str().expect("arg").into()).collect();
        let mut env = BTreeMap::new();
        for (k, v) in svc["environment"].as_mapping().into_iter().flatten() {
            env.insert(k.as_str().expect("key").to_string(), v.as_str().expect("string value").to_string());
        }
        for file in svc["env_file"].as_sequence().into_iter().flatten() {
            let path = host_path(file.as_str().expect("env_file"), generated);
            let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{name:?}: {}: {e}", path.display()));
            for line in text.lines().filter(|l| !l.trim().is_empty() && !l.starts_with('#')) {
                let (k, v) = line.split_once('=').expect("KEY=value");
                env.insert(k.to_string(), v.to_string());
            }
        }
        let mut secrets = BTreeMap::new();
        for s in svc["secrets"].as_sequence().into_iter().flatten() {
            let source = s["source"].as_str().expect("secret source");
            let file = secret_files.get(source).unwrap_or_else(|| panic!("{name:?}: undeclared secret {source}"));
            secrets.insert(s["target"].as_str().expect("secret target").to_string(), file.clone());
        }
        out.insert(name.as_str().expect("name").to_string(), ComposeService { argv, env, secrets });
    }
    out
}

/// `JETRL__SECTION__KEY=value` → `section.key=value`, then the command's own overrides (which win).
fn overrides(svc: &ComposeService) -> Vec<String> {
    let from_env = svc.env.iter().filter_map(|(k, v)| {
        let path = k.strip_prefix("JETRL__")?.split("__").map(str::to_lowercase).collect::<Vec<_>>().join(".");
        Some(format!("{path}={v}"))
    });
    from_env.chain(svc.argv.iter().skip(1).filter(|a| a.contains('=')).cloned()).collect()
}

fn job_file() -> PathBuf {
    repo().join("deploy/job.yaml")
}

/// A generated deployment (defaults: namespace jetrl, hosts 127.0.0.1, localhost, nats) in a temp dir.
fn generated() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    gen(&["--out", &dir.path().display().to_string()]);
    dir
}

const SERVICES: [&str; 5] = ["trainer", "rollout-worker", "reward-service", "replay-buffer", "checkpoint-sync"];

#[test]
fn compose_runs_every_service_with_its_own_identity_and_a_config_that_loads() {
    let gen_dir = generated();
    let doc = compose(&[]);
    let services = jetrl_services(&doc, gen_dir.path());
    for expected in SERVICES {
        let svc = services.get(expected).unwrap_or_else(|| panic!("compose lacks {expected}"));
        let argv = &svc.argv;
        assert_eq!(argv[0], format!("jetrl-{expected}"), "{expected}");
        let cfg = jetrl_config::JobConfig::load(Some(&job_file()), &overrides(svc))
            .unwrap_or_else(|e| panic!("{expected}: deploy/job.yaml with {argv:?} does not load: {e}"));
        let nats = &cfg.nats;
        assert_eq!(nats.url, "tls://nats:4222", "{expected} must reach the compose NATS service over TLS");
        assert_eq!(nats.user.as_deref(), Some(format!("jetrl-{expected}").as_str()), "{expected}: its own user");
        assert_eq!(nats.inbox_prefix.as_deref(), Some(format!("_INBOX_jetrl-{expected}").as_str()));
        // every credential file is a secret of this service, mounted from this service's generated files
        for (key, file) in [
            ("password", &nats.password_file),
            ("ca", &nats.tls_ca_file),
            ("cert", &nats.tls_cert_file),
            ("key", &nats.tls_key_file),
        ] {
            let path = file.as_deref().unwrap_or_else(|| panic!("{expected}: no {key} file"));
            let target = path.strip_prefix("/run/secrets/").unwrap_or_else(|| panic!("{expected}: {path}"));
            let source = svc.secrets.get(target).unwrap_or_else(|| panic!("{expected}: no secret mounted at {path}"));
            assert!(source.is_file(), "{expected}: {} was not generated", source.display());
            if key != "ca" {
                assert!(
                    source.starts_with(gen_dir.path().join("clients").join(expected)),
                    "{expected}: {key} is {source:?}"
                );
            }
        }
    }
    for (name, svc) in doc["services"].as_mapping().expect("services") {
        let name = name.as_str().expect("name");
        for v in svc["volumes"].as_sequence().into_iter().flatten().filter_map(|v| v.as_str()) {
            if let Some(src) = v.split(':').next().filter(|s| s.starts_with("./")) {
                assert!(host_path(src, gen_dir.path()).exists(), "{name}: volume source {src} is missing");
            }
        }
    }
    // the NATS container reads the generated server configuration
    let nats_volumes: Vec<&str> = doc["services"]["nats"]["volumes"]
        .as_sequence()
        .expect("nats volumes")
        .iter()
        .filter_map(|v| v.as_str())
        .collect();
    assert!(nats_volumes.contains(&"./nats/generated/server:/etc/nats:ro"), "{nats_volumes:?}");
}

#[test]
fn compose_publishes_ports_on_loopback_unless_asked() {
    let doc = compose(&[]);
    let mut published = 0;
    for (name, svc) in doc["services"].as_mapping().expect("services") {
        for port in svc["ports"].as_sequence().into_iter().flatten() {
            let spec = port.as_str().expect("port spec");
            published += 1;
            assert!(interpolate(spec).starts_with("127.0.0.1:"), "{name:?} publishes {spec} beyond the host");
            assert!(!spec.ends_with(":8222"), "{name:?}: the monitoring port is not published");
        }
    }
    assert!(published >= 3, "nats, prometheus and grafana publish their ports");
    let nats_ports = doc["services"]["nats"]["ports"][0].as_str().expect("nats port");
    assert!(nats_ports.starts_with("${JETRL_NATS_BIND:-127.0.0.1}:"), "the documented override: {nats_ports}");
}

/// `model.device` as the job file spells it.
fn device(cfg: &jetrl_config::JobConfig) -> String {
    let model = serde_json::to_value(&cfg.model).expect("model section");
    model["device"].as_str().expect("a device").to_string()
}

#[test]
fn gpu_overlay_puts_the_trainer_and_the_worker_on_their_own_gpus() {
    let gen_dir = generated();
    let doc = compose(&["deploy/docker-compose.gpu.yml"]);
    let services = jetrl_services(&doc, gen_dir.path());
    let mut gpus = HashSet::new();
    for name in ["trainer", "rollout-worker"] {
        let devices = &doc["services"][name]["deploy"]["resources"]["reservations"]["devices"][0];
        let ids = devices["device_ids"].as_sequence().unwrap_or_else(|| panic!("{name}: device_ids"));
        assert_eq!(ids.len(), 1, "{name}: one GPU");
        assert!(gpus.insert(interpolate(ids[0].as_str().expect("id"))), "{name} shares a GPU");
        let cfg = jetrl_config::JobConfig::load(Some(&job_file()), &overrides(&services[name])).expect("loads");
        assert_eq!(device(&cfg), "cuda:0", "{name}: the container's one GPU");
    }
    for name in ["replay-buffer", "reward-service", "checkpoint-sync"] {
        let cfg = jetrl_config::JobConfig::load(Some(&job_file()), &overrides(&services[name])).expect("loads");
        assert_eq!(device(&cfg), "cpu", "{name} needs no GPU");
    }
}

/// deploy/compose-gpus.sh: one service per rollout GPU (each seeing only its GPUs), one container per trainer rank
/// (each seeing the trainer's GPUs, rank r set), every one a complete jetrl service with its own identity, and the
/// ranks' rendezvous in every service's job.
#[test]
fn compose_gpus_gives_every_worker_and_rank_its_own_gpus() {
    let gen_dir = generated();
    let out = Command::new("bash")
        .arg(repo().join("deploy/compose-gpus.sh"))
        .args(["--trainer", "0,1", "--rollout", "2,3,4-5"])
        .output()
        .expect("bash");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let file = gen_dir.path().join("gpus.yml");
    std::fs::write(&file, &out.stdout).unwrap();
    let doc = compose(&["deploy/docker-compose.gpu.yml", &file.display().to_string()]);
    let services = jetrl_services(&doc, gen_dir.path());
    let gpus = |name: &str| -> Vec<String> {
        let devices = &doc["services"][name]["deploy"]["resources"]["reservations"]["devices"][0];
        devices["device_ids"].as_sequence().unwrap().iter().map(|v| v.as_str().unwrap().to_string()).collect()
    };
    let mut seen = Vec::new();
    for (name, expected) in
        [("rollout-worker", vec!["2"]), ("rollout-worker-g3", vec!["3"]), ("rollout-worker-g4", vec!["4", "5"])]
    {
        assert_eq!(gpus(name), expected, "{name}");
        seen.extend(expected.clone());
        let cfg = jetrl_config::JobConfig::load(Some(&job_file()), &overrides(&services[name])).expect("loads");
        assert_eq!(cfg.nats.user.as_deref(), Some("jetrl-rollout-worker"), "{name}");
        assert_eq!(device(&cfg), "cuda:0", "{name}: its first GPU");
        // a worker over two GPUs runs vLLM with tensor parallelism across them
        assert_eq!(cfg.rollout.tensor_model_parallel_size as usize, expected.len(), "{name}");
    }
    assert_eq!(seen.len(), 4);
    for (rank, name) in ["trainer", "trainer-r1"].iter().enumerate() {
        assert_eq!(gpus(name), ["0", "1"], "{name} sees the trainer's GPUs");
        let cfg = jetrl_config::JobConfig::load(Some(&job_file()), &overrides(&services[*name])).expect("loads");
        assert_eq!(cfg.nats.user.as_deref(), Some("jetrl-trainer"), "{name}");
        assert_eq!(cfg.trainer.dist.rank as usize, rank, "{name}");
        assert_eq!((cfg.trainer.n_gpus_per_node, cfg.trainer.dist.master_addr.as_str()), (2, "trainer"), "{name}");
    }
    // every generated service (and the GPU overlay's vLLM worker) carries the base service's identity files,
    // volumes and dependencies
    for name in ["rollout-worker-g3", "trainer-r1", "rollout-worker-vllm"] {
        let base = if name.starts_with("trainer") { "trainer" } else { "rollout-worker" };
        for key in ["volumes", "env_file", "secrets", "depends_on", "restart"] {
            assert_eq!(doc["services"][name][key], doc["services"][base][key], "{name}: {key}");
        }
    }
    let twice = Command::new("bash")
        .arg(repo().join("deploy/compose-gpus.sh"))
        .args(["--trainer", "0", "--rollout", "0,1"])
        .output()
        .expect("bash");
    assert!(!twice.status.success() && String::from_utf8_lossy(&twice.stderr).contains("GPU 0 is given twice"));
}

#[test]
fn prometheus_scrapes_the_ports_the_services_serve_metrics_on() {
    let gen_dir = generated();
    let doc = compose(&[]);
    let mut served: HashSet<String> = jetrl_services(&doc, gen_dir.path())
        .values()
        .flat_map(overrides)
        .filter(|o| o.contains("metrics_addr="))
        .filter_map(|o| o.rsplit(':').next().map(str::to_string))
        .collect();
    // NATS: the exporter shares the nats container's network, so Prometheus reaches it as nats:<port>
    let exporter = &doc["services"]["nats-exporter"];
    assert_eq!(exporter["network_mode"].as_str(), Some("service:nats"));
    let args: Vec<&str> =
        exporter["command"].as_sequence().expect("command").iter().filter_map(|a| a.as_str()).collect();
    let port = args.iter().position(|a| *a == "-port").map(|i| args[i + 1]).expect("-port");
    assert!(args.contains(&"-jsz=all"), "JetStream metrics: {args:?}");
    served.insert(port.to_string());
    let doc: serde_yaml::Value = yaml("deploy/prometheus/prometheus.yml");
    let mut scraped = HashSet::new();
    for job in doc["scrape_configs"].as_sequence().expect("scrape_configs") {
        for sc in job["static_configs"].as_sequence().into_iter().flatten() {
            for t in sc["targets"].as_sequence().expect("targets") {
                let target = t.as_str().expect("target");
                if job["job_name"].as_str() == Some("nats") {
                    assert_eq!(target, format!("nats:{port}"));
                }
                scraped.insert(target.rsplit(':').next().expect("port").to_string());
            }
        }
        for sd in job["dns_sd_configs"].as_sequence().into_iter().flatten() {
            scraped.insert(sd["port"].as_u64().expect("port").to_string());
        }
    }
    assert_eq!(served, scraped, "metrics ports served vs scraped");
    let dash: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(repo().join("deploy/grafana/dashboards/jetrl.json")).unwrap())
            .unwrap();
    assert!(dash["panels"].as_array().is_some_and(|p| !p.is_empty()));
}

#[test]
fn generated_nats_config_is_valid_for_nats_server() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().display().to_string();
    gen(&["--out", &out, "--install-dir", &format!("{out}/server"), "--store-dir", &format!("{out}/js")]);
    let conf = dir.path().join("server/nats.conf");
    let nats = jetrl_bus::harness::find_binary().expect("nats-server");
    let check = Command::new(nats).arg("-c").arg(&conf).arg("-t").output().expect("nats-server -t");
    let text = String::from_utf8_lossy(&check.stderr).to_string() + &String::from_utf8_lossy(&check.stdout);
    assert!(check.status.success(), "{text}");
    let text = std::fs::read_to_string(&conf).expect("nats.conf");
    for needed in ["max_payload: 8MB", "jetstream {", "verify: true", "http: 127.0.0.1:8222", "include ./auth.conf"] {
        assert!(text.contains(needed), "nats.conf lacks {needed:?}:\n{text}");
    }
    assert!(!repo().join("deploy/nats/nats.conf").exists(), "no configuration without users ships");
}

/// `gen.sh --no-tls` (what `jetrl run` uses for its own server): users, passwords and permissions without a CA,
/// certificates or openssl, a valid configuration without TLS, `nats://` URLs; only on a loopback address.
#[test]
fn gen_sh_without_tls_needs_no_openssl_and_listens_on_loopback_only() {
    let dir = tempfile::tempdir().expect("tempdir");
    // a PATH with the coreutils gen.sh uses and no openssl
    let tools = dir.path().join("bin");
    std::fs::create_dir(&tools).unwrap();
    for tool in ["bash", "dirname", "mkdir", "cat", "sort", "head", "tr", "chmod", "rm", "cp"] {
        let found = ["/usr/bin", "/bin"].iter().map(|d| Path::new(d).join(tool)).find(|p| p.exists());
        std::os::unix::fs::symlink(found.unwrap_or_else(|| panic!("no {tool}")), tools.join(tool)).unwrap();
    }
    let out = dir.path().join("generated");
    let run = |listen: &str| {
        Command::new("bash")
            .arg(repo().join("deploy/nats/gen.sh"))
            .args(["--out", &out.display().to_string(), "--namespace", "job-7", "--no-tls", "--monitor", "off"])
            .args(["--listen", listen, "--store-dir", &dir.path().join("js").display().to_string()])
            .env("PATH", &tools)
            .output()
            .expect("bash")
    };
    let done = run("127.0.0.1:4999");
    assert!(done.status.success(), "{}", String::from_utf8_lossy(&done.stderr));
    let conf = out.join("server/nats.conf");
    let text = std::fs::read_to_string(&conf).unwrap();
    assert!(!text.contains("tls {") && text.contains("listen: 127.0.0.1:4999"), "{text}");
    let nats = jetrl_bus::harness::find_binary().expect("nats-server");
    let check = Command::new(nats).arg("-c").arg(&conf).arg("-t").output().expect("nats-server -t");
    assert!(check.status.success(), "{}", String::from_utf8_lossy(&check.stderr));
    let identity = std::fs::read_to_string(out.join("clients/trainer/nats.yaml")).unwrap();
    assert!(identity.contains("url: nats://127.0.0.1:4999") && !identity.contains("tls_"), "{identity}");
    let password = std::fs::read_to_string(out.join("clients/trainer/password")).unwrap();
    assert!(password.len() == 32 && password.bytes().all(|b| b.is_ascii_alphanumeric()), "{password:?}");
    assert!(!out.join("ca").exists() && !out.join("server/tls").exists() && !out.join("clients/ca.pem").exists());

    let refused = run("0.0.0.0:4222");
    let why = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && why.contains("not a loopback address"), "{why}");
}

/// deploy/nats/cluster/ is what `gen.sh --cluster nats-1,nats-2,nats-3` writes; every node's configuration is
/// valid for nats-server, the identities list every node with replicas 3, and a node refuses a route from a
/// client's certificate.
#[test]
fn the_shipped_cluster_configuration_is_what_gen_sh_writes_and_a_route_needs_a_node_certificate() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("shipped");
    gen(&[
        "--out",
        &out.display().to_string(),
        "--cluster",
        "nats-1,nats-2,nats-3",
        "--store-dir",
        "/var/lib/nats/jetstream",
    ]);
    for n in 1..=3 {
        let generated = std::fs::read_to_string(out.join(format!("server/cluster-nats-{n}.conf"))).expect("generated");
        let shipped =
            std::fs::read_to_string(repo().join(format!("deploy/nats/cluster/nats-{n}.conf"))).expect("shipped");
        assert_eq!(
            generated, shipped,
            "deploy/nats/cluster/nats-{n}.conf differs from what gen.sh writes: regenerate it"
        );
        for needed in [
            &format!("server_name: \"nats-{n}\""),
            "\"tls://nats-1:6222\"",
            "\"tls://nats-3:6222\"",
            "verify_cert_and_check_known_urls: true",
            "name: \"jetrl-jetrl\"",
            &format!("store_dir: \"/var/lib/nats/jetstream/nats-{n}\""),
            "include ./auth.conf",
        ] {
            assert!(shipped.contains(needed), "nats-{n}.conf lacks {needed:?}");
        }
    }
    let identity = jetrl_config::JobConfig::load(Some(&job_file()), &[]).expect("job");
    let nats: jetrl_config::JobConfig =
        jetrl_config::load(Some(&out.join("clients/rollout-worker/nats.yaml")), &[]).expect("nats.yaml loads");
    assert_eq!(nats.nats.url, "tls://nats-1:4222,tls://nats-2:4222,tls://nats-3:4222");
    assert_eq!((nats.nats.replicas, identity.nats.replicas), (3, 1));

    // valid for nats-server, with the files where the configuration says
    let ports: Vec<u16> =
        (0..6).map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()).collect();
    let local = dir.path().join("local");
    let spec = format!(
        "localhost:{}:{},localhost:{}:{},localhost:{}:{}",
        ports[0], ports[1], ports[2], ports[3], ports[4], ports[5]
    );
    gen(&[
        "--out",
        &local.display().to_string(),
        "--install-dir",
        &local.join("server").display().to_string(),
        "--store-dir",
        &dir.path().join("js").display().to_string(),
        "--listen",
        "127.0.0.1:4222",
        "--monitor",
        "off",
        "--cluster",
        &spec,
    ]);
    let nats_server = jetrl_bus::harness::find_binary().expect("nats-server");
    let conf = |port: u16| local.join(format!("server/cluster-localhost-{port}.conf"));
    for port in [ports[0], ports[2], ports[4]] {
        let check = Command::new(&nats_server).arg("-c").arg(conf(port)).arg("-t").output().expect("nats-server -t");
        assert!(check.status.success(), "{}", String::from_utf8_lossy(&check.stderr));
    }
    // one node up; a client's certificate on its route port is refused
    let log = dir.path().join("node.log");
    let mut node = Command::new(&nats_server).arg("-c").arg(conf(ports[0])).arg("-l").arg(&log).spawn().expect("node");
    let started = std::time::Instant::now();
    while !std::fs::read_to_string(&log).unwrap_or_default().contains("Listening for route connections") {
        assert!(started.elapsed() < Duration::from_secs(20), "the node did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let client = local.join("clients/rollout-worker");
    let mut route = Command::new("openssl")
        .args(["s_client", "-quiet", "-connect", &format!("127.0.0.1:{}", ports[1])])
        .arg("-cert")
        .arg(client.join("cert.pem"))
        .arg("-key")
        .arg(client.join("key.pem"))
        .arg("-CAfile")
        .arg(local.join("clients/ca.pem"))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("openssl");
    if let Some(stdin) = route.stdin.as_mut() {
        use std::io::Write;
        let _ = stdin.write_all(b"CONNECT {\"verbose\":false}\r\nPING\r\n");
    }
    let started = std::time::Instant::now();
    let refused = loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.contains("Route connection created") && text.contains("authentication error") {
            break true;
        }
        if started.elapsed() > Duration::from_secs(10) {
            break false;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let _ = route.kill();
    let _ = route.wait();
    let _ = node.kill();
    let _ = node.wait();
    assert!(refused, "a client certificate opened a route:\n{}", std::fs::read_to_string(&log).unwrap_or_default());

    // nodes by IP address cannot pass the route check, and two nodes are no cluster for replicas 3
    for (cluster, expected) in [("10.0.0.1,10.0.0.2,10.0.0.3", "DNS name"), ("nats-1,nats-2", "three nodes")] {
        let out = Command::new("bash")
            .arg(repo().join("deploy/nats/gen.sh"))
            .args(["--out", &dir.path().join("bad").display().to_string(), "--cluster", cluster])
            .output()
            .expect("bash");
        let text = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && text.contains(expected), "--cluster {cluster}: {text}");
    }
}

/// The command a unit runs, as systemd would start it for `instance` on host `host`: specifiers and `$$`
/// replaced, a `/bin/sh -c '...'` wrapper run by a real shell (with the binary replaced by a printer of its
/// arguments). Returns (exit status of the shell, argv).
fn unit_command(unit_text: &str, instance: &str) -> (i32, Vec<String>) {
    let exec = unit_text.lines().find_map(|l| l.strip_prefix("ExecStart=")).expect("ExecStart");
    let exec =
        exec.replace("%i", instance).replace("%H", "host").replace("%d", "/run/credentials/unit").replace("$$", "$");
    let Some(script) = exec.strip_prefix("/bin/sh -c '").and_then(|s| s.strip_suffix('\'')) else {
        return (0, exec.split_whitespace().map(str::to_string).collect());
    };
    let binary = script.split("exec ").nth(1).and_then(|s| s.split_whitespace().next()).expect("exec BINARY");
    let script = script.replace(&format!("exec {binary}"), &format!("exec printf '%s\\n' {binary}"));
    let out = Command::new("/bin/sh").arg("-c").arg(&script).output().expect("sh");
    let argv = String::from_utf8_lossy(&out.stdout).lines().map(str::to_string).collect();
    (out.status.code().unwrap_or(-1), argv)
}

fn units() -> Vec<(String, String)> {
    let dir = repo().join("deploy/systemd");
    let mut units: Vec<(String, String)> = std::fs::read_dir(&dir)
        .expect("deploy/systemd")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "service" || e == "target"))
        .map(|p| {
            let name = p.file_name().expect("name").to_string_lossy().to_string();
            (name, std::fs::read_to_string(&p).expect("unit"))
        })
        .collect();
    units.sort();
    units
}

#[test]
fn systemd_units_start_jetrl_binaries_with_configs_that_load() {
    let mut services = 0;
    for (name, text) in units().iter().filter(|(n, _)| n.starts_with("jetrl-") && n.ends_with(".service")) {
        services += 1;
        for key in [
            "KillSignal=SIGTERM",
            "Restart=on-failure",
            "RestartSec=",
            "NoNewPrivileges=yes",
            "ProtectSystem=strict",
            "PrivateTmp=yes",
            "StateDirectory=jetrl",
            "PartOf=jetrl.target",
            "WantedBy=jetrl.target",
        ] {
            assert!(text.contains(key), "{name} lacks {key}");
        }
        let user = name.trim_start_matches("jetrl-").trim_end_matches(".service").trim_end_matches('@');
        assert!(text.contains(&format!("EnvironmentFile=/etc/jetrl/nats/{user}/nats.env")), "{name}: identity");
        let gpu = name.contains("trainer") || name.contains("rollout-worker");
        assert_eq!(
            text.contains("PrivateDevices=yes"),
            !gpu,
            "{name}: GPU units keep /dev/nvidia*, others hide devices"
        );
        let instances: &[&str] = if name.contains('@') { &["0", "7", "10", "63"] } else { &[""] };
        for instance in instances {
            let (status, argv) = unit_command(text, instance);
            assert_eq!(status, 0, "{name} instance {instance}");
            let binary = Path::new(&argv[0]).file_name().expect("binary").to_string_lossy().to_string();
            assert_eq!(argv[0], format!("/usr/local/bin/{binary}"), "{name}");
            assert!(bin(&binary).exists(), "{name}: {binary}");
            assert_eq!(argv[1..3], ["--config".to_string(), "/etc/jetrl/job.yaml".to_string()], "{name}");
            let mut overrides: Vec<String> = argv.iter().skip(3).cloned().collect();
            if name.starts_with("jetrl-trainer@") {
                // rank 63 is a rank of a job of 8 nodes of 8 GPUs (a batch of at least one group per rank)
                overrides.extend(
                    ["trainer.n_gpus_per_node=8", "trainer.nnodes=8", "data.train_batch_size=64"].map(String::from),
                );
            }
            let cfg =
                jetrl_config::JobConfig::load(Some(&job_file()), &overrides).unwrap_or_else(|e| panic!("{name}: {e}"));
            // every credential the unit passes is one it loads
            for file in
                [&cfg.nats.password_file, &cfg.nats.tls_ca_file, &cfg.nats.tls_cert_file, &cfg.nats.tls_key_file]
            {
                let id = file.as_deref().and_then(|f| f.strip_prefix("/run/credentials/unit/")).expect("a credential");
                assert!(text.contains(&format!("LoadCredential={id}:/etc/jetrl/nats/")), "{name}: {id} is not loaded");
            }
            let port = overrides.iter().find(|o| o.contains("metrics_addr=")).and_then(|o| o.rsplit(':').next());
            let port: u16 =
                port.and_then(|p| p.parse().ok()).unwrap_or_else(|| panic!("{name}: metrics port in {argv:?}"));
            let index: u16 = instance.parse().unwrap_or(0);
            let expected = match name.as_str() {
                "jetrl-rollout-worker@.service" => 9500 + index,
                "jetrl-reward-service@.service" => 9420 + index,
                "jetrl-trainer@.service" if index == 0 => 9401,
                "jetrl-trainer@.service" => 9600 + index,
                "jetrl-replay-buffer.service" => 9404,
                _ => 9405,
            };
            assert_eq!(port, expected, "{name} instance {instance}");
        }
        if name.contains('@') {
            let (status, _) = unit_command(text, "gpu1");
            assert_eq!(status, 2, "{name}: a non-numeric instance is refused");
            assert!(text.contains("RestartPreventExitStatus=2"), "{name}: and not restarted");
        }
    }
    assert_eq!(services, 5);
    let names: Vec<String> = units().into_iter().map(|(n, _)| n).collect();
    assert!(names.contains(&"jetrl.target".to_string()) && names.contains(&"nats-server.service".to_string()));
}

/// `systemd-analyze verify` on the units (binaries pointed at this build): syntax, specifiers, executables.
/// Where systemd-analyze is absent the test says so; with CI=true it fails instead.
#[test]
fn systemd_units_pass_systemd_analyze_verify() {
    if Command::new("systemd-analyze").arg("--version").output().is_err() {
        assert!(std::env::var("CI").as_deref() != Ok("true"), "systemd-analyze is not installed on this CI host");
        eprintln!("SKIPPED systemd_units_pass_systemd_analyze_verify: systemd-analyze is not installed");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let build = bin("jetrl").parent().expect("bin dir").to_path_buf();
    let nats = jetrl_bus::harness::find_binary().expect("nats-server");
    for (name, text) in units() {
        let text = text
            .replace("/usr/local/bin/nats-server", &nats.display().to_string())
            .replace("/usr/local/bin/", &format!("{}/", build.display()));
        std::fs::write(dir.path().join(&name), text).expect("write unit");
    }
    let to_verify = [
        "jetrl.target",
        "jetrl-trainer@0.service",
        "jetrl-trainer@1.service",
        "jetrl-replay-buffer.service",
        "jetrl-checkpoint-sync.service",
        "jetrl-reward-service@0.service",
        "jetrl-rollout-worker@0.service",
        "jetrl-rollout-worker@12.service",
        "nats-server.service",
    ];
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .args(to_verify)
        .current_dir(dir.path())
        .env("SYSTEMD_UNIT_PATH", format!("{}:", dir.path().display()))
        .output()
        .expect("systemd-analyze");
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && text.trim().is_empty(), "systemd-analyze verify:\n{text}");
}

/// Runs the compose services' own command lines and environments against a real nats-server with the generated
/// least-privilege configuration (host names, secrets and volumes replaced by local ones) for a two-step job.
#[test]
fn compose_command_lines_run_a_training_job() {
    let nats = SecureNats::start();
    let doc = compose(&[]);
    let services = jetrl_services(&doc, &nats.generated());
    let dir = tempfile::tempdir().expect("tempdir");
    let model = dir.path().join("model");
    jetrl_model::init_model("tiny-digits", &model, 1).expect("model");
    let local = [
        format!("run.dir={}", dir.path().join("run").display()),
        format!("model.path={}", model.display()),
        "trainer.total_training_steps=2".to_string(),
        "trainer.test_freq=-1".to_string(),
        "data.train_batch_size=4".to_string(),
        "actor.ppo_mini_batch_size=2".to_string(),
        "rollout.n=2".to_string(),
    ];
    let mut children = Vec::new();
    let mut trainer = None;
    for (name, svc) in services.iter().filter(|(_, svc)| !svc.is_shell()) {
        let mut args: Vec<String> =
            svc.argv[1..]
                .iter()
                .map(|a| if a == "/etc/jetrl/job.yaml" { job_file().display().to_string() } else { a.clone() })
                .map(|a| {
                    if a.contains("metrics_addr=") {
                        format!("{}=127.0.0.1:0", a.split('=').next().unwrap())
                    } else {
                        a
                    }
                })
                .collect();
        args.extend(local.iter().cloned());
        let mut command = Command::new(bin(&svc.argv[0]));
        command.args(&args);
        for (key, value) in &svc.env {
            let mut value = value.replace("tls://nats:4222", &nats.url());
            if let Some(target) = value.strip_prefix("/run/secrets/") {
                value = svc.secrets[target].display().to_string();
            }
            command.env(key, value);
        }
        let log = std::fs::File::create(dir.path().join(format!("{name}.log"))).expect("log");
        let child = command.stdout(log.try_clone().expect("log")).stderr(log).spawn().expect("spawn");
        if name == "trainer" {
            trainer = Some(child);
        } else {
            children.push(child);
        }
    }
    let mut trainer = trainer.expect("a trainer service");
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(s) = trainer.try_wait().expect("try_wait") {
            break s;
        }
        assert!(started.elapsed() < Duration::from_secs(180), "trainer did not finish");
        std::thread::sleep(Duration::from_millis(100));
    };
    for mut c in children {
        let _ = c.kill();
        let _ = c.wait();
    }
    let log = std::fs::read_to_string(dir.path().join("trainer.log")).unwrap_or_default();
    assert!(status.success(), "trainer failed:\n{log}");
    let metrics = std::fs::read_to_string(dir.path().join("run/metrics.jsonl")).expect("metrics.jsonl");
    assert_eq!(metrics.lines().count(), 2);
    assert!(nats.violations().is_empty(), "refused: {:?}", nats.violations());
}

#[test]
fn dockerfile_builds_the_release_profile_and_ships_every_binary_compose_runs() {
    let text = std::fs::read_to_string(repo().join("deploy/Dockerfile")).expect("Dockerfile");
    assert!(text.contains("scripts/setup.sh") && text.contains("cargo build --release --workspace --bins"));
    assert!(!text.contains("target/debug"), "the image ships the release build");
    assert!(repo().join("scripts/setup.sh").exists());
    // the image a user builds takes the build stage's binaries; `--build-arg JETRL_BINARIES=prebuilt` (compose-check)
    // takes the host's from deploy/prebuilt/, which only that script stages
    assert!(text.contains("ARG JETRL_BINARIES=build") && text.contains("FROM ${JETRL_BINARIES} AS binaries"));
    for line in
        text.lines().filter(|l| l.starts_with("COPY ") && !l.contains("--from") && !l.contains("deploy/prebuilt/"))
    {
        let src = line.split_whitespace().nth(1).expect("COPY source");
        assert!(repo().join(src).exists(), "COPY source {src} missing");
    }
    // what the image copies: `cp target/release/<pattern>...` (a trailing `*` matches any suffix)
    let cp = text.lines().find(|l| l.contains("cp target/release/")).expect("a cp of the release binaries");
    let patterns: Vec<&str> = cp.split_whitespace().filter_map(|w| w.strip_prefix("target/release/")).collect();
    let shipped = |binary: &str| {
        patterns.iter().any(|p| match p.strip_suffix('*') {
            Some(prefix) => binary.starts_with(prefix),
            None => binary == *p,
        })
    };
    let gen_dir = generated();
    let services = jetrl_services(&compose(&[]), gen_dir.path());
    assert!(services.len() >= 5);
    for (name, svc) in &services {
        // a shell step runs the binaries its script names
        let binaries: Vec<&str> = if svc.is_shell() {
            svc.argv[2].split_whitespace().filter(|w| w.starts_with("jetrl")).collect()
        } else {
            vec![svc.argv[0].as_str()]
        };
        assert!(!binaries.is_empty(), "{name}: runs no jetrl binary: {:?}", svc.argv);
        for binary in binaries {
            assert!(shipped(binary), "{name}: the image does not ship {binary} (copies {patterns:?})");
            assert!(bin(binary).exists(), "{name}: {binary} is not a binary of this workspace");
        }
    }
    let cargo = std::fs::read_to_string(repo().join("Cargo.toml")).expect("Cargo.toml");
    assert!(cargo.contains("[profile.release]"), "the release profile the image builds");
}

/// The walkthroughs of docs/deploy.md as written: every `sh` block is valid bash, every repository file it names
/// exists, and no path in jetrl.env or the units names a Python version (the venv's `libtorch` link does).
#[test]
fn deploy_md_commands_parse_and_name_files_that_exist() {
    let doc = std::fs::read_to_string(repo().join("docs/deploy.md")).unwrap();
    let mut blocks = 0;
    for block in doc.split("```sh\n").skip(1).filter_map(|rest| rest.split("```").next()) {
        blocks += 1;
        let out = Command::new("bash").args(["-n", "-c", block]).output().expect("bash");
        assert!(out.status.success(), "not bash:\n{block}\n{}", String::from_utf8_lossy(&out.stderr));
        // what a command writes (`> FILE`, gen.sh's `--out DIR`) need not exist before
        let words: Vec<&str> = block.split_whitespace().collect();
        let mut written = HashSet::new();
        for (i, word) in words.iter().enumerate() {
            let path = word.trim_end_matches([';', ')', '\'', '"']);
            if !path.starts_with("deploy/") || path.contains('*') {
                continue;
            }
            if i > 0 && [">", "--out"].contains(&words[i - 1]) {
                written.insert(path);
                continue;
            }
            let made = written.iter().any(|w| path.starts_with(w));
            assert!(made || repo().join(path).exists(), "docs/deploy.md names {path}, which does not exist:\n{block}");
        }
    }
    assert!(blocks >= 8, "{blocks} sh blocks");
    for (name, text) in units()
        .into_iter()
        .chain([("jetrl.env".to_string(), std::fs::read_to_string(repo().join("deploy/systemd/jetrl.env")).unwrap())])
    {
        assert!(!text.contains("python3."), "{name} names a Python version");
    }
}
