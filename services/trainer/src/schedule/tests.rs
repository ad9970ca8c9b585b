//! The three schedules against in-process stand-ins under tokio's paused clock: a fleet of one rollout engine
//! that generates one group at a time for a fixed time (holding the weights it was last given), a learner whose
//! update takes a fixed time per trajectory, and a weight plane that swaps the fleet's version at once. Every
//! call a schedule makes is logged, so the tests read the order of a step's phases, the policy versions its
//! batches were generated with, and the step's timings and idle shares (exact: the clock only moves to the next
//! timer). A test takes milliseconds of real time.

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use jetrl_config::JobConfig;
use jetrl_data::LoaderState;
use jetrl_wire::v1::{
    PauseResponse, ResumeResponse, Reward, SampleResponse, SampledGroup, WeightManifest, WorkerState,
};
use tokio::time::Instant;

use super::{step, warm_up, Schedule};
use crate::actor::{OldPolicy, TrainOutput};
use crate::batch::Sample;
use crate::checkpoint::ActorState;
use crate::error::TrainerError;
use crate::fleet::WorkerView;
use crate::learner::Learner;
use crate::planes::{DataPlane, WeightPlane};
use crate::rollout_client::Fetched;
use crate::step_metrics::{Metrics, Phase};
use crate::weight_sync::{HandshakeMissed, SyncReport};

/// The engine's time per group, unless a test says otherwise.
const GEN: Duration = Duration::from_secs(1);
/// The learner's time per trajectory.
const TRAIN_PER_TRAJECTORY: Duration = Duration::from_millis(250);
/// Trajectories per group (`rollout.n`).
const N: usize = 2;

/// One call a schedule made, in the order made.
#[derive(Debug, Clone, PartialEq)]
enum Call {
    Submit { step: u64, groups: usize },
    Sample { step: u64, groups: u32 },
    Reject { uid: String },
    Snapshot,
    Train { step: u64, pi_old: OldPolicy, trajectories: usize },
    Checkpoint,
    Release { step: u64, requests: usize },
    Publish { version: u64 },
    Wait { version: u64 },
    Pause { step: u64 },
    Store { version: u64 },
    Resume { version: u64 },
    Announce { version: u64 },
}

/// A submitted group: when the engine generates it (one at a time, first submitted first).
struct Group {
    uid: String,
    submit_step: u64,
    row: u64,
    start: Instant,
    end: Instant,
}

/// What the stand-ins share.
struct World {
    calls: Vec<Call>,
    /// (from when, version) of the weights the fleet holds, oldest first
    versions: Vec<(Instant, u64)>,
    /// submitted and not yet sampled, in the engine's order
    queue: VecDeque<Group>,
    /// every group's generation interval, for the fleet's idle time
    busy: Vec<(Instant, Instant)>,
    /// when the engine is free for the next group
    engine_free: Instant,
    /// the fleet's first moment
    born: Instant,
    /// the engine's time per group
    gen: Duration,
    paused_at: Option<Instant>,
    next_row: u64,
    /// sampled groups' trajectories, kept for the fetch
    sampled: BTreeMap<String, Vec<Sample>>,
    /// fetch rejects every group (its payloads failed the boundary checks)
    reject_all: bool,
    /// the co-located worker answers neither handshake
    deaf: bool,
}

impl World {
    fn version_at(&self, at: Instant) -> u64 {
        self.versions.iter().rev().find(|(from, _)| *from <= at).map_or(0, |(_, v)| *v)
    }

    fn hold(&mut self, version: u64) {
        self.versions.push((Instant::now(), version));
    }

    fn call(&mut self, call: Call) {
        self.calls.push(call);
    }
}

#[derive(Clone)]
struct Stand(Arc<Mutex<World>>);

impl Stand {
    fn new() -> Self {
        Self::generating(GEN)
    }

    fn generating(gen: Duration) -> Self {
        let now = Instant::now();
        Self(Arc::new(Mutex::new(World {
            calls: Vec::new(),
            versions: vec![(now, 0)],
            queue: VecDeque::new(),
            busy: Vec::new(),
            engine_free: now,
            born: now,
            gen,
            paused_at: None,
            next_row: 0,
            sampled: BTreeMap::new(),
            reject_all: false,
            deaf: false,
        })))
    }

    fn world(&self) -> std::sync::MutexGuard<'_, World> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn calls(&self) -> Vec<Call> {
        self.world().calls.clone()
    }

    fn call(&self, call: Call) {
        self.world().call(call);
    }
}

