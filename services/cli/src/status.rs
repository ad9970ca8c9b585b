//! One file: one command, from what it reads to the report it prints.
//!
//! `jetrl status`: what an on-call engineer needs to know about a running job, read from NATS only (so the
//! read-only `status` identity suffices): the trainer's step, rate and reward (its heartbeat), every service's
//! health (heartbeats in the job's WORKERS bucket), groups by state and a staleness histogram (the replay
//! buffer's ledger), weight versions per worker, consumers that lag (JetStream consumer info), dead letters by
//! service (the job's DLQ stream, where it exists) and the replicas of each stream. `--json` prints the same as
//! one object; `--watch` refreshes.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::path::Path;
use std::time::Duration;

use futures::StreamExt;
use jetrl_bus::Bus;
use jetrl_config::{JobConfig, NatsConfig};
use jetrl_wire::subjects::{self, Names};
use jetrl_wire::v1::{GroupState, Heartbeat, LedgerRequest, LedgerResponse, WorkerState};
use jetrl_wire::{Message, ServiceKind};
use serde::Serialize;
use serde_json::json;

/// Whom to ask, and how to judge what they say.
pub struct Target {
    pub nats: NatsConfig,
    pub namespace: String,
    /// a heartbeat older than this is a dead service (`rollout.heartbeat_timeout_s`)
    pub heartbeat_timeout_s: f64,
}

/// NATS settings and the job's namespace from `file` (a job file, or one with only `nats:`; the file is typed as
/// a job file, so a misspelt key is an error, but not validated as one), `JETRL__NATS__*` and `key=value`
/// overrides; `--namespace` wins over the file's `nats.namespace` / `run.name`. A status gives up on an
/// unreachable server after 5 s, and on an unanswered request after 10 s, unless the configuration says otherwise.
pub fn target(file: Option<&Path>, overrides: &[String], namespace: Option<String>) -> anyhow::Result<Target> {
    let mut overrides = overrides.to_vec();
    let given = jetrl_config::load_value(file, &overrides)?;
    for (key, seconds) in [("connect_timeout_s", 5), ("request_timeout_s", 10)] {
        if given.pointer(&format!("/nats/{key}")).is_none() {
            overrides.push(format!("nats.{key}={seconds}"));
        }
    }
    let job: JobConfig = jetrl_config::load(file, &overrides)?;
    let namespace = match namespace {
        Some(ns) => ns,
        None => job.namespace()?.to_string(),
    };
    Ok(Target { heartbeat_timeout_s: job.rollout.heartbeat_timeout_s, nats: job.nats, namespace })
}

/// What `jetrl status` was asked for.
pub struct Options {
    /// the row ledger (`--ledger`): a table after the status, or only JSON lines with `json`
    pub ledger: bool,
    /// these groups' buffer entries (`--uid`)
    pub uids: Vec<String>,
    pub json: bool,
    /// refresh every this many seconds until interrupted
    pub watch: Option<f64>,
}

/// Ledger entries asked for: enough for the staleness histogram of any job that fits the buffer's memory.
const LEDGER_LIMIT: u32 = 1_000_000;

pub async fn status(target: &Target, options: Options) -> anyhow::Result<()> {
    let names = Names::new(&target.namespace).map_err(|e| anyhow::anyhow!("--namespace: {e}"))?;
    let bus = Bus::connect(&target.nats, &names, "jetrl-status").await?;
    let Some(period) = options.watch else {
        if options.ledger && options.json {
            return crate::ledger::print(&bus, true).await;
        }
        let snapshot = snapshot(&bus, target, &options).await?;
        print(&snapshot, &options);
        if options.ledger {
            crate::ledger::print(&bus, false).await?;
        }
        return Ok(());
    };
    let period = Duration::from_secs_f64(period.max(0.2));
    let clear = std::io::stdout().is_terminal() && !options.json;
    loop {
        let taken = snapshot(&bus, target, &options).await;
        if clear {
            print!("\x1b[2J\x1b[H");
        }
        match taken {
            Ok(snapshot) => print(&snapshot, &options),
            // the server may be failing over: say so and try again
            Err(err) if options.json => println!("{}", json!({ "job": target.namespace, "error": err.to_string() })),
            Err(err) => println!("job {}: {err:#}", target.namespace),
        }
        tokio::select! {
            _ = tokio::time::sleep(period) => {}
            _ = tokio::signal::ctrl_c() => return Ok(()),
        }
    }
}

