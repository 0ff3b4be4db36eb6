//! Which external data file belongs to which checkpoint.
//!
//! A checkpoint with external data is two files, `<path>` and `<path>.data`, and
//! no filesystem renames two files at once: a crash between the two renames of a
//! save would leave the new data file beside the old checkpoint, and ONNX
//! Runtime's format has nothing to tell them apart. So ortckpt ends both files of
//! a pair with the same 32-byte trailer: a magic string and a random id. The
//! trailer is unreferenced padding to every flatbuffers reader (ONNX Runtime
//! included) and lies past every value in the data file.

/// Marks the trailer: the first 16 of its 32 bytes.
pub const PAIR_MAGIC: &[u8; 16] = b"ortckpt pair id\0";

/// Bytes in a trailer: the magic, then a 16-byte id.
pub const PAIR_TRAILER_LEN: usize = 32;

pub type PairId = [u8; 16];

/// A fresh id: unique across saves, processes and machines for all practical purposes.
pub fn new_pair_id() -> PairId {
    crate::random::unpredictable_128()
}

pub fn trailer(id: &PairId) -> [u8; PAIR_TRAILER_LEN] {
    let mut out = [0u8; PAIR_TRAILER_LEN];
    out[..16].copy_from_slice(PAIR_MAGIC);
    out[16..].copy_from_slice(id);
    out
}

/// The id a file ends with, if it ends with a trailer (files ONNX Runtime or older
/// writers made do not).
pub fn pair_id(file: &[u8]) -> Option<PairId> {
    let at = file.len().checked_sub(PAIR_TRAILER_LEN)?;
    let t = &file[at..];
    (t[..16] == PAIR_MAGIC[..]).then(|| t[16..].try_into().unwrap())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_differ_and_trailers_read_back() {
        let (a, b) = (new_pair_id(), new_pair_id());
        assert_ne!(a, b);
        let mut file = vec![7u8; 100];
        file.extend_from_slice(&trailer(&a));
        assert_eq!(pair_id(&file), Some(a));
        assert_eq!(pair_id(&file[..file.len() - 1]), None);
        assert_eq!(pair_id(&[0u8; 10]), None);
    }
}
