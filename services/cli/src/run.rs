//! `jetrl run`: one training job on this machine, every service its own process.

use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use futures::StreamExt;
use jetrl_bus::NatsServer;
use jetrl_config::JobConfig;
use serde_json::json;

use crate::broker;
use crate::embedded;
use crate::layout;
use crate::liveness::Liveness;
use crate::preflight;
use crate::supervisor::{self, Event, RestartHistory, RestartPolicy, ServiceSpec, Supervisor, Verdict};
use crate::threads;

/// Returns the process exit code: 0 when training completed.
pub async fn run(
    config: &Path,
    mut overrides: Vec<String>,
    nats_url: Option<String>,
    quiet: bool,
    placement: layout::Placement,
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
    let visible = preflight::visible_cuda_devices();
    preflight::check_devices(&cfg, visible, preflight::Spelling::Jetrl).map_err(anyhow::Error::msg)?;
    let gpus = layout::plan(&cfg, visible, placement).map_err(anyhow::Error::msg)?;
    // The supervisor says on the console when NATS is lost and back: the client's own reconnect chatter would
    // only repeat it (and break the progress bar).
    let level = if quiet { cfg.log.level.as_str() } else { "warn" };
    jetrl_telemetry::init_tracing(&format!("{level},async_nats=warn,jetrl_bus::connect=error"), cfg.log.format);
    // A dataset that is not there is a permanent error: said once, before any service starts (the trainer would
    // fail on it at every restart).
    for (key, files) in [("data.train_files", &cfg.data.train_files), ("data.val_files", &cfg.data.val_files)] {
        if let Some(missing) = files.iter().find(|f| !Path::new(f).exists()) {
            anyhow::bail!("{key}: {missing} does not exist");
        }
    }
    // vLLM missing for a job that starts vLLM servers: every rollout worker would fail at each restart
    jetrl_rollout_worker::vllm_preflight(&cfg).map_err(|e| anyhow::anyhow!(e))?;
    // A tracker that cannot work does not stop the job (the trainer says so in its log): say it here too, where
    // the user looks.
    for warning in tracker_warnings(&cfg) {
        eprintln!("warning: {warning}");
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
    preflight::check_model(&model_dir).map_err(anyhow::Error::msg)?;

    // NATS: the given server, or our own on loopback with one user per service and a temporary store.
    let namespace = cfg.namespace()?.to_string();
    let (url, embedded, identities) = match nats_url {
        Some(url) => (url, None, None),
        None => {
            let (server, identities) = embedded::start(&run_dir, &namespace).context("starting nats-server")?;
            (server.url(), Some(server), Some(identities))
        }
    };
    overrides.push(format!("nats.url={url}"));
    // the trainer's ranks meet at a free port of this host unless the job names one
    if cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes > 1 && cfg.trainer.dist.master_port == 0 {
        let port = std::net::TcpListener::bind((cfg.trainer.dist.master_addr.as_str(), 0))
            .and_then(|l| l.local_addr())
            .with_context(|| {
                format!("finding a free port on trainer.dist.master_addr {}", cfg.trainer.dist.master_addr)
            })?
            .port();
        overrides.push(format!("trainer.dist.master_port={port}"));
    }
    let omp_num_threads_set = std::env::var_os("OMP_NUM_THREADS").is_some_and(|v| !v.is_empty());
    overrides.extend(threads::job_thread_overrides(&cfg, jetrl_telemetry::available_cores(), omp_num_threads_set));
    let mut cfg = JobConfig::load(Some(config), &overrides)?;
    if identities.is_some() {
        cfg.nats = embedded::job_settings(&cfg.nats, &url);
    }
    let job_file = run_dir.join("job.yaml");
    std::fs::write(&job_file, serde_yaml::to_string(&cfg)?)
        .with_context(|| format!("writing {}", job_file.display()))?;
    // On the embedded server each service connects as its own user: `nats.user=...` overrides after job.yaml.
    let identity = |user: &str| identities.as_ref().map_or(Ok(Vec::new()), |ids| ids.overrides(user));

    // jetrl run declares the topology and follows the trainer's metrics: the trainer's identity may do that.
    let own = match &identities {
        Some(_) => JobConfig::load(Some(&job_file), &identity("trainer")?)?,
        None => cfg.clone(),
    };
    let bus = jetrl_bus::Bus::connect_job(&own, "jetrl-run").await?;
    bus.declare_topology().await?;
    let mut progress_sub = bus.client().subscribe(bus.names().trainer_metrics().to_string()).await?;
    let liveness = Liveness::watch(&bus, Duration::from_secs_f64(cfg.run.supervisor.hang_after_s)).await?;

    let bin_dir = std::env::current_exe()?.parent().map(Path::to_path_buf).context("locating jetrl's directory")?;
    let policy = RestartPolicy::from_config(&cfg.run.supervisor);
    let mut supervisor = Supervisor::new(policy.clone(), "trainer");
    let mut journal = Journal::create(&run_dir.join("supervisor.jsonl"), started)?;
    // the journal in the order things happened: the broker first, then the services that connect to it (a reader
    // that saw the services' lines, or the console's status line, finds the server's too)
    if let Some(server) = &embedded {
        journal.record("started", json!({"service": "nats-server", "pid": server.pid(), "port": server.port()}));
    }
    let service = |name: String, binary: &str, extra: Vec<String>| {
        let mut args: Vec<OsString> = vec!["--config".into(), job_file.clone().into()];
        args.extend(extra.into_iter().map(OsString::from));
        let log = run_dir.join("logs").join(format!("{name}.log"));
        ServiceSpec { binary: bin_dir.join(binary), args, log, name, group: None, env: Vec::new() }
    };
    let mut specs = vec![
        service("checkpoint-sync".into(), "jetrl-checkpoint-sync", identity("checkpoint-sync")?),
        service("replay-buffer".into(), "jetrl-replay-buffer", identity("replay-buffer")?),
    ];
    for i in 0..cfg.reward.workers.max(1) {
        let extra = [vec![format!("reward.instance_id=reward-{i}")], identity("reward-service")?].concat();
        specs.push(service(format!("reward-{i}"), "jetrl-reward-service", extra));
    }
    for i in 0..cfg.rollout.workers.max(1) {
        let mut extra = [vec![format!("rollout.instance_id=rollout-{i}")], identity("rollout-worker")?].concat();
        // a worker sees only its GPU, as cuda:0 (as the systemd units and the compose GPU files pin them)
        let gpu = gpus
            .as_ref()
            .and_then(|l| l.workers.get(i as usize))
            .map(|w| w.iter().map(|&g| physical_gpu(g)).collect::<Vec<_>>().join(","));
        if gpu.is_some() {
            extra.push("model.device=cuda:0".into());
        }
        let mut spec = service(format!("rollout-{i}"), "jetrl-rollout-worker", extra);
        spec.env.extend(gpu.map(|g| ("CUDA_VISIBLE_DEVICES".to_string(), g)));
        specs.push(spec);
    }
    // the trainer's ranks on this host, as one group: rank 0 is `trainer`, the others `trainer-<rank>` (the ranks of
    // other nodes are started there: `jetrl-trainer --config job.yaml trainer.dist.rank=<r>`)
    for rank in 0..cfg.trainer.n_gpus_per_node.max(1) {
        let (name, mut extra) = if rank == 0 {
            ("trainer".to_string(), Vec::new())
        } else {
            (format!("trainer-{rank}"), vec![format!("trainer.dist.rank={rank}")])
        };
        extra.extend(identity("trainer")?);
        let mut spec = service(name, "jetrl-trainer", extra);
        spec.group = (cfg.trainer.n_gpus_per_node > 1 || cfg.trainer.nnodes > 1).then(|| "trainer".to_string());
        specs.push(spec);
    }
    for spec in specs {
        anyhow::ensure!(
            spec.binary.exists(),
            "{} not found next to jetrl (build the workspace: cargo build)",
            spec.binary.display()
        );
        let name = spec.name.clone();
        let pid = supervisor.start(spec).with_context(|| format!("starting {name}"))?;
        journal.record("started", json!({"service": name, "pid": pid}));
    }
    if let Some(layout) = &gpus {
        eprintln!("{}", layout.describe());
        journal.record("gpu_layout", json!({"trainer": layout.trainer, "rollout_workers": layout.workers}));
    }
    let whose = if identities.is_some() { " (started by jetrl run: loopback only, one user per service)" } else { "" };
    eprintln!(
        "run directory: {} (service logs in logs/), NATS at {url}{whose}, job namespace {}",
        run_dir.display(),
        bus.names().namespace()
    );
    if let Some(ids) = &identities {
        let status_file = ids.write_status_file(&namespace)?;
        let jetrl = std::env::args_os().next().map_or_else(|| "jetrl".into(), |a| a.to_string_lossy().into_owned());
        eprintln!("the job while it runs: {jetrl} status --config {}", status_file.display());
    }

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
    let console = Console { bar: bar.clone() };
    let mut broker = broker::watch(bus.clone());
    let mut nats = NatsWatch {
        url: url.clone(),
        down_since: None,
        up_since: Some(Instant::now()),
        embedded: embedded.map(EmbeddedNats::new),
    };

    // SIGINT (Ctrl-C) or SIGTERM: stop every service cleanly.
    let mut ctrl_c = Box::pin(jetrl_telemetry::shutdown_signal());
    let mut check = tokio::time::interval(Duration::from_millis(500));
    let outcome: Result<(), String> = loop {
        tokio::select! {
            _ = &mut ctrl_c => break Err(INTERRUPTED.into()),
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
            _ = broker.changed() => nats.on_probe(*broker.borrow_and_update(), &console, &mut journal),
            _ = check.tick() => {
                let now = Instant::now();
                if let Err(reason) = nats.supervise_embedded(&policy, now, &console, &mut journal) {
                    break Err(reason);
                }
                if let Some(liveness) = &liveness {
                    kill_hung(liveness.hung(&supervisor.running(), nats.up_since, now), &console, &mut journal);
                }
                match handle_events(supervisor.poll(now), &policy, &console, &mut journal) {
                    Some(end) => break end,
                    None => continue,
                }
            }
        }
    };
    bar.finish_and_clear();
    // each service settles what it holds: a worker drains its in-flight groups, the trainer writes its ledger
    supervisor.stop_all(cfg.rollout.drain() + STOP_MARGIN).await;
    // Close our connection before the embedded server goes, or the client keeps reconnecting to it.
    drop(progress_sub);
    let _ = tokio::time::timeout(Duration::from_secs(2), bus.client().drain()).await;
    drop(nats);

    let restarts = supervisor.restart_counts();
    journal.record(
        "end",
        json!({
            "outcome": match &outcome { Ok(()) => "finished", Err(r) if r == INTERRUPTED => "interrupted", Err(_) => "failed" },
            "restarts": restarts.iter().map(|(name, n)| (name.clone(), json!(n))).collect::<serde_json::Map<_, _>>(),
        }),
    );
    if !restarts.is_empty() {
        let list: Vec<String> = restarts.iter().map(|(name, n)| format!("{name} ×{n}")).collect();
        eprintln!("restarts: {} (see {})", list.join(", "), run_dir.join("supervisor.jsonl").display());
    }
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
            Ok(if reason == INTERRUPTED { 130 } else { 1 })
        }
    }
}

