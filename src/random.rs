//! Unpredictable 128-bit values: pair ids (seal::pairing) and temporary file names
//! (io), which another process must not be able to guess.

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

/// 16 bytes no other process can predict: SipHash, keyed from the OS's random source
/// (std's `RandomState`), of the time, the pid and a counter. Unique across calls,
/// processes and machines for all practical purposes.
pub fn unpredictable_128() -> [u8; 16] {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut out = [0u8; 16];
    for half in out.chunks_exact_mut(8) {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(nanos);
        h.write_u32(std::process::id());
        h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
        half.copy_from_slice(&h.finish().to_le_bytes());
    }
    out
}
