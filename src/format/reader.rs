//! A flatbuffer reader whose every read is checked when it is made.
//!
//! The bytes may change while they are decoded: a file rewritten in place under our
//! private map (its untouched pages still show the file), or a shared mmap another
//! process writes. So nothing here relies on an earlier pass over the same bytes:
//! each value is copied out of the buffer once, through a raw pointer with volatile
//! reads (the compiler may neither read it again nor assume it unchanged), then
//! checked before it is used: offsets and lengths against the buffer's bounds, strings
//! as UTF-8 once copied. Tensor values are never read, only located.
//!
//! The checks repeat the flatbuffers verifier's (see `verify.rs`), field by field and
//! under the same limits, so on bytes that stay put they pass exactly where it passes (the
//! decoder visits the fields a checkpoint does not use too): the load is this one pass, and
//! the verifier runs only after a failed check, to word the error (if it passes then, the
//! bytes changed).

use std::marker::PhantomData;

use flatbuffers::{VOffsetT, VerifierOptions};

use crate::error::{Error, Result};

/// The error of a check that the verifier passed on the same bytes. Cold and out of
/// line, so the checks it ends stay small enough to inline.
#[cold]
#[inline(never)]
fn changed(what: std::fmt::Arguments<'_>) -> Error {
    Error::malformed(format!(
        "the checkpoint changed while it was being read ({what})"
    ))
}

/// A table: where it is and where its vtable is.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Table {
    pos: usize,
    vtable: usize,
    vtable_len: usize,
}

/// A vector of offsets (to tables or strings): its first element and length.
#[derive(Clone, Copy, Debug)]
pub(crate) struct List {
    start: usize,
    pub len: usize,
}

