//! Checkpoint arithmetic (average, delta, apply, interpolate) in one pass over memory.
//!
//! Each combined tensor is made a chunk at a time: the sources are accumulated one after
//! the other into one accumulator chunk (so memory does not grow with the number of
//! sources), the result is rounded once to the tensor's type and its bytes are written once
//! to the output (a file at the tensor's offset, or memory). The arithmetic is exactly the
//! Python layer's NumPy expressions, operation by operation and in the same order (no fused
//! multiply-add): float64 for float32/float64 tensors, float32 for float16/bfloat16, then one
//! rounding to nearest even.
//!
//! A result that does not fit its type where every input is finite is not written: the pass
//! stops and reports the first such element; the caller builds its error.
//!
//! A result written to a file is summed (XXH3-64, [`crate::seal::checksums`]) as its chunks
//! are written, in element order: the same sum the writer takes of a tensor's bytes, so the
//! staged file is sealed without reading its values back.

mod floats;
pub mod stats;

use std::collections::HashMap;
use std::fs::File;
use std::ops::{Add, Div, Mul, Sub};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};

use crate::format::DataType;
use crate::seal::checksums::{Running, Sum};
use crate::{Error, Result};
use floats::{
    bf16_bits_to_f32, f16_bits_to_f32, f32_to_bf16_bits, f32_to_f16_bits, f32_to_f8_bits,
    f8_is_finite, Float8,
};

/// Elements made at a time: the accumulator chunk (float64: 512 KiB) stays in the cache
/// while every source passes through it.
pub const CHUNK: usize = 1 << 16;

/// How the sources combine into one result element (`x_i`: the sources' elements, in the
/// work type; the coefficients are rounded to the work type first, as NumPy's `astype` does).
#[derive(Clone, Debug, PartialEq)]
pub enum Operation {
    /// `(x_0*w_0 + x_1*w_1 + ...) / total`, summed in source order; where that sum
    /// overflows, `0 + (w_0/total)*x_0 + (w_1/total)*x_1 + ...` instead (each weight's share).
    Average { weights: Vec<f64>, total: f64 },
    /// `x_0 - x_1`.
    Delta,
    /// `x_0 + x_1*scale`.
    Apply { scale: f64 },
    /// `x_0*a + x_1*b` (interpolation: `a = 1 - t`, `b = t`).
    Interpolate { a: f64, b: f64 },
}

impl Operation {
    fn sources(&self) -> usize {
        match self {
            Operation::Average { weights, .. } => weights.len(),
            _ => 2,
        }
    }
}

/// One source's values of a tensor.
pub struct Input<'a> {
    /// Little-endian elements of the tensor's type.
    pub bytes: &'a [u8],
    /// The addresses of the mapping `bytes` lie in, when its pages may be dropped once a
    /// chunk is used (with the neighbouring pages Linux mapped along: it maps pages
    /// around each fault, up to 64 KiB by default, see `fault_around_bytes`).
    ///
    /// Only for a private file mapping nobody wrote through: dropped pages are faulted in
    /// again from the file if read again; on anything else their data would be lost.
    pub release: Option<std::ops::Range<usize>>,
}

/// Where a tensor's result goes.
pub enum Sink<'a> {
    /// At `offset` in `file` (a staged file with a hole there); `path` names it in errors.
    File {
        file: &'a File,
        offset: u64,
        path: &'a Path,
    },
    /// Into this memory, exactly the result's length.
    Memory(&'a mut [u8]),
}

/// One combined tensor: its type, its sources in order, and where its result goes.
pub struct Job<'a> {
    pub data_type: DataType,
    pub inputs: Vec<Input<'a>>,
    pub sink: Sink<'a>,
}

/// A result that does not fit its type although every input is finite.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Overflow {
    /// Which job (index into the jobs given).
    pub job: usize,
    /// The element, counted from the tensor's first.
    pub element: u64,
    /// The value computed in the work type, before rounding to the tensor's type.
    pub exact: f64,
}

/// How a pass ended.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// Every result is written; for each job, in order, the checksum of the bytes written to
    /// its file (None for a result in memory).
    Written(Vec<Option<Sum>>),
    /// The first result that does not fit its type: that job's result, and those after, are
    /// incomplete.
    Overflow(Overflow),
}

