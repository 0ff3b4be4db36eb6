//! Encode -> decode round trips, and the layout choices the writer promises.

use ortckpt::format::dtype::ALL_DATA_TYPES;
use ortckpt::format::encode::PAYLOAD_ALIGNMENT;
use ortckpt::format::{
    decode, encode, Checkpoint, DataType, OptimizerGroup, ParameterOptimizerState, Payload,
    Placement, PropertyBag, Stored, Tensor,
};
use ortckpt::generated::onnxruntime::fbs;
use ortckpt::{load, save, SaveOptions};

/// Deterministic bytes, different per seed.
fn bytes(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn tensor<'a>(
    name: &str,
    data_type: DataType,
    dims: &[i64],
    data: &'a [u8],
) -> Tensor<Payload<'a>> {
    Tensor {
        name: name.into(),
        data_type,
        dims: dims.to_vec(),
        data: Payload::Bytes(data),
    }
}

/// Decodes `buf` and turns the byte ranges back into slices of it.
fn payloads_of<'a>(buf: &'a [u8], ckpt: &Checkpoint<Stored>) -> Checkpoint<Payload<'a>> {
    ckpt.try_map_data(|t| -> Result<_, ()> {
        Ok(match &t.data {
            Stored::Inline { offset, len } => Payload::Bytes(&buf[*offset..offset + len]),
            Stored::Strings(s) => Payload::Strings(s.clone()),
            Stored::Absent => Payload::Absent,
            Stored::External { .. } => unreachable!("no external data here"),
        })
    })
    .unwrap()
}

fn encode_to_vec(ckpt: &Checkpoint<Payload>) -> Vec<u8> {
    encode(ckpt, Placement::Inline).unwrap().segments().concat()
}

#[test]
fn every_data_type_round_trips_with_aligned_payloads() {
    let sized: Vec<DataType> = ALL_DATA_TYPES
        .iter()
        .copied()
        .filter(|t| t.bits().is_some())
        .collect();
    let shapes: [&[i64]; 5] = [&[2, 3], &[], &[0], &[1, 1, 1, 1, 1, 1, 1, 5], &[7]];
    let datas: Vec<Vec<u8>> = sized
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let count: i64 = shapes[i % shapes.len()].iter().product();
            bytes(t.byte_len(count as u64).unwrap() as usize, i as u8)
        })
        .collect();
    let mut ckpt = Checkpoint::default();
    for (i, t) in sized.iter().enumerate() {
        let target = if i % 2 == 0 {
            &mut ckpt.trainable
        } else {
            &mut ckpt.frozen
        };
        target.push(tensor(
            &format!("{}.{i}", t.name()),
            *t,
            shapes[i % shapes.len()],
            &datas[i],
        ));
    }
    ckpt.frozen.push(Tensor {
        name: "vocab".into(),
        data_type: DataType::String,
        dims: vec![3],
        data: Payload::Strings(vec!["a".into(), "".into(), "ünïcødé 🚀".into()]),
    });
    ckpt.properties = PropertyBag {
        ints: vec![("epoch".into(), 7), ("neg".into(), i64::MIN)],
        floats: vec![("best_accuracy".into(), 0.95)],
        strings: vec![("run".into(), "demo".into())],
    };
    ckpt.sort_like_ort_state_path();

    let buf = encode_to_vec(&ckpt);
    let decoded = decode(&buf).unwrap();
    for t in decoded.tensors() {
        if let Stored::Inline { offset, len } = t.data {
            if len > 0 {
                assert_eq!(offset % PAYLOAD_ALIGNMENT, 0, "{} at {offset}", t.name);
            }
        }
    }
    assert_eq!(payloads_of(&buf, &decoded), ckpt);
}