const INTERRUPTED: &str = "interrupted";
/// What a stop allows every service beyond a rollout worker's drain (`rollout.drain()`): the trainer's ledger and
/// lease release, the other services' naks and acks (a service whose broker is gone waits at most
/// `jetrl_bus::SETTLE_RECONNECT` for it); a service still running after that is killed.
const STOP_MARGIN: Duration = Duration::from_secs(15);

/// Shows and records what the supervisor did; `Some` ends the job (the trainer finished, or a crash loop).
fn handle_events(
    events: Vec<Event>,
    policy: &RestartPolicy,
    console: &Console,
    journal: &mut Journal,
) -> Option<Result<(), String>> {
    let mut end = None;
    for event in events {
        match event {
            Event::TrainerFinished => {
                journal.record("exit", json!({"service": "trainer", "status": "exit status: 0", "action": "end"}));
                end = Some(Ok(()));
            }
            // a trainer rank leaves when rank 0 says training is over
            Event::ExitedCleanly { service } if service.starts_with("trainer-") => {
                journal.record("exit", json!({"service": service, "status": "exit status: 0", "action": "none"}));
            }
            Event::ExitedCleanly { service } => {
                console.say(&format!("{service} exited with exit status: 0 on its own; not restarted"));
                journal.record("exit", json!({"service": service, "status": "exit status: 0", "action": "none"}));
            }
            Event::Restarting { service, status, delay, restarts } => {
                console.say(&format!(
                    "{service} {}; restarting in {:.1}s (restart {restarts} of at most {} within {:.0}s)",
                    failure(&status),
                    delay.as_secs_f64(),
                    policy.max_restarts,
                    policy.window.as_secs_f64(),
                ));
                journal.record(
                    "exit",
                    json!({"service": service, "status": status, "action": "restart", "delay_s": delay.as_secs_f64(),
                           "restarts_in_window": restarts}),
                );
            }
            Event::StoppedWithGroup { service, failed } => {
                console.say(&format!("{service} stopped: {failed} of its group failed; they restart together"));
                journal.record("stopped_with_group", json!({"service": service, "failed": failed}));
            }
            Event::Restarted { service, pid } => {
                console.say(&format!("{service} restarted (pid {})", pid.map_or("?".into(), |p| p.to_string())));
                journal.record("restarted", json!({"service": service, "pid": pid}));
            }
            Event::Failed { service, log, log_tail } => {
                console.say(&format!(
                    "{service} stopped on an error that a restart would meet again (not restarted); the last lines of {}:\n{log_tail}",
                    log.display(),
                ));
                journal.record("failed", json!({"service": service}));
                end = Some(Err(format!("{service} failed on a permanent error")));
            }
            Event::CrashLoop { service, status, restarts, log, log_tail } => {
                console.say(&format!(
                    "{service} is crash-looping: it {} after {restarts} restarts within {:.0}s; the last lines of {}:\n{log_tail}",
                    failure(&status),
                    policy.window.as_secs_f64(),
                    log.display(),
                ));
                journal.record("crash_loop", json!({"service": service, "status": status, "restarts": restarts}));
                end = Some(Err(format!("{service} is crash-looping ({status})")));
            }
        }
    }
    end
}