/// Whether [`run`] computes tensors of this type (E8M0, a scale, is left to the caller).
pub fn covers(data_type: DataType) -> bool {
    matches!(
        data_type,
        DataType::Float
            | DataType::Double
            | DataType::Float16
            | DataType::Bfloat16
            | DataType::Float8E4M3Fn
            | DataType::Float8E4M3Fnuz
            | DataType::Float8E5M2
            | DataType::Float8E5M2Fnuz
    )
}

/// Computes every job, stopping at the first overflow in job and element order (that job's
/// result, and those after, are then incomplete). The chunks are shared out among up to
/// `threads` threads; each result written to a file is summed as its chunks are written. `progress` is told the bytes of each result chunk written (from any of
/// them, one at a time); an error from it stops the pass.
///
/// # Errors
/// A job that does not match `operation` (number of sources, lengths, type), a failed
/// write, or `progress`'s own error.
pub fn run(
    operation: &Operation,
    jobs: &mut [Job<'_>],
    threads: usize,
    progress: &mut (dyn FnMut(u64) -> Result<()> + Send),
) -> Result<Outcome> {
    for job in jobs.iter() {
        check(operation, job)?;
    }
    let work = Pass::of(jobs);
    let progress = Mutex::new(progress);
    let threads = threads.clamp(1, work.len.max(1));
    std::thread::scope(|scope| {
        for _ in 1..threads {
            scope.spawn(|| work.drain(operation, &progress));
        }
        work.drain(operation, &progress);
    });
    if let Some(e) = work.error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    if let Some((_, o)) = work.first.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Ok(Outcome::Overflow(o));
    }
    Ok(Outcome::Written(work.sums.finish()))
}

/// One chunk of one job's result: what a thread takes from the queue.
struct Piece<'j, 'a> {
    job: usize,
    data_type: DataType,
    inputs: &'j [Input<'a>],
    start: usize,
    len: usize,
    out: Out<'j>,
}

/// Where a piece's bytes go: its own part of the result's memory, or a place in a file.
enum Out<'j> {
    Memory(&'j mut [u8]),
    File {
        file: &'j File,
        offset: u64,
        path: &'j Path,
    },
}

/// The pieces of a pass, handed out in order, and what the pass found.
struct Pass<'j, 'a> {
    queue: Mutex<std::iter::Enumerate<std::vec::IntoIter<Piece<'j, 'a>>>>,
    len: usize,
    /// The first overflow, by piece (pieces are in job and element order).
    first: Mutex<Option<(usize, Overflow)>>,
    /// Pieces after this one are not computed: an overflow (or error) came before them.
    stop_after: AtomicUsize,
    error: Mutex<Option<Error>>,
    sums: Sums,
}

