//! Bad input and dead processes, against real nats-server, real services and the real tiny model.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use jetrl_bus::publish::Outgoing;
use jetrl_bus::{Bus, GroupStore};
use jetrl_tests::{run_binary, TestJob};
use jetrl_wire::v1::{GroupState, SampleRequest, SampleResponse};
use jetrl_wire::Message;

const SERVICES: [&str; 5] =
    ["jetrl-trainer", "jetrl-rollout-worker", "jetrl-reward-service", "jetrl-replay-buffer", "jetrl-checkpoint-sync"];

#[test]
#[ignore = "slow tier: services killed and messages lost mid-run"]
fn unknown_config_key_is_named_by_every_service() {
    let job = TestJob::new("");
    let config = job.config.display().to_string();
    for binary in SERVICES {
        let (status, out) = run_binary(binary, &["--config", &config, "actor.optim.lrr=0.1"], Duration::from_secs(30));
        assert!(!status.success(), "{binary} accepted an unknown key");
        assert!(out.contains("actor.optim.lrr"), "{binary} did not name the key: {out}");
    }
    // in the file, nested
    let bad = job.dir.path().join("bad.yaml");
    std::fs::write(&bad, "rollout:\n  temprature: 0.5\n").unwrap();
    let (status, out) =
        run_binary("jetrl-replay-buffer", &["--config", &bad.display().to_string()], Duration::from_secs(30));
    assert!(!status.success());
    assert!(out.contains("rollout.temprature"), "{out}");
}

#[test]
#[ignore = "slow tier: services killed and messages lost mid-run"]
fn unreachable_nats_url_is_named_after_retrying_with_backoff() {
    let job = TestJob::new("");
    let config = job.config.display().to_string();
    for binary in SERVICES {
        let started = Instant::now();
        let (status, out) = run_binary(
            binary,
            &["--config", &config, "nats.url=nats://127.0.0.1:1", "nats.connect_timeout_s=1.5"],
            Duration::from_secs(60),
        );
        assert!(!status.success(), "{binary} started without NATS");
        assert!(out.contains("nats://127.0.0.1:1"), "{binary} did not name the URL: {out}");
        assert!(out.contains("attempts"), "{binary} did not retry: {out}");
        assert!(started.elapsed() >= Duration::from_millis(900), "{binary} gave up without backing off");
    }
}

fn free_addr() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

async fn scrape(addr: &str) -> String {
    let addr: SocketAddr = addr.parse().unwrap();
    jetrl_telemetry::scrape(addr).await.unwrap_or_default()
}

