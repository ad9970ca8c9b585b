//! jetrl against the least-privilege NATS deployment that deploy/nats/gen.sh generates: a real nats-server with
//! TLS (client certificates verified), one user per service and the generated permissions, on a free port with a
//! temporary store. The script, the server configuration and the services' credential handling are the ones a
//! deployment uses.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use bytes::Bytes;
use jetrl_bus::publish::Outgoing;
use jetrl_bus::{Bus, BusError};
use jetrl_config::NatsConfig;
use jetrl_tests::bin;
use jetrl_tests::secure_nats::{all_but_the_trainer, gen, spawn_service, SecureNats, Service};
use jetrl_wire::v1::{PromptTask, WeightAnnounce, WeightAnnounceResponse};
use jetrl_wire::Message;

/// The job namespace gen.sh generates for by default.
static NAMES: std::sync::LazyLock<jetrl_wire::subjects::Names> =
    std::sync::LazyLock::new(|| jetrl_wire::subjects::Names::new("jetrl").expect("the default namespace"));

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Asserts that `result` is a refusal that came back at once, not after a timeout.
fn assert_refused<T: std::fmt::Debug>(what: &str, result: Result<T, BusError>, started: Instant) {
    let err = result.expect_err(&format!("{what} must be refused"));
    let text = err.to_string();
    assert!(text.contains("permissions violation"), "{what}: not reported as a refusal: {text}");
    assert!(started.elapsed() < Duration::from_secs(5), "{what}: the refusal took {:?}", started.elapsed());
}

fn prompt_task() -> PromptTask {
    PromptTask { uid: "forged".into(), partition: "train".into(), n: 1, ..Default::default() }
}

fn permission_violations_counted() -> f64 {
    jetrl_tests::metric_family_sum(&jetrl_telemetry::prometheus().render(), "jetrl_bus_permission_violations_total")
}

#[tokio::test]
async fn wrong_credentials_fail_at_start_up_with_the_server_and_the_user_and_no_secret() {
    let nats = SecureNats::start();
    let wrong = nats.dir().join("wrong-password");
    std::fs::write(&wrong, "not-the-password\n").expect("write");
    let cfg = NatsConfig { password_file: Some(wrong.display().to_string()), ..nats.identity("rollout-worker") };
    let started = Instant::now();
    let err = Bus::connect(&cfg, &NAMES, "test").await.err().expect("a wrong password must not connect");
    let text = err.to_string();
    assert!(text.contains(&nats.url()), "the error names the server: {text}");
    assert!(text.contains("\"jetrl-rollout-worker\""), "the error names the user: {text}");
    assert!(text.contains("not retried"), "{text}");
    assert!(!text.contains("not-the-password"), "the error leaks the password: {text}");
    match err {
        BusError::Connect { attempts, .. } => assert_eq!(attempts, 1, "an authorization violation is permanent"),
        other => panic!("unexpected error {other}"),
    }
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());

    // the right password without the client certificate: the server's TLS refuses it, also at once
    let started = Instant::now();
    let cfg = NatsConfig { tls_cert_file: None, tls_key_file: None, ..nats.identity("rollout-worker") };
    let text = Bus::connect(&cfg, &NAMES, "test").await.err().expect("no client certificate").to_string();
    assert!(text.contains(&nats.url()) && text.contains("not retried"), "{text}");
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
}

