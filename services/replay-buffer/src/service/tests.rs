//! The buffer's handlers, one event at a time, against a real nats-server: each test feeds the buffer what its
//! inputs would deliver (a group record as the GROUPS watch delivers it, through [`Buffer::on_group_entry`]; a
//! reward straight into the state, as the REWARDS handler would index it), calls the request handlers
//! [`Buffer::serve`] dispatches to, and checks what they wrote to the GROUPS bucket, what they answered, and what
//! they kept. The decisions beneath them (which groups, which evictions) have their own tests in `sampler` and
//! `state`.

use std::time::Duration;

use async_nats::jetstream::kv;
use futures::StreamExt;
use jetrl_bus::{Bus, NatsServer};
use jetrl_config::{JobConfig, NatsConfig};
use jetrl_wire::keys::TrajectoryKey;
use jetrl_wire::subjects::{self, Names};
use jetrl_wire::v1::{ErrorCode, Eviction, GroupState, GroupStatus, Reward, SampleRequest, SampleResponse};
use jetrl_wire::Message;

use super::Buffer;
use crate::reread::Reread;
use crate::sampler::{Mode, SamplerConfig, Strategy};

/// A buffer of job `test` on `server` (its topology declared), with the sampler of a default (sync) job.
async fn buffer(server: &NatsServer) -> Buffer {
    buffer_with(server, SamplerConfig::from_job(&JobConfig::default())).await
}

async fn buffer_with(server: &NatsServer, sampler: SamplerConfig) -> Buffer {
    let cfg = NatsConfig { url: server.url(), ..NatsConfig::default() };
    let bus = Bus::connect(&cfg, &Names::new("test").expect("namespace"), "buffer-test").await.expect("connect");
    bus.declare_topology().await.expect("topology");
    Buffer::start(bus, sampler, Reread::new(Duration::ZERO)).await.expect("buffer")
}

/// A `train` record of group `uid` in `state`, submitted at `step`, listing one trajectory when terminal.
fn record(uid: &str, state: GroupState, step: u64) -> GroupStatus {
    let mut status = GroupStatus {
        uid: uid.into(),
        partition: "train".into(),
        submit_step: step,
        n: 1,
        trajectory_keys: if state.is_terminal() { vec![format!("{uid}_0_0")] } else { vec![] },
        ..Default::default()
    };
    status.set_state(state);
    status
}

/// The newest entry of `uid`'s record as the GROUPS watch delivers it (a delete marker included).
async fn newest_entry(buffer: &Buffer, uid: &str) -> kv::Entry {
    let mut history = buffer.groups.kv().history(subjects::group_key("train", uid)).await.expect("history");
    let mut newest = None;
    while let Ok(Some(entry)) = tokio::time::timeout(Duration::from_secs(2), history.next()).await {
        let entry = entry.expect("entry");
        let last = entry.delta == 0;
        newest = Some(entry);
        if last {
            break;
        }
    }
    newest.expect("the record has an entry")
}

/// Writes `uid`'s record, applies it as the watch would, and scores its trajectory (as the REWARDS input would);
/// returns the record's revision.
async fn complete_group(buffer: &mut Buffer, uid: &str, step: u64) -> u64 {
    buffer.groups.create(&record(uid, GroupState::Finished, step)).await.expect("create");
    let entry = newest_entry(buffer, uid).await;
    assert!(buffer.on_group_entry(&entry), "a finished record may complete a batch");
    assert!(score(buffer, uid), "a new reward is indexed");
    entry.revision
}

/// Indexes a reward of 1.0 for `uid`'s one trajectory at the next REWARDS sequence; returns whether it was new.
fn score(buffer: &mut Buffer, uid: &str) -> bool {
    let key = format!("{uid}_0_0");
    let parsed = TrajectoryKey::parse(&key).expect("key");
    let seq = buffer.state.rewards_read() + 1;
    let reward = Reward {
        uid: uid.into(),
        key,
        partition: "train".into(),
        score: 1.0,
        session_id: parsed.session_id,
        index: parsed.index,
        ..Default::default()
    };
    buffer.state.rewards_read_through(seq);
    buffer.state.apply_reward(reward, seq)
}

