//! Noticing a KV watch that has stalled. A watch is an ordered consumer on the bucket's stream; in a cluster, when
//! the node holding that consumer dies, the watch can go quiet without an error and without being recreated
//! (seen in `tests/tests/nats_cluster.rs`: a rollout worker never loaded the next version and the run stood
//! still). Whoever watches compares, while nothing arrives, the newest revision it was given with the bucket's.

use std::time::Duration;

use async_nats::jetstream::kv;

/// How often a watch that has delivered nothing is compared with its bucket.
pub const WATCH_CHECK: Duration = Duration::from_secs(5);

/// How long the comparison may take; a bucket that cannot be read now is not taken for a stalled watch.
const ASK_TIMEOUT: Duration = Duration::from_secs(2);

/// Whether `kv` holds a revision newer than `seen`: of `key` when given, else of any key (the bucket's last
/// sequence). A watch of that key (or of the whole bucket) that has delivered nothing newer than `seen` is then
/// stalled and should be started again from after `seen`.
pub async fn behind(kv: &kv::Store, key: Option<&str>, seen: u64) -> bool {
    matches!(newest(kv, key).await, Some(newest) if newest > seen)
}

/// The newest revision of `key` in `kv` (None: no such key), or of the whole bucket when `key` is None (its last
/// sequence, which counts deleted and expired entries too: read it before opening a watch, and take what the
/// watch delivers after that as new). None also when the bucket cannot be read within two seconds.
pub async fn newest(kv: &kv::Store, key: Option<&str>) -> Option<u64> {
    let newest = async {
        match key {
            Some(key) => kv.entry(key).await.ok().flatten().map(|entry| entry.revision),
            None => kv.status().await.ok().map(|status| status.info.state.last_sequence),
        }
    };
    tokio::time::timeout(ASK_TIMEOUT, newest).await.ok().flatten()
}

/// How long opening a watch may take before it is tried again.
const OPEN_TIMEOUT: Duration = Duration::from_secs(10);

/// Follows `kv`'s keys under `filter` for ever (spawn it; abort the task to stop): every current entry first, then
/// each change, handed to `each`. The watch is opened again after it ends or fails (a broker hiccup), when it
/// has stalled behind the bucket (checked every [`WATCH_CHECK`] while nothing comes), with a warning that names
/// `what` and a count in the counter `restarts_metric`, and when nothing at all has come for `quiet` (keys that
/// are written all the time, heartbeats: a fresh watch starts from each key's newest value, so a watch that went
/// deaf in a way the bucket's revision does not show is replaced too; counted, logged at debug).
pub async fn follow(
    kv: kv::Store,
    filter: &str,
    what: &'static str,
    restarts_metric: &'static str,
    quiet: Duration,
    mut each: impl FnMut(kv::Entry),
) {
    use futures::StreamExt;
    loop {
        // what the bucket held before the watch opened counts as delivered (expired entries too)
        let mut seen = newest(&kv, None).await.unwrap_or(0);
        let opened = tokio::time::timeout(OPEN_TIMEOUT, kv.watch_with_history(filter)).await;
        let mut entries = match opened {
            Ok(Ok(w)) => w,
            Ok(Err(err)) => {
                tracing::warn!(error = %err, what, "cannot watch; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
            Err(_) => {
                tracing::warn!(what, timeout_s = OPEN_TIMEOUT.as_secs(), "opening the watch got no answer; retrying");
                continue;
            }
        };
        let mut last_entry = std::time::Instant::now();
        // while nothing comes, the bucket is checked for revisions newer than those delivered (a watch whose
        // consumer died with a cluster node stalls without an error)
        let mut check = tokio::time::interval_at((std::time::Instant::now() + WATCH_CHECK).into(), WATCH_CHECK);
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let entry = tokio::select! {
                entry = entries.next() => entry,
                _ = check.tick() => {
                    if behind(&kv, None, seen).await {
                        tracing::warn!(seen, what, "watch stalled behind the bucket; watching again");
                        metrics::counter!(restarts_metric).increment(1);
                        break;
                    }
                    if last_entry.elapsed() >= quiet {
                        tracing::debug!(what, quiet_s = quiet.as_secs_f64(), "nothing watched for a while; watching again");
                        metrics::counter!(restarts_metric).increment(1);
                        break;
                    }
                    continue;
                }
            };
            let Some(Ok(entry)) = entry else { break };
            seen = seen.max(entry.revision);
            last_entry = std::time::Instant::now();
            check.reset();
            each(entry);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
