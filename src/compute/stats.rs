//! Per-tensor statistics, change figures and histograms, each in one pass over the bytes.
//!
//! A tensor is cut into pieces of [`PIECE`] elements, shared out among threads. Each piece is
//! widened to float64 once into a buffer that stays in the cache, and its figures are taken
//! from there (the piece's own mean first, then the squared deviations from it: two passes
//! over the cache, one over memory). The pieces' figures are then combined in element order
//! with Chan's formula, so a result does not depend on the number of threads.
//!
//! Each piece's values are first shifted by one of its own (its first finite value): the
//! means, and the differences between the pieces' means (the shifts' difference plus the
//! means'), are then of the spread, not of the offset, so the std of 1e8 plus noise of 1e-3
//! keeps its digits. The L2 norm is of the
//! values themselves (their sum of squares, with a scale of its own).
//!
//! Figures are computed in float64 scaled by a power of two (exact) where a piece's values lie
//! beyond 2^±480: squares of float64 values near the largest (or smallest) would overflow (or
//! underflow) otherwise. A figure is infinite only where its true value is beyond float64.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::sync::OnceLock;

use super::floats::{bf16_bits_to_f32, f16_bits_to_f32};
use super::{element_size, populate, Input};
use crate::format::DataType;
use crate::{Error, Result};

/// Elements taken at a time: widened to float64 they fill 128 KiB, which stays in the cache
/// for the passes over them.
pub const PIECE: usize = 1 << 14;

/// Values whose magnitude lies beyond 2^±SAFE are scaled: squares and the products of
/// Chan's formula stay far from float64's limits for any number of elements (2^60 and up).
const SAFE: i32 = 480;

/// Whether the kernels here compute tensors of this type: every numeric type ortckpt stores
/// but the complex ones (those and strings are left to the caller).
pub fn covers(data_type: DataType) -> bool {
    use DataType::*;
    matches!(
        data_type,
        Float
            | Double
            | Float16
            | Bfloat16
            | Float8E4M3Fn
            | Float8E4M3Fnuz
            | Float8E5M2
            | Float8E5M2Fnuz
            | Float8E8M0
            | Uint4
            | Int4
            | Float4E2M1
            | Uint2
            | Int2
            | Int8
            | Int16
            | Int32
            | Int64
            | Uint8
            | Uint16
            | Uint32
            | Uint64
            | Bool
    )
}

/// One tensor's values: its type, little-endian bytes and number of elements. The packed
/// sub-byte types hold two (4-bit) or four (2-bit) elements a byte, the first in the lowest
/// bits (ONNX's packing); their last byte may hold fewer than that.
pub struct Tensor<'a> {
    pub data_type: DataType,
    pub input: Input<'a>,
    pub elements: usize,
}

impl<'a> Tensor<'a> {
    /// A tensor of a type of whole bytes, as many elements as its bytes hold (a ragged length
    /// or a sub-byte type is refused by the kernels).
    pub fn whole(data_type: DataType, input: Input<'a>) -> Tensor<'a> {
        let elements = input.bytes.len() / element_size(data_type).max(1);
        Tensor {
            data_type,
            input,
            elements,
        }
    }

    /// This tensor as one job of [`by_piece`].
    fn extent(&self) -> Extent {
        Extent {
            elements: self.elements,
            data_type: self.data_type,
            sides: 1,
        }
    }
}

/// A job of [`by_piece`]: its elements, their type, and how many tensors of them it reads
/// (a piece's bytes are counted that many times in `progress`).
#[derive(Clone, Copy)]
struct Extent {
    elements: usize,
    data_type: DataType,
    sides: u64,
}

/// The bytes that hold `range`'s elements of a tensor of `data_type` (`range.start` a multiple
/// of the elements a byte holds: a piece's start).
#[inline(always)]
fn byte_range(data_type: DataType, range: &Range<usize>) -> Range<usize> {
    let bits = data_type.bits().unwrap_or(8) as usize;
    range.start * bits / 8..(range.end * bits).div_ceil(8)
}

/// A tensor's statistics. The figures are of its finite values (NaN where there are none).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Figures {
    pub nan: u64,
    pub posinf: u64,
    pub neginf: u64,
    pub finite: u64,
    pub min: f64,
    pub max: f64,
    pub mean: f64,
    /// Population standard deviation (ddof = 0).
    pub std: f64,
    pub l2: f64,
}

/// The change from tensor `a` to tensor `b` (same type and length).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Change {
    /// Elements that differ (NaN equals NaN).
    pub changed: u64,
    /// Of those, the pairs where either side is NaN or infinite.
    pub nonfinite: u64,
    /// L2 norm of `b - a` over the pairs where both are finite.
    pub l2: f64,
    /// L2 norm of `a`'s finite values.
    pub norm_a: f64,
    /// Largest `|b - a|` over the pairs where both are finite (0 when there are none).
    pub max_abs: f64,
    /// `l2 / norm_a`, from the scaled sums: finite where its true value is, though both norms
    /// may be beyond float64 (values near its largest); NaN when `norm_a` is 0.
    pub relative: f64,
}

