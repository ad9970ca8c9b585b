//! The rollout worker as a service, against a real nats-server and the real tiny model: groups become
//! trajectories (one per session, stored once) with the group's terminal status last; the trajectories carry
//! the log-probs the trainer recomputes and the weight version they were sampled under; a stopped worker naks
//! what it holds and another finishes it.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

mod common;

use std::net::TcpListener;
use std::path::Path;
use std::time::{Duration, Instant};

use futures::StreamExt;
use jetrl_bus::publish::Outgoing;
use jetrl_bus::weights::{manifest_for, WeightTransport};
use jetrl_bus::{consume, Bus, GroupStore, NatsServer, Publisher};
use jetrl_config::JobConfig;
use jetrl_model::{log_probs_of, CausalLm, DType};
use jetrl_wire::v1::{self, GroupState, GroupStatus, Heartbeat, PromptTask, Trajectory};
use jetrl_wire::{packed, Message};
use tch::Device;
use tokio::sync::oneshot;

fn free_addr() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().to_string()
}

fn config(nats: &NatsServer, model: &Path) -> JobConfig {
    let mut cfg = JobConfig::default();
    cfg.nats.url = nats.url();
    cfg.nats.connect_timeout_s = 20.0;
    cfg.model.path = model.display().to_string();
    cfg.data.max_prompt_length = 64;
    cfg.data.max_response_length = 24;
    cfg.rollout.n = 4;
    cfg.rollout.max_num_seqs = 16;
    cfg.rollout.ack_wait_s = 2.0;
    cfg.rollout.heartbeat_interval_s = 0.3;
    cfg.rollout.metrics_addr = free_addr();
    cfg
}

/// A running worker and the sender that stops it.
struct Running {
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), jetrl_rollout_worker::RolloutError>>,
}

fn start(cfg: JobConfig) -> Running {
    let (stop, rx) = oneshot::channel::<()>();
    let task = tokio::spawn(jetrl_rollout_worker::run(cfg, async move {
        let _ = rx.await;
    }));
    Running { stop: Some(stop), task }
}

impl Running {
    async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let result = tokio::time::timeout(Duration::from_secs(60), self.task).await.expect("worker stops");
        result.expect("worker task").expect("worker ran cleanly");
    }
}

/// Writes the pending record and publishes the task, as the trainer does.
async fn submit(bus: &Bus, groups: &GroupStore, task: PromptTask) {
    let mut status = GroupStatus {
        uid: task.uid.clone(),
        partition: task.partition.clone(),
        n: task.n,
        task: Some(task.clone()),
        ..Default::default()
    };
    status.set_state(GroupState::Pending);
    groups.create(&status).await.unwrap();
    let mut publisher = Publisher::new(bus, 16);
    let subject = bus.names().prompt_subject(&task.partition);
    publisher.publish(Outgoing::protobuf(subject, Some(task.uid.clone()), &task)).await.unwrap();
    publisher.drain().await.unwrap();
}

fn task(uid: &str, n: u32, prompt: &[u32], temperature: f32) -> PromptTask {
    PromptTask {
        uid: uid.into(),
        partition: "train".into(),
        n,
        sampling: Some(v1::SamplingParams { temperature, top_p: 1.0, top_k: -1, ..Default::default() }),
        prompt_ids: packed::pack_u32(prompt),
        data_source: "test".into(),
        ..Default::default()
    }
}

