//! Broken and hostile files: each gives a typed error naming what is wrong, never a panic.

mod common;

use common::{build_raw, RawTensor};
use ortckpt::format::{decode, Checkpoint, DataType, Payload, Tensor};
use ortckpt::{load, save, ErrorKind, SaveOptions};

fn malformed_message(buf: &[u8]) -> String {
    match decode(buf) {
        Err(e) => match e.kind() {
            ErrorKind::Malformed(m) => match e.tensor() {
                Some(t) => format!("{t}: {m}"),
                None => m.clone(),
            },
            other => panic!("expected Malformed, got {other:?}"),
        },
        Ok(_) => panic!("decoded a malformed buffer"),
    }
}

fn golden(name: &str) -> Vec<u8> {
    std::fs::read(common::data_dir().join("ort-vectors").join(name)).unwrap()
}

#[test]
fn every_truncation_fails_or_decodes_identically() {
    for name in [
        "trained_with_optimizer.ckpt",
        "protos.ckpt",
        "protos_nominal.ckpt",
    ] {
        let buf = golden(name);
        let full = decode(&buf).unwrap();
        for cut in 0..buf.len() {
            // Cutting only unreferenced trailing padding leaves a valid checkpoint.
            if let Ok(partial) = decode(&buf[..cut]) {
                assert_eq!(partial, full, "{name} cut at {cut}");
            }
        }
        assert!(decode(&buf[..buf.len() / 2]).is_err());
    }
}

#[test]
fn short_and_empty_files() {
    assert!(malformed_message(&[]).contains("too short"));
    assert!(malformed_message(b"ODTC").contains("too short"));
}

#[test]
fn wrong_identifier() {
    let mut buf = golden("protos.ckpt");
    buf[4..8].copy_from_slice(b"ORTM");
    let m = malformed_message(&buf);
    assert!(m.contains("file identifier") && m.contains("ORTM"), "{m}");
}

#[test]
fn wrong_and_missing_version() {
    let raw = [0u8; 4];
    let t = [RawTensor::float("w", &[1], &raw)];
    assert!(malformed_message(&build_raw(3, Some(&t), Some(&[])))
        .contains("version 3 is not supported"));
    assert!(malformed_message(&build_raw(0, Some(&t), Some(&[])))
        .contains("version 0 is not supported"));
    decode(&build_raw(2, Some(&t), Some(&[]))).unwrap();
}

#[test]
fn missing_required_parts() {
    let raw = [0u8; 4];
    let ok = RawTensor::float("w", &[1], &raw);
    assert!(malformed_message(&build_raw(2, None, Some(&[]))).contains("no requires_grad_params"));
    assert!(malformed_message(&build_raw(2, Some(&[]), None)).contains("no frozen_params"));
    let no_name = RawTensor {
        name: None,
        ..RawTensor::float("w", &[1], &raw)
    };
    assert!(
        malformed_message(&build_raw(2, Some(&[no_name]), Some(&[]))).contains("#0 has no name")
    );
    let no_dims = RawTensor {
        dims: None,
        ..RawTensor::float("w", &[1], &raw)
    };
    assert_eq!(
        malformed_message(&build_raw(2, Some(&[]), Some(&[no_dims]))),
        "w: tensor has no dims"
    );
    let no_data = RawTensor {
        raw_data: None,
        ..RawTensor::float("w", &[1], &raw)
    };
    assert!(
        malformed_message(&build_raw(2, Some(&[no_data]), Some(&[]))).contains("neither raw_data")
    );
    let _ = ok;
}

#[test]
fn dims_that_disagree_with_the_bytes() {
    let raw = [0u8; 12];
    let cases: [(&[i64], &str); 4] = [
        (
            &[2, 2],
            "raw_data holds 12 bytes but dims [2, 2] of FLOAT need 16",
        ),
        (&[3, -1], "negative dimension -1"),
        (&[i64::MAX, i64::MAX], "overflow the element count"),
        (&[1 << 61, 1], "overflow the byte length"),
    ];
    for (dims, expected) in cases {
        let t = RawTensor::float("layer.w", dims, &raw);
        let m = malformed_message(&build_raw(2, Some(&[t]), Some(&[])));
        assert!(
            m.starts_with("layer.w: ") && m.contains(expected),
            "{dims:?}: {m}"
        );
    }
}

#[test]
fn unknown_and_undefined_data_types() {
    let raw = [0u8; 4];
    for code in [0, 27, 99, -5] {
        let t = RawTensor {
            data_type: code,
            ..RawTensor::float("w", &[1], &raw)
        };
        let e = decode(&build_raw(2, Some(&[t]), Some(&[]))).unwrap_err();
        assert!(
            matches!(e.kind(), ErrorKind::UnsupportedDataType(c) if *c == code.max(0) || *c == code),
            "{e}"
        );
        assert_eq!(e.tensor(), Some("w"));
    }
}

#[test]
fn duplicate_parameter_names() {
    let raw = [0u8; 4];
    let a = RawTensor::float("w", &[1], &raw);
    let b = RawTensor::float("w", &[1], &raw);
    assert!(malformed_message(&build_raw(2, Some(&[a]), Some(&[b])))
        .contains("duplicate parameter name 'w'"));
}

#[test]
fn external_offset_without_external_data_flag() {
    let t = RawTensor {
        raw_data: None,
        external_data_offset: 0,
        ..RawTensor::float("w", &[1], &[])
    };
    assert!(
        malformed_message(&build_raw(2, Some(&[t]), Some(&[]))).contains("external_data_offset")
    );
}