impl<'j, 'a> Pass<'j, 'a> {
    fn of(jobs: &'j mut [Job<'a>]) -> Self {
        let mut pieces = Vec::new();
        let mut to_sum = Vec::new();
        for (index, job) in jobs.iter_mut().enumerate() {
            let size = element_size(job.data_type);
            let n = job.inputs[0].bytes.len() / size;
            to_sum.push(matches!(job.sink, Sink::File { .. }).then_some(n.div_ceil(CHUNK)));
            let starts = (0..n).step_by(CHUNK);
            let piece = |start: usize, out| Piece {
                job: index,
                data_type: job.data_type,
                inputs: &job.inputs,
                start,
                len: CHUNK.min(n - start),
                out,
            };
            match &mut job.sink {
                Sink::Memory(memory) => {
                    for (start, part) in starts.zip(memory.chunks_mut(CHUNK * size)) {
                        pieces.push(piece(start, Out::Memory(part)));
                    }
                }
                Sink::File { file, offset, path } => {
                    for start in starts {
                        let offset = *offset + (start * size) as u64;
                        pieces.push(piece(start, Out::File { file, offset, path }));
                    }
                }
            }
        }
        Pass {
            len: pieces.len(),
            queue: Mutex::new(pieces.into_iter().enumerate()),
            first: Mutex::new(None),
            stop_after: AtomicUsize::new(usize::MAX),
            error: Mutex::new(None),
            sums: Sums::new(to_sum),
        }
    }

    /// Computes pieces until none is left (or none that counts).
    fn drain(
        &self,
        operation: &Operation,
        progress: &Mutex<&mut (dyn FnMut(u64) -> Result<()> + Send)>,
    ) {
        let mut scratch = Scratch::default();
        let _waiters = StopOnPanic(&self.sums);
        loop {
            let next = self.queue.lock().unwrap_or_else(|p| p.into_inner()).next();
            let Some((index, mut piece)) = next else {
                return;
            };
            if index > self.stop_after.load(Ordering::Acquire) {
                return;
            }
            let done = piece_of(operation, &mut piece, &mut scratch).and_then(|found| {
                if found.is_none() {
                    if let Out::File { .. } = piece.out {
                        // What finished() just wrote is still in its staging buffer (exactly
                        // the piece's bytes).
                        debug_assert_eq!(scratch.out.len() as u64, piece.bytes());
                        self.sums
                            .add(piece.job, piece.start / CHUNK, &mut scratch.out);
                    }
                    (progress.lock().unwrap_or_else(|p| p.into_inner()))(piece.bytes())?;
                }
                Ok(found)
            });
            match done {
                Ok(None) => {}
                Ok(Some((element, exact))) => {
                    let mut first = self.first.lock().unwrap_or_else(|p| p.into_inner());
                    if first.as_ref().is_none_or(|(i, _)| index < *i) {
                        let job = piece.job;
                        *first = Some((
                            index,
                            Overflow {
                                job,
                                element,
                                exact,
                            },
                        ));
                    }
                    self.sums.stop();
                    self.stop_after.fetch_min(index, Ordering::AcqRel);
                }
                Err(e) => {
                    self.error
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .get_or_insert(e);
                    self.sums.stop();
                    self.stop_after.store(0, Ordering::Release);
                    return;
                }
            }
        }
    }
}

/// The checksums of the results written to files. XXH3 sums bytes in order only, and the
/// chunks finish in any order across threads: a chunk whose turn has not come (the chunks
/// before it in its tensor not yet summed) is kept, and summed by whichever thread sums the
/// chunk before it, so its own thread goes on at once. A thread waits only when [`AHEAD`]
/// chunks are kept already (one thread far behind the other, descheduled on a busy machine),
/// which bounds the memory. Summing is fast next to computing a chunk, so one lock serves
/// every tensor.
struct Sums {
    state: Mutex<Summing>,
    turn: Condvar,
}

/// Chunks kept for their turn at most, over every tensor: a few MiB (a chunk's result is at
/// most [`CHUNK`] float64 values, 512 KiB), whatever the sources and tensors.
const AHEAD: usize = 16;

struct Summing {
    /// For each job with a file sink: its chunks, the next one to sum, and the sum so far.
    jobs: Vec<Option<(usize, usize, Running)>>,
    /// The bytes of chunks that came before their turn, by (job, chunk).
    ahead: HashMap<(usize, usize), Vec<u8>>,
    /// Buffers of kept chunks once summed: the next staging buffers of the threads that
    /// leave theirs here.
    spare: Vec<Vec<u8>>,
    /// An overflow or error ended the pass: chunks no longer wait (some never come).
    stopped: bool,
}

impl Sums {
    fn new(chunks: Vec<Option<usize>>) -> Self {
        let jobs = chunks
            .into_iter()
            .map(|c| c.map(|c| (c, 0, Running::default())))
            .collect();
        Sums {
            state: Mutex::new(Summing {
                jobs,
                ahead: HashMap::new(),
                spare: Vec::new(),
                stopped: false,
            }),
            turn: Condvar::new(),
        }
    }

