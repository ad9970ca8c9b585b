//! Tests against a real nats-server (started per test on a free port).

use std::time::Duration;

use async_nats::jetstream::AckKind;
use jetrl_config::NatsConfig;
use jetrl_wire::subjects::Names;
use jetrl_wire::v1::{Eviction, GroupState, GroupStatus, Trajectory};

use crate::consume::{decode_or_term, pull_collect};
use crate::groups::GroupUpdateError;
use crate::publish::Outgoing;
use crate::*;

/// A connection for job `namespace`, its topology declared.
async fn job_bus(server: &NatsServer, namespace: &str) -> Bus {
    let cfg = NatsConfig { url: server.url(), ..NatsConfig::default() };
    let names = Names::new(namespace).expect("namespace");
    let bus = Bus::connect(&cfg, &names, "bus-test").await.expect("connect");
    bus.declare_topology().await.expect("declare");
    bus
}

async fn bus(server: &NatsServer) -> Bus {
    job_bus(server, "test").await
}

#[tokio::test]
async fn topology_declaration_is_idempotent() {
    let server = NatsServer::start().unwrap();
    let bus = bus(&server).await;
    bus.declare_topology().await.expect("second declaration");
    assert_eq!(bus.max_payload(), harness::MAX_PAYLOAD_BYTES);
}

/// A declaration reads first: it creates what is missing, updates only what differs from what jetrl declares
/// (naming the difference), and writes nothing when everything is as declared.
#[tokio::test]
async fn a_declaration_creates_what_is_missing_and_updates_only_what_differs() {
    let server = NatsServer::start().unwrap();
    let cfg = NatsConfig { url: server.url(), ..NatsConfig::default() };
    let bus = Bus::connect(&cfg, &Names::new("decl").unwrap(), "bus-test").await.expect("connect");
    let first = bus.declare_topology().await.expect("declare");
    assert_eq!(first.created.len(), 11, "{first:?}");
    assert!(first.created.contains(&"KV bucket JETRL_decl_LEASE".to_string()), "{first:?}");
    let again = bus.declare_topology().await.expect("declare again");
    assert!(again.created.is_empty() && again.updated.is_empty() && again.unchanged.len() == 11, "{again:?}");

    // an operator changed TRAJ's max age and the WORKERS bucket's history
    let js = bus.jetstream();
    let mut traj = js.get_stream(bus.names().traj_stream()).await.unwrap().cached_info().config.clone();
    traj.max_age = Duration::from_secs(3600);
    js.update_stream(traj).await.expect("operator's update");
    let workers_stream = format!("KV_{}", bus.names().workers_bucket());
    let mut workers = js.get_stream(&workers_stream).await.unwrap().cached_info().config.clone();
    workers.max_messages_per_subject = 5;
    js.update_stream(workers).await.expect("operator's update");
    let fixed = bus.declare_topology().await.expect("declare over the change");
    let updated: Vec<&str> = fixed.updated.iter().map(|(what, _)| what.as_str()).collect();
    assert_eq!(
        updated,
        [format!("stream {}", bus.names().traj_stream()), format!("KV bucket {}", bus.names().workers_bucket())]
    );
    assert_eq!(fixed.updated[0].1, ["max_age 3600s -> 86400s"]);
    assert_eq!(fixed.updated[1].1, ["history 5 -> 1"]);
    let traj = js.get_stream(bus.names().traj_stream()).await.unwrap().cached_info().config.clone();
    assert_eq!(traj.max_age, Duration::from_secs(24 * 3600));
}