#[test]
fn metadata_comes_first_and_values_follow_in_tensor_order() {
    let a = bytes(1000, 1);
    let b = bytes(3000, 2);
    let mut ckpt = Checkpoint {
        trainable: vec![
            tensor("a", DataType::Uint8, &[1000], &a),
            tensor("b", DataType::Uint8, &[3000], &b),
        ],
        ..Default::default()
    };
    ckpt.sort_like_ort_state_path();
    let encoded = encode(&ckpt, Placement::Inline).unwrap();
    let ranges: Vec<(usize, usize)> = encoded.payload_ranges().collect();
    assert_eq!(ranges.len(), 2);
    assert!(ranges[0].0 + ranges[0].1 <= ranges[1].0, "a before b");
    // The tail of the file is tensor bytes (then the checksum block and the pair trailer), so
    // opening reads only the head.
    let end = ortckpt::seal::checksums::tail_len(2);
    assert!(ranges[1].0 + ranges[1].1 + 64 + end > encoded.len());
    assert!(ranges[0].0 < 1024);
}

#[test]
fn optional_parts_follow_onnx_runtimes_state_path() {
    // No parameters and no properties: no module state, no property bag, an empty groups vector.
    let buf = encode_to_vec(&Checkpoint::default());
    let root = fbs::root_as_checkpoint(&buf).unwrap();
    assert_eq!(root.version(), 2);
    assert!(root.module_state().is_none());
    assert!(root.property_bag().is_none());
    assert_eq!(root.optimizer_groups().map(|g| g.len()), Some(0));

    // One property: all three property vectors are written.
    let ckpt = Checkpoint::<Payload> {
        properties: PropertyBag {
            ints: vec![("epoch".into(), 1)],
            ..Default::default()
        },
        ..Default::default()
    };
    let buf = encode_to_vec(&ckpt);
    let bag = fbs::root_as_checkpoint(&buf)
        .unwrap()
        .property_bag()
        .unwrap();
    assert_eq!(
        (
            bag.ints().unwrap().len(),
            bag.floats().unwrap().len(),
            bag.strings().unwrap().len()
        ),
        (1, 0, 0)
    );
}

#[test]
fn sorting_matches_the_state_path() {
    let z = [0u8; 4];
    let m = |name: &str| tensor(name, DataType::Float, &[1], &z);
    let mut ckpt = Checkpoint {
        trainable: vec![m("z"), m("a"), m("m")],
        frozen: vec![m("y"), m("b")],
        optimizer_groups: vec![
            OptimizerGroup {
                name: "g1".into(),
                step: 1,
                initial_learning_rate: 0.1,
                states: vec![],
            },
            OptimizerGroup {
                name: "g0".into(),
                step: 5,
                initial_learning_rate: 1e-3,
                states: vec![
                    ParameterOptimizerState {
                        param_name: "z".into(),
                        momentums: vec![m("momentum1"), m("momentum0")],
                    },
                    ParameterOptimizerState {
                        param_name: "a".into(),
                        momentums: vec![m("momentum0")],
                    },
                ],
            },
        ],
        properties: PropertyBag {
            ints: vec![("b".into(), 1), ("a".into(), 2)],
            floats: vec![("y".into(), 1.0), ("x".into(), 2.0)],
            strings: vec![("q".into(), "1".into()), ("p".into(), "2".into())],
        },
        ..Default::default()
    };
    ckpt.sort_like_ort_state_path();
    let buf = encode_to_vec(&ckpt);
    let d = decode(&buf).unwrap();
    let names = |ts: &[Tensor<Stored>]| ts.iter().map(|t| t.name.clone()).collect::<Vec<_>>();
    assert_eq!(names(&d.trainable), ["a", "m", "z"]);
    assert_eq!(names(&d.frozen), ["b", "y"]);
    assert_eq!(
        d.optimizer_groups
            .iter()
            .map(|g| g.name.as_str())
            .collect::<Vec<_>>(),
        ["g0", "g1"]
    );
    let g0 = &d.optimizer_groups[0];
    assert_eq!((g0.step, g0.initial_learning_rate), (5, 1e-3));
    assert_eq!(
        g0.states
            .iter()
            .map(|s| s.param_name.as_str())
            .collect::<Vec<_>>(),
        ["a", "z"]
    );
    assert_eq!(names(&g0.states[1].momentums), ["momentum0", "momentum1"]);
    assert_eq!(
        d.properties.ints,
        [("a".to_string(), 2), ("b".to_string(), 1)]
    );
    assert_eq!(d.properties.floats[0].0, "x");
    assert_eq!(d.properties.strings[0].0, "p");
}