fn request(id: &str, step: u64, batch_size: u32) -> SampleRequest {
    SampleRequest {
        request_id: id.into(),
        step,
        partition: "train".into(),
        batch_size,
        wait_ms: 60_000,
        incarnation: 1,
        ..Default::default()
    }
}

/// `payload` as the sample subscription delivers it, to be answered on `reply`.
fn sample_message(buffer: &Buffer, payload: Vec<u8>, reply: &str) -> async_nats::Message {
    async_nats::Message {
        subject: buffer.bus.names().buffer_sample().into(),
        reply: Some(reply.into()),
        payload: payload.into(),
        headers: None,
        status: None,
        description: None,
        length: 0,
    }
}

async fn next_answer(replies: &mut async_nats::Subscriber) -> SampleResponse {
    let msg = tokio::time::timeout(Duration::from_secs(5), replies.next())
        .await
        .expect("an answer within 5 s")
        .expect("subscription open");
    SampleResponse::decode(msg.payload.as_ref()).expect("a SampleResponse")
}

fn uids(response: &SampleResponse) -> Vec<String> {
    let mut uids: Vec<String> = response.groups.iter().map(|g| g.uid.clone()).collect();
    uids.sort();
    uids
}

#[tokio::test]
async fn a_record_is_applied_with_its_revision_a_delete_forgets_it_and_a_malformed_one_is_left_out() {
    let server = NatsServer::start().unwrap();
    let mut buffer = buffer(&server).await;
    assert!(
        buffer.groups_cursor.is_current() && buffer.rewards_input.is_current(),
        "an empty bucket and stream are read through"
    );

    buffer.groups.create(&record("running", GroupState::Running, 1)).await.unwrap();
    let entry = newest_entry(&buffer, "running").await;
    assert!(!buffer.on_group_entry(&entry), "a running group cannot complete a batch");
    assert_eq!(buffer.state.group("train", "running").map(|g| g.state()), Some(GroupState::Running));
    assert_eq!(buffer.state.known_revision("train", "running"), Some(entry.revision));

    buffer.groups.create(&record("done", GroupState::Finished, 1)).await.unwrap();
    let entry = newest_entry(&buffer, "done").await;
    assert!(buffer.on_group_entry(&entry), "a finished group may complete a batch");
    assert_eq!(buffer.state.group("train", "done").map(|g| g.state()), Some(GroupState::Finished));

    let kv = buffer.groups.kv().clone();
    kv.put(subjects::group_key("train", "garbled"), vec![0xff, 0xff, 0xff].into()).await.unwrap();
    let entry = newest_entry(&buffer, "garbled").await;
    assert!(!buffer.on_group_entry(&entry));
    assert!(buffer.state.group("train", "garbled").is_none(), "a malformed record is not applied");

    kv.delete(subjects::group_key("train", "done")).await.unwrap();
    let entry = newest_entry(&buffer, "done").await;
    assert_eq!(entry.operation, kv::Operation::Delete);
    assert!(buffer.on_group_entry(&entry), "a deleted group leaves the batch it was counted in");
    assert!(buffer.state.group("train", "done").is_none());
    assert!(buffer.state.group("train", "running").is_some(), "only the deleted group is forgotten");
}

