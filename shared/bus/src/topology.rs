//! The streams, consumers, KV buckets and object store of a jetrl job, declared idempotently: every
//! service declares what it touches at start-up, so the order in which services start does not matter. Every name
//! comes from the bus's [`jetrl_wire::subjects::Names`]: one job's topology never touches another's.

use std::time::Duration;

use async_nats::jetstream::{self, consumer, kv, object_store, stream};

use crate::{Bus, BusError};

/// How long a published trajectory/reward id is remembered for de-duplication.
pub const DEDUP_WINDOW: Duration = Duration::from_secs(120);

/// Safety net for payload streams: anything not released by the trainer within a day is dropped.
const PAYLOAD_MAX_AGE: Duration = Duration::from_secs(24 * 3600);

/// Heartbeats older than this disappear from the WORKERS bucket.
pub const HEARTBEAT_MAX_AGE: Duration = Duration::from_secs(15);

/// A lease not refreshed for this long disappears from the LEASE bucket (its holder died): how long a restarted
/// trainer may wait for the lease of the one that crashed.
pub const LEASE_TTL: Duration = Duration::from_secs(10);

fn declare_err(what: &str, err: impl std::fmt::Display) -> BusError {
    BusError::Declare { what: what.to_string(), message: err.to_string() }
}

/// A stream of the data path (TRAJ, SCORE, REWARDS): kept until purged (by the buffer on release or eviction, or
/// by the reward services below their ack floor), at most [`PAYLOAD_MAX_AGE`]; de-duplicated by `Nats-Msg-Id`;
/// readable by direct get.
fn payload_stream(name: &str, filter: String) -> stream::Config {
    stream::Config {
        name: name.into(),
        subjects: vec![filter],
        retention: stream::RetentionPolicy::Limits,
        storage: stream::StorageType::File,
        duplicate_window: DEDUP_WINDOW,
        max_age: PAYLOAD_MAX_AGE,
        allow_direct: true,
        ..Default::default()
    }
}

impl Bus {
    /// Declares every stream, bucket and object store (idempotent; existing configs are updated).
    pub async fn declare_topology(&self) -> Result<(), BusError> {
        let (js, names) = (self.jetstream(), self.names());
        let streams = [
            stream::Config {
                name: names.prompts_stream().into(),
                subjects: vec![names.prompts_filter()],
                retention: stream::RetentionPolicy::WorkQueue,
                storage: stream::StorageType::File,
                duplicate_window: DEDUP_WINDOW,
                ..Default::default()
            },
            payload_stream(names.traj_stream(), names.traj_filter()),
            // A limits stream, not a work queue: the reward services purge acknowledged requests in bulk (below
            // their consumer's ack floor), which costs the broker far less than deleting each one on its ack.
            payload_stream(names.score_stream(), names.score_filter()),
            payload_stream(names.rewards_stream(), names.rewards_filter()),
        ];
        for config in streams {
            let (name, retention) = (config.name.clone(), config.retention);
            if let Err(err) = js.create_or_update_stream(config).await {
                // The server cannot change a stream to or from a work queue in place (SCORE was one before).
                let mut message = err.to_string();
                if let Ok(mut existing) = js.get_stream(&name).await {
                    if let Ok(info) = existing.info().await {
                        if info.config.retention != retention {
                            message = format!(
                                "{message}; it exists with retention {:?} but this jetrl needs {retention:?}: stop \
                                 the job's services, let it drain (its consumers show nothing pending), delete it \
                                 (`nats stream rm {name}`) and start them again",
                                info.config.retention
                            );
                        }
                    }
                }
                return Err(declare_err(&format!("stream {name}"), message));
            }
        }
        self.key_value(names.groups_bucket()).await?;
        self.key_value(names.weights_bucket()).await?;
        self.key_value(names.workers_bucket()).await?;
        self.key_value(names.lease_bucket()).await?;
        self.object_store(names.blobs_store()).await?;
        Ok(())
    }

    /// Opens (declaring if needed) one of the job's KV buckets.
    pub async fn key_value(&self, bucket: &str) -> Result<kv::Store, BusError> {
        let js = self.jetstream();
        if let Ok(store) = js.get_key_value(bucket).await {
            return Ok(store);
        }
        let names = self.names();
        let config = match bucket {
            b if b == names.workers_bucket() => kv::Config {
                bucket: bucket.into(),
                history: 1,
                max_age: HEARTBEAT_MAX_AGE,
                storage: stream::StorageType::Memory,
                ..Default::default()
            },
            b if b == names.weights_bucket() => kv::Config {
                bucket: bucket.into(),
                history: 4,
                storage: stream::StorageType::File,
                ..Default::default()
            },
            // File storage: a lease outlives a restart of the NATS server, as its holder does.
            b if b == names.lease_bucket() => kv::Config {
                bucket: bucket.into(),
                history: 1,
                max_age: LEASE_TTL,
                storage: stream::StorageType::File,
                ..Default::default()
            },
            _ => kv::Config {
                bucket: bucket.into(),
                history: 1,
                storage: stream::StorageType::File,
                ..Default::default()
            },
        };
        match js.create_key_value(config).await {
            Ok(store) => Ok(store),
            // another service created it between our get and create
            Err(create_err) => {
                js.get_key_value(bucket).await.map_err(|_| declare_err(&format!("kv {bucket}"), create_err))
            }
        }
    }

    /// Opens (declaring if needed) an object store.
    pub async fn object_store(&self, bucket: &str) -> Result<object_store::ObjectStore, BusError> {
        let js = self.jetstream();
        if let Ok(store) = js.get_object_store(bucket).await {
            return Ok(store);
        }
        let config =
            object_store::Config { bucket: bucket.into(), storage: stream::StorageType::File, ..Default::default() };
        match js.create_object_store(config).await {
            Ok(store) => Ok(store),
            Err(create_err) => js
                .get_object_store(bucket)
                .await
                .map_err(|_| declare_err(&format!("object store {bucket}"), create_err)),
        }
    }

    /// The durable pull consumer shared by all instances of one service (a work-sharing group).
    pub async fn shared_pull_consumer(
        &self,
        stream_name: &str,
        durable: &str,
        filter_subject: &str,
        ack_wait: Duration,
        max_ack_pending: i64,
    ) -> Result<consumer::PullConsumer, BusError> {
        let what = format!("consumer {stream_name}/{durable}");
        let stream = self.jetstream().get_stream(stream_name).await.map_err(|e| declare_err(&what, e))?;
        let config = consumer::pull::Config {
            durable_name: Some(durable.to_string()),
            filter_subject: filter_subject.to_string(),
            ack_policy: consumer::AckPolicy::Explicit,
            ack_wait,
            max_ack_pending,
            // unlimited: a worker that dies must not make its prompts disappear; poison messages are
            // terminated by the consumer code instead.
            max_deliver: -1,
            ..Default::default()
        };
        // create_consumer is idempotent for an identical config; on a config change update it.
        match stream.create_consumer(config.clone()).await {
            Ok(consumer) => Ok(consumer),
            Err(_) => {
                self.jetstream()
                    .update_consumer_on_stream(config, stream_name)
                    .await
                    .map_err(|e| declare_err(&what, e))?;
                stream.get_consumer(durable).await.map_err(|e| declare_err(&what, e))
            }
        }
    }

    /// A handle on one of the job's streams.
    pub async fn stream(&self, name: &str) -> Result<jetstream::stream::Stream, BusError> {
        self.jetstream().get_stream(name).await.map_err(|e| declare_err(&format!("stream {name}"), e))
    }
}
