//! The malformed-file corpus (tests/data/malformed): broken and hostile
//! checkpoints, each with the error it must give.
//!
//! The corpus is defined here, in code, and committed as files so that other
//! readers (the Python tests, fuzzers' seeds, other implementations) can use it.
//! `make corpus` (ORTCKPT_WRITE_CORPUS=1) rewrites the files; the tests check
//! that the committed files are exactly what this code builds.
//!
//! Every case must fail with its typed error (or, where the format cannot tell,
//! load), and decoding must allocate no more than the file's size plus a small
//! fixed allowance: measured with a per-thread counting allocator.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::{Path, PathBuf};

use flatbuffers::{FlatBufferBuilder, WIPOffset};
use ortckpt::format::{decode, encode, Checkpoint, DataType, Payload, Placement, Stored, Tensor};
use ortckpt::generated::onnxruntime::fbs;
use ortckpt::{load, ErrorKind};

// ---------------------------------------------------------------------------
// Allocation accounting, per thread (tests run in parallel).

struct CountingAllocator;

thread_local! {
    static LIVE: Cell<usize> = const { Cell::new(0) };
    static PEAK: Cell<usize> = const { Cell::new(0) };
}

fn note_alloc(size: usize) {
    let _ = LIVE.try_with(|live| {
        let now = live.get() + size;
        live.set(now);
        let _ = PEAK.try_with(|peak| peak.set(peak.get().max(now)));
    });
}

fn note_free(size: usize) {
    let _ = LIVE.try_with(|live| live.set(live.get().saturating_sub(size)));
}

// SAFETY: forwards to the system allocator; the bookkeeping touches only
// const-initialised thread-locals, which never allocate.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note_alloc(layout.size());
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        note_free(layout.size());
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note_free(layout.size());
        note_alloc(new_size);
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// Peak bytes allocated by this thread while `f` ran, beyond what was live before.
fn peak_allocation<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let before = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(before));
    let out = f();
    (out, PEAK.with(Cell::get) - before)
}

/// What decoding may allocate beyond the file's own size: the error message, the
/// top-level vectors' first capacities, and the like.
const FIXED_ALLOWANCE: usize = 16 << 10;

// ---------------------------------------------------------------------------
// The expected outcomes.

