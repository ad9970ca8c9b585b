//! One prompt group, end to end: the task delivered from PROMPTS becomes `n` sessions of its agent loop (and a
//! remax task one more, its greedy baseline, as session `n`), each
//! session's trajectory is published as it finishes (de-duplicated by key `{uid}_{session}_{index}`), then the
//! group's score request for the reward service, and only then the group's terminal status and the task's ack.
//! A worker that dies before that leaves the task unacknowledged: the broker redelivers it after
//! `rollout.ack_wait_s` (long groups send in-progress acks so they are not redelivered while being worked on).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, AckKind};
use futures::stream::FuturesUnordered;
use futures::StreamExt;
use jetrl_bus::groups::GroupUpdateError;
use jetrl_bus::publish::Outgoing;
use jetrl_bus::{consume, Publisher, ScoreRequestBuilder};
use jetrl_model::{Request, Sampling, SequenceOutput};
use jetrl_wire::keys::{validate_uid, TrajectoryKey};
use jetrl_wire::packed;
use jetrl_wire::v1::{self, GroupState, PromptTask, Trajectory};
use tokio::sync::OwnedSemaphorePermit;

use crate::agent::{self, AgentKind, AgentPrompt, SessionOutput};
use crate::engine::{EngineError, Generation};
use crate::{Worker, SERVICE};

/// The engine sampling settings of a task (proto zeros mean "unset").
fn sampling_of(task: &PromptTask, default_max_tokens: u32) -> Sampling {
    let s = task.sampling.clone().unwrap_or_default();
    let mut stop_token_ids = s.stop_token_ids;
    stop_token_ids.sort_unstable();
    stop_token_ids.dedup();
    Sampling {
        temperature: s.temperature.max(0.0),
        top_p: if s.top_p <= 0.0 || s.top_p > 1.0 { 1.0 } else { s.top_p },
        top_k: i64::from(s.top_k),
        repetition_penalty: if s.repetition_penalty <= 0.0 { 1.0 } else { s.repetition_penalty },
        max_tokens: if s.max_new_tokens == 0 { default_max_tokens } else { s.max_new_tokens } as usize,
        stop_token_ids,
        stop: s.stop.into_iter().filter(|t| !t.is_empty()).collect(),
        seed: s.seed,
        ignore_eos: false,
    }
}

/// The sampling of a remax group's greedy baseline: the task's, at temperature 0 without nucleus or top-k
/// truncation (verl's `do_sample=False`).
fn greedy(sampling: &Sampling) -> Sampling {
    Sampling { temperature: 0.0, top_p: 1.0, top_k: -1, seed: None, ..sampling.clone() }
}

/// The finished sequences of a generation, as a stream.
fn outputs(generation: Generation) -> impl futures::Stream<Item = Result<SequenceOutput, EngineError>> {
    futures::stream::unfold(generation, |mut g| async move { g.next().await.map(|item| (item, g)) })
}

/// `extra_info.tool_selection` of a row (verl), when present.
fn tool_selection(task: &PromptTask) -> Option<Vec<String>> {
    let extra: serde_json::Value = serde_json::from_str(&task.extra_info_json).ok()?;
    let names = extra.get("tool_selection")?.as_array()?;
    Some(names.iter().filter_map(|n| n.as_str().map(str::to_string)).collect())
}

impl Worker {
    /// Waits (bounded by `rollout.heartbeat_timeout_s`) until the engine holds at least `version`; a worker that
    /// cannot get there hands the task back for another worker (a transient failure, redelivered).
    async fn await_version(&self, version: u64) -> Result<(), TaskError> {
        if self.engine.version() >= version {
            return Ok(());
        }
        let deadline = tokio::time::Instant::now() + self.version_wait;
        loop {
            let changed = self.status.changed();
            if self.engine.version() >= version {
                metrics::counter!("jetrl_rollout_version_waits_total", "outcome" => "loaded").increment(1);
                return Ok(());
            }
            if self.status.load_failed() || tokio::time::Instant::now() >= deadline {
                metrics::counter!("jetrl_rollout_version_waits_total", "outcome" => "handed_back").increment(1);
                let held = self.engine.version();
                return Err(TaskError::Retry(Transient::OlderWeights { needed: version, held }));
            }
            tokio::select! {
                _ = changed => {}
                _ = tokio::time::sleep_until(deadline) => {}
            }
        }
    }

