//! Packed little-endian arrays: the wire form of token ids (u32), masks (u8) and log-probs (f32).

use bytes::{BufMut, Bytes, BytesMut};

/// A packed field whose length is not a whole number of elements.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("packed {what}: {len} bytes is not a multiple of {width}")]
pub struct PackedLenError {
    pub what: &'static str,
    pub len: usize,
    pub width: usize,
}

pub fn pack_u32(values: &[u32]) -> Bytes {
    let mut out = BytesMut::with_capacity(values.len() * 4);
    for v in values {
        out.put_u32_le(*v);
    }
    out.freeze()
}

pub fn unpack_u32(bytes: &[u8]) -> Result<Vec<u32>, PackedLenError> {
    if !bytes.len().is_multiple_of(4) {
        return Err(PackedLenError { what: "u32", len: bytes.len(), width: 4 });
    }
    Ok(bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

pub fn pack_f32(values: &[f32]) -> Bytes {
    let mut out = BytesMut::with_capacity(values.len() * 4);
    for v in values {
        out.put_f32_le(*v);
    }
    out.freeze()
}

pub fn unpack_f32(bytes: &[u8]) -> Result<Vec<f32>, PackedLenError> {
    if !bytes.len().is_multiple_of(4) {
        return Err(PackedLenError { what: "f32", len: bytes.len(), width: 4 });
    }
    Ok(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

pub fn pack_u8(values: &[u8]) -> Bytes {
    Bytes::copy_from_slice(values)
}

/// Number of u32 elements in a packed field (no allocation).
pub fn u32_len(bytes: &[u8]) -> usize {
    bytes.len() / 4
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn u32_and_f32_round_trip_little_endian() {
        let ids = [0u32, 1, 151_643, u32::MAX];
        let packed = pack_u32(&ids);
        assert_eq!(&packed[4..8], &[1, 0, 0, 0]);
        assert_eq!(unpack_u32(&packed).unwrap(), ids);
        let lps = [-0.5f32, 0.0, -12.25];
        assert_eq!(unpack_f32(&pack_f32(&lps)).unwrap(), lps);
    }

    #[test]
    fn ragged_packed_field_is_an_error_naming_the_width() {
        let err = unpack_u32(&[1, 2, 3]).unwrap_err();
        assert_eq!(err, PackedLenError { what: "u32", len: 3, width: 4 });
        assert!(unpack_f32(&[0; 6]).is_err());
    }
}
