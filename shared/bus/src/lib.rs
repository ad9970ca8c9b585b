//! NATS JetStream plumbing shared by every jetrl service.
//!
//! - [`Bus`] ([`connect`]): a connection with retries and backoff, the JetStream context, the job's names
//!   ([`jetrl_wire::subjects::Names`]: every stream, bucket and subject belongs to one job), and the declaration
//!   of every stream, consumer, KV bucket and object store the services use ([`topology`]: by the trainer; the
//!   other services only wait for it).
//! - [`service`]: what every service does first (connect, the topology, dead letters, heartbeat, `/metrics`).
//! - [`watch`]: the [`watch::Follower`] of a KV watch or a stream that opens it again when it fails or stalls (the
//!   buffer's group records and rewards, the rollout workers' weights, the trainer's view of the fleet).
//! - [`heartbeat`]: every service's heartbeat in the job's WORKERS bucket, and the count of JetStream leader
//!   elections.
//! - [`Publisher`] ([`publish`]): JetStream publishes with `Nats-Msg-Id` de-duplication and pipelined,
//!   bounded, retried acknowledgements.
//! - [`error`]: [`BusError`] names the stage that failed and keeps the library's error as its source, with
//!   whether asking again can help ([`Recovery`]); [`retry`] retries what can, with backoff and a deadline.
//! - [`consume`]: pull consumption helpers; a message that does not decode is counted, logged with its
//!   subject and terminated, never redelivered forever.
//! - [`score`]: the score request a group's trajectories hand to the reward service.
//! - [`groups`]: the prompt-group control records (KV, compare-and-set on revision).
//! - [`ledger`]: the exactly-once ledger: the fate of every dataset row drawn, from the group records;
//!   [`archive`]: records that left the working set move from GROUPS to the job's LEDGER stream.
//! - [`lease`]: one holder per job of a role (the trainer), by a refreshed key in the job's LEASE bucket.
//! - [`harness`]: starts a real `nats-server -js` on a free port with a temporary store directory (tests,
//!   and `jetrl run` when no URL is given), killed on drop.

pub mod archive;
pub mod connect;
pub mod consume;
pub mod error;
pub mod fetch;
pub mod groups;
pub mod harness;
pub mod heartbeat;
pub mod lease;
pub mod ledger;
pub mod publish;
mod refusals;
pub mod retry;
pub mod score;
pub mod service;
mod tls;
pub mod topology;
pub mod watch;
pub mod weights;

pub use connect::{Bus, SETTLE_RECONNECT};
pub use error::{BusError, Cause, Classify, Recovery};
pub use groups::GroupStore;
pub use harness::NatsServer;
pub use lease::Lease;
pub use publish::Publisher;
pub use retry::{Delays, Patience};
pub use score::ScoreRequestBuilder;

#[cfg(test)]
mod tests;
