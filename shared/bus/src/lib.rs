//! NATS JetStream plumbing shared by every jetrl service.
//!
//! - [`Bus`] ([`connect`]): a connection with retries and backoff, the JetStream context, the job's names
//!   ([`jetrl_wire::subjects::Names`]: every stream, bucket and subject belongs to one job), and the declaration
//!   of every stream, consumer, KV bucket and object store the services use ([`topology`]).
//! - [`Publisher`] ([`publish`]): JetStream publishes with `Nats-Msg-Id` de-duplication and pipelined,
//!   bounded, retried acknowledgements.
//! - [`consume`]: pull consumption helpers; a message that does not decode is counted, logged with its
//!   subject and terminated, never redelivered forever.
//! - [`score`]: the score request a group's trajectories hand to the reward service.
//! - [`groups`]: the prompt-group control records (KV, compare-and-set on revision).
//! - [`ledger`]: the exactly-once ledger: the fate of every dataset row drawn, from the group records.
//! - [`lease`]: one holder per job of a role (the trainer), by a refreshed key in the job's LEASE bucket.
//! - [`harness`]: starts a real `nats-server -js` on a free port with a temporary store directory (tests,
//!   and `jetrl run` when no URL is given), killed on drop.

pub mod connect;
pub mod consume;
pub mod fetch;
pub mod groups;
pub mod harness;
pub mod lease;
pub mod ledger;
pub mod publish;
pub mod score;
pub mod topology;
pub mod weights;

pub use connect::Bus;
pub use groups::GroupStore;
pub use harness::NatsServer;
pub use lease::Lease;
pub use publish::Publisher;
pub use score::ScoreRequestBuilder;

/// Errors of the bus layer. Variants name the stage that failed.
#[derive(Debug, thiserror::Error)]
pub enum BusError {
    #[error("cannot connect to NATS at {url} after {attempts} attempts over {waited_s:.1}s: {message}")]
    Connect { url: String, attempts: u32, waited_s: f64, message: String },
    #[error("declaring {what}: {message}")]
    Declare { what: String, message: String },
    #[error("publishing to {subject}: {message}")]
    Publish { subject: String, message: String },
    #[error("payload of {bytes} bytes for {subject} exceeds the server's max_payload of {max} bytes")]
    PayloadTooLarge { subject: String, bytes: usize, max: usize },
    #[error("request on {subject}: {message}")]
    Request { subject: String, message: String },
    #[error("consuming from {what}: {message}")]
    Consume { what: String, message: String },
    #[error("key-value {bucket}/{key}: {message}")]
    Kv { bucket: String, key: String, message: String },
    #[error("object store {bucket}/{name}: {message}")]
    Object { bucket: String, name: String, message: String },
    #[error("decoding {what}: {message}")]
    Decode { what: String, message: String },
    #[error("nats-server: {0}")]
    Server(String),
    #[error("job namespace: {0}")]
    Namespace(String),
    #[error(
        "job {job}: another {key} is running: the lease {key:?} in {bucket} is held by {holder} since {since} and \
         was kept alive while this one waited; stop that {key} first, or give this job another run.name or \
         nats.namespace"
    )]
    LeaseHeld { job: String, bucket: String, key: String, holder: String, since: String },
    #[error("job {job}: the lease {key:?} in {bucket} was lost: {message}")]
    LeaseLost { job: String, bucket: String, key: String, message: String },
}

impl BusError {
    /// A stable label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            BusError::Connect { .. } => "connect",
            BusError::Declare { .. } => "declare",
            BusError::Publish { .. } => "publish",
            BusError::PayloadTooLarge { .. } => "payload_too_large",
            BusError::Request { .. } => "request",
            BusError::Consume { .. } => "consume",
            BusError::Kv { .. } => "kv",
            BusError::Object { .. } => "object",
            BusError::Decode { .. } => "decode",
            BusError::Server(_) => "server",
            BusError::Namespace(_) => "namespace",
            BusError::LeaseHeld { .. } => "lease_held",
            BusError::LeaseLost { .. } => "lease_lost",
        }
    }
}

#[cfg(test)]
mod tests;
