//! `just bench reward`: rule-scored trajectories per second through the reward service (a real nats-server, the
//! service's own `run`) against `RewardEngine::score_batch` called in-process on the same inputs, in the same run.
//!
//! 1. start nats-server, pre-publish M trajectories (openai/gsm8k, lighteval/MATH, math_dapo, jetrl/reverse, half
//!    of them correct) into TRAJ;
//! 2. start the service and time until all M rewards are in REWARDS → `service_per_s`; check every reward
//!    against the in-process score of the same trajectory;
//! 3. score the same inputs in-process in batches of `reward.batch_size` (best of three passes) →
//!    `inprocess_per_s`.
//!
//! The last line printed is `{"bench":"reward","service_per_s":…,"inprocess_per_s":…,"ratio":…}`.
//! Usage: `jetrl-reward-bench [--trajectories M] [--response-tokens N] [key=value reward overrides...]`.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use futures::StreamExt;
use jetrl_bus::publish::Outgoing;
use jetrl_bus::{Bus, NatsServer, Publisher};
use jetrl_config::JobConfig;
use jetrl_reward::{RewardEngine, ScoreInput};
use jetrl_wire::keys::TrajectoryKey;
use jetrl_wire::v1::{Reward, Timings, Trajectory};
use jetrl_wire::{packed, subjects, Message};

/// How long the service may take for all rewards before the bench gives up.
const SERVICE_DEADLINE: Duration = Duration::from_secs(600);
const IN_PROCESS_PASSES: usize = 3;
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
    jetrl_telemetry::init_tracing("warn", "text");
    let server = NatsServer::start().context("starting nats-server")?;
    // Only the reward section matters here; the rest of the job stays at its defaults.
    let mut cfg = JobConfig {
        reward: jetrl_config::load(None, &args.overrides).context("reward overrides")?,
        ..JobConfig::default()
    };
    cfg.reward.validate().context("reward overrides")?;
    cfg.nats.url = server.url();
    cfg.reward.metrics_addr = "127.0.0.1:0".into();

    let trajectories: Vec<Trajectory> =
        (0..args.trajectories).map(|i| trajectory(i, args.prompt_tokens, args.response_tokens)).collect();
    let payload_bytes: usize = trajectories.iter().map(Message::encoded_len).sum::<usize>() / trajectories.len();
    let bus = Bus::connect(&cfg.nats, "jetrl-reward-bench").await?;
    bus.declare_topology().await?;
    let published = Instant::now();
    let mut publisher = Publisher::new(&bus, 1024);
    for traj in &trajectories {
        let subject = subjects::traj_subject(&traj.partition, &traj.uid);
        publisher.publish(Outgoing::protobuf(subject, Some(traj.key.clone()), traj)).await?;
    }
    publisher.drain().await?;
    let publish_s = published.elapsed().as_secs_f64();
    println!(
        "pre-published {} trajectories ({payload_bytes} B each) in {publish_s:.2}s ({:.0}/s)",
        trajectories.len(),
        trajectories.len() as f64 / publish_s
    );

    // The service, in this process, on the same runtime as the poller below.
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let service_cfg = cfg.clone();
    let started = Instant::now();
    let service = tokio::spawn(jetrl_reward_service::run(service_cfg, async move {
        let _ = stopped.await;
    }));
    let rewards = bus.stream(subjects::REWARDS_STREAM).await?;
    let mut first_reward = None;
    loop {
        let stored = rewards.get_info().await.map(|info| info.state.messages as usize).unwrap_or(0);
        if stored > 0 && first_reward.is_none() {
            first_reward = Some(started.elapsed());
        }
        if stored >= trajectories.len() {
            break;
        }
        if started.elapsed() > SERVICE_DEADLINE || service.is_finished() {
            bail!("the service stored {stored} of {} rewards before stopping or the deadline", trajectories.len());
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let service_s = started.elapsed().as_secs_f64();
    let _ = stop.send(());
    service.await.context("service task")?.context("service")?;
    let service_per_s = trajectories.len() as f64 / service_s;
    println!(
        "service: {} rewards in {service_s:.2}s ({service_per_s:.0}/s; first after {:.3}s; max_inflight {}, batch_size {})",
        trajectories.len(),
        first_reward.unwrap_or_default().as_secs_f64(),
        cfg.reward.max_inflight,
        cfg.reward.batch_size
    );

    let page = jetrl_telemetry::prometheus().render();
    let batches = page
        .lines()
        .find_map(|line| line.strip_prefix("jetrl_reward_batch_seconds_count "))
        .and_then(|count| count.trim().parse::<f64>().ok())
        .unwrap_or(0.0);
    if batches > 0.0 {
        println!(
            "service scored {batches:.0} micro-batches, {:.1} trajectories each",
            trajectories.len() as f64 / batches
        );
    }

    // In-process: the same scorer inputs, in the service's batch size.
    let engine = RewardEngine::new(&cfg.reward).await?;
    let inputs: Vec<ScoreInput> = trajectories.iter().map(score_input).collect();
    let batch_size = (cfg.reward.batch_size.max(1) as usize).min(cfg.reward.max_inflight.max(1) as usize);
    let mut best_s = f64::INFINITY;
    let mut expected = HashMap::new();
    for _ in 0..IN_PROCESS_PASSES {
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
    println!(
        "in-process: {} scored in {best_s:.3}s ({inprocess_per_s:.0}/s, best of {IN_PROCESS_PASSES})",
        inputs.len()
    );

    let checked = check_rewards(&bus, &expected).await?;
    println!("checked {checked} rewards: one per trajectory, each equal to the in-process score");
    let ceiling_per_s = broker_ceiling(&bus, &trajectories).await?;
    println!(
        "broker ceiling: {ceiling_per_s:.0}/s (pull each trajectory, publish a 100-byte message with its key as \
         Nats-Msg-Id, ack: no decoding, no scoring); service at {:.0}% of it",
        100.0 * service_per_s / ceiling_per_s
    );
    let ratio = service_per_s / inprocess_per_s;
    // Written by hand so the keys keep this order.
    println!(
        "{{\"bench\":\"reward\",\"service_per_s\":{service_per_s:.0},\"inprocess_per_s\":{inprocess_per_s:.0},\"ratio\":{ratio:.3}}}"
    );
    drop(server);
    Ok(())
}

/// The same broker work per trajectory as the service does, and nothing else: a second durable consumer on TRAJ
/// pulls every trajectory, a 100-byte message per trajectory goes to a scratch stream with the trajectory key as
/// `Nats-Msg-Id`, and the trajectories are acknowledged once their messages are stored. No decoding, no scoring:
/// the rate no reward service on this broker and machine can beat.
async fn broker_ceiling(bus: &Bus, trajectories: &[Trajectory]) -> anyhow::Result<f64> {
    const WINDOW: usize = 1024;
    use async_nats::jetstream::{stream, AckKind};
    bus.jetstream()
        .create_stream(stream::Config {
            name: "BENCH_CEILING".into(),
            subjects: vec!["bench.ceiling.>".into()],
            storage: stream::StorageType::File,
            duplicate_window: jetrl_bus::topology::DEDUP_WINDOW,
            ..Default::default()
        })
        .await
        .context("scratch stream")?;
    let consumer = bus
        .shared_pull_consumer(subjects::TRAJ_STREAM, "bench-ceiling", "jetrl.traj.>", Duration::from_secs(30), 100_000)
        .await?;
    let started = Instant::now();
    let mut messages = consumer.stream().max_messages_per_batch(WINDOW).messages().await.context("pulling TRAJ")?;
    let mut publisher = Publisher::new(bus, WINDOW);
    let mut pending = Vec::with_capacity(WINDOW);
    let payload = bytes::Bytes::from(vec![7u8; 100]);
    let mut done = 0;
    while done < trajectories.len() {
        let msg = messages.next().await.context("TRAJ ended")?.context("pulling TRAJ")?;
        let key = msg.headers.as_ref().and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID)).map(|v| v.to_string());
        publisher.publish(Outgoing::new("bench.ceiling.x", key, payload.clone())).await?;
        pending.push(msg);
        done += 1;
        if pending.len() >= WINDOW / 4 || done == trajectories.len() {
            publisher.drain().await?;
            for msg in pending.drain(..) {
                jetrl_bus::consume::settle(&msg, AckKind::Ack).await;
            }
        }
    }
    Ok(trajectories.len() as f64 / started.elapsed().as_secs_f64())
}