/// Kills the hung services (SIGKILL, so a stopped one goes too): the supervisor then restarts each as one that
/// died, under the same backoff and crash-loop rules.
fn kill_hung(hung: Vec<crate::liveness::Hung>, console: &Console, journal: &mut Journal) {
    for h in hung {
        console.say(&format!(
            "{} (pid {}) has sent no heartbeat for {:.0}s while NATS was reachable: hung; killing it to restart it",
            h.service,
            h.pid,
            h.silent.as_secs_f64()
        ));
        journal.record("hung", json!({"service": h.service, "pid": h.pid, "silent_s": h.silent.as_secs_f64()}));
        supervisor::signal(h.pid, libc::SIGKILL);
    }
}

/// `exited with exit status: 1`, `was killed (signal: 9 (SIGKILL))`, `could not be started: ...`.
fn failure(status: &str) -> String {
    if status.starts_with("signal") {
        format!("was killed ({status})")
    } else if status.starts_with("exit status") {
        format!("exited with {status}")
    } else {
        status.to_string()
    }
}

/// Lines above the progress bar (or on stderr when there is none).
struct Console {
    bar: indicatif::ProgressBar,
}

impl Console {
    fn say(&self, line: &str) {
        if self.bar.is_hidden() {
            eprintln!("{line}");
        } else {
            self.bar.println(line);
        }
    }
}

