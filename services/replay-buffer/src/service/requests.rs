//! Sample requests: each one answered when the sampling policy finds enough complete groups (evicting what it
//! must), kept waiting until its deadline otherwise; answers remembered for a retried request.

use std::collections::VecDeque;
use std::time::Instant;

use jetrl_bus::{consume, BusError, Cause, GroupStore};
use jetrl_wire::subjects;
use jetrl_wire::v1::{ErrorCode, GroupState, SampleRequest, SampleResponse};
use jetrl_wire::Message;

use super::release::purge_payloads;
use super::{Buffer, SERVICE};
use crate::sampler::{next_action, Action, EvictReason, Progress};

impl Buffer {
    pub(super) fn on_sample_request(&mut self, msg: async_nats::Message) {
        let Some(reply) = msg.reply.clone() else { return };
        match SampleRequest::decode(msg.payload.as_ref()) {
            Ok(request) if self.waiting.is_superseded(request.incarnation) => {
                tracing::warn!(
                    request_id = %request.request_id,
                    incarnation = request.incarnation,
                    newest = self.waiting.incarnation(),
                    "sample request from a superseded trainer incarnation refused"
                );
                let response = SampleResponse {
                    request_id: request.request_id.clone(),
                    error: format!(
                        "trainer incarnation {} is superseded by {} (a newer trainer holds the job)",
                        request.incarnation,
                        self.waiting.incarnation()
                    ),
                    code: ErrorCode::Superseded as i32,
                    ..Default::default()
                };
                let client = self.bus.client().clone();
                tokio::spawn(async move { client.publish(reply, response.encode_to_vec().into()).await });
            }
            Ok(request) => self.waiting.admit(request, reply, Instant::now()),
            Err(err) => {
                let reason = format!("malformed SampleRequest: {err}");
                consume::dead_letter(SERVICE, self.bus.names().buffer_sample(), &msg.subject, &reason, &msg.payload);
                tracing::error!(subject = %msg.subject, error = %err, "malformed sample request");
                let response = SampleResponse {
                    error: format!("malformed SampleRequest: {err}"),
                    code: ErrorCode::Malformed as i32,
                    ..Default::default()
                };
                let client = self.bus.client().clone();
                tokio::spawn(async move { client.publish(reply, response.encode_to_vec().into()).await });
            }
        }
    }

    /// Answers every waiting request that can be answered now, in arrival order.
    pub(super) async fn answer_waiting(&mut self) {
        if !(self.groups_cursor.is_current() && self.rewards_input.is_current()) || self.waiting.is_empty() {
            return;
        }
        let mut still_waiting = VecDeque::new();
        for w in self.waiting.take_all() {
            match self.try_answer(&w.request).await {
                Some(response) => {
                    metrics::histogram!("jetrl_buffer_sample_wait_seconds").record(w.received.elapsed().as_secs_f64());
                    self.reply(&w.reply, &response).await;
                    self.waiting.answered();
                    self.reread.answered();
                }
                None => still_waiting.push_back(w),
            }
        }
        self.waiting.put_back(still_waiting);
    }

    pub(super) async fn expire_waiting(&mut self) {
        for w in self.waiting.take_expired(Instant::now()) {
            let response =
                SampleResponse { request_id: w.request.request_id.clone(), not_ready: true, ..Default::default() };
            self.reply(&w.reply, &response).await;
        }
    }