#[derive(Clone, Copy, Debug)]
enum Expect {
    /// ErrorKind::Malformed whose message contains the text, naming the tensor if given.
    Malformed(&'static str, Option<&'static str>),
    UnsupportedDataType(i32, &'static str),
    /// The OS error "not found" for the external data file.
    DataFileNotFound,
    /// The format has no checksum: this damage is invisible to any reader.
    Loads,
}

struct Case {
    name: &'static str,
    what: &'static str,
    main: Vec<u8>,
    /// The external data file, if the case has one.
    data: Option<Vec<u8>>,
    expect: Expect,
}

// ---------------------------------------------------------------------------
// Building blocks.

/// A valid inline checkpoint written by ortckpt: two parameters, one frozen, an
/// AdamW group and properties.
fn valid_checkpoint() -> Vec<u8> {
    let w: Vec<u8> = (0..96u8).collect();
    let b: Vec<u8> = (0..16u8).map(|x| x.wrapping_mul(7)).collect();
    let m: Vec<u8> = vec![0x3f; 96];
    let f32_tensor = |name: &str, dims: Vec<i64>, bytes| Tensor {
        name: name.to_owned(),
        data_type: DataType::Float,
        dims,
        data: Payload::Bytes(bytes),
    };
    let ckpt = Checkpoint {
        version: ortckpt::format::CHECKPOINT_VERSION,
        trainable: vec![f32_tensor("layer.weight", vec![4, 6], &w)],
        frozen: vec![f32_tensor("layer.bias", vec![4], &b)],
        is_nominal: false,
        has_external_data: false,
        optimizer_groups: vec![ortckpt::format::model::OptimizerGroup {
            name: "group0".into(),
            step: 3,
            initial_learning_rate: 1e-3,
            states: vec![ortckpt::format::model::ParameterOptimizerState {
                param_name: "layer.weight".into(),
                momentums: vec![
                    f32_tensor("momentum0", vec![4, 6], &m),
                    f32_tensor("momentum1", vec![4, 6], &m),
                ],
            }],
        }],
        properties: ortckpt::format::model::PropertyBag {
            ints: vec![("epoch".into(), 2)],
            floats: vec![],
            strings: vec![("note".into(), "corpus".into())],
        },
    };
    let mut encoded = encode(&ckpt, Placement::Inline).unwrap();
    encoded.seal_from_memory(); // (an inline file's pair id derives from its checksums: stable)
    encoded.segments().concat()
}

/// Where each tensor's values lie in `buf` (a valid inline checkpoint), file order.
fn inline_values(buf: &[u8]) -> Vec<(usize, usize)> {
    let ckpt = decode(buf).unwrap();
    let mut out: Vec<_> = ckpt
        .tensors()
        .filter_map(|t| match t.data {
            Stored::Inline { offset, len } => Some((offset, len)),
            _ => None,
        })
        .collect();
    out.sort_unstable();
    out
}

/// A hand-built tensor; each part can be left out or bent.
#[derive(Clone)]
struct Raw {
    name: Option<&'static str>,
    dims: Option<Vec<i64>>,
    data_type: i32,
    raw_data: Option<Vec<u8>>,
    external_data_offset: i64,
}

fn raw(name: &'static str, dims: &[i64], bytes: usize) -> Raw {
    Raw {
        name: Some(name),
        dims: Some(dims.to_vec()),
        data_type: 1,
        raw_data: Some(vec![0x11; bytes]),
        external_data_offset: -1,
    }
}

fn external(name: &'static str, dims: &[i64], offset: i64) -> Raw {
    Raw {
        raw_data: None,
        external_data_offset: offset,
        ..raw(name, dims, 0)
    }
}

/// What the module state holds; `None` leaves a required vector out.
struct Module {
    version: i32,
    trainable: Option<Vec<Raw>>,
    frozen: Option<Vec<Raw>>,
    has_external_data: bool,
}

impl Module {
    fn with(trainable: Vec<Raw>) -> Self {
        Module {
            version: 2,
            trainable: Some(trainable),
            frozen: Some(Vec::new()),
            has_external_data: false,
        }
    }

    fn external(trainable: Vec<Raw>) -> Self {
        Module {
            has_external_data: true,
            ..Module::with(trainable)
        }
    }

    fn build(&self) -> Vec<u8> {
        let mut fbb = FlatBufferBuilder::new();
        let requires_grad_params = self.trainable.as_ref().map(|l| tensors(&mut fbb, l));
        let frozen_params = self.frozen.as_ref().map(|l| tensors(&mut fbb, l));
        let args = fbs::ModuleStateArgs {
            requires_grad_params,
            frozen_params,
            is_nominal_state: false,
            has_external_data: self.has_external_data,
        };
        let module_state = Some(fbs::ModuleState::create(&mut fbb, &args));
        finish(&mut fbb, self.version, module_state)
    }
}

fn finish<'f>(
    fbb: &mut FlatBufferBuilder<'f>,
    version: i32,
    module_state: Option<WIPOffset<fbs::ModuleState<'f>>>,
) -> Vec<u8> {
    let optimizer_groups = Some(fbb.create_vector::<WIPOffset<fbs::OptimizerGroup>>(&[]));
    let args = fbs::CheckpointArgs {
        version,
        module_state,
        optimizer_groups,
        property_bag: None,
    };
    let root = fbs::Checkpoint::create(fbb, &args);
    fbs::finish_checkpoint_buffer(fbb, root);
    fbb.finished_data().to_vec()
}

fn tensor<'f>(fbb: &mut FlatBufferBuilder<'f>, t: &Raw) -> WIPOffset<fbs::Tensor<'f>> {
    let raw_data = t.raw_data.as_ref().map(|r| fbb.create_vector(r));
    tensor_with_data(fbb, t, raw_data)
}

