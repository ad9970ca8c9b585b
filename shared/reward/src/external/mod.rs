//! Out-of-process user reward functions.
//!
//! A user function is a program speaking the JSON-lines protocol of `PROTOCOL.md` on stdin/stdout. Each of
//! `processes` copies is started once and reused; a request line carries up to `batch_size` trajectories.
//! The process runs with an address-space limit (RLIMIT_AS) and, where `unshare -rn` works, in a network
//! namespace of its own. A timeout kills it (whole process group); a crash or kill is followed by a restart
//! with exponential backoff. A batch that ends in a timeout, crash or unreadable answer is retried one
//! trajectory at a time, so the trajectory that causes the fault is the one that carries it.
//!
//! verl users keep their `compute_score` file: `path` + `name` run it under a bundled adapter script.

mod process;
pub mod protocol;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use jetrl_config::CustomRewardFunctionConfig;
use jetrl_telemetry::Delays;
use tokio::sync::{mpsc, Mutex};

use crate::failure::{FailureKind, ScoreFailure};
use crate::input::ScoreInput;
use crate::result::RewardResult;
use process::{BatchAnswer, LaunchSpec, UserFunctionProcess};
use protocol::{Request, RequestItem, PROTOCOL_VERSION};

/// The adapter that runs a verl-style `compute_score(data_source, solution_str, ground_truth, extra_info)`.
const VERL_ADAPTER_SOURCE: &str = include_str!("verl_adapter.py");
/// Consecutive process faults after which a batch stops retrying its items one by one.
const MAX_FAULTS_IN_A_ROW_WHILE_ISOLATING: u32 = 3;
/// Counts process restarts (crash, timeout, unreadable answer, death while idle).
pub const RESTARTS_METRIC: &str = "jetrl_reward_external_restarts_total";

/// Why the user function could not be run or did not answer.
#[derive(Debug, thiserror::Error)]
pub enum ExternalError {
    #[error("reward.custom_reward_function has neither a command nor a path")]
    EmptyCommand,
    #[error("cannot install the verl adapter script: {0}")]
    AdapterInstall(std::io::Error),
    #[error("cannot start {program:?}: {source}")]
    Spawn { program: String, source: std::io::Error },
    #[error("cannot encode the request: {0}")]
    Encode(serde_json::Error),
    #[error("cannot write the request: {0}")]
    Write(std::io::Error),
    #[error("cannot read the answer: {0}")]
    Read(std::io::Error),
    #[error("no answer within {after:?}; the process was killed")]
    Timeout { after: Duration },
    #[error("the process exited ({detail})")]
    Crashed { detail: String },
    #[error("an output line exceeds {limit} bytes")]
    LineTooLong { limit: u64 },
}

impl ExternalError {
    pub fn kind(&self) -> FailureKind {
        match self {
            Self::EmptyCommand | Self::AdapterInstall(_) | Self::Spawn { .. } => FailureKind::SpawnFailed,
            Self::Timeout { .. } => FailureKind::Timeout,
            Self::Crashed { .. } | Self::Write(_) => FailureKind::Crashed,
            Self::Encode(_) | Self::Read(_) | Self::LineTooLong { .. } => FailureKind::BadResponse,
        }
    }

    /// Faults one trajectory of a batch may have caused, worth retrying the batch item by item.
    fn may_be_caused_by_one_item(&self) -> bool {
        matches!(self.kind(), FailureKind::Timeout | FailureKind::Crashed | FailureKind::BadResponse)
    }

    fn to_failure(&self) -> ScoreFailure {
        ScoreFailure::new(self.kind(), self.to_string())
    }
}

/// Scores trajectories with the user function; see the module docs.
pub struct ExternalRunner {
    launch: LaunchSpec,
    timeout: Duration,
    batch_size: usize,
    restart_backoff: Duration,
    max_restart_backoff: Duration,
    /// processes not serving a batch right now; a batch waits here for one
    idle_slots: Mutex<mpsc::Receiver<Slot>>,
    slot_return: mpsc::Sender<Slot>,
    next_request_id: AtomicU64,
    /// keeps the installed adapter script on disk while processes may (re)start
    _adapter_file: Option<tempfile::NamedTempFile>,
}

/// One process position in the pool; the process itself is absent until (re)started.
struct Slot {
    process: Option<UserFunctionProcess>,
    /// drives the restart backoff; reset by any answer
    consecutive_faults: u32,
}