    /// Adds `bytes`, chunk `chunk` of job `job`'s result, to its sum: at once when its turn
    /// has come (with the kept chunks that follow it), else kept for its turn, `bytes` then
    /// replaced by a spare buffer (its contents are not the chunk's).
    fn add(&self, job: usize, chunk: usize, bytes: &mut Vec<u8>) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if state.stopped {
                return;
            }
            let Summing {
                jobs, ahead, spare, ..
            } = &mut *state;
            match &mut jobs[job] {
                None => return,
                Some((_, next, running)) if *next == chunk => {
                    running.update(bytes);
                    *next += 1;
                    while let Some(kept) = ahead.remove(&(job, *next)) {
                        running.update(&kept);
                        *next += 1;
                        spare.push(kept);
                    }
                    break;
                }
                Some(_) if ahead.len() < AHEAD => {
                    let buffer = spare.pop().unwrap_or_default();
                    ahead.insert((job, chunk), std::mem::replace(bytes, buffer));
                    return;
                }
                Some(_) => {}
            }
            state = self.turn.wait(state).unwrap_or_else(|p| p.into_inner());
        }
        drop(state);
        self.turn.notify_all();
    }

    fn stop(&self) {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).stopped = true;
        self.turn.notify_all();
    }

    /// Each job's sum once every chunk of it is added (None for a result in memory, or
    /// one not summed whole, which the caller then reads back).
    fn finish(self) -> Vec<Option<Sum>> {
        let state = self.state.into_inner().unwrap_or_else(|p| p.into_inner());
        state
            .jobs
            .into_iter()
            .map(|job| {
                job.and_then(|(chunks, next, running)| (next == chunks).then(|| running.finish()))
            })
            .collect()
    }
}

/// Releases every chunk waiting for its turn if this thread panics before its own chunk is
/// summed (the panic then reaches the caller; nobody waits for a chunk that never comes).
struct StopOnPanic<'s>(&'s Sums);

impl Drop for StopOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.stop();
        }
    }
}

impl Piece<'_, '_> {
    fn bytes(&self) -> u64 {
        (self.len * element_size(self.data_type)) as u64
    }
}

fn element_size(data_type: DataType) -> usize {
    data_type.bits().map_or(0, |b| (b / 8) as usize)
}

fn check(operation: &Operation, job: &Job<'_>) -> Result<()> {
    let size = element_size(job.data_type);
    let len = job.inputs.first().map_or(0, |i| i.bytes.len());
    let sink_len = match &job.sink {
        Sink::Memory(m) => m.len(),
        Sink::File { .. } => len,
    };
    if job.inputs.len() != operation.sources()
        || size == 0
        || !len.is_multiple_of(size)
        || sink_len != len
        || job.inputs.iter().any(|i| i.bytes.len() != len)
    {
        return Err(Error::invalid_state(format!(
            "arithmetic: a {:?} job with {} inputs for {} sources, lengths {:?}, result {sink_len}",
            job.data_type,
            job.inputs.len(),
            operation.sources(),
            job.inputs.iter().map(|i| i.bytes.len()).collect::<Vec<_>>(),
        )));
    }
    Ok(())
}

/// The buffers one pass reuses for every chunk of every tensor.
#[derive(Default)]
struct Scratch {
    acc64: Vec<f64>,
    acc32: Vec<f32>,
    out: Vec<u8>,
}

/// The type arithmetic runs in: float64 or float32.
trait Work:
    Copy + Default + Add<Output = Self> + Sub<Output = Self> + Mul<Output = Self> + Div<Output = Self>
{
    /// `value` rounded to this type (NumPy's `astype`).
    fn of(value: f64) -> Self;
    fn to_f64(self) -> f64;
    fn is_finite(self) -> bool;
    fn is_infinite(self) -> bool;
    fn accumulator(scratch: &mut Scratch) -> &mut Vec<Self>;
}

impl Work for f64 {
    #[inline(always)]
    fn of(value: f64) -> Self {
        value
    }
    fn to_f64(self) -> f64 {
        self
    }
    fn is_finite(self) -> bool {
        f64::is_finite(self)
    }
    fn is_infinite(self) -> bool {
        f64::is_infinite(self)
    }
    fn accumulator(scratch: &mut Scratch) -> &mut Vec<Self> {
        &mut scratch.acc64
    }
}

impl Work for f32 {
    #[inline(always)]
    fn of(value: f64) -> Self {
        value as f32
    }
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    fn is_finite(self) -> bool {
        f32::is_finite(self)
    }
    fn is_infinite(self) -> bool {
        f32::is_infinite(self)
    }
    fn accumulator(scratch: &mut Scratch) -> &mut Vec<Self> {
        &mut scratch.acc32
    }
}

