//! `just bench soak`: the data plane under a steady load for a long time (10 minutes), watching every process's
//! memory and accounting for every group.
//!
//! - A real nats-server, and the real `jetrl-reward-service` and `jetrl-replay-buffer` binaries, each its own OS
//!   process (their resident memory is read from /proc).
//! - `SOAK_WORKERS` (8) stand-in rollout workers, each its own process (this binary run as `bench-soak worker`).
//!   A stand-in worker has a **fast stand-in generator**: it runs no model. It pulls prompt tasks from the PROMPTS
//!   stream as a rollout worker does (the shared `rollout-workers` consumer, `SOAK_WORKER_INFLIGHT` (4) groups at
//!   once), makes up each group's trajectories (synthetic token ids, `SOAK_PAYLOAD_BYTES` (4096) encoded bytes
//!   each, `SOAK_GROUP` (8) per group; the reverse task's answer, so the reward rule scores them) and writes them
//!   through the real data plane exactly as a worker does (`sim::produce_built`: running record, trajectories and
//!   score request, terminal record with the keys), then acknowledges the task. It reports each group it
//!   completed on its stdout.
//! - A sampling trainer stand-in, in this process: it submits groups as the trainer does (pending records, then
//!   prompt tasks), keeping at most workers × in-flight + 2 batches submitted and not yet trained, samples batches
//!   of `SOAK_BATCH_GROUPS` (16) groups from the buffer, fetches every payload from TRAJ (checking that each is
//!   the trajectory the buffer named) and releases each step, continuously. It trains no model.
//! - Paced: the trainer stand-in trains at most `SOAK_TRAJ_PER_S` (3000) trajectories per second (a step starts
//!   no sooner than its share of the run), below what this 2-core machine sustains in its slowest minutes
//!   (3,600–7,400 per minute were seen unpaced), so every minute carries the same load and memory growth measures
//!   what the processes keep, not how hard the machine could push that minute (the broker's de-duplication window
//!   holds one id per trajectory of the last minute). `SOAK_TRAJ_PER_S=0`: as fast as it goes.
//! - Every `SOAK_REPORT_S` (60) seconds one line: trajectories per second trained (and produced) in that interval
//!   and every process's RSS.
//! - After `SOAK_MINUTES` (10; `SOAK_SECONDS` wins when set) no more groups are submitted; the trainer trains
//!   what is still coming (60 s at most), the workers are stopped, then every group is accounted for:
//!   `lost`: completed by a worker and never trained, or trained with a payload missing or not its own;
//!   `duplicated`: trained (or completed) more than once; `in_flight`: submitted and neither completed nor
//!   trained when the drain ended (0 unless the drain timed out).
//! - RSS growth: every process's RSS is read every second; the growth of its highest reading in the interval (its
//!   peak), from the first interval to the last, per process, in percent (`rss_growth_pct`) and MiB
//!   (`rss_growth_mib`); `rollout-worker` is the largest growth among the workers. A process whose memory grows
//!   has a growing peak; a garbage-collected one (the broker) moves through a band below its peak all the time
//!   (from 149 to 169 MiB within one minute), so one reading at each interval's end says where in the band it
//!   fell: that reading's growth is printed beside (`rss_end_growth_pct`, a diagnostic). The
//!   trainer stand-in is reported apart (`harness_rss_growth_pct`): it holds the soak's own ledger of every group,
//!   which grows with the run by design. Note: every binary of the jetrl-tests package links libtorch (with CUDA
//!   where the wheel has it), so a stand-in worker's RSS starts at a few hundred MiB, most of it libtorch's.
//!
//! - RSS trend (`rss_trend_pct_per_10min`, a diagnostic beside the target): per process, the least-squares slope
//!   through every reading after the first interval, in percent of their mean per 10 minutes, so one reading
//!   taken at a peak or a trough of a garbage-collected heap does not decide whether memory rises.
//!
//! - The broker's live heap (Go's heap right after a collection, from nats-server's profiling port) at each
//!   report, beside its RSS: RSS also holds the garbage Go's collector lets pile up between collections, so bounded
//!   state shows flat in the live heap first (`live_heap_growth_pct`, `nats_live_heap_mib`).
//!
//! - The services' heap in use (`jetrl_process_heap_in_use_bytes` from their `/metrics`: what malloc has handed
//!   out and not had back) at each report, beside their RSS (`heap_in_use_mib`, `heap_in_use_growth_pct`): a
//!   live heap that grows shows there; RSS rising while it stays flat is the allocator's memory (fragmentation).
//!
//! - The broker runs under `GOMEMLIMIT` (`SOAK_NATS_GOMEMLIMIT`, default [`NATS_MEMORY_LIMIT`]; `off`: none), as
//!   docs/operations.md has a deployment run it (`nats_gomemlimit`), with Go's default `GOGC` unless
//!   `SOAK_NATS_GOGC` sets one (`nats_gogc`; `off` only with a limit); each process's CPU seconds over the run
//!   (`cpu_s`, the workers summed) show what the collector's work costs.
//!
//! Last line: `{"bench":"soak","minutes":…,"traj_per_s":…,"rss_growth_pct":{…},"lost":…,"duplicated":…,…}`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{BufRead, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use jetrl_bus::{consume, Bus, GroupStore, NatsServer};
use jetrl_tests::bench::{self, connect, knob};
use jetrl_tests::sim::{self, GroupSpec};
use jetrl_wire::subjects;
use jetrl_wire::v1::{PromptTask, SampleRequest, Trajectory};
use jetrl_wire::Message;

