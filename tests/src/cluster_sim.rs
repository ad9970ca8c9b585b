//! One file: the simulated fleet, learner and report share one clock and one set of knobs.
//!
//! `just bench cluster_sim`: the orchestration at cluster scale, measured by a paced simulation on one machine.
//!
//! The real trainer (its schedules, with the paced stand-in learner of `trainer.simulate`: no model, an update
//! sleeps the time a device would take), the real replay buffer, reward service and checkpoint-sync binaries, over
//! a real nats-server. The rollout fleet is made of **stand-in rollout workers**, many per process (tokio tasks of
//! this process): each has its own pull on the shared PROMPTS consumer, its own heartbeat (`rollout.<instance>`
//! with its loaded version and engine idle time, as a real worker writes it) and its own continuous batch, which
//! it decodes at a modelled per-step time (a function of batch size and context length) without burning the CPU:
//! it advances the batch to its next event (a sequence finishing, at most [`CHUNK_MODELLED_S`] of modelled time)
//! and sleeps that long. Response lengths are drawn from a clipped log-normal (a long tail). Trajectories are
//! written through the real data plane exactly as a worker writes them (`sim::produce_built`), with real token
//! arrays of the drawn length and the versions their tokens were decoded under, so staleness is real.
//!
//! Weight versions: one watch per process (a stand-in, polling the WEIGHTS bucket's `latest` every 100 ms and
//! fetching and verifying each new blob once) tells every stand-in; each swaps to it between two decode chunks
//! after the profile's modelled load time, as a real worker loads new weights between decode steps. In
//! colocate_async every stand-in pauses when the trainer pauses its co-located worker (the handshake on
//! `control.<instance>.pause|resume` is answered once for the whole fleet: the fleet shares the trainer's devices).
//!
//! The paced clock runs `time_scale` times faster than real time: every modelled duration (decode, update,
//! publish, weight load) is divided by it. Wall times are reported in modelled seconds (real × `time_scale`).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use jetrl_bus::{consume, Bus, GroupStore, NatsServer};
use jetrl_config::JobConfig;
use jetrl_wire::v1::{
    FinishReason, GroupState, Heartbeat, PauseResponse, PromptTask, ResumeRequest, ResumeResponse, SampleRequest,
    SampleResponse, Trajectory, VersionRun, WorkerState,
};
use jetrl_wire::{packed, subjects, Message};
use serde::Deserialize;
use tokio::sync::watch;

use crate::sim::{self, GroupSpec};

/// The longest stretch of modelled time a stand-in decodes before it looks for new tasks, weights or a pause.
pub const CHUNK_MODELLED_S: f64 = 0.25;

/// A simulation profile (`benches/cluster_sim/*.yaml`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    pub name: String,
    /// global steps per mode
    pub steps: u64,
    /// fleet sizes; the bench runs the largest unless `JETRL_SIM_WORKERS` says otherwise
    pub workers: Vec<usize>,
    /// modelled seconds per real second
    pub time_scale: f64,
    pub rollout: RolloutProfile,
    /// the job's settings (jetrl config keys), merged over the simulation's base job; `trainer.simulate` holds
    /// the paced learner's timings
    pub job: serde_yaml::Value,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RolloutProfile {
    /// groups one worker decodes at once (its continuous batch holds up to `max_groups × rollout.n` sequences)
    pub max_groups: usize,
    /// modelled prompt length in tokens (the context a sequence starts from)
    pub prompt_tokens: u32,
    /// one decode step: `base_s + per_seq_s × B + per_context_token_s × Σ context`
    pub step: StepModel,
    /// modelled seconds a worker takes to load a new weight version
    pub load_weights_s: f64,
    pub response: LengthModel,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepModel {
    pub base_s: f64,
    pub per_seq_s: f64,
    pub per_context_token_s: f64,
}

impl StepModel {
    /// Modelled seconds of `k` decode steps of a batch of `b` sequences holding `context` tokens at the first;
    /// every step adds one token to each.
    pub fn steps_s(&self, b: usize, context: u64, k: u64) -> f64 {
        let b_f = b as f64;
        let k_f = k as f64;
        k_f * (self.base_s + self.per_seq_s * b_f + self.per_context_token_s * context as f64)
            + self.per_context_token_s * b_f * k_f * (k_f - 1.0) / 2.0
    }
}

/// Response lengths: log-normal with this median and σ, clipped to `[min, max]` (`max` = the length limit).
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LengthModel {
    pub median: f64,
    pub sigma: f64,
    pub min: u32,
    pub max: u32,
}

/// splitmix64: the stand-ins' random numbers (seeded per worker, reproducible).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed ^ 0x9e37_79b9_7f4a_7c15)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// uniform in (0, 1)
    pub fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    pub fn normal(&mut self) -> f64 {
        (-2.0 * self.unit().ln()).sqrt() * (2.0 * std::f64::consts::PI * self.unit()).cos()
    }
}

impl LengthModel {
    pub fn draw(&self, rng: &mut Rng) -> u32 {
        let x = self.median * (self.sigma * rng.normal()).exp();
        (x.round() as u32).clamp(self.min.max(1), self.max)
    }
}

/// The bound the profile gives separate_async over sync, from the same models the stand-ins and the paced
/// learner use: sync's step is the fleet's slowest worker (its groups decoded as one continuous batch, Monte
/// Carlo over `trials` batches) plus the update and the publish; separate_async's ideal step is the longer of the
/// update plus the publish and the fleet's steady decode time for a batch's tokens at full continuous batches.
#[derive(Debug, Clone, Copy)]
pub struct Bound {
    pub sync_step_s: f64,
    pub async_step_s: f64,
    pub update_s: f64,
    pub generate_sync_s: f64,
    pub generate_steady_s: f64,
}

impl Bound {
    pub fn speedup(&self) -> f64 {
        self.sync_step_s / self.async_step_s
    }
}

