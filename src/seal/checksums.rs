//! Per-tensor checksums, kept in the checkpoint file where ONNX Runtime never looks.
//!
//! Every file ortckpt writes ends with the pair trailer (see [`super::pairing`]); just before
//! it sits a checksum block, unreferenced padding to every flatbuffers reader:
//!
//! ```text
//! sum of tensor 0 .. sum of tensor n-1   (u64 LE each, in the order the file lists them)
//! sum of the metadata                    (u64 LE: every byte before the block but the inline values)
//! n                                      (u32 LE)
//! version                                (u32 LE)
//! root                                   (u64 LE: the sum of the block's bytes before it, then the pair id)
//! magic                                  (16 bytes)
//! ```
//!
//! Sums are XXH3-64: above 10 GB/s on one core (so checking a file costs about what reading
//! it costs), with no CPU feature to detect at run time, unlike CRC32C's fast path; 64 bits
//! also leave chance collisions out of the question, which CRC32C's 32 do not across the
//! millions of tensors a run writes. It is no cryptographic digest (see the manager's
//! `digest="sha256"` for that).
//!
//! Files with a block also end their pair id with [`ID_MARK`]: the magic, the mark and the
//! trailer's own magic are three witnesses, so one flipped bit in any of them reads as a
//! damaged block, never as a file without one. A tensor without bytes of its own (strings,
//! nominal or empty tensors) has the sum of no bytes; its contents, if any, are metadata.

use xxhash_rust::xxh3::{xxh3_64, Xxh3};

use super::pairing::{PairId, PAIR_MAGIC, PAIR_TRAILER_LEN};

/// The block's last 16 bytes.
pub const BLOCK_MAGIC: &[u8; 16] = b"ortckpt sums xx3";

/// The block's layout version (readers refuse newer ones, naming it).
pub const BLOCK_VERSION: u32 = 1;

/// How the pair id of a file with a checksum block ends.
pub const ID_MARK: &[u8; 4] = b"xxh3";

/// count, version, root, magic.
const FOOTER_LEN: usize = 4 + 4 + 8 + 16;

/// One checksum, as the block and the manager's metadata record it.
pub type Sum = u64;

/// Bytes in the block of a checkpoint of `tensors` tensors.
pub fn block_len(tensors: usize) -> usize {
    8 * (tensors + 1) + FOOTER_LEN
}

/// The checksum of `bytes`.
pub fn sum(bytes: &[u8]) -> Sum {
    xxh3_64(bytes)
}

/// A checksum taken piece by piece, as the bytes go by.
#[derive(Clone, Default)]
pub struct Running(Xxh3);

impl Running {
    pub fn update(&mut self, piece: &[u8]) {
        self.0.update(piece);
    }

    pub fn finish(&self) -> Sum {
        self.0.digest()
    }
}

/// A pair id for a file with a block: random but for [`ID_MARK`] (96 random bits: a pair
/// id only has to differ from the few other saves of the same path).
pub fn marked(mut id: PairId) -> PairId {
    id[12..].copy_from_slice(ID_MARK);
    id
}

/// The pair id of a file without external data: derived from its checksums, so that saving
/// the same checkpoint twice writes the same bytes (a pair id only has to tell the saves of
/// an external pair apart; those draw theirs at random).
pub fn content_id(tensor_sums: &[Sum], metadata: Sum) -> PairId {
    let mut running = Running::default();
    for s in tensor_sums.iter().chain([&metadata]) {
        running.update(&s.to_le_bytes());
    }
    let low = running.finish();
    running.update(b"id");
    let high = running.finish();
    let mut id = [0u8; 16];
    id[..8].copy_from_slice(&low.to_le_bytes());
    id[8..].copy_from_slice(&high.to_le_bytes());
    marked(id)
}