fn print(snapshot: &Snapshot, options: &Options) {
    if options.json {
        // one line per snapshot: `--json --watch` is a JSON-lines stream
        println!("{}", serde_json::to_string(snapshot).unwrap_or_default());
    } else {
        print!("{}", render(snapshot));
    }
}

/// Everything `jetrl status` shows (`--json` prints it as one object).
#[derive(Debug, Serialize)]
struct Snapshot {
    job: String,
    server: String,
    unix_ms: i64,
    trainer: Option<TrainerView>,
    weights: Option<WeightsView>,
    services: Vec<ServiceView>,
    health: Health,
    /// groups by state (null when the replay buffer did not answer)
    groups: Option<BTreeMap<String, u64>>,
    staleness: Option<Staleness>,
    buffer_error: Option<String>,
    /// rollout workers by the weight version they hold
    weight_versions: BTreeMap<u64, Vec<String>>,
    consumers: Vec<ConsumerView>,
    dead_letters: DeadLetters,
    streams: Vec<StreamView>,
    /// the buffer entries of the groups asked for with `--uid`
    #[serde(skip_serializing_if = "Option::is_none")]
    ledger: Option<Vec<EntryView>>,
}

#[derive(Debug, Serialize)]
struct TrainerView {
    instance: String,
    step: u64,
    total_steps: u64,
    step_seconds: f64,
    steps_per_s: f64,
    /// null before the first step (NaN is not JSON)
    reward: Option<f64>,
    seen_s_ago: f64,
    /// the trainer ranks heard from within the heartbeat timeout
    ranks: Vec<String>,
}

#[derive(Debug, Serialize)]
struct WeightsView {
    version: u64,
    step: u64,
    tensors: usize,
    bytes: u64,
    location: String,
}

#[derive(Debug, Serialize)]
struct ServiceView {
    service: String,
    instance: String,
    host: String,
    pid: u32,
    state: &'static str,
    seen_s_ago: f64,
    healthy: bool,
    message: String,
    /// rollout workers only
    #[serde(skip_serializing_if = "Option::is_none")]
    policy_version: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    inflight: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tokens_per_s: Option<f64>,
}

#[derive(Debug, Serialize)]
struct Health {
    ok: bool,
    problems: Vec<String>,
}

#[derive(Debug, Serialize)]
struct Staleness {
    current_step: u64,
    /// groups not trained yet, by how many steps ago they were submitted
    not_trained: BTreeMap<u64, u64>,
    /// trained groups, by how many steps after their submission they were trained
    trained: BTreeMap<u64, u64>,
}

#[derive(Debug, Serialize)]
struct ConsumerView {
    stream: String,
    consumer: String,
    #[serde(flatten)]
    info: Answer<ConsumerStats>,
}

#[derive(Debug, Serialize)]
struct ConsumerStats {
    num_pending: u64,
    num_ack_pending: usize,
    num_redelivered: usize,
    num_waiting: usize,
    lagging: bool,
}

/// What the broker answered about one stream or consumer: its figures, or why there are none.
#[derive(Debug, Serialize)]
#[serde(untagged)]
enum Answer<T> {
    Ok(T),
    Err { error: String },
}

#[derive(Debug, Serialize)]
struct DeadLetters {
    stream: String,
    exists: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    by_service: Option<BTreeMap<String, u64>>,
}

#[derive(Debug, Serialize)]
struct StreamView {
    stream: String,
    #[serde(flatten)]
    info: Answer<StreamStats>,
}

#[derive(Debug, Serialize)]
struct StreamStats {
    messages: u64,
    bytes: u64,
    replicas: usize,
    leader: Option<String>,
    /// the leader plus the followers that are up to date
    current_replicas: usize,
}

#[derive(Debug, Serialize)]
struct EntryView {
    uid: String,
    partition: String,
    state: &'static str,
    submit_step: u64,
    sampled_step: u64,
    trajectories: u32,
    /// why it was evicted (`off_policy`, `rolled_back`, ...; empty unless evicted)
    eviction: &'static str,
    /// the eviction with its detail, as a person reads it
    evicted_reason: String,
}