/// Statistics of every tensor, in order. `progress` is told the bytes of each piece done
/// (one call at a time); an error from it stops the pass.
///
/// # Errors
/// A type [`covers`] refuses, a length that is not a whole number of elements, or
/// `progress`'s own error.
pub fn statistics(
    tensors: &[Tensor<'_>],
    threads: usize,
    progress: &mut (dyn FnMut(u64) -> Result<()> + Send),
) -> Result<Vec<Figures>> {
    for t in tensors {
        check(t)?;
    }
    let lengths: Vec<_> = tensors.iter().map(Tensor::extent).collect();
    let parts = by_piece(&lengths, threads, progress, |job, range, scratch| {
        dispatch!(piece_moments(&tensors[job], range, scratch))
    })?;
    Ok(parts
        .into_iter()
        .map(|pieces| {
            let total = pieces.into_iter().fold(Moments::EMPTY, Moments::merge);
            total.figures()
        })
        .collect())
}

/// The change figures of every pair `(a, b)`, in order (see [`statistics`] for `progress`).
///
/// # Errors
/// As [`statistics`], and a pair whose types or lengths differ.
pub fn changes(
    pairs: &[(Tensor<'_>, Tensor<'_>)],
    threads: usize,
    progress: &mut (dyn FnMut(u64) -> Result<()> + Send),
) -> Result<Vec<Change>> {
    for (a, b) in pairs {
        check(a)?;
        check(b)?;
        if a.data_type != b.data_type || a.elements != b.elements {
            return Err(Error::invalid_state(
                "statistics: a pair of tensors of different types or lengths",
            ));
        }
    }
    let lengths: Vec<_> = pairs
        .iter()
        .map(|(a, _)| Extent {
            sides: 2,
            ..a.extent()
        })
        .collect();
    let parts = by_piece(&lengths, threads, progress, |job, range, scratch| {
        let (a, b) = &pairs[job];
        dispatch!(piece_change(a, b, range, scratch))
    })?;
    Ok(parts
        .into_iter()
        .map(|pieces| {
            let total = pieces
                .into_iter()
                .fold(PieceChange::EMPTY, PieceChange::merge);
            Change {
                changed: total.changed,
                nonfinite: total.nonfinite,
                l2: total.diff.value(),
                norm_a: total.a.value(),
                max_abs: total.max_abs,
                relative: total.diff.over(total.a),
            }
        })
        .collect())
}

/// Counts of `tensor`'s finite values in the equal bins between `edges` (`bins + 1` of them,
/// ascending, as `numpy.linspace` makes them), as `numpy.histogram` counts: a value equal to
/// the last edge is in the last bin; values outside the edges are not counted.
///
/// # Errors
/// As [`statistics`], and fewer than two edges or edges that are not finite.
pub fn histogram(tensor: &Tensor<'_>, edges: &[f64], threads: usize) -> Result<Vec<u64>> {
    check(tensor)?;
    let bins = edges.len().saturating_sub(1);
    let (Some(&first), Some(&last)) = (edges.first(), edges.last()) else {
        return Err(Error::invalid_state("histogram: no edges"));
    };
    if bins == 0
        || !edges.iter().all(|e| e.is_finite())
        || !(last - first).is_finite()
        || edges.windows(2).any(|pair| pair[1] < pair[0])
    {
        return Err(Error::invalid_state(format!(
            "histogram: edges {first}..{last} ({bins} bins) are not finite, increasing bins"
        )));
    }
    let denominator = last - first;
    let parts = by_piece(
        &[tensor.extent()],
        threads,
        &mut |_| Ok(()),
        |_, range, scratch| {
            let mut counts = vec![0u64; bins];
            for &x in scratch.widen(tensor, range, 0).iter() {
                if !(x >= first && x <= last) {
                    continue; // NaN, infinities and values outside the range
                }
                // NumPy's steps: the bin by arithmetic, then set right by the edges (one step for
                // equal bins; as many as it takes for edges of any widths, as its searchsorted).
                let mut i = (((x - first) / denominator) * bins as f64) as usize;
                i = i.min(bins - 1);
                while i > 0 && x < edges[i] {
                    i -= 1;
                }
                while i != bins - 1 && x >= edges[i + 1] {
                    i += 1;
                }
                counts[i] += 1;
            }
            counts
        },
    )?;
    let mut counts = vec![0u64; bins];
    for piece in parts.into_iter().flatten() {
        counts.iter_mut().zip(piece).for_each(|(c, n)| *c += n);
    }
    Ok(counts)
}

fn check(tensor: &Tensor<'_>) -> Result<()> {
    if !covers(tensor.data_type) {
        return Err(Error::invalid_state(format!(
            "statistics: no kernel for {:?} tensors",
            tensor.data_type
        )));
    }
    let want = u64::try_from(tensor.elements)
        .ok()
        .and_then(|n| tensor.data_type.byte_len(n));
    if want != Some(tensor.input.bytes.len() as u64) {
        return Err(Error::invalid_state(format!(
            "statistics: {} bytes are not whole {:?} elements ({} of them)",
            tensor.input.bytes.len(),
            tensor.data_type,
            tensor.elements
        )));
    }
    Ok(())
}

/// Calls `name(args)`, or where the CPU has AVX2 its twin `name_avx2(args)` compiled for it:
/// twice the lanes of the baseline's SSE2, the same IEEE operations one by one (no fused
/// multiply-add), so the same results.
macro_rules! dispatch {
    ($name:ident($($arg:expr),*)) => {{
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU has AVX2 (checked just above).
                unsafe { avx2::$name($($arg),*) }
            } else {
                $name($($arg),*)
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            $name($($arg),*)
        }
    }};
}
use dispatch;

