//! The bus layer's error: which stage failed ([`BusError`]), and underneath it the library's error kept as the
//! source ([`Cause`]) with what asking again can do ([`Recovery`]), decided once from async-nats's error kinds.
//! [`retry`](crate::retry) retries what is not permanent, with backoff and a deadline.

use std::error::Error as StdError;

use async_nats::jetstream;

/// What asking again can do for a failed call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recovery {
    /// Asking again soon can succeed: a timeout, a broken connection, back-pressure, contention.
    Transient,
    /// Nothing answered for the resource (no responders, no stream for the subject, no JetStream leader). On one
    /// server that lasts; a JetStream cluster answers the same way for the seconds it elects a leader. Retried
    /// like a transient failure, within the same bounded wait, then reported.
    Unavailable,
    /// Asking again gives the same answer: an invalid key or subject, a refusal, a payload over the limit, a
    /// wrong revision, an existing key, a missing object, a message that does not decode.
    Permanent,
}

impl Recovery {
    /// A stable label for metrics.
    pub fn label(self) -> &'static str {
        match self {
            Recovery::Transient => "transient",
            Recovery::Unavailable => "unavailable",
            Recovery::Permanent => "permanent",
        }
    }

    /// Whether a retry (bounded) can help.
    pub fn retryable(self) -> bool {
        self != Recovery::Permanent
    }
}

type Source = Box<dyn StdError + Send + Sync + 'static>;

/// The failure underneath a [`BusError`]: its text, whether asking again can help, and the library's error
/// itself as the source (absent for a failure jetrl decided on its own, such as a refusal it observed).
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct Cause {
    recovery: Recovery,
    message: String,
    #[source]
    source: Option<Source>,
}

impl Cause {
    /// An async-nats error, classified by its kind.
    pub fn of<E: Classify>(err: E) -> Self {
        Self { recovery: err.recovery(), message: err.to_string(), source: Some(Box::new(err)) }
    }

    /// An error of no particular kind (async-nats's boxed `Error`, an I/O error): what it wraps decides, else it
    /// is taken as transient.
    pub fn other(err: impl Into<Source>) -> Self {
        let err: Source = err.into();
        let recovery = from_chain(&*err);
        Self { recovery, message: err.to_string(), source: Some(err) }
    }

    /// A failure described by jetrl itself.
    pub fn new(recovery: Recovery, message: impl Into<String>) -> Self {
        Self { recovery, message: message.into(), source: None }
    }

    pub fn transient(message: impl Into<String>) -> Self {
        Self::new(Recovery::Transient, message)
    }

    pub fn permanent(message: impl Into<String>) -> Self {
        Self::new(Recovery::Permanent, message)
    }

    pub fn recovery(&self) -> Recovery {
        self.recovery
    }

    /// Whether this is a KV create refused because the key exists (or, in a cluster, because a write to it is
    /// still being proposed: see [`lost_compare_and_set`]).
    pub fn is_create_conflict(&self) -> bool {
        self.source.as_deref().is_some_and(|e| lost_compare_and_set(e))
    }

    /// The same cause with more said about it (the source is kept).
    pub fn context(mut self, more: impl std::fmt::Display) -> Self {
        self.message = format!("{} ({more})", self.message);
        self
    }
}

/// Errors of the bus layer. Variants name the stage that failed; [`BusError::recovery`] says whether asking
/// again can help.
#[derive(Debug, thiserror::Error)]
pub enum BusError {
    #[error("cannot connect to NATS at {url} after {attempts} attempts over {waited_s:.1}s: {message}")]
    Connect { url: String, attempts: u32, waited_s: f64, message: String },
    #[error("declaring {what}: {cause}")]
    Declare {
        what: String,
        #[source]
        cause: Cause,
    },
    #[error("publishing to {subject}: {cause}")]
    Publish {
        subject: String,
        #[source]
        cause: Cause,
    },
    #[error("payload of {bytes} bytes for {subject} exceeds the server's max_payload of {max} bytes")]
    PayloadTooLarge { subject: String, bytes: usize, max: usize },
    #[error("request on {subject}: {cause}")]
    Request {
        subject: String,
        #[source]
        cause: Cause,
    },
    #[error("consuming from {what}: {cause}")]
    Consume {
        what: String,
        #[source]
        cause: Cause,
    },
    #[error("key-value {bucket}/{key}: {cause}")]
    Kv {
        bucket: String,
        key: String,
        #[source]
        cause: Cause,
    },
    #[error("object store {bucket}/{name}: {cause}")]
    Object {
        bucket: String,
        name: String,
        #[source]
        cause: Cause,
    },
    #[error("decoding {what}: {source}")]
    Decode {
        what: String,
        #[source]
        source: prost::DecodeError,
    },
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
    /// A stable label for metrics (the `kind` label of `jetrl_bus_errors_total` and `jetrl_bus_retries_total`).
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