    /// The answer to `request` if it can be given now: a remembered answer (retry), the groups a previous
    /// incarnation already consumed for it (retry after a restart), or the sampling policy's verdict
    /// (which may first evict groups and ask the trainer for refills).
    pub(super) async fn try_answer(&mut self, request: &SampleRequest) -> Option<SampleResponse> {
        if let Some(previous) = self.answers.get(&request.request_id) {
            return Some(previous.clone());
        }
        let prior: Vec<String> =
            self.state.sampled_by(&request.request_id).iter().map(|g| g.status.uid.clone()).collect();
        if !prior.is_empty() && prior.len() >= request.batch_size as usize {
            return Some(self.respond(request, &prior, Default::default()));
        }
        if request.groups_revision > self.groups_cursor.revision() {
            // the trainer created records for this request that the watch has not delivered yet: deciding now
            // would leave those groups out (a sync DAPO batch answered before its last refills were seen)
            return None;
        }
        if !prior.is_empty() {
            // Marking the batch sampled stopped part-way (a write refused, or a restart between the writes): the
            // groups marked stay this request's, and the rest of the batch is sampled beside them. Answered with
            // only these, a sync step trained three groups of four in the three-node cluster test.
            tracing::warn!(
                request_id = %request.request_id,
                marked = prior.len(),
                batch = request.batch_size,
                "part of this request's batch is marked sampled; sampling the rest"
            );
        }
        let mut progress = self.waiting.take_progress(&request.request_id);
        let response = self.run_policy(request, &prior, &mut progress).await;
        if response.as_ref().is_none_or(|r| r.not_ready) {
            self.waiting.keep_progress(&request.request_id, progress);
        }
        response
    }

    /// Runs the sampling policy for one request until it answers, asks for refills, fails or must wait. `prior`:
    /// groups already marked sampled for it; the policy picks the rest of the batch.
    pub(super) async fn run_policy(
        &mut self,
        request: &SampleRequest,
        prior: &[String],
        progress: &mut Progress,
    ) -> Option<SampleResponse> {
        let rest =
            SampleRequest { batch_size: request.batch_size.saturating_sub(prior.len() as u32), ..request.clone() };
        let mut iterations = 0;
        loop {
            iterations += 1;
            if iterations > 64 {
                // every eviction shrinks the candidate set, so this never loops; stay safe anyway
                return None;
            }
            match next_action(&self.state, &self.sampler, &rest, progress) {
                Action::Evict(evicted) => {
                    let done = self.evict(&request.partition, request.step, &evicted).await;
                    progress.record_eviction(&done);
                }
                Action::Refill(n) => {
                    progress.record_refill(n);
                    metrics::counter!("jetrl_buffer_refills_total", "partition" => request.partition.clone())
                        .increment(u64::from(n));
                    return Some(SampleResponse {
                        request_id: request.request_id.clone(),
                        not_ready: true,
                        refill: n,
                        ..Default::default()
                    });
                }
                Action::Answer { selected, discard } => {
                    let surplus: Vec<(String, EvictReason)> =
                        discard.into_iter().map(|uid| (uid, EvictReason::DiscardedSurplus)).collect();
                    let done = self.evict(&request.partition, request.step, &surplus).await;
                    progress.record_eviction(&done);
                    match self.consume(request, &selected).await {
                        Some(uids) => {
                            let prefix = if request.partition == "val" { "validation" } else { "training" };
                            let uids: Vec<String> = prior.iter().cloned().chain(uids).collect();
                            let response = self.respond(request, &uids, progress.metrics(prefix));
                            self.remember(response.clone());
                            return Some(response);
                        }
                        None => return None,
                    }
                }
                Action::Wait => return None,
                Action::Fail(error) => {
                    tracing::error!(request_id = %request.request_id, %error, "sample request cannot be answered");
                    return Some(SampleResponse {
                        request_id: request.request_id.clone(),
                        error,
                        code: ErrorCode::Invalid as i32,
                        ..Default::default()
                    });
                }
            }
        }
    }

