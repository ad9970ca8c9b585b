//! `just bench reward`: rule-scored trajectories per second through the reward service (a real nats-server, the
//! service's own `run`) against `RewardEngine::score_batch` called in-process on the same inputs, in the same run.
//!
//! 1. score M trajectories (openai/gsm8k, lighteval/MATH, math_dapo, jetrl/reverse, half of them correct)
//!    in-process in batches of `reward.batch_size`: best of three passes → `inprocess_per_s`;
//! 2. three times, on a fresh nats-server: publish them in groups of 8 as a rollout worker does (the trajectories
//!    into TRAJ, one score request per group into SCORE), start the service and time from the creation of its
//!    consumer (start-up left out, as step 1 leaves out building its engine; it is printed) until every score
//!    request is acknowledged (the service acknowledges a request only once its rewards are stored in REWARDS) and
//!    the settled requests are purged from SCORE (the service does that once a second; here it is done at the end
//!    of the pass and counted); check every reward against the in-process score. Best of three → `service_per_s`;
//! 3. on the last server, the broker ceiling: the same broker work per group (a pull and an ack, and one reward
//!    message per `reward.batch_size` requests) without decoding or scoring.
//!
//! The last line printed is `{"bench":"reward","service_per_s":…,"inprocess_per_s":…,"ratio":…}`.
//! Usage: `jetrl-reward-bench [--trajectories M] [--response-tokens N] [key=value reward overrides...]`.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use futures::StreamExt;
use jetrl_bus::publish::Outgoing;
use jetrl_bus::{score, Bus, NatsServer, Publisher, ScoreRequestBuilder};
use jetrl_config::JobConfig;
use jetrl_reward::{RewardEngine, ScoreInput};
use jetrl_tests::bench::cpu_seconds_here_and;
use jetrl_wire::keys::TrajectoryKey;
use jetrl_wire::v1::{RewardBatch, Timings, Trajectory};
use jetrl_wire::{packed, subjects, Message};

/// How long the service may take for all rewards before the bench gives up.
const SERVICE_DEADLINE: Duration = Duration::from_secs(600);
/// Passes of each side; the best of each is compared (the machine is shared and noisy).
const PASSES: usize = 3;
const GROUP_SIZE: usize = 8;

struct Args {
    trajectories: usize,
    response_tokens: usize,
    prompt_tokens: usize,
    overrides: Vec<String>,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut args = Args { trajectories: 50_000, response_tokens: 256, prompt_tokens: 128, overrides: Vec::new() };
    let mut iter = std::env::args().skip(1);
    while let Some(arg) = iter.next() {
        let mut number = |name: &str| -> anyhow::Result<usize> {
            iter.next()
                .with_context(|| format!("{name} needs a value"))?
                .parse()
                .with_context(|| format!("{name} must be a number"))
        };
        match arg.as_str() {
            "--trajectories" => args.trajectories = number("--trajectories")?.max(1),
            "--response-tokens" => args.response_tokens = number("--response-tokens")?.max(1),
            "--prompt-tokens" => args.prompt_tokens = number("--prompt-tokens")?.max(1),
            other if other.contains('=') => args.overrides.push(other.to_string()),
            other => bail!("unknown argument {other:?}"),
        }
    }
    Ok(args)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = parse_args()?;
    jetrl_telemetry::init_tracing("warn", jetrl_config::LogFormat::Text);
    // Only the reward section matters here; the rest of the job stays at its defaults.
    let mut cfg = JobConfig {
        reward: jetrl_config::load(None, &args.overrides).context("reward overrides")?,
        ..JobConfig::default()
    };
    cfg.reward.validate().context("reward overrides")?;
    cfg.reward.metrics_addr = "127.0.0.1:0".into();
    let trajectories: Vec<Trajectory> =
        (0..args.trajectories).map(|i| trajectory(i, args.prompt_tokens, args.response_tokens)).collect();
    let payload_bytes: usize = trajectories.iter().map(Message::encoded_len).sum::<usize>() / trajectories.len();
    println!(
        "{} trajectories ({payload_bytes} B each) in groups of {GROUP_SIZE}; max_inflight {}, batch_size {}",
        trajectories.len(),
        cfg.reward.max_inflight,
        cfg.reward.batch_size
    );