    /// Handles one delivered prompt task end to end; never panics, always settles the message.
    pub(crate) async fn handle(self: Arc<Self>, msg: jetstream::Message, mut slots: OwnedSemaphorePermit) {
        let Some(task) = consume::decode_or_term::<PromptTask>(&msg, SERVICE).await else { return };
        if let Err(err) = validate_uid(&task.uid) {
            let reason = format!("prompt task with an invalid uid: {err}");
            consume::dead_letter(SERVICE, self.bus.names().prompts_stream(), &msg.subject, &reason, &msg.payload);
            tracing::error!(subject = %msg.subject, error = %err, "task with an invalid uid terminated");
            consume::settle(&msg, AckKind::Term).await;
            return;
        }
        // Hold as many engine slots as the group has sessions, its greedy baseline included (at most all of them).
        let need = (task.n.max(1) as usize + usize::from(task.greedy_baseline)).min(self.engine.slots());
        if slots.num_permits() > need {
            drop(slots.split(slots.num_permits() - need));
        }
        self.inflight.fetch_add(1, Ordering::SeqCst);
        let (this, msg_ref, task_ref) = (&self, &msg, &task);
        // the slots are held by the work and go back when it ends (or is dropped at a hard stop)
        let work = async move {
            let _slots = if slots.num_permits() < need {
                // The reservation goes back before all `need` are asked for at once: a task that held some while
                // it waited for more could wait forever on the others doing the same.
                drop(slots);
                match this.slots.clone().acquire_many_owned(need as u32).await {
                    Ok(all) => all,
                    Err(_) => return Err(TaskError::Retry(Transient::SlotsClosed)),
                }
            } else {
                slots
            };
            this.run_group(msg_ref, task_ref).await
        };
        let outcome = tokio::select! {
            outcome = with_progress(work, &msg, self.ack_wait) => Some(outcome),
            _ = self.hard_stop.wait() => None,
        };
        self.inflight.fetch_sub(1, Ordering::SeqCst);
        match outcome {
            Some(Ok(())) => {
                if let Err(err) = consume::ack_confirmed(&msg).await {
                    tracing::warn!(uid = %task.uid, error = %err, "task ack not confirmed (a redelivery will be de-duplicated)");
                }
            }
            Some(Err(TaskError::Skip(reason))) => {
                tracing::info!(uid = %task.uid, %reason, "task skipped");
                consume::settle(&msg, AckKind::Ack).await;
            }
            Some(Err(TaskError::Fail(reason))) => {
                tracing::warn!(uid = %task.uid, %reason, "task failed permanently");
                consume::settle(&msg, AckKind::Ack).await;
            }
            Some(Err(TaskError::Retry(reason))) => {
                tracing::warn!(uid = %task.uid, %reason, "task failed transiently; naking for redelivery");
                consume::settle(&msg, AckKind::Nak(Some(Duration::from_secs(1)))).await;
            }
            None => {
                tracing::info!(uid = %task.uid, "shutting down: task naked for another worker");
                consume::settle(&msg, AckKind::Nak(None)).await;
            }
        }
    }

    async fn run_group(&self, msg: &jetstream::Message, task: &PromptTask) -> Result<(), TaskError> {
        let received = Instant::now();
        // sync mode: the group must be sampled with the weights of the step before (or later ones)
        self.await_version(task.min_policy_version).await?;
        // pending -> running (a redelivered task restarts a running group)
        let instance = self.instance.clone();
        let started = self
            .groups
            .update(&task.partition, &task.uid, |s| match s.state() {
                GroupState::Pending | GroupState::Running => {
                    s.worker_id = instance.clone();
                    Some(GroupState::Running)
                }
                _ => None,
            })
            .await;
        match started {
            Ok(Some(_)) => {}
            Ok(None) => return Err(TaskError::Skip(Skip::AlreadyTerminal)),
            Err(GroupUpdateError::Missing { key }) => return Err(TaskError::Skip(Skip::NoRecord { key })),
            Err(err) => return Err(TaskError::Retry(Transient::GroupRecord(err))),
        }
        let delivered = msg.info().map(|i| i.delivered).unwrap_or(1);
        if delivered > 1 {
            metrics::counter!("jetrl_rollout_redelivered_tasks_total").increment(1);
        }

        let (keys, failure) = match self.generate_and_publish(task, received).await {
            Err(TaskError::Fail(err)) => (Vec::new(), Some(err.to_string())),
            other => other?,
        };
        // Terminal status last: every trajectory above is already durable.
        let terminal = if failure.is_some() { GroupState::Failure } else { GroupState::Finished };
        let reason = failure.clone().unwrap_or_default();
        let result = self
            .groups
            .update(&task.partition, &task.uid, |s| {
                s.trajectory_keys = keys.clone();
                s.failure_reason = reason.clone();
                Some(terminal)
            })
            .await;
        match result {
            Ok(_) => {
                metrics::counter!("jetrl_rollout_groups_total", "state" => terminal.label()).increment(1);
                if let Some(reason) = failure {
                    tracing::warn!(uid = %task.uid, published = keys.len(), %reason, "group failed");
                }
                Ok(())
            }
            // evicted meanwhile (and perhaps already archived out of GROUPS): nothing will read these trajectories
            Err(GroupUpdateError::IllegalTransition { .. } | GroupUpdateError::Missing { .. }) => {
                Err(TaskError::Skip(Skip::SettledElsewhere))
            }
            Err(err) => Err(TaskError::Retry(Transient::GroupRecord(err))),
        }
    }

