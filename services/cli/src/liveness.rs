//! Hung services. A service that has crashed is restarted when its process exits; one that is stopped (SIGSTOP),
//! deadlocked or otherwise alive but doing nothing never exits. Every service writes a heartbeat to the job's
//! WORKERS bucket every `rollout.heartbeat_interval_s`, with its process id: `jetrl run` follows them, and a
//! service it started that has sent none for `run.supervisor.hang_after_s` while NATS was reachable the whole
//! time is hung. The caller kills it, and the supervisor restarts it like any service that died.
//!
//! A service is judged only after its first heartbeat (a long model load is not a hang), and not while the
//! broker is unreachable or has been reachable for less than the window (no one's heartbeat gets through then).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use async_nats::jetstream::kv;
use jetrl_bus::{watch, Bus};
use jetrl_wire::v1::{Heartbeat, WorkerState};
use jetrl_wire::Message;

/// A service found hung.
#[derive(Debug, Clone, PartialEq)]
pub struct Hung {
    pub service: String,
    pub pid: u32,
    /// since its last heartbeat
    pub silent: Duration,
}

/// The newest heartbeat of every process, by process id, as `jetrl run` received it.
pub struct Liveness {
    beats: Arc<Mutex<HashMap<u32, Instant>>>,
    hang_after: Duration,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Liveness {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Liveness {
    /// Follows the job's heartbeats; None when `hang_after` is zero (hangs are not looked for).
    pub async fn watch(bus: &Bus, hang_after: Duration) -> anyhow::Result<Option<Self>> {
        if hang_after.is_zero() {
            return Ok(None);
        }
        let kv = bus.key_value(bus.names().workers_bucket()).await?;
        let beats: Arc<Mutex<HashMap<u32, Instant>>> = Arc::default();
        let seen = beats.clone();
        let quiet = hang_after / 4;
        let task =
            tokio::spawn(watch::follow(kv, ">", "heartbeats", "jetrl_run_heartbeat_watch_restarts_total", quiet, {
                move |entry: kv::Entry| {
                    if entry.operation != kv::Operation::Put {
                        return;
                    }
                    // another job's or a garbage heartbeat: the services count those; here it is only not a beat
                    let Ok(beat) = Heartbeat::decode(entry.value.as_ref()) else { return };
                    let mut beats = seen.lock().unwrap_or_else(PoisonError::into_inner);
                    if beat.state == WorkerState::Stopped as i32 {
                        beats.remove(&beat.pid);
                    } else {
                        beats.insert(beat.pid, Instant::now());
                    }
                }
            }));
        Ok(Some(Self { beats, hang_after, task }))
    }

    /// The services of `running` (name, pid) that are hung at `now`; `broker_up_since` is when NATS last became
    /// reachable (None: unreachable now). A service reported is forgotten, so it is reported once.
    pub fn hung(&self, running: &[(String, u32)], broker_up_since: Option<Instant>, now: Instant) -> Vec<Hung> {
        let mut beats = self.beats.lock().unwrap_or_else(PoisonError::into_inner);
        let found = find_hung(&beats, running, self.hang_after, broker_up_since, now);
        for hung in &found {
            beats.remove(&hung.pid);
        }
        found
    }
}

/// Which of `running` have sent no heartbeat (last one in `beats`) for `hang_after`, while the broker has been
/// reachable since before that.
fn find_hung(
    beats: &HashMap<u32, Instant>,
    running: &[(String, u32)],
    hang_after: Duration,
    broker_up_since: Option<Instant>,
    now: Instant,
) -> Vec<Hung> {
    let Some(up_since) = broker_up_since else { return Vec::new() };
    if now.saturating_duration_since(up_since) < hang_after {
        return Vec::new();
    }
    running
        .iter()
        .filter_map(|(service, pid)| {
            let silent = now.saturating_duration_since(*beats.get(pid)?);
            (silent >= hang_after).then(|| Hung { service: service.clone(), pid: *pid, silent })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn a_running_service_silent_past_the_window_is_hung_and_the_others_are_not() {
        let now = Instant::now() + secs(1000);
        let beats = HashMap::from([(1, now - secs(130)), (2, now - secs(5)), (4, now - secs(121))]);
        let running = [("reward-0".to_string(), 1), ("rollout-0".to_string(), 2), ("trainer".to_string(), 3)];
        let hung = find_hung(&beats, &running, secs(120), Some(now - secs(500)), now);
        // 2 beats, 3 never sent one (still starting), 4 is not a service this job runs now
        assert_eq!(hung, [Hung { service: "reward-0".into(), pid: 1, silent: secs(130) }]);
    }

    #[test]
    fn nobody_is_hung_while_the_broker_is_down_or_back_for_less_than_the_window() {
        let now = Instant::now() + secs(1000);
        let beats = HashMap::from([(1, now - secs(300))]);
        let running = [("reward-0".to_string(), 1)];
        assert!(find_hung(&beats, &running, secs(120), None, now).is_empty());
        assert!(find_hung(&beats, &running, secs(120), Some(now - secs(60)), now).is_empty());
        assert_eq!(find_hung(&beats, &running, secs(120), Some(now - secs(120)), now).len(), 1);
    }
}
