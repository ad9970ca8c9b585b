//! Weight blobs and manifests.
//!
//! Weights never travel as ordinary messages: the trainer writes a safetensors blob to the object store
//! (between hosts) or to a shared directory (same node / shared filesystem), and checkpoint-sync announces a
//! [`WeightManifest`] — tensor names, dtypes, shapes, CRC-32s and where the bytes are — in the WEIGHTS KV
//! bucket (keys `latest` and `v.<version>`). Readers verify every checksum before loading.

use std::path::{Path, PathBuf};

use async_nats::jetstream::object_store::ObjectMetadata;
use bytes::Bytes;
use jetrl_wire::v1::{TensorInfo, WeightManifest};
use jetrl_wire::Message;
use tokio::io::AsyncReadExt;

use crate::{Bus, BusError, Cause};

/// Where weight blobs go.
#[derive(Debug, Clone)]
pub enum WeightTransport {
    /// the JetStream object store (works across hosts)
    ObjectStore { chunk_bytes: usize },
    /// a directory every reader can open (same node, or a shared filesystem)
    SharedFs { dir: PathBuf },
}

fn obj_err(bucket: &str, name: &str, cause: Cause) -> BusError {
    BusError::Object { bucket: bucket.into(), name: name.into(), cause }
}

/// A blob that is not what its manifest says, or a location that cannot name one: asking again reads the same.
fn blob_err(location: &str, why: impl Into<String>) -> BusError {
    BusError::Object { bucket: "weights".into(), name: location.into(), cause: Cause::permanent(why) }
}

/// A file of the shared-filesystem transport that could not be read or written.
fn file_err(location: &str, err: std::io::Error) -> BusError {
    BusError::Object { bucket: "weights".into(), name: location.into(), cause: Cause::other(err) }
}

/// Builds the manifest of a safetensors blob: one entry per tensor with its CRC-32, plus the blob's CRC.
pub fn manifest_for(bytes: &[u8], version: u64, step: u64, location: &str) -> Result<WeightManifest, BusError> {
    let parsed = safetensors::SafeTensors::deserialize(bytes)
        .map_err(|e| blob_err(location, format!("not safetensors: {e}")))?;
    let base = bytes.as_ptr() as usize;
    let mut tensors: Vec<TensorInfo> = parsed
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let data = view.data();
            TensorInfo {
                name,
                dtype: format!("{:?}", view.dtype()),
                shape: view.shape().iter().map(|&d| d as u64).collect(),
                crc32: crc32fast::hash(data),
                offset: (data.as_ptr() as usize - base) as u64,
                nbytes: data.len() as u64,
            }
        })
        .collect();
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(WeightManifest {
        version,
        tensors,
        location: location.to_string(),
        total_bytes: bytes.len() as u64,
        step,
        created_unix_ms: jetrl_wire::now_unix_ms(),
        blob_crc32: crc32fast::hash(bytes),
    })
}

/// Checks a downloaded blob against its manifest (size, blob CRC, every tensor's CRC).
pub fn verify(manifest: &WeightManifest, bytes: &[u8]) -> Result<(), BusError> {
    let location = &manifest.location;
    if bytes.len() as u64 != manifest.total_bytes {
        return Err(blob_err(location, format!("size {} != manifest {}", bytes.len(), manifest.total_bytes)));
    }
    let crc = crc32fast::hash(bytes);
    if crc != manifest.blob_crc32 {
        return Err(blob_err(location, format!("blob crc32 {crc:08x} != manifest {:08x}", manifest.blob_crc32)));
    }
    for t in &manifest.tensors {
        let start = t.offset as usize;
        let end = start + t.nbytes as usize;
        let data =
            bytes.get(start..end).ok_or_else(|| blob_err(location, format!("tensor {} out of range", t.name)))?;
        let crc = crc32fast::hash(data);
        if crc != t.crc32 {
            return Err(blob_err(location, format!("tensor {} crc32 {crc:08x} != manifest {:08x}", t.name, t.crc32)));
        }
    }
    Ok(())
}

fn object_name(version: u64) -> String {
    format!("weights-v{version:08}")
}