impl DataPlane for Stand {
    fn inflight_groups(&self) -> BoxFuture<'_, Result<usize, TrainerError>> {
        Box::pin(async move { Ok(self.world().queue.len()) })
    }

    fn submit_train(&mut self, step: u64, count: usize) -> BoxFuture<'_, Result<usize, TrainerError>> {
        Box::pin(async move {
            let mut w = self.world();
            w.call(Call::Submit { step, groups: count });
            let now = Instant::now();
            for _ in 0..count {
                let start = w.engine_free.max(now);
                let end = start + w.gen;
                w.engine_free = end;
                let row = w.next_row;
                w.next_row += 1;
                w.queue.push_back(Group { uid: format!("g{row}"), submit_step: step, row, start, end });
            }
            Ok(count)
        })
    }

    fn sample<'a>(
        &'a mut self,
        request_id: &'a str,
        step: u64,
        _partition: &'a str,
        groups: u32,
    ) -> BoxFuture<'a, Result<(SampleResponse, u32), TrainerError>> {
        Box::pin(async move {
            let ready = {
                let mut w = self.world();
                w.call(Call::Sample { step, groups });
                let last = w.queue.get(groups as usize - 1).expect("a sample request for groups never submitted");
                last.end
            };
            tokio::time::sleep_until(ready).await;
            let mut w = self.world();
            let mut response = SampleResponse { request_id: request_id.into(), ..Default::default() };
            for _ in 0..groups {
                let group = w.queue.pop_front().expect("submitted");
                let (min_version, max_version) = (w.version_at(group.start), w.version_at(group.end));
                w.busy.push((group.start, group.end));
                let samples: Vec<Sample> = (0..N)
                    .map(|i| Sample {
                        key: format!("{}/{i}", group.uid),
                        uid: group.uid.clone(),
                        prompt: vec![1; 8],
                        response: vec![2; 8],
                        response_mask: vec![1; 8],
                        rollout_logprobs: vec![-1.0; 8],
                        score: 1.0,
                        min_version,
                        max_version,
                        submit_step: group.submit_step,
                        dataset_row: group.row,
                        ..Default::default()
                    })
                    .collect();
                response.groups.push(SampledGroup {
                    uid: group.uid.clone(),
                    submit_step: group.submit_step,
                    trajectories: samples
                        .iter()
                        .map(|s| Reward { key: s.key.clone(), uid: s.uid.clone(), ..Default::default() })
                        .collect(),
                    ..Default::default()
                });
                w.sampled.insert(group.uid, samples);
            }
            Ok((response, 0))
        })
    }

    fn fetch<'a>(&'a self, response: &'a SampleResponse) -> BoxFuture<'a, Result<Fetched, TrainerError>> {
        Box::pin(async move {
            let mut w = self.world();
            let mut fetched = Fetched { samples: Vec::new(), rejected: BTreeMap::new() };
            for group in &response.groups {
                let samples = w.sampled.remove(&group.uid).expect("sampled");
                if w.reject_all {
                    fetched.rejected.insert(group.uid.clone(), "payload failed the boundary checks".into());
                } else {
                    fetched.samples.extend(samples);
                }
            }
            Ok(fetched)
        })
    }

    fn reject<'a>(&'a self, uid: &'a str, _reason: &'a str, _step: u64) -> BoxFuture<'a, Result<(), TrainerError>> {
        Box::pin(async move {
            self.call(Call::Reject { uid: uid.into() });
            Ok(())
        })
    }

    fn loader_state(&self) -> LoaderState {
        LoaderState::default()
    }

    fn release(&self, step: u64, request_ids: Vec<String>) {
        self.call(Call::Release { step, requests: request_ids.len() });
    }

    fn rollout_rows(&self, _step: u64, _samples: &[Sample]) -> Vec<serde_json::Value> {
        Vec::new()
    }
}

fn manifest(version: u64) -> WeightManifest {
    WeightManifest { version, step: version, ..Default::default() }
}

fn missed(what: &'static str) -> HandshakeMissed {
    HandshakeMissed { instance: "rollout-0".into(), what, seconds: 5.0, cause: "no responders".into() }
}