/// `<run.dir>/supervisor.jsonl`: one JSON object per restart, crash loop, broker outage and the end of the job.
struct Journal {
    file: Option<std::fs::File>,
    started: Instant,
}

impl Journal {
    fn create(path: &Path, started: Instant) -> anyhow::Result<Self> {
        let file = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
        Ok(Self { file: Some(file), started })
    }

    fn record(&mut self, event: &str, fields: serde_json::Value) {
        let mut line = json!({
            "t": SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64()),
            "elapsed_s": self.started.elapsed().as_secs_f64(),
            "event": event,
        });
        if let (Some(line), serde_json::Value::Object(fields)) = (line.as_object_mut(), fields) {
            line.extend(fields);
        }
        if let Some(file) = self.file.as_mut() {
            if writeln!(file, "{line}").is_err() {
                // a full disk must not stop the job: the console still says everything
                self.file = None;
            }
        }
    }
}

/// The broker as `jetrl run` sees it: reachability, and the embedded server when it started one.
struct NatsWatch {
    url: String,
    /// since when the broker has not answered
    down_since: Option<(Instant, SystemTime)>,
    /// since when it has answered (None while it does not)
    up_since: Option<Instant>,
    embedded: Option<EmbeddedNats>,
}

/// The nats-server `jetrl run` started, restarted on the same port and store when it dies.
struct EmbeddedNats {
    server: NatsServer,
    history: RestartHistory,
    started: Instant,
    restart_at: Option<Instant>,
}