/// The hot loops compiled for AVX2 (see [`dispatch`]).
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;

    #[target_feature(enable = "avx2")]
    pub(super) fn piece_moments(
        tensor: &Tensor<'_>,
        range: Range<usize>,
        scratch: &mut Scratch,
    ) -> Moments {
        super::piece_moments(tensor, range, scratch)
    }

    #[target_feature(enable = "avx2")]
    pub(super) fn piece_change(
        a: &Tensor<'_>,
        b: &Tensor<'_>,
        range: Range<usize>,
        scratch: &mut Scratch,
    ) -> PieceChange {
        super::piece_change(a, b, range, scratch)
    }
}

#[inline(always)]
fn piece_moments(tensor: &Tensor<'_>, range: Range<usize>, scratch: &mut Scratch) -> Moments {
    moments(scratch.widen(tensor, range, 0))
}

#[inline(always)]
fn piece_change(
    a: &Tensor<'_>,
    b: &Tensor<'_>,
    range: Range<usize>,
    scratch: &mut Scratch,
) -> PieceChange {
    scratch.widen(a, range.clone(), 0);
    scratch.widen(b, range, 1);
    let [wa, wb] = &mut scratch.wide;
    change_of(wa, wb)
}

/// Runs `f` over every piece of every job (`lengths`: each job's elements, and the bytes
/// each stands for in `progress`) on up to `threads` threads; returns each job's results in
/// element order.
fn by_piece<T: Send>(
    lengths: &[Extent],
    threads: usize,
    progress: &mut (dyn FnMut(u64) -> Result<()> + Send),
    f: impl Fn(usize, Range<usize>, &mut Scratch) -> T + Sync,
) -> Result<Vec<Vec<T>>> {
    let pieces: Vec<(usize, Range<usize>)> = lengths
        .iter()
        .enumerate()
        .flat_map(|(job, &Extent { elements: n, .. })| {
            (0..n)
                .step_by(PIECE)
                .map(move |s| (job, s..n.min(s + PIECE)))
        })
        .collect();
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let error: Mutex<Option<Error>> = Mutex::new(None);
    let progress = Mutex::new(progress);
    let done: Mutex<Vec<(usize, T)>> = Mutex::new(Vec::with_capacity(pieces.len()));
    let work = || {
        let mut scratch = Scratch::default();
        let mut mine = Vec::new();
        loop {
            let index = next.fetch_add(1, Ordering::Relaxed);
            if index >= pieces.len() || stop.load(Ordering::Relaxed) {
                break;
            }
            let (job, range) = pieces[index].clone();
            let Extent {
                data_type, sides, ..
            } = lengths[job];
            let bytes = byte_range(data_type, &range).len() as u64 * sides;
            mine.push((index, f(job, range, &mut scratch)));
            let told = progress.lock().unwrap_or_else(|p| p.into_inner())(bytes);
            if let Err(e) = told {
                stop.store(true, Ordering::Relaxed);
                error
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get_or_insert(e);
                break;
            }
        }
        done.lock().unwrap_or_else(|p| p.into_inner()).extend(mine);
    };
    let threads = threads.clamp(1, pieces.len().max(1));
    std::thread::scope(|scope| {
        for _ in 1..threads {
            scope.spawn(work);
        }
        work();
    });
    if let Some(e) = error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    let mut done = done.into_inner().unwrap_or_else(|p| p.into_inner());
    done.sort_unstable_by_key(|(index, _)| *index);
    let mut out: Vec<Vec<T>> = lengths.iter().map(|_| Vec::new()).collect();
    for (index, result) in done {
        out[pieces[index].0].push(result);
    }
    Ok(out)
}

/// A thread's buffers: up to two tensors' pieces widened to float64.
#[derive(Default)]
struct Scratch {
    wide: [Vec<f64>; 2],
}