    /// Marks groups evicted (CAS), locally too; returns those actually evicted.
    pub(super) async fn evict(
        &mut self,
        partition: &str,
        step: u64,
        groups: &[(String, EvictReason)],
    ) -> Vec<(String, EvictReason)> {
        // Owned inputs (no borrowed closure arguments) keep this future `Send` for every lifetime.
        let jobs: Vec<(GroupStore, String, String, EvictReason)> = groups
            .iter()
            .map(|(uid, reason)| (self.groups.clone(), partition.to_string(), uid.clone(), reason.clone()))
            .collect();
        let results = futures::future::join_all(jobs.into_iter().map(|(store, partition, uid, reason)| async move {
            store.evict(&partition, &uid, reason.eviction(), &reason.detail(), step).await
        }))
        .await;
        let mut done = Vec::new();
        for ((uid, reason), result) in groups.iter().zip(results) {
            match result {
                Ok(revision) => {
                    self.state.mark_evicted(partition, uid, reason.eviction(), &reason.detail(), revision.unwrap_or(0));
                    metrics::counter!("jetrl_buffer_evicted_groups_total", "reason" => reason.label()).increment(1);
                    done.push((uid.clone(), reason.clone()));
                }
                Err(err) => tracing::error!(%uid, error = %err, "could not evict group"),
            }
        }
        // Nothing reads an evicted group's payloads again (the ledger keeps the reason): they go as released
        // ones do, in the background.
        if !done.is_empty() {
            let evicted = done.iter().map(|(uid, _)| (partition.to_string(), uid.clone(), 0)).collect();
            tokio::spawn(purge_payloads(self.traj.clone(), self.bus.names().clone(), evicted));
        }
        done
    }

    /// Marks the selected groups sampled (CAS, all in flight at once). None if any record changed under us:
    /// what was confirmed is found again by request id next time.
    pub(super) async fn consume(&mut self, request: &SampleRequest, selected: &[String]) -> Option<Vec<String>> {
        let groups = &self.groups;
        let updates = selected.iter().map(|uid| {
            // the record and revision the watch delivered: one round trip instead of a read and a write
            let known = self.state.group(&request.partition, uid).and_then(|g| g.known_record());
            async move {
                if jetrl_telemetry::crash::missed_input("buffer.mark_sampled") {
                    let (bucket, key) = (groups.kv().name.clone(), subjects::group_key(&request.partition, uid));
                    let cause = Cause::permanent("write refused (JETRL_MISS_AT)");
                    return (uid, Err(BusError::Kv { bucket, key, cause }.into()));
                }
                let result = groups
                    .update_from(&request.partition, uid, known, |s| {
                        s.sampled_step = request.step;
                        s.sample_request_id = request.request_id.clone();
                        Some(GroupState::Sampled)
                    })
                    .await;
                (uid, result)
            }
        });
        let mut confirmed = Vec::with_capacity(selected.len());
        for (uid, result) in futures::future::join_all(updates).await {
            match result {
                Ok(written) => confirmed.push((uid.clone(), written.map_or(0, |(_, revision)| revision))),
                Err(err) => tracing::error!(%uid, error = %err, "could not mark group sampled"),
            }
        }
        for (uid, revision) in &confirmed {
            self.state.mark_sampled(&request.partition, uid, request.step, &request.request_id, *revision);
        }
        let confirmed: Vec<String> = confirmed.into_iter().map(|(uid, _)| uid).collect();
        // fault injection (inert unless JETRL_CRASH_AT names it): groups marked sampled, the trainer not answered
        jetrl_telemetry::crash::crash_point("buffer.mid_sample", request.step);
        (confirmed.len() == selected.len()).then_some(confirmed)
    }

    pub(super) fn respond(
        &self,
        request: &SampleRequest,
        uids: &[String],
        metrics: std::collections::BTreeMap<String, f64>,
    ) -> SampleResponse {
        let groups = uids
            .iter()
            .filter_map(|uid| self.state.group(&request.partition, uid))
            .map(|g| self.state.sampled_group(g))
            .collect::<Vec<_>>();
        metrics::counter!("jetrl_buffer_sampled_groups_total", "partition" => request.partition.clone())
            .increment(groups.len() as u64);
        SampleResponse {
            request_id: request.request_id.clone(),
            groups,
            metrics: metrics.into_iter().collect(),
            ..Default::default()
        }
    }

    pub(super) fn remember(&mut self, response: SampleResponse) {
        self.answers.remember(response);
    }
}