/// Value of `name{...source="<source>"...}` in a Prometheus text page, if present.
fn counter(page: &str, name: &str, source: &str) -> f64 {
    page.lines()
        .filter(|l| l.starts_with(name) && l.contains(&format!("source=\"{source}\"")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow tier: services killed and messages lost mid-run"]
async fn malformed_message_on_each_subject_is_counted_set_aside_and_services_keep_going() {
    let ports: HashMap<&str, String> =
        ["rollout", "reward", "buffer", "checkpoint", "trainer"].into_iter().map(|s| (s, free_addr())).collect();
    let mut job = TestJob::new("trainer: {total_training_steps: 2}");
    let cfg = job.config();
    let addr = |k: &str| ports[k].clone();
    job.spawn(
        "checkpoint-sync",
        "jetrl-checkpoint-sync",
        &[&format!("checkpoint.metrics_addr={}", addr("checkpoint"))],
    );
    job.spawn("replay-buffer", "jetrl-replay-buffer", &[&format!("buffer.metrics_addr={}", addr("buffer"))]);
    job.spawn("reward-0", "jetrl-reward-service", &[&format!("reward.metrics_addr={}", addr("reward"))]);
    job.spawn("rollout-0", "jetrl-rollout-worker", &[&format!("rollout.metrics_addr={}", addr("rollout"))]);

    let bus = Bus::connect_job(&cfg, "fault-test").await.unwrap();
    bus.declare_topology().await.unwrap();
    let names = bus.names().clone();
    let garbage = bytes::Bytes::from_static(&[0xff, 0xff, 0xff, 0x01]);
    // a task, a score request (for a group with a stored trajectory: that must still get a reward) and a reward
    // that do not decode
    bus.publish_durable(Outgoing::new(names.prompt_subject("train"), None, garbage.clone())).await.unwrap();
    bus.publish_durable(Outgoing::new(names.traj_subject("train", "junk"), Some("junk_0_0".into()), garbage.clone()))
        .await
        .unwrap();
    bus.publish_durable(Outgoing::new(names.score_subject("train", "junk"), None, garbage.clone())).await.unwrap();
    // (under another key: the reward service's own reward for `junk_0_0` is checked below)
    bus.publish_durable(Outgoing::new(names.reward_batch_subject("train"), None, garbage.clone())).await.unwrap();
    // a group record that does not decode, and a weight manifest that does not decode
    let groups = bus.key_value(names.groups_bucket()).await.unwrap();
    groups.put("train.garbage", garbage.clone()).await.unwrap();
    let weights = bus.key_value(names.weights_bucket()).await.unwrap();
    weights.put("latest", garbage.clone()).await.unwrap();
    // requests that do not decode get an error reply naming the message type
    let timeout = Duration::from_secs(20);
    let reply = async |subject: &str| -> Vec<u8> {
        let deadline = Instant::now() + timeout;
        loop {
            let req = async_nats::Request::new().payload(garbage.clone()).timeout(Some(timeout));
            match bus.client().send_request(subject.to_string(), req).await {
                Ok(m) => return m.payload.to_vec(),
                Err(_) if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(200)).await,
                Err(e) => panic!("{subject}: {e}"),
            }
        }
    };
    let sample: SampleResponse = SampleResponse::decode(reply(names.buffer_sample()).await.as_slice()).unwrap();
    assert!(sample.error.contains("SampleRequest"), "{sample:?}");
    let ann = jetrl_wire::v1::WeightAnnounceResponse::decode(reply(names.weights_announce()).await.as_slice()).unwrap();
    assert!(ann.error.contains("WeightAnnounce"), "{ann:?}");
    let rel = jetrl_wire::v1::ReleaseResponse::decode(reply(names.buffer_release()).await.as_slice()).unwrap();
    assert!(rel.error.contains("ReleaseRequest"), "{rel:?}");

    // The rollout worker sees the undecodable manifest before the trainer announces real weights over it.
    let deadline = Instant::now() + Duration::from_secs(120);
    while counter(&scrape(&addr("rollout")).await, "jetrl_rollout_malformed_messages_total", names.weights_bucket())
        < 1.0
    {
        assert!(Instant::now() < deadline, "rollout worker never counted the bad manifest:\n{}", job.log("rollout-0"));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // The undecodable score request was set aside, but its group's stored trajectory still got a (zero, failed)
    // reward under its key. (Read before training: the buffer forgets, and then purges, rewards whose group record
    // never comes, after a while.)
    let deadline = Instant::now() + Duration::from_secs(60);
    let junk = loop {
        let found: Vec<_> =
            jetrl_bus::score::stored_rewards(&bus).await.unwrap().into_iter().filter(|r| r.key == "junk_0_0").collect();
        if !found.is_empty() {
            break found;
        }
        assert!(Instant::now() < deadline, "no reward for junk_0_0:\n{}", job.log("reward-0"));
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(junk.len(), 1, "{junk:?}");
    assert!(junk[0].failure_reason.contains("malformed"), "{:?}", junk[0]);

    // The services keep going: a whole training run completes.
    job.spawn("trainer", "jetrl-trainer", &[&format!("trainer.metrics_addr={}", addr("trainer"))]);
    let status = tokio::task::block_in_place(|| job.wait("trainer", Duration::from_secs(180)));
    assert!(status.success(), "trainer failed:\n{}", job.log("trainer"));
    assert_eq!(job.metrics().len(), 2);

    let rollout = scrape(&addr("rollout")).await;
    assert!(counter(&rollout, "jetrl_rollout_malformed_messages_total", names.prompts_stream()) >= 1.0, "{rollout}");
    assert!(counter(&rollout, "jetrl_rollout_malformed_messages_total", names.weights_bucket()) >= 1.0, "{rollout}");
    let reward = scrape(&addr("reward")).await;
    assert!(counter(&reward, "jetrl_reward_malformed_messages_total", names.score_stream()) >= 1.0, "{reward}");
    let buffer = scrape(&addr("buffer")).await;
    for source in [names.rewards_stream(), names.groups_bucket(), names.buffer_sample(), names.buffer_release()] {
        assert!(counter(&buffer, "jetrl_buffer_malformed_messages_total", source) >= 1.0, "{source}: {buffer}");
    }
    let checkpoint = scrape(&addr("checkpoint")).await;
    assert!(
        counter(&checkpoint, "jetrl_checkpoint_malformed_messages_total", names.weights_announce()) >= 1.0,
        "{checkpoint}"
    );

    // each refused message also waits in the job's dead-letter stream, under the service that refused it, with
    // where it came from and why
    let dlq = bus.stream(names.dlq_stream()).await.unwrap();
    for service in ["rollout", "reward", "buffer", "checkpoint"] {
        let letter = dlq.direct_get_last_for_subject(names.dlq_subject(service)).await.unwrap_or_else(|e| {
            panic!("no dead letter from {service}: {e}");
        });
        let header = |name: &str| letter.headers.get(name).map(|v| v.as_str().to_string()).unwrap_or_default();
        assert_eq!(header("Jetrl-Service"), service);
        assert!(
            !header("Jetrl-Subject").is_empty() && header("Jetrl-Reason").contains("malformed"),
            "{service}: {letter:?}"
        );
    }
    assert_eq!(sample.code(), jetrl_wire::v1::ErrorCode::Malformed, "{sample:?}");

    // and the malformed sample request did not stop the buffer from answering a real one
    let ok: SampleResponse = bus
        .request(
            names.buffer_sample(),
            &SampleRequest {
                request_id: "probe".into(),
                step: 99,
                partition: "nothing".into(),
                batch_size: 0,
                wait_ms: 10,
                ..Default::default()
            },
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    assert!(ok.error.is_empty());
}

/// Counts group records by state and by worker.
async fn group_states(store: &GroupStore) -> (HashMap<i32, usize>, HashMap<String, usize>) {
    let mut by_state = HashMap::new();
    let mut by_worker = HashMap::new();
    for s in jetrl_tests::group_records(store).await {
        *by_state.entry(s.state).or_insert(0) += 1;
        *by_worker.entry(s.worker_id).or_insert(0) += 1;
    }
    (by_state, by_worker)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow tier: services killed and messages lost mid-run"]
async fn a_killed_rollout_workers_prompts_are_redelivered_and_nothing_is_lost() {
    // One group per engine batch, so worker A is still holding unfinished groups when it is killed.
    let mut job = TestJob::new(
        "data: {train_batch_size: 32}\nrollout: {n: 8, max_num_seqs: 8, ack_wait_s: 2}\ntrainer: {total_training_steps: 1}",
    );
    let cfg = job.config();
    job.spawn("checkpoint-sync", "jetrl-checkpoint-sync", &[]);
    job.spawn("replay-buffer", "jetrl-replay-buffer", &[]);
    job.spawn("reward-0", "jetrl-reward-service", &[]);
    job.spawn("rollout-a", "jetrl-rollout-worker", &["rollout.instance_id=worker-a"]);
    job.spawn("trainer", "jetrl-trainer", &[]);

    let bus = Bus::connect_job(&cfg, "fault-test").await.unwrap();
    bus.declare_topology().await.unwrap();
    let store = GroupStore::open(&bus).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let (states, _) = group_states(&store).await;
        let finished = states.get(&(GroupState::Finished as i32)).copied().unwrap_or(0);
        let open = states.get(&(GroupState::Pending as i32)).copied().unwrap_or(0)
            + states.get(&(GroupState::Running as i32)).copied().unwrap_or(0);
        if finished >= 1 && open >= 1 {
            break;
        }
        assert!(Instant::now() < deadline, "worker A never got going:\n{}", job.log("rollout-a"));
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    job.kill("rollout-a");
    job.spawn("rollout-b", "jetrl-rollout-worker", &["rollout.instance_id=worker-b"]);
    let status = tokio::task::block_in_place(|| job.wait("trainer", Duration::from_secs(180)));
    assert!(status.success(), "trainer failed:\n{}", job.log("trainer"));
    let metrics = job.metrics();
    assert_eq!(metrics[0]["training/num_groups"].as_f64(), Some(32.0), "a group was lost: {:?}", metrics[0]);
    assert_eq!(metrics[0]["training/num_trajectories"].as_f64(), Some(256.0));
    let (_, by_worker) = group_states(&store).await;
    assert!(by_worker.get("worker-a").copied().unwrap_or(0) >= 1, "{by_worker:?}");
    assert!(by_worker.get("worker-b").copied().unwrap_or(0) >= 1, "B must have taken over A's groups: {by_worker:?}");
}
