//! Structured round trips: any state the encoder accepts decodes to exactly that
//! state, inline or with external data; a state it refuses gets a typed error.
#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use ortckpt::format::model::{OptimizerGroup, ParameterOptimizerState, PropertyBag};
use ortckpt::format::{decode, encode, Checkpoint, DataType, Payload, Placement, Stored, Tensor};
use ortckpt::ErrorKind;

/// A tensor as the fuzzer describes it; its bytes are cut from a shared pool.
#[derive(Arbitrary, Debug)]
struct TensorSpec {
    name: String,
    code: u8,
    dims: Vec<u8>,
    strings: Vec<String>,
}

#[derive(Arbitrary, Debug)]
struct GroupSpec {
    name: String,
    step: i64,
    lr: f32,
    states: Vec<(String, Vec<TensorSpec>)>,
}

#[derive(Arbitrary, Debug)]
struct StateSpec {
    trainable: Vec<TensorSpec>,
    frozen: Vec<TensorSpec>,
    groups: Vec<GroupSpec>,
    ints: Vec<(String, i64)>,
    floats: Vec<(String, f32)>,
    strings: Vec<(String, String)>,
    nominal: bool,
    external: bool,
}

fn tensor<'a>(spec: &TensorSpec, pool: &'a [u8], nominal: bool) -> Tensor<Payload<'a>> {
    let data_type = DataType::from_code(i32::from(spec.code % 23)).unwrap_or(DataType::Float);
    let dims: Vec<i64> = spec
        .dims
        .iter()
        .take(4)
        .map(|&d| i64::from(d % 9))
        .collect();
    let count: u64 = dims.iter().map(|&d| d as u64).product();
    let data = if nominal {
        Payload::Absent
    } else if data_type == DataType::String {
        let mut strings: Vec<String> = spec.strings.iter().take(count as usize).cloned().collect();
        strings.resize(count as usize, String::new());
        Payload::Strings(strings)
    } else {
        let len = data_type.byte_len(count).unwrap_or(0) as usize;
        Payload::Bytes(&pool[..len.min(pool.len())])
    };
    Tensor {
        name: spec.name.clone(),
        data_type,
        dims,
        data,
    }
}

fuzz_target!(|input: &[u8]| {
    let mut u = Unstructured::new(input);
    let Ok(spec) = StateSpec::arbitrary(&mut u) else {
        return;
    };
    // Values: at most 64 KiB, the same pool for every tensor (their lengths differ).
    let pool: Vec<u8> = (0..65536u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    let nominal = spec.nominal;
    let ckpt = Checkpoint {
        version: ortckpt::format::CHECKPOINT_VERSION,
        trainable: spec
            .trainable
            .iter()
            .map(|t| tensor(t, &pool, nominal))
            .collect(),
        frozen: spec
            .frozen
            .iter()
            .map(|t| tensor(t, &pool, nominal))
            .collect(),
        is_nominal: nominal,
        has_external_data: false,
        optimizer_groups: spec
            .groups
            .iter()
            .map(|g| OptimizerGroup {
                name: g.name.clone(),
                step: g.step,
                initial_learning_rate: g.lr,
                states: g
                    .states
                    .iter()
                    .map(|(param, moms)| ParameterOptimizerState {
                        param_name: param.clone(),
                        momentums: moms.iter().map(|m| tensor(m, &pool, false)).collect(),
                    })
                    .collect(),
            })
            .collect(),
        properties: PropertyBag {
            ints: spec.ints.clone(),
            floats: spec.floats.clone(),
            strings: spec.strings.clone(),
        },
    };
    let placement = if spec.external {
        Placement::External
    } else {
        Placement::Inline
    };
    let encoded = match encode(&ckpt, placement) {
        Ok(e) => e,
        Err(e) => {
            // Refusals are typed: invalid states (duplicate names, bytes that
            // disagree with dims) and UNDEFINED tensors.
            assert!(
                matches!(
                    e.kind(),
                    ErrorKind::InvalidState(_) | ErrorKind::UnsupportedDataType(0)
                ),
                "{e}"
            );
            return;
        }
    };
    let file = encoded.segments().concat();
    let (data_len, parts) = encoded.external_data();
    let mut data = vec![0u8; data_len as usize];
    for (offset, bytes) in parts {
        data[offset as usize..offset as usize + bytes.len()].copy_from_slice(bytes);
    }
    let decoded = decode(&file).expect("what ortckpt encodes must decode");
    assert_eq!(decoded.is_nominal, nominal);
    // Back to payloads, reading inline bytes from the file and external ones from the data.
    let back = decoded
        .try_map_data(|t| -> Result<Payload<'_>, ()> {
            Ok(match &t.data {
                Stored::Inline { offset, len } => Payload::Bytes(&file[*offset..offset + len]),
                Stored::External { offset, len } => {
                    Payload::Bytes(&data[*offset as usize..(offset + len) as usize])
                }
                Stored::Strings(s) => Payload::Strings(s.clone()),
                Stored::Absent => Payload::Absent,
            })
        })
        .unwrap();
    // Empty values decode as an empty inline vector.
    fn expected_data<'a>(t: &Tensor<Payload<'a>>) -> Payload<'a> {
        match &t.data {
            Payload::Bytes(b) if b.is_empty() => Payload::Bytes(&[]),
            other => other.clone(),
        }
    }
    let same = |a: &[Tensor<Payload<'_>>], b: &[Tensor<Payload<'_>>]| {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert_eq!((&x.name, x.data_type), (&y.name, y.data_type));
            if !nominal {
                assert_eq!(x.dims, y.dims, "{}", x.name);
                assert_eq!(expected_data(x), expected_data(y), "{}", x.name);
            }
        }
    };
    same(&back.trainable, &ckpt.trainable);
    same(&back.frozen, &ckpt.frozen);
    assert_eq!(back.optimizer_groups.len(), ckpt.optimizer_groups.len());
    for (g, h) in back.optimizer_groups.iter().zip(&ckpt.optimizer_groups) {
        assert_eq!((&g.name, g.step), (&h.name, h.step));
        assert_eq!(bits(g.initial_learning_rate), bits(h.initial_learning_rate));
        assert_eq!(g.states.len(), h.states.len());
        for (s, t) in g.states.iter().zip(&h.states) {
            assert_eq!(s.param_name, t.param_name);
            same(&s.momentums, &t.momentums);
        }
    }
    assert_eq!(back.properties.ints, ckpt.properties.ints);
    assert_eq!(back.properties.strings, ckpt.properties.strings);
    let floats = |p: &PropertyBag| -> Vec<(String, u32)> {
        p.floats
            .iter()
            .map(|(n, v)| (n.clone(), bits(*v)))
            .collect()
    };
    assert_eq!(floats(&back.properties), floats(&ckpt.properties));
});

/// A float's bits, but -0.0 as 0.0: flatbuffers leaves out a scalar equal to its
/// default (0.0, which -0.0 equals), so ONNX Runtime's files and ortckpt's store
/// -0.0 as 0.0. (Found by this target: tests/fuzz/regressions/roundtrip-negative-zero-property.)
fn bits(v: f32) -> u32 {
    if v == 0.0 {
        0
    } else {
        v.to_bits()
    }
}
