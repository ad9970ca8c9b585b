//! checkpoint-sync against a real nats-server, in-process: an announced blob becomes `v.<n>` and `latest` in the
//! WEIGHTS bucket; an announcement that does not match its blob, names no blob, names another job's store or does
//! not decode is refused with the code and the reason; versions beyond `checkpoint.keep_versions` lose their blob
//! and entry; and a restarted service rebuilds its list of versions from the bucket, so collection goes on.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use bytes::Bytes;
use jetrl_bus::weights::WeightTransport;
use jetrl_bus::{Bus, NatsServer};
use jetrl_config::JobConfig;
use jetrl_wire::v1::{ErrorCode, TensorInfo, WeightAnnounce, WeightAnnounceResponse, WeightManifest};
use jetrl_wire::Message;
use tokio::sync::oneshot;

struct Service {
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl Service {
    fn start(cfg: &JobConfig) -> Self {
        let (stop, stopped) = oneshot::channel::<()>();
        let cfg = cfg.clone();
        let task = tokio::spawn(async move {
            jetrl_checkpoint_sync::run(cfg, async move {
                let _ = stopped.await;
            })
            .await
            .unwrap();
        });
        Self { stop, task }
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        tokio::time::timeout(Duration::from_secs(10), self.task).await.expect("checkpoint-sync stops").unwrap();
    }
}

async fn setup(keep_versions: u32) -> (NatsServer, JobConfig, Bus) {
    let nats = NatsServer::start().unwrap();
    let mut cfg = JobConfig::default();
    cfg.nats.url = nats.url();
    cfg.checkpoint.keep_versions = keep_versions;
    let bus = Bus::connect_job(&cfg, "checkpoint-sync-test").await.unwrap();
    bus.declare_topology().await.unwrap();
    (nats, cfg, bus)
}

fn manifest(version: u64, location: &str, total_bytes: u64) -> WeightManifest {
    WeightManifest {
        version,
        location: location.into(),
        total_bytes,
        step: version,
        tensors: vec![TensorInfo { name: "w".into(), ..Default::default() }],
        ..Default::default()
    }
}

/// Announces `payload` as the trainer does (request/reply), asking again until a checkpoint-sync answers.
async fn announce_raw(bus: &Bus, payload: Vec<u8>) -> WeightAnnounceResponse {
    let subject = bus.names().weights_announce().to_string();
    for _ in 0..50 {
        if let Ok(reply) = bus.client().request(subject.clone(), payload.clone().into()).await {
            return WeightAnnounceResponse::decode(reply.payload.as_ref()).unwrap();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("no checkpoint-sync answered on {subject}");
}

async fn announce(bus: &Bus, manifest: WeightManifest) -> WeightAnnounceResponse {
    announce_raw(bus, WeightAnnounce { manifest: Some(manifest) }.encode_to_vec()).await
}

async fn store(bus: &Bus, version: u64, bytes: usize) -> String {
    let transport = WeightTransport::ObjectStore { chunk_bytes: 1 << 20 };
    bus.store_weights(&transport, version, Bytes::from(vec![7u8; bytes])).await.unwrap()
}

async fn entry(bus: &Bus, key: &str) -> Option<WeightManifest> {
    let kv = bus.key_value(bus.names().weights_bucket()).await.unwrap();
    kv.get(key).await.unwrap().map(|b| WeightManifest::decode(b.as_ref()).unwrap())
}

#[tokio::test]
async fn an_announced_blob_is_published_and_bad_announcements_are_refused_with_their_reason() {
    let (_nats, cfg, bus) = setup(2).await;
    let service = Service::start(&cfg);

    let location = store(&bus, 1, 1000).await;
    let answer = announce(&bus, manifest(1, &location, 1000)).await;
    assert_eq!((answer.version, answer.code(), answer.error.as_str()), (1, ErrorCode::None, ""));
    assert_eq!(entry(&bus, "v.1").await.unwrap().location, location);
    assert_eq!(entry(&bus, "latest").await.unwrap().version, 1);
    assert_eq!(bus.latest_manifest().await.unwrap().unwrap().total_bytes, 1000);

    // the blob is not the size the manifest says
    let location = store(&bus, 2, 500).await;
    let answer = announce(&bus, manifest(2, &location, 600)).await;
    assert_eq!(answer.code(), ErrorCode::Invalid);
    assert!(answer.error.contains("500 bytes") && answer.error.contains("600"), "{}", answer.error);
    // no location or no tensors
    let answer = announce(&bus, WeightManifest { version: 3, ..Default::default() }).await;
    assert_eq!(answer.code(), ErrorCode::Invalid);
    assert!(answer.error.contains("no location"), "{}", answer.error);
    // another job's object store
    let answer = announce(&bus, manifest(4, "object://JETRL_other_BLOBS/weights-v00000004", 10)).await;
    assert_eq!(answer.code(), ErrorCode::Invalid);
    assert!(answer.error.contains("not in this job's object store"), "{}", answer.error);
    // bytes that are no WeightAnnounce
    let answer = announce_raw(&bus, vec![0xff, 0xff, 0xff]).await;
    assert_eq!(answer.code(), ErrorCode::Malformed);
    assert!(answer.error.contains("malformed WeightAnnounce"), "{}", answer.error);

    // nothing refused reached the bucket
    assert_eq!(entry(&bus, "latest").await.unwrap().version, 1);
    for key in ["v.2", "v.3", "v.4"] {
        assert!(entry(&bus, key).await.is_none(), "{key}");
    }
    service.stop().await;
}

#[tokio::test]
async fn old_versions_are_collected_and_a_restart_goes_on_from_the_bucket() {
    let (_nats, cfg, bus) = setup(2).await;
    let service = Service::start(&cfg);
    let mut locations = Vec::new();
    for version in 1..=4 {
        let location = store(&bus, version, 100).await;
        let answer = announce(&bus, manifest(version, &location, 100)).await;
        assert_eq!(answer.code(), ErrorCode::None, "{}", answer.error);
        locations.push(location);
    }
    // keep_versions 2: versions 1 and 2 are gone, blob and entry
    for (i, location) in locations.iter().enumerate() {
        let version = i as u64 + 1;
        let kept = version > 2;
        assert_eq!(bus.weights_size(location).await.is_ok(), kept, "blob of version {version}");
        assert_eq!(entry(&bus, &format!("v.{version}")).await.is_some(), kept, "entry of version {version}");
    }
    service.stop().await;

    // a new incarnation reads versions 3 and 4 from the bucket and collects 3 when 5 arrives
    let service = Service::start(&cfg);
    let location = store(&bus, 5, 100).await;
    assert_eq!(announce(&bus, manifest(5, &location, 100)).await.code(), ErrorCode::None);
    assert!(bus.weights_size(&locations[2]).await.is_err(), "version 3's blob outlived the restart");
    assert!(entry(&bus, "v.3").await.is_none());
    assert!(bus.weights_size(&locations[3]).await.is_ok());
    assert_eq!(entry(&bus, "latest").await.unwrap().version, 5);
    service.stop().await;
}
