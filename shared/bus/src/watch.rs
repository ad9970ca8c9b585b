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