/// Decodes one continuous batch of sequences of `lengths` (all admitted at once, as a sync step's groups are)
/// to the end; modelled seconds.
fn decode_all_s(step: &StepModel, prompt: u32, lengths: &mut [u32]) -> f64 {
    lengths.sort_unstable();
    let mut t = 0.0;
    let mut done = 0u64;
    for (i, &len) in lengths.iter().enumerate() {
        let k = u64::from(len) - done;
        if k > 0 {
            let alive = lengths.len() - i;
            t += step.steps_s(alive, (u64::from(prompt) + done) * alive as u64, k);
            done = u64::from(len);
        }
    }
    t
}

pub fn ideal_bound(profile: &Profile, job: &JobConfig, workers: usize, trials: usize) -> Bound {
    let r = &profile.rollout;
    let sim = job.trainer.simulate.clone().unwrap_or_default();
    let groups = job.data.train_batch_size as usize;
    let n = job.rollout.n as usize;
    let mut rng = Rng::new(7);
    let (mut gen_sync, mut tokens) = (0.0, 0.0);
    for _ in 0..trials {
        // sync: the batch's groups dealt to the workers, at most max_groups each at a time, in rounds
        let mut per_worker: Vec<Vec<u32>> = vec![Vec::new(); workers];
        let mut slowest: f64 = 0.0;
        let mut left = groups;
        while left > 0 {
            for w in per_worker.iter_mut() {
                w.clear();
            }
            'deal: for _ in 0..r.max_groups {
                for w in per_worker.iter_mut() {
                    if left == 0 {
                        break 'deal;
                    }
                    w.extend((0..n).map(|_| r.response.draw(&mut rng)));
                    left -= 1;
                }
            }
            let mut round_max: f64 = 0.0;
            for w in per_worker.iter_mut().filter(|w| !w.is_empty()) {
                tokens += w.iter().map(|&l| f64::from(l + r.prompt_tokens)).sum::<f64>();
                round_max = round_max.max(decode_all_s(&r.step, r.prompt_tokens, w));
            }
            slowest += round_max;
        }
        gen_sync += slowest;
    }
    let gen_sync = gen_sync / trials as f64 + r.load_weights_s;
    let tokens = tokens / trials as f64;
    let update = tokens / 1000.0 * sim.seconds_per_kilotoken + sim.publish_s;
    // steady state: every worker decodes a full batch of mean-length sequences at mean context
    let mean_len = {
        let mut rng = Rng::new(11);
        (0..20_000).map(|_| f64::from(r.response.draw(&mut rng))).sum::<f64>() / 20_000.0
    };
    let b = r.max_groups * n;
    let mean_ctx = f64::from(r.prompt_tokens) + mean_len / 2.0;
    let step_s = r.step.base_s + r.step.per_seq_s * b as f64 + r.step.per_context_token_s * b as f64 * mean_ctx;
    let fleet_tokens_per_s = workers as f64 * b as f64 / step_s;
    let steady = groups as f64 * n as f64 * mean_len / fleet_tokens_per_s;
    Bound {
        sync_step_s: gen_sync + update,
        async_step_s: update.max(steady),
        update_s: update,
        generate_sync_s: gen_sync,
        generate_steady_s: steady,
    }
}

pub fn load_profile(path: &Path) -> Profile {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("profile {}: {e}", path.display()));
    serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("profile {}: {e}", path.display()))
}