/// Everything `jetrl status` shows.
async fn snapshot(bus: &Bus, target: &Target, options: &Options) -> anyhow::Result<Snapshot> {
    let names = bus.names();
    let js = bus.jetstream();
    // Looking a job up must not declare one: a mistyped namespace would leave empty buckets behind.
    if js.get_stream(names.prompts_stream()).await.is_err() {
        let mut jobs = Vec::new();
        let mut streams = js.stream_names();
        while let Some(Ok(stream)) = streams.next().await {
            jobs.extend(subjects::job_of_prompts_stream(&stream).map(str::to_string));
        }
        jobs.sort();
        anyhow::bail!(
            "no job {:?} at {} (no stream {}); jobs there: {jobs:?}",
            names.namespace(),
            target.nats.url,
            names.prompts_stream()
        );
    }
    let now = jetrl_wire::now_unix_ms();
    let beats = heartbeats(bus).await?;
    // with several trainer ranks each beats (instance `rank-<r>`); rank 0's carries the step
    let trainer_beats: Vec<&Heartbeat> = beats.iter().filter(|b| b.service == ServiceKind::Trainer.as_str()).collect();
    let trainer = trainer_beats
        .iter()
        .copied()
        .filter(|b| !b.instance_id.starts_with("rank-") || b.instance_id == "rank-0")
        .max_by_key(|b| b.unix_ms);
    let ranks: Vec<String> = trainer_beats
        .iter()
        .filter(|b| b.state != WorkerState::Stopped as i32 && seen_s_ago(b, now) <= target.heartbeat_timeout_s)
        .map(|b| b.instance_id.clone())
        .collect();
    let weights = bus.latest_manifest().await?;

    let request = LedgerRequest { partition: String::new(), uids: options.uids.clone(), limit: LEDGER_LIMIT };
    // a job whose replay buffer is down (or hung) still shows everything else: what the broker holds is what
    // tells why a job stands still
    let asked: Result<LedgerResponse, _> = bus.request(names.buffer_ledger(), &request, bus.request_timeout()).await;
    let (ledger, buffer_error) = match asked {
        Ok(ledger) if ledger.error.is_empty() => (ledger, None),
        Ok(ledger) => (LedgerResponse::default(), Some(format!("replay buffer: {}", ledger.error))),
        Err(err) => (LedgerResponse::default(), Some(format!("replay buffer not answering: {err}"))),
    };
    if let (Some(err), false) = (&buffer_error, options.uids.is_empty()) {
        anyhow::bail!("{err}");
    }
    let current_step = trainer
        .map(|t| t.step)
        .filter(|&s| s > 0)
        .unwrap_or_else(|| ledger.entries.iter().map(|e| e.sampled_step).max().unwrap_or(0));

    let entries = (!options.uids.is_empty()).then(|| {
        ledger
            .entries
            .iter()
            .map(|e| EntryView {
                uid: e.uid.clone(),
                partition: e.partition.clone(),
                state: GroupState::try_from(e.state).map(|s| s.label()).unwrap_or("?"),
                submit_step: e.submit_step,
                sampled_step: e.sampled_step,
                trajectories: e.trajectories,
                eviction: if e.state == GroupState::Evicted as i32 { e.eviction().label() } else { "" },
                evicted_reason: if e.state == GroupState::Evicted as i32 {
                    e.eviction().describe(&e.evicted_reason)
                } else {
                    String::new()
                },
            })
            .collect()
    });
    Ok(Snapshot {
        job: names.namespace().to_string(),
        server: target.nats.url.clone(),
        unix_ms: now,
        trainer: trainer.map(|t| trainer_view(t, now, ranks)),
        weights: weights.map(|m| WeightsView {
            version: m.version,
            step: m.step,
            tensors: m.tensors.len(),
            bytes: m.total_bytes,
            location: m.location,
        }),
        services: beats.iter().map(|b| service_view(b, now, target.heartbeat_timeout_s)).collect(),
        health: health(&beats, now, target.heartbeat_timeout_s),
        groups: buffer_error.is_none().then(|| ledger.counts.iter().map(|(k, v)| (k.clone(), *v)).collect()),
        staleness: buffer_error.is_none().then(|| staleness(&ledger, current_step)),
        buffer_error,
        weight_versions: weight_versions(&beats),
        consumers: consumers(bus).await,
        dead_letters: dead_letters(bus).await,
        streams: streams(bus).await,
        ledger: entries,
    })
}

