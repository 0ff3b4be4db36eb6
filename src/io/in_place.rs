//! ONNX Runtime's saver, in a forked child, given a buffer that grows in place.
//!
//! ONNX Runtime's `save_checkpoint` builds the whole file in a `flatbuffers::FlatBufferBuilder`
//! that starts at 1 KiB and grows by half each time it fills: a new array (`operator new[]`),
//! what the old one holds copied to the new one's end (the builder fills downwards), the old one
//! freed. For a 768 MiB checkpoint that is 2.4 GiB of fresh memory and 622,603 page faults:
//! three quarters of the save's time. That array is the builder's alone in the saver's code
//! (ONNX Runtime 1.19: every other buffer it takes is a `std::vector` or smaller than 1 MiB).
//!
//! [`plan`] finds, in the parent, the two slots of ONNX Runtime's library through which it calls
//! `operator new[]` and `operator delete[]` (its global offset table: the dynamic loader is
//! asked nothing after the fork). [`install`], in the forked child that runs the saver and
//! nothing else, points them at [`grown_new`] and [`grown_delete`]:
//! - an array of 1 MiB or more is placed to end where a reserved mapping ends. The next, at
//!   least half again as large (the builder's growth), ends there too, so it holds the one
//!   before at the same addresses: the builder's copy writes each byte onto itself, no page is
//!   touched twice, and the memory is the final array's (ONNX Runtime's own save holds the last
//!   two arrays at once);
//! - a helper thread populates each new array's pages (`MADV_POPULATE_WRITE`) from its end
//!   downwards, ahead of the builder, on another core;
//! - any other array (smaller, or no growth of the one buffer, or a third) goes to the original
//!   operator, and its `delete[]` too.
//!
//! The child exits once ONNX Runtime's save returns, so nothing is ever put back.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

/// Arrays of this size or more are placed in the reserved mapping.
const IN_PLACE_FROM: usize = 1 << 20;
/// The reserved mapping: a flatbuffer holds at most 2 GiB.
const RESERVE: usize = 1 << 31;
/// The helper populates this much at a time.
const PIECE: usize = 2 << 20;
const MADV_POPULATE_WRITE: libc::c_int = 23;

/// Where ONNX Runtime's library calls `operator new[]` and `operator delete[]`, and what those
/// slots held when planned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    new_slot: usize,
    delete_slot: usize,
    original_new: usize,
    original_delete: usize,
}

/// The arrays placed in the reserved mapping and still held: the builder's buffer, and the
/// next one while the builder copies into it.
#[derive(Debug, Default)]
struct Held {
    arrays: Vec<(usize, usize)>, // (address, length)
}

impl Held {
    /// Where an array of `len` bytes goes in the mapping `[start, end)`: its end at `end`, when
    /// it is the first held or a growth (at least half again) of the one held; else None (the
    /// original operator's). Lengths not a multiple of 8 are no builder's.
    fn place(&mut self, len: usize, start: usize, end: usize) -> Option<usize> {
        if len < IN_PLACE_FROM || len > end - start || !len.is_multiple_of(8) {
            return None;
        }
        match self.arrays.as_slice() {
            [] => {}
            [(_, held)] if len >= held + held / 2 => {}
            _ => return None,
        }
        let at = end - len;
        self.arrays.push((at, len));
        Some(at)
    }

    /// Whether `at` was an array held here (now released).
    fn release(&mut self, at: usize) -> bool {
        match self.arrays.iter().position(|&(a, _)| a == at) {
            Some(i) => {
                self.arrays.swap_remove(i);
                true
            }
            None => false,
        }
    }
}

static HELD: Mutex<Held> = Mutex::new(Held { arrays: Vec::new() });
static START: AtomicUsize = AtomicUsize::new(0);
static END: AtomicUsize = AtomicUsize::new(0);
static ORIGINAL_NEW: AtomicUsize = AtomicUsize::new(0);
static ORIGINAL_DELETE: AtomicUsize = AtomicUsize::new(0);
/// Bytes below the mapping's end the helper is to populate (the largest array placed).
static AHEAD: AtomicUsize = AtomicUsize::new(0);
/// Bytes of arrays placed in the mapping (a report: the saver's buffer did grow in place).
static PLACED: AtomicU64 = AtomicU64::new(0);

type NewFn = unsafe extern "C-unwind" fn(usize) -> *mut libc::c_void;
type DeleteFn = unsafe extern "C-unwind" fn(*mut libc::c_void);

