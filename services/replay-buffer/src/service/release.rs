//! Releases (a trained step's groups leave the index, their payloads are purged, a marker records it) and ledger
//! queries.

use futures::StreamExt;
use jetrl_bus::consume;
use jetrl_bus::publish::Outgoing;
use jetrl_wire::subjects::{self, Names};
use jetrl_wire::v1::{ErrorCode, LedgerRequest, LedgerResponse, ReleaseRequest, ReleaseResponse, ReleasedGroups};
use jetrl_wire::Message;

use super::{Buffer, SERVICE};

impl Buffer {
    pub(super) async fn on_release(&mut self, msg: async_nats::Message) {
        let Some(reply) = msg.reply.clone() else { return };
        let request = match ReleaseRequest::decode(msg.payload.as_ref()) {
            Ok(r) => r,
            Err(err) => {
                let reason = format!("malformed ReleaseRequest: {err}");
                consume::dead_letter(SERVICE, self.bus.names().buffer_release(), &msg.subject, &reason, &msg.payload);
                let response = ReleaseResponse {
                    error: format!("malformed ReleaseRequest: {err}"),
                    code: ErrorCode::Malformed as i32,
                    ..Default::default()
                };
                self.reply(&reply, &response).await;
                return;
            }
        };
        let groups = self.state.release(&request.request_ids);
        for id in &request.request_ids {
            self.answers.forget(id);
            self.waiting.forget(id);
        }
        let released: usize = groups.iter().map(|g| g.2).sum();
        self.record_release(&request, &groups).await;
        // The index is gone; the payload purge runs in the background so the trainer's step never waits
        // on storage. A purge that did not happen (a crash) leaves bytes behind for the streams' max age,
        // never a group that can be sampled again (its record says sampled); a restart purges again.
        tokio::spawn(purge_payloads(self.traj.clone(), self.bus.names().clone(), groups));
        let response = ReleaseResponse { released_trajectories: released as u64, ..Default::default() };
        self.reply(&reply, &response).await;
    }

    /// Writes the release marker of `groups` to REWARDS and waits until it is stored, before the release is
    /// answered: their rewards stay in the stream until the floor passes them, and a restarted buffer must not
    /// take those for groups still waiting for their trainer. A marker that cannot be written is logged and
    /// counted; the release goes on (after a restart those groups would hold the floor until the stream's max
    /// age).
    pub(super) async fn record_release(&self, request: &ReleaseRequest, groups: &[(String, String, usize)]) {
        if groups.is_empty() {
            return;
        }
        let marker = ReleasedGroups {
            step: request.step,
            request_ids: request.request_ids.clone(),
            groups: groups.iter().map(|(partition, uid, _)| subjects::group_key(partition, uid)).collect(),
        };
        let subject = self.bus.names().released_subject();
        if let Err(err) = self.bus.publish_durable(Outgoing::protobuf(subject, None, &marker)).await {
            tracing::error!(step = request.step, error = %err, "release marker not stored");
            metrics::counter!("jetrl_buffer_release_marker_errors_total").increment(1);
        }
    }

    pub(super) async fn on_ledger(&self, msg: async_nats::Message) {
        let Some(reply) = msg.reply.clone() else { return };
        let response = match LedgerRequest::decode(msg.payload.as_ref()) {
            Ok(req) => {
                let limit = if req.limit == 0 { 10_000 } else { req.limit as usize };
                LedgerResponse {
                    entries: self.state.ledger(&req.partition, &req.uids, limit),
                    counts: self.state.counts(&req.partition).into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
                    ..Default::default()
                }
            }
            Err(err) => {
                let reason = format!("malformed LedgerRequest: {err}");
                consume::dead_letter(SERVICE, self.bus.names().buffer_ledger(), &msg.subject, &reason, &msg.payload);
                LedgerResponse {
                    error: format!("malformed LedgerRequest: {err}"),
                    code: ErrorCode::Malformed as i32,
                    ..Default::default()
                }
            }
        };
        self.reply(&reply, &response).await;
    }
}

/// Purges released (or evicted) groups' payloads: one TRAJ subject per group (`jetrl.<ns>.traj.<partition>.<uid>`),
/// so a whole group goes in one request, many requests in flight. `groups` are (partition, uid, trajectories
/// released). Their rewards go with the floor purge ([`Buffer::purge_rewards`]).
pub(super) async fn purge_payloads(
    traj: async_nats::jetstream::stream::Stream,
    names: Names,
    groups: Vec<(String, String, usize)>,
) {
    let trajectories: usize = groups.iter().map(|g| g.2).sum();
    let subjects: Vec<String> = groups.iter().map(|(partition, uid, _)| names.traj_subject(partition, uid)).collect();
    futures::stream::iter(subjects.into_iter().map(|subject| {
        let traj = traj.clone();
        async move {
            if let Err(err) = traj.purge().filter(subject.clone()).await {
                tracing::warn!(%subject, error = %err, "purge failed");
            }
        }
    }))
    .buffer_unordered(64)
    .collect::<Vec<_>>()
    .await;
    metrics::counter!("jetrl_buffer_released_trajectories_total").increment(trajectories as u64);
}
