//! `just bench dataplane`: the real data path against raw JetStream, in one run against one server.
//!
//! - jetrl: producers publish 16 KiB trajectories in groups of 8 (record pending → running → trajectories →
//!   finished), the real reward service scores them, the real replay buffer indexes them, and a consumer
//!   samples batches of groups, fetches every payload from the TRAJ stream and releases the step. The consumer
//!   keeps `BENCH_CONSUMER_DEPTH` (2) sample requests in flight, each followed by its fetch, as the raw path's pull
//!   consumer keeps a batch requested ahead; with depth 1 it samples, fetches and releases in turn, as the sync
//!   trainer does, and then measures that loop's round trips more than the data plane (it ends well after the
//!   producers).
//! - raw: the same number of messages, each the bytes of one of those trajectories (16 KiB), published with pipelined acks and pulled with acks by
//!   async-nats on a plain stream.
//! - three passes, each on a fresh server (raw, then jetrl); the best pass of each is compared, since the
//!   machine is shared and noisy.
//! - sample latency: for each sample request, how long after the later of (request sent, last needed group
//!   complete) the answer arrived; p99 over all requests.
//! - buffer memory: RSS growth of a separate `jetrl-replay-buffer` process while it indexes 100k trajectories.
//!
//! Last line: one JSON object.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use jetrl_bus::publish::Outgoing;
use jetrl_bus::{Bus, NatsServer, Publisher};
use jetrl_config::JobConfig;
use jetrl_tests::bench::{self, connect, cpu_seconds_here_and};
use jetrl_tests::sim::{self, GroupSpec};
use jetrl_wire::v1::{RewardBatch, SampleRequest, Trajectory};
use jetrl_wire::Message;

const PAYLOAD: usize = 16 * 1024;
const GROUP: usize = 8;
/// groups each producer keeps in flight (a rollout worker holds up to rollout.max_inflight_groups)
const INFLIGHT_GROUPS: usize = 8;
/// Passes of each path; the best of each is compared.
const PASSES: usize = 3;

/// A group of GROUP trajectories of PAYLOAD encoded bytes each, scored by the reverse rule.
fn bench_spec(uid: &str) -> GroupSpec {
    let mut spec = GroupSpec::finished(uid, 1, &[1.0; GROUP]);
    spec.payload_bytes = PAYLOAD;
    spec.data_source = "jetrl/reverse".into();
    spec
}

/// Raw JetStream: publish `count` messages of PAYLOAD bytes (pipelined acks) while a pull consumer reads and
/// acks them. Returns messages per second (end to end).
async fn raw(url: &str, count: usize) -> f64 {
    let (bus, _) = connect(url, "bench-raw").await;
    let js = bus.jetstream().clone();
    let stream = js
        .create_stream(async_nats::jetstream::stream::Config {
            name: "BENCH_RAW".into(),
            subjects: vec!["bench.raw".into()],
            ..Default::default()
        })
        .await
        .expect("stream");
    let consumer = stream
        .create_consumer(async_nats::jetstream::consumer::pull::Config {
            durable_name: Some("raw".into()),
            ack_policy: async_nats::jetstream::consumer::AckPolicy::Explicit,
            ..Default::default()
        })
        .await
        .expect("consumer");
    // the same bytes as the jetrl path's trajectories
    let payload = bytes::Bytes::from(sim::trajectory(&bench_spec("raw"), 0).encode_to_vec());
    let started = Instant::now();
    let reader = tokio::spawn(async move {
        let mut messages = consumer.stream().max_messages_per_batch(512).messages().await.expect("messages");
        let mut seen = 0;
        while seen < count {
            let Some(Ok(msg)) = messages.next().await else { break };
            let _ = msg.ack().await;
            seen += 1;
        }
    });
    let mut publisher = Publisher::new(&bus, 1024);
    for _ in 0..count {
        publisher.publish(Outgoing::new("bench.raw", None, payload.clone())).await.expect("publish");
    }
    publisher.drain().await.expect("drain");
    reader.await.expect("reader");
    let rate = count as f64 / started.elapsed().as_secs_f64();
    let _ = js.delete_stream("BENCH_RAW").await;
    rate
}