/// Every decodable heartbeat in the job's WORKERS bucket, by key.
async fn heartbeats(bus: &Bus) -> anyhow::Result<Vec<Heartbeat>> {
    let kv = bus.key_value(bus.names().workers_bucket()).await?;
    let mut keys = kv.keys().await?;
    let mut beats = Vec::new();
    while let Some(Ok(key)) = keys.next().await {
        if let Ok(Some(value)) = kv.get(&key).await {
            if let Ok(beat) = Heartbeat::decode(value.as_ref()) {
                beats.push(beat);
            }
        }
    }
    beats.sort_by(|a, b| (&a.service, &a.instance_id).cmp(&(&b.service, &b.instance_id)));
    Ok(beats)
}

fn seen_s_ago(beat: &Heartbeat, now: i64) -> f64 {
    (now - beat.unix_ms).max(0) as f64 / 1000.0
}

fn trainer_view(beat: &Heartbeat, now: i64, ranks: Vec<String>) -> TrainerView {
    TrainerView {
        instance: beat.instance_id.clone(),
        step: beat.step,
        total_steps: beat.total_steps,
        step_seconds: beat.step_seconds,
        steps_per_s: if beat.step_seconds > 0.0 { 1.0 / beat.step_seconds } else { 0.0 },
        reward: (beat.reward.is_finite() && beat.step > 0).then_some(beat.reward),
        seen_s_ago: seen_s_ago(beat, now),
        ranks,
    }
}

/// Why a heartbeat says its service is not healthy, if it does.
fn problem(beat: &Heartbeat, now: i64, timeout_s: f64) -> Option<String> {
    let state = WorkerState::try_from(beat.state).unwrap_or(WorkerState::Unspecified);
    let who = format!("{}.{}", beat.service, beat.instance_id);
    let age = seen_s_ago(beat, now);
    if age > timeout_s {
        Some(format!("{who}: last heartbeat {age:.1}s ago (more than rollout.heartbeat_timeout_s = {timeout_s}s)"))
    } else if matches!(state, WorkerState::LoadFailed | WorkerState::Stopped) {
        let why = if beat.message.is_empty() { String::new() } else { format!(": {}", beat.message) };
        Some(format!("{who}: {}{why}", state.label()))
    } else {
        None
    }
}

fn service_view(beat: &Heartbeat, now: i64, timeout_s: f64) -> ServiceView {
    let state = WorkerState::try_from(beat.state).unwrap_or(WorkerState::Unspecified);
    let rollout = beat.service == ServiceKind::Rollout.as_str();
    ServiceView {
        service: beat.service.clone(),
        instance: beat.instance_id.clone(),
        host: beat.host.clone(),
        pid: beat.pid,
        state: state.label(),
        seen_s_ago: seen_s_ago(beat, now),
        healthy: problem(beat, now, timeout_s).is_none(),
        message: beat.message.clone(),
        policy_version: rollout.then_some(beat.policy_version),
        inflight: rollout.then_some(beat.inflight),
        tokens_per_s: rollout.then_some(beat.tokens_per_s),
    }
}

fn health(beats: &[Heartbeat], now: i64, timeout_s: f64) -> Health {
    let mut problems: Vec<String> = beats.iter().filter_map(|b| problem(b, now, timeout_s)).collect();
    // every job runs each kind: a missing heartbeat of one is a problem
    for service in ServiceKind::ALL.map(ServiceKind::as_str) {
        if !beats.iter().any(|b| b.service == service) {
            problems.push(format!("{service}: no heartbeat (not running, or dead for more than 15 s)"));
        }
    }
    Health { ok: problems.is_empty(), problems }
}

/// How many steps old each group's prompt is: for groups not trained yet, the current step minus the step it was
/// submitted at; for trained groups, the step that trained it minus that.
fn staleness(ledger: &LedgerResponse, current_step: u64) -> Staleness {
    let mut not_trained: BTreeMap<u64, u64> = BTreeMap::new();
    let mut trained: BTreeMap<u64, u64> = BTreeMap::new();
    for entry in &ledger.entries {
        match GroupState::try_from(entry.state) {
            Ok(GroupState::Sampled) => {
                *trained.entry(entry.sampled_step.saturating_sub(entry.submit_step)).or_default() += 1;
            }
            Ok(GroupState::Pending | GroupState::Running | GroupState::Finished) => {
                *not_trained.entry(current_step.saturating_sub(entry.submit_step)).or_default() += 1;
            }
            _ => {}
        }
    }
    Staleness { current_step, not_trained, trained }
}