#[tokio::test]
async fn tls_checks_the_server_against_the_configured_ca_and_name() {
    let nats = SecureNats::start();
    // another job's CA does not vouch for this server: refused at once
    let other = tempfile::tempdir().expect("tempdir");
    gen(&["--out", &other.path().display().to_string(), "--monitor", "off"]);
    let cfg = NatsConfig {
        tls_ca_file: Some(other.path().join("clients/ca.pem").display().to_string()),
        ..nats.identity("status")
    };
    let started = Instant::now();
    let text = Bus::connect(&cfg, &NAMES, "test").await.err().expect("an unknown CA").to_string();
    assert!(text.contains("certificate") && text.contains("not retried"), "{text}");
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());

    // by IP, checked against a name the certificate carries (`localhost`): accepted
    let cfg = NatsConfig { tls_server_name: Some("localhost".into()), ..nats.identity("status") };
    Bus::connect(&cfg, &NAMES, "test").await.expect("the server's certificate names localhost");
    // against a name it does not carry: refused
    let cfg = NatsConfig { tls_server_name: Some("elsewhere.example".into()), ..nats.identity("status") };
    let text = Bus::connect(&cfg, &NAMES, "test").await.err().expect("a name the certificate lacks").to_string();
    assert!(text.contains("certificate") && text.contains("not retried"), "{text}");
}

#[tokio::test]
async fn a_rollout_worker_cannot_publish_prompt_tasks_announce_weights_or_write_the_weights_bucket() {
    let before = permission_violations_counted();
    let nats = SecureNats::start();
    nats.connect("trainer").await.declare_topology().await.expect("the trainer declares the topology");
    let worker = nats.connect("rollout-worker").await;
    worker.expect_topology().await.expect("a worker reads the job's topology");

    // what a worker does is allowed: a trajectory, and its heartbeat under its own service's keys
    let traj = Outgoing::new(NAMES.traj_subject("train", "u1"), Some("u1_0_0".into()), Bytes::from_static(b"x"));
    worker.publish_durable(traj).await.expect("a worker writes trajectories");
    let beat = Outgoing::new(format!("$KV.{}.rollout.w1", NAMES.workers_bucket()), None, Bytes::from_static(b"b"));
    worker.publish_durable(beat).await.expect("a worker writes its heartbeat");

    let started = Instant::now();
    let task = Outgoing::protobuf(NAMES.prompt_subject("train"), Some("forged".into()), &prompt_task());
    assert_refused("a prompt task from a worker", worker.publish_durable(task).await, started);

    let started = Instant::now();
    let announce = WeightAnnounce::default();
    let reply =
        worker.request::<_, WeightAnnounceResponse>(NAMES.weights_announce(), &announce, Duration::from_secs(60)).await;
    assert_refused("a weight announcement from a worker", reply, started);

    let started = Instant::now();
    let manifest = Outgoing::new(format!("$KV.{}.latest", NAMES.weights_bucket()), None, Bytes::from_static(b"m"));
    assert_refused("a weight manifest from a worker", worker.publish_durable(manifest).await, started);
    let beat = Outgoing::new(format!("$KV.{}.trainer.x", NAMES.workers_bucket()), None, Bytes::from_static(b"b"));
    assert_refused("another service's heartbeat", worker.publish_durable(beat).await, Instant::now());

    // nothing got through: the weights bucket is empty and PROMPTS holds nothing
    let checkpoint = nats.connect("checkpoint-sync").await;
    assert!(checkpoint.latest_manifest().await.expect("read").is_none());
    let mut prompts = nats.connect("trainer").await.stream(NAMES.prompts_stream()).await.expect("PROMPTS");
    assert_eq!(prompts.info().await.expect("info").state.messages, 0);
    assert!(permission_violations_counted() >= before + 4.0, "the refusals are counted");
}