impl EmbeddedNats {
    fn new(server: NatsServer) -> Self {
        Self { server, history: RestartHistory::default(), started: Instant::now(), restart_at: None }
    }
}

impl NatsWatch {
    fn on_probe(&mut self, finding: broker::Unreachable, console: &Console, journal: &mut Journal) {
        match (finding, self.down_since) {
            (Some(reason), None) => {
                let since = SystemTime::now();
                self.down_since = Some((Instant::now(), since));
                self.up_since = None;
                console.say(&format!("NATS at {} unreachable since {} UTC ({reason})", self.url, utc_time(since)));
                console.bar.set_message(format!("NATS at {} unreachable", self.url));
                journal.record("nats_unreachable", json!({"url": self.url, "reason": reason}));
            }
            (None, Some((since, _))) => {
                self.down_since = None;
                self.up_since = Some(Instant::now());
                let down = since.elapsed().as_secs_f64();
                console.say(&format!("NATS at {} reachable again after {down:.0}s", self.url));
                journal.record("nats_reachable", json!({"url": self.url, "down_s": down}));
            }
            _ => {}
        }
    }

    /// Restarts the embedded server when it has died; `Err` when it crash-loops.
    fn supervise_embedded(
        &mut self,
        policy: &RestartPolicy,
        now: Instant,
        console: &Console,
        journal: &mut Journal,
    ) -> Result<(), String> {
        let Some(nats) = self.embedded.as_mut() else { return Ok(()) };
        let status = match nats.restart_at {
            None => match nats.server.exit_status() {
                Some(status) => supervisor::describe(status),
                None => return Ok(()),
            },
            Some(at) if at <= now => {
                nats.restart_at = None;
                // Blocks this thread for the server's start-up (normally well under a second); it must be
                // this thread, the one that lives as long as the job (PR_SET_PDEATHSIG).
                match nats.server.restart() {
                    Ok(()) => {
                        nats.started = Instant::now();
                        console.say(&format!(
                            "nats-server restarted on port {} with its JetStream store ({})",
                            nats.server.port(),
                            nats.server.root().display()
                        ));
                        journal.record("restarted", json!({"service": "nats-server", "pid": nats.server.pid()}));
                        return Ok(());
                    }
                    Err(e) => format!("could not be started: {e}"),
                }
            }
            Some(_) => return Ok(()),
        };
        match nats.history.on_failure(policy, nats.started, now) {
            Verdict::Restart { delay, restarts_in_window } => {
                nats.restart_at = Some(now + delay);
                console.say(&format!(
                    "nats-server (started by jetrl run) {}; restarting it on port {} with its store in {:.1}s",
                    failure(&status),
                    nats.server.port(),
                    delay.as_secs_f64()
                ));
                journal.record(
                    "exit",
                    json!({"service": "nats-server", "status": status, "action": "restart",
                           "delay_s": delay.as_secs_f64(), "restarts_in_window": restarts_in_window}),
                );
                Ok(())
            }
            Verdict::CrashLoop { restarts } => {
                let log = nats.server.log_path();
                console.say(&format!(
                    "nats-server is crash-looping: it {} after {restarts} restarts; the last lines of {}:\n{}",
                    failure(&status),
                    log.display(),
                    supervisor::log_tail(&log, supervisor::LOG_TAIL_LINES)
                ));
                journal.record("crash_loop", json!({"service": "nats-server", "status": status, "restarts": restarts}));
                Err(format!("nats-server is crash-looping ({status})"))
            }
        }
    }
}

