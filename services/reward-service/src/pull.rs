//! Taking trajectories from the shared durable consumer, and holding them until they are acknowledged.
//!
//! The server starts a message's `ack_wait` clock when it delivers it, not when the service starts working on it.
//! A client-side prefetch buffer is therefore a hazard with slow scorers: messages waiting in it time out and are
//! redelivered to another instance while this one still holds them, and both score them. So:
//!
//! - [`Puller`] asks the server only for as many messages as there is [`Room`] for (`reward.max_inflight`); every
//!   message it receives is handed on at once, so nothing waits unseen in a buffer;
//! - [`Leases`] sends an in-progress ack for every held message every `ack_wait / 3`, from the moment it arrives
//!   until it is acknowledged, released or handed back.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, consumer::PullConsumer};
use async_nats::Subject;
use bytes::Bytes;
use futures::StreamExt;
use jetrl_telemetry::Shutdown;
use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinHandle;

/// How long one pull request waits on an empty stream before it is renewed.
const PULL_EXPIRES: Duration = Duration::from_secs(5);
/// Pause after a failed pull request (the server restarting, the consumer being recreated).
const PULL_RETRY: Duration = Duration::from_millis(200);
/// The body of an in-progress acknowledgement (JetStream's `+WPI`).
const PROGRESS: &[u8] = b"+WPI";

/// A held trajectory message and its lease.
pub struct Pulled {
    pub msg: jetstream::Message,
    pub lease: LeaseId,
}

/// Identifies a lease in [`Leases`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeaseId(u64);

/// The messages this instance holds, kept alive with in-progress acks.
#[derive(Clone)]
pub struct Leases {
    inner: Arc<LeaseTable>,
}

struct LeaseTable {
    /// reply (ack) subject of every held message, by lease
    held: Mutex<HashMap<LeaseId, Subject>>,
    next: AtomicU64,
}

impl Leases {
    /// Starts the task that renews every held message every `ack_wait / 3`. It runs until the returned
    /// [`LeaseRenewal`] is stopped (or dropped): after the last batch has settled, not at the shutdown signal,
    /// so batches finishing during a shutdown keep their trajectories.
    pub fn start(client: async_nats::Client, ack_wait: Duration) -> (Self, LeaseRenewal) {
        let leases = Self { inner: Arc::new(LeaseTable { held: Mutex::new(HashMap::new()), next: AtomicU64::new(0) }) };
        let renewing = leases.clone();
        let task = tokio::spawn(async move {
            let mut ticker = tokio::time::interval(ack_wait / 3);
            ticker.tick().await;
            loop {
                ticker.tick().await;
                for reply in renewing.snapshot() {
                    if let Err(err) = client.publish(reply, Bytes::from_static(PROGRESS)).await {
                        tracing::warn!(error = %err, "in-progress ack not sent");
                    }
                }
            }
        });
        (leases, LeaseRenewal { task })
    }

    /// Starts renewing `msg` (a message without a reply subject cannot be acknowledged at all; it gets a lease
    /// that renews nothing).
    pub fn hold(&self, msg: &jetstream::Message) -> LeaseId {
        let id = LeaseId(self.inner.next.fetch_add(1, Ordering::Relaxed));
        if let Some(reply) = msg.reply.clone() {
            self.with_table(|held| held.insert(id, reply));
        }
        id
    }

    /// Stops renewing: the message was acknowledged, or must be allowed to time out and come back.
    pub fn release(&self, id: LeaseId) {
        self.with_table(|held| held.remove(&id));
    }

    fn snapshot(&self) -> Vec<Subject> {
        self.with_table(|held| held.values().cloned().collect())
    }

    fn with_table<T>(&self, f: impl FnOnce(&mut HashMap<LeaseId, Subject>) -> T) -> T {
        // A panic while holding this lock cannot leave the map inconsistent (single inserts and removes).
        let mut held = self.inner.held.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        f(&mut held)
    }
}

/// The task renewing leases; stops it when stopped or dropped.
pub struct LeaseRenewal {
    task: JoinHandle<()>,
}

impl LeaseRenewal {
    /// Ends the renewals; the leases still held (none, after an orderly stop) time out at the server.
    pub fn stop(self) {
        self.task.abort();
    }
}

impl Drop for LeaseRenewal {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Room for held messages: the puller takes a permit per message requested, scoring gives it back once the
/// message is settled.
#[derive(Clone)]
pub struct Room {
    permits: Arc<Semaphore>,
}

impl Room {
    /// `count` messages were acknowledged, terminated or handed back.
    pub fn give_back(&self, count: usize) {
        if count > 0 {
            self.permits.add_permits(count);
        }
    }
}

/// Pulls trajectories into a channel, never holding more than `max_inflight` at once.
pub struct Puller {
    room: Room,
    task: JoinHandle<()>,
}

impl Puller {
    /// Starts pulling. The channel is unbounded in type only: the room bounds what is ever in it.
    pub fn start(
        consumer: PullConsumer,
        max_inflight: usize,
        leases: Leases,
        shutdown: Shutdown,
    ) -> (Self, mpsc::UnboundedReceiver<Pulled>) {
        let room = Room { permits: Arc::new(Semaphore::new(max_inflight.max(1))) };
        let (sender, receiver) = mpsc::unbounded_channel();
        let task = tokio::spawn(pull_loop(consumer, room.clone(), leases, sender, shutdown));
        (Self { room, task }, receiver)
    }

    pub fn room(&self) -> Room {
        self.room.clone()
    }

    /// Stops pulling and waits for the pull task to end.
    pub async fn stop(self) {
        self.task.abort();
        let _ = self.task.await;
    }
}

async fn pull_loop(
    consumer: PullConsumer,
    room: Room,
    leases: Leases,
    sender: mpsc::UnboundedSender<Pulled>,
    shutdown: Shutdown,
) {
    loop {
        let wanted = tokio::select! {
            _ = shutdown.wait() => return,
            wanted = take_room(&room) => wanted,
        };
        let request = consumer.batch().max_messages(wanted).expires(PULL_EXPIRES).messages().await;
        let mut batch = match request {
            Ok(batch) => batch,
            Err(err) => {
                tracing::warn!(error = %err, "pull request failed; retrying");
                room.give_back(wanted);
                tokio::select! {
                    _ = shutdown.wait() => return,
                    _ = tokio::time::sleep(PULL_RETRY) => continue,
                }
            }
        };
        let mut received = 0;
        loop {
            let next = tokio::select! {
                _ = shutdown.wait() => return,
                next = batch.next() => next,
            };
            match next {
                Some(Ok(msg)) => {
                    received += 1;
                    let lease = leases.hold(&msg);
                    if let Err(mpsc::error::SendError(unsent)) = sender.send(Pulled { msg, lease }) {
                        // The service is stopping: the message times out and is redelivered elsewhere.
                        leases.release(unsent.lease);
                        return;
                    }
                }
                Some(Err(err)) => {
                    tracing::warn!(error = %err, "pull request ended with an error");
                    break;
                }
                None => break,
            }
        }
        room.give_back(wanted.saturating_sub(received));
    }
}

/// Waits for room for one message, then takes all the room there is: one pull request asks for all of it.
async fn take_room(room: &Room) -> usize {
    // Only this task acquires, and nothing closes the semaphore, so both acquisitions succeed.
    if let Ok(first) = room.permits.acquire().await {
        first.forget();
    }
    let more = room.permits.available_permits();
    match u32::try_from(more).ok().and_then(|more| room.permits.try_acquire_many(more).ok()) {
        Some(permits) if more > 0 => {
            permits.forget();
            1 + more
        }
        _ => 1,
    }
}