/// Only the trainer (and admin) may create or update the job's streams and buckets: every other identity reads
/// them, finds them in place and goes on; its attempt to create or update one is refused at once, naming who
/// declares them.
#[tokio::test]
async fn only_the_trainer_creates_or_updates_the_jobs_streams_and_buckets() {
    let nats = SecureNats::start();
    let services = ["rollout-worker", "reward-service", "replay-buffer", "checkpoint-sync", "status"];
    for user in services {
        let started = Instant::now();
        let err = nats.connect(user).await.declare_topology().await.expect_err("only the trainer creates");
        let text = err.to_string();
        assert!(text.contains("permissions violation") && text.contains("trainer declares"), "{user}: {text}");
        assert!(started.elapsed() < Duration::from_secs(5), "{user}: the refusal took {:?}", started.elapsed());
    }
    let declared = nats.connect("trainer").await.declare_topology().await.expect("the trainer declares");
    assert_eq!(declared.created.len(), 11, "{declared:?}");
    for user in services {
        nats.connect(user).await.expect_topology().await.unwrap_or_else(|e| panic!("{user} reads it: {e}"));
    }
    // an admin changed a stream: a worker cannot change it back, the trainer does
    let admin = nats.connect("admin").await;
    let mut traj = admin.stream(NAMES.traj_stream()).await.expect("TRAJ").cached_info().config.clone();
    traj.max_age = Duration::from_secs(3600);
    admin.jetstream().update_stream(traj).await.expect("admin updates");
    let started = Instant::now();
    let text = nats.connect("rollout-worker").await.declare_topology().await.expect_err("refused").to_string();
    assert!(text.contains("permissions violation") && text.contains(NAMES.traj_stream()), "{text}");
    assert!(started.elapsed() < Duration::from_secs(5), "the refusal took {:?}", started.elapsed());
    nats.connect("rollout-worker").await.expect_topology().await.expect("a difference does not stop a reader");
    let fixed = nats.connect("trainer").await.declare_topology().await.expect("the trainer updates");
    assert_eq!(fixed.updated.len(), 1, "{fixed:?}");
    assert!(nats.violations().iter().all(|v| !v.contains("jetrl-trainer")), "{:?}", nats.violations());
}

#[tokio::test]
async fn the_status_identity_reads_and_cannot_write() {
    let nats = SecureNats::start();
    nats.connect("trainer").await.declare_topology().await.expect("the trainer declares the topology");
    let status = nats.connect("status").await;
    assert!(status.latest_manifest().await.expect("status reads the weights bucket").is_none());
    let workers = status.key_value(NAMES.workers_bucket()).await.expect("status opens WORKERS");
    use futures::StreamExt;
    assert_eq!(workers.keys().await.expect("status lists heartbeats").count().await, 0);
    // the row ledger (`jetrl status --ledger`) reads the group records
    let groups = jetrl_bus::GroupStore::open(&status).await.expect("status opens GROUPS");
    assert!(groups.records("train").await.expect("status reads the group records, live and archived").is_empty());

    for (what, subject) in [
        ("a prompt task", NAMES.prompt_subject("train")),
        ("a heartbeat", format!("$KV.{}.rollout.fake", NAMES.workers_bucket())),
        ("a weight manifest", format!("$KV.{}.latest", NAMES.weights_bucket())),
        ("a group record", format!("$KV.{}.train.u1", NAMES.groups_bucket())),
        ("a trajectory", NAMES.traj_subject("train", "u1")),
    ] {
        let message = Outgoing::new(subject, None, Bytes::from(prompt_task().encode_to_vec()));
        assert_refused(what, status.publish_durable(message).await, Instant::now());
    }
    let started = Instant::now();
    let sample = jetrl_wire::v1::SampleRequest::default();
    let reply =
        status.request::<_, jetrl_wire::v1::SampleResponse>(NAMES.buffer_sample(), &sample, Duration::from_secs(30));
    assert_refused("a sample request (it would take groups from the trainer)", reply.await, started);
}

