//! jetrl-replay-buffer: the group state machine and the sampling policy (the TransferQueue controller role
//! of verl V1).
//!
//! - [`state`]: the pure index (group records, scored trajectories, selection), tested without tasks.
//! - [`service`]: [`run`] — rebuilds the index from JetStream (the GROUPS bucket and the REWARDS stream),
//!   then answers sample, release and ledger requests, event-driven: a request that can be satisfied is
//!   answered as soon as the last group it needs becomes complete, with no polling interval.
//! - [`reread`]: when a sample request has waited long with nothing coming in, the group records and rewards are
//!   read again from the stores, and whatever the buffer had missed is applied and reported.
//! - [`archiver`]: groups that leave the working set (trained and released, or evicted) move from the GROUPS
//!   bucket to the job's LEDGER stream, so the bucket, the broker and the buffer hold the working set only.
//!
//! Payloads never pass through the buffer: it keeps keys, versions, lengths, scores and stream sequences;
//! the trainer fetches trajectory bytes from the TRAJ stream directly.

pub mod archiver;
pub mod reread;
pub mod sampler;
pub mod service;
pub mod state;

pub use service::{run, BufferError};
