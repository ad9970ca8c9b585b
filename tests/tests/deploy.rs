//! The deploy files (docker compose, systemd, NATS, Prometheus): no Docker engine runs on the CI machines,
//! so these tests parse the files and run the same commands they run, against a real nats-server.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use jetrl_tests::{bin, NatsServer};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn compose() -> serde_yaml::Value {
    let text = std::fs::read_to_string(repo().join("deploy/docker-compose.yml")).expect("docker-compose.yml");
    let mut doc: serde_yaml::Value = serde_yaml::from_str(&text).expect("docker-compose.yml is YAML");
    doc.apply_merge().expect("merge keys");
    doc
}

/// The command of every jetrl service in the compose file (service name → argv).
fn jetrl_commands() -> BTreeMap<String, Vec<String>> {
    let doc = compose();
    let services = doc["services"].as_mapping().expect("services");
    services
        .iter()
        .filter_map(|(name, svc)| {
            let argv: Vec<String> =
                svc["command"].as_sequence()?.iter().filter_map(|v| v.as_str().map(str::to_string)).collect();
            let is_jetrl = argv.first().is_some_and(|b| b.starts_with("jetrl-"));
            is_jetrl.then(|| (name.as_str().unwrap_or_default().to_string(), argv))
        })
        .collect()
}

/// `--config FILE key=value...` → the overrides.
fn overrides(argv: &[String]) -> Vec<String> {
    argv.iter().skip(1).filter(|a| a.contains('=')).cloned().collect()
}

fn job_file() -> PathBuf {
    repo().join("deploy/job.yaml")
}

#[test]
fn compose_runs_every_service_with_a_config_that_loads() {
    let commands = jetrl_commands();
    let names: HashSet<&str> = commands.keys().map(String::as_str).collect();
    for expected in ["trainer", "rollout-worker", "reward-service", "replay-buffer", "checkpoint-sync"] {
        assert!(names.contains(expected), "compose lacks {expected}: {names:?}");
    }
    for (name, argv) in &commands {
        let binary = bin(&argv[0]);
        assert!(binary.exists(), "{name}: {} is not a jetrl binary", argv[0]);
        let cfg = jetrl_config::JobConfig::load(Some(&job_file()), &overrides(argv))
            .unwrap_or_else(|e| panic!("{name}: deploy/job.yaml with {argv:?} does not load: {e}"));
        assert_eq!(cfg.nats.url, "nats://nats:4222", "{name} must reach the compose NATS service");
    }
    let doc = compose();
    for (name, svc) in doc["services"].as_mapping().unwrap() {
        let name = name.as_str().unwrap();
        if let Some(vols) = svc["volumes"].as_sequence() {
            for v in vols.iter().filter_map(|v| v.as_str()) {
                if let Some(src) = v.split(':').next().filter(|s| s.starts_with("./")) {
                    assert!(repo().join("deploy").join(src).exists(), "{name}: volume source {src} is missing");
                }
            }
        }
    }
}

#[test]
fn prometheus_scrapes_the_ports_the_services_serve_metrics_on() {
    let served: HashSet<String> = jetrl_commands()
        .values()
        .flat_map(|argv| overrides(argv))
        .filter(|o| o.contains("metrics_addr="))
        .filter_map(|o| o.rsplit(':').next().map(str::to_string))
        .collect();
    let text = std::fs::read_to_string(repo().join("deploy/prometheus/prometheus.yml")).unwrap();
    let doc: serde_yaml::Value = serde_yaml::from_str(&text).unwrap();
    let mut scraped = HashSet::new();
    for job in doc["scrape_configs"].as_sequence().unwrap() {
        for sc in job["static_configs"].as_sequence().into_iter().flatten() {
            for t in sc["targets"].as_sequence().unwrap() {
                scraped.insert(t.as_str().unwrap().rsplit(':').next().unwrap().to_string());
            }
        }
        for sd in job["dns_sd_configs"].as_sequence().into_iter().flatten() {
            scraped.insert(sd["port"].as_u64().unwrap().to_string());
        }
    }
    assert_eq!(served, scraped, "metrics ports served vs scraped");
    let dash: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(repo().join("deploy/grafana/dashboards/jetrl.json")).unwrap())
            .unwrap();
    assert!(dash["panels"].as_array().is_some_and(|p| !p.is_empty()));
}