#[test]
fn single_bit_flips_never_panic() {
    let buf = golden("trained_with_optimizer.ckpt");
    for i in 0..buf.len() {
        for bit in [0, 3, 7] {
            let mut bad = buf.clone();
            bad[i] ^= 1 << bit;
            let _ = decode(&bad); // Ok or Err, both fine; a panic fails the test
        }
    }
}

#[test]
fn load_names_the_file_and_missing_files_are_io_not_found() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.ckpt");
    let e = load(&missing).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::Io(io) if io.kind() == std::io::ErrorKind::NotFound));
    assert_eq!(e.path(), Some(missing.as_path()));

    let garbage = dir.path().join("garbage.ckpt");
    std::fs::write(&garbage, b"this is not a checkpoint at all").unwrap();
    let e = load(&garbage).unwrap_err();
    assert!(
        e.to_string().starts_with(&format!(
            "{}: not an ONNX Runtime training checkpoint",
            garbage.display()
        )),
        "{e}"
    );
}

#[test]
fn invalid_states_are_refused_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.ckpt");
    std::fs::write(&path, b"previous").unwrap();
    let bytes = [0u8; 8];
    let tensor = |name: &str, dims: Vec<i64>, data_type| Tensor {
        name: name.to_owned(),
        data_type,
        dims,
        data: Payload::Bytes(&bytes),
    };
    let cases: Vec<(Checkpoint<Payload>, &str)> = vec![
        (
            Checkpoint {
                trainable: vec![tensor("a", vec![3], DataType::Float)],
                ..Default::default()
            },
            "tensor 'a': 8 bytes given but dims [3] of FLOAT need 12",
        ),
        (
            Checkpoint {
                trainable: vec![tensor("a", vec![2], DataType::Float)],
                frozen: vec![tensor("a", vec![2], DataType::Float)],
                ..Default::default()
            },
            "duplicate parameter name 'a'",
        ),
        (
            Checkpoint {
                trainable: vec![tensor("s", vec![1], DataType::String)],
                ..Default::default()
            },
            "STRING tensors take strings",
        ),
    ];
    for (ckpt, expected) in cases {
        let e = save(&path, &ckpt, &SaveOptions::default()).unwrap_err();
        assert!(matches!(e.kind(), ErrorKind::InvalidState(_)), "{e}");
        assert!(e.to_string().contains(expected), "{e}");
        assert_eq!(std::fs::read(&path).unwrap(), b"previous");
    }
    let e = save(
        &path,
        &Checkpoint {
            trainable: vec![tensor("u", vec![2], DataType::Undefined)],
            ..Default::default()
        },
        &SaveOptions::default(),
    )
    .unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::UnsupportedDataType(0)));
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        1,
        "no temporary file left behind"
    );
}

#[test]
fn a_repeated_name_is_reported_alike_on_write_and_on_read() {
    use ortckpt::format::{OptimizerGroup, ParameterOptimizerState};
    let bytes = [0u8; 4];
    let tensor = |name: &str| Tensor {
        name: name.to_owned(),
        data_type: DataType::Float,
        dims: vec![1],
        data: Payload::Bytes(&bytes),
    };
    let state = |param: &str, momentums: [&str; 2]| ParameterOptimizerState {
        param_name: param.to_owned(),
        momentums: momentums.iter().map(|m| tensor(m)).collect(),
    };
    let with_states = |states| Checkpoint {
        trainable: vec![tensor("w")],
        optimizer_groups: vec![OptimizerGroup {
            name: "group0".to_owned(),
            step: 1,
            initial_learning_rate: 0.1,
            states,
        }],
        ..Default::default()
    };
    // (the repeated name, a valid checkpoint, the name in it renamed to the repeated one)
    let cases = [
        (
            "duplicate momentum name 'momentum0'",
            "group0/state_a",
            vec![state("state_a", ["momentum0", "momentum1"])],
            (&b"momentum1"[..], &b"momentum0"[..]),
        ),
        (
            "duplicate optimizer state for parameter name 'state_a'",
            "group0",
            vec![
                state("state_a", ["m0", "m1"]),
                state("state_b", ["m0", "m1"]),
            ],
            (&b"state_b"[..], &b"state_a"[..]),
        ),
    ];
    for (message, scope, states, (from, to)) in cases {
        let mut repeated = with_states(states.clone());
        let renamed = String::from_utf8(to.to_vec()).unwrap();
        for s in &mut repeated.optimizer_groups[0].states {
            if s.param_name.as_bytes() == from {
                s.param_name = renamed.clone();
            }
            for m in &mut s.momentums {
                if m.name.as_bytes() == from {
                    m.name = renamed.clone();
                }
            }
        }
        let Err(written) = ortckpt::encode_in_memory(&repeated, true) else {
            panic!("{message}: encoded");
        };
        // The same checkpoint as a file: a valid one's bytes with the name renamed (same length).
        let mut file = ortckpt::encode_in_memory(&with_states(states), true)
            .unwrap()
            .segments()
            .concat();
        let at = file.windows(from.len()).position(|w| w == from).unwrap();
        file[at..at + to.len()].copy_from_slice(to);
        let read = decode(&file).unwrap_err();
        assert!(
            matches!(written.kind(), ErrorKind::InvalidState(m) if m == message),
            "{written}"
        );
        assert!(
            matches!(read.kind(), ErrorKind::Malformed(m) if m == message),
            "{read}"
        );
        assert_eq!(
            (written.tensor(), read.tensor()),
            (Some(scope), Some(scope))
        );
    }
}