/// A tensor's element type: its bytes, the type it is computed in, and the one rounding.
trait Element {
    type Work: Work;
    const SIZE: usize;
    /// An average's sources summed a pass ([`weighted`]).
    const GROUP: usize = GROUP;
    /// The element in `bytes` (exactly SIZE long), widened exactly to the work type.
    fn load(bytes: &[u8]) -> Self::Work;
    /// `value` rounded to nearest even into `out` (SIZE long); whether the result is finite.
    fn store(value: Self::Work, out: &mut [u8]) -> bool;
}

struct F32;
struct F64;
struct F16;
struct Bf16;

impl Element for F32 {
    type Work = f64;
    const SIZE: usize = 4;
    #[inline(always)]
    fn load(bytes: &[u8]) -> f64 {
        f64::from(f32::from_le_bytes(bytes.try_into().unwrap_or_default()))
    }
    #[inline(always)]
    fn store(value: f64, out: &mut [u8]) -> bool {
        let v = value as f32;
        out.copy_from_slice(&v.to_le_bytes());
        v.is_finite()
    }
}

impl Element for F64 {
    type Work = f64;
    const SIZE: usize = 8;
    #[inline(always)]
    fn load(bytes: &[u8]) -> f64 {
        f64::from_le_bytes(bytes.try_into().unwrap_or_default())
    }
    #[inline(always)]
    fn store(value: f64, out: &mut [u8]) -> bool {
        out.copy_from_slice(&value.to_le_bytes());
        value.is_finite()
    }
}

impl Element for F16 {
    type Work = f32;
    const SIZE: usize = 2;
    // One: its widening's branches keep the compiler from vectorising a group (2.5 times
    // slower); source by source, it vectorises.
    const GROUP: usize = 1;
    #[inline(always)]
    fn load(bytes: &[u8]) -> f32 {
        f16_bits_to_f32(u16::from_le_bytes(bytes.try_into().unwrap_or_default()))
    }
    #[inline(always)]
    fn store(value: f32, out: &mut [u8]) -> bool {
        let bits = f32_to_f16_bits(value);
        out.copy_from_slice(&bits.to_le_bytes());
        bits & 0x7c00 != 0x7c00
    }
}

impl Element for Bf16 {
    type Work = f32;
    const SIZE: usize = 2;
    #[inline(always)]
    fn load(bytes: &[u8]) -> f32 {
        bf16_bits_to_f32(u16::from_le_bytes(bytes.try_into().unwrap_or_default()))
    }
    #[inline(always)]
    fn store(value: f32, out: &mut [u8]) -> bool {
        let bits = f32_to_bf16_bits(value);
        out.copy_from_slice(&bits.to_le_bytes());
        bits & 0x7f80 != 0x7f80
    }
}

/// The float8 types: computed in float32 (every float8 value is one), rounded once to nearest
/// even as ml_dtypes rounds (beyond the largest value: infinity, or NaN where there is none).
macro_rules! float8 {
    ($name:ident, $data_type:ident, $format:expr) => {
        struct $name;

        impl Element for $name {
            type Work = f32;
            const SIZE: usize = 1;
            #[inline(always)]
            fn load(bytes: &[u8]) -> f32 {
                static VALUES: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
                let values = VALUES.get_or_init(|| {
                    let table = stats::float8_table(DataType::$data_type);
                    std::array::from_fn(|b| table[b] as f32)
                });
                values[usize::from(bytes[0])]
            }
            #[inline(always)]
            fn store(value: f32, out: &mut [u8]) -> bool {
                const FORMAT: Float8 = $format;
                out[0] = f32_to_f8_bits(value, FORMAT);
                f8_is_finite(out[0], FORMAT)
            }
        }
    };
}

float8!(F8E4M3Fn, Float8E4M3Fn, floats::E4M3FN);
float8!(F8E4M3Fnuz, Float8E4M3Fnuz, floats::E4M3FNUZ);
float8!(F8E5M2, Float8E5M2, floats::E5M2);
float8!(F8E5M2Fnuz, Float8E5M2Fnuz, floats::E5M2FNUZ);

/// The element `at` of `input`.
fn element<E: Element>(input: &Input<'_>, at: usize) -> E::Work {
    E::load(&input.bytes[at * E::SIZE..(at + 1) * E::SIZE])
}