    // In-process: the same scorer inputs, in the service's batch size. The scorers record their metrics in both
    // (the service cannot run without them): the recorder is installed first, or those calls would be free here.
    jetrl_telemetry::prometheus();
    let engine = RewardEngine::new(&cfg.reward).await?;
    let inputs: Vec<ScoreInput> = trajectories.iter().map(score_input).collect();
    let batch_size = cfg.reward.batch_size.max(1) as usize;
    let mut best_s = f64::INFINITY;
    let mut expected = HashMap::new();
    for _ in 0..PASSES {
        let batches: Vec<Vec<ScoreInput>> = inputs.chunks(batch_size).map(<[ScoreInput]>::to_vec).collect();
        let pass = Instant::now();
        let mut outcomes = Vec::with_capacity(inputs.len());
        for batch in batches {
            outcomes.extend(engine.score_batch(batch).await);
        }
        best_s = best_s.min(pass.elapsed().as_secs_f64());
        expected = outcomes.into_iter().map(|o| (o.key, o.score)).collect();
    }
    let inprocess_per_s = inputs.len() as f64 / best_s;
    println!("in-process: best of {PASSES} {best_s:.3}s ({inprocess_per_s:.0}/s)");

    // The service: each pass on a fresh nats-server holding the same trajectories and requests.
    let mut service_per_s: f64 = 0.0;
    for pass in 1..=PASSES {
        let server = NatsServer::start().context("starting nats-server")?;
        cfg.nats.url = server.url();
        let bus = Bus::connect_job(&cfg, "jetrl-reward-bench").await?;
        bus.declare_topology().await?;
        let request_bytes = publish_groups(&bus, &trajectories).await?;
        let rate = service_pass(&cfg, &bus, &server, trajectories.len(), request_bytes.len()).await?;
        service_per_s = service_per_s.max(rate);
        let checked = check_rewards(&bus, &expected).await?;
        println!("  pass {pass}: checked {checked} rewards, one per trajectory, each equal to the in-process score");
        if pass == PASSES {
            let ceiling_per_s = broker_ceiling(&bus, &request_bytes, GROUP_SIZE, batch_size).await?;
            println!(
                "broker ceiling: {ceiling_per_s:.0} trajectories/s (pull each group's request, publish 100 bytes per \
                 trajectory with a Nats-Msg-Id in one message per {batch_size} requests, ack: no decoding, no \
                 scoring); best service pass at {:.0}% of it",
                100.0 * service_per_s / ceiling_per_s
            );
        }
    }
    println!("service: best of {PASSES} {service_per_s:.0}/s");
    let ratio = service_per_s / inprocess_per_s;
    // Written by hand so the keys keep this order.
    println!(
        "{{\"bench\":\"reward\",\"service_per_s\":{service_per_s:.0},\"inprocess_per_s\":{inprocess_per_s:.0},\"ratio\":{ratio:.3}}}"
    );
    Ok(())
}

/// Publishes the trajectories as a rollout worker does: each group's into TRAJ, then its score request into
/// SCORE. Returns the requests' bytes (for the broker ceiling).
async fn publish_groups(bus: &Bus, trajectories: &[Trajectory]) -> anyhow::Result<Vec<bytes::Bytes>> {
    let published = Instant::now();
    let mut request_bytes = Vec::with_capacity(trajectories.len() / GROUP_SIZE + 1);
    for group in trajectories.chunks(GROUP_SIZE) {
        let (partition, uid) = (&group[0].partition, &group[0].uid);
        let mut request = ScoreRequestBuilder::new(partition, uid);
        group.iter().for_each(|traj| request.add(traj));
        request_bytes.push(bytes::Bytes::from(request.wire_request().encode_to_vec()));
        score::publish_group(bus, partition, uid, group).await?;
    }
    println!(
        "  published {} trajectories and {} score requests in {:.2}s",
        trajectories.len(),
        request_bytes.len(),
        published.elapsed().as_secs_f64()
    );
    Ok(request_bytes)
}