impl Bus {
    /// Stores a weight blob; returns its location.
    pub async fn store_weights(
        &self,
        transport: &WeightTransport,
        version: u64,
        bytes: Bytes,
    ) -> Result<String, BusError> {
        match transport {
            WeightTransport::ObjectStore { chunk_bytes } => {
                let bucket = self.names().blobs_store();
                let store = self.object_store(bucket).await?;
                let name = object_name(version);
                // Each chunk is one acknowledged publish, awaited in turn: big chunks are what make this fast.
                let chunk = (*chunk_bytes).min(self.max_payload().saturating_sub(64 * 1024)).max(64 * 1024);
                let meta = ObjectMetadata { name: name.clone(), chunk_size: Some(chunk), ..Default::default() };
                let mut reader = bytes.as_ref();
                store.put(meta, &mut reader).await.map_err(|e| obj_err(bucket, &name, Cause::of(e)))?;
                Ok(format!("object://{bucket}/{name}"))
            }
            WeightTransport::SharedFs { dir } => {
                tokio::fs::create_dir_all(dir).await.map_err(|e| file_err(&dir.display().to_string(), e))?;
                let dir = tokio::fs::canonicalize(dir).await.map_err(|e| file_err(&dir.display().to_string(), e))?;
                let path = dir.join(format!("{}.safetensors", object_name(version)));
                let tmp = path.with_extension("safetensors.tmp");
                tokio::fs::write(&tmp, &bytes).await.map_err(|e| file_err(&tmp.display().to_string(), e))?;
                tokio::fs::rename(&tmp, &path).await.map_err(|e| file_err(&path.display().to_string(), e))?;
                Ok(format!("file://{}", path.display()))
            }
        }
    }

    /// A weight location in another job's object store (a forged or misrouted manifest) is refused.
    fn check_own_blobs(&self, bucket: &str, location: &str) -> Result<(), BusError> {
        let own = self.names().blobs_store();
        if bucket == own {
            Ok(())
        } else {
            Err(blob_err(location, format!("not in this job's object store {own}")))
        }
    }

    /// Reads a weight blob from its location.
    pub async fn load_weights(&self, location: &str) -> Result<Bytes, BusError> {
        if let Some(rest) = location.strip_prefix("object://") {
            let (bucket, name) =
                rest.split_once('/').ok_or_else(|| blob_err(location, "expected object://bucket/name"))?;
            self.check_own_blobs(bucket, location)?;
            let store = self.object_store(bucket).await?;
            let mut object = store.get(name).await.map_err(|e| obj_err(bucket, name, Cause::of(e)))?;
            let mut out = Vec::with_capacity(object.info().size);
            object.read_to_end(&mut out).await.map_err(|e| obj_err(bucket, name, Cause::other(e)))?;
            Ok(Bytes::from(out))
        } else if let Some(path) = location.strip_prefix("file://") {
            let bytes = tokio::fs::read(Path::new(path)).await.map_err(|e| file_err(location, e))?;
            Ok(Bytes::from(bytes))
        } else {
            Err(blob_err(location, "unknown scheme (expected object:// or file://)"))
        }
    }

    /// Size of a stored blob (to check an announcement before publishing it).
    pub async fn weights_size(&self, location: &str) -> Result<u64, BusError> {
        if let Some(rest) = location.strip_prefix("object://") {
            let (bucket, name) =
                rest.split_once('/').ok_or_else(|| blob_err(location, "expected object://bucket/name"))?;
            self.check_own_blobs(bucket, location)?;
            let store = self.object_store(bucket).await?;
            let info = store.info(name).await.map_err(|e| obj_err(bucket, name, Cause::of(e)))?;
            // the store keeps a deleted object's info, marked deleted: its blob is gone
            if info.deleted {
                return Err(blob_err(location, "deleted (an old version collected by checkpoint-sync)"));
            }
            Ok(info.size as u64)
        } else if let Some(path) = location.strip_prefix("file://") {
            let meta = tokio::fs::metadata(path).await.map_err(|e| file_err(location, e))?;
            Ok(meta.len())
        } else {
            Err(blob_err(location, "unknown scheme (expected object:// or file://)"))
        }
    }

    /// Deletes a blob (old versions).
    pub async fn delete_weights(&self, location: &str) -> Result<(), BusError> {
        if let Some(rest) = location.strip_prefix("object://") {
            let (bucket, name) =
                rest.split_once('/').ok_or_else(|| blob_err(location, "expected object://bucket/name"))?;
            self.check_own_blobs(bucket, location)?;
            let store = self.object_store(bucket).await?;
            store.delete(name).await.map_err(|e| obj_err(bucket, name, Cause::of(e)))
        } else if let Some(path) = location.strip_prefix("file://") {
            tokio::fs::remove_file(path).await.map_err(|e| file_err(location, e))
        } else {
            Err(blob_err(location, "unknown scheme"))
        }
    }

    /// The latest announced manifest, if any.
    pub async fn latest_manifest(&self) -> Result<Option<WeightManifest>, BusError> {
        let bucket = self.names().weights_bucket();
        let kv = self.key_value(bucket).await?;
        let value = kv.get("latest").await.map_err(|e| BusError::Kv {
            bucket: bucket.into(),
            key: "latest".into(),
            cause: Cause::of(e),
        })?;
        match value {
            None => Ok(None),
            Some(bytes) => WeightManifest::decode(bytes.as_ref())
                .map(Some)
                .map_err(|source| BusError::Decode { what: "weight manifest".into(), source }),
        }
    }
}