fn tensor_with_data<'f>(
    fbb: &mut FlatBufferBuilder<'f>,
    t: &Raw,
    raw_data: Option<WIPOffset<flatbuffers::Vector<'f, u8>>>,
) -> WIPOffset<fbs::Tensor<'f>> {
    let name = t.name.map(|n| fbb.create_string(n));
    let args = fbs::TensorArgs {
        name,
        doc_string: None,
        dims: t.dims.as_ref().map(|d| fbb.create_vector(d)),
        data_type: fbs::TensorDataType(t.data_type),
        raw_data,
        string_data: None,
        external_data_offset: t.external_data_offset,
    };
    fbs::Tensor::create(fbb, &args)
}

fn tensors<'f>(
    fbb: &mut FlatBufferBuilder<'f>,
    list: &[Raw],
) -> WIPOffset<flatbuffers::Vector<'f, flatbuffers::ForwardsUOffset<fbs::Tensor<'f>>>> {
    let offsets: Vec<_> = list.iter().map(|t| tensor(fbb, t)).collect();
    fbb.create_vector(&offsets)
}

/// Two parameters whose raw_data is the same vector.
fn shared_raw_data() -> Vec<u8> {
    let mut fbb = FlatBufferBuilder::new();
    let shared = fbb.create_vector(&[0x22u8; 16]);
    let a = tensor_with_data(&mut fbb, &raw("a", &[4], 0), Some(shared));
    let b = tensor_with_data(&mut fbb, &raw("b", &[4], 0), Some(shared));
    let trainable = fbb.create_vector(&[a, b]);
    let frozen = fbb.create_vector::<WIPOffset<fbs::Tensor>>(&[]);
    let args = fbs::ModuleStateArgs {
        requires_grad_params: Some(trainable),
        frozen_params: Some(frozen),
        ..Default::default()
    };
    let module_state = Some(fbs::ModuleState::create(&mut fbb, &args));
    finish(&mut fbb, 2, module_state)
}

/// A parameter vector of `count` entries that all point at one tensor table: tiny
/// on disk, huge once expanded (a "DAG bomb").
fn dag_bomb(count: usize) -> Vec<u8> {
    let mut fbb = FlatBufferBuilder::new();
    let one = tensor(&mut fbb, &raw("w", &[1], 4));
    let trainable = fbb.create_vector(&vec![one; count]);
    let frozen = fbb.create_vector::<WIPOffset<fbs::Tensor>>(&[]);
    let args = fbs::ModuleStateArgs {
        requires_grad_params: Some(trainable),
        frozen_params: Some(frozen),
        ..Default::default()
    };
    let module_state = Some(fbs::ModuleState::create(&mut fbb, &args));
    finish(&mut fbb, 2, module_state)
}

/// Where the root table's first vector (optimizer groups or module state's) is: the
/// offset of the u32 length prefix of the parameter vector in a [`Module`] build.
fn length_prefix_of_parameters(buf: &[u8]) -> usize {
    let root = fbs::root_as_checkpoint(buf).unwrap();
    let params = root.module_state().unwrap().requires_grad_params().unwrap();
    params.bytes().as_ptr() as usize - buf.as_ptr() as usize - 4
}

fn length_prefix_of_raw_data(buf: &[u8]) -> usize {
    let root = fbs::root_as_checkpoint(buf).unwrap();
    let params = root.module_state().unwrap().requires_grad_params().unwrap();
    let data = params.get(0).raw_data().unwrap();
    data.bytes().as_ptr() as usize - buf.as_ptr() as usize - 4
}

fn patch_u32(mut buf: Vec<u8>, at: usize, value: u32) -> Vec<u8> {
    buf[at..at + 4].copy_from_slice(&value.to_le_bytes());
    buf
}

fn flip(mut buf: Vec<u8>, at: usize, bit: u8) -> Vec<u8> {
    buf[at] ^= 1 << bit;
    buf
}

// ---------------------------------------------------------------------------
// The corpus.