/// `operator new[]` for ONNX Runtime's library once installed.
unsafe extern "C-unwind" fn grown_new(len: usize) -> *mut libc::c_void {
    let (start, end) = (START.load(Ordering::Acquire), END.load(Ordering::Acquire));
    let placed = HELD
        .lock()
        .map(|mut held| held.place(len, start, end))
        .unwrap_or(None);
    match placed {
        Some(at) => {
            PLACED.fetch_add(len as u64, Ordering::Relaxed);
            AHEAD.fetch_max(len, Ordering::Release);
            at as *mut libc::c_void
        }
        None => {
            // SAFETY: the slot's value when planned, checked before it was replaced: the
            // operator ONNX Runtime called (a C++ exception from it unwinds through here).
            let original: NewFn =
                unsafe { std::mem::transmute(ORIGINAL_NEW.load(Ordering::Acquire)) };
            unsafe { original(len) }
        }
    }
}

/// `operator delete[]` for ONNX Runtime's library once installed.
unsafe extern "C-unwind" fn grown_delete(at: *mut libc::c_void) {
    let address = at as usize;
    let (start, end) = (START.load(Ordering::Acquire), END.load(Ordering::Acquire));
    if (start..end).contains(&address) {
        // Ours: released (an address in the mapping no array holds cannot come: nothing to do).
        if let Ok(mut held) = HELD.lock() {
            held.release(address);
        }
        return;
    }
    // SAFETY: as in grown_new.
    let original =
        unsafe { std::mem::transmute::<usize, DeleteFn>(ORIGINAL_DELETE.load(Ordering::Acquire)) };
    unsafe { original(at) }
}

/// The helper (a bare pthread: started in a forked child, where a lock of Rust's runtime
/// another thread held at the fork would stay held): populates the mapping from its end
/// downwards, as far as [`AHEAD`] says, looking again every 100 us once it is there. Stops at
/// the first refusal (an old kernel, no memory: the builder's own page faults then do it).
extern "C" fn populate_ahead(_: *mut libc::c_void) -> *mut libc::c_void {
    let end = END.load(Ordering::Acquire);
    let mut done = 0usize;
    loop {
        let ahead = AHEAD.load(Ordering::Acquire);
        if done >= ahead {
            // SAFETY: usleep has no preconditions.
            unsafe { libc::usleep(100) };
            continue;
        }
        let piece = PIECE.min(ahead - done);
        let first = end - done - piece;
        // SAFETY: pages of our own reserved mapping; populating changes no byte.
        if unsafe { libc::madvise(first as *mut libc::c_void, piece, MADV_POPULATE_WRITE) } != 0 {
            return std::ptr::null_mut();
        }
        done += piece;
    }
}

/// Bytes of arrays the saver's buffer took in place so far, in this process.
pub fn placed() -> u64 {
    PLACED.load(Ordering::Relaxed)
}

/// The slots of the loaded library whose file name contains `library` (exactly one must), or
/// None: not loaded, not an x86-64 or AArch64 ELF with lazy-bindable (PLT) `operator new[]` and
/// `operator delete[]` slots, or one that also imports a sized `operator delete[]`.
pub fn plan(library: &str) -> Option<Plan> {
    let mut found = Found {
        library,
        matches: 0,
        plan: None,
    };
    // SAFETY: the callback only reads the loaded objects' headers the loader hands it.
    unsafe {
        libc::dl_iterate_phdr(
            Some(each_object),
            &mut found as *mut Found as *mut libc::c_void,
        );
    }
    if found.matches == 1 {
        found.plan
    } else {
        None
    }
}

struct Found<'a> {
    library: &'a str,
    matches: usize,
    plan: Option<Plan>,
}

unsafe extern "C" fn each_object(
    info: *mut libc::dl_phdr_info,
    _size: libc::size_t,
    data: *mut libc::c_void,
) -> libc::c_int {
    // SAFETY: the loader's own record of a loaded object, and our Found.
    let (info, found) = unsafe { (&*info, &mut *(data as *mut Found)) };
    if info.dlpi_name.is_null() {
        return 0;
    }
    // SAFETY: a NUL-terminated path the loader keeps.
    let path = unsafe { std::ffi::CStr::from_ptr(info.dlpi_name) }.to_string_lossy();
    if !path
        .rsplit('/')
        .next()
        .is_some_and(|file| file.contains(found.library))
    {
        return 0;
    }
    found.matches += 1;
    // SAFETY: the object's program headers, mapped by the loader.
    found.plan = unsafe { plan_of(info) };
    0
}

#[repr(C)]
struct Dyn {
    tag: i64,
    value: u64,
}
#[repr(C)]
struct Rela {
    offset: u64,
    info: u64,
    _addend: i64,
}
#[repr(C)]
struct Sym {
    name: u32,
    _info: u8,
    _other: u8,
    _shndx: u16,
    _value: u64,
    _size: u64,
}

