//! External data: values in `<checkpoint>.data`, the layout beyond 2 GiB.

use ortckpt::format::encode::{EXTERNAL_MIN_BYTES, PAYLOAD_ALIGNMENT};
use ortckpt::format::{
    Checkpoint, DataType, OptimizerGroup, ParameterOptimizerState, Payload, Stored, Tensor,
};
use ortckpt::seal::pairing::PAIR_TRAILER_LEN;
use ortckpt::{external_data_path, load, save, ErrorKind, SaveOptions};

fn bytes(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(7).wrapping_add(seed))
        .collect()
}

fn float<'a>(name: &str, data: &'a [u8]) -> Tensor<Payload<'a>> {
    Tensor {
        name: name.into(),
        data_type: DataType::Float,
        dims: vec![(data.len() / 4) as i64],
        data: Payload::Bytes(data),
    }
}

fn external() -> SaveOptions {
    SaveOptions {
        external_data_threshold: 0,
        ..SaveOptions::default()
    }
}

#[test]
fn values_move_out_momentums_included_small_ones_stay() {
    let (big, small, m0, m1) = (bytes(4000, 1), bytes(16, 2), bytes(4000, 3), bytes(4000, 4));
    let mut ckpt = Checkpoint {
        trainable: vec![float("w", &big), float("b", &small)],
        frozen: vec![Tensor {
            name: "vocab".into(),
            data_type: DataType::String,
            dims: vec![1],
            data: Payload::Strings(vec!["x".into()]),
        }],
        optimizer_groups: vec![OptimizerGroup {
            name: "group0".into(),
            step: 2,
            initial_learning_rate: 0.1,
            states: vec![ParameterOptimizerState {
                param_name: "w".into(),
                momentums: vec![float("momentum0", &m0), float("momentum1", &m1)],
            }],
        }],
        ..Default::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c");
    save(&path, &ckpt, &external()).unwrap();
    assert!(external_data_path(&path).exists());

    let loaded = load(&path).unwrap();
    let c = loaded.checkpoint();
    assert!(c.has_external_data);
    let mut offsets = Vec::new();
    for t in c.tensors() {
        match (&t.data, t.name.as_str()) {
            (Stored::External { offset, len }, _) => {
                assert!(*len as usize >= EXTERNAL_MIN_BYTES);
                assert_eq!(offset % PAYLOAD_ALIGNMENT as u64, 0);
                offsets.push(*offset);
            }
            (Stored::Inline { .. }, "b") | (Stored::Strings(_), "vocab") => {}
            (other, name) => panic!("{name}: {other:?}"),
        }
    }
    offsets.sort();
    assert_eq!(
        offsets,
        [0, 4032, 8064],
        "w, then its momentums, packed at 64-byte boundaries"
    );
    assert_eq!(
        std::fs::metadata(external_data_path(&path)).unwrap().len(),
        8064 + 4000 + PAIR_TRAILER_LEN as u64,
        "the values, then the pair trailer"
    );
    ckpt.sort_like_ort_state_path();
    ckpt.has_external_data = true;
    assert!(
        loaded.as_payloads().unwrap() == ckpt,
        "every value read back from the data file"
    );
}

#[test]
fn below_the_threshold_everything_stays_inline_and_a_stale_data_file_goes() {
    let w = bytes(4000, 1);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c");
    let ckpt = Checkpoint {
        trainable: vec![float("w", &w)],
        ..Default::default()
    };
    save(&path, &ckpt, &external()).unwrap();
    let live = load(&path).unwrap();
    save(
        &path,
        &ckpt,
        &SaveOptions {
            external_data_threshold: 4000,
            ..SaveOptions::default()
        },
    )
    .unwrap();
    assert!(!external_data_path(&path).exists());
    let inline = load(&path).unwrap();
    assert!(!inline.checkpoint().has_external_data);
    assert_eq!(
        inline.bytes(&inline.checkpoint().trainable[0]).unwrap(),
        &w[..]
    );
    // The earlier load still reads its (now unlinked) data file.
    assert_eq!(live.bytes(&live.checkpoint().trainable[0]).unwrap(), &w[..]);
}

#[test]
fn saving_a_loaded_external_checkpoint_over_itself() {
    let w = bytes(1 << 20, 5);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c");
    save(
        &path,
        &Checkpoint {
            trainable: vec![float("w", &w)],
            ..Default::default()
        },
        &external(),
    )
    .unwrap();
    let loaded = load(&path).unwrap();
    save(
        &path,
        &loaded.as_payloads().unwrap(),
        &SaveOptions {
            durable: true,
            ..external()
        },
    )
    .unwrap();
    assert_eq!(
        loaded.bytes(&loaded.checkpoint().trainable[0]).unwrap(),
        &w[..]
    );
    let again = load(&path).unwrap();
    assert_eq!(
        again.bytes(&again.checkpoint().trainable[0]).unwrap(),
        &w[..]
    );
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        2,
        "c and c.data, no temporary files"
    );
}