fn corpus() -> Vec<Case> {
    use Expect::*;
    let valid = valid_checkpoint();
    let values = inline_values(&valid);
    let (first_value, first_len) = values[0];
    let (last_value, last_len) = *values.last().unwrap();
    let metadata_end = first_value - 4;
    let case = |name, what, main: Vec<u8>, expect| Case {
        name,
        what,
        main,
        data: None,
        expect,
    };
    let with_data = |name, what, main: Vec<u8>, data: Vec<u8>, expect| Case {
        name,
        what,
        main,
        data: Some(data),
        expect,
    };
    let mut root_offset_wild = valid.clone();
    root_offset_wild[0..4].copy_from_slice(&0xffff_fff0u32.to_le_bytes());
    let root_table = u32::from_le_bytes(valid[0..4].try_into().unwrap()) as usize;
    // Built with a placeholder name, whose bytes are then made invalid UTF-8.
    let invalid_utf8 = {
        let mut b = Module::with(vec![raw("w_PLACEHOLDER", &[1], 4)]).build();
        let at = b.windows(13).position(|w| w == b"w_PLACEHOLDER").unwrap();
        b[at + 1] = 0xff;
        b[at + 2] = 0xfe;
        b
    };

    vec![
        case(
            "empty",
            "a zero-byte file",
            vec![],
            Malformed("too short", None),
        ),
        case(
            "short",
            "7 bytes",
            valid[..7].to_vec(),
            Malformed("too short", None),
        ),
        case(
            "text",
            "a text file",
            b"this is not a checkpoint, it is a note\n".to_vec(),
            Malformed("not an ONNX Runtime training checkpoint", None),
        ),
        case(
            "wrong_identifier",
            "identifier ORTM (an ONNX Runtime model) instead of ODTC",
            {
                let mut b = valid.clone();
                b[4..8].copy_from_slice(b"ORTM");
                b
            },
            Malformed("file identifier", None),
        ),
        case(
            "truncated_after_identifier",
            "root offset and identifier only",
            valid[..8].to_vec(),
            Malformed("verification failed", None),
        ),
        case(
            "truncated_in_root_table",
            "cut inside the root table",
            valid[..root_table + 2].to_vec(),
            Malformed("verification failed", None),
        ),
        case(
            "truncated_mid_metadata",
            "cut halfway through the metadata",
            valid[..metadata_end / 2].to_vec(),
            Malformed("verification failed", None),
        ),
        case(
            "truncated_at_first_value",
            "cut where the first tensor's bytes begin",
            valid[..first_value].to_vec(),
            Malformed("verification failed", None),
        ),
        case(
            "truncated_mid_value",
            "cut in the middle of the first tensor's bytes",
            valid[..first_value + first_len / 2].to_vec(),
            Malformed("verification failed", None),
        ),
        case(
            "truncated_last_byte",
            "the last tensor's final byte missing",
            valid[..last_value + last_len - 1].to_vec(),
            Malformed("verification failed", None),
        ),
        case(
            "root_offset_out_of_range",
            "root offset pointing 4 GiB away",
            root_offset_wild,
            Malformed("verification failed", None),
        ),
        case(
            "bitflip_root_vtable",
            "high bit of the root table's vtable offset flipped",
            flip(valid.clone(), root_table + 3, 7),
            Malformed("verification failed", None),
        ),
        case(
            "huge_root_table",
            "the root table's vtable claiming a 65,535-byte vtable and table",
            {
                let mut b = valid.clone();
                let soffset = i32::from_le_bytes(b[root_table..root_table + 4].try_into().unwrap());
                let vtable = (root_table as i64 - i64::from(soffset)) as usize;
                b[vtable..vtable + 4].copy_from_slice(&[0xff, 0xff, 0xff, 0xff]);
                b
            },
            Malformed("verification failed", None),
        ),
        case(
            "bitflip_in_values",
            "one bit of a tensor's bytes flipped: the format has no checksum, so \
             the file loads with a changed value (ortckpt cannot tell, nor can ONNX Runtime)",
            flip(valid.clone(), first_value + 5, 2),
            Loads,
        ),
        case(
            "version_0",
            "checkpoint version 0 (ONNX Runtime wrote 1 and 2)",
            Module {
                version: 0,
                ..Module::with(vec![raw("w", &[1], 4)])
            }
            .build(),
            Malformed("version 0 is not supported", None),
        ),
        case(
            "version_1_with_external_data",
            "checkpoint version 1 (readable) claiming external data, a flag version 2 added",
            Module {
                version: 1,
                has_external_data: true,
                ..Module::with(vec![raw("w", &[1], 4)])
            }
            .build(),
            Malformed(
                "version-1 checkpoint cannot be nominal or have external data",
                None,
            ),
        ),
        case(
            "version_3",
            "checkpoint version 3",
            Module {
                version: 3,
                ..Module::with(vec![raw("w", &[1], 4)])
            }
            .build(),
            Malformed("version 3 is not supported", None),
        ),
        case(
            "no_requires_grad_params",
            "module state without its trainable-parameter vector",
            Module {
                trainable: None,
                ..Module::with(vec![])
            }
            .build(),
            Malformed("no requires_grad_params", None),
        ),
        case(
            "no_frozen_params",
            "module state without its frozen-parameter vector",
            Module {
                frozen: None,
                ..Module::with(vec![raw("w", &[1], 4)])
            }
            .build(),
            Malformed("no frozen_params", None),
        ),
        case(
            "tensor_without_name",
            "a parameter with no name",
            Module::with(vec![Raw {
                name: None,
                ..raw("w", &[1], 4)
            }])
            .build(),
            Malformed("has no name", None),
        ),
        case(
            "tensor_name_not_utf8",
            "a parameter name that is not UTF-8",
            invalid_utf8,
            Malformed("verification failed", None),
        ),
        case(
            "tensor_without_dims",
            "a parameter with no dims",
            Module::with(vec![Raw {
                dims: None,
                ..raw("w", &[1], 4)
            }])
            .build(),
            Malformed("no dims", Some("w")),
        ),
        case(
            "tensor_without_values",
            "neither raw_data nor an external offset",
            Module::with(vec![Raw {
                raw_data: None,
                ..raw("w", &[1], 4)
            }])
            .build(),
            Malformed("neither raw_data", Some("w")),
        ),
        case(
            "negative_dim",
            "dims [3, -1]",
            Module::with(vec![raw("w", &[3, -1], 12)]).build(),
            Malformed("negative dimension -1", Some("w")),
        ),
        case(
            "dims_overflow_count",
            "dims whose product overflows 64 bits",
            Module::with(vec![raw("w", &[i64::MAX, i64::MAX], 4)]).build(),
            Malformed("overflow the element count", Some("w")),
        ),
        case(
            "dims_overflow_bytes",
            "an element count whose byte length overflows 64 bits",
            Module::with(vec![raw("w", &[1 << 61, 1], 4)]).build(),
            Malformed("overflow the byte length", Some("w")),
        ),
        case(
            "bytes_disagree_with_dims",
            "12 bytes for dims [2, 2] of float",
            Module::with(vec![raw("w", &[2, 2], 12)]).build(),
            Malformed("need 16", Some("w")),
        ),
        case(
            "unknown_data_type",
            "data type code 99",
            Module::with(vec![Raw {
                data_type: 99,
                ..raw("w", &[1], 4)
            }])
            .build(),
            UnsupportedDataType(99, "w"),
        ),
        case(
            "undefined_data_type",
            "data type UNDEFINED (0), which has no element size",
            Module::with(vec![Raw {
                data_type: 0,
                ..raw("w", &[1], 4)
            }])
            .build(),
            UnsupportedDataType(0, "w"),
        ),
        case(
            "duplicate_names",
            "two parameters named w",
            Module::with(vec![raw("w", &[1], 4), raw("w", &[1], 4)]).build(),
            Malformed("duplicate parameter name 'w'", None),
        ),
        case(
            "shared_values",
            "two parameters whose raw_data is the same vector (writing one would change the other)",
            shared_raw_data(),
            Malformed("overlap", Some("b")),
        ),
        case(
            "absurd_vector_length",
            "a raw_data length prefix of 2^31 - 16 bytes in a small file",
            {
                let b = Module::with(vec![raw("w", &[1], 4)]).build();
                let at = length_prefix_of_raw_data(&b);
                patch_u32(b, at, 0x7fff_fff0)
            },
            Malformed("verification failed", None),
        ),
        case(
            "absurd_tensor_count",
            "a parameter vector claiming a billion tensors",
            {
                let b = Module::with(vec![raw("w", &[1], 4)]).build();
                let at = length_prefix_of_parameters(&b);
                patch_u32(b, at, 1 << 30)
            },
            Malformed("verification failed", None),
        ),
        case(
            "dag_bomb",
            "10,000 parameter entries all pointing at one table",
            dag_bomb(10_000),
            Malformed("verification failed", None),
        ),
        case(
            "external_offset_without_flag",
            "an external offset in a checkpoint that says it has no external data",
            Module::with(vec![external("w", &[1], 0)]).build(),
            Malformed("external_data_offset", Some("w")),
        ),
        with_data(
            "external_past_end",
            "external data at offset 64 in a 64-byte data file",
            Module::external(vec![external("w", &[16], 64)]).build(),
            vec![0; 64],
            Malformed("beyond the end of the data file", Some("w")),
        ),
        with_data(
            "external_offset_huge",
            "external offset 2^63 - 1 (offset + length overflows)",
            Module::external(vec![external("w", &[16], i64::MAX)]).build(),
            vec![0; 64],
            Malformed("beyond the end of the data file", Some("w")),
        ),
        with_data(
            "external_overlapping",
            "two parameters whose external ranges overlap",
            Module::external(vec![external("a", &[16], 0), external("b", &[16], 32)]).build(),
            vec![0; 128],
            Malformed("overlap", Some("b")),
        ),
        case(
            "external_data_missing",
            "an external checkpoint whose .data file is absent",
            Module::external(vec![external("w", &[16], 0)]).build(),
            DataFileNotFound,
        ),
    ]
}