/// Reads every reward and compares it with the in-process score of its key.
async fn check_rewards(bus: &Bus, expected: &HashMap<String, f64>) -> anyhow::Result<usize> {
    let stream = bus.stream(subjects::REWARDS_STREAM).await?;
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
        let reward = Reward::decode(msg.payload.clone()).context("decoding a reward")?;
        let Some(&want) = expected.get(&reward.key) else { bail!("reward for unknown key {}", reward.key) };
        if (reward.score - want).abs() > 1e-12 || !reward.failure_reason.is_empty() {
            bail!("{}: service scored {} ({:?}), in-process {want}", reward.key, reward.score, reward.failure_reason);
        }
        if seen.insert(reward.key.clone(), reward.score).is_some() {
            bail!("two rewards for {}", reward.key);
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

/// Trajectory `i`: one of four rule-scored sources in turn, every other one answered correctly, with reasoning
/// text before the answer and packed ids, mask and log-probs of the given lengths.
fn trajectory(i: usize, prompt_tokens: usize, response_tokens: usize) -> Trajectory {
    let correct = (i / 4) & 1 == 0;
    let n = (i * 7919) % 1000;
    let given = if correct { n } else { n + 1 };
    let reasoning = format!(
        "Let me work through this carefully. We are given the quantities in the problem and need to combine them. \
         First, we multiply the first two numbers, then we account for the remainder, and finally we check the \
         result against the constraints stated in the question. Step {i}: the intermediate value is {n} and the \
         check passes, so we can state the final answer. "
    )
    .repeat(2);
    let (data_source, response, truth) = match i % 4 {
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
        extra_info_json: format!("{{\"index\": {i}, \"split\": \"train\"}}"),
        ..Trajectory::default()
    }
}