/// `acc[j] = f(acc[j], x[j])` over one source's chunk.
#[inline(always)]
fn fold<E: Element>(acc: &mut [E::Work], bytes: &[u8], f: impl Fn(E::Work, E::Work) -> E::Work) {
    for (a, x) in acc.iter_mut().zip(bytes.chunks_exact(E::SIZE)) {
        *a = f(*a, E::load(x));
    }
}

/// One piece, computed and written: Some((element, exact value)) at its first overflow (and
/// nothing written).
fn piece_of(
    operation: &Operation,
    piece: &mut Piece<'_, '_>,
    scratch: &mut Scratch,
) -> Result<Option<(u64, f64)>> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { piece_avx2(operation, piece, scratch) };
    }
    piece_by_type(operation, piece, scratch)
}

/// [`piece_by_type`] compiled for AVX2: twice the lanes of the baseline's SSE2, the same
/// IEEE operations one by one (no fused multiply-add), so the same results.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn piece_avx2(
    operation: &Operation,
    piece: &mut Piece<'_, '_>,
    scratch: &mut Scratch,
) -> Result<Option<(u64, f64)>> {
    piece_by_type(operation, piece, scratch)
}

#[inline(always)]
fn piece_by_type(
    operation: &Operation,
    piece: &mut Piece<'_, '_>,
    scratch: &mut Scratch,
) -> Result<Option<(u64, f64)>> {
    match piece.data_type {
        DataType::Float => chunk::<F32>(operation, piece, scratch),
        DataType::Double => chunk::<F64>(operation, piece, scratch),
        DataType::Float16 => chunk::<F16>(operation, piece, scratch),
        DataType::Bfloat16 => chunk::<Bf16>(operation, piece, scratch),
        DataType::Float8E4M3Fn => chunk::<F8E4M3Fn>(operation, piece, scratch),
        DataType::Float8E4M3Fnuz => chunk::<F8E4M3Fnuz>(operation, piece, scratch),
        DataType::Float8E5M2 => chunk::<F8E5M2>(operation, piece, scratch),
        DataType::Float8E5M2Fnuz => chunk::<F8E5M2Fnuz>(operation, piece, scratch),
        other => Err(Error::invalid_state(format!(
            "arithmetic does not compute {} tensors here",
            other.name()
        ))),
    }
}

/// One chunk: every source accumulated in turn, the result rounded once and written once.
#[inline(always)]
fn chunk<E: Element>(
    operation: &Operation,
    piece: &mut Piece<'_, '_>,
    scratch: &mut Scratch,
) -> Result<Option<(u64, f64)>> {
    let len = piece.len;
    let mut acc = std::mem::take(E::Work::accumulator(scratch));
    acc.resize(len, E::Work::default());
    let found = finished::<E>(operation, piece, &mut acc[..len], &mut scratch.out);
    *E::Work::accumulator(scratch) = acc;
    found
}

/// [`chunk`] with its accumulator: the sources into it, then the result out.
#[inline(always)]
fn finished<E: Element>(
    operation: &Operation,
    piece: &mut Piece<'_, '_>,
    acc: &mut [E::Work],
    staging: &mut Vec<u8>,
) -> Result<Option<(u64, f64)>> {
    let (start, len) = (piece.start, piece.len);
    let span = start * E::SIZE..(start + len) * E::SIZE;
    // Sources whose pages are dropped once read go one at a time (a group's would be held
    // together: the peak grew with the number of sources).
    let a_pass = match operation {
        Operation::Average { .. } if piece.inputs.iter().all(|i| i.release.is_none()) => E::GROUP,
        _ => 1,
    };
    for (g, group) in piece.inputs.chunks(a_pass).enumerate() {
        let bytes: Vec<&[u8]> = group.iter().map(|i| &i.bytes[span.clone()]).collect();
        for (input, chunk) in group.iter().zip(&bytes) {
            if input.release.is_some() {
                populate(chunk);
            }
        }
        accumulate::<E>(operation, g * a_pass, acc, &bytes);
        for (input, chunk) in group.iter().zip(&bytes) {
            if let Some(mapping) = &input.release {
                release_around(chunk, mapping);
            }
        }
    }
    if let Operation::Average { total, .. } = operation {
        let total = E::Work::of(*total);
        acc.iter_mut().for_each(|a| *a = *a / total);
    }
    let (out, file): (&mut [u8], _) = match &mut piece.out {
        Out::Memory(memory) => (memory, None),
        Out::File { file, offset, path } => {
            staging.resize(len * E::SIZE, 0);
            (&mut staging[..len * E::SIZE], Some((*file, *offset, *path)))
        }
    };
    let mut finite = true;
    for (a, o) in acc.iter().zip(out.chunks_exact_mut(E::SIZE)) {
        finite &= E::store(*a, o);
    }
    if !finite {
        if let Some(bad) = not_finite::<E>(operation, piece.inputs, acc, out, start) {
            return Ok(Some(bad));
        }
    }
    if let Some((file, offset, path)) = file {
        use std::os::unix::fs::FileExt;
        file.write_all_at(out, offset)
            .map_err(|e| Error::from(e).in_file(path))?;
    }
    Ok(None)
}