/// Which rollout workers hold which weight version.
fn weight_versions(beats: &[Heartbeat]) -> BTreeMap<u64, Vec<String>> {
    let mut versions: BTreeMap<u64, Vec<String>> = BTreeMap::new();
    for beat in beats.iter().filter(|b| b.service == ServiceKind::Rollout.as_str()) {
        versions.entry(beat.policy_version).or_default().push(beat.instance_id.clone());
    }
    versions
}

/// The work-sharing consumers: what waits for an instance (`num_pending`) and what instances hold unacknowledged
/// (`num_ack_pending`). A consumer lags when work waits for it.
async fn consumers(bus: &Bus) -> Vec<ConsumerView> {
    let names = bus.names();
    let mut out = Vec::new();
    for (stream, durable) in
        [(names.prompts_stream(), subjects::ROLLOUT_CONSUMER), (names.score_stream(), subjects::REWARD_CONSUMER)]
    {
        let info = match bus.stream(stream).await {
            Ok(stream) => stream.consumer_info(durable).await.map_err(|e| e.to_string()),
            Err(err) => Err(err.to_string()),
        };
        out.push(ConsumerView {
            stream: stream.to_string(),
            consumer: durable.to_string(),
            info: match info {
                Ok(info) => Answer::Ok(ConsumerStats {
                    num_pending: info.num_pending,
                    num_ack_pending: info.num_ack_pending,
                    num_redelivered: info.num_redelivered,
                    num_waiting: info.num_waiting,
                    lagging: info.num_pending > 0,
                }),
                Err(error) => Answer::Err { error },
            },
        });
    }
    out
}

/// Messages the services refused and set aside, by service (the job's DLQ stream, `jetrl.<ns>.dlq.<service>`).
async fn dead_letters(bus: &Bus) -> DeadLetters {
    let names = bus.names();
    let mut view = DeadLetters { stream: names.dlq_stream().to_string(), exists: false, error: None, by_service: None };
    let Ok(stream) = bus.jetstream().get_stream(names.dlq_stream()).await else {
        return view;
    };
    view.exists = true;
    let prefix = names.dlq_subject("");
    let mut by_service: BTreeMap<String, u64> = BTreeMap::new();
    match stream.info_with_subjects(format!("{prefix}>")).await {
        Ok(mut subjects) => {
            while let Some(Ok((subject, count))) = subjects.next().await {
                let service = subject.strip_prefix(&prefix).unwrap_or(&subject).to_string();
                *by_service.entry(service).or_default() += count as u64;
            }
            view.by_service = Some(by_service);
        }
        Err(err) => view.error = Some(err.to_string()),
    }
    view
}

/// Messages, leader and replicas of each of the job's streams (a cluster's health at a glance).
async fn streams(bus: &Bus) -> Vec<StreamView> {
    let names = bus.names();
    let mut out = Vec::new();
    let streams = [
        names.prompts_stream().to_string(),
        names.traj_stream().into(),
        names.score_stream().into(),
        names.rewards_stream().into(),
        names.dlq_stream().into(),
        names.ledger_stream().into(),
        format!("KV_{}", names.groups_bucket()),
        format!("KV_{}", names.weights_bucket()),
        format!("KV_{}", names.workers_bucket()),
        format!("KV_{}", names.lease_bucket()),
        format!("OBJ_{}", names.blobs_store()),
    ];
    for name in streams {
        let info = match bus.jetstream().get_stream(&name).await {
            Ok(stream) => {
                let info = stream.cached_info();
                let cluster = info.cluster.clone().unwrap_or_default();
                let current = cluster.replicas.iter().filter(|p| p.current && !p.offline).count();
                Answer::Ok(StreamStats {
                    messages: info.state.messages,
                    bytes: info.state.bytes,
                    replicas: info.config.num_replicas.max(1),
                    current_replicas: usize::from(cluster.leader.is_some()) + current,
                    leader: cluster.leader,
                })
            }
            Err(err) => Answer::Err { error: err.to_string() },
        };
        out.push(StreamView { stream: name, info });
    }
    out
}

