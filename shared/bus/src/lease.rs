//! One holder per job of a role (the trainer): a key in the job's LEASE bucket.
//!
//! The key is created with `create`, which fails while it exists; its holder refreshes it every fifth of the
//! bucket's max age, so it disappears by max age when the holder dies, and the holder deletes it when it exits
//! cleanly. A newcomer that finds the key waits: a holder that died leaves it to expire within the max age and the
//! newcomer takes it then (a trainer restarted after a crash is not refused for ever); a holder that is alive
//! refreshes it, which the newcomer sees as a new revision, and the newcomer gives up with
//! [`BusError::LeaseHeld`] naming the job, the holder and since when it holds the lease.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::kv;
use bytes::Bytes;
use tokio::sync::watch;

use crate::topology::LEASE_TTL;
use crate::{Bus, BusError, Cause};

/// A held lease: refreshed in the background until [`Lease::release`]. Dropped without a release (the holder
/// fails), it stops being refreshed and expires by the bucket's max age.
pub struct Lease {
    kv: kv::Store,
    key: String,
    job: String,
    /// what this holder wrote (who and since when): tells its own entry from another holder's
    value: Bytes,
    /// revision of this holder's entry, as last written by the refresher
    revision: Arc<AtomicU64>,
    /// `Some(why)` once the lease is lost to another holder
    lost: watch::Receiver<Option<String>>,
    refresher: tokio::task::JoinHandle<()>,
}

/// Who holds a lease, as stored in its value.
struct Holder {
    holder: String,
    since_unix_ms: i64,
}

impl Holder {
    fn this_process(key: &str) -> Self {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .ok()
            .filter(|h| !h.is_empty())
            .or_else(|| std::env::var("HOSTNAME").ok())
            .unwrap_or_else(|| "an unknown host".into());
        Self { holder: format!("{key} pid {} on {host}", std::process::id()), since_unix_ms: jetrl_wire::now_unix_ms() }
    }

    fn encode(&self) -> Bytes {
        serde_json::json!({ "holder": self.holder, "since_unix_ms": self.since_unix_ms }).to_string().into()
    }

    fn decode(value: &[u8]) -> Self {
        let parsed: Option<serde_json::Value> = serde_json::from_slice(value).ok();
        let field = |name: &str| parsed.as_ref().and_then(|v| v.get(name).cloned());
        Self {
            holder: field("holder")
                .and_then(|h| h.as_str().map(str::to_string))
                .unwrap_or_else(|| format!("an unreadable holder ({} bytes)", value.len())),
            since_unix_ms: field("since_unix_ms").and_then(|s| s.as_i64()).unwrap_or(0),
        }
    }

    /// `2025-01-31T12:00:00Z (42 s ago)`.
    fn since(&self) -> String {
        let ago = (jetrl_wire::now_unix_ms() - self.since_unix_ms).max(0) / 1000;
        format!("{} ({ago} s ago)", utc(self.since_unix_ms))
    }
}

impl Lease {
    /// Takes lease `key` of the bus's job, waiting for a dead holder's entry to expire (at most the bucket's max
    /// age and a half). Fails with [`BusError::LeaseHeld`] as soon as the holder shows it is alive by refreshing
    /// it, or when the wait is over.
    pub async fn acquire(bus: &Bus, key: &str) -> Result<Self, BusError> {
        let bucket = bus.names().lease_bucket();
        let job = bus.names().namespace().to_string();
        let kv = bus.key_value(bucket).await?;
        let kv_err = |cause: Cause| BusError::Kv { bucket: bucket.into(), key: key.into(), cause };
        let ttl = match kv.status().await.map(|s| s.max_age()) {
            Ok(age) if !age.is_zero() => age,
            // no max age: an entry never expires, so waiting is bounded by the default instead
            Ok(_) => LEASE_TTL,
            Err(err) => return Err(kv_err(Cause::of(err))),
        };
        let value = Holder::this_process(key).encode();
        let poll = (ttl / 10).clamp(Duration::from_millis(50), Duration::from_millis(500));
        let deadline = Instant::now() + ttl + ttl / 2;
        // the other holder's revision when first seen: a newer one proves it alive
        let mut first_seen: Option<u64> = None;
        loop {
            let error = match kv.create(key, value.clone()).await {
                Ok(revision) => {
                    tracing::info!(%job, bucket, key, "lease taken");
                    return Ok(Self::start(kv, key, job, value, revision, ttl / 5));
                }
                Err(err) => err,
            };
            if !crate::error::lost_compare_and_set(&error) {
                if Instant::now() >= deadline {
                    return Err(kv_err(Cause::of(error)));
                }
                tracing::warn!(%job, bucket, key, error = %error, "cannot create the lease yet; retrying");
            } else if let Some(entry) = kv.entry(key).await.map_err(|e| kv_err(Cause::of(e)))? {
                if entry.operation == kv::Operation::Put {
                    let holder = Holder::decode(&entry.value);
                    let alive = first_seen.is_some_and(|revision| revision != entry.revision);
                    if alive || Instant::now() >= deadline {
                        let since = holder.since();
                        return Err(BusError::LeaseHeld {
                            job,
                            bucket: bucket.into(),
                            key: key.into(),
                            holder: holder.holder,
                            since,
                        });
                    }
                    if first_seen.is_none() {
                        tracing::warn!(%job, bucket, key, holder = %holder.holder, since = %holder.since(), wait_s = (ttl + ttl / 2).as_secs_f64(), "the lease is held: waiting for it to expire (its holder died) or to be refreshed (it is alive)");
                        first_seen = Some(entry.revision);
                    }
                }
            }
            tokio::time::sleep(poll).await;
        }
    }

