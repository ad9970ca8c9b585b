//! `jetrl run`: one training job on this machine, every service its own process.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::StreamExt;
use jetrl_bus::NatsServer;
use jetrl_config::JobConfig;
use tokio::process::{Child, Command};

/// A started service process.
struct Service {
    name: String,
    child: Child,
}

/// Returns the process exit code: 0 when training completed.
pub async fn run(
    config: &Path,
    mut overrides: Vec<String>,
    nats_url: Option<String>,
    quiet: bool,
) -> anyhow::Result<i32> {
    let started = Instant::now();
    // colocate_async pairs the trainer with one worker on its device: name it, unless the job does.
    let merged = jetrl_config::load_value(Some(config), &overrides)?;
    if merged["trainer"]["mode"] == "colocate_async"
        && merged["trainer"]["colocate_async"]["rollout_instance"].as_str().is_none_or(str::is_empty)
    {
        overrides.push("trainer.colocate_async.rollout_instance=rollout-0".into());
    }
    let cfg = JobConfig::load(Some(config), &overrides)?;
    anyhow::ensure!(
        cfg.trainer.mode != jetrl_config::TrainerMode::ColocateAsync || cfg.rollout.workers == 1,
        "rollout.workers is {} but colocate_async runs exactly one rollout worker, on the trainer's device",
        cfg.rollout.workers
    );
    if !quiet {
        jetrl_telemetry::init_tracing("warn", cfg.log.format);
    } else {
        jetrl_telemetry::init_tracing(&cfg.log.level, cfg.log.format);
    }
    let run_dir = PathBuf::from(&cfg.run.dir);
    std::fs::create_dir_all(run_dir.join("logs")).with_context(|| format!("creating {}", run_dir.display()))?;

    // The model: create the preset if the directory has none.
    let model_dir = PathBuf::from(&cfg.model.path);
    if !model_dir.join("config.json").exists() {
        let preset = cfg.model.init_preset.map(|p| p.as_str()).with_context(|| {
            format!("model.path {} has no config.json and model.init_preset is not set", model_dir.display())
        })?;
        jetrl_model::init_model(preset, &model_dir, cfg.run.seed)
            .with_context(|| format!("creating the {preset} model"))?;
        eprintln!("created a random-init `{preset}` model in {}", model_dir.display());
    }

    // NATS: the given server, or our own with a temporary store.
    let mut embedded = None;
    let url = match nats_url {
        Some(url) => url,
        None => {
            let server = NatsServer::start().context("starting nats-server")?;
            let url = server.url();
            embedded = Some(server);
            url
        }
    };
    overrides.push(format!("nats.url={url}"));
    let cfg = JobConfig::load(Some(config), &overrides)?;
    let job_file = run_dir.join("job.yaml");
    std::fs::write(&job_file, serde_yaml::to_string(&cfg)?)
        .with_context(|| format!("writing {}", job_file.display()))?;

    let bus = jetrl_bus::Bus::connect_job(&cfg, "jetrl-run").await?;
    bus.declare_topology().await?;
    let mut progress_sub = bus.client().subscribe(bus.names().trainer_metrics().to_string()).await?;

    let bin_dir = std::env::current_exe()?.parent().map(Path::to_path_buf).context("locating jetrl's directory")?;
    let mut services = Vec::new();
    let mut spawn = |name: String, binary: &str, extra: Vec<String>| -> anyhow::Result<()> {
        let path = bin_dir.join(binary);
        anyhow::ensure!(path.exists(), "{} not found next to jetrl (build the workspace: cargo build)", path.display());
        let log = std::fs::File::create(run_dir.join("logs").join(format!("{name}.log")))?;
        let mut command = Command::new(&path);
        // If `jetrl run` itself dies (even by SIGKILL), its services get SIGTERM and settle what they hold.
        #[cfg(target_os = "linux")]
        // SAFETY: prctl(PR_SET_PDEATHSIG) is async-signal-safe and touches no memory of the parent.
        #[allow(unsafe_code)]
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }
        let child = command
            .arg("--config")
            .arg(&job_file)
            .args(extra)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", path.display()))?;
        services.push(Service { name, child });
        Ok(())
    };
    spawn("checkpoint-sync".into(), "jetrl-checkpoint-sync", vec![])?;
    spawn("replay-buffer".into(), "jetrl-replay-buffer", vec![])?;
    for i in 0..cfg.reward.workers.max(1) {
        spawn(format!("reward-{i}"), "jetrl-reward-service", vec![format!("reward.instance_id=reward-{i}")])?;
    }
    for i in 0..cfg.rollout.workers.max(1) {
        spawn(format!("rollout-{i}"), "jetrl-rollout-worker", vec![format!("rollout.instance_id=rollout-{i}")])?;
    }
    spawn("trainer".into(), "jetrl-trainer", vec![])?;
    eprintln!(
        "run directory: {} (service logs in logs/), NATS at {url}, job namespace {}",
        run_dir.display(),
        bus.names().namespace()
    );

    let bar = if quiet {
        indicatif::ProgressBar::hidden()
    } else {
        let bar = indicatif::ProgressBar::new(0);
        bar.set_style(
            indicatif::ProgressStyle::with_template("{spinner} [{elapsed_precise}] step {pos}/{len} {wide_msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        bar.enable_steady_tick(Duration::from_millis(200));
        bar.set_message("starting services...");
        bar
    };

    // SIGINT (Ctrl-C) or SIGTERM: stop every service cleanly.
    let mut ctrl_c = Box::pin(jetrl_telemetry::shutdown_signal());
    let mut check = tokio::time::interval(Duration::from_millis(500));
    let trainer_index = services.len() - 1;
    let outcome: Result<(), String> = loop {
        tokio::select! {
            _ = &mut ctrl_c => break Err("interrupted".into()),
            msg = progress_sub.next() => {
                if let Some(msg) = msg {
                    if let Ok(m) = serde_json::from_slice::<serde_json::Value>(&msg.payload) {
                        let step = m["training/global_step"].as_f64().unwrap_or(0.0) as u64;
                        if let Some(total) = m["training/total_steps"].as_f64() { bar.set_length(total as u64); }
                        bar.set_position(step);
                        let msg = format!(
                            "reward {:.3}  tok/s {:.0}  step {:.2}s",
                            m["critic/score/mean"].as_f64().unwrap_or(f64::NAN),
                            m["perf/throughput"].as_f64().unwrap_or(0.0),
                            m["timing_s/step"].as_f64().unwrap_or(0.0),
                        );
                        if quiet { eprintln!("step {step}: {msg}"); }
                        bar.set_message(msg);
                    }
                }
            }
            _ = check.tick() => {
                if let Ok(Some(status)) = services[trainer_index].child.try_wait() {
                    break if status.success() { Ok(()) } else { Err(format!("trainer exited with {status}")) };
                }
                if let Some(dead) = services.iter_mut().find_map(|s| match s.child.try_wait() {
                    Ok(Some(status)) => Some(format!("{} exited with {status}", s.name)),
                    _ => None,
                }) {
                    break Err(dead);
                }
            }
        }
    };
    bar.finish_and_clear();
    stop_all(&mut services).await;
    drop(embedded);

    let summary = std::fs::read_to_string(run_dir.join("summary.json")).ok();
    match &outcome {
        Ok(()) => {
            eprintln!("training finished in {:.0}s", started.elapsed().as_secs_f64());
            if let Some(summary) = summary {
                eprintln!("{summary}");
            }
            eprintln!("metrics: {}", run_dir.join("metrics.jsonl").display());
            eprintln!("reward curve: {}", run_dir.join("reward_curve.svg").display());
            Ok(0)
        }
        Err(reason) => {
            eprintln!("job stopped: {reason} (see {}/logs/)", run_dir.display());
            Ok(if reason == "interrupted" { 130 } else { 1 })
        }
    }
}

/// SIGTERM to every service, then wait (up to 20 s) so each can settle what it holds; SIGKILL stragglers.
async fn stop_all(services: &mut [Service]) {
    for s in services.iter() {
        if let Some(pid) = s.child.id() {
            // SAFETY: kill(2) with a pid we spawned and a valid signal has no memory-safety preconditions.
            #[allow(unsafe_code)]
            unsafe {
                libc::kill(pid as libc::pid_t, libc::SIGTERM);
            }
        }
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    for s in services.iter_mut() {
        let left = deadline.saturating_duration_since(Instant::now());
        if tokio::time::timeout(left, s.child.wait()).await.is_err() {
            eprintln!("{} did not stop in time; killing it", s.name);
            let _ = s.child.kill().await;
        }
    }
}