/// The jetrl data path. Returns trajectories per second, sample latency samples in ms, and the CPU seconds this
/// process (producers, services, consumer) and the server used while the clock ran.
async fn jetrl_path(
    url: &str,
    server: Option<u32>,
    groups_total: usize,
    batch_groups: usize,
    producers: usize,
    depth: usize,
) -> (f64, Vec<f64>, (f64, f64)) {
    let mut cfg = JobConfig::default();
    cfg.nats.url = url.into();
    cfg.trainer.mode = jetrl_config::TrainerMode::SeparateAsync;
    cfg.buffer.max_off_policy_threshold = 1_000_000;
    cfg.reward.max_inflight = 512;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    // BENCH_REWARD=sim: producers publish rewards themselves (isolates the buffer from the reward service)
    let sim_reward = std::env::var("BENCH_REWARD").is_ok_and(|v| v == "sim");
    let services: &[&str] = if sim_reward { &["buffer"] } else { &["buffer", "reward"] };
    for &service in services {
        let cfg = cfg.clone();
        let mut rx = stop_rx.clone();
        let stop = async move {
            let _ = rx.wait_for(|s| *s).await;
        };
        tokio::spawn(async move {
            match service {
                "buffer" => jetrl_replay_buffer::run(cfg, stop).await.map_err(|e| e.to_string()),
                _ => jetrl_reward_service::run(cfg, stop).await.map_err(|e| e.to_string()),
            }
            .expect("service");
        });
    }
    let (bus, _) = connect(url, "bench-consumer").await;
    bench::wait_until_ready(&bus, sim_reward).await;
    // uid -> when its reward batch was stored (the group is complete once the buffer sees it)
    let completed: Arc<Mutex<HashMap<String, Instant>>> = Arc::new(Mutex::new(HashMap::new()));
    let per_producer = groups_total / producers;
    let groups_total = per_producer * producers;
    // Generating trajectories is the rollout's work, not the data plane's: they are built before the clock starts
    // (the raw path publishes bytes built before its clock, too). Encoding and publishing them is timed.
    let built: Vec<Vec<(GroupSpec, Vec<Trajectory>)>> = (0..producers)
        .map(|p| {
            (0..per_producer)
                .map(|i| {
                    let spec = bench_spec(&format!("p{p}g{i}"));
                    let trajectories = (0..GROUP).map(|session| sim::trajectory(&spec, session)).collect();
                    (spec, trajectories)
                })
                .collect()
        })
        .collect();
    // each producer's connection, made before the clock too
    let mut connections = Vec::new();
    for _ in 0..producers {
        connections.push(connect(url, "bench-producer").await);
    }
    let started = Instant::now();
    let cpu_before = cpu_seconds_here_and(server);
    let mut tasks = Vec::new();
    for (p, (groups_of_producer, (bus, groups))) in built.into_iter().zip(connections).enumerate() {
        tasks.push(tokio::spawn(async move {
            // like a rollout worker: several groups in flight at once, each written children-first
            futures::stream::iter(groups_of_producer.into_iter().map(|(spec, trajectories)| {
                let (bus, groups) = (bus.clone(), groups.clone());
                async move {
                    let known = sim::submit(&groups, &spec).await.expect("submit");
                    let seqs =
                        sim::produce_built(&bus, &groups, &spec, Some(known), &trajectories).await.expect("produce");
                    if sim_reward {
                        sim::score(&mut Publisher::new(&bus, GROUP), &spec, &seqs).await.expect("score");
                    }
                }
            }))
            .buffer_unordered(INFLIGHT_GROUPS)
            .collect::<Vec<_>>()
            .await;
            eprintln!("  producer {p} done after {:.2}s", started.elapsed().as_secs_f64());
        }));
    }
    // the reward service's output tells us when each group is complete: a group's rewards are published together,
    // in one reward batch (with the rest of its micro-batch)
    {
        let completed = completed.clone();
        let rewards = bus.stream(bus.names().rewards_stream()).await.expect("rewards stream");
        let consumer = rewards
            .create_consumer(async_nats::jetstream::consumer::pull::OrderedConfig {
                filter_subject: bus.names().reward_batches_filter(),
                ..Default::default()
            })
            .await
            .expect("ordered");
        tokio::spawn(async move {
            let mut messages = consumer.messages().await.expect("messages");
            while let Some(Ok(msg)) = messages.next().await {
                let Ok(batch) = RewardBatch::decode(msg.payload.as_ref()) else { continue };
                let now = Instant::now();
                let mut completed = completed.lock().expect("lock");
                for reward in batch.rewards {
                    completed.entry(reward.uid).or_insert(now);
                }
            }
        });
    }
    // `depth` steps in flight (see the module doc), each with its own group count
    let trajectories_total = groups_total * GROUP;
    let steps: Vec<(u64, u32)> = (0..groups_total.div_ceil(batch_groups))
        .map(|i| ((i + 1) as u64, batch_groups.min(groups_total - i * batch_groups) as u32))
        .collect();
    let step_count = steps.len();
    let trace = std::env::var("BENCH_TRACE").is_ok();
    let results: Vec<(usize, Option<f64>, tokio::task::JoinHandle<()>)> = futures::stream::iter(steps)
        .map(|(step, batch_size)| {
            let (bus, completed) = (bus.clone(), completed.clone());
            async move { consume_step(&bus, &completed, step, batch_size, trace).await }
        })
        .buffered(depth.max(1))
        .collect()
        .await;
    let mut consumed = 0;
    let mut latencies = Vec::new();
    let mut releases = Vec::new();
    for (fetched, latency, release) in results {
        consumed += fetched;
        latencies.extend(latency);
        releases.push(release);
    }
    assert_eq!(consumed, trajectories_total, "every trajectory is consumed once");
    for release in releases {
        release.await.expect("release");
    }
    let rate = consumed as f64 / started.elapsed().as_secs_f64();
    let cpu_after = cpu_seconds_here_and(server);
    for t in tasks {
        t.await.expect("producer");
    }
    eprintln!("  consumer done after {:.2}s ({} sample requests)", started.elapsed().as_secs_f64(), step_count);
    let _ = stop_tx.send(true);
    (rate, latencies, (cpu_after.0 - cpu_before.0, cpu_after.1 - cpu_before.1))
}

