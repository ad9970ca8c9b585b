//! One file: the trainer's whole conversation with the data plane (tasks out, samples and payloads in, releases).
//!
//! The trainer's side of the data plane: prompt tasks out (GROUPS record first, then PROMPTS), sample requests to
//! the replay buffer (with verl's refills), trajectory payloads in (TRAJ, batched direct gets), releases back.
//! Every mode's schedule goes through it; it owns the dataloader cursor.

use std::collections::BTreeMap;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use jetrl_bus::publish::Outgoing;
use jetrl_bus::{Bus, Delays, GroupStore, Publisher};
use jetrl_config::JobConfig;
use jetrl_data::prompt::{PromptLimits, PromptTokenizer};
use jetrl_data::{ChatMessage, DataLoader, Drawn, Example, LoaderState, Prompt};
use jetrl_model::Tokenizer;
use jetrl_telemetry::Shutdown;
use jetrl_wire::keys::new_uid;
use jetrl_wire::v1::{
    self, Eviction, GroupState, GroupStatus, PromptTask, ReleaseRequest, ReleaseResponse, SampleRequest,
    SampleResponse, Trajectory,
};
use jetrl_wire::{packed, subjects, Message};

use crate::batch::{Sample, SampleLimits};
use crate::error::TrainerError;

/// The model's tokenizer as the dataset's prompt tokenizer (chat template from `tokenizer_config.json`).
pub(crate) struct ModelPrompts<'a>(pub &'a Tokenizer);

impl PromptTokenizer for ModelPrompts<'_> {
    fn chat_ids(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, String> {
        let messages: Vec<serde_json::Value> =
            messages.iter().map(|m| serde_json::json!({"role": m.role, "content": m.content})).collect();
        self.0.apply_chat_template(&messages, true).map_err(|e| format!("chat template: {e}"))
    }

    fn text_ids(&self, text: &str) -> Result<Vec<u32>, String> {
        self.0.encode(text, true).map_err(|e| e.to_string())
    }
}

/// How long a step waits for its batch (or a weight sync for its workers) before the trainer says so, and again
/// after each as long: a job whose workers are not running, or whose groups are never scored, otherwise waits
/// without a word at info level.
pub(crate) const SLOW_BATCH_WARN: Duration = Duration::from_secs(60);

/// A sampled batch's training rows, and the groups that could not be trained on (with why).
#[derive(Debug, Default)]
pub struct Fetched {
    /// ordered by (epoch, dataset row, session, index), so a seeded run trains the same batches whatever order
    /// the groups arrived in
    pub samples: Vec<Sample>,
    /// uid → reason: a payload missing from TRAJ or failing the boundary checks fails its whole group (a
    /// partial group would change its GRPO baseline)
    pub rejected: BTreeMap<String, String>,
}

pub struct RolloutClient {
    bus: Bus,
    groups: GroupStore,
    tokenizer: Tokenizer,
    limits: PromptLimits,
    sample_limits: SampleLimits,
    loader: DataLoader,
    shutdown: Shutdown,
    run_seed: u64,
    train_sampling: v1::SamplingParams,
    val_sampling: v1::SamplingParams,
    n: u32,
    val_n: u32,
    /// remax: every train group comes with the greedy rollout of its prompt, whose score is the group's baseline
    greedy_baseline: bool,
    sample_wait: Duration,
    /// sync mode: a train task of step `s` must be generated with the weights of step `s - 1` at least (see
    /// [`policy_floor`])
    sync: bool,
    /// releases sent in the background (nothing waits on one), awaited before the run ends
    releases: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    /// this trainer process (its start time, unix ms), carried by every sample request
    incarnation: u64,
    /// the newest GROUPS revision this trainer created a record at, carried by every sample request
    created_revision: std::sync::atomic::AtomicU64,
}