/// Why a tracker of `trainer.logger` would record nothing: mlflow without an http(s):// `MLFLOW_TRACKING_URI`,
/// wandb without the package in the Python the trainer runs it with (`JETRL_PYTHON`, else `python3`).
fn tracker_warnings(cfg: &JobConfig) -> Vec<String> {
    use jetrl_config::Logger;
    let mut out = Vec::new();
    if cfg.trainer.logger.contains(&Logger::Mlflow) {
        match std::env::var("MLFLOW_TRACKING_URI") {
            Ok(uri) if jetrl_telemetry::http::HttpEndpoint::parse(uri.trim_end_matches('/')).is_ok() => {}
            Ok(uri) => out.push(format!(
                "trainer.logger has mlflow, but MLFLOW_TRACKING_URI {uri:?} is not the http:// or https:// address \
                 of an MLflow tracking server: nothing will reach MLflow"
            )),
            Err(_) => out.push(
                "trainer.logger has mlflow, but MLFLOW_TRACKING_URI is not set: nothing will reach MLflow".into(),
            ),
        }
    }
    if cfg.trainer.logger.contains(&Logger::Wandb) {
        let python = std::env::var("JETRL_PYTHON").ok().filter(|p| !p.is_empty()).unwrap_or_else(|| "python3".into());
        let found = std::process::Command::new(&python)
            .args(["-c", "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('wandb') else 1)"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !found {
            out.push(format!(
                "trainer.logger has wandb, but {python} cannot import the wandb package (pip install wandb, or set \
                 JETRL_PYTHON to a Python that has it): nothing will reach wandb"
            ));
        }
    }
    out
}

/// `HH:MM:SS` of a wall-clock time, in UTC.
fn utc_time(t: SystemTime) -> String {
    let secs = t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()) % 86_400;
    format!("{:02}:{:02}:{:02}", secs / 3600, secs / 60 % 60, secs % 60)
}

/// The name `CUDA_VISIBLE_DEVICES` gives the GPU libtorch sees as index `index` here: the entry of jetrl run's own
/// list when it has one, else the index.
fn physical_gpu(index: usize) -> String {
    std::env::var("CUDA_VISIBLE_DEVICES")
        .ok()
        .and_then(|list| list.split(',').map(str::trim).filter(|s| !s.is_empty()).nth(index).map(str::to_string))
        .unwrap_or_else(|| index.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_time_is_hours_minutes_seconds_of_the_day() {
        assert_eq!(utc_time(UNIX_EPOCH + Duration::from_secs(86_400 * 3 + 3600 * 13 + 60 * 5 + 9)), "13:05:09");
    }

    #[test]
    fn failures_read_as_sentences() {
        assert_eq!(failure("signal: 9 (SIGKILL)"), "was killed (signal: 9 (SIGKILL))");
        assert_eq!(failure("exit status: 1"), "exited with exit status: 1");
    }
}