    /// The prompt's token ids: given directly, or the chat messages rendered with the chat template.
    fn prompt_ids(&self, task: &PromptTask) -> Result<Vec<u32>, String> {
        let ids = if !task.prompt_ids.is_empty() {
            packed::unpack_u32(&task.prompt_ids).map_err(|e| e.to_string())?
        } else if !task.messages.is_empty() {
            self.tokenizer.apply_chat_template(&messages_of(task), true).map_err(|e| format!("chat template: {e}"))?
        } else {
            return Err("task has neither prompt_ids nor messages".into());
        };
        self.check_prompt(ids)
    }

    fn check_prompt(&self, ids: Vec<u32>) -> Result<Vec<u32>, String> {
        if ids.is_empty() {
            return Err("prompt is empty".into());
        }
        if ids.len() > self.max_prompt_len {
            return Err(format!(
                "prompt has {} tokens, more than data.max_prompt_length = {}",
                ids.len(),
                self.max_prompt_len
            ));
        }
        Ok(ids)
    }

    /// Runs the group's sessions with its agent loop and publishes each trajectory as its session ends. Returns
    /// the keys published and, for a group that could not be (fully) generated, the failure reason.
    async fn generate_and_publish(
        &self,
        task: &PromptTask,
        received: Instant,
    ) -> Result<(Vec<String>, Option<String>), TaskError> {
        let agent =
            if task.agent_name.is_empty() { Ok(self.default_agent) } else { task.agent_name.parse::<AgentKind>() };
        let agent = match agent {
            Ok(agent) => agent,
            Err(reason) => return Ok((Vec::new(), Some(reason.to_string()))),
        };
        let sampling = sampling_of(task, self.default_max_tokens);
        let n = task.n.max(1) as usize;
        let mut out = GroupPublisher::new(self, task, agent, received);
        match agent {
            AgentKind::SingleTurn => {
                let prompt = match self.prompt_ids(task) {
                    Ok(prompt) => prompt,
                    Err(reason) => return Ok((Vec::new(), Some(reason))),
                };
                // One request for the whole group: the prompt is prefilled once and forked n times. A remax
                // group's greedy baseline is one more request, numbered n, generated alongside.
                let mut requests = vec![Request::new(prompt.clone(), n, sampling.clone())];
                if task.greedy_baseline {
                    requests.push(Request { first_sample: n, ..Request::new(prompt.clone(), 1, greedy(&sampling)) });
                }
                let mut generations = futures::stream::SelectAll::new();
                for request in requests {
                    match self.engine.submit(request).await {
                        Ok(g) => generations.push(Box::pin(outputs(g))),
                        Err(EngineError::Stopped) => return Err(TaskError::Retry(Transient::EngineStopped)),
                        Err(err) => return Ok((Vec::new(), Some(err.to_string()))),
                    }
                }
                while let Some(result) = generations.next().await {
                    match result {
                        Ok(sample) => out.publish(&prompt, SessionOutput::single_turn(sample)).await?,
                        Err(EngineError::Stopped) => return Err(TaskError::Retry(Transient::EngineStopped)),
                        Err(err) => out.fail(err.to_string()),
                    }
                }
            }
            AgentKind::Tool => {
                let tool_agent = match &self.tool_agent {
                    Ok(a) => a,
                    Err(reason) => return Ok((Vec::new(), Some(format!("tool_agent unavailable: {reason}")))),
                };
                let tools = tool_agent.tools.select(tool_selection(task).as_deref());
                let prompt = if !task.messages.is_empty() {
                    AgentPrompt::Messages(messages_of(task))
                } else {
                    match packed::unpack_u32(&task.prompt_ids) {
                        Ok(ids) => AgentPrompt::Ids(ids),
                        Err(err) => return Ok((Vec::new(), Some(err.to_string()))),
                    }
                };
                let prompt = match tool_agent.prompt_ids(&prompt, &tools).map_err(|e| e.to_string()) {
                    Ok(ids) => match self.check_prompt(ids) {
                        Ok(ids) => ids,
                        Err(reason) => return Ok((Vec::new(), Some(reason))),
                    },
                    Err(reason) => return Ok((Vec::new(), Some(reason))),
                };
                let budget = sampling.max_tokens;
                let greedy = greedy(&sampling);
                // a remax group's greedy baseline is session n
                let baseline = task.greedy_baseline.then_some((n, &greedy));
                let mut sessions: FuturesUnordered<_> = (0..n)
                    .map(|session| (session, &sampling))
                    .chain(baseline)
                    .map(|(session, sampling)| {
                        tool_agent.run_session(&self.engine, &prompt, &tools, sampling, budget, session)
                    })
                    .collect();
                while let Some(result) = sessions.next().await {
                    match result {
                        Ok(session) => out.publish(&prompt, session).await?,
                        Err(agent::AgentError::Engine(EngineError::Stopped)) => {
                            return Err(TaskError::Retry(Transient::EngineStopped))
                        }
                        Err(err) => out.fail(err.to_string()),
                    }
                }
            }
        }
        out.finish().await
    }
}