impl ExternalRunner {
    /// Installs the adapter if needed, decides on network isolation, and starts every process.
    pub async fn start(config: &CustomRewardFunctionConfig) -> Result<Self, ExternalError> {
        let (mut argv, adapter_file) = base_argv(config)?;
        if config.no_network {
            if network_namespace_available().await {
                argv.splice(0..0, ["unshare", "--map-root-user", "--net", "--"].map(String::from));
            } else {
                tracing::warn!(
                    "reward.custom_reward_function.no_network: `unshare -rn` is unavailable here; \
                     the reward function runs with network access"
                );
            }
        }
        let launch = LaunchSpec {
            argv,
            address_space_limit: (config.memory_mb > 0).then(|| config.memory_mb.saturating_mul(1 << 20)),
        };
        let processes = config.processes.max(1);
        let (slot_return, idle) = mpsc::channel(processes);
        for _ in 0..processes {
            let process = UserFunctionProcess::spawn(&launch)?;
            // The channel holds exactly `processes` slots, so this never finds it full.
            let _ = slot_return.try_send(Slot { process: Some(process), consecutive_faults: 0 });
        }
        Ok(Self {
            launch,
            timeout: Duration::from_secs_f64(config.timeout_s.max(0.001)),
            batch_size: config.batch_size.max(1),
            restart_backoff: Duration::from_secs_f64(config.restart_backoff_s.max(0.0)),
            max_restart_backoff: Duration::from_secs_f64(config.max_restart_backoff_s.max(0.0)),
            idle_slots: Mutex::new(idle),
            slot_return,
            next_request_id: AtomicU64::new(1),
            _adapter_file: adapter_file,
        })
    }

    /// The argv every process is started with (after any isolation wrapper).
    pub fn argv(&self) -> &[String] {
        &self.launch.argv
    }

    /// One result per input, in order. Never fails as a whole: faults become per-trajectory failures.
    pub async fn score(&self, inputs: &[ScoreInput]) -> Vec<Result<RewardResult, ScoreFailure>> {
        let chunks = inputs.chunks(self.batch_size).map(|chunk| self.score_chunk(chunk));
        futures::future::join_all(chunks).await.into_iter().flatten().collect()
    }

    async fn score_chunk(&self, items: &[ScoreInput]) -> Vec<Result<RewardResult, ScoreFailure>> {
        let Some(mut slot) = self.checkout().await else {
            let failure = ScoreFailure::new(FailureKind::Internal, "the process pool is closed");
            return vec![Err(failure); items.len()];
        };
        match self.run_batch(&mut slot, items).await {
            Ok(Ok(results)) => results,
            Ok(Err(batch_failure)) => vec![Err(batch_failure); items.len()],
            Err(fault) if items.len() > 1 && fault.may_be_caused_by_one_item() => {
                tracing::warn!(items = items.len(), error = %fault, "batch failed; retrying its items one at a time");
                let mut last_fault = fault.to_failure();
                let mut results = Vec::with_capacity(items.len());
                for item in items {
                    // A function that faults on everything (it cannot even start) is not worth one restart per
                    // trajectory: after a few faults in a row the rest of the batch fails with the last one.
                    if slot.consecutive_faults() >= MAX_FAULTS_IN_A_ROW_WHILE_ISOLATING {
                        results.push(Err(last_fault.clone()));
                        continue;
                    }
                    results.push(match self.run_batch(&mut slot, std::slice::from_ref(item)).await {
                        Ok(Ok(mut single)) => single.pop().unwrap_or_else(|| {
                            Err(ScoreFailure::new(FailureKind::BadResponse, "empty results for one item"))
                        }),
                        Ok(Err(failure)) => Err(failure),
                        Err(fault) => {
                            last_fault = fault.to_failure();
                            Err(last_fault.clone())
                        }
                    });
                }
                results
            }
            Err(fault) => vec![Err(fault.to_failure()); items.len()],
        }
    }