const PT_DYNAMIC: u32 = 2;
const DT_NULL: i64 = 0;
const DT_PLTRELSZ: i64 = 2;
const DT_STRTAB: i64 = 5;
const DT_SYMTAB: i64 = 6;
const DT_RELA: u64 = 7;
const DT_STRSZ: i64 = 10;
const DT_PLTREL: i64 = 20;
const DT_JMPREL: i64 = 23;
#[cfg(target_arch = "x86_64")]
const JUMP_SLOT: u32 = 7; // R_X86_64_JUMP_SLOT
#[cfg(target_arch = "aarch64")]
const JUMP_SLOT: u32 = 1026; // R_AARCH64_JUMP_SLOT
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const JUMP_SLOT: u32 = u32::MAX; // (no plan on other machines)

/// The plan for one loaded object, from its dynamic section's PLT relocations.
///
/// # Safety
/// `info` is the loader's record of a loaded object.
unsafe fn plan_of(info: &libc::dl_phdr_info) -> Option<Plan> {
    if cfg!(not(target_pointer_width = "64")) || JUMP_SLOT == u32::MAX {
        return None;
    }
    let base = info.dlpi_addr as usize;
    // SAFETY: the loader's program headers of the object.
    let headers = unsafe { std::slice::from_raw_parts(info.dlpi_phdr, info.dlpi_phnum as usize) };
    let dynamic = headers.iter().find(|h| h.p_type == PT_DYNAMIC)?;
    // The loader relocates these addresses in place on x86-64 and AArch64; one it did not is
    // below the load address.
    let absolute = |v: u64| -> usize {
        let v = v as usize;
        if v < base {
            v + base
        } else {
            v
        }
    };
    let (mut jmprel, mut pltrelsz, mut pltrel, mut symtab, mut strtab, mut strsz) =
        (0, 0, 0, 0, 0, 0);
    let mut entry = (base + dynamic.p_vaddr as usize) as *const Dyn;
    loop {
        // SAFETY: the dynamic section ends with DT_NULL.
        let d = unsafe { &*entry };
        match d.tag {
            DT_NULL => break,
            DT_JMPREL => jmprel = absolute(d.value),
            DT_PLTRELSZ => pltrelsz = d.value as usize,
            DT_PLTREL => pltrel = d.value,
            DT_SYMTAB => symtab = absolute(d.value),
            DT_STRTAB => strtab = absolute(d.value),
            DT_STRSZ => strsz = d.value as usize,
            _ => {}
        }
        // SAFETY: within the section, which goes on to DT_NULL.
        entry = unsafe { entry.add(1) };
    }
    if jmprel == 0 || pltrel != DT_RELA || symtab == 0 || strtab == 0 || strsz == 0 {
        return None;
    }
    // SAFETY: the object's string table, DT_STRSZ bytes.
    let strings = unsafe { std::slice::from_raw_parts(strtab as *const u8, strsz) };
    let name_at = |offset: u32| -> &[u8] {
        let rest = strings.get(offset as usize..).unwrap_or(&[]);
        &rest[..rest.iter().position(|&b| b == 0).unwrap_or(rest.len())]
    };
    let (mut new_slot, mut delete_slot) = (None, None);
    for k in 0..pltrelsz / std::mem::size_of::<Rela>() {
        // SAFETY: the PLT relocations, DT_PLTRELSZ bytes.
        let rela = unsafe { &*(jmprel as *const Rela).add(k) };
        if rela.info as u32 != JUMP_SLOT {
            continue;
        }
        // SAFETY: the symbol the relocation names, in the object's symbol table.
        let sym = unsafe { &*(symtab as *const Sym).add((rela.info >> 32) as usize) };
        let slot = base + rela.offset as usize;
        match name_at(sym.name) {
            b"_Znam" => new_slot = Some(slot),
            b"_ZdaPv" => delete_slot = Some(slot),
            b"_ZdaPvm" => return None, // (a sized delete[] the builder's arrays might go to)
            _ => {}
        }
    }
    let (new_slot, delete_slot) = (new_slot?, delete_slot?);
    // SAFETY: slots of the loaded object.
    let (original_new, original_delete) = unsafe {
        (
            std::ptr::read_volatile(new_slot as *const usize),
            std::ptr::read_volatile(delete_slot as *const usize),
        )
    };
    // Bound to the operators the process uses (not a lazy binding's stub, which would call the
    // loader, and rewrite the slot, in the child).
    // SAFETY: dlsym with NUL-terminated names.
    let (bound_new, bound_delete) = unsafe {
        (
            libc::dlsym(libc::RTLD_DEFAULT, c"_Znam".as_ptr()) as usize,
            libc::dlsym(libc::RTLD_DEFAULT, c"_ZdaPv".as_ptr()) as usize,
        )
    };
    if original_new != bound_new || original_delete != bound_delete || bound_new == 0 {
        return None;
    }
    Some(Plan {
        new_slot,
        delete_slot,
        original_new,
        original_delete,
    })
}

