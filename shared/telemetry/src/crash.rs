//! Fault injection for the crash matrix: a process dies by SIGKILL at a named point of its work, once.
//!
//! Inert unless `JETRL_CRASH_AT=<point>[@<step>]` is set (with `JETRL_CRASH_MARKER=<file>`): the first time the
//! process reaches `<point>` (at step `<step>` when given, or later) and the marker file does not exist yet, it
//! creates the marker and kills itself with SIGKILL — nothing settled, nothing flushed, as `kill -9` at that
//! moment would. A restarted process finds the marker and goes on. Tests reach each crash point
//! deterministically this way instead of sleeping and hoping.
//!
//! Points: `trainer.before_submit`, `trainer.after_submit`, `trainer.mid_update`,
//! `trainer.between_checkpoint_and_publish`, `rollout.mid_group`, `reward.mid_batch`, `buffer.mid_sample`,
//! `checkpoint.mid_announce`.
//!
//! A second kind, [`missed_input`], makes a process miss one input as a consumer lost with a cluster node can
//! (the replay buffer's stall in the three-node cluster test), or have one write refused: inert unless
//! `JETRL_MISS_AT=<point>[@<n>]` is set; the `<n>`-th time (1 when not given) the process reaches `<point>` it is
//! told to ignore what it just read, or to take the write as refused, once. Points: `buffer.reward` (a REWARDS
//! message), `buffer.terminal_record` (a group record that ends the group), `buffer.mark_sampled` (marking one
//! group of a batch sampled).

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// Kills this process if `JETRL_CRASH_AT` names `point` (and `step` reached its step) and it has not crashed
/// there before.
pub fn crash_point(point: &str, step: u64) {
    let Some((name, at)) = spec("JETRL_CRASH_AT") else { return };
    if name != point || step < at.unwrap_or(0) {
        return;
    }
    let Ok(marker) = std::env::var("JETRL_CRASH_MARKER") else { return };
    let marker = Path::new(&marker);
    if marker.exists() {
        return;
    }
    if std::fs::write(marker, format!("{point}@{step} pid {}\n", std::process::id())).is_err() {
        return;
    }
    tracing::error!(point, step, "crash point reached: killing this process (JETRL_CRASH_AT)");
    // SAFETY: kill(2) on our own pid with SIGKILL: the process ends here, as `kill -9` would end it.
    #[allow(unsafe_code)]
    unsafe {
        libc::kill(libc::getpid(), libc::SIGKILL);
    }
}

/// Times [`missed_input`]'s point has been reached in this process.
static MISS_COUNT: AtomicU64 = AtomicU64::new(0);

/// Whether the input just read at `point` is to be ignored: true once, the `<n>`-th time `point` is reached, when
/// `JETRL_MISS_AT` names it (see the module's note); false otherwise, always when the variable is not set.
pub fn missed_input(point: &str) -> bool {
    // read once: this is asked for every message of a busy input
    static SPEC: OnceLock<Option<(String, u64)>> = OnceLock::new();
    let spec = SPEC.get_or_init(|| spec("JETRL_MISS_AT").map(|(name, n)| (name, n.unwrap_or(1).max(1))));
    let Some((name, nth)) = spec else { return false };
    if name != point || MISS_COUNT.fetch_add(1, Ordering::Relaxed) + 1 != *nth {
        return false;
    }
    tracing::warn!(point, nth, "ignoring this input as if it had not been delivered (JETRL_MISS_AT)");
    true
}

/// `<point>[@<number>]` from the environment variable `var`: the point, and the number when one is given and reads.
fn spec(var: &str) -> Option<(String, Option<u64>)> {
    let spec = std::env::var(var).ok()?;
    Some(match spec.split_once('@') {
        Some((name, n)) => (name.to_string(), n.parse().ok()),
        None => (spec, None),
    })
}