#[test]
fn nominal_checkpoints_keep_names_and_types_only() {
    let w = bytes(24, 3);
    let mut ckpt = Checkpoint {
        trainable: vec![tensor("w", DataType::Float, &[2, 3], &w)],
        frozen: vec![Tensor {
            name: "mask".into(),
            data_type: DataType::Bool,
            dims: vec![4],
            data: Payload::Absent,
        }],
        is_nominal: true,
        ..Default::default()
    };
    ckpt.sort_like_ort_state_path();
    let buf = encode_to_vec(&ckpt);
    assert!(buf.len() < 512, "no values written: {} bytes", buf.len());
    let d = decode(&buf).unwrap();
    assert!(d.is_nominal);
    let t = &d.trainable[0];
    assert_eq!(
        (t.name.as_str(), t.data_type, t.dims.len(), &t.data),
        ("w", DataType::Float, 0, &Stored::Absent)
    );
    assert_eq!(d.frozen[0].data_type, DataType::Bool);
}

/// Found by the roundtrip fuzzer (tests/fuzz/regressions/roundtrip-nominal-without-parameters):
/// the module state, which holds the nominal flag, was left out when there were no parameters.
#[test]
fn a_nominal_checkpoint_without_parameters_stays_nominal() {
    let ckpt = Checkpoint::<Payload<'_>> {
        is_nominal: true,
        ..Default::default()
    };
    assert!(decode(&encode_to_vec(&ckpt)).unwrap().is_nominal);
}

/// Found by both fuzz targets: flatbuffers leaves out a scalar equal to its default,
/// and -0.0 equals 0.0, so a -0.0 property or learning rate reads back as 0.0. ONNX
/// Runtime's writer does the same; the README says so.
#[test]
fn negative_zero_floats_read_back_as_zero_as_in_onnx_runtime() {
    let mut ckpt = Checkpoint::<Payload<'_>>::default();
    ckpt.properties.floats.push(("loss".into(), -0.0));
    let d = decode(&encode_to_vec(&ckpt)).unwrap();
    assert_eq!(d.properties.floats[0].1.to_bits(), 0.0f32.to_bits());
}

#[test]
fn saving_over_the_file_a_live_load_maps_keeps_both_intact() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.ckpt");
    let w = bytes(1 << 20, 9);
    let ckpt = Checkpoint {
        trainable: vec![tensor("w", DataType::Float, &[1 << 18], &w)],
        ..Default::default()
    };
    save(&path, &ckpt, &SaveOptions::default()).unwrap();

    let loaded = load(&path).unwrap();
    let mut again = loaded.as_payloads().unwrap();
    again.properties.ints.push(("epoch".into(), 2));
    save(
        &path,
        &again,
        &SaveOptions {
            durable: true,
            ..SaveOptions::default()
        },
    )
    .unwrap();
    // The live mapping still reads the old bytes; the file holds the new checkpoint.
    assert_eq!(
        loaded.bytes(&loaded.checkpoint().trainable[0]).unwrap(),
        &w[..]
    );
    let reloaded = load(&path).unwrap();
    assert_eq!(
        reloaded.bytes(&reloaded.checkpoint().trainable[0]).unwrap(),
        &w[..]
    );
    assert_eq!(
        reloaded.checkpoint().properties.ints,
        [("epoch".to_string(), 2)]
    );
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        1,
        "no temporary file left behind"
    );
}

#[test]
fn save_sorts_by_name_unless_asked_to_keep_the_given_order() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("order.ckpt");
    let data = bytes(16, 1);
    let names = ["zeta", "alpha", "mid"];
    let names_in = |ckpt: &Checkpoint<Stored>| -> Vec<String> {
        ckpt.trainable.iter().map(|t| t.name.clone()).collect()
    };
    for (keep_order, expected) in [(false, ["alpha", "mid", "zeta"]), (true, names)] {
        let ckpt = Checkpoint {
            trainable: names
                .iter()
                .map(|n| tensor(n, DataType::Float, &[4], &data))
                .collect(),
            ..Default::default()
        };
        let options = SaveOptions {
            keep_order,
            ..SaveOptions::default()
        };
        save(&path, &ckpt, &options).unwrap();
        assert_eq!(names_in(load(&path).unwrap().checkpoint()), expected);
    }
}