    /// Whether asking again can help. A connection that could not be made within `nats.connect_timeout_s` is
    /// transient (the server may come back); the stages that carry a [`Cause`] answer from it.
    pub fn recovery(&self) -> Recovery {
        match self {
            BusError::Connect { .. } => Recovery::Transient,
            BusError::Declare { cause, .. }
            | BusError::Publish { cause, .. }
            | BusError::Request { cause, .. }
            | BusError::Consume { cause, .. }
            | BusError::Kv { cause, .. }
            | BusError::Object { cause, .. } => cause.recovery(),
            BusError::PayloadTooLarge { .. }
            | BusError::Decode { .. }
            | BusError::Server(_)
            | BusError::Namespace(_)
            | BusError::LeaseHeld { .. }
            | BusError::LeaseLost { .. } => Recovery::Permanent,
        }
    }

    /// Counts this error in `jetrl_bus_errors_total{kind, recovery}` and returns it (for `map_err` chains at the
    /// places that give up).
    pub fn counted(self) -> Self {
        metrics::counter!("jetrl_bus_errors_total", "kind" => self.kind(), "recovery" => self.recovery().label())
            .increment(1);
        self
    }
}

/// An error whose kind says what asking again can do.
pub trait Classify: StdError + Send + Sync + 'static {
    fn recovery(&self) -> Recovery;
}

/// What a kind of async-nats error says about asking again; `None` when the kind is too general to tell (an
/// `Other`), and the error's sources decide.
pub trait KindRecovery {
    fn recovery(&self) -> Option<Recovery>;
}

impl<K> Classify for async_nats::error::Error<K>
where
    K: KindRecovery + Clone + std::fmt::Debug + std::fmt::Display + PartialEq + Send + Sync + 'static,
{
    fn recovery(&self) -> Recovery {
        self.kind().recovery().unwrap_or_else(|| from_sources(self))
    }
}

