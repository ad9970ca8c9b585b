//! The trainer as a group of ranks (docs/scale-out.md): `trainer.n_gpus_per_node × trainer.nnodes` processes in one c10d
//! process group, one per device. Rank 0 leads: it holds the job's lease, talks to the replay buffer and the
//! rollout workers, and tells the other ranks what to do next through the group's store (rank 0 hosts it); ranks
//! 1..N follow ([`follow`]). Every rank holds the whole model, its shard of the optimizer state and a share of each
//! batch's rows, which it fetches itself from the data plane: payload bytes never pass through rank 0.
//!
//! The commands are numbered: rank 0 writes `cmd/<n>`, every follower waits for it, then all ranks run it together
//! (its collectives keep them in step). A follower waits for the next command in short polls, so a stop reaches it
//! within a second however long rank 0 waits for rollouts; a rank 0 that is gone takes its store with it, and the
//! follower's next poll fails. A follower that dies makes rank 0's next collective fail: the group stops and is
//! restarted together (by `jetrl run`, systemd or compose), from the last checkpoint.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use jetrl_bus::Bus;
use jetrl_config::JobConfig;
use jetrl_torch_ext::{Backend, DistError, ProcessGroup, ProcessGroupOptions};
use jetrl_wire::v1;
use jetrl_wire::Message;

use crate::actor::{Actor, OldPolicy};
use crate::batch::{RankBatch, RowInfo, Sample, SampleLimits};
use crate::command::{Command, PiOld};
use crate::dist::Comm;
use crate::error::{ActorError, TrainerError};

/// How long a follower's wait for the next command lasts before it looks at its stop flag again.
const COMMAND_POLL: Duration = Duration::from_secs(1);

/// Where this process stands among the trainer's ranks, from the job's `trainer.*` keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankPlan {
    pub rank: usize,
    pub world: usize,
    /// the rank's device index on its node (`rank % n_gpus_per_node`)
    pub local_rank: usize,
}

impl RankPlan {
    pub fn of(cfg: &JobConfig) -> Self {
        let per_node = cfg.trainer.n_gpus_per_node.max(1) as usize;
        let world = per_node * cfg.trainer.nnodes.max(1) as usize;
        let rank = cfg.trainer.dist.rank as usize;
        Self { rank, world, local_rank: rank % per_node }
    }

    pub fn is_leader(&self) -> bool {
        self.rank == 0
    }
}

/// Puts a rank on its own GPU (`cuda:<local rank>`) when the model runs on CUDA and there are several ranks.
pub fn place_on_device(cfg: &mut JobConfig) {
    let plan = RankPlan::of(cfg);
    if plan.world > 1
        && matches!(cfg.model.device, jetrl_config::DeviceSpec::Auto | jetrl_config::DeviceSpec::Cuda(_))
        && tch::Cuda::is_available()
    {
        cfg.model.device = jetrl_config::DeviceSpec::Cuda(plan.local_rank);
    }
}

/// Joins the trainer's process group (rank 0 hosts its store); blocks until every rank has joined or the
/// rendezvous times out (`trainer.dist.timeout_s`). With one rank there is no group.
pub fn join(cfg: &JobConfig, plan: &RankPlan) -> Result<Comm, DistError> {
    if plan.world == 1 {
        return Ok(Comm::Solo);
    }
    let device = jetrl_model::resolve_device(cfg.model.device).unwrap_or(tch::Device::Cpu);
    let backend = match device {
        tch::Device::Cuda(_) => Backend::Nccl,
        _ => Backend::Gloo,
    };
    let dist = &cfg.trainer.dist;
    if dist.master_port == 0 {
        return Err(DistError::InvalidOptions(format!(
            "trainer.dist.master_port is 0, but {} trainer ranks must meet at a known port of {} (jetrl run picks one; \
             set it when the ranks are started otherwise)",
            plan.world, dist.master_addr
        )));
    }
    let mut opts = ProcessGroupOptions::new(backend, plan.rank, plan.world, &dist.master_addr, dist.master_port)
        .with_timeout(Duration::from_secs_f64(dist.timeout_s));
    if let tch::Device::Cuda(index) = device {
        opts = opts.with_cuda_device(index);
    }
    tracing::info!(
        rank = plan.rank,
        world = plan.world,
        store = %opts.store_addr(),
        backend = ?backend,
        "joining the trainer's process group"
    );
    let group = ProcessGroup::new(opts)?;
    tracing::info!(rank = plan.rank, world = plan.world, "trainer process group formed");
    Ok(Comm::group(group))
}