// ---------------------------------------------------------------------------
// The checks.

fn corpus_dir() -> PathBuf {
    common::data_dir().join("malformed")
}

fn file_of(case: &Case) -> PathBuf {
    corpus_dir().join(format!("{}.ckpt", case.name))
}

fn data_file_of(case: &Case) -> PathBuf {
    ortckpt::external_data_path(&file_of(case))
}

/// The corpus's index, read by the Python tests: name, description, expected error.
fn manifest(cases: &[Case]) -> String {
    let entries: Vec<serde_json::Value> = cases
        .iter()
        .map(|c| {
            let (kind, contains, tensor) = match c.expect {
                Expect::Malformed(text, tensor) => ("malformed", text.to_owned(), tensor),
                Expect::UnsupportedDataType(code, tensor) => {
                    ("unsupported_data_type", code.to_string(), Some(tensor))
                }
                Expect::DataFileNotFound => ("not_found", String::new(), None),
                Expect::Loads => ("loads", String::new(), None),
            };
            serde_json::json!({
                "file": format!("{}.ckpt", c.name),
                "data_file": c.data.as_ref().map(|_| format!("{}.ckpt.data", c.name)),
                "what": c.what,
                "expect": kind,
                "message_contains": contains,
                "tensor": tensor,
            })
        })
        .collect();
    serde_json::to_string_pretty(&entries).unwrap() + "\n"
}