fn messages_of(task: &PromptTask) -> Vec<serde_json::Value> {
    task.messages.iter().map(|m| serde_json::json!({"role": m.role, "content": m.content})).collect()
}

/// Publishes one group's trajectories as its sessions finish (pipelined, de-duplicated by key) and collects
/// the keys for the terminal status.
struct GroupPublisher<'a> {
    worker: &'a Worker,
    task: &'a PromptTask,
    agent: AgentKind,
    received: Instant,
    publisher: Publisher,
    /// the group's score request, published once every trajectory is stored
    scoring: ScoreRequestBuilder,
    keys: Vec<String>,
    failure: Option<String>,
}

impl<'a> GroupPublisher<'a> {
    fn new(worker: &'a Worker, task: &'a PromptTask, agent: AgentKind, received: Instant) -> Self {
        GroupPublisher {
            worker,
            task,
            agent,
            received,
            publisher: Publisher::new(&worker.bus, 256),
            scoring: ScoreRequestBuilder::new(&task.partition, &task.uid),
            keys: Vec::new(),
            failure: None,
        }
    }

    /// A session that could not be generated: the group ends `failure`, with the sessions that succeeded.
    fn fail(&mut self, reason: String) {
        metrics::counter!("jetrl_rollout_failed_sessions_total").increment(1);
        self.failure.get_or_insert(reason);
    }

    async fn publish(&mut self, prompt: &[u32], out: SessionOutput) -> Result<(), TaskError> {
        let task = self.task;
        let key = TrajectoryKey::new(task.uid.clone(), out.session as u32, 0).to_string();
        let current = self.worker.engine.version();
        let lag = current.saturating_sub(out.min_version);
        let lag = if lag >= 3 { "3+".to_string() } else { lag.to_string() };
        metrics::counter!("jetrl_rollout_trajectories_total", "version_lag" => lag, "agent" => self.agent.as_str())
            .increment(1);
        if out.min_version != out.max_version {
            metrics::counter!("jetrl_rollout_mixed_version_trajectories_total").increment(1);
        }
        metrics::histogram!("jetrl_rollout_response_tokens").record(out.response_ids.len() as f64);
        let finish = if out.aborted {
            v1::FinishReason::Aborted
        } else if out.truncated {
            v1::FinishReason::Length
        } else {
            v1::FinishReason::Stop
        };
        let traj = Trajectory {
            key: key.clone(),
            uid: task.uid.clone(),
            session_id: out.session as u32,
            index: 0,
            partition: task.partition.clone(),
            submit_step: task.submit_step,
            epoch: task.epoch,
            dataset_row: task.dataset_row,
            prompt_ids: packed::pack_u32(prompt),
            response_ids: packed::pack_u32(&out.response_ids),
            response_mask: packed::pack_u8(&out.response_mask),
            logprobs: packed::pack_f32(&out.logprobs),
            min_version: out.min_version,
            max_version: out.max_version,
            version_runs: out
                .version_runs
                .iter()
                .map(|&(first_token, version)| v1::VersionRun { first_token, version })
                .collect(),
            finish_reason: finish as i32,
            timings: Some(v1::Timings {
                time_to_first_token_s: out.time_to_first_token.map_or(0.0, |d| d.as_secs_f64()),
                generate_s: self.received.elapsed().as_secs_f64(),
                completed_unix_ms: jetrl_wire::now_unix_ms(),
            }),
            response_text: self.worker.tokenizer.decode(&out.response_ids, true).unwrap_or_default(),
            data_source: task.data_source.clone(),
            ground_truth: task.ground_truth.clone(),
            extra_info_json: task.extra_info_json.clone(),
            worker_id: self.worker.instance.clone(),
            num_turns: out.num_turns,
            tool_rewards: out.tool_rewards,
            agent_name: self.agent.as_str().into(),
            stop_reason: out.stop_reason.as_str().into(),
            raw_prompt: task.messages.clone(),
            // the baseline of a remax group is the session after its n samples
            greedy_baseline: task.greedy_baseline && out.session == task.n.max(1) as usize,
            routed_experts_layers: if out.routed_experts.is_empty() { 0 } else { self.worker.routes_layout.0 },
            routed_experts_top_k: if out.routed_experts.is_empty() { 0 } else { self.worker.routes_layout.1 },
            routed_experts: out.routed_experts.iter().map(|&e| u32::from(e)).collect(),
            ..Default::default()
        };
        let subject = self.worker.bus.names().traj_subject(&task.partition, &task.uid);
        self.publisher.publish(Outgoing::protobuf(subject, Some(key.clone()), &traj)).await.map_err(task_error)?;
        self.scoring.add(&traj);
        self.keys.push(key);
        // fault injection (inert unless JETRL_CRASH_AT names it): part of the group published, not its status
        jetrl_telemetry::crash::crash_point("rollout.mid_group", task.submit_step);
        Ok(())
    }