    fn start(kv: kv::Store, key: &str, job: String, value: Bytes, revision: u64, every: Duration) -> Self {
        let revision = Arc::new(AtomicU64::new(revision));
        let (lost_tx, lost) = watch::channel(None);
        let refresher = tokio::spawn(refresh(
            kv.clone(),
            key.to_string(),
            value.clone(),
            Arc::clone(&revision),
            every.max(Duration::from_millis(20)),
            lost_tx,
        ));
        Self { kv, key: key.to_string(), job, value, revision, lost, refresher }
    }

    /// Resolves once the lease is lost to another holder (never while it is held).
    pub fn lost(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut lost = self.lost.clone();
        async move {
            if lost.wait_for(Option::is_some).await.is_err() {
                // the refresher ended without losing the lease (released): nothing more will come
                std::future::pending::<()>().await;
            }
        }
    }

    /// Resolves when `other` does or when the lease is lost: a holder's shutdown signal.
    pub fn or_lost(
        &self,
        other: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        let lost = self.lost();
        async move {
            tokio::select! {
                _ = other => {}
                _ = lost => tracing::error!("lease lost: stopping"),
            }
        }
    }

    /// Stops refreshing and deletes the entry, if it is still this holder's. A lost lease is an error; an entry
    /// that cannot be deleted now (NATS unreachable) is left to expire.
    pub async fn release(mut self) -> Result<(), BusError> {
        self.refresher.abort();
        let _ = (&mut self.refresher).await;
        let lost = self.lost.borrow().clone();
        if let Some(why) = lost {
            return Err(BusError::LeaseLost {
                job: self.job.clone(),
                bucket: self.kv.name.clone(),
                key: self.key.clone(),
                message: why,
            });
        }
        let mut revision = self.revision.load(Ordering::SeqCst);
        if self.kv.delete_expect_revision(&self.key, Some(revision)).await.is_err() {
            // a refresh may have been written as the refresher stopped: delete the entry if it is still ours
            match self.kv.entry(&self.key).await {
                Ok(Some(entry)) if entry.operation == kv::Operation::Put && entry.value == self.value => {
                    revision = entry.revision;
                    if let Err(err) = self.kv.delete_expect_revision(&self.key, Some(revision)).await {
                        tracing::warn!(key = %self.key, error = %err, "lease not deleted; it expires by max age");
                    }
                }
                Ok(_) => {}
                Err(err) => tracing::warn!(key = %self.key, error = %err, "lease not deleted; it expires by max age"),
            }
        }
        tracing::info!(job = %self.job, key = %self.key, "lease released");
        Ok(())
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.refresher.abort();
    }
}

/// Rewrites the entry every `every` with compare-and-set on its revision. An entry that expired meanwhile (NATS
/// was unreachable for longer than the max age) is taken again if nobody else took it; one that another holder
/// wrote is reported through `lost`, and refreshing stops.
async fn refresh(
    kv: kv::Store,
    key: String,
    value: Bytes,
    revision: Arc<AtomicU64>,
    every: Duration,
    lost: watch::Sender<Option<String>>,
) {
    loop {
        tokio::time::sleep(every).await;
        let current = revision.load(Ordering::SeqCst);
        let error = match kv.update(&key, value.clone(), current).await {
            Ok(next) => {
                revision.store(next, Ordering::SeqCst);
                continue;
            }
            Err(err) => err,
        };
        if !crate::error::lost_compare_and_set(&error) {
            tracing::warn!(%key, error = %error, "lease not refreshed; retrying");
            continue;
        }
        let entry = match kv.entry(&key).await {
            Ok(entry) => entry.filter(|e| e.operation == kv::Operation::Put),
            Err(err) => {
                tracing::warn!(%key, error = %err, "lease not refreshed; retrying");
                continue;
            }
        };
        match entry {
            Some(entry) if entry.value == value => revision.store(entry.revision, Ordering::SeqCst),
            Some(entry) => {
                let holder = Holder::decode(&entry.value);
                let _ = lost.send(Some(format!("now held by {} since {}", holder.holder, holder.since())));
                return;
            }
            None => match kv.create(&key, value.clone()).await {
                Ok(next) => {
                    tracing::warn!(%key, "the lease expired while NATS was unreachable; taken again");
                    revision.store(next, Ordering::SeqCst);
                }
                Err(err) => tracing::warn!(%key, error = %err, "expired lease not taken again yet; retrying"),
            },
        }
    }
}

/// A Unix time in milliseconds as UTC, `YYYY-MM-DDTHH:MM:SSZ` (days to civil date: H. Hinnant's algorithm).
fn utc(unix_ms: i64) -> String {
    let secs = unix_ms.div_euclid(1000);
    let (days, rest) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z", rest / 3600, rest % 3600 / 60, rest % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unix_times_print_as_utc() {
        assert_eq!(utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc(951_827_696_000), "2000-02-29T12:34:56Z");
        assert_eq!(utc(1_767_225_599_999), "2025-12-31T23:59:59Z");
    }

    #[test]
    fn a_holder_round_trips_and_an_unreadable_value_is_named_as_such() {
        let holder = Holder::this_process("trainer");
        let back = Holder::decode(&holder.encode());
        assert_eq!((back.holder.as_str(), back.since_unix_ms), (holder.holder.as_str(), holder.since_unix_ms));
        assert!(back.holder.starts_with(&format!("trainer pid {} on ", std::process::id())), "{}", back.holder);
        assert_eq!(Holder::decode(b"\xff\x00").holder, "an unreadable holder (2 bytes)");
    }
}