/// The text form of a snapshot.
fn render(s: &Snapshot) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(out, "job: {}  ({})", s.job, s.server);
    match &s.trainer {
        None => {
            let _ = writeln!(out, "trainer: no heartbeat");
        }
        Some(t) => {
            let reward = t.reward.map_or("-".to_string(), |r| format!("{r:.3}"));
            let ranks = if t.ranks.len() > 1 { format!("  ranks {}", t.ranks.len()) } else { String::new() };
            let _ = writeln!(
                out,
                "trainer: step {}/{}  {:.2} steps/s ({:.1} s/step)  reward {reward}{ranks}",
                t.step, t.total_steps, t.steps_per_s, t.step_seconds
            );
        }
    }
    match &s.weights {
        None => {
            let _ = writeln!(out, "weights: no version announced yet");
        }
        Some(w) => {
            let _ = writeln!(
                out,
                "weights: version {} (step {}, {} tensors, {} bytes at {})",
                w.version, w.step, w.tensors, w.bytes, w.location
            );
        }
    }
    if s.health.ok {
        let _ = writeln!(out, "health: ok");
    } else {
        let _ = writeln!(out, "health: PROBLEMS");
        for p in &s.health.problems {
            let _ = writeln!(out, "  - {p}");
        }
    }
    if let Some(err) = &s.buffer_error {
        let _ = writeln!(out, "groups and staleness unknown: {err}");
    }
    let _ = writeln!(out, "services:");
    for v in &s.services {
        let version = v.policy_version.map(|p| format!("v{p}")).unwrap_or_default();
        let inflight = v.inflight.map(|i| format!("inflight {i}")).unwrap_or_default();
        let _ = writeln!(
            out,
            "  {:<10} {:<28} {:<11} seen {:>5.1}s ago  {:<6} {:<12} {}",
            v.service, v.instance, v.state, v.seen_s_ago, version, inflight, v.message
        );
    }
    let groups: Vec<String> = s.groups.iter().flatten().map(|(state, n)| format!("{state} {n}")).collect();
    let _ = writeln!(out, "groups: {}", if groups.is_empty() { "none".into() } else { groups.join(", ") });
    let histogram = |h: &BTreeMap<u64, u64>| -> String {
        let bins: Vec<String> = h.iter().map(|(age, n)| format!("{age}: {n}")).collect();
        if bins.is_empty() {
            "-".into()
        } else {
            bins.join("  ")
        }
    };
    let empty = BTreeMap::new();
    let (current, not_trained, trained) = match &s.staleness {
        Some(st) => (st.current_step.to_string(), &st.not_trained, &st.trained),
        None => ("null".to_string(), &empty, &empty),
    };
    let _ = writeln!(out, "staleness (steps behind step {current}):");
    let _ = writeln!(out, "  not trained yet: {}", histogram(not_trained));
    let _ = writeln!(out, "  trained:         {}", histogram(trained));
    let versions: Vec<String> =
        s.weight_versions.iter().map(|(v, workers)| format!("v{v}: {}", workers.join(" "))).collect();
    let _ = writeln!(out, "weight versions: {}", if versions.is_empty() { "-".into() } else { versions.join("; ") });
    let _ = writeln!(out, "consumers:");
    for c in &s.consumers {
        let name = format!("{}/{}", c.stream, c.consumer);
        match &c.info {
            Answer::Err { error } => {
                let _ = writeln!(out, "  {name}: {error}");
            }
            Answer::Ok(info) => {
                let lag = if info.lagging { "  LAGGING" } else { "" };
                let _ = writeln!(
                    out,
                    "  {name:<40} pending {:<6} ack pending {:<6} redelivered {:<6}{lag}",
                    info.num_pending, info.num_ack_pending, info.num_redelivered
                );
            }
        }
    }
    let dl = &s.dead_letters;
    let dead = if !dl.exists {
        format!("no dead-letter stream {}", dl.stream)
    } else if let Some(err) = &dl.error {
        err.clone()
    } else {
        let by: Vec<String> = dl.by_service.iter().flatten().map(|(svc, n)| format!("{svc} {n}")).collect();
        if by.is_empty() {
            "none".into()
        } else {
            by.join(", ")
        }
    };
    let _ = writeln!(out, "malformed messages set aside: {dead}");
    let _ = writeln!(out, "streams:");
    for st in &s.streams {
        match &st.info {
            Answer::Err { error } => {
                let _ = writeln!(out, "  {:<28} {error}", st.stream);
            }
            Answer::Ok(info) => {
                let _ = writeln!(
                    out,
                    "  {:<28} {:>8} msgs  replicas {}/{}  leader {}",
                    st.stream,
                    info.messages,
                    info.current_replicas,
                    info.replicas,
                    info.leader.as_deref().unwrap_or("-")
                );
            }
        }
    }
    if let Some(entries) = &s.ledger {
        let _ = writeln!(
            out,
            "{:<38} {:<6} {:<9} {:>6} {:>8} {:>5}  reason",
            "uid", "part", "state", "submit", "trained", "trajs"
        );
        for e in entries {
            let trained = if e.sampled_step > 0 { e.sampled_step.to_string() } else { "-".into() };
            let _ = writeln!(
                out,
                "{:<38} {:<6} {:<9} {:>6} {:>8} {:>5}  {}",
                e.uid, e.partition, e.state, e.submit_step, trained, e.trajectories, e.evicted_reason
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use jetrl_wire::v1::LedgerEntry;

    fn beat(service: &str, instance: &str, age_ms: i64, state: WorkerState) -> Heartbeat {
        Heartbeat {
            service: service.into(),
            instance_id: instance.into(),
            unix_ms: 1_000_000 - age_ms,
            state: state as i32,
            ..Default::default()
        }
    }

    #[test]
    fn health_names_stale_failed_and_missing_services() {
        let now = 1_000_000;
        let beats = [
            beat("trainer", "t", 100, WorkerState::Ready),
            beat("rollout", "w0", 100, WorkerState::Ready),
            beat("rollout", "w1", 9_000, WorkerState::Ready),
            beat("reward", "r0", 100, WorkerState::LoadFailed),
            beat("buffer", "b", 100, WorkerState::Ready),
        ];
        let h = health(&beats, now, 5.0);
        assert!(!h.ok);
        let problems = &h.problems;
        assert_eq!(problems.len(), 3, "{problems:?}");
        assert!(problems[0].starts_with("rollout.w1: last heartbeat 9.0s ago"), "{problems:?}");
        assert!(problems[1].starts_with("reward.r0: load_failed"), "{problems:?}");
        assert!(problems[2].starts_with("checkpoint: no heartbeat"), "{problems:?}");
        let all = [beats[0].clone(), beats[1].clone(), beats[4].clone(), beat("reward", "r", 0, WorkerState::Ready)];
        let all = [&all[..], &[beat("checkpoint", "c", 0, WorkerState::Ready)]].concat();
        assert!(health(&all, now, 5.0).ok);
    }

    /// `--json` keeps its shape: a stream's figures or its error beside its name, rollout-only keys only on
    /// rollout workers.
    #[test]
    fn the_json_snapshot_has_flat_answers_and_rollout_only_keys_on_workers() {
        let stream = StreamView {
            stream: "S".into(),
            info: Answer::Ok(StreamStats { messages: 3, bytes: 9, replicas: 1, leader: None, current_replicas: 0 }),
        };
        assert_eq!(
            serde_json::to_value(&stream).unwrap(),
            json!({"stream": "S", "messages": 3, "bytes": 9, "replicas": 1, "leader": null, "current_replicas": 0})
        );
        let missing = StreamView { stream: "S".into(), info: Answer::Err { error: "gone".into() } };
        assert_eq!(serde_json::to_value(&missing).unwrap(), json!({"stream": "S", "error": "gone"}));
        let trainer =
            serde_json::to_value(service_view(&beat("trainer", "t", 0, WorkerState::Ready), 1_000_000, 5.0)).unwrap();
        assert!(trainer.get("policy_version").is_none() && trainer["healthy"] == true, "{trainer}");
        let worker =
            serde_json::to_value(service_view(&beat("rollout", "w", 0, WorkerState::Ready), 1_000_000, 5.0)).unwrap();
        assert_eq!(worker["policy_version"], 0, "{worker}");
    }

    #[test]
    fn staleness_counts_waiting_groups_against_the_current_step_and_trained_ones_against_their_step() {
        let entry = |state: GroupState, submit_step, sampled_step| LedgerEntry {
            state: state as i32,
            submit_step,
            sampled_step,
            ..Default::default()
        };
        let ledger = LedgerResponse {
            entries: vec![
                entry(GroupState::Sampled, 3, 3),
                entry(GroupState::Sampled, 3, 4),
                entry(GroupState::Sampled, 2, 4),
                entry(GroupState::Finished, 5, 0),
                entry(GroupState::Pending, 6, 0),
                entry(GroupState::Evicted, 1, 0),
            ],
            ..Default::default()
        };
        let s = serde_json::to_value(staleness(&ledger, 6)).unwrap();
        assert_eq!(s["trained"], json!({"0": 1, "1": 1, "2": 1}));
        assert_eq!(s["not_trained"], json!({"0": 1, "1": 1}));
    }
}
