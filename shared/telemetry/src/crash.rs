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

use std::path::Path;

/// Kills this process if `JETRL_CRASH_AT` names `point` (and `step` reached its step) and it has not crashed
/// there before.
pub fn crash_point(point: &str, step: u64) {
    let Ok(spec) = std::env::var("JETRL_CRASH_AT") else { return };
    let (name, at) = match spec.split_once('@') {
        Some((name, at)) => (name, at.parse::<u64>().unwrap_or(0)),
        None => (spec.as_str(), 0),
    };
    if name != point || step < at {
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