impl From<OldPolicy> for PiOld {
    fn from(p: OldPolicy) -> Self {
        match p {
            OldPolicy::Current => Self::Current,
            OldPolicy::CycleStart => Self::CycleStart,
        }
    }
}

impl From<PiOld> for OldPolicy {
    fn from(p: PiOld) -> Self {
        match p {
            PiOld::Current => Self::Current,
            PiOld::CycleStart => Self::CycleStart,
        }
    }
}

/// Splits a batch among the ranks by whole prompt groups, balanced by tokens (verl's `balance_batch`): groups in
/// order of size, each to the rank with the fewest tokens so far. Returns each row's rank.
pub fn balance(samples: &[Sample], world: usize) -> Vec<usize> {
    let groups = crate::batch::groups_of(samples);
    let tokens = |g: &Vec<usize>| g.iter().map(|&i| samples[i].prompt.len() + samples[i].response.len()).sum::<usize>();
    let mut order: Vec<usize> = (0..groups.len()).collect();
    order.sort_by_key(|&g| std::cmp::Reverse(tokens(&groups[g])));
    let mut load = vec![0usize; world.max(1)];
    let mut owner = vec![0usize; samples.len()];
    for g in order {
        let rank = (0..load.len()).min_by_key(|&r| (load[r], r)).unwrap_or(0);
        load[rank] += tokens(&groups[g]);
        for &i in &groups[g] {
            owner[i] = rank;
        }
    }
    owner
}

/// Rank 0's share of `samples`, and the command that gives every follower its share (their reward records, found
/// by trajectory key in `rewards`).
pub fn split_batch(
    samples: Vec<Sample>,
    world: usize,
    rewards: &BTreeMap<String, v1::Reward>,
    step: u64,
    pi_old: OldPolicy,
) -> Result<(RankBatch, Command), ActorError> {
    let owner = balance(&samples, world);
    let rows: Vec<RowInfo> = samples.iter().map(RowInfo::of).collect();
    let mut shares: BTreeMap<usize, Vec<(usize, Vec<u8>)>> = BTreeMap::new();
    let mut local = BTreeMap::new();
    for (i, sample) in samples.into_iter().enumerate() {
        if owner[i] == 0 {
            local.insert(i, sample);
        } else {
            let reward = rewards
                .get(&sample.key)
                .ok_or_else(|| ActorError::Batch(format!("no reward record for trajectory {}", sample.key)))?;
            shares.entry(owner[i]).or_default().push((i, reward.encode_to_vec()));
        }
    }
    let command = Command::Train { step, pi_old: pi_old.into(), rows: rows.clone(), shares };
    Ok((RankBatch { rows, local }, command))
}

/// A follower's loop: joins the group, builds its actor when rank 0 says so, and runs every command until rank 0
/// says stop (or `stop` is set, or the group fails). Runs on a thread of its own (libtorch and the group's calls
/// block); payloads are fetched on the runtime behind `runtime`.
pub fn follow(
    cfg: &JobConfig,
    comm: Comm,
    bus: &Bus,
    limits: SampleLimits,
    runtime: &tokio::runtime::Handle,
    stop: &AtomicBool,
) -> Result<(), TrainerError> {
    let rank = comm.rank();
    let mut actor: Option<Actor> = None;
    let mut next = 1u64;
    loop {
        let command = match wait_command(&comm, next, stop)? {
            Some(command) => command,
            None => return Err(TrainerError::Shutdown),
        };
        next += 1;
        match command {
            Command::Init { horizon, resume, pad_id } => {
                let resume_ref = resume.as_ref().map(|(dir, state)| (dir.as_path(), state));
                let mut built = Actor::new(cfg, horizon, resume_ref, comm.clone())?;
                built.set_pad_id(pad_id);
                tracing::info!(rank, horizon, resumed = resume.is_some(), "actor ready");
                actor = Some(built);
            }
            Command::Train { step, pi_old, rows, shares } => {
                let actor = actor.as_mut().ok_or_else(|| not_initialised(rank))?;
                let mine = shares.get(&rank).cloned().unwrap_or_default();
                let local = runtime.block_on(fetch_share(bus, &mine, limits))?;
                let batch = RankBatch { rows, local };
                // fault injection (inert unless JETRL_CRASH_AT names it): a follower dies in the middle of a step
                jetrl_telemetry::crash::crash_point("trainer.follower_train", step);
                let started = Instant::now();
                actor.train(&batch, step, pi_old.into())?;
                tracing::debug!(
                    rank,
                    step,
                    rows = batch.local.len(),
                    seconds = started.elapsed().as_secs_f64(),
                    "trained"
                );
            }
            Command::Snapshot => actor.as_mut().ok_or_else(|| not_initialised(rank))?.snapshot()?,
            Command::SaveCheckpoint { dir } => {
                actor.as_ref().ok_or_else(|| not_initialised(rank))?.save_checkpoint(&dir)?;
                comm.barrier().map_err(ActorError::from)?;
            }
            Command::Stop => {
                tracing::info!(rank, "rank 0 ended training");
                return Ok(());
            }
        }
    }
}