impl WeightPlane for Stand {
    fn publish(&self, version: u64, _blob: Bytes) -> BoxFuture<'_, Result<WeightManifest, TrainerError>> {
        Box::pin(async move {
            let mut w = self.world();
            w.call(Call::Publish { version });
            // the engine swaps the new weights in between decode steps
            w.hold(version);
            Ok(manifest(version))
        })
    }

    fn store(&self, version: u64, _blob: Bytes) -> BoxFuture<'_, Result<WeightManifest, TrainerError>> {
        Box::pin(async move {
            self.call(Call::Store { version });
            Ok(manifest(version))
        })
    }

    fn announce(&self, manifest: WeightManifest) -> BoxFuture<'_, Result<WeightManifest, TrainerError>> {
        Box::pin(async move {
            self.call(Call::Announce { version: manifest.version });
            Ok(manifest)
        })
    }

    fn wait_for_workers(&self, version: u64, _exact: bool) -> BoxFuture<'_, Result<SyncReport, TrainerError>> {
        Box::pin(async move {
            self.call(Call::Wait { version });
            Ok(SyncReport { version, loaded: 1, lagging: Vec::new(), silent: Vec::new(), seconds: 0.0 })
        })
    }

    fn pause_colocated(&self, step: u64) -> BoxFuture<'_, Result<PauseResponse, HandshakeMissed>> {
        Box::pin(async move {
            let mut w = self.world();
            if w.deaf {
                return Err(missed("pause"));
            }
            w.call(Call::Pause { step });
            let now = Instant::now();
            w.paused_at = Some(now);
            // the groups the engine had begun are parked with their prefixes
            let parked = w.queue.iter().filter(|g| g.start <= now && now < g.end).count() as u32;
            Ok(PauseResponse { parked_sequences: parked * N as u32, ..Default::default() })
        })
    }

    fn resume_colocated(
        &self,
        step: u64,
        manifest: Option<WeightManifest>,
    ) -> BoxFuture<'_, Result<ResumeResponse, HandshakeMissed>> {
        Box::pin(async move {
            let mut w = self.world();
            if w.deaf {
                return Err(missed("resume"));
            }
            let version = manifest.map_or(step, |m| m.version);
            w.call(Call::Resume { version });
            let now = Instant::now();
            // the engine stood still while paused: what was not finished then finishes that much later, and a
            // parked group continues with the new weights
            if let Some(paused) = w.paused_at.take() {
                let stood = now - paused;
                for g in w.queue.iter_mut().filter(|g| g.end > paused) {
                    if g.start > paused {
                        g.start += stood;
                    }
                    g.end += stood;
                }
                if w.engine_free > paused {
                    w.engine_free += stood;
                }
            }
            w.hold(version);
            Ok(ResumeResponse { version, ..Default::default() })
        })
    }

    fn workers(&self) -> Vec<WorkerView> {
        let w = self.world();
        let version = w.version_at(Instant::now());
        vec![WorkerView { instance: "rollout-0".into(), version, state: WorkerState::Ready, message: String::new() }]
    }

    fn silent_workers(&self) -> Vec<WorkerView> {
        Vec::new()
    }

    fn fleet_idle_seconds(&self) -> (f64, usize) {
        let w = self.world();
        let now = Instant::now();
        let running = w.queue.iter().map(|g| (g.start, g.end));
        let busy: Duration =
            w.busy.iter().copied().chain(running).map(|(s, e)| e.min(now).saturating_duration_since(s)).sum();
        ((now - w.born).saturating_sub(busy).as_secs_f64(), 1)
    }
}

/// An update takes [`TRAIN_PER_TRAJECTORY`] per trajectory; every call is logged in the stand's world.
struct TimedLearner(Stand);

impl Learner for TimedLearner {
    fn train(
        &self,
        samples: Vec<Sample>,
        _response: &SampleResponse,
        step: u64,
        pi_old: OldPolicy,
    ) -> BoxFuture<'_, Result<TrainOutput, TrainerError>> {
        Box::pin(async move {
            self.0.call(Call::Train { step, pi_old, trajectories: samples.len() });
            tokio::time::sleep(TRAIN_PER_TRAJECTORY * samples.len() as u32).await;
            Ok(TrainOutput::default())
        })
    }

    fn snapshot(&self) -> BoxFuture<'_, Result<(), TrainerError>> {
        Box::pin(async move {
            self.0.call(Call::Snapshot);
            Ok(())
        })
    }

    fn weights_blob(&self) -> BoxFuture<'_, Result<Bytes, TrainerError>> {
        Box::pin(async { Ok(crate::paced::dummy_weights()) })
    }

    fn save_checkpoint(&self, _dir: PathBuf) -> BoxFuture<'_, Result<ActorState, TrainerError>> {
        Box::pin(async move {
            self.0.call(Call::Checkpoint);
            Ok(ActorState::default())
        })
    }

    fn finish(&self) -> BoxFuture<'_, Result<(), TrainerError>> {
        Box::pin(async { Ok(()) })
    }
}