/// The block's bytes.
///
/// # Panics
/// With 2^32 tensors or more (a checkpoint's tables alone would pass ONNX Runtime's 2 GiB).
pub fn block(tensor_sums: &[Sum], metadata: Sum, id: &PairId) -> Vec<u8> {
    let mut out = Vec::with_capacity(block_len(tensor_sums.len()));
    for s in tensor_sums.iter().chain([&metadata]) {
        out.extend_from_slice(&s.to_le_bytes());
    }
    let count = u32::try_from(tensor_sums.len()).expect("fewer than 2^32 tensors");
    out.extend_from_slice(&count.to_le_bytes());
    out.extend_from_slice(&BLOCK_VERSION.to_le_bytes());
    let root = root_of(&out, id);
    out.extend_from_slice(&root.to_le_bytes());
    out.extend_from_slice(BLOCK_MAGIC);
    out
}

fn root_of(body: &[u8], id: &PairId) -> Sum {
    let mut running = Running::default();
    running.update(body);
    running.update(id);
    running.finish()
}

/// A checksum block, read and checked against its own root.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Block {
    /// One per tensor, in file order.
    pub tensors: Vec<Sum>,
    pub metadata: Sum,
    /// Identifies the file's contents (and its pair id): what the manager records.
    pub root: Sum,
    /// Where the block starts in the file: the metadata sum covers the bytes before.
    pub start: usize,
}

/// The block of the file whose last bytes are `tail` (`file_len` bytes in all; `tail` may be
/// the whole file), if it has one. `Err` says why a block that should be there is damaged.
pub fn find(tail: &[u8], file_len: u64) -> Result<Option<Block>, String> {
    let Some(footer_at) = tail.len().checked_sub(FOOTER_AND_TRAILER_LEN) else {
        return Ok(None); // too short for a block (files of a few bytes are no checkpoints anyway)
    };
    let Some(footer) = Footer::read(&tail[footer_at..], file_len)? else {
        return Ok(None);
    };
    let room = tail.len() - PAIR_TRAILER_LEN;
    if footer.block_len() > room {
        return Err(footer.too_many());
    }
    footer.check(&tail[room - footer.block_len()..footer_at + 8])
}

/// A block's footer (its count and root) and the trailer after it, read from a file's last
/// [`FOOTER_AND_TRAILER_LEN`] bytes: what a reader needs to know how much more to read, checked
/// as far as they allow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Footer {
    /// The tensors the block claims (no more than the file can hold).
    pub count: usize,
    pub root: Sum,
    id: PairId,
    /// Where the block starts in the file.
    pub start: u64,
}

impl Footer {
    /// The footer in `last` (a file's last [`FOOTER_AND_TRAILER_LEN`] bytes; `file_len` bytes
    /// in all), if the file has a block. `Err` says why a block that should be there is damaged.
    pub fn read(last: &[u8], file_len: u64) -> Result<Option<Footer>, String> {
        let Ok(last) = <&[u8; FOOTER_AND_TRAILER_LEN]>::try_from(last) else {
            return Ok(None);
        };
        let (footer, trailer) = last.split_at(FOOTER_LEN);
        let witnesses = [
            trailer[..16] == PAIR_MAGIC[..],
            trailer[PAIR_TRAILER_LEN - ID_MARK.len()..] == ID_MARK[..],
            footer[FOOTER_LEN - 16..] == BLOCK_MAGIC[..],
        ];
        match witnesses.iter().filter(|&&w| w).count() {
            0 | 1 => return Ok(None), // ONNX Runtime's file, or an older ortckpt's
            2 => return Err("the checksum block or the trailer after it is damaged".to_owned()),
            _ => {}
        }
        let word = |at: usize| u32::from_le_bytes(footer[at..at + 4].try_into().unwrap());
        let (count, version) = (word(0) as usize, word(4));
        if version != BLOCK_VERSION {
            return Err(format!(
                "checksum block version {version}: this ortckpt reads version {BLOCK_VERSION} (a \
                 newer ortckpt wrote it, or the block is damaged)"
            ));
        }
        let mut found = Footer {
            count,
            root: u64::from_le_bytes(footer[8..16].try_into().unwrap()),
            id: trailer[16..].try_into().unwrap(),
            start: 0,
        };
        found.start = file_len
            .checked_sub((found.block_len() + PAIR_TRAILER_LEN) as u64)
            .ok_or_else(|| found.too_many())?;
        Ok(Some(found))
    }

    /// Bytes in the block.
    pub fn block_len(&self) -> usize {
        block_len(self.count)
    }