/// Across every identity: only the trainer may publish prompt tasks and weight announcements, only
/// checkpoint-sync may write the WEIGHTS bucket. A refusal is immediate; an allowed publish may still fail for
/// another reason (no checkpoint-sync answers the announcement here), but never as a refusal.
#[tokio::test]
async fn prompt_tasks_announcements_and_weight_manifests_each_have_one_writer() {
    let nats = SecureNats::start();
    nats.connect("trainer").await.declare_topology().await.expect("topology");
    for user in ["trainer", "rollout-worker", "reward-service", "replay-buffer", "checkpoint-sync", "status"] {
        let bus = nats.connect(user).await;
        let task = Outgoing::protobuf(NAMES.prompt_subject("train"), Some(format!("p-{user}")), &prompt_task());
        let manifest = Outgoing::new(format!("$KV.{}.latest", NAMES.weights_bucket()), None, Bytes::from_static(b"m"));
        let announcement = WeightAnnounce::default();
        let announce =
            bus.request::<_, WeightAnnounceResponse>(NAMES.weights_announce(), &announcement, Duration::from_secs(3));
        let outcomes = [
            ("a prompt task", user == "trainer", bus.publish_durable(task).await.err()),
            ("a weight announcement", user == "trainer", announce.await.err()),
            ("a weight manifest", user == "checkpoint-sync", bus.publish_durable(manifest).await.err()),
        ];
        for (what, allowed, err) in outcomes {
            let refused = err.as_ref().is_some_and(|e| e.to_string().contains("permissions violation"));
            assert_eq!(refused, !allowed, "{user} publishing {what}: {err:?}");
        }
    }
}

/// Token authentication, the token read from a file (a plain server with `authorization { token }`): the right
/// token connects, a wrong one fails at once without naming it.
#[tokio::test]
async fn a_token_from_a_file_authenticates_and_a_wrong_one_fails_at_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("free port").port();
    let conf = dir.path().join("nats.conf");
    std::fs::write(&conf, format!("host: 127.0.0.1\nport: {port}\nauthorization {{ token: \"t0ken-1234\" }}\n"))
        .expect("write");
    let log = dir.path().join("nats.log");
    let mut server = Command::new(jetrl_bus::harness::find_binary().expect("nats-server"))
        .arg("-c")
        .arg(&conf)
        .arg("-l")
        .arg(&log)
        .spawn()
        .expect("nats-server");
    let started = Instant::now();
    while !std::fs::read_to_string(&log).unwrap_or_default().contains("Server is ready") {
        assert!(started.elapsed() < Duration::from_secs(20), "nats-server not ready");
        std::thread::sleep(Duration::from_millis(20));
    }
    let token_file = dir.path().join("token");
    let url = format!("nats://127.0.0.1:{port}");
    let cfg = NatsConfig {
        url: url.clone(),
        token_file: Some(token_file.display().to_string()),
        connect_timeout_s: 20.0,
        ..Default::default()
    };
    std::fs::write(&token_file, "t0ken-1234\n").expect("write");
    let connected = Bus::connect(&cfg, &NAMES, "test").await;
    std::fs::write(&token_file, "wrong-token\n").expect("write");
    let started = Instant::now();
    let refused = Bus::connect(&cfg, &NAMES, "test").await;
    let _ = server.kill();
    let _ = server.wait();
    connected.expect("the right token connects");
    let text = refused.err().expect("a wrong token must not connect").to_string();
    assert!(text.contains(&url) && text.contains("a token") && text.contains("not retried"), "{text}");
    assert!(!text.contains("wrong-token"), "the error leaks the token: {text}");
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
}