    /// Waits until every trajectory is stored, then publishes the group's score request (the reward service's
    /// input) and waits until it is stored too; returns the keys (in session order) and the failure, if any.
    async fn finish(mut self) -> Result<(Vec<String>, Option<String>), TaskError> {
        let acks = self.publisher.drain().await.map_err(task_error)?;
        self.scoring.publish(&self.worker.bus, &acks).await.map_err(task_error)?;
        self.keys.sort();
        Ok((self.keys, self.failure))
    }
}

/// Why a task was not completed.
#[derive(Debug)]
enum TaskError {
    /// nothing to do: acknowledge
    Skip(Skip),
    /// transient (broker or engine trouble): nak for redelivery
    Retry(Transient),
    /// permanent (a trajectory or score request above the server's max_payload): generating the group again
    /// would fail again, so it ends `failure` with the reason, without trajectories
    Fail(jetrl_bus::BusError),
}

/// Why a task needs no work.
#[derive(Debug, thiserror::Error)]
enum Skip {
    #[error("group is already terminal (duplicate delivery)")]
    AlreadyTerminal,
    #[error("no group record {key}")]
    NoRecord { key: String },
    /// evicted while it ran (and perhaps already archived out of GROUPS)
    #[error("group was settled elsewhere")]
    SettledElsewhere,
}

/// Why a task is handed back for another try.
#[derive(Debug, thiserror::Error)]
enum Transient {
    #[error("the task needs weights v{needed}, this worker holds v{held}")]
    OlderWeights { needed: u64, held: u64 },
    #[error("the worker's slot semaphore is closed")]
    SlotsClosed,
    #[error("engine stopped")]
    EngineStopped,
    #[error("group record: {0}")]
    GroupRecord(#[source] GroupUpdateError),
    #[error(transparent)]
    Bus(jetrl_bus::BusError),
}

/// A broker error while publishing a group: a message the server can never take fails the group for good;
/// anything else is worth a redelivery.
fn task_error(err: jetrl_bus::BusError) -> TaskError {
    match err {
        jetrl_bus::BusError::PayloadTooLarge { .. } => {
            metrics::counter!("jetrl_rollout_permanent_failures_total", "reason" => "payload_too_large").increment(1);
            TaskError::Fail(err)
        }
        other => TaskError::Retry(Transient::Bus(other)),
    }
}

/// Runs `work` while sending in-progress acks every ack_wait/3, so a long group is not redelivered.
async fn with_progress<T>(
    work: impl std::future::Future<Output = T>,
    msg: &jetstream::Message,
    ack_wait: Duration,
) -> T {
    tokio::pin!(work);
    let mut ticker = tokio::time::interval(ack_wait / 3);
    ticker.tick().await;
    loop {
        tokio::select! {
            out = &mut work => return out,
            _ = ticker.tick() => consume::settle(msg, AckKind::Progress).await,
        }
    }
}