#[test]
fn nats_config_is_valid_for_nats_server() {
    let (status, out) = {
        let nats = jetrl_bus::harness::find_binary().unwrap();
        let out = std::process::Command::new(nats)
            .args(["-c", &repo().join("deploy/nats/nats.conf").display().to_string(), "-t"])
            .output()
            .unwrap();
        (out.status, String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout))
    };
    assert!(status.success(), "{out}");
    let text = std::fs::read_to_string(repo().join("deploy/nats/nats.conf")).unwrap();
    assert!(text.contains("max_payload: 8MB") && text.contains("jetstream"));
}

#[test]
fn systemd_units_start_jetrl_binaries_with_configs_that_load() {
    let dir = repo().join("deploy/systemd");
    let mut units = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        if !name.starts_with("jetrl-") || !name.ends_with(".service") {
            continue;
        }
        units += 1;
        let text = std::fs::read_to_string(&path).unwrap();
        for key in ["KillSignal=SIGTERM", "Restart=on-failure", "[Install]"] {
            assert!(text.contains(key), "{name} lacks {key}");
        }
        let exec =
            text.lines().find_map(|l| l.strip_prefix("ExecStart=")).unwrap_or_else(|| panic!("{name}: no ExecStart"));
        let argv: Vec<String> =
            exec.replace("%i", "0").replace("%H", "host").split_whitespace().map(str::to_string).collect();
        let binary = Path::new(&argv[0]).file_name().unwrap().to_string_lossy().to_string();
        assert!(bin(&binary).exists(), "{name}: {binary}");
        assert_eq!(argv[1..3], ["--config".to_string(), "/etc/jetrl/job.yaml".to_string()], "{name}");
        jetrl_config::JobConfig::load(Some(&job_file()), &overrides(&argv)).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    assert_eq!(units, 5);
}

/// Runs the compose services' own command lines against a real nats-server (host names and volumes
/// replaced by local ones) for a two-step job.
#[test]
fn compose_command_lines_run_a_training_job() {
    let nats = NatsServer::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    jetrl_model::init_model("tiny-digits", &model, 1).unwrap();
    let local = [
        format!("run.dir={}", dir.path().join("run").display()),
        format!("model.path={}", model.display()),
        "trainer.total_training_steps=2".to_string(),
        "trainer.test_freq=-1".to_string(),
        "data.train_batch_size=4".to_string(),
        "rollout.n=2".to_string(),
    ];
    let mut children = Vec::new();
    let mut trainer = None;
    for (name, argv) in jetrl_commands() {
        let mut args: Vec<String> =
            argv[1..]
                .iter()
                .map(|a| if a == "/etc/jetrl/job.yaml" { job_file().display().to_string() } else { a.clone() })
                .map(|a| a.replace("nats://nats:4222", &nats.url()).replace("0.0.0.0:", "127.0.0.1:"))
                .map(|a| {
                    if a.contains("metrics_addr=") {
                        format!("{}=127.0.0.1:0", a.split('=').next().unwrap())
                    } else {
                        a
                    }
                })
                .collect();
        args.extend(local.iter().cloned());
        let log = std::fs::File::create(dir.path().join(format!("{name}.log"))).unwrap();
        let child = std::process::Command::new(bin(&argv[0]))
            .args(&args)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        if name == "trainer" {
            trainer = Some(child);
        } else {
            children.push(child);
        }
    }
    let mut trainer = trainer.expect("a trainer service");
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(s) = trainer.try_wait().unwrap() {
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
    let metrics = std::fs::read_to_string(dir.path().join("run/metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 2);
}

#[test]
fn dockerfile_builds_with_the_readme_setup_and_ships_every_binary() {
    let text = std::fs::read_to_string(repo().join("deploy/Dockerfile")).unwrap();
    assert!(text.contains("scripts/setup.sh") && text.contains("cargo build --workspace --bins"));
    assert!(repo().join("scripts/setup.sh").exists());
    for line in text.lines().filter(|l| l.starts_with("COPY ") && !l.contains("--from")) {
        let src = line.split_whitespace().nth(1).unwrap();
        assert!(repo().join(src).exists(), "COPY source {src} missing");
    }
    for (_, argv) in jetrl_commands() {
        // the image copies target/debug/jetrl-*: every compose command's binary is one of them
        assert!(argv[0].starts_with("jetrl-"));
    }
}
