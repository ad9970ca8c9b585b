//! What the benchmarks (`src/bin/bench_*.rs`) share: CPU seconds and resident memory of each side of a run, a
//! connection to the benchmark's job, and the sampling trainer's calls to the replay buffer (sample, fetch the
//! payloads, release).

use std::time::{Duration, Instant};

use bytes::Bytes;
use jetrl_bus::{Bus, GroupStore};
use jetrl_config::JobConfig;
use jetrl_wire::subjects;
use jetrl_wire::v1::{LedgerRequest, LedgerResponse, ReleaseRequest, ReleaseResponse, SampleRequest, SampleResponse};

/// CPU seconds (user + system) used so far by process `pid` (this process for `None`), from /proc; 0 elsewhere.
pub fn cpu_seconds(pid: Option<u32>) -> f64 {
    let path = pid.map_or_else(|| "/proc/self/stat".to_string(), |pid| format!("/proc/{pid}/stat"));
    let Ok(stat) = std::fs::read_to_string(path) else { return 0.0 };
    // fields after the command name (which may hold spaces): state is field 3, utime 14, stime 15
    let fields: Vec<&str> = stat.rsplit_once(')').map_or("", |(_, rest)| rest).split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // USER_HZ is 100 on Linux
    let hz = 100.0;
    (ticks(11) + ticks(12)) / hz
}

/// CPU seconds used so far by this process and by process `server` (a benchmark's two sides of one run).
pub fn cpu_seconds_here_and(server: Option<u32>) -> (f64, f64) {
    (cpu_seconds(None), cpu_seconds(server))
}

/// Resident memory (VmRSS) of process `pid` in bytes, from /proc; 0 when it cannot be read (the process is gone).
pub fn rss_bytes(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmRSS:")).map(|l| l.to_string()))
        .and_then(|l| l.split_whitespace().nth(1).and_then(|kb| kb.parse::<u64>().ok()))
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}

/// A benchmark knob: environment variable `name` parsed, or `default` when unset or unparsable.
pub fn knob<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// A connection to the benchmark's job: the default job (its namespace is the default `run.name`), as the
/// services the benchmarks start and their job files use. Declares the topology (idempotent).
pub async fn connect(url: &str, name: &str) -> (Bus, GroupStore) {
    let mut job = JobConfig::default();
    job.nats.url = url.into();
    let bus = Bus::connect_job(&job, name).await.expect("connect");
    bus.declare_topology().await.expect("declare");
    let groups = GroupStore::open(&bus).await.expect("groups");
    (bus, groups)
}

/// Waits (60 s at most) until the buffer answers requests and, unless `sim_reward` (no reward service runs), the
/// reward service has its consumer, so that a benchmark's clock does not count service start-up.
pub async fn wait_until_ready(bus: &Bus, sim_reward: bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let buffer = bus
            .request::<_, LedgerResponse>(
                bus.names().buffer_ledger(),
                &LedgerRequest { limit: 1, ..Default::default() },
                Duration::from_millis(500),
            )
            .await
            .is_ok();
        let reward = sim_reward || {
            let score = bus.stream(bus.names().score_stream()).await.expect("SCORE");
            score.consumer_info(subjects::REWARD_CONSUMER).await.is_ok()
        };
        if buffer && reward {
            return;
        }
        assert!(Instant::now() < deadline, "services did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Asks the buffer for `request`'s groups, asking again (same request id) while it answers "not ready" or does
/// not answer (still starting), until `deadline` if any. None when the deadline passed first.
pub async fn sample(bus: &Bus, request: &SampleRequest, deadline: Option<Instant>) -> Option<SampleResponse> {
    loop {
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return None;
        }
        match bus.request::<_, SampleResponse>(bus.names().buffer_sample(), request, Duration::from_secs(10)).await {
            Ok(r) if !r.not_ready => return Some(r),
            Ok(_) => {}
            // the buffer is still starting
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

/// Every payload of a sample answer, fetched from the TRAJ stream by sequence: one per trajectory, in the answer's
/// order (groups, then their trajectories); None where the stream did not return it.
pub async fn fetch_payloads(bus: &Bus, response: &SampleResponse) -> Vec<Option<Bytes>> {
    let wanted: Vec<(String, u64)> = response
        .groups
        .iter()
        .flat_map(|g| g.trajectories.iter().map(|t| (bus.names().traj_subject(&t.partition, &t.uid), t.traj_seq)))
        .collect();
    let mut payloads = bus.fetch_by_sequence(bus.names().traj_stream(), &wanted).await.expect("fetch");
    wanted.iter().map(|(_, seq)| payloads.remove(seq)).collect()
}

/// Releases the groups of sample request `request_id` at `step` in the background, as the trainer does once it
/// holds their payloads; the task ends when the buffer has answered.
pub fn release(bus: &Bus, step: u64, request_id: &str) -> tokio::task::JoinHandle<()> {
    let release = ReleaseRequest { step, request_ids: vec![request_id.to_string()] };
    let bus = bus.clone();
    tokio::spawn(async move {
        let _: ReleaseResponse =
            bus.request(bus.names().buffer_release(), &release, Duration::from_secs(30)).await.expect("release");
    })
}