/// How long the trainer keeps training after the clock ran out, for what is still in flight.
const DRAIN: Duration = Duration::from_secs(60);
/// A stand-in worker's ack wait on the PROMPTS consumer: its groups take milliseconds.
const ACK_WAIT: Duration = Duration::from_secs(30);
/// RSS growth after the first interval that the issue allows, in percent.
const GROWTH_LIMIT_PCT: f64 = 5.0;
/// How often every process's RSS is read within an interval (for its peak).
const RSS_EVERY: Duration = Duration::from_secs(1);
/// The broker's `GOMEMLIMIT` unless `SOAK_NATS_GOMEMLIMIT` says otherwise (`off`: none). Go collects when its
/// heap reaches twice what the last collection kept, so without a limit the broker's RSS follows the highest
/// live heap it has had (the ids of the one-minute duplicate window, the stores' block buffers) doubled, and
/// rises for minutes after the first. A limit about 1.5× that peak, as a deployment sets one (docs/operations.md,
/// "The broker's memory", with the measurements), keeps the collector ahead of it. One reading at a minute's end
/// says only where in the collector's band it fell, so the growth judged is the peak's.
const NATS_MEMORY_LIMIT: &str = "160MiB";

fn main() {
    let mut args = std::env::args().skip(1);
    if args.next().as_deref() == Some("worker") {
        let url = args.next().expect("bench-soak worker <nats url> <index>");
        let index: usize = args.next().and_then(|i| i.parse().ok()).expect("bench-soak worker <nats url> <index>");
        // one thread: a stand-in worker's work is a few KV writes and publishes per group
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        runtime.block_on(worker(&url, index));
    } else {
        let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("runtime");
        runtime.block_on(soak());
    }
}

/// The soak's knobs (environment), shared by the parent and the stand-in workers it starts (they inherit it).
#[derive(Debug, Clone)]
struct Knobs {
    seconds: f64,
    report_s: f64,
    workers: usize,
    worker_inflight: usize,
    group: usize,
    payload: usize,
    batch: usize,
    /// trajectories per second the trainer stand-in trains at most (0: as fast as the data plane goes)
    pace: f64,
    /// the broker's `GOMEMLIMIT` (Go's soft memory limit), as a deployment sets it; None: Go's default (none)
    nats_memory_limit: Option<String>,
    /// the broker's `GOGC`; None: Go's default (100)
    nats_gogc: Option<String>,
}

impl Knobs {
    fn from_env() -> Self {
        let minutes: f64 = knob("SOAK_MINUTES", 10.0);
        let nats_memory_limit = Some(knob("SOAK_NATS_GOMEMLIMIT", NATS_MEMORY_LIMIT.to_string()))
            .filter(|limit| !limit.is_empty() && limit != "off");
        let nats_gogc = Some(knob("SOAK_NATS_GOGC", String::new())).filter(|gogc| !gogc.is_empty());
        assert!(
            !(nats_gogc.as_deref() == Some("off") && nats_memory_limit.is_none()),
            "SOAK_NATS_GOGC=off needs a SOAK_NATS_GOMEMLIMIT: without a memory limit the broker would never collect"
        );
        Self {
            seconds: knob("SOAK_SECONDS", minutes * 60.0),
            report_s: knob("SOAK_REPORT_S", 60.0),
            workers: knob("SOAK_WORKERS", 8),
            worker_inflight: knob("SOAK_WORKER_INFLIGHT", 4),
            group: knob("SOAK_GROUP", 8),
            payload: knob("SOAK_PAYLOAD_BYTES", 4096),
            batch: knob("SOAK_BATCH_GROUPS", 16),
            pace: knob("SOAK_TRAJ_PER_S", 3000.0),
            nats_memory_limit,
            nats_gogc,
        }
    }
}

/// Group uids are `soak<n>`: the ledger keys them by `n`.
fn uid_of(n: u64) -> String {
    format!("soak{n}")
}

fn number_of(uid: &str) -> Option<u64> {
    uid.strip_prefix("soak").and_then(|n| n.parse().ok())
}

/// The spec of a group: `group` trajectories of `payload` encoded bytes, answered as the reverse rule wants.
fn spec(uid: &str, partition: &str, submit_step: u64, group: usize, payload: usize) -> GroupSpec {
    let mut spec = GroupSpec::finished(uid, submit_step, &vec![1.0; group]);
    spec.partition = partition.into();
    spec.payload_bytes = payload;
    spec.data_source = "jetrl/reverse".into();
    spec
}

// ---------------------------------------------------------------------------------------------------------------
// The stand-in rollout worker (a process of its own)
// ---------------------------------------------------------------------------------------------------------------