/// A job of `batch` groups per step in `mode` (separate_async: two local updates a step), with the overrides given.
fn job(mode: &str, batch: u32, overrides: &[&str]) -> JobConfig {
    let mut all = vec![
        "data.task.name=copy".to_string(),
        format!("trainer.mode={mode}"),
        format!("data.train_batch_size={batch}"),
    ];
    match mode {
        // two local updates of half a batch each
        "separate_async" => all.extend([
            "trainer.separate_async.parameter_sync_step=2".to_string(),
            format!("actor.ppo_mini_batch_size={}", batch / 2),
        ]),
        "colocate_async" => all.push("trainer.colocate_async.rollout_instance=rollout-0".into()),
        _ => {}
    }
    all.extend(overrides.iter().map(ToString::to_string));
    JobConfig::load(None, &all).expect("a valid job")
}

/// A fresh run's schedule over the stand-ins.
fn schedule<'a>(
    cfg: &'a JobConfig,
    learner: &'a TimedLearner,
    data: &'a mut Stand,
    weights: &'a Stand,
    ckpt_root: &'a std::path::Path,
    total_steps: u64,
) -> Schedule<'a> {
    Schedule { cfg, learner, client: data, weights, incarnation: "test", ckpt_root, total_steps, start_step: 0 }
}

/// A run of `steps` steps as the trainer makes it (warm-up, then the steps); each step's metrics and the run's
/// (paused-clock) duration.
async fn run(cfg: &JobConfig, stand: &Stand, steps: u64, ckpt_root: &std::path::Path) -> (Vec<Metrics>, f64) {
    let learner = TimedLearner(stand.clone());
    let (mut data, weights) = (stand.clone(), stand.clone());
    let mut schedule = schedule(cfg, &learner, &mut data, &weights, ckpt_root, steps);
    let started = Instant::now();
    warm_up(&mut schedule).await.expect("warm-up");
    let mut out = Vec::new();
    for s in 1..=steps {
        out.push(step(&mut schedule, s).await.expect("a step"));
    }
    (out, started.elapsed().as_secs_f64())
}

fn metric(m: &Metrics, key: &str) -> f64 {
    *m.get(key).unwrap_or_else(|| panic!("no {key} in {:?}", m.keys().collect::<Vec<_>>()))
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 0.01
}

/// The calls of step `s` (from its submit to the next step's).
fn step_calls(calls: &[Call], s: u64) -> Vec<Call> {
    let start = calls.iter().position(|c| matches!(c, Call::Submit { step, .. } if *step == s)).expect("submitted");
    let end = calls[start + 1..]
        .iter()
        .position(|c| matches!(c, Call::Submit { step, .. } if *step == s + 1))
        .map_or(calls.len(), |i| start + 1 + i);
    calls[start..end].to_vec()
}

#[tokio::test(start_paused = true)]
async fn sync_trains_on_policy_and_publishes_and_waits_before_the_next_batch() {
    let stand = Stand::new();
    let dir = tempfile::tempdir().unwrap();
    let (metrics, wall) = run(&job("sync", 4, &[]), &stand, 3, dir.path()).await;
    let calls = stand.calls();
    for s in 1..=3 {
        assert_eq!(
            step_calls(&calls, s),
            vec![
                Call::Submit { step: s, groups: 4 },
                Call::Sample { step: s, groups: 4 },
                Call::Train { step: s, pi_old: OldPolicy::Current, trajectories: 8 },
                Call::Release { step: s, requests: 1 },
                Call::Publish { version: s },
                Call::Wait { version: s },
            ],
            "step {s}"
        );
    }
    for m in &metrics {
        // generated with the weights of the step before, every token
        assert_eq!(metric(m, "training/off_policy/trajectory_staleness/max"), 0.0);
        assert_eq!(metric(m, "training/off_policy/trajectory_spans/max"), 1.0);
        // 4 s of generation (4 groups, one at a time), then 2 s of update (8 trajectories)
        assert!(close(metric(m, "timing_s/gen"), 4.0), "{m:?}");
        assert!(close(metric(m, "timing_s/step"), 6.0), "{m:?}");
        assert!(close(metric(m, "perf/trainer_idle_ratio"), 4.0 / 6.0), "{m:?}");
        // the engine idles while the trainer updates
        assert!(close(metric(m, "perf/rollout_idle_ratio"), 2.0 / 6.0), "{m:?}");
    }
    assert!(close(wall, 18.0), "{wall}");
}