/// Points the planned slots at [`grown_new`] and [`grown_delete`], with a reserved mapping and
/// a helper thread; true once done. False, and nothing changed, where the mapping cannot be had
/// (`ulimit -v`, strict overcommit), the slots no longer hold what they held when planned, or a
/// slot cannot be made writable.
///
/// # Safety
/// Only in a process that runs nothing of ONNX Runtime's but one save from here on, on one
/// thread (a forked child), with `plan` made by [`plan`] in this address space.
pub unsafe fn install(plan: &Plan) -> bool {
    // SAFETY: reading the slots planned in this address space.
    let (new_now, delete_now) = unsafe {
        (
            std::ptr::read_volatile(plan.new_slot as *const usize),
            std::ptr::read_volatile(plan.delete_slot as *const usize),
        )
    };
    if new_now != plan.original_new
        || delete_now != plan.original_delete
        || END.load(Ordering::Acquire) != 0
    {
        return false;
    }
    // SAFETY: a new private anonymous mapping, pages made only when touched.
    let start = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            RESERVE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if start == libc::MAP_FAILED {
        return false;
    }
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
    for slot in [plan.new_slot, plan.delete_slot] {
        // SAFETY: the page of a slot of the loaded object (read-only after relocation: RELRO).
        if unsafe {
            libc::mprotect(
                (slot & !(page - 1)) as *mut libc::c_void,
                page,
                libc::PROT_READ | libc::PROT_WRITE,
            )
        } != 0
        {
            // SAFETY: our mapping, unused.
            unsafe { libc::munmap(start, RESERVE) };
            return false;
        }
    }
    let start = start as usize;
    START.store(start, Ordering::Release);
    END.store(start + RESERVE, Ordering::Release);
    ORIGINAL_NEW.store(plan.original_new, Ordering::Release);
    ORIGINAL_DELETE.store(plan.original_delete, Ordering::Release);
    let mut helper: libc::pthread_t = 0;
    // SAFETY: a detached-in-effect thread running populate_ahead, which needs no argument; no
    // thread to be had (an error) leaves the builder's own page faults to populate.
    unsafe {
        libc::pthread_create(
            &mut helper,
            std::ptr::null(),
            populate_ahead,
            std::ptr::null_mut(),
        );
    }
    // delete[] first: from here on an array of ours is freed by ours.
    // SAFETY: the slots, writable now, hold function addresses the library calls through.
    unsafe {
        std::ptr::write_volatile(
            plan.delete_slot as *mut usize,
            grown_delete as DeleteFn as usize,
        );
        std::ptr::write_volatile(plan.new_slot as *mut usize, grown_new as NewFn as usize);
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;
    const START_AT: usize = 1 << 40;
    const END_AT: usize = START_AT + RESERVE;

    /// The builder's growth from 1 KiB (flatbuffers: reserved += max(len, reserved / 2),
    /// rounded up to 8): each array of 1 MiB or more ends at the mapping's end, each holds the
    /// one before at the same addresses, and at most two are held at once.
    #[test]
    fn the_builders_growth_ends_every_array_at_the_mappings_end() {
        let mut held = Held::default();
        let mut reserved = 1024usize;
        let mut before: Option<(usize, usize)> = None;
        let mut placed = 0;
        while reserved < 1300 * MIB {
            let grown = (reserved + (reserved / 2).max(1)).div_ceil(8) * 8;
            let at = held.place(grown, START_AT, END_AT);
            if grown < IN_PLACE_FROM {
                assert_eq!(at, None);
            } else {
                let at = at.expect("placed");
                assert_eq!(at + grown, END_AT);
                if let Some((old, old_len)) = before {
                    assert_eq!(old + old_len, at + grown); // (the copy's bytes stay where they are)
                    assert!(held.release(old));
                }
                before = Some((at, grown));
                placed += 1;
            }
            assert!(held.arrays.len() <= 1);
            reserved = grown;
        }
        assert!(placed > 5);
    }

    /// A large array that is no growth of the one held, a third array, a small one, an odd
    /// length and one larger than the mapping all go to the original operator.
    #[test]
    fn arrays_that_are_no_growth_of_the_buffer_are_not_placed() {
        let mut held = Held::default();
        let first = held.place(4 * MIB, START_AT, END_AT).unwrap();
        assert_eq!(held.place(5 * MIB, START_AT, END_AT), None); // (not half again)
        assert_eq!(held.place(MIB - 8, START_AT, END_AT), None);
        let second = held.place(6 * MIB, START_AT, END_AT).unwrap();
        assert_eq!(held.place(9 * MIB, START_AT, END_AT), None); // (two held: a third)
        assert!(held.release(first));
        assert!(!held.release(first));
        assert_eq!(held.place(9 * MIB + 4, START_AT, END_AT), None); // (no builder's length)
        assert_eq!(held.place(RESERVE + 8, START_AT, END_AT), None);
        assert_eq!(
            held.place(9 * MIB, START_AT, END_AT),
            Some(END_AT - 9 * MIB)
        );
        assert!(held.release(second));
    }

    unsafe extern "C-unwind" fn fake_new(len: usize) -> *mut libc::c_void {
        // SAFETY: malloc has no preconditions.
        unsafe { libc::malloc(len) }
    }
    unsafe extern "C-unwind" fn fake_delete(at: *mut libc::c_void) {
        // SAFETY: only ever given what fake_new returned.
        unsafe { libc::free(at) }
    }

    /// Installed over two slots of ours (as a library's would be): the slots call ortckpt's
    /// operators; a builder's arrays end at the mapping's end, each holding the one before,
    /// and the helper populates them (resident before any byte is written); a small array and
    /// its delete[] are the original operators'. A second install, or one over slots that no
    /// longer hold what was planned, changes nothing.
    #[test]
    fn installed_slots_grow_the_buffer_in_place_and_pass_the_rest_on() {
        let slots: Box<[usize; 2]> =
            Box::new([fake_new as NewFn as usize, fake_delete as DeleteFn as usize]);
        let plan = Plan {
            new_slot: &slots[0] as *const usize as usize,
            delete_slot: &slots[1] as *const usize as usize,
            original_new: slots[0],
            original_delete: slots[1],
        };
        let stale = Plan {
            original_new: 1,
            ..plan
        };
        // SAFETY: the slots are ours; nothing else calls through them.
        assert!(!unsafe { install(&stale) });
        assert_eq!(slots[0], fake_new as NewFn as usize);
        assert!(unsafe { install(&plan) });
        assert!(!unsafe { install(&plan) }); // (once per process)
        let (new, delete): (NewFn, DeleteFn) = unsafe {
            (
                std::mem::transmute::<usize, NewFn>(slots[0]),
                std::mem::transmute::<usize, DeleteFn>(slots[1]),
            )
        };
        let end = END.load(Ordering::Acquire);
        let small = unsafe { new(4096) };
        assert!(!(START.load(Ordering::Acquire)..end).contains(&(small as usize)));
        unsafe { delete(small) };
        let first = unsafe { new(4 * MIB) } as usize;
        assert_eq!(first + 4 * MIB, end);
        // SAFETY: the array is ours, 4 MiB.
        unsafe { std::ptr::write_bytes((end - 16) as *mut u8, 7, 16) };
        let grown = unsafe { new(8 * MIB) } as usize;
        assert_eq!(grown + 8 * MIB, end);
        assert_eq!(unsafe { *((end - 1) as *const u8) }, 7); // (the old array's bytes, in place)
        unsafe { delete(first as *mut libc::c_void) };
        let resident = |at: usize, len: usize| -> bool {
            let mut pages = vec![0u8; len.div_ceil(4096)];
            // SAFETY: our mapping's pages, one byte per page out.
            let rc = unsafe { libc::mincore(at as *mut libc::c_void, len, pages.as_mut_ptr()) };
            rc == 0 && pages.iter().all(|p| p & 1 == 1)
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !resident(grown, 8 * MIB) {
            assert!(
                std::time::Instant::now() < deadline,
                "the helper populated nothing"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(!resident(end - 16 * MIB, 4096)); // (nothing past the largest array)
        unsafe { delete(grown as *mut libc::c_void) };
        assert!(HELD.lock().unwrap().arrays.is_empty());
        assert!(placed() >= (12 * MIB) as u64);
    }

    /// No loaded object by that name: no plan. The plan for the C library's own objects, which
    /// import no `operator new[]`, is none either.
    #[test]
    fn no_plan_for_a_library_not_loaded_or_without_the_slots() {
        assert_eq!(plan("no-such-library-is-loaded"), None);
        assert_eq!(plan("libc.so"), None);
    }
}