/// One consumer step: samples `batch_size` groups (re-asking while the buffer is not ready), fetches every payload
/// from TRAJ and sends the release in the background, as the trainer does. Returns the trajectories fetched, the
/// sample latency (none for step 1, which also waits for the services to start) and the release task.
async fn consume_step(
    bus: &Bus,
    completed: &Mutex<HashMap<String, Instant>>,
    step: u64,
    batch_size: u32,
    trace: bool,
) -> (usize, Option<f64>, tokio::task::JoinHandle<()>) {
    let request = SampleRequest {
        request_id: format!("bench-{step}"),
        step,
        partition: "train".into(),
        batch_size,
        wait_ms: 5_000,
        ..Default::default()
    };
    let sent = Instant::now();
    let response = bench::sample(bus, &request, None).await.expect("no deadline");
    let answered = Instant::now();
    let ready = {
        let done = completed.lock().expect("lock");
        response.groups.iter().filter_map(|g| done.get(&g.uid).copied()).max().unwrap_or(sent)
    };
    let latency = (step > 1).then(|| answered.saturating_duration_since(ready.max(sent)).as_secs_f64() * 1000.0);
    let fetched: Vec<usize> =
        bench::fetch_payloads(bus, &response).await.iter().map(|p| p.as_ref().map_or(0, |p| p.len())).collect();
    assert!(fetched.iter().all(|&n| n + 1 >= PAYLOAD), "a payload was missing");
    // as the trainer does: the release goes out in the background (the groups are already consumed)
    let release = bench::release(bus, step, &request.request_id);
    if trace {
        eprintln!(
            "  step {step}: sample {:.1} ms, fetch {:.1} ms",
            (answered - sent).as_secs_f64() * 1e3,
            answered.elapsed().as_secs_f64() * 1e3
        );
    }
    (fetched.len(), latency, release)
}

/// RSS growth per indexed trajectory of a separate buffer process holding `count` trajectories.
async fn buffer_memory(url: &str, count: usize) -> f64 {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("job.yaml");
    std::fs::write(&config, format!("nats: {{url: \"{url}\"}}\ndata: {{task: {{name: reverse}}}}\n")).expect("config");
    let mut child = std::process::Command::new(jetrl_tests::bin("jetrl-replay-buffer"))
        .arg("--config")
        .arg(&config)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("buffer process");
    let (bus, groups) = connect(url, "bench-memory").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = bench::rss_bytes(child.id());
    let mut publisher = Publisher::new(&bus, 1024);
    let group_count = count / GROUP;
    for g in 0..group_count {
        let spec = GroupSpec::finished(&format!("m{g}"), 1, &[0.5; GROUP]);
        sim::submit(&groups, &spec).await.expect("submit");
        groups.update("train", &spec.uid, |_| Some(jetrl_wire::v1::GroupState::Running)).await.expect("running");
        let keys: Vec<String> = (0..GROUP).map(|i| format!("m{g}_{i}_0")).collect();
        groups
            .update("train", &spec.uid, |s| {
                s.trajectory_keys = keys.clone();
                Some(jetrl_wire::v1::GroupState::Finished)
            })
            .await
            .expect("finished");
        let seqs: Vec<u64> = (0..GROUP as u64).map(|i| g as u64 * 8 + i + 1).collect();
        sim::score(&mut publisher, &spec, &seqs).await.expect("score");
    }
    // wait until the buffer has indexed everything (its ledger counts the finished groups)
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let ledger: jetrl_wire::v1::LedgerResponse = bus
            .request(
                bus.names().buffer_ledger(),
                &jetrl_wire::v1::LedgerRequest { limit: 1, ..Default::default() },
                Duration::from_secs(30),
            )
            .await
            .expect("ledger");
        if ledger.counts.get("finished").copied().unwrap_or(0) as usize >= group_count {
            break;
        }
        assert!(Instant::now() < deadline, "buffer did not index {count} trajectories");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let after = bench::rss_bytes(child.id());
    let _ = child.kill();
    let _ = child.wait();
    (after.saturating_sub(before)) as f64 / count as f64
}