impl Scratch {
    /// The elements `range` of `tensor` as float64 in buffer `slot`, read once from memory;
    /// the pages of a mapping the caller may drop are dropped once read.
    #[inline(always)]
    fn widen(&mut self, tensor: &Tensor<'_>, range: Range<usize>, slot: usize) -> &mut [f64] {
        let bytes = &tensor.input.bytes[byte_range(tensor.data_type, &range)];
        let out = &mut self.wide[slot];
        out.resize(range.len(), 0.0);
        if let Some(mapping) = &tensor.input.release {
            if bytes.len() >= POPULATE_FROM {
                populate(bytes);
            }
            widen(tensor.data_type, bytes, out);
            drop_behind(bytes, mapping);
        } else {
            widen(tensor.data_type, bytes, out);
        }
        out
    }
}

/// How often pages are dropped: each time a piece ends a window of this size. Linux (6.x,
/// large folios) maps a file's pages in by whole folios, far beyond the 64 KiB fault-around
/// window (measured: dropping only the 64 KiB windows around each piece left a quarter of a
/// 512 MiB file mapped; dropping the 2 MiB window behind, an eighth of a file warmed by
/// `read()`), so everything behind the piece is dropped, from the mapping's start.
const BEHIND: usize = 2 << 20;

/// Pieces from this size are mapped in with one call (MADV_POPULATE_READ) rather than by a
/// fault every folio; for smaller ones the call costs more than the faults it saves.
const POPULATE_FROM: usize = 64 << 10;

/// Where `bytes` end a [`BEHIND`] window (counted from the mapping's start): drops the pages
/// of `mapping` up to their end from this process's memory (MADV_DONTNEED; pages another
/// thread is reading are faulted in again). Elsewhere nothing: one call a window rather than
/// one a piece (16,000 small tensors make 16,000 pieces).
fn drop_behind(bytes: &[u8], mapping: &Range<usize>) {
    let (address, base) = (bytes.as_ptr() as usize, mapping.start);
    let Some(offset) = address.checked_sub(base) else {
        return;
    };
    let last = offset + bytes.len();
    if offset / BEHIND == last / BEHIND && last < mapping.end - base {
        return;
    }
    // SAFETY: sysconf has no preconditions.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
        .unwrap_or(4096)
        .max(1);
    let start = base.div_ceil(page) * page;
    let end = (address + bytes.len())
        .next_multiple_of(page)
        .min(mapping.end / page * page);
    if end > start {
        // SAFETY: the range lies inside `mapping`, which the caller promised (Input::release)
        // is a private file mapping nobody wrote: later reads fault the same bytes in again.
        // A failure only leaves the pages in memory.
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED);
        }
    }
}

/// Little-endian elements of `data_type` as float64 (exactly as NumPy's `astype(float64)`:
/// exact for all but 64-bit integers, which round to nearest).
#[inline(always)]
fn widen(data_type: DataType, bytes: &[u8], out: &mut [f64]) {
    macro_rules! each {
        ($n:literal, $f:expr) => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact($n)) {
                let b: [u8; $n] = b.try_into().unwrap_or([0; $n]);
                *o = $f(b);
            }
        };
    }
    use DataType::*;
    match data_type {
        Float => each!(4, |b| f64::from(f32::from_le_bytes(b))),
        Double => each!(8, f64::from_le_bytes),
        Float16 => each!(2, |b| f64::from(f16_bits_to_f32(u16::from_le_bytes(b)))),
        Bfloat16 => each!(2, |b| f64::from(bf16_bits_to_f32(u16::from_le_bytes(b)))),
        Int8 => each!(1, |b| f64::from(i8::from_le_bytes(b))),
        Uint8 => each!(1, |b: [u8; 1]| f64::from(b[0])),
        Bool => each!(1, |b: [u8; 1]| f64::from(u8::from(b[0] != 0))),
        Int16 => each!(2, |b| f64::from(i16::from_le_bytes(b))),
        Uint16 => each!(2, |b| f64::from(u16::from_le_bytes(b))),
        Int32 => each!(4, |b| f64::from(i32::from_le_bytes(b))),
        Uint32 => each!(4, |b| f64::from(u32::from_le_bytes(b))),
        Int64 => each!(8, |b| i64::from_le_bytes(b) as f64),
        Uint64 => each!(8, |b| u64::from_le_bytes(b) as f64),
        Float8E4M3Fn | Float8E4M3Fnuz | Float8E5M2 | Float8E5M2Fnuz | Float8E8M0 => {
            let table = float8_table(data_type);
            for (o, b) in out.iter_mut().zip(bytes) {
                *o = table[usize::from(*b)];
            }
        }
        Uint4 | Int4 | Float4E2M1 => unpack(nibble_table(data_type), bytes, out),
        Uint2 | Int2 => unpack(crumb_table(data_type), bytes, out),
        _ => out.fill(f64::NAN), // refused by check() before any pass
    }
}