/// The chunks of sources `i`, `i + 1`, ... (`sources`: one for every operation but an
/// average's [`GROUP`]) into the accumulator: the operation's step for each source in turn,
/// its coefficient rounded to the work type once.
#[inline(always)]
fn accumulate<E: Element>(operation: &Operation, i: usize, acc: &mut [E::Work], sources: &[&[u8]]) {
    let w = E::Work::of;
    let bytes = sources[0];
    match (operation, i) {
        (Operation::Average { weights, .. }, 0) if sources.len() == 1 => {
            let c = w(weights[0]);
            fold::<E>(acc, bytes, |_, x| x * c)
        }
        (Operation::Average { weights, .. }, _) if sources.len() == 1 => {
            let c = w(weights[i]);
            fold::<E>(acc, bytes, |a, x| a + x * c)
        }
        (Operation::Average { weights, .. }, _) => {
            let weights = &weights[i..i + sources.len()];
            match sources.len() {
                2 => weighted::<E, 2>(acc, sources, weights, i == 0),
                3 => weighted::<E, 3>(acc, sources, weights, i == 0),
                4 => weighted::<E, 4>(acc, sources, weights, i == 0),
                5 => weighted::<E, 5>(acc, sources, weights, i == 0),
                6 => weighted::<E, 6>(acc, sources, weights, i == 0),
                7 => weighted::<E, 7>(acc, sources, weights, i == 0),
                _ => weighted::<E, GROUP>(acc, sources, weights, i == 0),
            }
        }
        (Operation::Delta | Operation::Apply { .. }, 0) => fold::<E>(acc, bytes, |_, x| x),
        (Operation::Delta, _) => fold::<E>(acc, bytes, |a, x| a - x),
        (Operation::Apply { scale }, _) => {
            let c = w(*scale);
            fold::<E>(acc, bytes, |a, x| a + x * c)
        }
        (Operation::Interpolate { a, .. }, 0) => {
            let c = w(*a);
            fold::<E>(acc, bytes, |_, x| x * c)
        }
        (Operation::Interpolate { b, .. }, _) => {
            let c = w(*b);
            fold::<E>(acc, bytes, |s, x| s + x * c)
        }
    }
}

/// An average's sources summed a pass: each element's running sum stays in a register
/// while they are added to it (one at a time, in order: the same sum as source by source,
/// without the accumulator's load and store for each; about half the time a pass).
const GROUP: usize = 8;

/// Elements summed side by side (the compiler's vector lanes).
const LANES: usize = 8;

/// `acc[j] = acc[j] + x_0[j]*c_0 + x_1[j]*c_1 + ...` (left to right) over `N` sources' chunks,
/// or from `x_0[j]*c_0` when they are `first` (the average's first sources).
#[inline(always)]
fn weighted<E: Element, const N: usize>(
    acc: &mut [E::Work],
    sources: &[&[u8]],
    weights: &[f64],
    first: bool,
) {
    let c: [E::Work; N] = std::array::from_fn(|k| E::Work::of(weights[k]));
    let x: [&[u8]; N] = std::array::from_fn(|k| &sources[k][..acc.len() * E::SIZE]);
    let term = |k: usize, at: usize| E::load(&x[k][at..at + E::SIZE]) * c[k];
    let done = acc.len() / LANES * LANES;
    let mut blocks = acc.chunks_exact_mut(LANES);
    for (b, a) in (&mut blocks).enumerate() {
        let at = b * LANES * E::SIZE;
        let mut sum = [E::Work::default(); LANES];
        for k in 0..N {
            let xs = &x[k][at..at + LANES * E::SIZE];
            for l in 0..LANES {
                let v = E::load(&xs[l * E::SIZE..(l + 1) * E::SIZE]) * c[k];
                sum[l] = match (k, first) {
                    (0, true) => v,
                    (0, false) => a[l] + v,
                    _ => sum[l] + v,
                };
            }
        }
        a.copy_from_slice(&sum);
    }
    for (j, a) in blocks.into_remainder().iter_mut().enumerate() {
        let at = (done + j) * E::SIZE;
        let mut sum = if first { term(0, at) } else { *a + term(0, at) };
        for k in 1..N {
            sum = sum + term(k, at);
        }
        *a = sum;
    }
}