pub(crate) struct Reader<'a> {
    /// The buffer, read only by [`Reader::copy`] and [`Reader::copy_bytes`]: never
    /// through a reference, which would tell the compiler the bytes cannot change.
    ptr: *const u8,
    len: usize,
    _buf: PhantomData<&'a [u8]>,
    /// Tables and bytes visited so far, bounded as the verifier bounds them: a hostile
    /// file (a DAG of offsets to one big table, say) costs at most its own size. Depth
    /// needs no count: the decoder follows the schema, which nests tables 4 deep.
    tables: usize,
    apparent_size: usize,
    max_tables: usize,
    max_apparent_size: usize,
    /// What decoding may allocate (strings, dims, tensors), when bounded (see `within`), and
    /// what it has: past it, every read fails and `over_budget` says why.
    budget: Option<usize>,
    spent: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8], limits: &VerifierOptions) -> Self {
        Reader {
            ptr: buf.as_ptr(),
            len: buf.len(),
            _buf: PhantomData,
            tables: 0,
            apparent_size: 0,
            max_tables: limits.max_tables,
            max_apparent_size: limits.max_apparent_size,
            budget: None,
            spent: 0,
        }
    }

    #[inline]
    fn in_bounds(&self, pos: usize, size: usize) -> Result<()> {
        match pos.checked_add(size) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(changed(format_args!(
                "{size} bytes at {pos} lie beyond the end of its {} bytes",
                self.len
            ))),
        }
    }

    /// Copies the `N` bytes at `pos`: the one read of scalars.
    #[inline]
    fn copy<const N: usize>(&self, pos: usize) -> Result<[u8; N]> {
        self.in_bounds(pos, N)?;
        // SAFETY: pos..pos + N lies inside the buffer (checked just above), which outlives
        // 'a; [u8; N] needs no alignment.
        Ok(unsafe { self.ptr.add(pos).cast::<[u8; N]>().read_volatile() })
    }

    /// Copies the `size` bytes at `pos` (strings).
    fn copy_bytes(&mut self, pos: usize, size: usize) -> Result<Vec<u8>> {
        self.in_bounds(pos, size)?;
        self.charge(size)?;
        // SAFETY: every i is in pos..pos + size, inside the buffer (checked just above).
        Ok((pos..pos + size)
            .map(|i| unsafe { self.ptr.add(i).read_volatile() })
            .collect())
    }

    /// This reader, failing once decoding has allocated more than `budget` bytes (strings,
    /// dims and tensors, as counted by `charge`).
    pub fn within(mut self, budget: usize) -> Self {
        self.budget = Some(budget);
        self
    }

    /// Whether a read failed because the budget was spent (not because of the bytes).
    pub fn over_budget(&self) -> bool {
        self.budget.is_some_and(|budget| self.spent > budget)
    }

    /// Counts `size` more bytes allocated, failing past the budget.
    #[inline]
    pub fn charge(&mut self, size: usize) -> Result<()> {
        self.spent = self.spent.saturating_add(size);
        if self.over_budget() {
            return Err(Error::malformed(
                "decoding the checkpoint exceeded its allocation budget",
            ));
        }
        Ok(())
    }

    /// The verifier's `range_in_buffer`: in bounds, and counted against the size limit.
    #[inline]
    fn visit(&mut self, pos: usize, size: usize) -> Result<()> {
        self.in_bounds(pos, size)?;
        self.apparent_size = self.apparent_size.saturating_add(size);
        if self.apparent_size > self.max_apparent_size {
            return Err(changed(format_args!(
                "it refers to more bytes than it holds"
            )));
        }
        Ok(())
    }

    #[inline]
    fn aligned(pos: usize, align: usize) -> Result<()> {
        if pos.is_multiple_of(align) {
            Ok(())
        } else {
            Err(changed(format_args!(
                "position {pos} is not {align}-byte aligned"
            )))
        }
    }

    /// The bytes of a `T` at `pos`, aligned as the verifier requires (`align_of::<T>()`).
    #[inline]
    fn scalar<T, const N: usize>(&mut self, pos: usize) -> Result<[u8; N]> {
        Self::aligned(pos, align_of::<T>())?;
        self.visit(pos, N)?;
        self.copy(pos)
    }

    #[inline]
    fn u16_at(&mut self, pos: usize) -> Result<u16> {
        self.scalar::<u16, 2>(pos).map(u16::from_le_bytes)
    }

    #[inline]
    fn u32_at(&mut self, pos: usize) -> Result<u32> {
        self.scalar::<u32, 4>(pos).map(u32::from_le_bytes)
    }

    /// Follows the unsigned offset at `pos`.
    #[inline]
    fn offset_at(&mut self, pos: usize) -> Result<usize> {
        let offset = self.u32_at(pos)? as usize;
        Ok(pos.saturating_add(offset))
    }

    /// The table at `pos` (the verifier's `visit_table`).
    fn table_at(&mut self, pos: usize) -> Result<Table> {
        let soffset = i32::from_le_bytes(self.scalar::<i32, 4>(pos)?);
        // The vtable is at pos - soffset, which must be in the buffer.
        let vtable = if soffset > 0 {
            pos.checked_sub(soffset.unsigned_abs() as usize)
        } else {
            pos.checked_add(soffset.unsigned_abs() as usize)
        }
        .filter(|&v| v < self.len)
        .ok_or_else(|| {
            changed(format_args!(
                "the vtable offset of the table at {pos} points outside"
            ))
        })?;
        let vtable_len = self.u16_at(vtable)? as usize;
        Self::aligned(vtable.saturating_add(vtable_len), 2)?;
        self.visit(vtable, vtable_len)?;
        self.tables += 1;
        if self.tables > self.max_tables {
            return Err(changed(format_args!(
                "it holds more tables than its size allows"
            )));
        }
        Ok(Table {
            pos,
            vtable,
            vtable_len,
        })
    }

    /// The file identifier (bytes 4 to 8).
    pub fn identifier(&self) -> Result<[u8; 4]> {
        self.copy(4)
    }

    /// The root table, after checking the file identifier.
    pub fn root(&mut self, identifier: &str) -> Result<Table> {
        if self.identifier()? != *identifier.as_bytes() {
            return Err(changed(format_args!(
                "its file identifier is not {identifier}"
            )));
        }
        let pos = self.offset_at(0)?;
        self.table_at(pos)
    }

    /// Where `field` of `t` is, or None when it is absent (the verifier's `deref`).
    #[inline]
    fn field(&mut self, t: Table, field: VOffsetT) -> Result<Option<usize>> {
        let field = field as usize;
        if field >= t.vtable_len {
            return Ok(None);
        }
        let offset = self.u16_at(t.vtable.saturating_add(field))?;
        Ok((offset > 0).then(|| t.pos.saturating_add(offset as usize)))
    }

    #[inline]
    fn scalar_field<T, const N: usize>(
        &mut self,
        t: Table,
        field: VOffsetT,
    ) -> Result<Option<[u8; N]>> {
        match self.field(t, field)? {
            Some(pos) => self.scalar::<T, N>(pos).map(Some),
            None => Ok(None),
        }
    }

    /// A bool field (default false): any byte but 0 is true, as flatbuffers reads it.
    pub fn bool(&mut self, t: Table, field: VOffsetT) -> Result<bool> {
        Ok(self
            .scalar_field::<bool, 1>(t, field)?
            .is_some_and(|[b]| b != 0))
    }

    pub fn i32(&mut self, t: Table, field: VOffsetT, default: i32) -> Result<i32> {
        Ok(self
            .scalar_field::<i32, 4>(t, field)?
            .map_or(default, i32::from_le_bytes))
    }

    pub fn i64(&mut self, t: Table, field: VOffsetT, default: i64) -> Result<i64> {
        Ok(self
            .scalar_field::<i64, 8>(t, field)?
            .map_or(default, i64::from_le_bytes))
    }

    pub fn f32(&mut self, t: Table, field: VOffsetT, default: f32) -> Result<f32> {
        Ok(self
            .scalar_field::<f32, 4>(t, field)?
            .map_or(default, f32::from_le_bytes))
    }

    /// Follows the offset of `field`, if present.
    fn target(&mut self, t: Table, field: VOffsetT) -> Result<Option<usize>> {
        match self.field(t, field)? {
            Some(pos) => self.offset_at(pos).map(Some),
            None => Ok(None),
        }
    }

    pub fn table(&mut self, t: Table, field: VOffsetT) -> Result<Option<Table>> {
        match self.target(t, field)? {
            Some(pos) => self.table_at(pos).map(Some),
            None => Ok(None),
        }
    }

    /// The vector at `pos` of `elem_size`-byte elements aligned to `align`: where its
    /// elements start, and how many there are (bounded by the buffer).
    fn vector_at(&mut self, pos: usize, elem_size: usize, align: usize) -> Result<(usize, usize)> {
        let count = self.u32_at(pos)? as usize;
        let start = pos.saturating_add(4);
        Self::aligned(start, align)?;
        self.visit(start, count.saturating_mul(elem_size))?;
        Ok((start, count))
    }

    /// A vector of offsets to tables or strings.
    pub fn list(&mut self, t: Table, field: VOffsetT) -> Result<Option<List>> {
        match self.target(t, field)? {
            Some(pos) => {
                let (start, len) = self.vector_at(pos, 4, 4)?;
                Ok(Some(List { start, len }))
            }
            None => Ok(None),
        }
    }

    fn element(list: List, index: usize) -> Result<usize> {
        if index >= list.len {
            return Err(changed(format_args!(
                "element {index} of a list of {}",
                list.len
            )));
        }
        Ok(list.start.saturating_add(index.saturating_mul(4)))
    }

    pub fn table_in(&mut self, list: List, index: usize) -> Result<Table> {
        let pos = self.offset_at(Self::element(list, index)?)?;
        self.table_at(pos)
    }

    pub fn string_in(&mut self, list: List, index: usize) -> Result<String> {
        let pos = self.offset_at(Self::element(list, index)?)?;
        self.string_at(pos)
    }

    /// The string at `pos`, copied: UTF-8 and null-terminated, as the verifier demands.
    fn string_at(&mut self, pos: usize) -> Result<String> {
        let (start, len) = self.vector_at(pos, 1, 1)?;
        let bytes = self.copy_bytes(start, len)?;
        if !matches!(self.copy::<1>(start.saturating_add(len)), Ok([0])) {
            return Err(changed(format_args!(
                "the string at {pos} has no null terminator"
            )));
        }
        String::from_utf8(bytes)
            .map_err(|e| changed(format_args!("the string at {pos} is not UTF-8: {e}")))
    }

    pub fn string(&mut self, t: Table, field: VOffsetT) -> Result<Option<String>> {
        match self.target(t, field)? {
            Some(pos) => self.string_at(pos).map(Some),
            None => Ok(None),
        }
    }

    /// A vector of int64, copied; 4-byte alignment is enough (see `verify.rs`).
    pub fn int64s(&mut self, t: Table, field: VOffsetT) -> Result<Option<Vec<i64>>> {
        let Some(pos) = self.target(t, field)? else {
            return Ok(None);
        };
        let (start, count) = self.vector_at(pos, 8, 4)?;
        self.charge(count.saturating_mul(8))?;
        // start + 8 * count <= len: vector_at checked it.
        (0..count)
            .map(|i| self.copy(start + 8 * i).map(i64::from_le_bytes))
            .collect::<Result<_>>()
            .map(Some)
    }

    /// A vector of bytes, not copied: where its bytes start, and how many there are.
    pub fn byte_range(&mut self, t: Table, field: VOffsetT) -> Result<Option<(usize, usize)>> {
        match self.target(t, field)? {
            Some(pos) => self.vector_at(pos, 1, 1).map(Some),
            None => Ok(None),
        }
    }
}