async fn wait_terminal(groups: &GroupStore, uid: &str, timeout: Duration) -> GroupStatus {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some((status, _)) = groups.get("train", uid).await.unwrap() {
            if matches!(status.state(), GroupState::Finished | GroupState::Failure) {
                return status;
            }
        }
        assert!(Instant::now() < deadline, "group {uid} did not settle in {timeout:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Every trajectory stored so far, by key.
async fn trajectories(bus: &Bus, reader: &str) -> std::collections::BTreeMap<String, Trajectory> {
    let consumer = bus
        .shared_pull_consumer(
            bus.names().traj_stream(),
            reader,
            &bus.names().traj_filter(),
            Duration::from_secs(30),
            10_000,
        )
        .await
        .unwrap();
    let mut out = std::collections::BTreeMap::new();
    loop {
        let batch = consume::pull_collect(&consumer, 1000, Duration::from_millis(300)).await.unwrap();
        if batch.is_empty() {
            break;
        }
        for msg in batch {
            let traj = Trajectory::decode(msg.payload.as_ref()).unwrap();
            out.insert(traj.key.clone(), traj);
            let _ = msg.ack().await;
        }
    }
    out
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32).map(|i| 3 + (i * 7 + salt) % 60).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groups_become_one_trajectory_per_session_with_trainer_logprobs_and_the_terminal_status_last() {
    let nats = NatsServer::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    jetrl_model::init_model("tiny", dir.path(), 3).unwrap();
    let cfg = config(&nats, dir.path());
    let metrics_addr = cfg.rollout.metrics_addr.clone();
    let bus = Bus::connect_job(&cfg, "test").await.unwrap();
    bus.declare_topology().await.unwrap();
    let groups = GroupStore::open(&bus).await.unwrap();
    let worker = start(cfg);

    let prompts: Vec<Vec<u32>> = (0..3).map(|i| prompt(10 + 3 * i, i as u32)).collect();
    for (i, p) in prompts.iter().enumerate() {
        submit(&bus, &groups, task(&format!("g{i}"), 4, p, 1.0)).await;
    }
    let mut chat = task("chat", 2, &[], 1.0);
    chat.prompt_ids.clear();
    chat.messages = vec![v1::ChatMessage { role: "user".into(), content: "reverse 1234".into() }];
    chat.agent_name = "tool_agent".into();
    submit(&bus, &groups, chat).await;
    let mut bad = task("bad", 2, &prompts[0], 1.0);
    bad.agent_name = "telepathy_agent".into();
    submit(&bus, &groups, bad).await;

    for i in 0..3 {
        let status = wait_terminal(&groups, &format!("g{i}"), Duration::from_secs(60)).await;
        assert_eq!(status.state(), GroupState::Finished, "{status:?}");
        let keys: Vec<String> = (0..4).map(|s| format!("g{i}_{s}_0")).collect();
        assert_eq!(status.trajectory_keys, keys);
    }
    let chat = wait_terminal(&groups, "chat", Duration::from_secs(60)).await;
    assert_eq!(chat.state(), GroupState::Finished, "{chat:?}");
    let bad = wait_terminal(&groups, "bad", Duration::from_secs(60)).await;
    assert_eq!(bad.state(), GroupState::Failure);
    assert!(bad.failure_reason.contains("unknown agent loop"), "{}", bad.failure_reason);

    let stored = trajectories(&bus, "reader-1").await;
    assert_eq!(stored.len(), 3 * 4 + 2, "one trajectory per session, each stored once");
    let model = CausalLm::load(dir.path(), Device::Cpu, DType::F32).unwrap();
    let (mut sum, mut count, mut max) = (0.0f64, 0usize, 0.0f32);
    for (key, t) in &stored {
        let prompt = packed::unpack_u32(&t.prompt_ids).unwrap();
        let response = packed::unpack_u32(&t.response_ids).unwrap();
        let logprobs = packed::unpack_f32(&t.logprobs).unwrap();
        let mask = t.response_mask.to_vec();
        assert!(!response.is_empty() && response.len() <= 24, "{key}");
        assert_eq!(logprobs.len(), response.len());
        assert_eq!(mask.len(), response.len());
        assert_eq!((t.min_version, t.max_version), (0, 0));
        if key.starts_with("chat") {
            assert_eq!(t.agent_name, "tool_agent");
            assert_eq!(t.raw_prompt.len(), 1, "the chat messages travel with the trajectory");
            assert!(
                ["no_tool_call", "length", "response_budget"].contains(&t.stop_reason.as_str()),
                "{}",
                t.stop_reason
            );
        } else {
            assert_eq!(t.agent_name, "single_turn_agent");
            assert_eq!(t.num_turns, 2);
            assert!(mask.iter().all(|&m| m == 1));
        }
        // The trainer's recomputation on the same weights (temperature 1).
        let ids: Vec<u32> = prompt.iter().chain(&response).copied().collect();
        let recomputed = log_probs_of(&model, &ids).unwrap();
        for (j, &lp) in logprobs.iter().enumerate() {
            if mask[j] == 1 {
                let d = (lp - recomputed[prompt.len() - 1 + j]).abs();
                sum += f64::from(d);
                max = max.max(d);
                count += 1;
            }
        }
        let finish = if t.finish_reason == v1::FinishReason::Length as i32 { "length" } else { "stop" };
        assert!(finish == "length" || [0u32, 2].contains(response.last().unwrap()) || key.starts_with("chat"));
    }
    let mean = sum / count as f64;
    println!("rollout vs recomputed log-probs over {count} tokens: mean {mean:.3e} max {max:.3e}");
    assert!(mean <= 1e-4, "mean |Δ| {mean}");

    // Heartbeat with the version and the engine's load; metrics on the endpoint.
    let kv = bus.key_value(bus.names().workers_bucket()).await.unwrap();
    let mut keys = kv.keys().await.unwrap();
    let key = keys.next().await.unwrap().unwrap();
    let beat = Heartbeat::decode(kv.get(&key).await.unwrap().unwrap().as_ref()).unwrap();
    assert_eq!((beat.service.as_str(), beat.policy_version), ("rollout", 0));
    let metrics = jetrl_telemetry::scrape(metrics_addr.parse().unwrap()).await.unwrap();
    for name in [
        "jetrl_rollout_generated_tokens_total",
        "jetrl_rollout_batch_occupancy_ratio",
        "jetrl_rollout_kv_cache_usage_ratio",
        "jetrl_rollout_queue_depth_sequences",
        "jetrl_rollout_time_to_first_token_seconds",
        "jetrl_rollout_generation_tokens_per_second",
        "jetrl_rollout_trajectories_total{version_lag=\"0\"",
    ] {
        assert!(metrics.contains(name), "{name} missing from /metrics:\n{metrics}");
    }
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_weight_version_is_swapped_in_and_stamped_on_the_trajectories_sampled_under_it() {
    let nats = NatsServer::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    jetrl_model::init_model("tiny", dir.path(), 4).unwrap();
    let cfg = config(&nats, dir.path());
    let bus = Bus::connect_job(&cfg, "test").await.unwrap();
    bus.declare_topology().await.unwrap();
    let groups = GroupStore::open(&bus).await.unwrap();
    let worker = start(cfg);

    // Version 7: the same architecture, other weights (what checkpoint-sync would announce).
    let other = tempfile::tempdir().unwrap();
    jetrl_model::init_model("tiny", other.path(), 99).unwrap();
    let model_v7 = CausalLm::load(other.path(), Device::Cpu, DType::F32).unwrap();
    let blob = bytes::Bytes::from(model_v7.to_safetensors_bytes().unwrap());
    let location =
        bus.store_weights(&WeightTransport::ObjectStore { chunk_bytes: 1 << 20 }, 7, blob.clone()).await.unwrap();
    let manifest = manifest_for(&blob, 7, 7, &location).unwrap();
    let kv = bus.key_value(bus.names().weights_bucket()).await.unwrap();
    kv.put("latest", manifest.encode_to_vec().into()).await.unwrap();

    let workers = bus.key_value(bus.names().workers_bucket()).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let mut keys = workers.keys().await.unwrap();
        let mut version = 0;
        while let Some(Ok(key)) = keys.next().await {
            if let Ok(Some(value)) = workers.get(&key).await {
                version = Heartbeat::decode(value.as_ref()).unwrap().policy_version;
            }
        }
        if version == 7 {
            break;
        }
        assert!(Instant::now() < deadline, "the worker never reported version 7");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let p = prompt(12, 5);
    submit(&bus, &groups, task("after", 3, &p, 1.0)).await;
    let status = wait_terminal(&groups, "after", Duration::from_secs(60)).await;
    assert_eq!(status.state(), GroupState::Finished);
    let stored = trajectories(&bus, "reader-2").await;
    assert_eq!(stored.len(), 3);
    for t in stored.values() {
        assert_eq!((t.min_version, t.max_version), (7, 7));
        let response = packed::unpack_u32(&t.response_ids).unwrap();
        let logprobs = packed::unpack_f32(&t.logprobs).unwrap();
        let ids: Vec<u32> = p.iter().chain(&response).copied().collect();
        let recomputed = log_probs_of(&model_v7, &ids).unwrap();
        for (j, lp) in logprobs.iter().enumerate() {
            assert!((lp - recomputed[p.len() - 1 + j]).abs() < 1e-3, "sampled under the new weights");
        }
    }
    worker.stop().await;
}

/// The first worker is the colocated one and is paused (as the trainer pauses it) before the group comes: it
/// takes the group, marks it running, and cannot decode a token of it, so its stop always finds the group
/// unfinished, whatever the machine's speed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_worker_naks_the_group_it_cannot_finish_and_another_worker_completes_it() {
    let nats = NatsServer::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    jetrl_model::init_model("tiny", dir.path(), 5).unwrap();
    // EOS outside the vocabulary: every sequence runs its full budget.
    std::fs::write(dir.path().join("generation_config.json"), "{\"eos_token_id\": [1000]}").unwrap();
    let mut cfg = config(&nats, dir.path());
    cfg.data.max_response_length = 48;
    cfg.rollout.max_num_seqs = 64;
    cfg.rollout.ack_wait_s = 1.0;
    cfg.rollout.instance_id = Some("first".into());
    cfg.trainer.mode = jetrl_config::TrainerMode::ColocateAsync;
    cfg.trainer.colocate_async.rollout_instance = Some("first".into());
    cfg.trainer.colocate_async.handshake_timeout_s = 600.0;
    let bus = Bus::connect_job(&cfg, "test").await.unwrap();
    bus.declare_topology().await.unwrap();
    let groups = GroupStore::open(&bus).await.unwrap();
    let first = start(cfg.clone());
    let pause_subject = bus.names().control_subject("first", "pause");
    let pause = v1::PauseRequest { step: 0, free_cache: false };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        // no responders until the worker's control task has subscribed
        match bus.request::<_, v1::PauseResponse>(&pause_subject, &pause, Duration::from_secs(2)).await {
            Ok(reply) => {
                assert!(reply.error.is_empty(), "pause refused: {reply:?}");
                break;
            }
            Err(err) => assert!(Instant::now() < deadline, "the first worker never answered a pause: {err}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    submit(&bus, &groups, task("long", 16, &prompt(8, 1), 1.0)).await;
    // Wait until the first worker has taken the group, then stop it.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (status, _) = groups.get("train", "long").await.unwrap().unwrap();
        if status.state() == GroupState::Running {
            assert_eq!(status.worker_id, "first");
            break;
        }
        assert!(Instant::now() < deadline, "the first worker never took the group");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    first.stop().await;
    let (status, _) = groups.get("train", "long").await.unwrap().unwrap();
    assert_eq!(status.state(), GroupState::Running, "no terminal status for an unfinished group");

    cfg.rollout.instance_id = Some("second".into());
    cfg.rollout.metrics_addr = free_addr();
    let second = start(cfg);
    let status = wait_terminal(&groups, "long", Duration::from_secs(120)).await;
    assert_eq!(status.state(), GroupState::Finished);
    assert_eq!(status.worker_id, "second");
    let stored = trajectories(&bus, "reader-3").await;
    assert_eq!(stored.len(), 16);
    for t in stored.values() {
        assert_eq!(packed::unpack_u32(&t.response_ids).unwrap().len(), 48);
        assert_eq!(t.worker_id, "second", "nothing of the stopped worker's partial work was published");
    }
    second.stop().await;
}

/// A group whose score request can never fit the server's max_payload (many sessions: the "large n")
/// fails for good with the reason, and is acknowledged: not naked and regenerated every ack_wait forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_too_large_for_the_broker_fails_once_with_the_reason_instead_of_looping() {
    let nats = NatsServer::start_with_max_payload(4096).unwrap();
    let dir = tempfile::tempdir().unwrap();
    jetrl_model::init_model("tiny", dir.path(), 3).unwrap();
    let cfg = config(&nats, dir.path());
    let bus = Bus::connect_job(&cfg, "test").await.unwrap();
    bus.declare_topology().await.unwrap();
    let groups = GroupStore::open(&bus).await.unwrap();
    let worker = start(cfg);

    submit(&bus, &groups, task("huge", 64, &prompt(10, 1), 1.0)).await;
    let status = wait_terminal(&groups, "huge", Duration::from_secs(120)).await;
    assert_eq!(status.state(), GroupState::Failure, "{status:?}");
    assert!(status.failure_reason.contains("max_payload"), "{}", status.failure_reason);
    assert!(status.trajectory_keys.is_empty(), "a failed group names no trajectories: {status:?}");
    // past two ack_waits (2 s each): the task was acknowledged, never redelivered and regenerated
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (again, _) = groups.get("train", "huge").await.unwrap().unwrap();
    assert_eq!(again.updated_unix_ms, status.updated_unix_ms, "the group was touched again: {again:?}");
    assert_eq!(again.state(), GroupState::Failure);
    worker.stop().await;
}