/// The chunk's results that are not finite, looked at one by one: an average whose sum
/// overflowed is computed again from each weight's share; a result still not finite where
/// every input is finite is the overflow reported (inputs that are not finite are the
/// user's, and pass as the arithmetic makes them).
fn not_finite<E: Element>(
    operation: &Operation,
    inputs: &[Input<'_>],
    acc: &[E::Work],
    out: &mut [u8],
    start: usize,
) -> Option<(u64, f64)> {
    for (j, (a, o)) in acc.iter().zip(out.chunks_exact_mut(E::SIZE)).enumerate() {
        let mut exact = *a;
        if E::store(exact, o) {
            continue;
        }
        let at = start + j;
        if let Operation::Average { weights, total } = operation {
            // Where the sum itself overflowed (not only the mean), each weight's share.
            if sum_overflowed::<E>(weights, inputs, at) {
                exact = weights
                    .iter()
                    .zip(inputs)
                    .fold(E::Work::default(), |sum, (c, i)| {
                        sum + E::Work::of(c / total) * element::<E>(i, at)
                    });
                if E::store(exact, o) {
                    continue;
                }
            }
        }
        if inputs.iter().all(|i| element::<E>(i, at).is_finite()) {
            return Some((at as u64, exact.to_f64()));
        }
    }
    None
}

/// Whether an average's sum (before its division by the total) is infinite at element `at`:
/// the same sum as the pass made, computed again for this one element.
fn sum_overflowed<E: Element>(weights: &[f64], inputs: &[Input<'_>], at: usize) -> bool {
    let w = E::Work::of;
    let mut terms = weights.iter().zip(inputs);
    let first = terms
        .next()
        .map_or(E::Work::default(), |(c, i)| element::<E>(i, at) * w(*c));
    terms
        .fold(first, |sum, (c, i)| sum + element::<E>(i, at) * w(*c))
        .is_infinite()
}

/// Maps `bytes` (of a file mapping) in with one call (MADV_POPULATE_READ, Linux 5.14+)
/// instead of a page fault every few pages; where the kernel refuses, reads fault as usual.
fn populate(bytes: &[u8]) {
    const MADV_POPULATE_READ: libc::c_int = 22;
    // SAFETY: sysconf has no preconditions.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
        .unwrap_or(4096)
        .max(1);
    let start = bytes.as_ptr() as usize / page * page;
    let end = bytes.as_ptr() as usize + bytes.len();
    if end > start {
        // SAFETY: populating only reads pages of our own mapping in (no data changes).
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, MADV_POPULATE_READ);
        }
    }
}

/// How far around a fault the kernel maps pages in (its default `fault_around_bytes`; the
/// window is aligned to it).
const FAULT_AROUND: usize = 64 << 10;

/// Drops the pages of `bytes`, and those within [`FAULT_AROUND`] of them, from this
/// process's memory (MADV_DONTNEED), staying inside `mapping` (see [`Input::release`]).
fn release_around(bytes: &[u8], mapping: &std::ops::Range<usize>) {
    // SAFETY: sysconf has no preconditions.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
        .unwrap_or(4096)
        .max(1);
    let address = bytes.as_ptr() as usize;
    let start = (address / FAULT_AROUND * FAULT_AROUND).max(mapping.start.div_ceil(page) * page);
    let end = (address + bytes.len())
        .next_multiple_of(FAULT_AROUND)
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

#[cfg(test)]
mod tests;