#[test]
fn a_missing_or_short_data_file_is_a_clear_error() {
    let w = bytes(4000, 1);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c");
    save(
        &path,
        &Checkpoint {
            trainable: vec![float("w", &w)],
            ..Default::default()
        },
        &external(),
    )
    .unwrap();
    let data = external_data_path(&path);

    std::fs::write(&data, &w[..3999]).unwrap();
    let e = load(&path).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::Malformed(_)), "{e}");
    assert_eq!(e.path(), Some(data.as_path()));
    assert_eq!(e.tensor(), Some("w"));
    assert!(
        e.to_string().contains(
            "offset 0, 4000 bytes long, lies beyond the end of the data file (3999 bytes)"
        ),
        "{e}"
    );

    std::fs::write(&data, b"").unwrap();
    assert!(matches!(
        load(&path).unwrap_err().kind(),
        ErrorKind::Malformed(_)
    ));

    std::fs::remove_file(&data).unwrap();
    let e = load(&path).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::Io(io) if io.kind() == std::io::ErrorKind::NotFound));
    assert_eq!(e.path(), Some(data.as_path()));
}

#[test]
fn a_momentum_beyond_the_data_file_is_named_within_its_group_and_parameter() {
    let (w, m0) = (bytes(16, 1), bytes(4000, 2));
    let ckpt = Checkpoint {
        trainable: vec![float("w", &w)], // under 64 bytes: stays inline
        optimizer_groups: vec![OptimizerGroup {
            name: "group0".into(),
            step: 1,
            initial_learning_rate: 0.1,
            states: vec![ParameterOptimizerState {
                param_name: "w".into(),
                momentums: vec![float("momentum0", &m0)],
            }],
        }],
        ..Default::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c");
    save(&path, &ckpt, &external()).unwrap();
    std::fs::write(external_data_path(&path), &m0[..100]).unwrap();
    let e = load(&path).unwrap_err();
    assert_eq!(e.tensor(), Some("group0/w/momentum0"), "{e}");
}

/// Values named in `holes` are left unwritten by `write_staged` (zeros until filled in
/// place), inline and in the data file (the last tensor included);
/// the rest are written as usual, and the file's length covers the holes.
#[test]
fn holes_are_left_for_the_caller_to_fill_in_place() {
    use std::os::unix::fs::FileExt;
    let (a, b, c) = (bytes(4000, 1), bytes(4096, 2), bytes(5000, 3));
    for threshold in [0, u64::MAX] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("h.ckpt");
        let ckpt = Checkpoint {
            trainable: vec![float("a", &a), float("b", &b), float("c", &c)],
            ..Default::default()
        };
        let options = SaveOptions {
            external_data_threshold: threshold,
            keep_order: true,
            holes: [a.as_ptr() as usize, c.as_ptr() as usize].into(),
            ..SaveOptions::default()
        };
        let (mut staged, placed) = ortckpt::write_staged(&path, &ckpt, &options).unwrap();
        let external = threshold == 0;
        let file = |staged: &mut ortckpt::io::Staged| {
            if external {
                staged.data().unwrap().file().try_clone().unwrap()
            } else {
                staged.main().file().try_clone().unwrap()
            }
        };
        let f = file(&mut staged);
        let at = |v: &[u8]| {
            placed
                .iter()
                .find(|p| p.0 == v.as_ptr() as usize)
                .unwrap()
                .1
        };
        let mut read = vec![0u8; 5000];
        f.read_exact_at(&mut read[..4000], at(&a)).unwrap();
        assert!(
            read[..4000].iter().all(|&x| x == 0),
            "a hole reads as zeros"
        );
        f.read_exact_at(&mut read[..4096], at(&b)).unwrap();
        assert_eq!(&read[..4096], &b[..], "a value not named is written");
        f.read_exact_at(&mut read, at(&c)).unwrap();
        assert!(read.iter().all(|&x| x == 0));
        f.write_all_at(&a, at(&a)).unwrap();
        f.write_all_at(&c, at(&c)).unwrap();
        staged
            .commit(&ortckpt::io::CommitOptions::default())
            .unwrap();
        let loaded = load(&path).unwrap();
        let values: Vec<&[u8]> = loaded
            .checkpoint()
            .trainable
            .iter()
            .map(|t| loaded.bytes(t).unwrap())
            .collect();
        assert_eq!(values, [&a[..], &b[..], &c[..]], "threshold {threshold}");
    }
}
