//! The hand-off from the rollout worker to the reward service: once every trajectory of a group is stored in
//! TRAJ, one [`ScoreRequest`] with the trajectories minus their token arrays goes to the SCORE work queue. And the
//! hand-off from the reward service to the replay buffer: [`reward_message`], one per micro-batch.

use std::collections::HashMap;

use jetrl_wire::score::{factor_common, request_id, reward_batch_id, score_view};
use jetrl_wire::subjects::{self, Names};
use jetrl_wire::v1::{Reward, RewardBatch, ScoreRequest, Trajectory};
use jetrl_wire::Message;

use crate::publish::{Acked, Outgoing};
use crate::{Bus, BusError, Cause, Publisher};

/// Collects a group's trajectories as they are published, then publishes their score request.
#[derive(Debug, Clone)]
pub struct ScoreRequestBuilder {
    request: ScoreRequest,
}

impl ScoreRequestBuilder {
    pub fn new(partition: &str, uid: &str) -> Self {
        Self { request: ScoreRequest { uid: uid.into(), partition: partition.into(), ..Default::default() } }
    }

    /// Keeps the score view of a trajectory being published (its stored sequence comes from its ack).
    pub fn add(&mut self, traj: &Trajectory) {
        self.request.trajectories.push(score_view(traj, 0));
    }

    /// The request as it would go on the wire now (stored sequences are filled in by [`Self::publish`]).
    pub fn wire_request(&self) -> ScoreRequest {
        let mut request = self.request.clone();
        request.trajectories.sort_by(|a, b| a.key.cmp(&b.key));
        factor_common(&mut request);
        request
    }

    pub fn is_empty(&self) -> bool {
        self.request.trajectories.is_empty()
    }

    /// Publishes the request once every trajectory is acknowledged (`acks`: at least those of this group's
    /// trajectories, matched by key). A trajectory the stream already held under its key — an earlier attempt at
    /// this group stored it before its worker died — is replaced by the stored copy, so the score is computed on
    /// the payload the trainer will read. Waits until the request is stored; returns its id (`None` when the group
    /// has no trajectories and nothing was published).
    pub async fn publish(mut self, bus: &Bus, acks: &[Acked]) -> Result<Option<String>, BusError> {
        if self.is_empty() {
            return Ok(None);
        }
        let by_key: HashMap<&str, &Acked> = acks.iter().filter_map(|a| a.msg_id.as_deref().map(|id| (id, a))).collect();
        let mut traj_stream = None;
        for view in &mut self.request.trajectories {
            let Some(ack) = by_key.get(view.key.as_str()) else {
                return Err(BusError::Publish {
                    subject: bus.names().score_subject(&self.request.partition, &self.request.uid),
                    cause: Cause::permanent(format!("trajectory {} has no publish acknowledgement", view.key)),
                });
            };
            view.stored_seq = ack.sequence;
            if ack.duplicate {
                let stream = match &traj_stream {
                    Some(stream) => stream,
                    None => traj_stream.insert(bus.stream(bus.names().traj_stream()).await?),
                };
                match stream.direct_get(ack.sequence).await.map(|m| Trajectory::decode(m.payload.as_ref())) {
                    Ok(Ok(stored)) if stored.key == view.key => *view = score_view(&stored, ack.sequence),
                    Ok(Ok(_)) | Ok(Err(_)) => {
                        tracing::warn!(key = %view.key, seq = ack.sequence, "stored copy of a duplicate trajectory does not match its key; scoring this copy")
                    }
                    Err(err) => {
                        return Err(BusError::Consume {
                            what: format!("{} seq {}", bus.names().traj_stream(), ack.sequence),
                            cause: Cause::of(err),
                        })
                    }
                }
            }
        }
        // Key order, so a retried group with the same trajectories gets the same id whatever order they finished in.
        self.request.trajectories.sort_by(|a, b| a.key.cmp(&b.key));
        factor_common(&mut self.request);
        let id = request_id(&self.request);
        let subject = bus.names().score_subject(&self.request.partition, &self.request.uid);
        bus.publish_durable(Outgoing::protobuf(subject, Some(id.clone()), &self.request)).await?;
        Ok(Some(id))
    }
}

/// Publishes a whole group at once as a rollout worker does over time: every trajectory into TRAJ (pipelined,
/// keyed by its key), then the score request. For simulated producers, tests and benchmarks; the worker itself
/// publishes each trajectory as its session ends. Returns the trajectories' acks and the request id (`None` for
/// no trajectories).
pub async fn publish_group(
    bus: &Bus,
    partition: &str,
    uid: &str,
    trajectories: &[Trajectory],
) -> Result<(Vec<Acked>, Option<String>), BusError> {
    let mut publisher = Publisher::new(bus, trajectories.len().max(1));
    let mut scoring = ScoreRequestBuilder::new(partition, uid);
    for traj in trajectories {
        let subject = bus.names().traj_subject(partition, uid);
        publisher.publish(Outgoing::protobuf(subject, Some(traj.key.clone()), traj)).await?;
        scoring.add(traj);
    }
    let acks = publisher.drain().await?;
    let id = scoring.publish(bus, &acks).await?;
    Ok((acks, id))
}

/// One reward message of job `names`: the batch on its partition's subject, the answered requests' ids in
/// [`subjects::SCORE_REQUESTS_HEADER`], and a `Nats-Msg-Id` derived from them (the same requests answered again
/// are stored once).
pub fn reward_message(names: &Names, partition: &str, batch: &RewardBatch, request_ids: &[String]) -> Outgoing {
    let ids: Vec<&str> = request_ids.iter().map(String::as_str).collect();
    let msg_id = reward_batch_id(&ids);
    Outgoing::protobuf(names.reward_batch_subject(partition), Some(msg_id), batch)
        .header(subjects::SCORE_REQUESTS_HEADER, ids.join(" "))
}

/// Every reward stored in REWARDS now, in stream order (release markers and batches that do not decode are
/// skipped): for tests and benchmarks, which check what the reward services wrote.
pub async fn stored_rewards(bus: &Bus) -> Result<Vec<Reward>, BusError> {
    let stream = bus.stream(bus.names().rewards_stream()).await?;
    let config = async_nats::jetstream::consumer::pull::OrderedConfig {
        filter_subject: bus.names().reward_batches_filter(),
        ..Default::default()
    };
    let mut rewards = Vec::new();
    crate::consume::read_stored(&stream, config, usize::MAX, std::time::Duration::from_secs(1), |msg| {
        if let Ok(batch) = RewardBatch::decode(msg.payload.clone()) {
            rewards.extend(batch.rewards);
        }
    })
    .await?;
    Ok(rewards)
}