/// The weight version a task of `step` must be generated with at least (`PromptTask.min_policy_version`; a worker
/// on an older version hands the task back): validation scores the policy of its step, just published, in every
/// mode; a sync train task needs the weights of the step before its own (a refill, or a group re-issued after a
/// resume, included); the async modes take any version and bound staleness at the buffer.
fn policy_floor(sync: bool, step: u64, validation: bool) -> u64 {
    if validation {
        step
    } else if sync {
        step.saturating_sub(1)
    } else {
        0
    }
}

impl RolloutClient {
    #[allow(clippy::too_many_arguments)]
    pub async fn new(
        cfg: &JobConfig,
        bus: Bus,
        tokenizer: Tokenizer,
        limits: PromptLimits,
        sample_limits: SampleLimits,
        loader: DataLoader,
        shutdown: Shutdown,
    ) -> Result<Self, TrainerError> {
        let kw = &cfg.rollout.val_kwargs;
        Ok(Self {
            incarnation: jetrl_wire::now_unix_ms().max(0) as u64,
            created_revision: std::sync::atomic::AtomicU64::new(0),
            groups: GroupStore::open(&bus).await?,
            bus,
            tokenizer,
            limits,
            sample_limits,
            loader,
            shutdown,
            run_seed: cfg.run.seed,
            train_sampling: v1::SamplingParams {
                temperature: cfg.rollout.temperature,
                top_p: cfg.rollout.top_p,
                top_k: cfg.rollout.top_k,
                repetition_penalty: cfg.rollout.repetition_penalty,
                max_new_tokens: cfg.max_new_tokens(),
                ..Default::default()
            },
            val_sampling: v1::SamplingParams {
                temperature: kw.temperature,
                top_p: kw.top_p,
                top_k: kw.top_k,
                max_new_tokens: cfg.max_new_tokens(),
                ..Default::default()
            },
            n: cfg.rollout.n,
            val_n: kw.n.max(1),
            greedy_baseline: cfg.algorithm.adv_estimator == jetrl_config::AdvantageEstimator::Remax,
            sample_wait: Duration::from_secs_f64(cfg.trainer.sample_wait_s.max(0.1)),
            sync: !cfg.trainer.mode.is_async(),
            releases: Default::default(),
        })
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    pub fn loader_state(&self) -> LoaderState {
        self.loader.state()
    }

    /// This trainer process's incarnation (its start time, unix ms): it names the process in sample request ids
    /// and fences requests of older incarnations at the buffer.
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    pub fn loader_len(&self) -> usize {
        self.loader.len()
    }

    /// The task of one prompt: its ids rendered and limited here (chat template, `data.truncation`), so the
    /// prompt a worker generates from is exactly the one the dataset settings describe; chat messages travel
    /// along for agent loops that need them. The sampling seed derives from the run seed and the row, so a seeded
    /// run draws the same samples whichever worker generates them.
    fn task_for(
        &self,
        drawn: &Drawn,
        partition: &str,
        step: u64,
        validation: bool,
    ) -> Result<PromptTask, TrainerError> {
        let example = &drawn.example;
        let ids = jetrl_data::prompt::tokenize_prompt(example, &ModelPrompts(&self.tokenizer), self.limits)?;
        let mut sampling = if validation { self.val_sampling.clone() } else { self.train_sampling.clone() };
        sampling.seed = Some(row_seed(self.run_seed, partition, drawn.epoch, drawn.row));
        let mut task = PromptTask {
            uid: new_uid(),
            partition: partition.into(),
            n: if validation { self.val_n } else { self.n },
            submit_step: step,
            sampling: Some(sampling),
            data_source: example.data_source.clone(),
            ground_truth: example.ground_truth.clone(),
            extra_info_json: example.extra_info.to_string(),
            agent_name: example.agent_name.clone().unwrap_or_default(),
            row_index: example.index,
            prompt_ids: packed::pack_u32(&ids),
            min_policy_version: policy_floor(self.sync, step, validation),
            epoch: drawn.epoch,
            dataset_row: drawn.row,
            greedy_baseline: self.greedy_baseline && !validation,
            ..Default::default()
        };
        if let Prompt::Messages(messages) = &example.prompt {
            task.messages =
                messages.iter().map(|m| v1::ChatMessage { role: m.role.clone(), content: m.content.clone() }).collect();
        }
        Ok(task)
    }

    /// Draws `count` rows from the dataloader and submits them as train groups of step `step`.
    pub async fn submit_train(&mut self, step: u64, count: usize) -> Result<usize, TrainerError> {
        let rows = self.loader.next_rows(count);
        self.submit(subjects::TRAIN_PARTITION, step, &rows, false).await
    }

    /// Submits validation prompts (`examples` in order, rows numbered from 0) for step `step`.
    pub async fn submit_val(&self, step: u64, first_row: u64, examples: &[Example]) -> Result<usize, TrainerError> {
        let rows: Vec<Drawn> = examples
            .iter()
            .enumerate()
            .map(|(i, e)| Drawn { epoch: step, row: first_row + i as u64, example: e.clone() })
            .collect();
        self.submit(subjects::VAL_PARTITION, step, &rows, true).await
    }

    /// Writes a pending record then publishes the task, for every row. Returns the number submitted.
    async fn submit(
        &self,
        partition: &str,
        step: u64,
        rows: &[Drawn],
        validation: bool,
    ) -> Result<usize, TrainerError> {
        let mut tasks = Vec::with_capacity(rows.len());
        for row in rows {
            tasks.push(self.task_for(row, partition, step, validation)?);
        }
        let records: Vec<GroupStatus> = tasks
            .iter()
            .map(|t| {
                let mut s = GroupStatus {
                    uid: t.uid.clone(),
                    partition: t.partition.clone(),
                    submit_step: step,
                    n: t.n,
                    epoch: t.epoch,
                    dataset_row: t.dataset_row,
                    task: Some(t.clone()),
                    updated_unix_ms: jetrl_wire::now_unix_ms(),
                    ..Default::default()
                };
                s.set_state(GroupState::Pending);
                s
            })
            .collect();
        // The record first: a worker must never see a task without one. Both writes retry a lost broker for up
        // to `nats.connect_timeout_s` (and each publish ack for its own timeout): a stop does not wait for that.
        // A submit cut short leaves pending records without tasks, which the next trainer's resume retires.
        let write = async {
            let revision = self.groups.create_many(&records).await?;
            self.created_revision.fetch_max(revision, std::sync::atomic::Ordering::Relaxed);
            let mut publisher = Publisher::new(&self.bus, 512);
            for task in &tasks {
                publisher
                    .publish(Outgoing::protobuf(
                        self.bus.names().prompt_subject(partition),
                        Some(task.uid.clone()),
                        task,
                    ))
                    .await?;
            }
            publisher.drain().await?;
            Ok::<(), TrainerError>(())
        };
        tokio::select! {
            written = write => written?,
            () = self.shutdown.wait() => return Err(TrainerError::Shutdown),
        }
        metrics::counter!("jetrl_trainer_submitted_groups_total", "partition" => partition.to_string())
            .increment(tasks.len() as u64);
        Ok(tasks.len())
    }

    /// Asks the buffer for `batch_size` groups, re-asking with the same request id until it answers. When the
    /// buffer evicted groups (DAPO filter, failures, staleness) it asks for refills: this submits that many new
    /// prompts at `step` (verl's `refill_fn`) and reports them in `refilled`, so a lost reply can neither lose nor
    /// double a refill. Returns the answer and how many prompts were refilled. A buffer that does not answer is
    /// asked again with backoff (it is restarted by its supervisor and rebuilds its state); an answer with an
    /// error is final.
    pub async fn sample(
        &mut self,
        request_id: &str,
        step: u64,
        partition: &str,
        batch_size: u32,
    ) -> Result<(SampleResponse, u32), TrainerError> {
        let mut request = SampleRequest {
            request_id: request_id.to_string(),
            step,
            partition: partition.to_string(),
            batch_size,
            wait_ms: self.sample_wait.as_millis() as u32,
            incarnation: self.incarnation,
            ..Default::default()
        };
        let mut failures = 0u32;
        let mut backoff = Delays::new(Duration::from_millis(200), Duration::from_secs(5));
        let asked = Instant::now();
        let mut next_warn = asked + SLOW_BATCH_WARN;
        loop {
            if self.shutdown.is_triggered() {
                return Err(TrainerError::Shutdown);
            }
            let timeout = self.sample_wait + Duration::from_secs(5);
            // every record created so far (this request's refills too) must be in the buffer's view first
            request.groups_revision = self.created_revision.load(std::sync::atomic::Ordering::Relaxed);
            let reply = tokio::select! {
                _ = self.shutdown.wait() => return Err(TrainerError::Shutdown),
                r = self.bus.request::<_, SampleResponse>(self.bus.names().buffer_sample(), &request, timeout) => r,
            };
            match reply {
                // the buffer could not answer now (its store failed): ask again like an unanswered request
                Ok(resp) if !resp.error.is_empty() && resp.code() == v1::ErrorCode::Unavailable => {
                    failures += 1;
                    tracing::warn!(request_id, error = %resp.error, attempts = failures, "replay buffer unavailable; retrying");
                    metrics::counter!("jetrl_trainer_buffer_retries_total").increment(1);
                    tokio::select! {
                        _ = self.shutdown.wait() => return Err(TrainerError::Shutdown),
                        _ = backoff.sleep() => {}
                    }
                }
                Ok(resp) if !resp.error.is_empty() => {
                    let (code, message) = (resp.code(), resp.error);
                    return Err(TrainerError::Buffer { request_id: request_id.to_string(), code, message });
                }
                Ok(resp) if resp.refill > 0 => {
                    let rows = self.loader.next_rows(resp.refill as usize);
                    let submitted = self.submit(partition, step, &rows, false).await?;
                    request.refilled += submitted as u32;
                    metrics::counter!("jetrl_trainer_refilled_prompts_total").increment(submitted as u64);
                    tracing::info!(step, refill = resp.refill, "buffer evicted groups; submitted refills");
                }
                Ok(resp) if resp.not_ready => {
                    tracing::debug!(request_id, step, "buffer: batch not ready yet");
                    if Instant::now() >= next_warn {
                        next_warn += SLOW_BATCH_WARN;
                        tracing::warn!(
                            step,
                            batch_size,
                            waited_s = asked.elapsed().as_secs(),
                            "no batch yet: the replay buffer has fewer finished groups than a batch (are rollout \
                             workers and the reward service running and scoring? `jetrl status` shows them)"
                        );
                    }
                    failures = 0;
                    backoff.reset();
                }
                Ok(resp) => return Ok((resp, request.refilled)),
                // refused by the server, or an answer that does not decode: asking again gets the same
                Err(err) if !err.recovery().retryable() => return Err(err.counted().into()),
                Err(err) => {
                    failures += 1;
                    if failures % 10 == 1 {
                        tracing::warn!(error = %err, request_id, attempts = failures, "replay buffer not answering; retrying");
                    }
                    metrics::counter!("jetrl_trainer_buffer_retries_total").increment(1);
                    tokio::select! {
                        _ = self.shutdown.wait() => return Err(TrainerError::Shutdown),
                        _ = backoff.sleep() => {}
                    }
                }
            }
        }
    }

    /// Fetches every sampled trajectory's payload from the TRAJ stream (one batched direct get per group) and
    /// checks it at the boundary ([`Sample::from_wire`]). A group with a payload missing or invalid is rejected
    /// whole, and so is a remax train group without its greedy baseline.
    pub async fn fetch(&self, response: &SampleResponse) -> Result<Fetched, TrainerError> {
        let started = Instant::now();
        let rewards: Vec<&v1::Reward> = response.groups.iter().flat_map(|g| g.trajectories.iter()).collect();
        let mut out = fetch_payloads(&self.bus, &rewards, self.sample_limits).await?;
        if self.greedy_baseline {
            let train: std::collections::BTreeSet<&str> =
                rewards.iter().filter(|r| r.partition == subjects::TRAIN_PARTITION).map(|r| r.uid.as_str()).collect();
            let missing = out.samples.iter().filter(|s| s.reward_baseline.is_none() && train.contains(s.uid.as_str()));
            for sample in missing {
                let reason = "remax: the group has no scored greedy rollout, the baseline of its samples".to_string();
                out.rejected.entry(sample.uid.clone()).or_insert(reason);
            }
            out.samples.retain(|s| !out.rejected.contains_key(&s.uid));
        }
        metrics::histogram!("jetrl_trainer_fetch_seconds").record(started.elapsed().as_secs_f64());
        Ok(out)
    }

    /// Tells the buffer the step's payloads may go, in the background: the groups are already consumed (their
    /// records say sampled), so nothing the trainer does next depends on it. A failed release only leaves
    /// payloads behind until the streams' max age.
    pub fn release(&self, step: u64, request_ids: Vec<String>) {
        let bus = self.bus.clone();
        let task = tokio::spawn(async move {
            let request = ReleaseRequest { step, request_ids };
            match bus.request::<_, ReleaseResponse>(bus.names().buffer_release(), &request, bus.request_timeout()).await
            {
                Ok(resp) if resp.error.is_empty() => {}
                Ok(resp) => tracing::warn!(error = %resp.error, "release failed"),
                Err(err) => tracing::warn!(error = %err, "release not acknowledged"),
            }
        });
        let mut releases = self.releases.lock().unwrap_or_else(PoisonError::into_inner);
        releases.retain(|t| !t.is_finished());
        releases.push(task);
    }

    /// Stops the releases still in flight (the broker is gone: each would wait out its retries).
    pub fn abandon_releases(&self) {
        for task in std::mem::take(&mut *self.releases.lock().unwrap_or_else(PoisonError::into_inner)) {
            task.abort();
        }
    }

    /// Waits for the releases still in flight.
    pub async fn finish_releases(&self) {
        let pending: Vec<_> = std::mem::take(&mut *self.releases.lock().unwrap_or_else(PoisonError::into_inner));
        for task in pending {
            let _ = task.await;
        }
    }

    /// At the start of every run, after a resume from the checkpoint of step `k` (the dataloader restored to that
    /// checkpoint's cursor) or from step `k` = 0 (a fresh start, which finds records only when an earlier trainer
    /// of this job died before its first checkpoint): makes the group records agree with this timeline, so that
    /// every row ends trained, evicted or failed once. For each dataset row:
    ///
    /// - decided at or before step `k` (trained at a step ≤ k, or evicted then): kept; any later group of it is
    ///   superseded;
    /// - otherwise every group of it is retired: an in-flight one (pending, running, or generated but not
    ///   trained) is evicted as `superseded_by_resume` — it was generated for weights that no longer exist, so
    ///   sync mode is on-policy again from the first step —, a training after step k is rolled back
    ///   (`rolled_back: …`: the weights it produced are gone), an eviction after step k likewise; and the row is
    ///   submitted again at step k + 1 when the checkpointed run had drawn it (rows drawn after the checkpoint
    ///   are drawn again by the dataloader).
    ///
    /// Returns how many rows were submitted again.
    pub async fn resume(&mut self, k: u64) -> Result<usize, TrainerError> {
        use std::collections::{BTreeMap, HashMap};
        let drawn = self.loader.drawn(self.loader.state());
        // the whole history: live records and those archived out of GROUPS
        let records = self.groups.records(subjects::TRAIN_PARTITION).await?;
        let mut by_row: BTreeMap<(u64, u64), Vec<GroupStatus>> = BTreeMap::new();
        for g in records {
            by_row.entry((g.epoch, g.dataset_row)).or_default().push(g);
        }
        let bookkeeping = jetrl_bus::ledger::is_bookkeeping;
        let since = if k == 0 {
            "the trainer started again from step 0 (no checkpoint)".to_string()
        } else {
            format!("the checkpoint of step {k}")
        };
        let mut positions: HashMap<u64, Vec<u64>> = HashMap::new();
        let mut again: Vec<Drawn> = Vec::new();
        let (mut superseded, mut rolled_back) = (0usize, 0usize);
        for ((epoch, row), groups) in by_row {
            let decided = groups.iter().any(|g| {
                (g.state() == GroupState::Sampled && g.sampled_step <= k)
                    || (g.state() == GroupState::Evicted && g.evicted_step <= k && !bookkeeping(g))
            });
            for g in &groups {
                let keep = (g.state() == GroupState::Sampled && g.sampled_step <= k)
                    || (g.state() == GroupState::Evicted && (g.evicted_step <= k || bookkeeping(g)));
                if keep {
                    continue;
                }
                let (eviction, detail) = match g.state() {
                    GroupState::Sampled => {
                        rolled_back += 1;
                        (Eviction::RolledBack, format!("trained at step {} after {since}", g.sampled_step))
                    }
                    GroupState::Evicted => {
                        rolled_back += 1;
                        let was = g.eviction().describe(&g.evicted_reason);
                        (Eviction::RolledBack, format!("evicted at step {} ({was}) after {since}", g.evicted_step))
                    }
                    _ => {
                        superseded += 1;
                        (Eviction::SupersededByResume, String::new())
                    }
                };
                self.groups.retract_known(g, eviction, &detail, k).await.map_err(TrainerError::GroupRecord)?;
            }
            if decided {
                continue;
            }
            let drawn_before = self.loader.position_of(epoch, row, &mut positions).is_some_and(|p| p < drawn);
            if let (true, Some(example)) = (drawn_before, self.loader.examples().get(row as usize)) {
                again.push(Drawn { epoch, row, example: example.clone() });
            }
        }
        // validation groups of the old incarnation are never trained: retire them
        for g in self.groups.list(subjects::VAL_PARTITION).await? {
            if g.state().is_inflight() || g.state().is_terminal() {
                let superseded = Eviction::SupersededByResume;
                self.groups.retract_known(&g, superseded, "", k).await.map_err(TrainerError::GroupRecord)?;
            }
        }
        let submitted = self.submit(subjects::TRAIN_PARTITION, k + 1, &again, false).await?;
        if superseded + rolled_back + submitted > 0 {
            tracing::info!(
                start_step = k,
                superseded,
                rolled_back,
                submitted_again = submitted,
                "an earlier trainer's group records brought to this run's timeline"
            );
        }
        Ok(submitted)
    }

    /// Groups of the train partition in flight (pending, running, or terminal and not yet sampled).
    pub async fn inflight_groups(&self) -> Result<usize, TrainerError> {
        let records = self.groups.list(subjects::TRAIN_PARTITION).await?;
        Ok(records.iter().filter(|g| g.state().is_inflight() || g.state().is_terminal()).count())
    }

    /// Records that the sampled group `uid` could not be trained on (fate `failed`, with the reason).
    pub async fn reject(&self, uid: &str, reason: &str, step: u64) -> Result<(), TrainerError> {
        tokio::select! {
            retracted = self.groups.retract(subjects::TRAIN_PARTITION, uid, Eviction::Rejected, reason, step) => {
                retracted.map_err(TrainerError::GroupRecord)
            }
            () = self.shutdown.wait() => Err(TrainerError::Shutdown),
        }
    }

    /// Every train group record (live and archived), for the ledger.
    pub async fn train_records(&self) -> Result<Vec<GroupStatus>, TrainerError> {
        Ok(self.groups.records(subjects::TRAIN_PARTITION).await?)
    }
}

/// The payloads of `rewards`' trajectories from the TRAJ stream, checked at the boundary ([`Sample::from_wire`]),
/// ordered by (epoch, dataset row, session, key); a group with a payload missing or invalid is rejected whole. A
/// remax group's greedy rollout is not a training row: its score becomes the `reward_baseline` of the group's rows.
pub async fn fetch_payloads(bus: &Bus, rewards: &[&v1::Reward], limits: SampleLimits) -> Result<Fetched, TrainerError> {
    let wanted: Vec<(String, u64)> =
        rewards.iter().map(|r| (bus.names().traj_subject(&r.partition, &r.uid), r.traj_seq)).collect();
    let mut payloads = bus.fetch_by_sequence(bus.names().traj_stream(), &wanted).await?;
    let mut out = Fetched::default();
    let mut baselines: BTreeMap<String, f64> = BTreeMap::new();
    for &reward in rewards {
        if out.rejected.contains_key(&reward.uid) {
            continue;
        }
        let checked = match payloads.remove(&reward.traj_seq) {
            Some(payload) => Trajectory::decode(payload.as_ref())
                .map_err(|e| format!("trajectory {} does not decode: {e}", reward.key))
                .and_then(|traj| {
                    if traj.key != reward.key {
                        return Err(format!(
                            "TRAJ sequence {} holds {}, not {}",
                            reward.traj_seq, traj.key, reward.key
                        ));
                    }
                    let sample = Sample::from_wire(&traj, reward, limits)
                        .map_err(|e| format!("trajectory {}: {e}", reward.key))?;
                    Ok((sample, traj.greedy_baseline))
                }),
            None => {
                Err(format!("trajectory {} (TRAJ sequence {}) is missing from the stream", reward.key, reward.traj_seq))
            }
        };
        match checked {
            Ok((sample, true)) => {
                baselines.insert(sample.uid, sample.score);
            }
            Ok((sample, false)) => out.samples.push(sample),
            Err(reason) => {
                tracing::error!(uid = %reward.uid, %reason, "group rejected: not trained on");
                metrics::counter!("jetrl_trainer_rejected_groups_total").increment(1);
                out.rejected.insert(reward.uid.clone(), reason);
            }
        }
    }
    out.samples.retain(|s| !out.rejected.contains_key(&s.uid));
    for sample in &mut out.samples {
        sample.reward_baseline = baselines.get(&sample.uid).copied();
    }
    out.samples.sort_by(|a, b| {
        (a.epoch, a.dataset_row, a.session_id, &a.key).cmp(&(b.epoch, b.dataset_row, b.session_id, &b.key))
    });
    Ok(out)
}

/// The sampling seed of a dataset row: a pure function of the run seed, the partition and (epoch, row).
fn row_seed(run_seed: u64, partition: &str, epoch: u64, row: u64) -> u64 {
    let salt =
        partition.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    let mut z = run_seed ^ salt ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ row.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::policy_floor;

    #[test]
    fn the_policy_floor_is_the_previous_step_in_sync_the_step_itself_for_validation_and_none_in_async() {
        // sync: step 5's tasks need the weights published after step 4; step 1's the initial weights (0)
        assert_eq!(policy_floor(true, 5, false), 4);
        assert_eq!(policy_floor(true, 1, false), 0);
        // validation at step 5 scores the weights of step 5, in every mode
        assert_eq!(policy_floor(true, 5, true), 5);
        assert_eq!(policy_floor(false, 5, true), 5);
        // async: any version; the buffer bounds staleness
        assert_eq!(policy_floor(false, 5, false), 0);
    }
}