/// A service that only reads the topology (every one but the trainer) waits for it, and after
/// `nats.connect_timeout_s` fails naming what is missing and who declares it.
#[tokio::test]
async fn a_reader_of_the_topology_waits_for_it_and_names_what_is_missing() {
    let server = NatsServer::start().unwrap();
    let names = Names::new("wait").unwrap();
    let reader_cfg = NatsConfig { url: server.url(), connect_timeout_s: 1.0, ..NatsConfig::default() };
    let reader = Bus::connect(&reader_cfg, &names, "reader").await.expect("connect");
    let started = std::time::Instant::now();
    let err = reader.expect_topology().await.expect_err("nothing declared").to_string();
    assert!(started.elapsed() < Duration::from_secs(3), "waited {:?}", started.elapsed());
    assert!(err.contains("stream JETRL_wait_PROMPTS") && err.contains("KV bucket JETRL_wait_GROUPS"), "{err}");
    assert!(err.contains("trainer declares"), "{err}");

    // declared while a reader waits: the reader goes on
    let reader_cfg = NatsConfig { connect_timeout_s: 20.0, ..reader_cfg };
    let reader = Bus::connect(&reader_cfg, &names, "reader").await.expect("connect");
    let waiting = tokio::spawn(async move { reader.expect_topology().await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let declarer = Bus::connect(&NatsConfig { url: server.url(), ..NatsConfig::default() }, &names, "trainer")
        .await
        .expect("connect");
    declarer.declare_topology().await.expect("declare");
    waiting.await.unwrap().expect("the reader finds the topology once declared");
}

/// `nats.replicas` 3 on one server (no cluster) fails with an error that says what replicas need.
#[tokio::test]
async fn replicas_beyond_what_the_server_has_fail_naming_nats_replicas() {
    let server = NatsServer::start().unwrap();
    let cfg = NatsConfig { url: server.url(), replicas: 3, ..NatsConfig::default() };
    let bus = Bus::connect(&cfg, &Names::new("r3").unwrap(), "bus-test").await.expect("connect");
    assert_eq!(bus.replicas(), 3);
    let err = bus.declare_topology().await.expect_err("one server holds one replica").to_string();
    assert!(err.contains("stream JETRL_r3_PROMPTS") && err.contains("nats.replicas is 3"), "{err}");
}

#[tokio::test]
async fn a_stream_declared_with_another_retention_by_an_earlier_version_is_named_with_the_way_out() {
    let server = NatsServer::start().unwrap();
    let cfg = NatsConfig { url: server.url(), ..NatsConfig::default() };
    let bus = Bus::connect(&cfg, &Names::new("test").unwrap(), "bus-test").await.expect("connect");
    let score = bus.names().score_stream();
    // an earlier jetrl declared SCORE as a work queue
    bus.jetstream()
        .create_stream(async_nats::jetstream::stream::Config {
            name: score.into(),
            subjects: vec![bus.names().score_filter()],
            retention: async_nats::jetstream::stream::RetentionPolicy::WorkQueue,
            ..Default::default()
        })
        .await
        .expect("old stream");
    let err = bus.declare_topology().await.expect_err("retention cannot change in place").to_string();
    assert!(err.contains(score) && err.contains("WorkQueue"), "{err}");
    assert!(err.contains(&format!("nats stream rm {score}")), "{err}");
}

#[tokio::test]
async fn same_msg_id_is_stored_once() {
    let server = NatsServer::start().unwrap();
    let bus = bus(&server).await;
    let traj = Trajectory { key: "u1_0_0".into(), uid: "u1".into(), ..Default::default() };
    let subject = bus.names().traj_subject("train", "u1");
    let first = bus.publish_durable(Outgoing::protobuf(&subject, Some(traj.key.clone()), &traj)).await.unwrap();
    let second = bus.publish_durable(Outgoing::protobuf(&subject, Some(traj.key.clone()), &traj)).await.unwrap();
    assert!(!first.duplicate);
    assert!(second.duplicate);
    assert_eq!(first.sequence, second.sequence);
    let mut stream = bus.stream(bus.names().traj_stream()).await.unwrap();
    assert_eq!(stream.info().await.unwrap().state.messages, 1);
}

#[tokio::test]
async fn pipelined_publisher_acks_every_message_with_distinct_sequences() {
    let server = NatsServer::start().unwrap();
    let bus = bus(&server).await;
    let mut publisher = Publisher::new(&bus, 256);
    for i in 0..3000u32 {
        let key = format!("u{i}_0_0");
        publisher
            .publish(Outgoing::new(
                bus.names().traj_subject("train", &format!("u{i}")),
                Some(key),
                vec![7u8; 512].into(),
            ))
            .await
            .unwrap();
        assert!(publisher.inflight() <= 256);
    }
    let acks = publisher.drain().await.unwrap();
    assert_eq!(acks.len(), 3000);
    let seqs: std::collections::HashSet<u64> = acks.iter().map(|a| a.sequence).collect();
    assert_eq!(seqs.len(), 3000);
}

#[tokio::test]
async fn malformed_message_is_counted_terminated_set_aside_and_not_redelivered() {
    let server = NatsServer::start().unwrap();
    let bus = bus(&server).await;
    crate::consume::route_dead_letters(&bus);
    let metrics_addr = jetrl_telemetry::serve_metrics("127.0.0.1:0", std::future::pending()).await.unwrap();
    let consumer = bus
        .shared_pull_consumer(
            bus.names().traj_stream(),
            "t",
            &bus.names().traj_filter(),
            Duration::from_millis(1000),
            100,
        )
        .await
        .unwrap();
    // 0xff is an invalid protobuf tag: this cannot decode as a Trajectory
    bus.publish_durable(Outgoing::new(bus.names().traj_subject("train", "bad"), None, vec![0xff, 0xff, 0xff].into()))
        .await
        .unwrap();
    let good = Trajectory { key: "ok_0_0".into(), ..Default::default() };
    bus.publish_durable(Outgoing::protobuf(bus.names().traj_subject("train", "ok"), None, &good)).await.unwrap();

    let msgs = pull_collect(&consumer, 2, Duration::from_millis(500)).await.unwrap();
    assert_eq!(msgs.len(), 2);
    let mut decoded = Vec::new();
    for msg in &msgs {
        if let Some(t) = decode_or_term::<Trajectory>(msg, "bustest").await {
            msg.ack_with(AckKind::Ack).await.unwrap();
            decoded.push(t.key);
        }
    }
    assert_eq!(decoded, vec!["ok_0_0".to_string()]);
    // past ack_wait: a terminated message must not come back
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let again = pull_collect(&consumer, 10, Duration::from_millis(500)).await.unwrap();
    assert!(again.is_empty(), "got {} redeliveries", again.len());
    let body = jetrl_telemetry::scrape(metrics_addr).await.unwrap();
    assert!(body.contains("jetrl_bustest_malformed_messages_total{source=\"JETRL_test_TRAJ\"} 1"), "{body}");
    // and a copy of it waits in the job's dead-letter stream, saying where it came from, who refused it and why
    let dlq = bus.stream(bus.names().dlq_stream()).await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let letter = loop {
        match dlq.direct_get_last_for_subject(bus.names().dlq_subject("bustest")).await {
            Ok(letter) => break letter,
            Err(err) => assert!(std::time::Instant::now() < deadline, "no dead letter: {err}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(letter.payload.as_ref(), &[0xff, 0xff, 0xff]);
    let header = |name: &str| letter.headers.get(name).map(|v| v.as_str().to_string()).unwrap_or_default();
    assert_eq!(header("Jetrl-Subject"), bus.names().traj_subject("train", "bad"));
    assert_eq!(header("Jetrl-Service"), "bustest");
    assert!(header("Jetrl-Reason").contains("does not decode as") && header("Jetrl-Reason").contains("Trajectory"));
    assert_eq!(header("Jetrl-Bytes"), "3");
}

#[tokio::test]
async fn group_transitions_are_compare_and_set_and_checked() {
    let server = NatsServer::start().unwrap();
    let bus = bus(&server).await;
    let groups = GroupStore::open(&bus).await.unwrap();
    let mut status =
        GroupStatus { uid: "g1".into(), partition: "train".into(), n: 4, submit_step: 3, ..Default::default() };
    status.set_state(GroupState::Pending);
    groups.create(&status).await.unwrap();
    assert!(groups.create(&status).await.is_err(), "create must not overwrite");

    let err = groups.update("train", "g1", |_| Some(GroupState::Sampled)).await.unwrap_err();
    assert!(matches!(err, GroupUpdateError::IllegalTransition { from: "pending", to: "sampled", .. }), "{err}");

    // Many concurrent writers each append a key: with CAS none is lost.
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let groups = groups.clone();
            tokio::spawn(async move {
                groups
                    .update("train", "g1", move |s| {
                        s.trajectory_keys.push(format!("g1_{i}_0"));
                        Some(GroupState::Running)
                    })
                    .await
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let (status, _) = groups.get("train", "g1").await.unwrap().unwrap();
    assert_eq!(status.state(), GroupState::Running);
    assert_eq!(status.trajectory_keys.len(), 8);
    let missing = groups.update("train", "nope", |_| Some(GroupState::Running)).await.unwrap_err();
    assert!(matches!(missing, GroupUpdateError::Missing { .. }));
}

#[tokio::test]
async fn two_megabyte_payload_round_trips() {
    let server = NatsServer::start().unwrap();
    let bus = bus(&server).await;
    let payload: Vec<u8> = (0..2 * 1024 * 1024).map(|i| (i % 251) as u8).collect();
    let ack = bus
        .publish_durable(Outgoing::new(
            bus.names().traj_subject("train", "big"),
            Some("big_0_0".into()),
            payload.clone().into(),
        ))
        .await
        .unwrap();
    let stream = bus.stream(bus.names().traj_stream()).await.unwrap();
    let msg = stream.direct_get(ack.sequence).await.unwrap();
    assert_eq!(msg.payload.as_ref(), payload.as_slice());
    let too_big = vec![0u8; harness::MAX_PAYLOAD_BYTES + 1];
    let subject = bus.names().traj_subject("train", "x");
    let err = bus.publish_durable(Outgoing::new(subject, None, too_big.into())).await.unwrap_err();
    assert!(matches!(err, BusError::PayloadTooLarge { .. }), "{err}");
}

#[tokio::test]
async fn stored_messages_survive_a_server_crash() {
    let mut server = NatsServer::start().unwrap();
    {
        let bus = bus(&server).await;
        let mut publisher = Publisher::new(&bus, 64);
        for i in 0..100 {
            publisher
                .publish(Outgoing::new(
                    bus.names().traj_subject("train", "u"),
                    Some(format!("u_{i}_0")),
                    vec![1u8; 64].into(),
                ))
                .await
                .unwrap();
        }
        publisher.drain().await.unwrap();
    }
    server.restart().unwrap();
    let bus = bus(&server).await;
    let mut stream = bus.stream(bus.names().traj_stream()).await.unwrap();
    assert_eq!(stream.info().await.unwrap().state.messages, 100);
}

#[tokio::test]
async fn weight_blob_round_trips_through_both_transports_and_is_verified() {
    use crate::weights::{manifest_for, verify, WeightTransport};
    let server = NatsServer::start().unwrap();
    let bus = bus(&server).await;
    // a valid safetensors blob: two f32 tensors
    let a: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0].iter().flat_map(|v| v.to_le_bytes()).collect();
    let b: Vec<u8> = [5.0f32, 6.0].iter().flat_map(|v| v.to_le_bytes()).collect();
    let views = vec![
        ("a".to_string(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![2, 2], &a).unwrap()),
        ("b".to_string(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![2], &b).unwrap()),
    ];
    let blob = bytes::Bytes::from(safetensors::serialize(views, None).unwrap());
    let dir = tempfile::tempdir().unwrap();
    for transport in [
        WeightTransport::ObjectStore { chunk_bytes: 1 << 20 },
        WeightTransport::SharedFs { dir: dir.path().to_path_buf() },
    ] {
        let location = bus.store_weights(&transport, 7, blob.clone()).await.unwrap();
        let manifest = manifest_for(&blob, 7, 7, &location).unwrap();
        assert_eq!(manifest.tensors.len(), 2);
        assert_eq!(manifest.tensors[0].shape, vec![2, 2]);
        let loaded = bus.load_weights(&location).await.unwrap();
        verify(&manifest, &loaded).unwrap();
        assert_eq!(bus.weights_size(&location).await.unwrap(), blob.len() as u64);
        let mut corrupted = loaded.to_vec();
        let last = corrupted.len() - 1;
        corrupted[last] ^= 0xff;
        assert!(verify(&manifest, &corrupted).is_err());
        bus.delete_weights(&location).await.unwrap();
        assert!(bus.load_weights(&location).await.is_err());
    }
}

#[tokio::test]
async fn payloads_are_fetched_by_sequence_one_batch_per_subject() {
    let server = NatsServer::start().unwrap();
    let bus = bus(&server).await;
    // two groups interleaved, plus a message on group a's subject that is not wanted
    let mut want = Vec::new();
    let mut unwanted = 0;
    for i in 0..20u32 {
        let uid = if i % 2 == 0 { "a" } else { "b" };
        let subject = bus.names().traj_subject("train", uid);
        let ack = bus
            .publish_durable(Outgoing::new(
                subject.clone(),
                Some(format!("{uid}_{i}_0")),
                i.to_le_bytes().to_vec().into(),
            ))
            .await
            .unwrap();
        if i == 4 {
            unwanted = ack.sequence;
        } else {
            want.push((subject, ack.sequence, i));
        }
    }
    let seqs: Vec<u64> = want.iter().filter(|w| w.0.ends_with(".a")).map(|w| w.1).collect();
    let batch =
        bus.direct_get_batch(bus.names().traj_stream(), &bus.names().traj_subject("train", "a"), &seqs).await.unwrap();
    assert_eq!(batch.len(), seqs.len(), "one batched request returns the whole group");
    assert!(!batch.contains_key(&unwanted));

    // a sequence that is gone is absent, the rest are there with their bytes
    let mut wanted: Vec<(String, u64)> = want.iter().map(|w| (w.0.clone(), w.1)).collect();
    wanted.push((bus.names().traj_subject("train", "b"), 10_000));
    let found = bus.fetch_by_sequence(bus.names().traj_stream(), &wanted).await.unwrap();
    assert_eq!(found.len(), want.len());
    for (_, seq, i) in &want {
        assert_eq!(found[seq].as_ref(), i.to_le_bytes());
    }
}

fn scored_trajectory(key: &str, text: &str, tokens: &[u32]) -> Trajectory {
    Trajectory {
        key: key.into(),
        uid: "u".into(),
        partition: "train".into(),
        prompt_ids: jetrl_wire::packed::pack_u32(&[1, 2]),
        response_ids: jetrl_wire::packed::pack_u32(tokens),
        logprobs: jetrl_wire::packed::pack_f32(&vec![-0.5; tokens.len()]),
        response_text: text.into(),
        ground_truth: "42".into(),
        ..Default::default()
    }
}

#[tokio::test]
async fn a_score_request_carries_what_was_stored_even_for_a_trajectory_an_earlier_attempt_published() {
    use jetrl_wire::Message;
    let server = NatsServer::start().unwrap();
    let bus = bus(&server).await;
    let subject = bus.names().traj_subject("train", "u");
    // a first attempt at the group stored session 0, then its worker died
    let earlier = scored_trajectory("u_0_0", "first attempt", &[7, 7, 7]);
    let stored = bus.publish_durable(Outgoing::protobuf(&subject, Some(earlier.key.clone()), &earlier)).await.unwrap();
    // the second attempt regenerates both sessions; session 0 is a duplicate the stream keeps once
    let mut publisher = Publisher::new(&bus, 8);
    let mut scoring = ScoreRequestBuilder::new("train", "u");
    for traj in [scored_trajectory("u_1_0", "second attempt", &[5]), scored_trajectory("u_0_0", "second attempt", &[5])]
    {
        publisher.publish(Outgoing::protobuf(&subject, Some(traj.key.clone()), &traj)).await.unwrap();
        scoring.add(&traj);
    }
    let acks = publisher.drain().await.unwrap();
    let id = scoring.publish(&bus, &acks).await.unwrap().expect("a request");

    let score = bus.stream(bus.names().score_stream()).await.unwrap();
    let msg = score.direct_get_last_for_subject(bus.names().score_subject("train", "u")).await.unwrap();
    assert_eq!(msg.headers.get(async_nats::header::NATS_MESSAGE_ID).map(|v| v.as_str()), Some(id.as_str()));
    let mut request = jetrl_wire::v1::ScoreRequest::decode(msg.payload.as_ref()).unwrap();
    assert_eq!(request.common.as_ref().map(|c| c.ground_truth.as_str()), Some("42"), "shared fields travel once");
    jetrl_wire::score::expand_common(&mut request, true);
    let keys: Vec<&str> = request.trajectories.iter().map(|t| t.key.as_str()).collect();
    assert_eq!(keys, ["u_0_0", "u_1_0"], "key order");
    let (zero, one) = (&request.trajectories[0], &request.trajectories[1]);
    assert_eq!(
        (zero.response_text.as_str(), zero.stored_seq, zero.response_len),
        ("first attempt", stored.sequence, 3)
    );
    assert_eq!((one.response_text.as_str(), one.response_len, one.ground_truth.as_str()), ("second attempt", 1, "42"));
    assert!(request.trajectories.iter().all(|t| t.response_ids.is_empty() && t.logprobs.is_empty()));
    assert_eq!(request.trajectories.iter().map(|t| t.prompt_ids.len()).collect::<Vec<_>>(), [8, 8]);
    // an empty group publishes nothing
    assert_eq!(ScoreRequestBuilder::new("train", "empty").publish(&bus, &[]).await.unwrap(), None);
}

#[tokio::test]
async fn two_jobs_on_one_server_see_none_of_each_others_records() {
    use crate::weights::WeightTransport;
    let server = NatsServer::start().unwrap();
    let (a, b) = (job_bus(&server, "job-a").await, job_bus(&server, "job-b").await);
    // the same group uid and trajectory key in both jobs: each job stores its own
    for bus in [&a, &b] {
        let traj = Trajectory { key: "u_0_0".into(), uid: "u".into(), ..Default::default() };
        let subject = bus.names().traj_subject("train", "u");
        let ack = bus.publish_durable(Outgoing::protobuf(subject, Some(traj.key.clone()), &traj)).await.unwrap();
        assert!(!ack.duplicate, "job {} saw another job's trajectory", bus.names().namespace());
        let mut status = GroupStatus { uid: "u".into(), partition: "train".into(), ..Default::default() };
        status.set_state(GroupState::Pending);
        GroupStore::open(bus).await.unwrap().create(&status).await.unwrap();
    }
    for bus in [&a, &b] {
        let mut traj = bus.stream(bus.names().traj_stream()).await.unwrap();
        assert_eq!(traj.info().await.unwrap().state.messages, 1);
    }
    // a weight location of job a is not readable through job b
    let transport = WeightTransport::ObjectStore { chunk_bytes: 1 << 20 };
    let location = a.store_weights(&transport, 1, bytes::Bytes::from_static(b"weights of a")).await.unwrap();
    assert!(location.contains("JETRL_job-a_BLOBS"), "{location}");
    assert_eq!(a.load_weights(&location).await.unwrap().as_ref(), b"weights of a");
    let refused = b.load_weights(&location).await.unwrap_err().to_string();
    assert!(refused.contains("JETRL_job-b_BLOBS"), "{refused}");
}

#[tokio::test]
async fn a_job_with_an_invalid_namespace_is_refused_before_connecting_and_the_error_names_the_key() {
    let mut job = jetrl_config::JobConfig::default();
    job.nats.url = "nats://127.0.0.1:1".into();
    job.run.name = "two words".into();
    let err = Bus::connect_job(&job, "test").await.err().expect("invalid namespace").to_string();
    assert!(err.contains("run.name") && err.contains("two words"), "{err}");
    job.nats.namespace = Some("a.b".into());
    let err = Bus::connect_job(&job, "test").await.err().expect("invalid namespace").to_string();
    assert!(err.contains("nats.namespace") && err.contains("a.b"), "{err}");
}

/// Declares job `namespace`'s LEASE bucket with a short max age before anything else does, so a dead holder's
/// lease expires quickly.
async fn short_lease_bucket(bus: &Bus, max_age: Duration) {
    bus.jetstream()
        .create_key_value(async_nats::jetstream::kv::Config {
            bucket: bus.names().lease_bucket().into(),
            history: 1,
            max_age,
            ..Default::default()
        })
        .await
        .expect("lease bucket");
}

#[tokio::test]
async fn a_second_holder_is_refused_while_the_first_is_alive_and_takes_the_lease_once_it_is_released() {
    let server = NatsServer::start().unwrap();
    let cfg = NatsConfig { url: server.url(), ..NatsConfig::default() };
    let bus = Bus::connect(&cfg, &Names::new("exp-1").unwrap(), "bus-test").await.unwrap();
    short_lease_bucket(&bus, Duration::from_secs(2)).await;
    let first = Lease::acquire(&bus, "trainer").await.unwrap();

    let started = std::time::Instant::now();
    let err = Lease::acquire(&bus, "trainer").await.err().expect("the lease is held");
    let waited = started.elapsed();
    let text = err.to_string();
    assert!(matches!(err, BusError::LeaseHeld { .. }), "{text}");
    assert!(text.contains("job exp-1") && text.contains("JETRL_exp-1_LEASE"), "{text}");
    assert!(text.contains(&format!("trainer pid {}", std::process::id())) && text.contains(" ago)"), "{text}");
    // refused as soon as the holder refreshed (every 0.4 s here), not after waiting out the max age
    assert!(waited < Duration::from_secs(2), "refused after {waited:?}");

    first.release().await.unwrap();
    let started = std::time::Instant::now();
    let second = Lease::acquire(&bus, "trainer").await.expect("a released lease is free");
    assert!(started.elapsed() < Duration::from_millis(500), "took {:?}", started.elapsed());
    second.release().await.unwrap();
}

#[tokio::test]
async fn a_dead_holders_lease_expires_and_a_newcomer_takes_it() {
    let server = NatsServer::start().unwrap();
    let cfg = NatsConfig { url: server.url(), ..NatsConfig::default() };
    let bus = Bus::connect(&cfg, &Names::new("exp-2").unwrap(), "bus-test").await.unwrap();
    short_lease_bucket(&bus, Duration::from_secs(1)).await;
    // dropped without a release: refreshing stops, as when the holder's process dies
    drop(Lease::acquire(&bus, "trainer").await.unwrap());
    let started = std::time::Instant::now();
    let lease = Lease::acquire(&bus, "trainer").await.expect("the dead holder's lease expires");
    let waited = started.elapsed();
    assert!(waited > Duration::from_millis(300) && waited < Duration::from_secs(3), "took {waited:?}");
    lease.release().await.unwrap();
}

#[tokio::test]
async fn a_holder_whose_lease_was_taken_over_learns_it_and_its_release_fails() {
    let server = NatsServer::start().unwrap();
    let cfg = NatsConfig { url: server.url(), ..NatsConfig::default() };
    let bus = Bus::connect(&cfg, &Names::new("exp-3").unwrap(), "bus-test").await.unwrap();
    short_lease_bucket(&bus, Duration::from_secs(1)).await;
    let lease = Lease::acquire(&bus, "trainer").await.unwrap();
    // another holder overwrites the entry (as one would after this holder missed refreshing past the max age)
    let kv = bus.key_value(bus.names().lease_bucket()).await.unwrap();
    let other = serde_json::json!({ "holder": "trainer pid 1 on elsewhere", "since_unix_ms": 0 }).to_string();
    kv.put("trainer", other.into()).await.unwrap();
    let stopped = tokio::time::timeout(Duration::from_secs(2), lease.or_lost(std::future::pending())).await;
    assert!(stopped.is_ok(), "the holder did not learn it lost the lease");
    let err = lease.release().await.expect_err("a lost lease").to_string();
    assert!(err.contains("exp-3") && err.contains("trainer pid 1 on elsewhere"), "{err}");
    // the other holder's entry stays
    let entry = kv.entry("trainer").await.unwrap().expect("entry");
    assert_eq!(entry.operation, async_nats::jetstream::kv::Operation::Put);
}

#[test]
fn only_failures_that_can_pass_on_a_retry_are_retried() {
    use async_nats::jetstream::context::{PublishError, PublishErrorKind as Kind};
    let recovery = |kind| Cause::of(PublishError::new(kind)).recovery();
    for kind in [Kind::TimedOut, Kind::BrokenPipe, Kind::MaxAckPending, Kind::Other] {
        assert_eq!(recovery(kind), Recovery::Transient, "{kind:?}");
    }
    // a cluster answers "no stream" while it elects a stream leader
    assert_eq!(recovery(Kind::StreamNotFound), Recovery::Unavailable);
    for kind in [Kind::MaxPayloadExceeded, Kind::WrongLastMessageId, Kind::WrongLastSequence] {
        assert_eq!(recovery(kind), Recovery::Permanent, "{kind:?}");
    }
}

/// A clustered stream's leader refuses a write whose expected revision another in-flight write to the key will
/// change with JetStream error 10164, which async-nats reports as `Other` (a single server's 10071 comes as
/// `WrongLastRevision` / `AlreadyExists`). Both are a lost compare-and-set: the writer reads the key again. Taken
/// for a permanent failure it cost a step a group in the three-node cluster test.
#[test]
fn a_clustered_leaders_wrong_last_sequence_is_a_lost_compare_and_set_not_a_failure() {
    use crate::error::lost_compare_and_set;
    use async_nats::jetstream::context::{PublishError, PublishErrorKind};
    use async_nats::jetstream::kv::{CreateError, CreateErrorKind, UpdateError, UpdateErrorKind};
    let api = |code: u32, description: &str| -> async_nats::jetstream::Error {
        serde_json::from_str(&format!(r#"{{"code":400,"err_code":{code},"description":"{description}"}}"#)).unwrap()
    };
    // as async-nats builds them from the server's answer
    let clustered =
        UpdateError::from(PublishError::with_source(PublishErrorKind::Other, api(10164, "wrong last sequence")));
    assert_eq!(clustered.kind(), UpdateErrorKind::Other, "async-nats maps 10164 to Other");
    assert!(lost_compare_and_set(&clustered), "{clustered}");
    let single = UpdateError::from(PublishError::with_source(
        PublishErrorKind::WrongLastSequence,
        api(10071, "wrong last sequence: 7"),
    ));
    assert_eq!(single.kind(), UpdateErrorKind::WrongLastRevision);
    assert!(lost_compare_and_set(&single));
    // a create that meets the same answer is a create conflict (the caller reads the key and compares)
    assert!(Cause::of(CreateError::with_source(CreateErrorKind::Other, clustered)).is_create_conflict());
    assert!(Cause::of(CreateError::new(CreateErrorKind::AlreadyExists)).is_create_conflict());
    // anything else is not
    let full =
        UpdateError::from(PublishError::with_source(PublishErrorKind::Other, api(10077, "maximum messages exceeded")));
    assert!(!lost_compare_and_set(&full));
    assert!(!lost_compare_and_set(&UpdateError::from(PublishError::new(PublishErrorKind::TimedOut))));
    assert!(!Cause::of(CreateError::new(CreateErrorKind::Other)).is_create_conflict());
}

/// A watch whose consumer the server refuses for the consumer limit is worth opening again (the ephemeral
/// consumers of dead processes expire); other limits stay permanent.
#[test]
fn the_consumer_limit_is_transient_and_other_limits_are_permanent() {
    use async_nats::jetstream::kv::{WatchError, WatchErrorKind};
    use async_nats::jetstream::stream::{ConsumerError, ConsumerErrorKind};
    let api = |code: u32, description: &str| -> async_nats::jetstream::Error {
        serde_json::from_str(&format!(r#"{{"code":400,"err_code":{code},"description":"{description}"}}"#)).unwrap()
    };
    // as a KV watch reports it: the consumer's creation, inside the watch's error
    let watch = |code: u32, description: &str| {
        let consumer = ConsumerError::new(ConsumerErrorKind::JetStream(api(code, description)));
        WatchError::with_source(WatchErrorKind::ConsumerCreate, consumer)
    };
    assert_eq!(Cause::of(watch(10026, "maximum consumers limit reached")).recovery(), Recovery::Transient);
    assert_eq!(Cause::of(watch(10047, "insufficient resources")).recovery(), Recovery::Permanent);
}

#[tokio::test]
async fn a_publish_no_stream_takes_is_retried_with_backoff_then_fails_naming_the_attempts() {
    let server = NatsServer::start().unwrap();
    // "no stream" is retried for at least five attempts and while the first is younger than connect_timeout_s
    let cfg = NatsConfig { url: server.url(), connect_timeout_s: 5.0, ..NatsConfig::default() };
    let bus = Bus::connect(&cfg, &Names::new("test").unwrap(), "bus-test").await.expect("connect");
    let started = std::time::Instant::now();
    let err = bus
        .publish_durable(Outgoing::new("nowhere.at.all", None, vec![1u8, 2, 3].into()))
        .await
        .expect_err("no stream takes this subject");
    let waited = started.elapsed();
    let attempts: u32 = err
        .to_string()
        .split("after ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no attempt count in {err}"));
    assert!(attempts >= 6, "more than the five quick attempts while younger than 5 s: {err}");
    assert_eq!(err.recovery(), Recovery::Unavailable, "{err}");
    // 0.1 + 0.2 + 0.4 + 0.8 + 1.6 + 2 s of backoff between attempts, then given up: not a tight loop, not forever
    assert!(waited >= Duration::from_secs(3) && waited < Duration::from_secs(12), "{waited:?}");
}

/// A group record written while the server is down is written once it is back (within the store's patience):
/// the failure is transient, retried with backoff, and the record is there exactly once.
#[tokio::test]
async fn a_group_record_written_while_the_server_restarts_is_written_once_it_is_back() {
    let mut server = NatsServer::start().unwrap();
    let bus = bus(&server).await;
    let groups = GroupStore::open(&bus).await.unwrap().with_patience(Patience::within(Duration::from_secs(20)));
    let status = GroupStatus {
        uid: "g1".into(),
        partition: "train".into(),
        state: GroupState::Pending as i32,
        ..Default::default()
    };
    server.kill();
    // the server is restarted by a thread that lives until the test ends: a server dies with the thread that
    // started it (PR_SET_PDEATHSIG)
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let restarter = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(1500));
        server.restart().unwrap();
        let _ = done_rx.recv();
    });
    let started = std::time::Instant::now();
    let revision = groups.create(&status).await.expect("created once the server is back");
    assert!(started.elapsed() >= Duration::from_millis(1000), "written before the server came back?");
    let (stored, stored_revision) = groups.get("train", "g1").await.unwrap().expect("record");
    assert_eq!((stored.uid.as_str(), stored_revision), ("g1", revision));
    // and an update after the restart goes through the same store
    let updated = groups.update("train", "g1", |_| Some(GroupState::Running)).await.unwrap().expect("updated");
    assert_eq!(updated.state(), GroupState::Running);
    drop(done_tx);
    restarter.join().unwrap();
}

/// A permanent failure is not retried: creating a record that exists answers at once, with the cause kept as
/// the error's source and classified.
#[tokio::test]
async fn a_permanent_failure_is_returned_at_once_with_its_cause() {
    let server = NatsServer::start().unwrap();
    let bus = bus(&server).await;
    let groups = GroupStore::open(&bus).await.unwrap().with_patience(Patience::within(Duration::from_secs(30)));
    let status = GroupStatus { uid: "g1".into(), partition: "train".into(), ..Default::default() };
    groups.create(&status).await.unwrap();
    let started = std::time::Instant::now();
    let err = groups.create(&status).await.expect_err("the key exists");
    assert!(started.elapsed() < Duration::from_secs(1), "retried a permanent failure: {:?}", started.elapsed());
    assert_eq!(err.recovery(), Recovery::Permanent, "{err}");
    assert_eq!(err.kind(), "kv");
    let source = std::error::Error::source(&err).expect("the cause is kept");
    let nats = std::error::Error::source(source).expect("and the library's error under it");
    let create = nats.downcast_ref::<async_nats::jetstream::kv::CreateError>().expect("a KV create error");
    assert_eq!(create.kind(), async_nats::jetstream::kv::CreateErrorKind::AlreadyExists);
}

/// A server that is gone is reported after the patience, not waited for forever.
#[tokio::test]
async fn a_server_that_stays_down_is_reported_after_the_deadline() {
    let mut server = NatsServer::start().unwrap();
    let bus = bus(&server).await;
    let groups = GroupStore::open(&bus).await.unwrap().with_patience(Patience::within(Duration::from_secs(2)));
    server.kill();
    let started = std::time::Instant::now();
    let err = groups.get("train", "g1").await.expect_err("no server");
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(1500) && waited < Duration::from_secs(10), "gave up after {waited:?}");
    assert!(err.recovery().retryable(), "{err}");
}

/// Archiving moves a retired record out of GROUPS into LEDGER (its key purged, so the broker keeps no subject for
/// it); a revision written after the archived one stays; the history reads both; a rollback of an archived record
/// is appended to the archive and wins; a record archived twice (a crash before the purge) is read once.
#[tokio::test]
async fn archived_records_leave_groups_and_are_still_read_with_their_rollbacks() {
    let server = NatsServer::start().unwrap();
    let bus = bus(&server).await;
    let groups = GroupStore::open(&bus).await.unwrap();
    let record = |uid: &str, row: u64| {
        let mut s = GroupStatus {
            uid: uid.into(),
            partition: "train".into(),
            dataset_row: row,
            n: 2,
            task: Some(Default::default()),
            ..Default::default()
        };
        s.set_state(GroupState::Pending);
        s
    };
    let mut archived = Vec::new();
    for (uid, row) in [("a", 0), ("b", 1), ("c", 2)] {
        groups.create(&record(uid, row)).await.unwrap();
        groups.update("train", uid, |_| Some(GroupState::Running)).await.unwrap();
        groups.update("train", uid, |_| Some(GroupState::Finished)).await.unwrap();
        let (status, revision) = groups
            .update_from("train", uid, None, |s| {
                s.sampled_step = 4;
                Some(GroupState::Sampled)
            })
            .await
            .unwrap()
            .unwrap();
        archived.push((status, revision));
    }
    // c is retracted after the buffer saw it: its newer revision must survive the purge of the older one
    groups.retract("train", "c", Eviction::RolledBack, "test", 4).await.unwrap();
    assert_eq!(groups.archive(&archived).await.unwrap(), 3);
    assert_eq!(groups.archive(&archived[..1]).await.unwrap(), 1, "archiving again is harmless");
    let live: Vec<String> = groups.list("train").await.unwrap().into_iter().map(|g| g.uid).collect();
    assert_eq!(live, vec!["c".to_string()], "a and b purged from GROUPS, c's newer revision kept");
    let mut stream = groups.kv().stream.clone();
    let messages = stream.info().await.unwrap().state.messages;
    assert_eq!(messages, 1, "no revision of a or b is left in the bucket's stream");

    let by_uid = |records: Vec<GroupStatus>| {
        records.into_iter().map(|g| (g.uid.clone(), g)).collect::<std::collections::BTreeMap<_, _>>()
    };
    let all = by_uid(groups.records("train").await.unwrap());
    assert_eq!(all.len(), 3, "{all:?}");
    assert_eq!((all["a"].state(), all["a"].sampled_step), (GroupState::Sampled, 4));
    assert!(all["a"].task.is_none(), "the archive keeps no prompt task");
    assert_eq!(all["c"].state(), GroupState::Evicted, "the live, newer record wins");

    // a resume rolls back b, which is only in the archive
    let detail = "trained at step 4 after the checkpoint of step 2";
    groups.retract_known(&all["b"], Eviction::RolledBack, detail, 2).await.unwrap();
    let all = by_uid(groups.records("train").await.unwrap());
    assert_eq!(all["b"].state(), GroupState::Evicted);
    assert_eq!((all["b"].evicted_step, all["b"].dataset_row), (2, 1));
    assert_eq!((all["b"].eviction(), all["b"].evicted_reason.as_str()), (Eviction::RolledBack, detail));
    let (rows, duplicates) = crate::ledger::ledger(&all.into_values().collect::<Vec<_>>());
    assert!(duplicates.is_empty() && rows.len() == 3, "{rows:?}");

    // garbage on the archive's subject is skipped (and counted), the history still reads
    bus.publish_durable(Outgoing::new(bus.names().ledger_subject("train"), None, vec![0xff, 0xff, 0xff].into()))
        .await
        .unwrap();
    let all = by_uid(groups.records("train").await.unwrap());
    assert_eq!(all.len(), 3, "{all:?}");
}

/// A read that must get to a sequence (the last one on its subject as the stream leader has it) and whose
/// consumer ends before it (as one placed on a cluster replica still catching up does) fails, transiently, instead
/// of passing a short read for the whole; one that gets there reads everything.
#[tokio::test]
async fn a_stored_read_short_of_the_leaders_last_message_fails_instead_of_passing_for_the_whole() {
    use async_nats::jetstream::consumer::pull::OrderedConfig;
    let server = NatsServer::start().unwrap();
    let bus = bus(&server).await;
    let subject = bus.names().ledger_subject("train");
    let mut last = 0;
    for i in 0..3u8 {
        let ack = bus.jetstream().publish(subject.clone(), vec![i].into()).await.unwrap().await.unwrap();
        last = ack.sequence;
    }
    let stream = bus.stream(bus.names().ledger_stream()).await.unwrap();
    let config = || OrderedConfig { filter_subject: subject.clone(), ..Default::default() };
    let wait = Duration::from_millis(300);
    let mut seen = Vec::new();
    let read = consume::read_stored_through(&stream, config(), last, wait, |m| seen.push(m.payload[0])).await;
    assert_eq!(read.unwrap(), 3);
    assert_eq!(seen, [0, 1, 2]);
    let short = consume::read_stored_through(&stream, config(), last + 5, wait, |_| {}).await;
    let err = short.expect_err("a read short of the expected sequence must fail");
    assert_eq!(err.recovery(), Recovery::Transient, "{err}");
    assert!(err.to_string().contains(&format!("#{} expected", last + 5)), "{err}");
}

/// The connection state a stopping service asks for comes from the client's events: up at once while connected,
/// `unreachable_for` resolves after the broker has been gone that long, and `wait_connected` sees it come back.
#[tokio::test]
async fn connection_state_follows_the_clients_events() {
    let mut server = NatsServer::start().unwrap();
    let bus = bus(&server).await;
    assert!(bus.wait_connected(Duration::ZERO).await);
    server.kill();
    let started = std::time::Instant::now();
    tokio::time::timeout(Duration::from_secs(10), bus.unreachable_for(Duration::from_millis(500)))
        .await
        .expect("unreachable_for resolves once the broker is gone");
    assert!(started.elapsed() >= Duration::from_millis(500), "{:?}", started.elapsed());
    assert!(!bus.wait_connected(Duration::from_millis(200)).await);
    server.restart().unwrap();
    assert!(bus.wait_connected(Duration::from_secs(20)).await, "the reconnect was not seen");
    // back and staying up: unreachable_for does not resolve
    assert!(tokio::time::timeout(Duration::from_millis(700), bus.unreachable_for(Duration::from_millis(300)))
        .await
        .is_err());
}

/// A bucket of its own for the follower tests (history 1, like the job's buckets).
async fn follower_bucket(bus: &Bus, name: &str) -> async_nats::jetstream::kv::Store {
    bus.jetstream()
        .create_key_value(async_nats::jetstream::kv::Config { bucket: name.into(), ..Default::default() })
        .await
        .expect("bucket")
}

/// The next entry within `within`, as `(key, revision)`.
async fn next_of(follower: &mut watch::Follower, within: Duration) -> (String, u64) {
    let entry = tokio::time::timeout(within, follower.next()).await.expect("an entry in time").expect("watching");
    (entry.key, entry.revision)
}

/// With `Resume::After`, a follower that loses its watch (the server killed and started again) opens a new one
/// after the newest revision it delivered: every change is delivered once, none twice, none missed.
#[tokio::test]
async fn a_follower_delivers_every_change_once_through_a_server_restart() {
    let mut server = NatsServer::start().unwrap();
    let bus = bus(&server).await;
    let kv = follower_bucket(&bus, "FOLLOW_AFTER").await;
    for key in ["a", "b", "c"] {
        kv.put(key, "1".into()).await.unwrap();
    }
    let mut follower = watch::Follower::new(kv.clone(), ">", "test", "test_restarts_total", watch::Resume::After)
        .check_every(Duration::from_millis(200));
    let mut got = Vec::new();
    for _ in 0..3 {
        got.push(next_of(&mut follower, Duration::from_secs(5)).await);
    }
    server.kill();
    server.restart().unwrap();
    // written once the client is back (a put during its reconnect may fail: asked again)
    let mut written = 0;
    for key in ["b", "d"] {
        for _ in 0..100 {
            if kv.put(key, "2".into()).await.is_ok() {
                written += 1;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    assert_eq!(written, 2, "the puts after the restart");
    for _ in 0..2 {
        got.push(next_of(&mut follower, Duration::from_secs(20)).await);
    }
    let keys: Vec<(&str, u64)> = got.iter().map(|(k, r)| (k.as_str(), *r)).collect();
    assert_eq!(keys, [("a", 1), ("b", 2), ("c", 3), ("b", 4), ("d", 5)]);
    assert_eq!(follower.seen(), 5);
    // and nothing more comes (no revision delivered twice)
    assert!(tokio::time::timeout(Duration::from_millis(700), follower.next()).await.is_err());
}

/// A watch whose consumer is gone without an error (deleted on the server here; in a cluster, lost with its node)
/// delivers nothing more: the follower sees the bucket move past what it delivered and opens the watch again from
/// there, within its check interval (the client's own recovery of an ordered consumer takes several seconds).
#[tokio::test]
async fn a_follower_whose_watch_stalled_watches_again_from_what_it_delivered() {
    use futures::StreamExt;
    let server = NatsServer::start().unwrap();
    let bus = bus(&server).await;
    let kv = follower_bucket(&bus, "FOLLOW_STALL").await;
    kv.put("a", "1".into()).await.unwrap();
    let mut follower = watch::Follower::new(kv.clone(), ">", "test", "test_restarts_total", watch::Resume::After)
        .check_every(Duration::from_millis(200));
    assert_eq!(next_of(&mut follower, Duration::from_secs(5)).await, ("a".into(), 1));
    let stream = bus.jetstream().get_stream("KV_FOLLOW_STALL").await.unwrap();
    let consumers: Vec<String> = stream.consumer_names().filter_map(|n| async move { n.ok() }).collect().await;
    assert!(!consumers.is_empty(), "the watch's consumer");
    for name in &consumers {
        stream.delete_consumer(name).await.unwrap();
    }
    kv.put("b", "1".into()).await.unwrap();
    kv.put("a", "2".into()).await.unwrap();
    assert_eq!(next_of(&mut follower, Duration::from_secs(3)).await, ("b".into(), 2));
    assert_eq!(next_of(&mut follower, Duration::from_secs(3)).await, ("a".into(), 3));
    assert_eq!(follower.restarts(), 1, "opened again once, for the stall");
}

/// With `Resume::Newest` and a quiet window, a follower that hears nothing for that long opens its watch again and
/// is handed each key's newest value again (a heartbeat reader's deaf watch is replaced); `replay` does the same
/// on demand.
#[tokio::test]
async fn a_quiet_follower_watches_again_and_is_handed_each_keys_newest_value() {
    let server = NatsServer::start().unwrap();
    let bus = bus(&server).await;
    let kv = follower_bucket(&bus, "FOLLOW_NEWEST").await;
    kv.put("a", "1".into()).await.unwrap();
    kv.put("a", "2".into()).await.unwrap();
    kv.put("b", "1".into()).await.unwrap();
    let mut follower = watch::Follower::new(kv.clone(), ">", "test", "test_restarts_total", watch::Resume::Newest)
        .quiet(Duration::from_millis(400))
        .check_every(Duration::from_millis(100));
    assert_eq!(next_of(&mut follower, Duration::from_secs(5)).await, ("a".into(), 2));
    assert_eq!(next_of(&mut follower, Duration::from_secs(5)).await, ("b".into(), 3));
    assert_eq!(follower.restarts(), 0);
    let started = std::time::Instant::now();
    assert_eq!(next_of(&mut follower, Duration::from_secs(5)).await, ("a".into(), 2));
    assert!(started.elapsed() >= Duration::from_millis(300), "watched again after {:?}", started.elapsed());
    assert_eq!(follower.restarts(), 1);
    assert_eq!(next_of(&mut follower, Duration::from_secs(5)).await, ("b".into(), 3));
    follower.replay();
    assert_eq!(next_of(&mut follower, Duration::from_millis(300)).await, ("a".into(), 2));
    assert_eq!(follower.restarts(), 1, "a replay asked for is not a restart");
}

/// The stream sequence of the next message within `within`.
async fn next_seq(follower: &mut watch::Follower<watch::Messages>, within: Duration) -> u64 {
    let msg = tokio::time::timeout(within, follower.next()).await.expect("a message in time").expect("following");
    msg.info().expect("a JetStream message").stream_sequence
}

/// A stream's follower delivers each message once, in order, also when its consumer is deleted on the server
/// (recreated by the client or opened again by the follower, after the last sequence delivered); `replay` reads
/// every message again. (The stall check itself is unit-tested in `watch`.)
#[tokio::test]
async fn a_stream_follower_delivers_each_message_once_through_a_lost_consumer_and_replays_on_demand() {
    use futures::StreamExt;
    let server = NatsServer::start().unwrap();
    let bus = bus(&server).await;
    let config = async_nats::jetstream::stream::Config {
        name: "FOLLOW_MSGS".into(),
        subjects: vec!["follow.>".into()],
        ..Default::default()
    };
    let stream = bus.jetstream().create_stream(config).await.expect("stream");
    let js = bus.jetstream();
    let publish =
        |n: u64| async move { js.publish(format!("follow.{n}"), "x".into()).await.unwrap().await.unwrap().sequence };
    assert_eq!(publish(1).await, 1);
    let mut follower =
        watch::Follower::messages(bus.jetstream().clone(), "FOLLOW_MSGS", "follow.>", "test", "test_restarts_total")
            .check_every(Duration::from_millis(200));
    assert_eq!(next_seq(&mut follower, Duration::from_secs(5)).await, 1);
    let consumers: Vec<String> = stream.consumer_names().filter_map(|n| async move { n.ok() }).collect().await;
    assert!(!consumers.is_empty(), "the follower's consumer");
    for name in &consumers {
        stream.delete_consumer(name).await.unwrap();
    }
    publish(2).await;
    publish(3).await;
    assert_eq!(next_seq(&mut follower, Duration::from_secs(3)).await, 2);
    assert_eq!(next_seq(&mut follower, Duration::from_secs(3)).await, 3);
    assert_eq!(follower.seen(), 3);
    assert!(tokio::time::timeout(Duration::from_millis(700), follower.next()).await.is_err(), "nothing twice");
    follower.replay();
    assert_eq!(next_seq(&mut follower, Duration::from_secs(3)).await, 1, "a replay reads every message again");
}

/// A filter without wildcards is one key: the follower compares that key's revision with what it delivered, so
/// writes to other keys do not make it watch again.
#[tokio::test]
async fn a_follower_of_one_key_is_not_restarted_by_writes_to_others() {
    let server = NatsServer::start().unwrap();
    let bus = bus(&server).await;
    let kv = follower_bucket(&bus, "FOLLOW_KEY").await;
    kv.put("latest", "1".into()).await.unwrap();
    let mut follower = watch::Follower::new(kv.clone(), "latest", "test", "test_restarts_total", watch::Resume::Newest)
        .check_every(Duration::from_millis(100));
    assert_eq!(next_of(&mut follower, Duration::from_secs(5)).await, ("latest".into(), 1));
    for n in 0..5 {
        kv.put(format!("blob{n}"), "x".into()).await.unwrap();
    }
    assert!(tokio::time::timeout(Duration::from_millis(600), follower.next()).await.is_err());
    assert_eq!(follower.restarts(), 0);
    kv.put("latest", "2".into()).await.unwrap();
    assert_eq!(next_of(&mut follower, Duration::from_secs(5)).await, ("latest".into(), 7));
}

/// A watch the server refuses for good (a filter that is not a subject) is an error naming the bucket, returned to
/// the owner instead of asked for again for ever.
#[tokio::test]
async fn a_follower_whose_watch_is_refused_for_good_says_so() {
    let server = NatsServer::start().unwrap();
    let bus = bus(&server).await;
    let kv = follower_bucket(&bus, "FOLLOW_BAD").await;
    let mut follower = watch::Follower::new(kv, "a..b", "test", "test_restarts_total", watch::Resume::Newest);
    let err = tokio::time::timeout(Duration::from_secs(10), follower.next())
        .await
        .expect("an answer in time")
        .expect_err("refused");
    assert_eq!(err.recovery(), Recovery::Permanent, "{err}");
    assert!(err.to_string().contains("FOLLOW_BAD"), "{err}");
}