/// The `out.len()` elements packed `K` a byte in `bytes`, each byte's `K` values looked up at
/// once (the fields of the last byte beyond the tensor's end are padding, left out).
#[inline(always)]
fn unpack<const K: usize>(table: &[[f64; K]; 256], bytes: &[u8], out: &mut [f64]) {
    let mut chunks = out.chunks_exact_mut(K);
    for (o, &b) in (&mut chunks).zip(bytes) {
        o.copy_from_slice(&table[usize::from(b)]);
    }
    let tail = chunks.into_remainder();
    if let (false, Some(&b)) = (tail.is_empty(), bytes.last()) {
        let n = tail.len();
        tail.copy_from_slice(&table[usize::from(b)][..n]);
    }
}

/// For each byte, the values of the `K` fields of `8 / K` bits it holds (the first in the
/// lowest bits), as float64.
fn packed<const K: usize>(data_type: DataType) -> [[f64; K]; 256] {
    let bits = 8 / K;
    let mask = (1u8 << bits) - 1;
    std::array::from_fn(|byte| {
        std::array::from_fn(|i| sub_byte_value(data_type, (byte as u8 >> (i * bits)) & mask))
    })
}

/// The two values of every byte of a 4-bit type (UINT4, INT4, FLOAT4E2M1), built once.
fn nibble_table(data_type: DataType) -> &'static [[f64; 2]; 256] {
    use DataType::*;
    static TABLES: OnceLock<[[[f64; 2]; 256]; 3]> = OnceLock::new();
    let tables = TABLES.get_or_init(|| [Uint4, Int4, Float4E2M1].map(packed::<2>));
    &tables[match data_type {
        Uint4 => 0,
        Int4 => 1,
        _ => 2,
    }]
}

/// The four values of every byte of a 2-bit type (UINT2, INT2), built once.
fn crumb_table(data_type: DataType) -> &'static [[f64; 4]; 256] {
    use DataType::*;
    static TABLES: OnceLock<[[[f64; 4]; 256]; 2]> = OnceLock::new();
    let tables = TABLES.get_or_init(|| [Uint2, Int2].map(packed::<4>));
    &tables[usize::from(data_type == Int2)]
}

/// One field of a packed sub-byte type (its low bits), as ONNX (and ml_dtypes) define them:
/// UINT4 0..15, INT4 -8..7, UINT2 0..3, INT2 -2..1 (two's complement), FLOAT4E2M1 a sign, two
/// exponent bits (bias 1) and one mantissa bit, no infinity and no NaN (0b1000 is -0).
fn sub_byte_value(data_type: DataType, field: u8) -> f64 {
    use DataType::*;
    match data_type {
        Uint4 | Uint2 => f64::from(field),
        Int4 => f64::from(((field << 4) as i8) >> 4),
        Int2 => f64::from(((field << 6) as i8) >> 6),
        _ => {
            let (exponent, mantissa) = (i32::from((field >> 1) & 0b11), f64::from(field & 1));
            let magnitude = if exponent == 0 {
                mantissa * 0.5
            } else {
                (1.0 + mantissa * 0.5) * pow2(exponent - 1)
            };
            if field & 0b1000 != 0 {
                -magnitude
            } else {
                magnitude
            }
        }
    }
}

/// The 256 values of a float8 type, as float64 (exactly: every float8 value is one), built once.
pub(crate) fn float8_table(data_type: DataType) -> &'static [f64; 256] {
    static TABLES: OnceLock<[[f64; 256]; 5]> = OnceLock::new();
    let tables = TABLES.get_or_init(|| {
        use DataType::*;
        [
            Float8E4M3Fn,
            Float8E4M3Fnuz,
            Float8E5M2,
            Float8E5M2Fnuz,
            Float8E8M0,
        ]
        .map(|t| std::array::from_fn(|bits| float8_value(t, bits as u8)))
    });
    match data_type {
        DataType::Float8E4M3Fn => &tables[0],
        DataType::Float8E4M3Fnuz => &tables[1],
        DataType::Float8E5M2 => &tables[2],
        DataType::Float8E5M2Fnuz => &tables[3],
        _ => &tables[4],
    }
}

/// One float8 value, as ONNX (and ml_dtypes) define the four types: E4M3FN has no infinity and
/// one NaN pattern (all ones, either sign); E5M2 is IEEE-like (exponent all ones: infinity or
/// NaN); the FNUZ types have no infinity, no negative zero, and NaN is 0x80. E8M0 (a scale:
/// no sign, no mantissa) is 2^(bits - 127), NaN at 0xFF.
fn float8_value(data_type: DataType, bits: u8) -> f64 {
    use DataType::*;
    if data_type == Float8E8M0 {
        return if bits == 0xff {
            f64::NAN
        } else {
            pow2(i32::from(bits) - 127)
        };
    }
    let (mantissa_bits, bias) = match data_type {
        Float8E4M3Fn => (3, 7),
        Float8E4M3Fnuz => (3, 8),
        Float8E5M2 => (2, 15),
        _ => (2, 16),
    };
    let exponent_mask = (1u8 << (7 - mantissa_bits)) - 1;
    let exponent = (bits >> mantissa_bits) & exponent_mask;
    let mantissa = bits & ((1 << mantissa_bits) - 1);
    let fnuz = matches!(data_type, Float8E4M3Fnuz | Float8E5M2Fnuz);
    if fnuz && bits == 0x80 {
        return f64::NAN;
    }
    if data_type == Float8E4M3Fn && exponent == exponent_mask && mantissa == 0b111 {
        return f64::NAN;
    }
    if data_type == Float8E5M2 && exponent == exponent_mask {
        return if mantissa == 0 {
            if bits & 0x80 != 0 {
                f64::NEG_INFINITY
            } else {
                f64::INFINITY
            }
        } else {
            f64::NAN
        };
    }
    let m = mantissa_bits;
    let magnitude = if exponent == 0 {
        f64::from(mantissa) * pow2(1 - bias - m)
    } else {
        f64::from((1u8 << mantissa_bits) + mantissa) * pow2(i32::from(exponent) - bias - m)
    };
    if bits & 0x80 != 0 {
        -magnitude
    } else {
        magnitude
    }
}