fn not_initialised(rank: usize) -> TrainerError {
    TrainerError::Actor(ActorError::Batch(format!("rank {rank}: a command came before the actor was built")))
}

/// The command numbered `n`, polling so that `stop` is seen within [`COMMAND_POLL`]; `None` once stopped.
fn wait_command(comm: &Comm, n: u64, stop: &AtomicBool) -> Result<Option<Command>, TrainerError> {
    let key = format!("cmd/{n}");
    loop {
        if stop.load(Ordering::SeqCst) {
            return Ok(None);
        }
        if let Some(bytes) = comm.store_get(&key, COMMAND_POLL).map_err(ActorError::from)? {
            let command = serde_json::from_slice(&bytes)
                .map_err(|source| ActorError::RankMessage { what: format!("command {n} from rank 0"), source })?;
            return Ok(Some(command));
        }
    }
}

/// A follower's rows: the payloads of its reward records, fetched from the TRAJ stream and checked at the
/// boundary as rank 0 checks them. Rank 0 has already fetched and checked the same payloads, so any failure here
/// (a payload gone) is the group's failure, not a rejected group.
async fn fetch_share(
    bus: &Bus,
    share: &[(usize, Vec<u8>)],
    limits: SampleLimits,
) -> Result<BTreeMap<usize, Sample>, TrainerError> {
    let mut rewards = Vec::with_capacity(share.len());
    for (row, bytes) in share {
        let reward = v1::Reward::decode(bytes.as_slice())
            .map_err(|e| ActorError::Batch(format!("row {row}: reward record does not decode: {e}")))?;
        rewards.push((*row, reward));
    }
    let records: Vec<&v1::Reward> = rewards.iter().map(|(_, r)| r).collect();
    let fetched = crate::rollout_client::fetch_payloads(bus, &records, limits).await?;
    if let Some((uid, reason)) = fetched.rejected.iter().next() {
        return Err(TrainerError::Actor(ActorError::Batch(format!("group {uid} could not be fetched: {reason}"))));
    }
    let by_key: BTreeMap<String, Sample> = fetched.samples.into_iter().map(|s| (s.key.clone(), s)).collect();
    let mut out = BTreeMap::new();
    for (row, reward) in rewards {
        let sample = by_key
            .get(&reward.key)
            .cloned()
            .ok_or_else(|| ActorError::Batch(format!("trajectory {} was not fetched", reward.key)))?;
        out.insert(row, sample);
    }
    Ok(out)
}

/// A follower process (`trainer.dist.rank` ≥ 1): connects to NATS (to fetch its payloads), joins the group and
/// follows rank 0 until training ends or `shutdown` resolves.
pub async fn run_follower(cfg: JobConfig, shutdown: jetrl_telemetry::Shutdown) -> Result<(), TrainerError> {
    let plan = RankPlan::of(&cfg);
    let bus = Bus::connect_job(&cfg, &format!("jetrl-trainer-rank-{}", plan.rank)).await?;
    // `jetrl status` lists the ranks; `jetrl run` judges a follower hung by its heartbeat as any service
    let instance = format!("rank-{}", plan.rank);
    let heartbeat =
        jetrl_bus::heartbeat::start(&bus, &cfg, jetrl_bus::heartbeat::TRAINER, Some(&instance), shutdown.clone());
    let model_dir = PathBuf::from(&cfg.model.path);
    let model_config = jetrl_model::ModelConfig::from_file(&model_dir.join("config.json"))
        .map_err(|source| TrainerError::ModelConfig { path: model_dir.join("config.json"), source })?;
    let limits = SampleLimits {
        vocab_size: model_config.vocab_size.max(0) as u64,
        max_len: model_config.max_position_embeddings.max(1) as usize,
    };
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = {
        let stop = stop.clone();
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            shutdown.wait().await;
            stop.store(true, Ordering::SeqCst);
        })
    };
    let runtime = tokio::runtime::Handle::current();
    let result = tokio::task::spawn_blocking(move || -> Result<(), TrainerError> {
        let comm = join(&cfg, &plan).map_err(ActorError::from)?;
        follow(&cfg, comm, &bus, limits, &runtime, &stop)
    })
    .await
    .map_err(|_| TrainerError::Actor(ActorError::Stopped))?;
    watcher.abort();
    heartbeat.stop().await;
    result
}