#[tokio::test]
async fn a_request_waits_for_a_full_batch_then_its_groups_are_marked_sampled_and_a_retry_gets_the_same_answer() {
    let server = NatsServer::start().unwrap();
    let mut buffer = buffer(&server).await;
    let mut replies = buffer.bus.client().subscribe("replies.>").await.unwrap();

    complete_group(&mut buffer, "g1", 3).await;
    let payload = request("r1", 3, 2).encode_to_vec();
    buffer.on_sample_request(sample_message(&buffer, payload.clone(), "replies.1"));
    buffer.answer_waiting().await;
    assert_eq!(buffer.waiting.len(), 1, "one complete group of the two asked for: the request waits");

    complete_group(&mut buffer, "g2", 3).await;
    buffer.answer_waiting().await;
    assert!(buffer.waiting.is_empty() && buffer.waiting.waiting_since().is_none());
    let answer = next_answer(&mut replies).await;
    assert_eq!((answer.request_id.as_str(), answer.not_ready, answer.error.as_str()), ("r1", false, ""));
    assert_eq!(uids(&answer), ["g1", "g2"]);
    assert!(answer.groups.iter().all(|g| g.trajectories.len() == 1 && g.trajectories[0].score == 1.0));
    for uid in ["g1", "g2"] {
        let (status, _) = buffer.groups.get("train", uid).await.unwrap().expect("record");
        assert_eq!(
            (status.state(), status.sampled_step, status.sample_request_id.as_str()),
            (GroupState::Sampled, 3, "r1")
        );
        assert_eq!(buffer.state.group("train", uid).map(|g| g.state()), Some(GroupState::Sampled));
    }

    // the trainer timed out and asks again: the same groups, not a second batch
    complete_group(&mut buffer, "g3", 3).await;
    buffer.on_sample_request(sample_message(&buffer, payload, "replies.2"));
    buffer.answer_waiting().await;
    assert_eq!(next_answer(&mut replies).await, answer);
    let (status, _) = buffer.groups.get("train", "g3").await.unwrap().expect("record");
    assert_eq!(status.state(), GroupState::Finished, "the retry sampled nothing more");
}

#[tokio::test]
async fn a_restarted_buffer_answers_a_retry_from_the_groups_already_marked_for_it() {
    let server = NatsServer::start().unwrap();
    let mut before = buffer(&server).await;
    complete_group(&mut before, "g1", 2).await;
    complete_group(&mut before, "g2", 2).await;
    let answer = before.try_answer(&request("r1", 2, 2)).await.expect("answered");
    assert_eq!(uids(&answer), ["g1", "g2"]);

    // a new buffer has no remembered answers; it reads the records (now sampled for r1) and the rewards again
    let mut after = buffer(&server).await;
    assert!(!after.groups_cursor.is_current(), "a bucket with records is replayed first");
    for uid in ["g1", "g2", "g3"] {
        if uid == "g3" {
            after.groups.create(&record(uid, GroupState::Finished, 2)).await.unwrap();
        }
        let entry = newest_entry(&after, uid).await;
        after.on_group_entry(&entry);
        score(&mut after, uid);
    }
    let again = after.try_answer(&request("r1", 2, 2)).await.expect("answered from the marked groups");
    assert_eq!(uids(&again), ["g1", "g2"], "the groups marked for r1, not g3");
}

#[tokio::test]
async fn an_off_policy_group_is_evicted_in_the_bucket_with_its_reason_and_the_request_asks_for_a_refill() {
    let server = NatsServer::start().unwrap();
    let sampler = SamplerConfig {
        mode: Mode::Async,
        strategy: Strategy::Drop,
        max_off_policy_threshold: 1,
        ..SamplerConfig::from_job(&JobConfig::default())
    };
    let mut buffer = buffer_with(&server, sampler).await;
    complete_group(&mut buffer, "old", 1).await;
    complete_group(&mut buffer, "fresh", 5).await;

    // step 5: `old` spans steps 1..=5, beyond a threshold of 1
    let response = buffer.try_answer(&request("r5", 5, 2)).await.expect("a refill is an answer");
    assert!(response.not_ready);
    assert_eq!(response.refill, 1, "one group evicted, one refill asked for");
    let (status, _) = buffer.groups.get("train", "old").await.unwrap().expect("record");
    assert_eq!((status.state(), status.eviction(), status.evicted_step), (GroupState::Evicted, Eviction::OffPolicy, 5));
    assert_eq!(status.evicted_reason, "submission span 5");
    let (status, _) = buffer.groups.get("train", "fresh").await.unwrap().expect("record");
    assert_eq!(status.state(), GroupState::Finished, "the fresh group stays for the batch");
    assert!(buffer.waiting.has_progress("r5"), "the refill granted is remembered for the request");
}