    async fn checkout(&self) -> Option<SlotGuard<'_>> {
        let slot = self.idle_slots.lock().await.recv().await?;
        Some(SlotGuard { slot: Some(slot), home: &self.slot_return })
    }

    /// One request/answer on the slot's process, (re)starting it first if needed. On a process fault the
    /// process is killed and dropped; the next use restarts it after the backoff.
    async fn run_batch(&self, guard: &mut SlotGuard<'_>, items: &[ScoreInput]) -> Result<BatchAnswer, ExternalError> {
        let Some(slot) = guard.slot.as_mut() else {
            return Err(ExternalError::Crashed { detail: "slot lost".into() });
        };
        let id = self.next_request_id.fetch_add(1, Ordering::Relaxed);
        let request = Request { protocol: PROTOCOL_VERSION, id, items: items.iter().map(RequestItem::from).collect() };
        let line = serde_json::to_vec(&request).map_err(ExternalError::Encode)?;

        let mut process = self.running_process(slot).await?;
        // The process lives in this local while the exchange runs: if the caller is cancelled mid-exchange it
        // is dropped (and killed), never returned to the pool half-way through an answer.
        match process.exchange(&line, id, items.len(), self.timeout).await {
            Ok(answer) => {
                slot.consecutive_faults = 0;
                slot.process = Some(process);
                Ok(answer)
            }
            Err(fault) => {
                tracing::warn!(error = %fault, "reward function fault; killing the process");
                process.kill();
                slot.consecutive_faults += 1;
                metrics::counter!(RESTARTS_METRIC).increment(1);
                Err(fault)
            }
        }
    }

    async fn running_process(&self, slot: &mut Slot) -> Result<UserFunctionProcess, ExternalError> {
        if let Some(mut process) = slot.process.take() {
            if process.is_running() {
                return Ok(process);
            }
            tracing::warn!("reward function exited while idle; restarting it");
            slot.consecutive_faults += 1;
            metrics::counter!(RESTARTS_METRIC).increment(1);
        }
        if slot.consecutive_faults > 0 {
            tokio::time::sleep(self.backoff(slot.consecutive_faults)).await;
        }
        UserFunctionProcess::spawn(&self.launch).inspect_err(|_| slot.consecutive_faults += 1)
    }

    /// 1×, 2×, 4×… the first restart backoff, capped.
    fn backoff(&self, consecutive_faults: u32) -> Duration {
        Delays::new(self.restart_backoff, self.max_restart_backoff).nth(consecutive_faults)
    }
}

/// Returns its slot to the pool when dropped, including when a scoring future is cancelled.
struct SlotGuard<'a> {
    slot: Option<Slot>,
    home: &'a mpsc::Sender<Slot>,
}

impl SlotGuard<'_> {
    fn consecutive_faults(&self) -> u32 {
        self.slot.as_ref().map_or(u32::MAX, |slot| slot.consecutive_faults)
    }
}

impl Drop for SlotGuard<'_> {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            // Capacity equals the number of slots, so there is always room.
            let _ = self.home.try_send(slot);
        }
    }
}

/// The command from the config, or the bundled adapter around a verl-style `path` + `name`.
fn base_argv(
    config: &CustomRewardFunctionConfig,
) -> Result<(Vec<String>, Option<tempfile::NamedTempFile>), ExternalError> {
    if !config.command.is_empty() {
        return Ok((config.command.clone(), None));
    }
    let path = config.path.as_deref().filter(|p| !p.trim().is_empty()).ok_or(ExternalError::EmptyCommand)?;
    let mut adapter = tempfile::Builder::new()
        .prefix("jetrl-verl-adapter-")
        .suffix(".py")
        .tempfile()
        .map_err(ExternalError::AdapterInstall)?;
    std::io::Write::write_all(&mut adapter, VERL_ADAPTER_SOURCE.as_bytes()).map_err(ExternalError::AdapterInstall)?;
    let kwargs = serde_json::to_string(&config.reward_kwargs).map_err(ExternalError::Encode)?;
    let argv = vec![
        config.python.clone(),
        adapter.path().display().to_string(),
        path.to_string(),
        config.name.clone(),
        kwargs,
    ];
    Ok((argv, Some(adapter)))
}

/// Whether an unprivileged network namespace can be created here (`unshare -rn true` succeeds).
async fn network_namespace_available() -> bool {
    let probe = tokio::process::Command::new("unshare")
        .args(["--map-root-user", "--net", "true"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .status();
    matches!(tokio::time::timeout(Duration::from_secs(5), probe).await, Ok(Ok(status)) if status.success())
}
