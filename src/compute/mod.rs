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

mod floats;

use std::fs::File;
use std::ops::{Add, Div, Mul, Sub};
use std::path::Path;

use crate::format::DataType;
use crate::{Error, Result};
use floats::{bf16_bits_to_f32, f16_bits_to_f32, f32_to_bf16_bits, f32_to_f16_bits};

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
    /// chunk is used (with the neighbouring pages the kernel mapped along: it maps pages
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

/// Whether [`run`] computes tensors of this type (the float8 types are left to the caller).
pub fn covers(data_type: DataType) -> bool {
    matches!(
        data_type,
        DataType::Float | DataType::Double | DataType::Float16 | DataType::Bfloat16
    )
}

/// Computes every job in order, stopping at the first overflow (its tensor's result, and
/// those after, are then not complete). `progress` is told the bytes of each result chunk
/// written; an error from it stops the pass.
///
/// # Errors
/// A job that does not match `operation` (number of sources, lengths, type), a failed
/// write, or `progress`'s own error.
pub fn run(
    operation: &Operation,
    jobs: &mut [Job<'_>],
    progress: &mut dyn FnMut(u64) -> Result<()>,
) -> Result<Option<Overflow>> {
    let mut scratch = Scratch::default();
    for (index, job) in jobs.iter_mut().enumerate() {
        check(operation, job)?;
        let found = match job.data_type {
            DataType::Float => tensor::<F32>(operation, job, &mut scratch, progress)?,
            DataType::Double => tensor::<F64>(operation, job, &mut scratch, progress)?,
            DataType::Float16 => tensor::<F16>(operation, job, &mut scratch, progress)?,
            DataType::Bfloat16 => tensor::<Bf16>(operation, job, &mut scratch, progress)?,
            other => {
                return Err(Error::invalid_state(format!(
                    "arithmetic does not compute {} tensors here", other.name()
                )))
            }
        };
        if let Some((element, exact)) = found {
            return Ok(Some(Overflow {
                job: index,
                element,
                exact,
            }));
        }
    }
    Ok(None)
}

fn check(operation: &Operation, job: &Job<'_>) -> Result<()> {
    let size = job.data_type.bits().map_or(0, |b| (b / 8) as usize);
    let len = job.inputs.first().map_or(0, |i| i.bytes.len());
    let sink_len = match &job.sink {
        Sink::Memory(m) => m.len(),
        Sink::File { .. } => len,
    };
    if job.inputs.len() != operation.sources()
        || size == 0
        || len % size != 0
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
    Copy
    + Default
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
{
    /// `value` rounded to this type (NumPy's `astype`).
    fn of(value: f64) -> Self;
    fn to_f64(self) -> f64;
    fn is_finite(self) -> bool;
    fn is_infinite(self) -> bool;
    fn accumulator(scratch: &mut Scratch) -> &mut Vec<Self>;
}

impl Work for f64 {
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
    fn load(bytes: &[u8]) -> f64 {
        f64::from(f32::from_le_bytes(bytes.try_into().unwrap_or_default()))
    }
    fn store(value: f64, out: &mut [u8]) -> bool {
        let v = value as f32;
        out.copy_from_slice(&v.to_le_bytes());
        v.is_finite()
    }
}

impl Element for F64 {
    type Work = f64;
    const SIZE: usize = 8;
    fn load(bytes: &[u8]) -> f64 {
        f64::from_le_bytes(bytes.try_into().unwrap_or_default())
    }
    fn store(value: f64, out: &mut [u8]) -> bool {
        out.copy_from_slice(&value.to_le_bytes());
        value.is_finite()
    }
}

impl Element for F16 {
    type Work = f32;
    const SIZE: usize = 2;
    fn load(bytes: &[u8]) -> f32 {
        f16_bits_to_f32(u16::from_le_bytes(bytes.try_into().unwrap_or_default()))
    }
    fn store(value: f32, out: &mut [u8]) -> bool {
        let bits = f32_to_f16_bits(value);
        out.copy_from_slice(&bits.to_le_bytes());
        bits & 0x7c00 != 0x7c00
    }
}

impl Element for Bf16 {
    type Work = f32;
    const SIZE: usize = 2;
    fn load(bytes: &[u8]) -> f32 {
        bf16_bits_to_f32(u16::from_le_bytes(bytes.try_into().unwrap_or_default()))
    }
    fn store(value: f32, out: &mut [u8]) -> bool {
        let bits = f32_to_bf16_bits(value);
        out.copy_from_slice(&bits.to_le_bytes());
        bits & 0x7f80 != 0x7f80
    }
}

/// The element `at` of `input`.
fn element<E: Element>(input: &Input<'_>, at: usize) -> E::Work {
    E::load(&input.bytes[at * E::SIZE..(at + 1) * E::SIZE])
}

/// `acc[j] = f(acc[j], x[j])` over one source's chunk.
fn fold<E: Element>(acc: &mut [E::Work], bytes: &[u8], f: impl Fn(E::Work, E::Work) -> E::Work) {
    for (a, x) in acc.iter_mut().zip(bytes.chunks_exact(E::SIZE)) {
        *a = f(*a, E::load(x));
    }
}

/// One tensor, chunk by chunk: Some((element, exact value)) at the first overflow.
fn tensor<E: Element>(
    operation: &Operation,
    job: &mut Job<'_>,
    scratch: &mut Scratch,
    progress: &mut dyn FnMut(u64) -> Result<()>,
) -> Result<Option<(u64, f64)>> {
    let w = E::Work::of;
    let n = job.inputs[0].bytes.len() / E::SIZE;
    let mut out = std::mem::take(&mut scratch.out);
    out.resize(CHUNK.min(n) * E::SIZE, 0);
    let mut acc = std::mem::take(E::Work::accumulator(scratch));
    acc.resize(CHUNK.min(n), E::Work::default());
    let found = (|| {
        for start in (0..n).step_by(CHUNK) {
            let len = CHUNK.min(n - start);
            let acc = &mut acc[..len];
            for (i, input) in job.inputs.iter().enumerate() {
                let bytes = &input.bytes[start * E::SIZE..(start + len) * E::SIZE];
                if let Some(mapping) = &input.release {
                    populate(bytes);
                    accumulate::<E>(operation, i, acc, bytes);
                    release_around(bytes, mapping);
                } else {
                    accumulate::<E>(operation, i, acc, bytes);
                }
            }
            if let Operation::Average { total, .. } = operation {
                let total = w(*total);
                acc.iter_mut().for_each(|a| *a = *a / total);
            }
            let out = &mut out[..len * E::SIZE];
            let mut finite = true;
            for (a, o) in acc.iter().zip(out.chunks_exact_mut(E::SIZE)) {
                finite &= E::store(*a, o);
            }
            if !finite {
                if let Some(bad) = not_finite::<E>(operation, &job.inputs, acc, out, start) {
                    return Ok(Some(bad));
                }
            }
            put(&mut job.sink, start * E::SIZE, out)?;
            progress(out.len() as u64)?;
        }
        Ok(None)
    })();
    scratch.out = out;
    *E::Work::accumulator(scratch) = acc;
    found
}

/// Source `i`'s chunk `bytes` into the accumulator: the operation's step for that source,
/// its coefficient rounded to the work type once.
fn accumulate<E: Element>(operation: &Operation, i: usize, acc: &mut [E::Work], bytes: &[u8]) {
    let w = E::Work::of;
    match (operation, i) {
        (Operation::Average { weights, .. }, 0) => {
            let c = w(weights[0]);
            fold::<E>(acc, bytes, |_, x| x * c)
        }
        (Operation::Average { weights, .. }, _) => {
            let c = w(weights[i]);
            fold::<E>(acc, bytes, |a, x| a + x * c)
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
                exact = weights.iter().zip(inputs).fold(E::Work::default(), |sum, (c, i)| {
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

fn put(sink: &mut Sink<'_>, at: usize, bytes: &[u8]) -> Result<()> {
    match sink {
        Sink::Memory(memory) => {
            memory[at..at + bytes.len()].copy_from_slice(bytes);
            Ok(())
        }
        Sink::File { file, offset, path } => {
            use std::os::unix::fs::FileExt;
            file.write_all_at(bytes, *offset + at as u64)
                .map_err(|e| Error::from(e).in_file(path))
        }
    }
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