#[tokio::test]
async fn malformed_and_superseded_requests_are_answered_with_their_code_and_a_newer_trainer_drops_older_waits() {
    let server = NatsServer::start().unwrap();
    let mut buffer = buffer(&server).await;
    let mut replies = buffer.bus.client().subscribe("replies.>").await.unwrap();

    buffer.on_sample_request(sample_message(&buffer, vec![0xff, 0x01], "replies.bad"));
    let answer = next_answer(&mut replies).await;
    assert_eq!(answer.code(), ErrorCode::Malformed);
    assert!(answer.error.contains("malformed SampleRequest"), "{}", answer.error);
    assert!(buffer.waiting.is_empty(), "a malformed request never waits");

    let at = |incarnation: u64, id: &str| SampleRequest { incarnation, ..request(id, 1, 4) }.encode_to_vec();
    buffer.on_sample_request(sample_message(&buffer, at(5, "five"), "replies.5"));
    assert_eq!((buffer.waiting.len(), buffer.waiting.incarnation()), (1, 5));

    buffer.on_sample_request(sample_message(&buffer, at(3, "three"), "replies.3"));
    let answer = next_answer(&mut replies).await;
    assert_eq!((answer.request_id.as_str(), answer.code()), ("three", ErrorCode::Superseded));
    assert_eq!(buffer.waiting.len(), 1, "a superseded trainer's request is refused, not kept");

    buffer.on_sample_request(sample_message(&buffer, at(7, "seven"), "replies.7"));
    let ids: Vec<&str> = buffer.waiting.request_ids().collect();
    assert_eq!(
        (ids, buffer.waiting.incarnation()),
        (vec!["seven"], 7),
        "incarnation 5's request left with its trainer"
    );
}

#[tokio::test]
async fn a_request_naming_a_groups_revision_the_watch_has_not_delivered_waits_for_it_and_expires_as_not_ready() {
    let server = NatsServer::start().unwrap();
    let mut buffer = buffer(&server).await;
    let mut replies = buffer.bus.client().subscribe("replies.>").await.unwrap();
    let revision = complete_group(&mut buffer, "g1", 1).await;
    // what `on_record` notes once the watch has delivered g1's record
    buffer.groups_cursor.delivered(revision, 0);

    let ahead = SampleRequest { groups_revision: revision + 1, wait_ms: 50, ..request("ahead", 1, 1) };
    assert!(buffer.try_answer(&ahead).await.is_none(), "a record the watch has not delivered may belong to it");
    buffer.on_sample_request(sample_message(&buffer, ahead.encode_to_vec(), "replies.ahead"));
    buffer.answer_waiting().await;
    assert_eq!(buffer.waiting.len(), 1);

    tokio::time::sleep(Duration::from_millis(60)).await;
    buffer.expire_waiting().await;
    let answer = next_answer(&mut replies).await;
    assert_eq!((answer.request_id.as_str(), answer.not_ready, answer.groups.len()), ("ahead", true, 0));
    assert!(buffer.waiting.is_empty());
    let (status, _) = buffer.groups.get("train", "g1").await.unwrap().expect("record");
    assert_eq!(status.state(), GroupState::Finished, "nothing sampled for an expired request");

    let reached = SampleRequest { groups_revision: revision, ..request("reached", 1, 1) };
    let answer = buffer.try_answer(&reached).await.expect("the revision it names is delivered");
    assert_eq!(uids(&answer), ["g1"]);
}