#[tokio::test(start_paused = true)]
async fn separate_async_overlaps_generation_with_its_local_updates() {
    // the learner is the bottleneck: a batch is generated in 1 s (4 groups of 250 ms) and trained in 2 s
    let gen = Duration::from_millis(250);
    let steps = 8;
    let dir = tempfile::tempdir().unwrap();
    let (_, sync_wall) = run(&job("sync", 4, &[]), &Stand::generating(gen), steps, dir.path()).await;
    assert!(close(sync_wall, 3.0 * steps as f64), "sync: {sync_wall}");

    let stand = Stand::generating(gen);
    let cfg = job("separate_async", 4, &["trainer.separate_async.num_warmup_batches=1"]);
    let (metrics, wall) = run(&cfg, &stand, steps, dir.path()).await;
    let calls = stand.calls();
    // the warm-up batch before step 1
    assert_eq!(calls[0], Call::Submit { step: 1, groups: 4 });
    for s in 1..=steps {
        assert_eq!(
            step_calls(&calls[1..], s),
            vec![
                Call::Submit { step: s, groups: 4 },
                Call::Snapshot,
                Call::Sample { step: s, groups: 2 },
                Call::Train { step: s, pi_old: OldPolicy::Current, trajectories: 4 },
                Call::Sample { step: s, groups: 2 },
                Call::Train { step: s, pi_old: OldPolicy::CycleStart, trajectories: 4 },
                Call::Release { step: s, requests: 2 },
                Call::Publish { version: s },
            ],
            "step {s}: two local updates, one publish, no wait for the fleet"
        );
    }
    for m in &metrics {
        assert_eq!(metric(m, "training/local_updates"), 2.0);
    }
    // after the first step, every batch was generated during the step before, with its weights
    let staleness: Vec<f64> =
        metrics.iter().map(|m| metric(m, "training/off_policy/trajectory_staleness/max")).collect();
    assert_eq!(staleness[0], 0.0);
    assert!(staleness[1..].iter().all(|&s| s == 1.0), "{staleness:?}");
    // and was ready when the trainer asked: it never waited after the first half-batch
    let idle: Vec<f64> = metrics[1..].iter().map(|m| metric(m, "perf/trainer_idle_ratio")).collect();
    assert!(idle.iter().all(|&r| r < 0.01), "the trainer waited: {idle:?}");
    // the overlap bound of these timings: (1 s + 2 s) / max(1 s, 2 s) = 1.5 over sync; the first step pays for
    // its first half-batch (0.5 s)
    let speedup = sync_wall / wall;
    assert!(close(wall, 0.5 + 2.0 * steps as f64), "separate_async: {wall}");
    assert!(speedup > 1.5 * 0.9 && speedup <= 1.5, "speedup {speedup:.3} over sync ({sync_wall:.1} s / {wall:.1} s)");
}

#[tokio::test(start_paused = true)]
async fn colocate_async_pauses_its_worker_to_train_and_resumes_it_with_the_new_weights() {
    let stand = Stand::new();
    let dir = tempfile::tempdir().unwrap();
    let cfg = job("colocate_async", 4, &["trainer.colocate_async.num_warmup_batches=1"]);
    let (metrics, _) = run(&cfg, &stand, 4, dir.path()).await;
    let calls = stand.calls();
    assert_eq!(calls[0], Call::Submit { step: 1, groups: 4 });
    for s in 1..=4 {
        assert_eq!(
            step_calls(&calls[1..], s),
            vec![
                Call::Submit { step: s, groups: 4 },
                Call::Sample { step: s, groups: 4 },
                Call::Pause { step: s },
                Call::Train { step: s, pi_old: OldPolicy::Current, trajectories: 8 },
                Call::Release { step: s, requests: 1 },
                Call::Store { version: s },
                Call::Resume { version: s },
                Call::Announce { version: s },
            ],
            "step {s}: the weights through the local file, the registry last"
        );
    }
    // a group the pause cut in two is finished with the next version: it spans two
    let spans: Vec<f64> = metrics.iter().map(|m| metric(m, "training/off_policy/trajectory_spans/max")).collect();
    assert!(spans.contains(&2.0), "{spans:?}");
    let parked: Vec<f64> = metrics.iter().map(|m| metric(m, "colocate/parked_sequences")).collect();
    assert!(parked.iter().any(|&p| p > 0.0), "{parked:?}");
    assert!(metrics.iter().all(|m| !m.contains_key("colocate/handshake_missed")));
}