#[test]
fn the_committed_corpus_is_what_this_code_builds() {
    let cases = corpus();
    let dir = corpus_dir();
    if std::env::var_os("ORTCKPT_WRITE_CORPUS").is_some() {
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for c in &cases {
            std::fs::write(file_of(c), &c.main).unwrap();
            if let Some(data) = &c.data {
                std::fs::write(data_file_of(c), data).unwrap();
            }
        }
        std::fs::write(dir.join("expected.json"), manifest(&cases)).unwrap();
    }
    let mut committed: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    committed.sort();
    let mut expected: Vec<String> = cases
        .iter()
        .flat_map(|c| {
            let mut names = vec![format!("{}.ckpt", c.name)];
            if c.data.is_some() {
                names.push(format!("{}.ckpt.data", c.name));
            }
            names
        })
        .chain(["expected.json".to_owned()])
        .collect();
    expected.sort();
    assert_eq!(
        committed, expected,
        "run `make corpus` to rewrite tests/data/malformed"
    );
    for c in &cases {
        assert!(
            std::fs::read(file_of(c)).unwrap() == c.main,
            "{} differs: run `make corpus`",
            c.name
        );
        if let Some(data) = &c.data {
            assert!(
                std::fs::read(data_file_of(c)).unwrap() == *data,
                "{}.data differs",
                c.name
            );
        }
    }
    assert_eq!(
        std::fs::read_to_string(dir.join("expected.json")).unwrap(),
        manifest(&cases)
    );
}