/// A stand-in rollout worker: pulls prompt tasks as a rollout worker does and completes each with the stand-in
/// generator, until its stdin closes (the parent's stop), then finishes the groups it holds.
async fn worker(url: &str, index: usize) {
    let knobs = Knobs::from_env();
    let (bus, groups) = connect(url, &format!("soak-rollout-worker-{index}")).await;
    let consumer = bus
        .shared_pull_consumer(
            bus.names().prompts_stream(),
            subjects::ROLLOUT_CONSUMER,
            &bus.names().prompts_filter(),
            ACK_WAIT,
            100_000,
        )
        .await
        .expect("prompts consumer");
    let (stop_tx, mut stop) = tokio::sync::watch::channel(false);
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink());
        let _ = stop_tx.send(true);
    });
    let mut tasks = tokio::task::JoinSet::new();
    while !*stop.borrow() {
        while tasks.try_join_next().is_some() {}
        let free = knobs.worker_inflight.max(1).saturating_sub(tasks.len());
        if free == 0 {
            tokio::select! {
                _ = stop.changed() => {}
                _ = tasks.join_next() => {}
            }
            continue;
        }
        let batch = tokio::select! {
            _ = stop.changed() => break,
            batch = consume::pull(&consumer, free, Duration::from_millis(500)) => batch,
        };
        let mut batch = match batch {
            Ok(batch) => batch,
            Err(err) => {
                eprintln!("worker {index}: pull failed: {err}");
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        while let Some(Ok(msg)) = batch.next().await {
            tasks.spawn(complete_group(bus.clone(), groups.clone(), msg, knobs.payload));
        }
    }
    while tasks.join_next().await.is_some() {}
}

/// One prompt task, end to end, as a rollout worker handles it, with the stand-in generator in place of the
/// model. Prints `done <uid> <trajectories>` once the group's terminal record is written (before the task's
/// ack); a redelivered task whose group is already terminal prints `redelivered <uid>` and is acknowledged.
async fn complete_group(bus: Bus, groups: GroupStore, msg: async_nats::jetstream::Message, payload: usize) {
    let Some(task) = consume::decode_or_term::<PromptTask>(&msg, "soak-rollout-worker").await else { return };
    let spec = spec(&task.uid, &task.partition, task.submit_step, task.n as usize, payload);
    // the stand-in generator: synthetic trajectories, no model
    let trajectories: Vec<Trajectory> = (0..spec.scores.len()).map(|session| sim::trajectory(&spec, session)).collect();
    match sim::produce_built(&bus, &groups, &spec, None, &trajectories).await {
        Ok(_) => {
            report(&format!("done {} {}", spec.uid, trajectories.len()));
            let _ = consume::ack_confirmed(&msg).await;
        }
        Err(err) => {
            let terminal =
                matches!(groups.get(&spec.partition, &spec.uid).await, Ok(Some((s, _))) if s.state().is_terminal());
            if terminal {
                report(&format!("redelivered {}", spec.uid));
                consume::settle(&msg, async_nats::jetstream::AckKind::Ack).await;
            } else {
                eprintln!("group {}: {err}; handed back", spec.uid);
                report(&format!("error {}", spec.uid));
                consume::settle(&msg, async_nats::jetstream::AckKind::Nak(Some(Duration::from_secs(1)))).await;
            }
        }
    }
}

/// One line to the parent (stdout is the worker's report channel).
fn report(line: &str) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}").expect("report to the parent");
}

// ---------------------------------------------------------------------------------------------------------------
// The parent: services, workers, the sampling trainer stand-in, the report
// ---------------------------------------------------------------------------------------------------------------

/// Every group's fate, by uid number.
#[derive(Debug, Default)]
struct Ledger {
    submitted: u64,
    /// groups a worker reported complete, and how many times
    completed: HashMap<u64, u32>,
    completed_trajectories: u64,
    /// groups the trainer trained on, and how many times
    trained: HashMap<u64, u32>,
    trained_trajectories: u64,
    /// trained groups with a payload missing, not the trajectory named, or fewer trajectories than generated
    damaged: HashSet<u64>,
    redelivered: u64,
    worker_errors: u64,
}

impl Ledger {
    /// Completed by a worker, not trained yet.
    fn completed_untrained(&self) -> usize {
        self.completed.keys().filter(|n| !self.trained.contains_key(n)).count()
    }

    /// Submitted groups neither completed nor trained (uids are numbered 0..submitted).
    fn in_flight(&self) -> u64 {
        (0..self.submitted).filter(|n| !self.completed.contains_key(n) && !self.trained.contains_key(n)).count() as u64
    }

    fn record_worker_line(&mut self, line: &str) {
        let mut parts = line.split_whitespace();
        match (parts.next(), parts.next().and_then(number_of)) {
            (Some("done"), Some(n)) => {
                *self.completed.entry(n).or_insert(0) += 1;
                self.completed_trajectories += parts.next().and_then(|t| t.parse().ok()).unwrap_or(0);
            }
            (Some("redelivered"), Some(_)) => self.redelivered += 1,
            (Some("error"), Some(_)) => self.worker_errors += 1,
            _ => eprintln!("soak: unexpected worker line {line:?}"),
        }
    }
}

/// A process whose memory is watched.
struct Watched {
    name: String,
    pid: u32,
    /// its `/metrics` endpoint (the services): their heap in use is read there
    metrics: Option<std::net::SocketAddr>,
}

/// One interval's report.
struct Sample {
    /// trajectories trained since the start, at the end of the interval
    trained: u64,
    /// each process's RSS at the end of the interval
    rss: BTreeMap<String, u64>,
    /// each process's highest RSS in the interval (read every [`RSS_EVERY`])
    rss_peak: BTreeMap<String, u64>,
    /// CPU seconds each process has used since it started
    cpu_s: BTreeMap<String, f64>,
    /// nats-server's live heap in bytes ([`nats_live_heap`])
    nats_live_heap: Option<u64>,
    /// each service's heap in use, bytes ([`heap_in_use`]; those whose endpoint answered)
    heap_in_use: BTreeMap<String, u64>,
}

