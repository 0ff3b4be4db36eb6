//! A checkpoint truncated by another process while it is being checked: the check fails with
//! an integrity error naming the file, never a fault reading the mapping (SIGBUS, which would
//! end this test process).

use std::fs::OpenOptions;
use std::path::Path;

use ortckpt::format::{Checkpoint, DataType, Payload, Tensor};
use ortckpt::{external_data_path, load, save, ErrorKind, SaveOptions};

fn saved(path: &Path, external: bool) {
    let values: Vec<u8> = (0..64 * 4096u32).flat_map(|i| i.to_le_bytes()).collect();
    let ckpt = Checkpoint {
        trainable: vec![Tensor {
            name: "w".into(),
            data_type: DataType::Float,
            dims: vec![(values.len() / 4) as i64],
            data: Payload::Bytes(&values),
        }],
        ..Default::default()
    };
    let options = SaveOptions {
        external_data_threshold: if external { 0 } else { u64::MAX },
        ..SaveOptions::default()
    };
    save(path, &ckpt, &options).unwrap();
}

fn truncated_while_checked(external: bool) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c");
    saved(&path, external);
    let loaded = load(&path).unwrap();
    // Another process cuts the file the values are in, after the load mapped it.
    let victim = if external {
        external_data_path(&path)
    } else {
        path.clone()
    };
    let file = OpenOptions::new().write(true).open(&victim).unwrap();
    file.set_len(4096).unwrap();
    let err = loaded.verify_checksums().unwrap_err();
    assert!(
        matches!(err.kind(), ErrorKind::Integrity(m) if m.contains("truncated while being checked")),
        "{err}"
    );
    assert!(
        err.to_string().contains(&*victim.to_string_lossy()),
        "{err}"
    );
}

#[test]
fn a_checkpoint_truncated_under_its_check_fails_it() {
    truncated_while_checked(false);
}

#[test]
fn a_data_file_truncated_under_its_check_fails_it() {
    truncated_while_checked(true);
}