/// `2^k` exactly (subnormal below 2^-1022, 0 below 2^-1074, infinity above 2^1023).
fn pow2(k: i32) -> f64 {
    match k {
        1024.. => f64::INFINITY,
        -1022..=1023 => f64::from_bits(((k + 1023) as u64) << 52),
        -1074..=-1023 => f64::from_bits(1u64 << (k + 1074)),
        _ => 0.0,
    }
}

/// The power of two the values of a piece whose largest magnitude is `a` are divided by: 0
/// (no scaling) within 2^±SAFE, else `a`'s exponent (the scaled largest in [1, 2)); for
/// zeros the smallest, so that any other piece's scale wins when they are combined.
fn scale_for(a: f64) -> i32 {
    if a == 0.0 {
        return -1022;
    }
    if !a.is_finite() || (pow2(-SAFE)..=pow2(SAFE)).contains(&a) {
        return 0;
    }
    let exponent = ((a.to_bits() >> 52) & 0x7ff) as i32 - 1023;
    exponent.clamp(-1022, 1023)
}

/// The moments of a run of finite values less `shift`, in units of `2^scale`, and the run's
/// counts, min and max (of the values themselves).
#[derive(Clone, Copy, Debug)]
struct Moments {
    n: u64,
    nan: u64,
    posinf: u64,
    neginf: u64,
    min: f64,
    max: f64,
    /// What the values are less (one of them, within 2^±SAFE, or 0).
    shift: f64,
    scale: i32,
    mean: f64,
    /// Sum of squared deviations from `mean`.
    m2: f64,
    /// Sum of squares of the values themselves.
    squares: Norm,
}

impl Moments {
    const EMPTY: Moments = Moments {
        n: 0,
        nan: 0,
        posinf: 0,
        neginf: 0,
        min: f64::INFINITY,
        max: f64::NEG_INFINITY,
        shift: 0.0,
        scale: i32::MIN,
        mean: 0.0,
        m2: 0.0,
        squares: Norm::ZERO,
    };

    /// The moments in units of `2^to` (`to` at least `scale`; what falls below float64's
    /// range is negligible beside the values of the larger scale).
    fn rescaled(self, to: i32) -> Moments {
        if self.n == 0 || to == self.scale {
            return Moments { scale: to, ..self };
        }
        let shift = self.scale.saturating_sub(to).max(-4000);
        Moments {
            scale: to,
            mean: self.mean * pow2(shift),
            m2: self.m2 * pow2(2 * shift),
            ..self
        }
    }

    /// Two runs as one (Chan, Golub and LeVeque's pairwise update).
    fn merge(self, other: Moments) -> Moments {
        let counts = Moments {
            nan: self.nan + other.nan,
            posinf: self.posinf + other.posinf,
            neginf: self.neginf + other.neginf,
            min: self.min.min(other.min),
            max: self.max.max(other.max),
            ..self
        };
        if other.n == 0 {
            return counts;
        }
        if self.n == 0 {
            return other.merge_counts(counts);
        }
        // The merged run keeps `self`'s shift; the means differ by the shifts' difference
        // (exact where the shifts are within a factor 2) plus the means' own.
        let apart = other.shift - self.shift;
        let scale = self.scale.max(other.scale).max(scale_for(apart.abs()));
        let (a, b) = (self.rescaled(scale), other.rescaled(scale));
        let n = a.n + b.n;
        let delta = apart * pow2(-scale) + (b.mean - a.mean);
        let share = b.n as f64 / n as f64;
        Moments {
            n,
            scale,
            mean: a.mean + delta * share,
            m2: a.m2 + b.m2 + delta * delta * (a.n as f64 * share),
            squares: a.squares.merge(b.squares),
            ..counts
        }
    }

    /// These moments with the counts, min and max of `counts`.
    fn merge_counts(self, counts: Moments) -> Moments {
        Moments {
            nan: counts.nan,
            posinf: counts.posinf,
            neginf: counts.neginf,
            min: counts.min,
            max: counts.max,
            ..self
        }
    }