/// Walks an error's sources for one that tells: a JetStream API error's code (bare, or as a consumer creation's
/// kind), an I/O error (transient). An error
/// that says nothing more is a client or connection failure, taken as transient (its retry is bounded).
fn from_sources(err: &(dyn StdError + 'static)) -> Recovery {
    err.source().map_or(Recovery::Transient, from_chain)
}

/// [`from_sources`], starting with the error itself.
fn from_chain(err: &(dyn StdError + 'static)) -> Recovery {
    let mut next = Some(err);
    while let Some(source) = next {
        if let Some(api) = source.downcast_ref::<jetstream::Error>() {
            return api_recovery(api);
        }
        // a consumer's creation wrapped in another error (a KV watch's): its kind carries the API error
        if let Some(recovery) =
            source.downcast_ref::<jetstream::stream::ConsumerError>().and_then(|e| e.kind().recovery())
        {
            return recovery;
        }
        if source.is::<std::io::Error>() {
            return Recovery::Transient;
        }
        next = source.source();
    }
    Recovery::Transient
}

/// Whether `err` (or one of its sources) says a write that expected a key at some revision found it elsewhere: a
/// compare-and-set that lost, or a create of a key that exists. A single server answers JetStream error 10071
/// (`wrong last sequence: <n>`), which async-nats reports as `WrongLastRevision` (an update) or `AlreadyExists` (a
/// create). A clustered stream's leader answers 10164 (`wrong last sequence`, no number) when another write to
/// the same key is still being proposed, and async-nats reports that as `Other`: taken for a permanent failure, it
/// made the buffer give up marking a group sampled in the three-node cluster test (the step trained three groups
/// of four). Either way the writer reads the key again and decides.
pub fn lost_compare_and_set(err: &(dyn StdError + 'static)) -> bool {
    use jetstream::context::{PublishError, PublishErrorKind};
    use jetstream::kv::{CreateError, CreateErrorKind, UpdateError, UpdateErrorKind};
    let mut next = Some(err);
    while let Some(e) = next {
        let lost = e.downcast_ref::<UpdateError>().is_some_and(|e| e.kind() == UpdateErrorKind::WrongLastRevision)
            || e.downcast_ref::<CreateError>().is_some_and(|e| e.kind() == CreateErrorKind::AlreadyExists)
            || e.downcast_ref::<PublishError>().is_some_and(|e| e.kind() == PublishErrorKind::WrongLastSequence)
            || e.downcast_ref::<jetstream::Error>().is_some_and(|e| {
                [
                    jetstream::ErrorCode::STREAM_WRONG_LAST_SEQUENCE,
                    jetstream::ErrorCode::STREAM_WRONG_LAST_SEQUENCE_CONSTANT,
                ]
                .contains(&e.error_code())
            });
        if lost {
            return true;
        }
        next = e.source();
    }
    false
}

/// A JetStream API error: the codes a cluster answers while a node or a leader is missing are `Unavailable`; the
/// consumer limit is `Transient` (the ephemeral consumers of processes that died, their watches, are removed by
/// the server after their inactivity threshold, so a new one fits again); every other answer (limits,
/// configuration, names) is permanent.
fn api_recovery(err: &jetstream::Error) -> Recovery {
    use jetstream::ErrorCode as C;
    let code = err.error_code();
    if code == C::MAXIMUM_CONSUMERS_LIMIT {
        return Recovery::Transient;
    }
    let unavailable = [
        C::STREAM_NOT_FOUND,
        C::CLUSTER_NOT_AVAILABLE,
        C::CLUSTER_NOT_LEADER,
        C::CLUSTER_NO_PEERS,
        C::CLUSTER_NOT_ACTIVE,
        C::CLUSTER_NOT_ASSIGNED,
        C::CLUSTER_INCOMPLETE,
        C::JETSTREAM_NOT_ENABLED,
    ];
    if unavailable.contains(&code) {
        Recovery::Unavailable
    } else {
        Recovery::Permanent
    }
}

use Recovery::{Permanent, Transient, Unavailable};

/// `impl KindRecovery for <kind> { Variant => Recovery, ... }`; variants mapped to `None` defer to the sources.
macro_rules! kinds {
    ($($kind:ty { $($pat:pat => $rec:expr),+ $(,)? })+) => {
        $(impl KindRecovery for $kind {
            #[allow(unreachable_patterns)]
            fn recovery(&self) -> Option<Recovery> {
                #[allow(unused_imports)]
                use $kind as K;
                match self { $($pat => $rec),+ }
            }
        })+
    };
}

kinds! {
    jetstream::stream::LastRawMessageErrorKind {
        K::NoMessageFound | K::InvalidSubject => Some(Permanent),
        K::JetStream(e) => Some(api_recovery(e)),
        K::Other => None,
    }
    jetstream::kv::EntryErrorKind {
        K::TimedOut => Some(Transient),
        K::InvalidKey => Some(Permanent),
        K::Other => None,
    }
    jetstream::kv::UpdateErrorKind {
        K::TimedOut => Some(Transient),
        K::InvalidKey | K::WrongLastRevision => Some(Permanent),
        K::Other => None,
    }
    jetstream::kv::CreateErrorKind {
        K::AlreadyExists | K::InvalidKey => Some(Permanent),
        K::Publish | K::Ack | K::Other => None,
    }
    jetstream::kv::PutErrorKind {
        K::InvalidKey => Some(Permanent),
        K::Publish | K::Ack => None,
    }
    jetstream::kv::WatchErrorKind {
        K::TimedOut => Some(Transient),
        K::InvalidKey => Some(Permanent),
        K::ConsumerCreate | K::Other => None,
    }
    jetstream::kv::WatcherErrorKind {
        K::Consumer | K::Other => None,
    }
    jetstream::kv::StatusErrorKind {
        K::TimedOut => Some(Transient),
        K::JetStream(e) => Some(api_recovery(e)),
    }
    jetstream::context::PublishErrorKind {
        K::TimedOut | K::BrokenPipe | K::MaxAckPending => Some(Transient),
        K::StreamNotFound => Some(Unavailable),
        K::WrongLastMessageId | K::WrongLastSequence | K::MaxPayloadExceeded => Some(Permanent),
        K::Other => None,
    }
    jetstream::context::RequestErrorKind {
        K::TimedOut => Some(Transient),
        K::NoResponders => Some(Unavailable),
        K::InvalidSubject => Some(Permanent),
        K::Other => None,
    }
    jetstream::context::GetStreamErrorKind {
        K::Request => Some(Transient),
        K::EmptyName | K::InvalidStreamName => Some(Permanent),
        K::JetStream(e) => Some(api_recovery(e)),
    }
    jetstream::context::KeyValueErrorKind {
        K::InvalidStoreName => Some(Permanent),
        K::GetBucket | K::JetStream => None,
    }
    jetstream::context::ObjectStoreErrorKind {
        K::InvalidBucketName => Some(Permanent),
        K::GetStore => None,
    }
    jetstream::stream::ConsumerErrorKind {
        K::TimedOut | K::Request => Some(Transient),
        K::InvalidConsumerType | K::InvalidName => Some(Permanent),
        K::JetStream(e) => Some(api_recovery(e)),
        K::Other => None,
    }
    jetstream::stream::DirectGetErrorKind {
        K::TimedOut | K::Request => Some(Transient),
        K::NotFound | K::InvalidSubject => Some(Permanent),
        K::ErrorResponse(status, _) => Some(match status.as_u16() {
            503 => Unavailable,
            408 => Transient,
            _ => Permanent,
        }),
        K::Other => None,
    }
    jetstream::stream::PurgeErrorKind {
        K::Request => Some(Transient),
        K::TimedOut => Some(Transient),
        K::JetStream(e) => Some(api_recovery(e)),
    }
    jetstream::consumer::StreamErrorKind {
        K::TimedOut => Some(Transient),
        K::Other => None,
    }
    jetstream::consumer::pull::MessagesErrorKind {
        K::MissingHeartbeat | K::Pull => Some(Transient),
        K::NoResponders | K::ConsumerDeleted => Some(Unavailable),
        K::PushBasedConsumer => Some(Permanent),
        K::Other => None,
        _ => Some(Permanent),
    }
    jetstream::context::CreateStreamErrorKind {
        K::TimedOut => Some(Transient),
        K::JetStreamUnavailable => Some(Unavailable),
        K::JetStream(e) => Some(api_recovery(e)),
        K::Response | K::ResponseParse => None,
        _ => Some(Permanent),
    }
    jetstream::context::CreateKeyValueErrorKind {
        K::TimedOut => Some(Transient),
        K::JetStream | K::BucketCreate => None,
        _ => Some(Permanent),
    }
    jetstream::stream::ConsumerUpdateErrorKind {
        K::TimedOut | K::Request => Some(Transient),
        K::DoesNotExist => Some(Unavailable),
        K::JetStream(e) => Some(api_recovery(e)),
        K::InvalidConsumerType | K::InvalidName => Some(Permanent),
        K::Other => None,
    }
    jetstream::consumer::pull::BatchErrorKind {
        K::Subscribe | K::Pull | K::Flush => Some(Transient),
        _ => Some(Permanent),
    }
    jetstream::consumer::pull::OrderedErrorKind {
        K::MissingHeartbeat | K::Pull | K::Recreate => Some(Transient),
        K::NoResponders | K::ConsumerDeleted => Some(Unavailable),
        K::Other => None,
        _ => Some(Permanent),
    }
    jetstream::object_store::GetErrorKind {
        K::TimedOut => Some(Transient),
        K::InvalidName | K::NotFound | K::BucketLink => Some(Permanent),
        K::ConsumerCreate | K::Other => None,
    }
    jetstream::object_store::PutErrorKind {
        K::TimedOut => Some(Transient),
        K::InvalidName => Some(Permanent),
        K::ReadChunks | K::PublishChunks | K::PublishMetadata | K::PurgeOldChunks | K::Other => None,
    }
    jetstream::object_store::InfoErrorKind {
        K::TimedOut => Some(Transient),
        K::InvalidName | K::NotFound => Some(Permanent),
        K::Other => None,
    }
    jetstream::object_store::DeleteErrorKind {
        K::TimedOut => Some(Transient),
        K::InvalidName | K::NotFound => Some(Permanent),
        _ => None,
    }
    async_nats::client::RequestErrorKind {
        K::TimedOut => Some(Transient),
        K::NoResponders => Some(Unavailable),
        K::InvalidSubject | K::MaxPayloadExceeded => Some(Permanent),
        K::Other => None,
    }
    async_nats::client::PublishErrorKind {
        K::MaxPayloadExceeded | K::InvalidSubject => Some(Permanent),
        K::Send => Some(Transient),
    }
    async_nats::client::SubscribeErrorKind {
        K::InvalidSubject | K::InvalidQueueName => Some(Permanent),
        K::Other => None,
    }
}