/// `over` merged into `base`, mappings key by key at every depth.
fn merge(base: &mut serde_yaml::Value, over: &serde_yaml::Value) {
    match (base.as_mapping_mut(), over.as_mapping()) {
        (Some(b), Some(o)) => {
            for (k, v) in o {
                match b.get_mut(k) {
                    Some(slot) if slot.is_mapping() && v.is_mapping() => merge(slot, v),
                    _ => {
                        b.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        _ => *base = over.clone(),
    }
}

// ---------------------------------------------------------------------------------------------------------------
// The stand-in fleet
// ---------------------------------------------------------------------------------------------------------------

/// A dataset row as the ledger names it: `(epoch, row)`.
type DatasetRow = (u64, u64);

/// What the fleet shares: the newest weight version, the colocate pause, counters, and what it completed.
struct Fleet {
    profile: RolloutProfile,
    time_scale: f64,
    version: watch::Receiver<u64>,
    paused: watch::Receiver<bool>,
    stop: watch::Receiver<bool>,
    /// uid → (times completed, the lowest version of its tokens, its dataset row)
    completed: Mutex<HashMap<String, (u32, u64, DatasetRow)>>,
    idle_ns: AtomicU64,
    busy_ns: AtomicU64,
    errors: AtomicU64,
}

impl Fleet {
    fn real(&self, modelled: f64) -> Duration {
        Duration::from_secs_f64((modelled / self.time_scale).max(0.0))
    }
}

struct Running {
    task: Arc<PromptTask>,
    session: u32,
    length: u32,
    generated: u32,
    runs: Vec<VersionRun>,
}

struct GroupInFlight {
    msg: async_nats::jetstream::Message,
    left: usize,
    done: Vec<Option<Trajectory>>,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

/// One stand-in worker: a puller (its own pull on the shared PROMPTS consumer, at most `max_groups` groups held)
/// feeding its continuous batch, and a heartbeat.
async fn stand_in(bus: Bus, groups: GroupStore, fleet: Arc<Fleet>, cfg: JobConfig, index: usize) {
    let instance = format!("sim-{index}");
    let p = fleet.profile.clone();
    let consumer = match bus
        .shared_pull_consumer(
            bus.names().prompts_stream(),
            subjects::ROLLOUT_CONSUMER,
            &bus.names().prompts_filter(),
            Duration::from_secs_f64(cfg.rollout.ack_wait_s),
            1_000_000,
        )
        .await
    {
        Ok(c) => c,
        Err(err) => {
            eprintln!("{instance}: prompts consumer: {err}");
            fleet.errors.fetch_add(1, Ordering::Relaxed);
            return;
        }
    };
    let permits = Arc::new(tokio::sync::Semaphore::new(p.max_groups));
    let (task_tx, mut task_rx) = tokio::sync::mpsc::channel(p.max_groups);
    let mut stop = fleet.stop.clone();
    let _puller = {
        let permits = permits.clone();
        let mut stop = stop.clone();
        AbortOnDrop(tokio::spawn(async move {
            loop {
                let permit = tokio::select! {
                    _ = stop.changed() => return,
                    p = permits.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => return },
                };
                let batch = tokio::select! {
                    _ = stop.changed() => return,
                    b = consume::pull(&consumer, 1, Duration::from_secs(1)) => b,
                };
                let Ok(mut batch) = batch else {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                };
                if let Some(Ok(msg)) = batch.next().await {
                    if task_tx.send((msg, permit)).await.is_err() {
                        return;
                    }
                }
            }
        }))
    };
    // the heartbeat
    let loaded = Arc::new(AtomicU64::new(0));
    let running_now = Arc::new(AtomicU64::new(0));
    // a new version loaded is reported at once, as a real worker does (the trainer waits for it)
    let loaded_changed = Arc::new(tokio::sync::Notify::new());
    let idle_s = Arc::new(Mutex::new((0.0f64, Some(Instant::now()))));
    let _beat = {
        let (bus, loaded, running_now, idle_s, instance) =
            (bus.clone(), loaded.clone(), running_now.clone(), idle_s.clone(), instance.clone());
        let loaded_changed = loaded_changed.clone();
        let interval = Duration::from_secs_f64(cfg.rollout.heartbeat_interval_s.max(0.1));
        let slots = (p.max_groups * cfg.rollout.n as usize) as u32;
        let mut stop = stop.clone();
        AbortOnDrop(tokio::spawn(async move {
            let Ok(kv) = bus.key_value(bus.names().workers_bucket()).await else { return };
            let mut ticker = tokio::time::interval(interval);
            loop {
                tokio::select! {
                    _ = stop.changed() => return,
                    _ = ticker.tick() => {}
                    _ = loaded_changed.notified() => {}
                }
                let idle = {
                    let g = idle_s.lock().expect("idle");
                    g.0 + g.1.map_or(0.0, |t| t.elapsed().as_secs_f64())
                };
                let beat = Heartbeat {
                    service: "rollout".into(),
                    instance_id: instance.clone(),
                    policy_version: loaded.load(Ordering::Relaxed),
                    unix_ms: jetrl_wire::now_unix_ms(),
                    state: WorkerState::Ready as i32,
                    host: jetrl_telemetry::host_name().to_string(),
                    pid: std::process::id(),
                    slots,
                    engine_idle_seconds: idle,
                    running_sequences: running_now.load(Ordering::Relaxed) as u32,
                    ..Default::default()
                };
                let _ = kv.put(format!("rollout.{instance}"), beat.encode_to_vec().into()).await;
            }
        }))
    };

    let mut rng = Rng::new(index as u64 + 1);
    let mut version_rx = fleet.version.clone();
    let mut paused = fleet.paused.clone();
    let mut batch: Vec<Running> = Vec::new();
    let mut in_flight: HashMap<String, GroupInFlight> = HashMap::new();
    // tasks held until the worker has the version they ask for (sync mode)
    let mut waiting: Vec<(async_nats::jetstream::Message, tokio::sync::OwnedSemaphorePermit)> = Vec::new();
    let mut publishing = tokio::task::JoinSet::new();
    let set_idle = |idle: bool| {
        let mut g = idle_s.lock().expect("idle");
        match (idle, g.1) {
            (true, None) => g.1 = Some(Instant::now()),
            (false, Some(t)) => {
                let dt = t.elapsed();
                g.0 += dt.as_secs_f64();
                g.1 = None;
                fleet.idle_ns.fetch_add(dt.as_nanos() as u64, Ordering::Relaxed);
            }
            _ => {}
        }
    };
    loop {
        if *stop.borrow() {
            break;
        }
        while publishing.try_join_next().is_some() {}
        // a pause (colocate_async): nothing decodes until the resume
        if *paused.borrow() {
            set_idle(true);
            tokio::select! {
                _ = stop.changed() => break,
                _ = paused.changed() => {}
            }
            continue;
        }
        // a new weight version: loaded between two decode chunks, after the modelled load time
        let latest = *version_rx.borrow_and_update();
        if latest > loaded.load(Ordering::Relaxed) {
            tokio::time::sleep(fleet.real(p.load_weights_s)).await;
            loaded.store(latest, Ordering::Relaxed);
            loaded_changed.notify_one();
            for s in &mut batch {
                s.runs.push(VersionRun { first_token: s.generated, version: latest });
            }
        }
        let version = loaded.load(Ordering::Relaxed);
        // admit what has arrived (and what now has its version)
        while let Ok(item) = task_rx.try_recv() {
            waiting.push(item);
        }
        let mut i = 0;
        while i < waiting.len() {
            let Some(task) = PromptTask::decode(waiting[i].0.payload.clone()).ok() else {
                let (msg, _) = waiting.swap_remove(i);
                consume::settle(&msg, async_nats::jetstream::AckKind::Term).await;
                continue;
            };
            if task.min_policy_version > version {
                i += 1;
                continue;
            }
            let (msg, permit) = waiting.swap_remove(i);
            let task = Arc::new(task);
            for session in 0..task.n {
                batch.push(Running {
                    task: task.clone(),
                    session,
                    length: p.response.draw(&mut rng),
                    generated: 0,
                    runs: vec![VersionRun { first_token: 0, version }],
                });
            }
            in_flight.insert(
                task.uid.clone(),
                GroupInFlight { msg, left: task.n as usize, done: vec![None; task.n as usize], _permit: permit },
            );
        }
        running_now.store(batch.len() as u64, Ordering::Relaxed);
        if batch.is_empty() {
            set_idle(true);
            tokio::select! {
                _ = stop.changed() => break,
                _ = paused.changed() => {}
                _ = version_rx.changed() => {}
                item = task_rx.recv() => if let Some(item) = item { waiting.push(item) },
            }
            continue;
        }
        set_idle(false);
        // decode to the next event: a sequence finishing, or the chunk's modelled time
        let b = batch.len();
        let context: u64 = batch.iter().map(|s| u64::from(p.prompt_tokens + s.generated)).sum();
        let to_finish = batch.iter().map(|s| s.length - s.generated).min().unwrap_or(1).max(1);
        let one = p.step.steps_s(b, context, 1).max(1e-9);
        let k = u64::from(to_finish).min(((CHUNK_MODELLED_S / one).floor() as u64).max(1));
        let modelled = p.step.steps_s(b, context, k);
        let started = Instant::now();
        tokio::time::sleep(fleet.real(modelled)).await;
        fleet.busy_ns.fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        let mut j = 0;
        while j < batch.len() {
            batch[j].generated += k as u32;
            if batch[j].generated < batch[j].length {
                j += 1;
                continue;
            }
            let s = batch.swap_remove(j);
            let traj = trajectory(&s, &instance, p.prompt_tokens, p.response.max, &mut rng);
            let uid = s.task.uid.clone();
            let Some(group) = in_flight.get_mut(&uid) else { continue };
            group.done[s.session as usize] = Some(traj);
            group.left -= 1;
            if group.left == 0 {
                let Some(group) = in_flight.remove(&uid) else { continue };
                publishing.spawn(publish(bus.clone(), groups.clone(), fleet.clone(), s.task.clone(), group));
            }
        }
    }
    set_idle(false);
    // the groups being published finish; what is still decoding is handed back
    while publishing.join_next().await.is_some() {}
    for (_, g) in in_flight {
        consume::settle(&g.msg, async_nats::jetstream::AckKind::Nak(None)).await;
    }
}

/// A task that ends with its owner (a stand-in killed by the chaos takes its puller and heartbeat with it).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A finished sequence as the worker stores it: real token arrays of its length, the versions it was decoded
/// under. The response text is the ground truth half of the time (a reward of 1), else a wrong answer.
fn trajectory(s: &Running, instance: &str, prompt_tokens: u32, max_len: u32, rng: &mut Rng) -> Trajectory {
    let t = &s.task;
    let len = s.length as usize;
    // tiny-digits' vocabulary: ids 3..16 are the digits and '=' (0..2 are pad, bos, eos)
    let ids: Vec<u32> = (0..len as u64).map(|i| 3 + ((i * 2_654_435_761 + u64::from(s.session)) % 13) as u32).collect();
    // the task's prompt, left-padded with a digit to the profile's prompt length: what the trainer trains on and
    // the data plane carries has the modelled size
    let task_prompt = packed::unpack_u32(&t.prompt_ids).unwrap_or_default();
    let mut prompt_ids = vec![3u32; (prompt_tokens as usize).saturating_sub(task_prompt.len())];
    prompt_ids.extend(task_prompt);
    let prompt_len = prompt_ids.len() as u32;
    let prompt = packed::pack_u32(&prompt_ids);
    let min_version = s.runs.iter().map(|r| r.version).min().unwrap_or(0);
    let max_version = s.runs.iter().map(|r| r.version).max().unwrap_or(0);
    Trajectory {
        key: jetrl_wire::keys::TrajectoryKey::new(t.uid.clone(), s.session, 0).to_string(),
        uid: t.uid.clone(),
        session_id: s.session,
        partition: t.partition.clone(),
        submit_step: t.submit_step,
        prompt_ids: prompt,
        response_ids: packed::pack_u32(&ids),
        response_mask: Bytes::from(vec![1u8; len]),
        logprobs: packed::pack_f32(&vec![-0.7; len]),
        min_version,
        max_version,
        version_runs: s.runs.clone(),
        finish_reason: if s.length >= max_len { FinishReason::Length } else { FinishReason::Stop } as i32,
        response_text: if rng.unit() < 0.5 { t.ground_truth.clone() } else { "0".into() },
        data_source: t.data_source.clone(),
        ground_truth: t.ground_truth.clone(),
        extra_info_json: t.extra_info_json.clone(),
        worker_id: instance.to_string(),
        num_turns: 1,
        epoch: t.epoch,
        dataset_row: t.dataset_row,
        prompt_len,
        response_len: len as u32,
        ..Default::default()
    }
}

/// Writes a decoded group through the real data plane (running, trajectories, score request, terminal record),
/// then acknowledges its task; a failure hands the task back.
async fn publish(bus: Bus, groups: GroupStore, fleet: Arc<Fleet>, task: Arc<PromptTask>, group: GroupInFlight) {
    let trajectories: Vec<Trajectory> = group.done.into_iter().flatten().collect();
    let spec = GroupSpec {
        uid: task.uid.clone(),
        partition: task.partition.clone(),
        submit_step: task.submit_step,
        scores: vec![0.0; trajectories.len()],
        state: GroupState::Finished,
        payload_bytes: 0,
        data_source: task.data_source.clone(),
    };
    let min_version = trajectories.iter().map(|t| t.min_version).min().unwrap_or(0);
    match sim::produce_built(&bus, &groups, &spec, None, &trajectories).await {
        Ok(_) => {
            // completed once its terminal record is written, before the ack: a stand-in killed in between leaves
            // a group that is trained, and must not count as one no stand-in wrote
            {
                let mut done = fleet.completed.lock().expect("completed");
                let entry = done.entry(task.uid.clone()).or_insert((0, min_version, (task.epoch, task.dataset_row)));
                entry.0 += 1;
            }
            let _ = consume::ack_confirmed(&group.msg).await;
        }
        Err(err) => {
            // as a rollout worker does: a group no longer pending or running (terminal, or already sampled or
            // evicted: a redelivery after a kill) or without a record (a resumed trainer retired it) needs no work
            let settled = match groups.get(&spec.partition, &spec.uid).await {
                Ok(Some((s, _))) => !s.state().is_inflight(),
                Ok(None) => true,
                Err(_) => false,
            };
            if settled {
                consume::settle(&group.msg, async_nats::jetstream::AckKind::Ack).await;
            } else {
                eprintln!("group {}: {err}; handed back", spec.uid);
                fleet.errors.fetch_add(1, Ordering::Relaxed);
                consume::settle(&group.msg, async_nats::jetstream::AckKind::Nak(Some(Duration::from_secs(1)))).await;
            }
        }
    }
}

/// Raises `version` to `v` when `v` is newer.
fn raise(version: &watch::Sender<u64>, v: u64) {
    version.send_if_modified(|cur| {
        let newer = v > *cur;
        if newer {
            *cur = v;
        }
        newer
    });
}

/// Follows the WEIGHTS bucket's `latest` for the whole process (a stand-in for each worker's own watch: one poll
/// every 100 ms; each new blob is fetched and its checksums verified once, as a worker does before loading it).
async fn weight_watch(bus: Bus, version: Arc<watch::Sender<u64>>, mut stop: watch::Receiver<bool>) {
    let mut seen: Option<u64> = None;
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
        let Ok(Some(manifest)) = bus.latest_manifest().await else { continue };
        if seen == Some(manifest.version) {
            continue;
        }
        match bus.load_weights(&manifest.location).await {
            Ok(blob) => {
                if let Err(err) = jetrl_bus::weights::verify(&manifest, &blob) {
                    eprintln!("weights v{}: {err}", manifest.version);
                    continue;
                }
            }
            Err(err) => {
                eprintln!("weights v{}: {err}", manifest.version);
                continue;
            }
        }
        seen = Some(manifest.version);
        raise(&version, manifest.version);
    }
}

/// colocate_async: the handshake with the trainer, answered for the whole fleet. As a rollout worker does, the
/// fleet resumes on its own when no resume comes within `handshake_timeout` of a pause (a trainer killed while
/// its worker was paused never sends one; the next trainer publishes its weights and waits for the fleet to load
/// them).
async fn colocate_control(
    bus: Bus,
    instance: String,
    handshake_timeout: Duration,
    paused: Arc<watch::Sender<bool>>,
    version: Arc<watch::Sender<u64>>,
    mut stop: watch::Receiver<bool>,
) {
    let client = bus.client().clone();
    let (Ok(mut pause), Ok(mut resume)) = (
        client.subscribe(bus.names().control_subject(&instance, "pause")).await,
        client.subscribe(bus.names().control_subject(&instance, "resume")).await,
    ) else {
        eprintln!("colocate control: subscribe failed");
        return;
    };
    let mut overdue: Option<tokio::time::Instant> = None;
    loop {
        let deadline = overdue.unwrap_or_else(tokio::time::Instant::now);
        tokio::select! {
            _ = stop.changed() => return,
            _ = tokio::time::sleep_until(deadline), if overdue.is_some() => {
                overdue = None;
                eprintln!("colocate control: no resume within {handshake_timeout:?}; the fleet resumed on its own");
                paused.send_replace(false);
            }
            Some(msg) = pause.next() => {
                paused.send_replace(true);
                overdue = Some(tokio::time::Instant::now() + handshake_timeout);
                if let Some(reply) = msg.reply {
                    let _ = client.publish(reply, PauseResponse::default().encode_to_vec().into()).await;
                }
            }
            Some(msg) = resume.next() => {
                overdue = None;
                let request = ResumeRequest::decode(msg.payload.clone()).unwrap_or_default();
                if let Some(m) = &request.manifest {
                    raise(&version, m.version);
                }
                paused.send_replace(false);
                if let Some(reply) = msg.reply {
                    let resp = ResumeResponse { version: *version.borrow(), ..Default::default() };
                    let _ = client.publish(reply, resp.encode_to_vec().into()).await;
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// One run
// ---------------------------------------------------------------------------------------------------------------

/// What one mode's run measured.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    pub mode: String,
    pub workers: usize,
    pub steps: u64,
    pub time_scale: f64,
    pub trainer_ok: bool,
    /// modelled seconds of the whole training: initial weights, warm-up and every step (the trainer's
    /// `train_wall_s` × scale)
    pub wall_s: f64,
    /// modelled seconds of the steps alone (Σ `timing_s/step` × scale)
    pub steps_s: f64,
    /// the mean modelled step after the first (which fills the pipeline in the async modes)
    pub steady_step_s: f64,
    pub steps_trained: Vec<u64>,
    pub groups_per_step: Vec<u64>,
    /// trainer idle share (`perf/trainer_idle_ratio`, mean over steps) and the fleet's idle share (stand-ins'
    /// engine idle time over their time)
    pub trainer_wait_share: f64,
    pub fleet_idle_share: f64,
    /// staleness of trained groups, in versions: the step it was trained at − 1 − the lowest version of its tokens
    pub staleness: BTreeMap<u64, u64>,
    pub staleness_max_allowed: u64,
    pub sample_latency_ms: Vec<f64>,
    pub reward_queue_max: u64,
    pub reward_queue_mean: f64,
    pub lost: u64,
    pub duplicated: u64,
    pub untrained_at_end: u64,
    pub worker_errors: u64,
    /// `JETRL_SIM_CHAOS=1`: stand-ins killed (and restarted), services killed (and restarted), by name
    pub chaos: bool,
    pub workers_killed: u64,
    pub services_killed: Vec<String>,
    /// the longest time the trainer recorded no step (modelled seconds, after its first step): a killed
    /// trainer's restart, its lease wait and its resume show here
    pub longest_stall_s: f64,
    /// the longest and the median step, modelled seconds (the longest stall a kill of a service other than the
    /// trainer caused shows as the first)
    pub longest_step_s: f64,
    pub median_step_s: f64,
}

pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn spawn_logged(dir: &Path, name: &str, binary: &str, config: &Path, extra: &[String]) -> Child {
    let log = std::fs::File::create(dir.join(format!("{name}.log"))).expect("log file");
    let mut command = Command::new(crate::bin(binary));
    command
        .arg("--config")
        .arg(config)
        .args(extra)
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("log"))
        .stderr(log);
    jetrl_bus::harness::die_with_parent(&mut command);
    command.spawn().unwrap_or_else(|e| panic!("starting {binary}: {e}"))
}

/// The services `JETRL_SIM_CHAOS=1` kills (one at random every 60 s); `JETRL_SIM_CHAOS_KILL` names fewer.
pub const CHAOS_VICTIMS: &str = "checkpoint-sync,replay-buffer,reward-service,trainer";

/// Runs one mode of `profile` with `workers` stand-ins at `time_scale`; `dir` keeps the logs and the run directory.
pub async fn run_mode(profile: &Profile, mode: &str, workers: usize, time_scale: f64, dir: &Path) -> Outcome {
    let server = NatsServer::start().expect("nats-server");
    let url = server.url();
    let model = dir.join("model");
    if !model.join("config.json").exists() {
        jetrl_model::init_model("tiny-digits", &model, 1).expect("tiny-digits model");
        // the trainer checks response lengths against the model's positions: room for the profile's lengths
        let path = model.join("config.json");
        let mut config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).expect("config.json")).expect("config.json");
        config["max_position_embeddings"] = serde_json::json!(65_536);
        std::fs::write(&path, serde_json::to_string_pretty(&config).expect("json")).expect("config.json");
    }
    let run_dir = dir.join(format!("run-{mode}"));
    let _ = std::fs::remove_dir_all(&run_dir);
    let base = format!(
        r#"
nats: {{url: "{url}", connect_timeout_s: 30}}
run: {{name: sim, dir: "{run}", seed: 1}}
model: {{path: "{model}"}}
log: {{level: warn}}
rollout: {{ack_wait_s: 300, heartbeat_interval_s: 1.0, heartbeat_timeout_s: 30}}
trainer:
  mode: {mode}
  total_training_steps: {steps}
  logger: [jsonl]
  weight_sync_timeout_s: 600
  colocate_async: {{rollout_instance: sim-0}}
"#,
        run = run_dir.display(),
        model = model.display(),
        steps = profile.steps,
    );
    let mut doc: serde_yaml::Value = serde_yaml::from_str(&base).expect("base job");
    merge(&mut doc, &profile.job);
    let chaos = std::env::var("JETRL_SIM_CHAOS").is_ok_and(|v| v == "1");
    if chaos {
        // a killed stand-in's tasks come back after the ack wait: short enough for the run to go on; a killed
        // trainer resumes from its newest checkpoint (saved every step: a paced learner's checkpoint holds no weights)
        merge(&mut doc, &serde_yaml::from_str("rollout: {ack_wait_s: 20}").expect("yaml"));
        merge(&mut doc, &serde_yaml::from_str("trainer: {save_freq: 1, resume_mode: auto}").expect("yaml"));
    }
    let scale = serde_yaml::from_str(&format!("trainer: {{simulate: {{time_scale: {time_scale}}}}}")).expect("yaml");
    merge(&mut doc, &scale);
    let config = dir.join(format!("job-{mode}.yaml"));
    std::fs::write(&config, serde_yaml::to_string(&doc).expect("yaml")).expect("job.yaml");
    let cfg = JobConfig::load(Some(&config), &[]).expect("the simulation's job");
    let bus = Bus::connect_job(&cfg, "cluster-sim").await.expect("connect");
    bus.declare_topology().await.expect("declare");
    let groups = GroupStore::open(&bus).await.expect("groups");

    let mut children: Vec<(String, Child)> = vec![
        ("checkpoint-sync".into(), spawn_logged(dir, "checkpoint-sync", "jetrl-checkpoint-sync", &config, &[])),
        ("replay-buffer".into(), spawn_logged(dir, "replay-buffer", "jetrl-replay-buffer", &config, &[])),
        ("reward-service".into(), spawn_logged(dir, "reward-service", "jetrl-reward-service", &config, &[])),
    ];
    // the fleet
    let (stop_tx, stop_rx) = watch::channel(false);
    let (version_tx, version_rx) = watch::channel(0u64);
    let (paused_tx, paused_rx) = watch::channel(false);
    // held for the whole run: a stand-in waits on its changes
    let paused_tx = Arc::new(paused_tx);
    let fleet = Arc::new(Fleet {
        profile: profile.rollout.clone(),
        time_scale,
        version: version_rx,
        paused: paused_rx,
        stop: stop_rx.clone(),
        completed: Mutex::new(HashMap::new()),
        idle_ns: AtomicU64::new(0),
        busy_ns: AtomicU64::new(0),
        errors: AtomicU64::new(0),
    });
    let version_tx = Arc::new(version_tx);
    let mut fleet_tasks = tokio::task::JoinSet::new();
    fleet_tasks.spawn(weight_watch(bus.clone(), version_tx.clone(), stop_rx.clone()));
    if mode == "colocate_async" {
        let paused = paused_tx.clone();
        let handshake_timeout = Duration::from_secs_f64(cfg.trainer.colocate_async.handshake_timeout_s);
        fleet_tasks.spawn(colocate_control(
            bus.clone(),
            "sim-0".into(),
            handshake_timeout,
            paused,
            version_tx.clone(),
            stop_rx.clone(),
        ));
    }
    let fleet_started = Instant::now();
    let mut worker_handles: Vec<tokio::task::AbortHandle> = (0..workers)
        .map(|i| fleet_tasks.spawn(stand_in(bus.clone(), groups.clone(), fleet.clone(), cfg.clone(), i)))
        .collect();
    // probes: the buffer's answer latency (a sample request for an empty partition, answered `not ready` at
    // once, through the same request loop as the trainer's), the reward service's queue (SCORE consumer pending)
    let probing = Arc::new(AtomicBool::new(true));
    let probe = {
        let (bus, probing) = (bus.clone(), probing.clone());
        tokio::spawn(async move {
            let (mut latencies, mut queue) = (Vec::new(), Vec::new());
            let mut n = 0u64;
            while probing.load(Ordering::Relaxed) {
                n += 1;
                let request = SampleRequest {
                    request_id: format!("probe-{n}"),
                    step: 0,
                    partition: "probe".into(),
                    batch_size: 1,
                    wait_ms: 0,
                    ..Default::default()
                };
                let t = Instant::now();
                if bus
                    .request::<_, SampleResponse>(bus.names().buffer_sample(), &request, Duration::from_secs(5))
                    .await
                    .is_ok()
                {
                    latencies.push(t.elapsed().as_secs_f64() * 1000.0);
                }
                if let Ok(mut stream) = bus.jetstream().get_stream(bus.names().score_stream()).await {
                    let _ = stream.info().await;
                    if let Ok(mut c) = stream
                        .get_consumer::<async_nats::jetstream::consumer::pull::Config>(subjects::REWARD_CONSUMER)
                        .await
                    {
                        if let Ok(info) = c.info().await {
                            queue.push(info.num_pending + info.num_ack_pending as u64);
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            (latencies, queue)
        })
    };
    let mut trainer = spawn_logged(dir, "trainer", "jetrl-trainer", &config, &[]);
    let mut out_kills: (u64, Vec<String>) = (0, Vec::new());
    let deadline = Instant::now() + Duration::from_secs(1800);
    // chaos: kill -9 a random stand-in every 10 s (restarted at once under its instance id, as a supervisor
    // restarts a worker on its GPU) and a random service every 60 s (restarted after a second; the trainer
    // resumes from its checkpoint once the dead one's lease has expired)
    let mut victims: Vec<String> = crate::bench::knob("JETRL_SIM_CHAOS_KILL", CHAOS_VICTIMS.to_string())
        .split(',')
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
        .collect();
    for v in &victims {
        assert!(
            CHAOS_VICTIMS.split(',').any(|known| known == v),
            "JETRL_SIM_CHAOS_KILL: unknown service {v:?} (known: {CHAOS_VICTIMS})"
        );
    }
    victims.sort();
    let metrics_path = run_dir.join("metrics.jsonl");
    // the metrics file's length and when it last grew: the trainer's stalls
    let (mut metrics_len, mut last_growth, mut longest_stall) = (0u64, None::<Instant>, Duration::ZERO);
    let mut rng = Rng::new(99);
    let (mut next_worker_kill, mut next_service_kill) =
        (Instant::now() + Duration::from_secs(10), Instant::now() + Duration::from_secs(60));
    let status = loop {
        if let Ok(Some(status)) = trainer.try_wait() {
            break Some(status);
        }
        if chaos && Instant::now() >= next_worker_kill {
            next_worker_kill += Duration::from_secs(10);
            let i = (rng.next_u64() % workers as u64) as usize;
            worker_handles[i].abort();
            worker_handles[i] = fleet_tasks.spawn(stand_in(bus.clone(), groups.clone(), fleet.clone(), cfg.clone(), i));
            out_kills.0 += 1;
        }
        if chaos && !victims.is_empty() && Instant::now() >= next_service_kill {
            next_service_kill += Duration::from_secs(60);
            let name = victims[(rng.next_u64() % victims.len() as u64) as usize].clone();
            let incarnation = format!("{name}-{}", out_kills.1.len());
            if name == "trainer" {
                let _ = trainer.kill();
                let _ = trainer.wait();
                eprintln!("chaos: killed the trainer");
                trainer = spawn_logged(dir, &incarnation, "jetrl-trainer", &config, &[]);
            } else if let Some((_, child)) = children.iter_mut().find(|(n, _)| *n == name) {
                let _ = child.kill();
                let _ = child.wait();
                eprintln!("chaos: killed {name}");
                tokio::time::sleep(Duration::from_secs(1)).await;
                *child = spawn_logged(dir, &incarnation, &format!("jetrl-{name}"), &config, &[]);
            }
            out_kills.1.push(name);
        }
        // a step recorded appends to the file (a resumed trainer first cuts it back to its checkpoint's step)
        let len = std::fs::metadata(&metrics_path).map_or(0, |m| m.len());
        if len > metrics_len {
            if let Some(at) = last_growth {
                longest_stall = longest_stall.max(at.elapsed());
            }
            last_growth = Some(Instant::now());
        }
        metrics_len = len;
        if Instant::now() > deadline {
            let _ = trainer.kill();
            break None;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let fleet_real_s = fleet_started.elapsed().as_secs_f64();
    probing.store(false, Ordering::Relaxed);
    let _ = stop_tx.send(true);
    while fleet_tasks.join_next().await.is_some() {}
    let (mut latencies, queue) = probe.await.unwrap_or_default();
    latencies.sort_by(f64::total_cmp);
    for (_, child) in &mut children {
        let _ = child.kill();
        let _ = child.wait();
    }
    drop(server);

    // what the trainer wrote
    let metrics = crate::run_metrics(&run_dir);
    let mut out = Outcome {
        mode: mode.into(),
        workers,
        steps: profile.steps,
        time_scale,
        trainer_ok: status.is_some_and(|s| s.success()),
        ..Default::default()
    };
    // every step's line holds its batch's record; a line a resumed trainer wrote from a checkpoint (the trainer
    // before it died between the checkpoint and the line) has no whole-step timing, so the timings read the others
    let trained: Vec<&serde_json::Value> = metrics.iter().filter(|m| m["training/num_groups"].is_number()).collect();
    out.steps_trained = trained.iter().filter_map(|m| m["training/global_step"].as_f64().map(|s| s as u64)).collect();
    out.groups_per_step = trained.iter().map(|m| m["training/num_groups"].as_f64().unwrap_or(0.0) as u64).collect();
    let steps: Vec<&serde_json::Value> = metrics.iter().filter(|m| m["timing_s/step"].is_number()).collect();
    let step_s: f64 = steps.iter().filter_map(|m| m["timing_s/step"].as_f64()).sum();
    out.steps_s = step_s * time_scale;
    let later: Vec<f64> = steps.iter().skip(1).filter_map(|m| m["timing_s/step"].as_f64()).collect();
    out.steady_step_s =
        if later.is_empty() { f64::NAN } else { later.iter().sum::<f64>() / later.len() as f64 * time_scale };
    // the whole training (initial weights, warm-up, every step), from the trainer's summary
    let summary: serde_json::Value = std::fs::read_to_string(run_dir.join("summary.json"))
        .ok()
        .and_then(|s| serde_json::from_str(&s).ok())
        .unwrap_or_default();
    out.wall_s = summary["train_wall_s"].as_f64().unwrap_or(f64::NAN) * time_scale;
    let idle: Vec<f64> = steps.iter().filter_map(|m| m["perf/trainer_idle_ratio"].as_f64()).collect();
    out.trainer_wait_share = if idle.is_empty() { f64::NAN } else { idle.iter().sum::<f64>() / idle.len() as f64 };
    out.fleet_idle_share =
        (fleet.idle_ns.load(Ordering::Relaxed) as f64 / 1e9 / (fleet_real_s * workers as f64)).clamp(0.0, 1.0);
    out.sample_latency_ms = latencies;
    out.reward_queue_max = queue.iter().copied().max().unwrap_or(0);
    out.reward_queue_mean = if queue.is_empty() { 0.0 } else { queue.iter().sum::<u64>() as f64 / queue.len() as f64 };
    out.worker_errors = fleet.errors.load(Ordering::Relaxed);
    out.chaos = chaos;
    out.workers_killed = out_kills.0;
    out.services_killed = out_kills.1;
    out.longest_stall_s = longest_stall.as_secs_f64() * time_scale;
    let mut step_times: Vec<f64> =
        steps.iter().filter_map(|m| m["timing_s/step"].as_f64()).map(|t| t * time_scale).collect();
    step_times.sort_by(f64::total_cmp);
    out.longest_step_s = step_times.last().copied().unwrap_or(f64::NAN);
    out.median_step_s = percentile(&step_times, 0.5);
    out.staleness_max_allowed = cfg.buffer.max_off_policy_threshold.max(1);

    // the ledger: every completed group trained once, or still waiting (untrained when the run ended)
    let ledger = std::fs::read_to_string(run_dir.join("ledger.jsonl")).unwrap_or_default();
    let mut trained_at: HashMap<String, u64> = HashMap::new();
    let mut decided_rows: HashMap<(u64, u64), u32> = HashMap::new();
    let mut in_ledger: HashSet<String> = HashSet::new();
    let mut open_rows: HashSet<(u64, u64)> = HashSet::new();
    for row in ledger.lines().filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()) {
        let uid = row["uid"].as_str().unwrap_or_default().to_string();
        in_ledger.insert(uid.clone());
        let key = (row["epoch"].as_u64().unwrap_or(0), row["row"].as_u64().unwrap_or(0));
        match row["fate"].as_str() {
            Some("trained") => {
                *decided_rows.entry(key).or_default() += 1;
                trained_at.insert(uid, row["step"].as_u64().unwrap_or(0));
            }
            Some("evicted") | Some("failed") => *decided_rows.entry(key).or_default() += 1,
            _ => {
                open_rows.insert(key);
                out.untrained_at_end += 1;
            }
        }
    }
    out.duplicated = decided_rows.values().filter(|&&n| n > 1).map(|&n| u64::from(n - 1)).sum();
    let completed = fleet.completed.lock().expect("completed");
    for (uid, &(_, min_version, row)) in completed.iter() {
        // a group rolled back or superseded by a trainer's resume is not in the ledger; its row is, decided by the
        // group drawn again
        if !in_ledger.contains(uid) && !decided_rows.contains_key(&row) && !open_rows.contains(&row) {
            eprintln!(
                "lost: group {uid} (epoch {}, row {}) completed, not in the ledger, its row undecided",
                row.0, row.1
            );
            out.lost += 1;
        }
        if let Some(&step) = trained_at.get(uid) {
            *out.staleness.entry(step.saturating_sub(1).saturating_sub(min_version)).or_default() += 1;
        }
    }
    // trained groups no stand-in completed (a payload from nowhere) count as lost too
    for uid in trained_at.keys().filter(|uid| !completed.contains_key(*uid)) {
        eprintln!("lost: group {uid} trained, written by no stand-in");
        out.lost += 1;
    }
    out
}

/// The profile file `name` (a path, or a name under `benches/cluster_sim/`).
pub fn profile_path(name: &str) -> PathBuf {
    let p = PathBuf::from(name);
    if p.exists() {
        return p;
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../benches/cluster_sim").join(format!("{name}.yaml"))
}

/// The profile's job as the simulation runs it (for the bound: batch size, group size, the learner's timings).
pub fn profile_job(profile: &Profile, dir: &Path) -> JobConfig {
    let path = dir.join("profile-job.yaml");
    std::fs::write(&path, serde_yaml::to_string(&profile.job).expect("yaml")).expect("profile job");
    JobConfig::load(Some(&path), &[]).expect("the profile's job")
}

/// One mode's JSON line.
pub fn mode_json(profile: &Profile, o: &Outcome, bound: &Bound) -> serde_json::Value {
    let lat = &o.sample_latency_ms;
    serde_json::json!({
        "bench": "cluster_sim",
        "profile": profile.name,
        "mode": o.mode,
        "workers": o.workers,
        "steps": o.steps,
        "steps_trained": o.steps_trained.len(),
        "trainer_ok": o.trainer_ok,
        "time_scale": o.time_scale,
        "wall_s": round(o.wall_s, 1),
        "steps_s": round(o.steps_s, 1),
        "step_s": round(o.steps_s / o.steps.max(1) as f64, 2),
        "steady_step_s": round(o.steady_step_s, 2),
        "ideal_step_s": round(if o.mode == "sync" { bound.sync_step_s } else { bound.async_step_s }, 2),
        "trainer_wait_share": round(o.trainer_wait_share, 4),
        "fleet_idle_share": round(o.fleet_idle_share, 4),
        "staleness": o.staleness.iter().map(|(k, v)| (k.to_string(), *v)).collect::<BTreeMap<_, _>>(),
        "staleness_bound": o.staleness_max_allowed,
        "sample_p50_ms": round(percentile(lat, 0.5), 2),
        "sample_p99_ms": round(percentile(lat, 0.99), 2),
        "sample_probes": lat.len(),
        "reward_queue_max": o.reward_queue_max,
        "reward_queue_mean": round(o.reward_queue_mean, 1),
        "lost": o.lost,
        "duplicated": o.duplicated,
        "untrained_at_end": o.untrained_at_end,
        "worker_errors": o.worker_errors,
        "longest_step_s": round(o.longest_step_s, 2),
        "median_step_s": round(o.median_step_s, 2),
        "chaos": if o.chaos {
            serde_json::json!({
                "workers_killed": o.workers_killed,
                "services_killed": o.services_killed,
                "longest_stall_s": round(o.longest_stall_s, 1),
            })
        } else {
            serde_json::Value::Null
        },
    })
}

pub fn round(x: f64, digits: i32) -> f64 {
    let f = 10f64.powi(digits);
    (x * f).round() / f
}