/// A service's heap in use (`jetrl_process_heap_in_use_bytes`) from its `/metrics`; None if unreadable.
async fn heap_in_use(addr: std::net::SocketAddr) -> Option<u64> {
    let body = tokio::time::timeout(Duration::from_secs(10), jetrl_telemetry::scrape(addr)).await.ok()?.ok()?;
    let line = body.lines().find(|l| l.starts_with(jetrl_telemetry::heap::IN_USE_METRIC))?;
    line.rsplit(' ').next()?.parse::<f64>().ok().map(|v| v as u64)
}

/// Starts `command` so that it dies with this process (the soak stopped or killed); called from the main thread.
fn spawn_tied(command: &mut Command) -> Child {
    jetrl_bus::harness::die_with_parent(command);
    command.spawn().unwrap_or_else(|e| panic!("starting {:?}: {e}", command.get_program()))
}

/// A service binary with the soak's job file; its log goes to `<dir>/<name>.log`.
fn spawn_service(dir: &std::path::Path, name: &str, binary: &str) -> Child {
    let log = std::fs::File::create(dir.join(format!("{name}.log"))).expect("log file");
    spawn_tied(
        Command::new(jetrl_tests::bin(binary))
            .arg("--config")
            .arg(dir.join("job.yaml"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log),
    )
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

fn growth_pct(first: u64, last: u64) -> f64 {
    if first == 0 {
        return f64::NAN;
    }
    round2((last as f64 - first as f64) / first as f64 * 100.0)
}

/// Per process, its highest RSS in an interval: of the readings through it and the one at its end.
fn interval_peaks(readings: &BTreeMap<String, Vec<u64>>, at_end: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    readings
        .iter()
        .map(|(name, r)| (name.clone(), r.iter().copied().chain(at_end.get(name).copied()).max().unwrap_or(0)))
        .collect()
}

/// Per process, the growth of `last` over `first` in percent and in MiB; the workers as one (`rollout-worker`,
/// the largest growth among them).
fn growth_by_process(
    first: &BTreeMap<String, u64>,
    last: &BTreeMap<String, u64>,
) -> (BTreeMap<String, f64>, BTreeMap<String, f64>) {
    let mut growth: BTreeMap<String, f64> = BTreeMap::new();
    let mut growth_mib: BTreeMap<String, f64> = BTreeMap::new();
    for (name, &before) in first {
        let after = last.get(name).copied().unwrap_or(0);
        keep_largest(&mut growth, name, growth_pct(before, after));
        keep_largest(&mut growth_mib, name, round2(mib(after) - mib(before)));
    }
    (growth, growth_mib)
}

/// Puts `value` under `process` in `by_process`, the workers as one (`rollout-worker`: the largest of theirs).
fn keep_largest(by_process: &mut BTreeMap<String, f64>, process: &str, value: f64) {
    let name = if process.starts_with("rollout-worker-") { "rollout-worker" } else { process };
    let entry = by_process.entry(name.to_string()).or_insert(f64::NEG_INFINITY);
    *entry = entry.max(value);
}

/// The trend of one process's RSS after the first interval: the least-squares slope through the readings of
/// intervals 2 to the last, as percent of their mean per 10 minutes (`interval_s` apart). Two readings can land on
/// a peak and a trough of a garbage-collected heap (the broker's moves ±15% from minute to minute); a slope over all
/// of them says whether memory rises. A diagnostic beside `rss_growth_pct`, not the target. None with fewer
/// than three such readings.
fn trend_pct_per_10min(readings: &[u64], interval_s: f64) -> Option<f64> {
    let ys: Vec<f64> = readings.iter().skip(1).map(|&b| b as f64).collect();
    if ys.len() < 3 || interval_s <= 0.0 {
        return None;
    }
    let n = ys.len() as f64;
    let mean_x = (n - 1.0) / 2.0;
    let mean_y = ys.iter().sum::<f64>() / n;
    let (mut sxy, mut sxx) = (0.0, 0.0);
    for (i, y) in ys.iter().enumerate() {
        let dx = i as f64 - mean_x;
        sxy += dx * (y - mean_y);
        sxx += dx * dx;
    }
    let per_interval = sxy / sxx;
    Some(round2(per_interval / mean_y * 100.0 * 600.0 / interval_s))
}

/// Waits (10 s at most) for the GROUPS bucket to hold no record (each trained group archived to LEDGER and purged);
/// returns the records left in GROUPS and the records archived in LEDGER.
async fn archive_settled(bus: &Bus, groups: &GroupStore) -> (u64, u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left = groups.kv().status().await.map(|s| s.values()).unwrap_or(u64::MAX);
        if left == 0 || Instant::now() > deadline {
            let archived = match bus.stream(bus.names().ledger_stream()).await {
                Ok(mut stream) => stream.info().await.map(|i| i.state.messages).unwrap_or(0),
                Err(_) => 0,
            };
            return (left, archived);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The broker's live heap: the Go runtime's allocated heap right after a collection, from nats-server's profiling
/// port (`/debug/pprof/heap?gc=1` collects first). RSS also holds the garbage the Go collector lets pile up
/// between collections (up to the live heap again, by default), so a leak shows here first; None if unreadable.
fn nats_live_heap(port: u16) -> Option<u64> {
    use std::io::Read;
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(30))).ok()?;
    stream.write_all(b"GET /debug/pprof/heap?debug=1&gc=1 HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut body = String::new();
    stream.read_to_string(&mut body).ok()?;
    body.lines().find_map(|line| line.strip_prefix("# HeapAlloc = ")).and_then(|n| n.trim().parse().ok())
}

/// Prints one line per interval (trajectories per second trained and produced in it, every process's RSS) until
/// the clock runs out; returns the samples.
async fn reporter(
    knobs: Knobs,
    started: Instant,
    ledger: Arc<Mutex<Ledger>>,
    watched: Vec<Watched>,
    nats_prof_port: u16,
) -> Vec<Sample> {
    let intervals = (knobs.seconds / knobs.report_s).ceil().max(1.0) as usize;
    let unit = if (knobs.report_s - 60.0).abs() < 1e-9 { "minute" } else { "interval" };
    let mut samples = Vec::new();
    let (mut trained_before, mut produced_before, mut at_before) = (0u64, 0u64, 0.0f64);
    for k in 1..=intervals {
        let at = (k as f64 * knobs.report_s).min(knobs.seconds);
        let end = started + Duration::from_secs_f64(at);
        // every process's RSS every second through the interval: its peak
        let mut readings: BTreeMap<String, Vec<u64>> = BTreeMap::new();
        loop {
            for w in &watched {
                readings.entry(w.name.clone()).or_default().push(bench::rss_bytes(w.pid));
            }
            let next = Instant::now() + RSS_EVERY;
            if next >= end {
                break;
            }
            tokio::time::sleep_until(next.into()).await;
        }
        tokio::time::sleep_until(end.into()).await;
        let (trained, produced) = {
            let ledger = ledger.lock().expect("ledger");
            (ledger.trained_trajectories, ledger.completed_trajectories)
        };
        let rss: BTreeMap<String, u64> = watched.iter().map(|w| (w.name.clone(), bench::rss_bytes(w.pid))).collect();
        let rss_peak = interval_peaks(&readings, &rss);
        let cpu_s: BTreeMap<String, f64> =
            watched.iter().map(|w| (w.name.clone(), bench::cpu_seconds(Some(w.pid)))).collect();
        let seconds = at - at_before;
        let listed: Vec<String> = watched
            .iter()
            .map(|w| format!("{} {:.1} (peak {:.1})", w.name, mib(rss[&w.name]), mib(rss_peak[&w.name])))
            .collect();
        let nats_live_heap = tokio::task::spawn_blocking(move || nats_live_heap(nats_prof_port)).await.ok().flatten();
        let mut heap = BTreeMap::new();
        for w in &watched {
            if let Some(bytes) = match w.metrics {
                Some(addr) => heap_in_use(addr).await,
                None => None,
            } {
                heap.insert(w.name.clone(), bytes);
            }
        }
        let heap_listed: Vec<String> = heap.iter().map(|(name, &b)| format!("{name} {:.2}", mib(b))).collect();
        println!(
            "soak {unit} {k}/{intervals} ({at:.0} s): trained {:.0} traj/s, produced {:.0} traj/s; RSS MiB: {}; \
             nats-server live heap MiB: {}; heap in use MiB: {}",
            (trained - trained_before) as f64 / seconds,
            (produced - produced_before) as f64 / seconds,
            listed.join(", "),
            nats_live_heap.map_or("?".to_string(), |b| format!("{:.1}", mib(b))),
            heap_listed.join(", ")
        );
        (trained_before, produced_before, at_before) = (trained, produced, at);
        samples.push(Sample { trained, rss, rss_peak, cpu_s, nats_live_heap, heap_in_use: heap });
    }
    samples
}

/// The sampling trainer stand-in: keeps `window` groups submitted and not trained, samples batches, fetches and
/// checks every payload, releases each step. Stops submitting at `end`, then trains what the workers still
/// complete until nothing is left or `drain_deadline`.
async fn train(bus: &Bus, groups: &GroupStore, knobs: &Knobs, ledger: &Mutex<Ledger>, end: Instant) {
    let window = (knobs.workers * knobs.worker_inflight.max(1) + 2 * knobs.batch) as u64;
    let drain_deadline = end + DRAIN;
    let mut releases = Vec::new();
    let mut step = 0u64;
    let started = Instant::now();
    // a paced step starts no sooner than its share of the run: a steady load, so that memory growth measures what
    // is kept rather than how hard this (shared, noisy) machine could push in a given minute
    let step_interval =
        (knobs.pace > 0.0).then(|| Duration::from_secs_f64((knobs.batch * knobs.group) as f64 / knobs.pace));
    loop {
        if let Some(interval) = step_interval {
            tokio::time::sleep_until((started + interval.mul_f64(step as f64)).into()).await;
        }
        let draining = Instant::now() >= end;
        let batch_size = if draining {
            let (left, in_flight) = {
                let ledger = ledger.lock().expect("ledger");
                (ledger.completed_untrained(), ledger.in_flight())
            };
            if left == 0 {
                if in_flight == 0 || Instant::now() >= drain_deadline {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            left.min(knobs.batch)
        } else {
            let (submitted, untrained) = {
                let ledger = ledger.lock().expect("ledger");
                (ledger.submitted, ledger.submitted - ledger.trained.len() as u64)
            };
            if untrained < window {
                let specs: Vec<GroupSpec> = (submitted..submitted + window - untrained)
                    .map(|n| spec(&uid_of(n), "train", step + 1, knobs.group, knobs.payload))
                    .collect();
                sim::submit_prompts(bus, groups, &specs).await.expect("submit");
                ledger.lock().expect("ledger").submitted += specs.len() as u64;
            }
            knobs.batch
        };
        step += 1;
        let request = SampleRequest {
            request_id: format!("soak-{step}"),
            step,
            partition: "train".into(),
            batch_size: batch_size as u32,
            wait_ms: 1_000,
            ..Default::default()
        };
        let Some(response) = bench::sample(bus, &request, Some(drain_deadline)).await else {
            eprintln!("soak: step {step}: no answer from the buffer before the drain deadline");
            break;
        };
        assert!(response.error.is_empty(), "sample request {}: {}", request.request_id, response.error);
        let payloads = bench::fetch_payloads(bus, &response).await;
        releases.push(bench::release(bus, step, &request.request_id));
        let mut payloads = payloads.into_iter();
        let mut ledger = ledger.lock().expect("ledger");
        for group in &response.groups {
            let Some(n) = number_of(&group.uid) else { panic!("a group the soak did not submit: {}", group.uid) };
            let mut whole = group.trajectories.len() == knobs.group;
            for reward in &group.trajectories {
                let payload = payloads.next().flatten();
                let decoded = payload.and_then(|p| Trajectory::decode(p.as_ref()).ok());
                whole &= decoded.is_some_and(|t| t.key == reward.key && t.uid == group.uid);
            }
            if !whole {
                ledger.damaged.insert(n);
            }
            *ledger.trained.entry(n).or_insert(0) += 1;
            ledger.trained_trajectories += group.trajectories.len() as u64;
        }
        drop(ledger);
        releases.retain(|r| !r.is_finished());
    }
    for release in releases {
        release.await.expect("release");
    }
}

async fn soak() {
    let knobs = Knobs::from_env();
    assert!(knobs.seconds > 0.0 && knobs.report_s > 0.0, "SOAK_SECONDS and SOAK_REPORT_S must be > 0");
    println!(
        "soak: {:.0} s, {} stand-in rollout workers (fast stand-in generator, no model; {} groups in flight each), \
         groups of {} trajectories of {} bytes, batches of {} groups, report every {:.0} s; nats-server \
         GOMEMLIMIT {} GOGC {}",
        knobs.seconds,
        knobs.workers,
        knobs.worker_inflight,
        knobs.group,
        knobs.payload,
        knobs.batch,
        knobs.report_s,
        knobs.nats_memory_limit.as_deref().unwrap_or("off"),
        knobs.nats_gogc.as_deref().unwrap_or("100 (Go's default)")
    );
    // the profiling port: the broker's live heap at each report (nats_live_heap)
    let prof_port = jetrl_bus::harness::free_port().expect("a free port");
    let env = [("GOMEMLIMIT", &knobs.nats_memory_limit), ("GOGC", &knobs.nats_gogc)]
        .into_iter()
        .filter_map(|(name, value)| value.clone().map(|value| (name.to_string(), value)))
        .collect();
    let server = NatsServer::start_with_config_and_env(&format!("prof_port: {prof_port}"), env).expect("nats-server");
    let url = server.url();
    let dir = tempfile::Builder::new().prefix("jetrl-soak-").tempdir().expect("tempdir");
    // the services' /metrics on known ports: their heap in use at each report
    let metrics_ports: HashMap<&str, u16> = ["reward-service", "replay-buffer"]
        .into_iter()
        .map(|name| (name, jetrl_bus::harness::free_port().expect("a free port")))
        .collect();
    std::fs::write(
        dir.path().join("job.yaml"),
        format!(
            "nats: {{url: \"{url}\"}}\ndata: {{task: {{name: reverse}}}}\nlog: {{level: warn}}\n\
             reward: {{metrics_addr: \"127.0.0.1:{}\"}}\nbuffer: {{metrics_addr: \"127.0.0.1:{}\"}}\n",
            metrics_ports["reward-service"], metrics_ports["replay-buffer"]
        ),
    )
    .expect("job.yaml");
    // the trainer's connection: it declares the job's topology, as the trainer does
    let (bus, groups) = connect(&url, "soak-trainer").await;
    let mut services: Vec<(String, Child)> = vec![
        ("reward-service".into(), spawn_service(dir.path(), "reward-service", "jetrl-reward-service")),
        ("replay-buffer".into(), spawn_service(dir.path(), "replay-buffer", "jetrl-replay-buffer")),
    ];
    bench::wait_until_ready(&bus, false).await;

    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let exe = std::env::current_exe().expect("own path");
    let mut workers: Vec<(Child, Option<ChildStdin>)> = Vec::new();
    let mut readers = Vec::new();
    for i in 0..knobs.workers {
        let log = std::fs::File::create(dir.path().join(format!("rollout-worker-{i}.log"))).expect("log file");
        let mut child = spawn_tied(
            Command::new(&exe)
                .arg("worker")
                .arg(&url)
                .arg(i.to_string())
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(log),
        );
        let stdout = child.stdout.take().expect("worker stdout");
        let ledger = ledger.clone();
        readers.push(std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                ledger.lock().expect("ledger").record_worker_line(&line);
            }
        }));
        let stdin = child.stdin.take();
        workers.push((child, stdin));
    }
    let mut watched =
        vec![Watched { name: "nats-server".into(), pid: server.pid().expect("server pid"), metrics: None }];
    watched.extend(services.iter().map(|(name, child)| Watched {
        name: name.clone(),
        pid: child.id(),
        metrics: metrics_ports.get(name.as_str()).map(|&port| std::net::SocketAddr::from(([127, 0, 0, 1], port))),
    }));
    watched.push(Watched { name: "trainer".into(), pid: std::process::id(), metrics: None });
    watched.extend(workers.iter().enumerate().map(|(i, (child, _))| Watched {
        name: format!("rollout-worker-{i}"),
        pid: child.id(),
        metrics: None,
    }));

    let started = Instant::now();
    let end = started + Duration::from_secs_f64(knobs.seconds);
    let report = tokio::spawn(reporter(knobs.clone(), started, ledger.clone(), watched, prof_port));
    train(&bus, &groups, &knobs, &ledger, end).await;
    let samples = report.await.expect("reporter");
    let drained_s = (Instant::now() - end).as_secs_f64();

    // stop the workers (their stdin closes), read the rest of what they reported
    for (_, stdin) in &mut workers {
        drop(stdin.take());
    }
    for (child, _) in &mut workers {
        let deadline = Instant::now() + Duration::from_secs(30);
        while child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let _ = child.kill();
        let _ = child.wait();
    }
    for reader in readers {
        reader.join().expect("worker reader");
    }
    // every group was trained and released: the buffer archives each to LEDGER and purges it from GROUPS
    let (groups_left, archived) = archive_settled(&bus, &groups).await;
    let mut exited = Vec::new();
    for (name, child) in &mut services {
        if let Ok(Some(status)) = child.try_wait() {
            exited.push(format!("{name} exited early ({status})"));
        }
        let _ = Command::new("kill").arg("-TERM").arg(child.id().to_string()).status();
    }
    for (_, child) in &mut services {
        let deadline = Instant::now() + Duration::from_secs(10);
        while child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let _ = child.kill();
        let _ = child.wait();
    }

    let ledger = ledger.lock().expect("ledger");
    let lost = ledger.completed_untrained() as u64 + ledger.damaged.len() as u64;
    let extra = |counts: &HashMap<u64, u32>| counts.values().map(|&c| u64::from(c.saturating_sub(1))).sum::<u64>();
    let duplicated = extra(&ledger.trained) + extra(&ledger.completed);
    let in_flight = ledger.in_flight();

    // RSS growth from the first interval to the last, in percent and in MiB: of each interval's peak (the target),
    // and of the one reading at each interval's end (a diagnostic)
    let (first, last) = (samples.first().expect("one interval at least"), samples.last().expect("one interval"));
    let (mut growth, growth_mib) = growth_by_process(&first.rss_peak, &last.rss_peak);
    let (mut end_growth, _) = growth_by_process(&first.rss, &last.rss);
    end_growth.remove("trainer");
    // the slope after the first interval, per process (the workers as one: the steepest)
    let mut trend: BTreeMap<String, f64> = BTreeMap::new();
    for name in first.rss.keys() {
        let readings: Vec<u64> = samples.iter().filter_map(|s| s.rss.get(name).copied()).collect();
        let Some(slope) = trend_pct_per_10min(&readings, knobs.report_s) else { continue };
        keep_largest(&mut trend, name, slope);
    }
    trend.remove("trainer");
    // the broker's live heap (after a collection): bounded state shows flat here even while RSS follows the Go
    // collector's garbage
    let live_heap_growth = match (first.nats_live_heap, last.nats_live_heap) {
        (Some(a), Some(b)) => serde_json::json!({ "nats-server": growth_pct(a, b) }),
        _ => serde_json::Value::Null,
    };
    let live_heap_mib: Vec<f64> = samples.iter().filter_map(|s| s.nats_live_heap).map(|b| round2(mib(b))).collect();
    // the services' heap in use: each reading, and its growth from the first interval to the last
    let mut heap_mib: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for sample in &samples {
        for (name, &bytes) in &sample.heap_in_use {
            heap_mib.entry(name.as_str()).or_default().push(round2(mib(bytes)));
        }
    }
    let heap_growth: BTreeMap<&str, f64> = first
        .heap_in_use
        .iter()
        .filter_map(|(name, &a)| last.heap_in_use.get(name).map(|&b| (name.as_str(), growth_pct(a, b))))
        .collect();
    // CPU seconds over the run (to the last report): the broker's garbage collection under its memory limit shows
    // here; the workers as one (their sum)
    let mut cpu_s: BTreeMap<String, f64> = BTreeMap::new();
    for (name, &seconds) in &last.cpu_s {
        let name = if name.starts_with("rollout-worker-") { "rollout-workers" } else { name.as_str() };
        *cpu_s.entry(name.to_string()).or_default() += seconds;
    }
    cpu_s.values_mut().for_each(|s| *s = round2(*s));
    // the trainer stand-in holds the soak's own ledger: reported apart
    let harness_growth = growth.remove("trainer").unwrap_or(f64::NAN);
    let rss_end: BTreeMap<&str, f64> = last.rss.iter().map(|(k, &v)| (k.as_str(), round2(mib(v)))).collect();
    // trained while the clock ran (the last interval ends with it): the drain is not counted
    let traj_per_s = last.trained as f64 / knobs.seconds;
    let over: Vec<String> =
        growth.iter().filter(|(_, &g)| g.is_nan() || g > GROWTH_LIMIT_PCT).map(|(k, g)| format!("{k} {g}%")).collect();
    let accounted = lost == 0 && duplicated == 0 && in_flight == 0 && exited.is_empty();
    let met = over.is_empty() && accounted;
    if !met {
        eprintln!(
            "soak: targets not met: RSS growth over {GROWTH_LIMIT_PCT}%: {over:?}; lost {lost}, duplicated \
             {duplicated}, in flight {in_flight}; {exited:?}"
        );
    }
    if !accounted {
        // keep the services' and workers' logs to look at
        eprintln!("soak: logs kept in {}", dir.keep().display());
    }
    println!(
        "soak: submitted {} groups; workers completed {} ({} trajectories, {} redelivered tasks, {} errors); \
         trained {} groups ({} trajectories); drained in {drained_s:.1} s",
        ledger.submitted,
        ledger.completed.len(),
        ledger.completed_trajectories,
        ledger.redelivered,
        ledger.worker_errors,
        ledger.trained.len(),
        ledger.trained_trajectories,
    );
    // the fields first, in its order, then the rest
    let fields: Vec<(&str, serde_json::Value)> = vec![
        ("bench", "soak".into()),
        ("minutes", round2(knobs.seconds / 60.0).into()),
        ("traj_per_s", traj_per_s.round().into()),
        ("paced_traj_per_s", knobs.pace.into()),
        ("rss_growth_pct", serde_json::json!(growth)),
        ("lost", lost.into()),
        ("duplicated", duplicated.into()),
        ("in_flight", in_flight.into()),
        ("workers", knobs.workers.into()),
        ("submitted_groups", ledger.submitted.into()),
        ("trained_groups", ledger.trained.len().into()),
        ("trained_trajectories", ledger.trained_trajectories.into()),
        ("redelivered_tasks", ledger.redelivered.into()),
        ("payload_bytes", knobs.payload.into()),
        ("rss_growth_mib", serde_json::json!(growth_mib)),
        ("rss_mib_end", serde_json::json!(rss_end)),
        ("rss_trend_pct_per_10min", serde_json::json!(trend)),
        ("rss_end_growth_pct", serde_json::json!(end_growth)),
        ("harness_rss_growth_pct", serde_json::json!({ "trainer": harness_growth })),
        ("live_heap_growth_pct", live_heap_growth),
        ("nats_live_heap_mib", serde_json::json!(live_heap_mib)),
        ("heap_in_use_mib", serde_json::json!(heap_mib)),
        ("heap_in_use_growth_pct", serde_json::json!(heap_growth)),
        ("nats_gomemlimit", serde_json::json!(knobs.nats_memory_limit)),
        ("nats_gogc", serde_json::json!(knobs.nats_gogc)),
        ("cpu_s", serde_json::json!(cpu_s)),
        ("groups_bucket_records_end", groups_left.into()),
        ("ledger_archived_records", archived.into()),
        ("targets_met", met.into()),
    ];
    let fields: Vec<String> = fields.iter().map(|(k, v)| format!("{}:{v}", serde_json::Value::from(*k))).collect();
    println!("{{{}}}", fields.join(","));
}

#[cfg(test)]
mod tests {
    use super::{growth_by_process, interval_peaks, trend_pct_per_10min};
    use std::collections::BTreeMap;

    #[test]
    fn growth_is_the_peaks_and_the_workers_count_as_their_largest() {
        let map = |pairs: &[(&str, u64)]| -> BTreeMap<String, u64> {
            pairs.iter().map(|&(k, v)| (k.to_string(), v)).collect()
        };
        // a broker that moves through a band (150-170) without rising, and still rising at the first interval's end
        let readings: BTreeMap<String, Vec<u64>> =
            [("nats-server".to_string(), vec![100, 170, 150]), ("rollout-worker-0".to_string(), vec![200, 200])].into();
        let first = interval_peaks(&readings, &map(&[("nats-server", 160), ("rollout-worker-0", 210)]));
        assert_eq!(first, map(&[("nats-server", 170), ("rollout-worker-0", 210)]), "the end's reading counts too");
        let last = map(&[("nats-server", 170), ("rollout-worker-0", 231), ("rollout-worker-1", 999)]);
        let (pct, mib) = growth_by_process(&first, &last);
        assert_eq!(pct["nats-server"], 0.0);
        assert_eq!(pct["rollout-worker"], 10.0, "one worker's growth, named for all");
        assert_eq!(mib.len(), 2, "only processes read in the first interval");
    }

    #[test]
    fn the_trend_ignores_the_first_reading_and_a_swing_that_does_not_rise() {
        // the first interval's reading is left out; the others swing ±10% around 200 without rising
        let swinging = [100, 200, 220, 180, 180, 220, 200];
        assert_eq!(trend_pct_per_10min(&swinging, 60.0), Some(0.0));
        // 2 MiB a minute from 100 MiB: readings 2..=7 are 102..=112 MiB (mean 107), 2/107 a minute, 18.69% per 10
        let rising: Vec<u64> = (0..7).map(|m| (100 + 2 * m) << 20).collect();
        let slope = trend_pct_per_10min(&rising[..], 60.0).unwrap();
        assert!((slope - 2.0 / 107.0 * 1000.0).abs() < 0.01, "{slope}");
        assert_eq!(trend_pct_per_10min(&[1, 2, 3], 60.0), None);
    }
}
