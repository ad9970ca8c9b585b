//! Weights & Biases (`trainer.logger` `wandb`) through the `wandb` Python package: the trainer starts
//! `python/wandb_bridge.py` (built into the binary) with `JETRL_PYTHON`, else `python3` from `PATH` (`./dev.sh`
//! and `just` put the repository's `.venv/bin` first), and writes it one JSON line per step. wandb reads its
//! own environment (`WANDB_MODE=offline`, `WANDB_DIR`, `WANDB_API_KEY`, `WANDB_ENTITY`, ...).
//!
//! project: `trainer.project_name`; run name: `trainer.experiment_name`, else `run.name`; config: the resolved
//! job config, secrets redacted. The wandb run id is kept in `<run.dir>/wandb_run_id`: a resumed trainer
//! continues the same wandb run (`resume="allow"`; wandb ignores steps below its last one). A step that validated
//! logs its `log_val_generations` generations as verl does: a `wandb.Table` under `val/generations`, one row per
//! validation (`step`, then `input_i`, `output_i`, `score_i` of each generation), every earlier row kept. At the
//! end the reward curve and `summary.json` are saved with the run.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use jetrl_config::JobConfig;
use rand::Rng;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};

use super::{Failure, Finish, RunEnd, Step, Tracker};

/// The bridge script, run with `python -c`.
const BRIDGE: &str = include_str!("../../python/wandb_bridge.py");
/// how long `wandb.init` may take (it reaches the wandb servers unless offline)
const INIT_TIMEOUT: Duration = Duration::from_secs(120);
/// where a run directory keeps the wandb run id it reports to
pub(crate) const ID_FILE: &str = "wandb_run_id";

/// The Python that runs the bridge: `JETRL_PYTHON`, else `python3`.
pub(crate) fn python() -> String {
    std::env::var("JETRL_PYTHON").ok().filter(|p| !p.is_empty()).unwrap_or_else(|| "python3".into())
}

pub(crate) struct Wandb {
    python: String,
    /// the bridge's init line
    init: Value,
    child: Option<Child>,
    stdin: Option<ChildStdin>,
}

impl Wandb {
    pub fn new(cfg: &JobConfig, run_dir: &Path, resume: bool) -> Self {
        let id_file = run_dir.join(ID_FILE);
        let saved = resume.then(|| std::fs::read_to_string(&id_file).ok()).flatten();
        let saved = saved.map(|s| s.trim().to_string()).filter(|s| !s.is_empty());
        let id = saved.clone().unwrap_or_else(new_run_id);
        if saved.is_none() {
            if let Err(err) = std::fs::write(&id_file, &id) {
                tracing::warn!(tracker = "wandb", error = %err, path = %id_file.display(), "wandb run id not kept: a resumed trainer will start a new wandb run");
            }
        }
        let init = json!({ "init": {
            "project": cfg.trainer.project_name,
            "name": super::experiment_name(cfg),
            "id": id,
            "resume": saved.is_some().then_some("allow"),
            "config": super::redacted_config(cfg),
        }});
        Self { python: python(), init, child: None, stdin: None }
    }

    async fn write(&mut self, line: &Value) -> Result<(), Failure> {
        let Some(stdin) = self.stdin.as_mut() else {
            return Err(Failure::Disabled("the wandb bridge is not running".into()));
        };
        let mut text = line.to_string();
        text.push('\n');
        if let Err(err) = stdin.write_all(text.as_bytes()).await {
            return Err(Failure::Disabled(format!("the wandb bridge stopped reading ({err}){}", self.exit_status())));
        }
        Ok(())
    }

    /// `; it exited with <status>` once the bridge has exited.
    fn exit_status(&mut self) -> String {
        match self.child.as_mut().map(Child::try_wait) {
            Some(Ok(Some(status))) => format!("; it exited with {status} (its messages are in this log above)"),
            _ => String::new(),
        }
    }
}

/// A new wandb run id: 8 characters of `[a-z0-9]`, as wandb makes them.
fn new_run_id() -> String {
    const CHARS: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::thread_rng();
    (0..8).map(|_| CHARS[rng.gen_range(0..CHARS.len())] as char).collect()
}

impl Tracker for Wandb {
    async fn start(&mut self) -> Result<(), Failure> {
        let mut child = Command::new(&self.python)
            .arg("-u")
            .arg("-c")
            .arg(BRIDGE)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|err| {
                Failure::Disabled(format!(
                    "cannot start the wandb bridge with Python {:?} ({err}): set JETRL_PYTHON to a Python with the \
                     wandb package",
                    self.python
                ))
            })?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(Failure::Disabled("the wandb bridge has no stdin or stdout".into()));
        };
        self.child = Some(child);
        self.stdin = Some(stdin);
        let init = self.init.clone();
        self.write(&init).await?;
        let mut lines = BufReader::new(stdout).lines();
        let answer = match tokio::time::timeout(INIT_TIMEOUT, lines.next_line()).await {
            Ok(Ok(Some(line))) => serde_json::from_str::<Value>(&line).unwrap_or(json!({ "error": line })),
            Ok(_) => {
                let status = self.exit_status();
                return Err(Failure::Disabled(format!("the wandb bridge ended before wandb.init answered{status}")));
            }
            Err(_) => {
                if let Some(child) = self.child.as_mut() {
                    let _ = child.start_kill();
                }
                return Err(Failure::Disabled(format!("wandb.init did not answer within {INIT_TIMEOUT:?}")));
            }
        };
        if let Some(error) = answer["error"].as_str() {
            return Err(Failure::Disabled(format!("wandb: {error}")));
        }
        tracing::info!(tracker = "wandb", id = %answer["id"], url = %answer["url"], python = self.python, "wandb run started");
        Ok(())
    }

    async fn send(&mut self, pending: &mut VecDeque<Step>) -> Result<(), Failure> {
        while let Some(step) = pending.front() {
            let mut line = json!({ "step": step.step, "metrics": *step.metrics });
            if let Some(generations) = &step.generations {
                line["generations"] =
                    json!(generations.iter().map(|g| json!([g.input, g.output, g.score])).collect::<Vec<_>>());
            }
            self.write(&line).await?;
            pending.pop_front();
        }
        if let Some(stdin) = self.stdin.as_mut() {
            let _ = stdin.flush().await;
        }
        Ok(())
    }

    async fn finish(&mut self, finish: &Finish) -> Result<(), Failure> {
        let files: Vec<String> = finish.files.iter().map(|p: &PathBuf| p.display().to_string()).collect();
        let exit_code = if finish.end == RunEnd::Finished { 0 } else { 1 };
        self.write(&json!({ "finish": { "exit_code": exit_code, "files": files } })).await?;
        // closing stdin ends the bridge's loop; wandb.finish then syncs (bounded by the trainer's finishing wait;
        // a bridge still syncing after it goes on by itself)
        self.stdin = None;
        if let Some(child) = self.child.as_mut() {
            match child.wait().await {
                Ok(status) if status.success() => {}
                Ok(status) => return Err(Failure::Permanent(format!("the wandb bridge exited with {status}"))),
                Err(err) => return Err(Failure::Permanent(format!("waiting for the wandb bridge: {err}"))),
            }
        }
        Ok(())
    }
}