fn check_outcome(case: &Case, result: ortckpt::Result<()>, path: Option<&Path>) {
    let name = case.name;
    match (case.expect, result) {
        (Expect::Loads, Ok(())) => {}
        (Expect::Loads, Err(e)) => panic!("{name}: expected to load, got {e}"),
        (_, Ok(())) => panic!("{name}: loaded, expected {:?}", case.expect),
        (Expect::Malformed(text, tensor), Err(e)) => {
            assert!(
                matches!(e.kind(), ErrorKind::Malformed(m) if m.contains(text)),
                "{name}: expected Malformed containing {text:?}, got {e}"
            );
            if tensor.is_some() {
                assert_eq!(e.tensor(), tensor, "{name}: {e}");
            }
            if let Some(path) = path {
                assert!(e.path().is_some(), "{name}: error names no file: {e}");
                assert!(
                    e.to_string().contains(&path.display().to_string())
                        || e.path() == Some(path)
                        || e.path() == Some(ortckpt::external_data_path(path).as_path()),
                    "{name}: {e}"
                );
            }
        }
        (Expect::UnsupportedDataType(code, tensor), Err(e)) => {
            assert!(
                matches!(e.kind(), ErrorKind::UnsupportedDataType(c) if *c == code),
                "{name}: {e}"
            );
            assert_eq!(e.tensor(), Some(tensor), "{name}: {e}");
        }
        (Expect::DataFileNotFound, Err(e)) => {
            assert!(
                matches!(e.kind(), ErrorKind::Io(io) if io.kind() == std::io::ErrorKind::NotFound),
                "{name}: {e}"
            );
            let path = path.expect("checked through load()");
            assert_eq!(
                e.path(),
                Some(ortckpt::external_data_path(path).as_path()),
                "{name}"
            );
        }
    }
}

#[test]
fn every_case_gives_its_error_from_the_committed_files() {
    for c in corpus() {
        let path = file_of(&c);
        let result = load(&path).map(|loaded| {
            // Every byte a loader hands out must be readable.
            for t in loaded.checkpoint().tensors() {
                if let Stored::Inline { .. } | Stored::External { .. } = t.data {
                    let bytes = loaded.bytes(t).unwrap();
                    let _ = bytes.iter().fold(0u8, |a, b| a ^ b);
                }
            }
        });
        check_outcome(&c, result, Some(&path));
    }
}

#[test]
fn decoding_allocates_at_most_the_file_size_plus_a_fixed_allowance() {
    for c in corpus() {
        if c.data.is_some() || matches!(c.expect, Expect::DataFileNotFound) {
            continue; // the external ranges are checked by load(); decode sees the main file
        }
        let (result, peak) = peak_allocation(|| decode(&c.main).map(drop));
        let expect_decodes = matches!(c.expect, Expect::Loads);
        assert_eq!(result.is_ok(), expect_decodes, "{}", c.name);
        assert!(
            peak <= c.main.len() + FIXED_ALLOWANCE,
            "{}: decoding a {}-byte file allocated {peak} bytes",
            c.name,
            c.main.len()
        );
    }
}

#[test]
fn the_valid_base_of_the_corpus_is_valid() {
    let valid = valid_checkpoint();
    let ckpt = decode(&valid).unwrap();
    assert_eq!(ckpt.trainable.len(), 1);
    assert_eq!(ckpt.optimizer_groups[0].states[0].momentums.len(), 2);
}