#[tokio::main]
async fn main() {
    let groups_total = bench::knob("BENCH_GROUPS", 1000usize);
    let batch = bench::knob("BENCH_BATCH_GROUPS", 16usize);
    let producers = bench::knob("BENCH_PRODUCERS", 4usize);
    let memory_trajs = bench::knob("BENCH_MEMORY_TRAJECTORIES", 100_000usize);
    let depth = bench::knob("BENCH_CONSUMER_DEPTH", 2usize);
    let trajectories = groups_total * GROUP;
    println!(
        "dataplane: {groups_total} groups x {GROUP} trajectories of {PAYLOAD} bytes, {producers} producers, batches \
         of {batch} groups, {depth} sample requests in flight"
    );
    // Each pass on a fresh server: raw, then the jetrl path. The best pass of each is compared (the machine is
    // shared and noisy); the latency percentiles pool every pass.
    let (mut raw_rate, mut jetrl_rate, mut latencies): (f64, f64, Vec<f64>) = (0.0, 0.0, Vec::new());
    for pass in 1..=PASSES {
        let server = NatsServer::start().expect("nats-server");
        let url = server.url();
        let before = cpu_seconds_here_and(server.pid());
        let raw_pass = raw(&url, trajectories).await;
        let raw_cpu = cpu_seconds_here_and(server.pid());
        let (jetrl_pass, pass_latencies, jetrl_cpu) =
            jetrl_path(&url, server.pid(), groups_total, batch, producers, depth).await;
        println!(
            "  pass {pass}: raw JetStream publish+consume {raw_pass:.0} msg/s (CPU: bench {:.2}s, nats-server {:.2}s), \
             jetrl path {jetrl_pass:.0} traj/s (CPU while timed: producers, services and consumer {:.2}s, \
             nats-server {:.2}s)",
            raw_cpu.0 - before.0,
            raw_cpu.1 - before.1,
            jetrl_cpu.0,
            jetrl_cpu.1
        );
        raw_rate = raw_rate.max(raw_pass);
        jetrl_rate = jetrl_rate.max(jetrl_pass);
        latencies.extend(pass_latencies);
        // let the services of this pass stop before their server goes
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    println!("raw JetStream publish+consume: best of {PASSES} {raw_rate:.0} msg/s");
    latencies.sort_by(|a, b| a.total_cmp(b));
    let p99 = latencies[((latencies.len() as f64 * 0.99).ceil() as usize).saturating_sub(1).min(latencies.len() - 1)];
    let p50 = latencies[latencies.len() / 2];
    println!(
        "jetrl path: best of {PASSES} {jetrl_rate:.0} traj/s; sample latency p50 {p50:.2} ms, p99 {p99:.2} ms over {} requests",
        latencies.len()
    );
    let server2 = NatsServer::start().expect("nats-server");
    let per_traj = buffer_memory(&server2.url(), memory_trajs).await;
    println!("buffer RSS growth: {per_traj:.0} bytes per indexed trajectory ({memory_trajs} trajectories)");
    println!(
        "{}",
        serde_json::json!({
            "bench": "dataplane",
            "payload_bytes": PAYLOAD,
            "raw_traj_per_s": raw_rate.round(),
            "jetrl_traj_per_s": jetrl_rate.round(),
            "ratio": (jetrl_rate / raw_rate * 1000.0).round() / 1000.0,
            "sample_latency_p99_ms": (p99 * 100.0).round() / 100.0,
            "buffer_rss_bytes_per_traj": per_traj.round(),
            "consumer_depth": depth,
        })
    );
}