/// Runs the service (its own `run`, in this process) until every group's reward batch is stored. The clock starts
/// when the service's consumer exists (it pulls at once): start-up (connecting, declaring, building the engine) is
/// left out, as the in-process figure leaves out building its engine; it is printed. Returns trajectories/s.
async fn service_pass(
    cfg: &JobConfig,
    bus: &Bus,
    server: &NatsServer,
    trajectories: usize,
    groups: usize,
) -> anyhow::Result<f64> {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let cpu_before = cpu_seconds_here_and(server.pid());
    let started = Instant::now();
    let service = tokio::spawn(jetrl_reward_service::run(cfg.clone(), async move {
        let _ = stopped.await;
    }));
    let score_stream = bus.stream(bus.names().score_stream()).await?;
    let consuming = loop {
        if score_stream.consumer_info(subjects::REWARD_CONSUMER).await.is_ok() {
            break Instant::now();
        }
        if started.elapsed() > SERVICE_DEADLINE || service.is_finished() {
            bail!("the service never created its consumer");
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    };
    let startup_s = consuming.duration_since(started).as_secs_f64();
    let mut consumer = score_stream
        .get_consumer::<async_nats::jetstream::consumer::pull::Config>(subjects::REWARD_CONSUMER)
        .await
        .map_err(|e| anyhow::anyhow!("reward consumer: {e}"))?;
    loop {
        // every request acknowledged: the service acknowledges a request only once its rewards are stored
        let info = consumer.info().await.context("reward consumer info")?;
        let settled = info.ack_floor.consumer_sequence as usize;
        if info.num_pending == 0 && info.num_ack_pending == 0 && settled >= groups {
            break;
        }
        if started.elapsed() > SERVICE_DEADLINE || service.is_finished() {
            bail!("the service acknowledged {settled} of {groups} score requests before stopping or the deadline");
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    // The service purges settled requests from SCORE once a second, in bulk; the pass is shorter than that, so
    // the purge it owes is done here, as the service would, and counted in its time.
    let rewards_s = consuming.elapsed().as_secs_f64();
    let ack_floor = consumer.info().await.context("reward consumer info")?.ack_floor.stream_sequence;
    if jetrl_reward_service::compact(&score_stream, ack_floor, 0).await < ack_floor {
        bail!("settled score requests were not purged");
    }
    let service_s = consuming.elapsed().as_secs_f64();
    let cpu_after = cpu_seconds_here_and(server.pid());
    let _ = stop.send(());
    service.await.context("service task")?.context("service")?;
    let rate = trajectories as f64 / service_s;
    println!(
        "  service: {trajectories} rewards in {service_s:.3}s ({rate:.0}/s; start-up before that {startup_s:.3}s, \
         {:.0}/s counting it; the purge of the settled requests took {:.3}s of it); CPU meanwhile: service \
         {:.2}s, nats-server {:.2}s",
        trajectories as f64 / (service_s + startup_s),
        service_s - rewards_s,
        cpu_after.0 - cpu_before.0,
        cpu_after.1 - cpu_before.1,
    );
    Ok(rate)
}

/// The same broker work per group as the service does, and nothing else: the score requests' bytes go to a
/// scratch stream; a durable consumer pulls each one; for every `per_message` requests pulled (the service's
/// largest micro-batch) one message of 100 bytes per trajectory (a reward's size) goes to a second scratch stream
/// with a `Nats-Msg-Id`, and the requests are acknowledged once their message is stored. No decoding, no scoring:
/// the rate (in trajectories) no reward service on this broker and machine can beat.
async fn broker_ceiling(
    bus: &Bus,
    requests: &[bytes::Bytes],
    per_request: usize,
    per_message: usize,
) -> anyhow::Result<f64> {
    const WINDOW: usize = 1024;
    use async_nats::jetstream::{stream, AckKind};
    for (name, subject) in [("BENCH_CEILING_IN", "bench.ceiling.in"), ("BENCH_CEILING_OUT", "bench.ceiling.out")] {
        bus.jetstream()
            .create_stream(stream::Config {
                name: name.into(),
                subjects: vec![subject.into()],
                storage: stream::StorageType::File,
                duplicate_window: jetrl_bus::topology::DEDUP_WINDOW,
                ..Default::default()
            })
            .await
            .context("scratch stream")?;
    }
    let mut publisher = Publisher::new(bus, WINDOW);
    for (i, request) in requests.iter().enumerate() {
        publisher.publish(Outgoing::new("bench.ceiling.in", Some(format!("r{i}")), request.clone())).await?;
    }
    publisher.drain().await?;
    let consumer = bus
        .shared_pull_consumer("BENCH_CEILING_IN", "bench-ceiling", "bench.ceiling.in", Duration::from_secs(30), 100_000)
        .await?;
    let started = Instant::now();
    let mut messages = consumer.stream().max_messages_per_batch(WINDOW).messages().await.context("pulling")?;
    let mut pending = Vec::with_capacity(WINDOW);
    let per_message = per_message.max(1);
    let payload = bytes::Bytes::from(vec![7u8; 100 * per_request * per_message]);
    let mut done = 0;
    while done < requests.len() {
        let msg = messages.next().await.context("scratch stream ended")?.context("pulling")?;
        pending.push(msg);
        done += 1;
        if pending.len().is_multiple_of(per_message) || done == requests.len() {
            let key = format!("out{done}");
            publisher.publish(Outgoing::new("bench.ceiling.out", Some(key), payload.clone())).await?;
        }
        if pending.len() >= WINDOW / 4 || done == requests.len() {
            publisher.drain().await?;
            for msg in pending.drain(..) {
                jetrl_bus::consume::settle(&msg, AckKind::Ack).await;
            }
        }
    }
    Ok((requests.len() * per_request) as f64 / started.elapsed().as_secs_f64())
}

/// Reads every reward and compares it with the in-process score of its key.
async fn check_rewards(bus: &Bus, expected: &HashMap<String, f64>) -> anyhow::Result<usize> {
    let stream = bus.stream(bus.names().rewards_stream()).await?;
    let consumer = stream
        .create_consumer(async_nats::jetstream::consumer::pull::OrderedConfig::default())
        .await
        .context("ordered consumer on REWARDS")?;
    let mut messages = consumer.messages().await.context("reading REWARDS")?;
    let mut seen = HashMap::new();
    while seen.len() < expected.len() {
        let msg = tokio::time::timeout(Duration::from_secs(10), messages.next())
            .await
            .context("REWARDS ended early")?
            .context("REWARDS ended")?
            .context("reading REWARDS")?;
        let batch = RewardBatch::decode(msg.payload.clone()).context("decoding a reward batch")?;
        for reward in batch.rewards {
            let Some(&want) = expected.get(&reward.key) else { bail!("reward for unknown key {}", reward.key) };
            if (reward.score - want).abs() > 1e-12 || !reward.failure_reason.is_empty() {
                bail!(
                    "{}: service scored {} ({:?}), in-process {want}",
                    reward.key,
                    reward.score,
                    reward.failure_reason
                );
            }
            if seen.insert(reward.key.clone(), reward.score).is_some() {
                bail!("two rewards for {}", reward.key);
            }
        }
    }
    Ok(seen.len())
}

/// The scorer input the service builds for a rule-scored trajectory.
fn score_input(traj: &Trajectory) -> ScoreInput {
    ScoreInput {
        key: traj.key.clone(),
        data_source: traj.data_source.clone(),
        solution_str: traj.response_text.clone(),
        ground_truth: traj.ground_truth.clone(),
        response_len: packed::u32_len(&traj.response_ids),
        ..ScoreInput::default()
    }
}

/// Trajectory `i`: session `i % 8` of prompt group `i / 8`. As in a verl dataset, a group's trajectories are
/// answers to one prompt, so they share its data source (one of four rule-scored sources, in turn by group),
/// ground truth and extra info; every other answer is correct. Reasoning text comes before the answer, and the
/// packed ids, mask and log-probs have the given lengths.
fn trajectory(i: usize, prompt_tokens: usize, response_tokens: usize) -> Trajectory {
    let group = i / GROUP_SIZE;
    let correct = i.is_multiple_of(2);
    let n = (group * 7919) % 1000;
    let given = if correct { n } else { n + 1 };
    let reasoning = format!(
        "Let me work through this carefully. We are given the quantities in the problem and need to combine them. \
         First, we multiply the first two numbers, then we account for the remainder, and finally we check the \
         result against the constraints stated in the question. Step {i}: the intermediate value is {n} and the \
         check passes, so we can state the final answer. "
    )
    .repeat(2);
    let (data_source, response, truth) = match group % 4 {
        0 => ("openai/gsm8k", format!("{reasoning}The total is {given}.\n#### {given}"), n.to_string()),
        1 => (
            "lighteval/MATH",
            format!("{reasoning}Simplifying, the answer is $\\boxed{{\\frac{{{given}}}{{2}}}}$."),
            format!("\\frac{{{n}}}{{2}}"),
        ),
        2 => ("math_dapo", format!("{reasoning}Answer: {given}"), n.to_string()),
        _ => {
            let digits = format!("{:04}", n);
            let reversed: String = digits.chars().rev().collect();
            let answer = if correct { reversed.clone() } else { digits.clone() };
            ("jetrl/reverse", answer, reversed)
        }
    };
    let uid = format!("bench{}", i / GROUP_SIZE);
    let session = (i % GROUP_SIZE) as u32;
    let ids: Vec<u32> = (0..response_tokens as u32).map(|t| (t * 31 + i as u32) % 50_000).collect();
    Trajectory {
        key: TrajectoryKey::new(uid.clone(), session, 0).to_string(),
        uid,
        session_id: session,
        partition: "train".into(),
        prompt_ids: packed::pack_u32(&(0..prompt_tokens as u32).collect::<Vec<_>>()),
        response_ids: packed::pack_u32(&ids),
        response_mask: packed::pack_u8(&vec![1; response_tokens]),
        logprobs: packed::pack_f32(&vec![-0.5; response_tokens]),
        timings: Some(Timings { completed_unix_ms: jetrl_wire::now_unix_ms(), ..Timings::default() }),
        response_text: response,
        data_source: data_source.into(),
        ground_truth: truth,
        extra_info_json: format!("{{\"index\": {group}, \"split\": \"train\"}}"),
        ..Trajectory::default()
    }
}