    fn figures(self) -> Figures {
        let (min, max, mean, std, l2) = if self.n == 0 {
            (f64::NAN, f64::NAN, f64::NAN, f64::NAN, f64::NAN)
        } else {
            let unit = |x: f64| {
                // x * 2^scale, in two steps where 2^scale alone is not a float64.
                let half = self.scale / 2;
                x * pow2(half) * pow2(self.scale - half)
            };
            let mean = (self.shift + unit(self.mean)).clamp(self.min, self.max);
            let std = unit((self.m2 / self.n as f64).sqrt());
            (self.min, self.max, mean, std, self.squares.value())
        };
        Figures {
            nan: self.nan,
            posinf: self.posinf,
            neginf: self.neginf,
            finite: self.n,
            min,
            max,
            mean,
            std,
            l2,
        }
    }
}

/// The moments of one piece's values (the buffer is reused: its finite values are moved to
/// its front, shifted and scaled there).
#[inline(always)]
fn moments(values: &mut [f64]) -> Moments {
    // Min and max in eight lanes, and a probe that turns NaN if any value is NaN or infinite
    // (x * 0 is 0 for every finite x): plain vector min, max, multiply and add.
    let (mut lo, mut hi, mut probe) = ([f64::INFINITY; 8], [f64::NEG_INFINITY; 8], [0.0f64; 8]);
    let mut blocks = values.chunks_exact(8);
    for block in &mut blocks {
        for (((l, h), p), &x) in lo.iter_mut().zip(&mut hi).zip(&mut probe).zip(block) {
            *l = if x < *l { x } else { *l };
            *h = if x > *h { x } else { *h };
            *p += x * 0.0;
        }
    }
    for (((l, h), p), &x) in lo
        .iter_mut()
        .zip(&mut hi)
        .zip(&mut probe)
        .zip(blocks.remainder())
    {
        *l = if x < *l { x } else { *l };
        *h = if x > *h { x } else { *h };
        *p += x * 0.0;
    }
    let mut min = lo
        .iter()
        .copied()
        .fold(f64::INFINITY, |m, x| if x < m { x } else { m });
    let mut max = hi
        .iter()
        .copied()
        .fold(f64::NEG_INFINITY, |m, x| if x > m { x } else { m });
    let (mut nan, mut posinf, mut neginf, mut n) = (0u64, 0u64, 0u64, values.len());
    if !pairwise(&probe).is_finite() {
        // Rare: count them by kind, move the finite values to the front, and take the min
        // and max of those alone.
        (n, min, max) = (0, f64::INFINITY, f64::NEG_INFINITY);
        for i in 0..values.len() {
            let x = values[i];
            nan += u64::from(x.is_nan());
            posinf += u64::from(x == f64::INFINITY);
            neginf += u64::from(x == f64::NEG_INFINITY);
            values[n] = x;
            if x.is_finite() {
                n += 1;
                min = if x < min { x } else { min };
                max = if x > max { x } else { max };
            }
        }
    }
    let finite = &mut values[..n];
    let mut m = Moments {
        n: n as u64,
        nan,
        posinf,
        neginf,
        min,
        max,
        ..Moments::EMPTY
    };
    if n == 0 {
        return m;
    }
    // The shift: the first finite value, where no difference from it can overflow.
    m.shift = Some(finite[0])
        .filter(|x| (pow2(-SAFE)..=pow2(SAFE)).contains(&x.abs()))
        .unwrap_or(0.0);
    let shift = m.shift;
    // One pass: the values' squares (at a scale of their own), and the values less `shift`
    // at theirs, stored back, and summed.
    let square_scale = scale_for(min.abs().max(max.abs()));
    m.scale = scale_for((min - shift).abs().max((max - shift).abs()));
    let (sx, s) = (pow2(-square_scale), pow2(-m.scale));
    let (mut squares, mut sums) = ([0.0f64; 8], [0.0f64; 8]);
    let mut blocks = finite.chunks_exact_mut(8);
    for block in &mut blocks {
        for ((q, t), x) in squares.iter_mut().zip(&mut sums).zip(block) {
            let v = *x * sx;
            *q += v * v;
            *x = (*x - shift) * s;
            *t += *x;
        }
    }
    for ((q, t), x) in squares
        .iter_mut()
        .zip(&mut sums)
        .zip(blocks.into_remainder())
    {
        let v = *x * sx;
        *q += v * v;
        *x = (*x - shift) * s;
        *t += *x;
    }
    m.squares = Norm {
        scale: square_scale,
        ssq: pairwise(&squares),
    };
    m.mean = pairwise(&sums) / n as f64;
    let mean = m.mean;
    m.m2 = lanes(finite, |x| (x - mean) * (x - mean));
    m
}