/// The five services as processes, each with its own identity, the deploy job file, two steps: the job
/// completes and the server refused nothing (the generated permissions cover everything the services do).
#[test]
fn a_training_job_runs_with_every_service_under_its_own_identity() {
    let nats = SecureNats::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let model = dir.path().join("model");
    jetrl_model::init_model("tiny-digits", &model, 1).expect("model");
    let job = [
        format!("run.dir={}", dir.path().join("run").display()),
        format!("model.path={}", model.display()),
        "trainer.total_training_steps=2".to_string(),
        "trainer.test_freq=-1".to_string(),
        "trainer.save_freq=1".to_string(),
        "data.train_batch_size=4".to_string(),
        "rollout.n=2".to_string(),
    ];
    let spawn = |user: &str, binary: &str| spawn_service(dir.path(), user, binary, &job, &nats.overrides(user));
    let _services: Vec<Service> = all_but_the_trainer(&spawn);
    let mut trainer = spawn("trainer", "jetrl-trainer");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = trainer.0.try_wait().expect("try_wait") {
            break status;
        }
        assert!(started.elapsed() < Duration::from_secs(240), "the trainer did not finish");
        std::thread::sleep(Duration::from_millis(100));
    };
    let logs: String = ["trainer", "checkpoint-sync", "replay-buffer", "reward-service", "rollout-worker"]
        .iter()
        .map(|u| {
            format!(
                "----- {u} -----\n{}\n",
                std::fs::read_to_string(dir.path().join(format!("{u}.log"))).unwrap_or_default()
            )
        })
        .collect();
    assert!(status.success(), "the trainer failed:\n{logs}");
    let metrics = std::fs::read_to_string(dir.path().join("run/metrics.jsonl")).expect("metrics.jsonl");
    assert_eq!(metrics.lines().count(), 2);

    // the read-only identity sees the job through `jetrl status --config <its nats.yaml>`
    let out = Command::new(bin("jetrl"))
        .arg("status")
        .arg("--config")
        .arg(nats.identity_file("status"))
        .output()
        .expect("jetrl status");
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && text.contains("weights: version 2"), "jetrl status:\n{text}");

    let refused = nats.violations();
    assert!(refused.is_empty(), "the server refused something a service does:\n{}\n{logs}", refused.join("\n"));
    assert!(!logs.contains("permissions violation"), "{logs}");
}

/// The secret-free parts of a generated identity: nats.env names the user and its reply prefix and holds no
/// password; the password and the key are readable by their owner only.
#[test]
fn generated_credentials_keep_secrets_in_owner_only_files() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let first = gen(&["--out", &dir.path().display().to_string(), "--namespace", "job-7"]);
    assert!(first.contains("new: CA"), "{first}");
    let client = dir.path().join("clients/rollout-worker");
    let password = std::fs::read_to_string(client.join("password")).expect("password");
    assert_eq!(password.len(), 32, "{password:?}");
    let env = std::fs::read_to_string(client.join("nats.env")).expect("nats.env");
    assert!(env.contains("JETRL__NATS__USER=job-7-rollout-worker"), "{env}");
    assert!(env.contains("JETRL__NATS__INBOX_PREFIX=_INBOX_job-7-rollout-worker"), "{env}");
    assert!(!env.contains(&password));
    for secret in ["password", "key.pem"] {
        let mode = std::fs::metadata(client.join(secret)).expect(secret).permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{secret}");
    }
    let auth = std::fs::read_to_string(dir.path().join("server/auth.conf")).expect("auth.conf");
    assert!(auth.contains("\"JETRL_job-7\"") && auth.contains(&password));

    // a second run keeps every secret; --rotate passwords replaces the passwords only
    let again = gen(&["--out", &dir.path().display().to_string(), "--namespace", "job-7"]);
    assert!(again.contains("nothing new"), "{again}");
    assert_eq!(std::fs::read_to_string(client.join("password")).expect("password"), password);
    let cert = std::fs::read_to_string(client.join("cert.pem")).expect("cert");
    gen(&["--out", &dir.path().display().to_string(), "--namespace", "job-7", "--rotate", "passwords"]);
    assert_ne!(std::fs::read_to_string(client.join("password")).expect("password"), password);
    assert_eq!(std::fs::read_to_string(client.join("cert.pem")).expect("cert"), cert);

    let bad = Command::new("bash")
        .arg(repo().join("deploy/nats/gen.sh"))
        .args(["--out", &dir.path().display().to_string(), "--namespace", "bad.name"])
        .output()
        .expect("bash");
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--namespace bad.name"));
}

#[test]
fn nats_config_debug_shows_no_secret() {
    let cfg = NatsConfig {
        user: Some("u".into()),
        password: Some("hunter2".into()),
        token: Some("t0k".into()),
        ..Default::default()
    };
    let text = format!("{cfg:?}");
    assert!(!text.contains("hunter2") && !text.contains("t0k"), "{text}");
    assert!(text.contains("<redacted>") && text.contains("\"u\""), "{text}");
}