    /// Bytes of the block the root covers (the sums, the count and the version): from
    /// [`Footer::start`] on.
    pub fn body_len(&self) -> usize {
        self.block_len() - 16 - 8
    }

    fn too_many(&self) -> String {
        format!(
            "the checksum block claims {} tensors, more than the file holds",
            self.count
        )
    }

    /// Whether `body` (the [`Footer::body_len`] bytes from [`Footer::start`], fed to a
    /// [`Running`] sum, piece by piece as they are read) is the body this footer's root covers.
    pub fn covers(&self, mut body: Running) -> bool {
        body.update(&self.id);
        body.finish() == self.root
    }

    /// The block whose body is `body` (as [`Footer::covers`]), checked against its root.
    pub fn check(&self, body: &[u8]) -> Result<Option<Block>, String> {
        let mut running = Running::default();
        running.update(body);
        if body.len() != self.body_len() || !self.covers(running) {
            return Err("the checksum block is damaged (its own checksum differs)".to_owned());
        }
        let mut sums: Vec<Sum> = body[..8 * (self.count + 1)]
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let metadata = sums.pop().unwrap();
        Ok(Some(Block {
            tensors: sums,
            metadata,
            root: self.root,
            start: usize::try_from(self.start)
                .map_err(|_| "the file is too large to address".to_owned())?,
        }))
    }
}

/// The most bytes [`find`] needs from the end of a file of `tensors` tensors.
pub fn tail_len(tensors: usize) -> usize {
    block_len(tensors) + PAIR_TRAILER_LEN
}

/// Bytes of a file's end that hold the footer and trailer (what [`Footer::read`] reads).
pub const FOOTER_AND_TRAILER_LEN: usize = FOOTER_LEN + PAIR_TRAILER_LEN;

#[cfg(test)]
mod tests {
    use super::super::pairing::trailer;
    use super::*;

    fn file_with_block(sums: &[Sum]) -> (Vec<u8>, PairId) {
        let id = marked([9; 16]);
        let mut file = vec![1u8; 100];
        file.extend(block(sums, 77, &id));
        file.extend(trailer(&id));
        (file, id)
    }

    #[test]
    fn a_block_reads_back_with_its_root_and_start() {
        let (file, _) = file_with_block(&[1, 2, 3]);
        let found = find(&file, file.len() as u64).unwrap().unwrap();
        assert_eq!(
            (found.tensors, found.metadata, found.start),
            (vec![1, 2, 3], 77, 100)
        );
        // Only the end of the file is needed.
        let tail = &file[file.len() - tail_len(3)..];
        assert_eq!(find(tail, file.len() as u64).unwrap().unwrap().start, 100);
    }

    #[test]
    fn every_flipped_bit_of_block_or_trailer_is_caught() {
        let (file, _) = file_with_block(&[1, 2]);
        for at in 100..file.len() {
            for bit in 0..8 {
                let mut bad = file.clone();
                bad[at] ^= 1 << bit;
                let found = find(&bad, bad.len() as u64);
                assert!(found.is_err(), "byte {at} bit {bit}: {found:?}");
            }
        }
    }

    #[test]
    fn a_footer_is_read_and_bounded_from_the_last_bytes_alone() {
        let (file, _) = file_with_block(&[1, 2]);
        let last = &file[file.len() - FOOTER_AND_TRAILER_LEN..];
        let footer = Footer::read(last, file.len() as u64).unwrap().unwrap();
        assert_eq!((footer.count, footer.start), (2, 100));
        // A count the file cannot hold is refused before anything more is read.
        let mut bad = last.to_vec();
        bad[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        let why = Footer::read(&bad, file.len() as u64).unwrap_err();
        assert!(
            why.contains("claims 4294967295 tensors, more than the file holds"),
            "{why}"
        );
    }

    #[test]
    fn files_without_a_block_have_none() {
        assert_eq!(find(&[0u8; 10], 10), Ok(None));
        assert_eq!(find(&[5u8; 200], 200), Ok(None));
        // An older ortckpt's pair: a trailer with an unmarked id, no block.
        let mut old = vec![0u8; 100];
        old.extend(trailer(&[3; 16]));
        assert_eq!(find(&old, old.len() as u64), Ok(None));
    }
}