/// Eight lanes' sums added pairwise.
#[inline(always)]
fn pairwise(acc: &[f64; 8]) -> f64 {
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

/// `sum(f(x))` in eight interleaved sums (so the compiler keeps them in vector registers),
/// added pairwise at the end.
#[inline(always)]
fn lanes(values: &[f64], f: impl Fn(f64) -> f64) -> f64 {
    let mut acc = [0.0f64; 8];
    let mut blocks = values.chunks_exact(8);
    for block in &mut blocks {
        for (a, &x) in acc.iter_mut().zip(block) {
            *a += f(x);
        }
    }
    for (a, &x) in acc.iter_mut().zip(blocks.remainder()) {
        *a += f(x);
    }
    pairwise(&acc)
}

/// A sum of squares in units of `2^(2 * scale)`.
#[derive(Clone, Copy, Debug)]
struct Norm {
    scale: i32,
    ssq: f64,
}

impl Norm {
    const ZERO: Norm = Norm {
        scale: -1022,
        ssq: 0.0,
    };

    /// The sum of squares of `values`, whose largest magnitude is `a`.
    #[inline(always)]
    fn of(values: &[f64], a: f64) -> Norm {
        let scale = scale_for(a);
        let s = pow2(-scale);
        Norm {
            scale,
            ssq: lanes(values, |x| (x * s) * (x * s)),
        }
    }

    fn merge(self, other: Norm) -> Norm {
        let scale = self.scale.max(other.scale);
        let shifted = |n: Norm| n.ssq * pow2(2 * (n.scale - scale).max(-4000));
        Norm {
            scale,
            ssq: shifted(self) + shifted(other),
        }
    }

    fn value(self) -> f64 {
        let half = self.scale / 2;
        self.ssq.sqrt() * pow2(half) * pow2(self.scale - half)
    }

    /// This norm over `other`'s (NaN when that is 0), without leaving the scaled units: the
    /// norms themselves may be beyond float64 where their ratio is not.
    fn over(self, other: Norm) -> f64 {
        if other.ssq == 0.0 {
            return f64::NAN;
        }
        let apart = (self.scale - other.scale).clamp(-4000, 4000);
        let half = apart / 2;
        self.ssq.sqrt() / other.ssq.sqrt() * pow2(half) * pow2(apart - half)
    }
}

/// One piece's change figures.
#[derive(Clone, Copy, Debug)]
struct PieceChange {
    changed: u64,
    nonfinite: u64,
    diff: Norm,
    a: Norm,
    max_abs: f64,
}

impl PieceChange {
    const EMPTY: PieceChange = PieceChange {
        changed: 0,
        nonfinite: 0,
        diff: Norm::ZERO,
        a: Norm::ZERO,
        max_abs: 0.0,
    };

    fn merge(self, other: PieceChange) -> PieceChange {
        PieceChange {
            changed: self.changed + other.changed,
            nonfinite: self.nonfinite + other.nonfinite,
            diff: self.diff.merge(other.diff),
            a: self.a.merge(other.a),
            max_abs: self.max_abs.max(other.max_abs),
        }
    }
}

/// The change figures of one piece (`a` becomes its finite values, zeros for the others;
/// `b` the differences where both are finite, zeros elsewhere), in eight lanes.
#[inline(always)]
fn change_of(a: &mut [f64], b: &mut [f64]) -> PieceChange {
    let (mut changed, mut nonfinite) = ([0u64; 8], [0u64; 8]);
    let (mut max_abs, mut max_a) = ([0.0f64; 8], [0.0f64; 8]);
    let mut step = |j: usize, x: &mut f64, y: &mut f64| {
        let same = *x == *y || (x.is_nan() && y.is_nan());
        let (x_finite, y_finite) = (x.abs() < f64::INFINITY, y.abs() < f64::INFINITY);
        let both = x_finite && y_finite;
        changed[j] += u64::from(!same);
        nonfinite[j] += u64::from(!same && !both);
        *y = if both { *y - *x } else { 0.0 };
        *x = if x_finite { *x } else { 0.0 };
        let (d, v) = (y.abs(), x.abs());
        max_abs[j] = if d > max_abs[j] { d } else { max_abs[j] };
        max_a[j] = if v > max_a[j] { v } else { max_a[j] };
    };
    let mut blocks = a.chunks_exact_mut(8).zip(b.chunks_exact_mut(8));
    for (xs, ys) in &mut blocks {
        for (j, (x, y)) in xs.iter_mut().zip(ys.iter_mut()).enumerate() {
            step(j, x, y);
        }
    }
    let tail = a.len() / 8 * 8;
    for (j, (x, y)) in a[tail..].iter_mut().zip(b[tail..].iter_mut()).enumerate() {
        step(j, x, y);
    }
    let largest = |m: [f64; 8]| {
        m.iter()
            .copied()
            .fold(0.0, |m, x| if x > m { x } else { m })
    };
    let (max_abs, max_a) = (largest(max_abs), largest(max_a));
    PieceChange {
        changed: changed.iter().sum(),
        nonfinite: nonfinite.iter().sum(),
        diff: Norm::of(b, max_abs),
        a: Norm::of(a, max_a),
        max_abs,
    }
}

#[cfg(test)]
mod tests;
