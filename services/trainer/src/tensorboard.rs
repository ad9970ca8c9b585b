//! TensorBoard event files written directly: TFRecord framing (length, masked CRC-32C of the length, the
//! record, masked CRC-32C of the record) around hand-encoded `tensorflow.Event` protobufs
//! (`wall_time` 1, `step` 2, `file_version` 3, `summary` 5 of `Summary.Value{tag 1, simple_value 2}`,
//! `session_log` 7). No Python and no protobuf dependency: the three messages are a dozen fields.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum TFRecord uses.
pub fn crc32c(data: &[u8]) -> u32 {
    static TABLE: std::sync::OnceLock<[u32; 256]> = std::sync::OnceLock::new();
    let table = TABLE.get_or_init(|| {
        let mut table = [0u32; 256];
        for (i, slot) in table.iter_mut().enumerate() {
            let mut c = i as u32;
            for _ in 0..8 {
                c = if c & 1 != 0 { 0x82f6_3b78 ^ (c >> 1) } else { c >> 1 };
            }
            *slot = c;
        }
        table
    });
    let mut crc = !0u32;
    for &b in data {
        crc = table[((crc ^ u32::from(b)) & 0xff) as usize] ^ (crc >> 8);
    }
    !crc
}

/// TFRecord's masking, so a CRC stored inside CRC'd data does not weaken it.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    let crc = crc32c(data);
    (crc.rotate_right(15)).wrapping_add(0xa282_ead8)
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn key(out: &mut Vec<u8>, field: u32, wire: u8) {
    varint(out, (u64::from(field) << 3) | u64::from(wire));
}

fn bytes_field(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    key(out, field, 2);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// The fields every event starts with: `wall_time` and `step`.
fn event_header(wall_time: f64, step: i64) -> Vec<u8> {
    let mut out = Vec::new();
    key(&mut out, 1, 1);
    out.extend_from_slice(&wall_time.to_le_bytes());
    key(&mut out, 2, 0);
    varint(&mut out, step as u64);
    out
}

/// An `Event` carrying one scalar summary per metric.
pub fn scalar_event(wall_time: f64, step: i64, scalars: &BTreeMap<String, f64>) -> Vec<u8> {
    let mut summary = Vec::new();
    for (tag, value) in scalars {
        let mut v = Vec::new();
        bytes_field(&mut v, 1, tag.as_bytes());
        key(&mut v, 2, 5);
        v.extend_from_slice(&(*value as f32).to_le_bytes());
        bytes_field(&mut summary, 1, &v);
    }
    let mut out = event_header(wall_time, step);
    bytes_field(&mut out, 5, &summary);
    out
}

/// One TFRecord: framing and checksums around `data`.
pub fn record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc32c(data).to_le_bytes());
    out
}

/// An open event file.
pub struct EventWriter {
    file: std::fs::File,
    path: PathBuf,
}

fn now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

impl EventWriter {
    /// Creates `dir/events.out.tfevents.<unix time>.<host>.<pid>.0` and writes the `brain.Event:2` header.
    /// `resumed_at`: the first step of a resumed run; a `SessionLog.START` at that step makes TensorBoard drop
    /// the older run's points from that step on, so the curve shows the continuation only once.
    pub fn create(dir: &Path, resumed_at: Option<u64>) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let host = std::env::var("HOSTNAME").ok().filter(|h| !h.is_empty()).unwrap_or_else(|| "jetrl".into());
        let path = dir.join(format!(
            "events.out.tfevents.{}.{}.{}.0",
            now() as u64,
            host.replace(['/', '\\'], "_"),
            std::process::id()
        ));
        let mut writer = Self { file: std::fs::File::create(&path)?, path };
        let mut header = event_header(now(), 0);
        bytes_field(&mut header, 3, b"brain.Event:2");
        writer.file.write_all(&record(&header))?;
        if let Some(step) = resumed_at {
            let mut restart = event_header(now(), step as i64);
            // SessionLog { status: START (1) }
            bytes_field(&mut restart, 7, &[0x08, 0x01]);
            writer.file.write_all(&record(&restart))?;
        }
        writer.file.flush()?;
        Ok(writer)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one event with every metric of a step as a scalar.
    pub fn scalars(&mut self, step: u64, metrics: &BTreeMap<String, f64>) -> std::io::Result<()> {
        let finite: BTreeMap<String, f64> =
            metrics.iter().filter(|(_, v)| v.is_finite()).map(|(k, v)| (k.clone(), *v)).collect();
        self.file.write_all(&record(&scalar_event(now(), step as i64, &finite)))?;
        self.file.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_the_standard_check_value() {
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(crc32c(b""), 0);
    }

    /// Reads records back, checking both checksums, and returns their payloads.
    fn read_records(bytes: &[u8]) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        let mut at = 0;
        while at < bytes.len() {
            let len_bytes = &bytes[at..at + 8];
            let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
            let len_crc = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap());
            assert_eq!(len_crc, masked_crc32c(len_bytes));
            let data = &bytes[at + 12..at + 12 + len];
            let data_crc = u32::from_le_bytes(bytes[at + 12 + len..at + 16 + len].try_into().unwrap());
            assert_eq!(data_crc, masked_crc32c(data));
            out.push(data.to_vec());
            at += 16 + len;
        }
        out
    }

    #[test]
    fn event_file_has_the_version_header_then_one_scalar_event_per_step() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path(), Some(3)).unwrap();
        let metrics = BTreeMap::from([("actor/pg_loss".to_string(), 0.5), ("bad".to_string(), f64::NAN)]);
        w.scalars(3, &metrics).unwrap();
        let records = read_records(&std::fs::read(w.path()).unwrap());
        assert_eq!(records.len(), 3);
        assert!(records[0].windows(13).any(|x| x == b"brain.Event:2"));
        assert!(records[1].ends_with(&[0x3a, 0x02, 0x08, 0x01]), "session log START");
        let event = &records[2];
        // step 3 as a varint after the wall time
        assert_eq!(&event[9..11], &[0x10, 0x03]);
        assert!(event.windows(13).any(|x| x == b"actor/pg_loss"));
        assert!(event.windows(4).any(|x| x == 0.5f32.to_le_bytes()));
        assert!(!event.windows(3).any(|x| x == b"bad"), "non-finite values are left out");
        assert!(w.path().file_name().unwrap().to_str().unwrap().starts_with("events.out.tfevents."));
    }
}