#[tokio::test(start_paused = true)]
async fn a_co_located_worker_that_misses_both_handshakes_is_reported_and_training_goes_on() {
    let stand = Stand::new();
    stand.world().deaf = true;
    let dir = tempfile::tempdir().unwrap();
    let cfg = job("colocate_async", 2, &["trainer.colocate_async.num_warmup_batches=1"]);
    let (metrics, _) = run(&cfg, &stand, 2, dir.path()).await;
    for (i, m) in metrics.iter().enumerate() {
        assert_eq!(metric(m, "colocate/handshake_missed"), 2.0, "step {}", i + 1);
    }
    let calls = stand.calls();
    assert_eq!(calls.iter().filter(|c| matches!(c, Call::Train { .. })).count(), 2);
    // the registry still names each version: a worker that returns loads it from there
    assert!(calls.contains(&Call::Announce { version: 2 }));
}

#[tokio::test(start_paused = true)]
async fn a_batch_rejected_whole_skips_the_update_and_the_weights_still_move_on() {
    let stand = Stand::new();
    stand.world().reject_all = true;
    let dir = tempfile::tempdir().unwrap();
    let (metrics, _) = run(&job("sync", 2, &[]), &stand, 1, dir.path()).await;
    let calls = stand.calls();
    assert!(!calls.iter().any(|c| matches!(c, Call::Train { .. })), "{calls:?}");
    assert_eq!(calls.iter().filter(|c| matches!(c, Call::Reject { .. })).count(), 2);
    assert_eq!(metric(&metrics[0], "training/skipped_updates"), 1.0);
    assert_eq!(metric(&metrics[0], "training/rejected_groups"), 2.0);
    assert!(calls.contains(&Call::Publish { version: 1 }) && calls.contains(&Call::Wait { version: 1 }));
}

#[tokio::test(start_paused = true)]
async fn a_due_checkpoint_is_committed_before_the_release_and_the_publish() {
    for mode in ["sync", "colocate_async", "separate_async"] {
        let stand = Stand::new();
        let dir = tempfile::tempdir().unwrap();
        let (metrics, _) = run(&job(mode, 2, &["trainer.save_freq=2"]), &stand, 3, dir.path()).await;
        let calls = stand.calls();
        for s in 1..=3u64 {
            let step = step_calls(&calls, s);
            let at = |want: &dyn Fn(&Call) -> bool| step.iter().position(want);
            let checkpoint = at(&|c| *c == Call::Checkpoint);
            let release = at(&|c| matches!(c, Call::Release { .. })).expect("released");
            let weights = at(&|c| matches!(c, Call::Publish { .. } | Call::Store { .. })).expect("weights out");
            // every second step, and the last
            if s == 2 || s == 3 {
                let checkpoint = checkpoint.unwrap_or_else(|| panic!("{mode}: no checkpoint at step {s}"));
                assert!(checkpoint < release && release < weights, "{mode} step {s}: {step:?}");
                let saved = crate::checkpoint::step_dir(dir.path(), s);
                assert!(saved.join(crate::checkpoint::TRAINER_STATE_FILE).is_file(), "{mode}: {saved:?}");
                assert!(metrics[s as usize - 1].contains_key(&format!("timing_s/{}", Phase::SaveCheckpoint.name())));
            } else {
                assert_eq!(checkpoint, None, "{mode} step {s}");
            }
        }
    }
}

#[tokio::test(start_paused = true)]
async fn the_warm_up_counts_what_an_earlier_trainer_left_in_flight() {
    let stand = Stand::new();
    let cfg = job("separate_async", 4, &["trainer.separate_async.num_warmup_batches=2"]);
    // an earlier incarnation's groups, still queued
    DataPlane::submit_train(&mut stand.clone(), 1, 3).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let learner = TimedLearner(stand.clone());
    let (mut data, weights) = (stand.clone(), stand.clone());
    let mut schedule = schedule(&cfg, &learner, &mut data, &weights, dir.path(), 10);
    warm_up(&mut schedule).await.unwrap();
    assert_eq!(stand.calls(), vec![Call::Submit { step: 1, groups: 3 }, Call::Submit { step: 1, groups: 5 }]);
    // sync submits nothing ahead
    let sync = job("sync", 4, &[]);
    schedule.cfg = &sync;
    warm_up(&mut schedule).await.unwrap();
    assert_eq!(stand.calls().len(), 2);
}
