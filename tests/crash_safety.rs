//! What a save stopped at any point leaves behind: the old checkpoint or the new
//! one, never a mix, and leftovers that readers ignore and the next save removes.
//! (tests/python/files/test_crash_safety.py kills real saving processes.)

use std::path::{Path, PathBuf};

use ortckpt::format::{Checkpoint, DataType, Payload, Tensor};
use ortckpt::io::{pending_temps, temp_path_for};
use ortckpt::seal::pairing::{pair_id, PAIR_TRAILER_LEN};
use ortckpt::{external_data_path, load, save, ErrorKind, SaveOptions};

fn state(seed: u8) -> Vec<u8> {
    (0..4096u32).map(|i| (i as u8).wrapping_mul(seed)).collect()
}

fn save_state(path: &Path, values: &[u8], threshold: u64) {
    save_named(path, "w", values, threshold)
}

fn save_named(path: &Path, name: &str, values: &[u8], threshold: u64) {
    let ckpt = Checkpoint {
        trainable: vec![Tensor {
            name: name.into(),
            data_type: DataType::Float,
            dims: vec![(values.len() / 4) as i64],
            data: Payload::Bytes(values),
        }],
        ..Default::default()
    };
    let options = SaveOptions {
        external_data_threshold: threshold,
        ..SaveOptions::default()
    };
    save(path, &ckpt, &options).unwrap();
}

fn values_of(path: &Path) -> Vec<u8> {
    named_values_of(path).1
}

fn named_values_of(path: &Path) -> (String, Vec<u8>) {
    let loaded = load(path).unwrap();
    let t = &loaded.checkpoint().trainable[0];
    (t.name.clone(), loaded.bytes(t).unwrap().to_vec())
}

/// A temporary name of a save whose writer is gone: nobody holds its lock.
fn temp_of_dead_save(target: &Path) -> PathBuf {
    temp_path_for(target)
}

#[test]
fn both_files_of_an_external_pair_end_with_the_same_trailer_and_inline_files_with_their_own() {
    let dir = tempfile::tempdir().unwrap();
    let (external, inline) = (dir.path().join("e"), dir.path().join("i"));
    save_state(&external, &state(3), 0);
    save_state(&inline, &state(3), u64::MAX);
    let main = std::fs::read(&external).unwrap();
    let data = std::fs::read(external_data_path(&external)).unwrap();
    assert!(pair_id(&main).is_some());
    assert_eq!(pair_id(&main), pair_id(&data));
    // An inline file ends with a trailer too (after its checksum block), of its own id.
    let inline_id = pair_id(&std::fs::read(&inline).unwrap());
    assert!(inline_id.is_some() && inline_id != pair_id(&main));
    // A second save gets a new id.
    save_state(&external, &state(3), 0);
    assert_ne!(pair_id(&std::fs::read(&external).unwrap()), pair_id(&main));
    assert_eq!(data.len() % 8, 0, "{} bytes", data.len() - PAIR_TRAILER_LEN);
}

/// The one moment two files cannot be replaced atomically: the new data file is in
/// place, the new checkpoint still in its temporary file. Loading must give the new
/// checkpoint whole.
#[test]
fn a_save_stopped_between_its_two_renames_loads_as_the_new_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let (old, new) = (dir.path().join("old"), dir.path().join("new"));
    // Different names and sizes, so that a mix would show.
    save_named(&old, "old", &state(3), 0);
    save_named(&new, "new", &state(5)[..1024], 0);
    // The target: old checkpoint, new data, new checkpoint pending under a dead writer's name.
    let target = dir.path().join("target");
    std::fs::copy(&old, &target).unwrap();
    std::fs::copy(external_data_path(&new), external_data_path(&target)).unwrap();
    let pending = temp_of_dead_save(&target);
    std::fs::copy(&new, &pending).unwrap();
    assert_eq!(
        named_values_of(&target),
        ("new".into(), state(5)[..1024].to_vec())
    );

    // The next save replaces everything and removes the leftover.
    save_state(&target, &state(7), 0);
    assert_eq!(values_of(&target), state(7));
    assert!(!pending.exists());
    assert!(pending_temps(&target).is_empty());
}

#[test]
fn a_mixed_pair_without_its_pending_checkpoint_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let (old, new) = (dir.path().join("old"), dir.path().join("new"));
    save_state(&old, &state(3), 0);
    save_state(&new, &state(5), 0);
    std::fs::copy(external_data_path(&new), external_data_path(&old)).unwrap();
    let e = load(&old).unwrap_err();
    assert!(
        matches!(e.kind(), ErrorKind::Malformed(m) if m.contains("come from different saves")),
        "{e}"
    );
    assert_eq!(e.path(), Some(old.as_path()));
}

#[test]
fn leftovers_of_dead_saves_are_ignored_by_readers_and_removed_by_the_next_save() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("c");
    save_state(&target, &state(3), 0);
    let dead = temp_of_dead_save(&target);
    let dead_data = temp_of_dead_save(&external_data_path(&target));
    std::fs::write(&dead, b"half a checkpoint").unwrap();
    std::fs::write(&dead_data, b"half a data file").unwrap();
    // One of a save still running (its writer holds its lock): kept.
    let live = temp_path_for(&target);
    std::fs::write(&live, b"being written").unwrap();
    let writer = std::fs::File::open(&live).unwrap();
    writer.lock().unwrap();

    assert_eq!(values_of(&target), state(3));
    save_state(&target, &state(4), 0);
    assert!(!dead.exists() && !dead_data.exists());
    assert!(live.exists());
    assert_eq!(values_of(&target), state(4));
    drop(writer);
    save_state(&target, &state(5), u64::MAX); // an inline save cleans up too
    assert!(!live.exists());
    assert_eq!(values_of(&target), state(5));
    assert!(!external_data_path(&target).exists());
}

#[test]
fn temporary_names_are_random_and_not_derived_from_the_pid() {
    let target = Path::new("/x/ck");
    let (a, b) = (temp_path_for(target), temp_path_for(target));
    assert_ne!(a, b);
    let name = a.file_name().unwrap().to_string_lossy().into_owned();
    assert!(name.starts_with(".ck.ortckpt-tmp."), "{name}");
    assert_eq!(name.len(), ".ck.ortckpt-tmp.".len() + 32, "{name}");
    assert!(!name.contains(&format!(".{}.", std::process::id())));
}

/// Threads saving one path with external data while others load it: every load gets one
/// save's checkpoint whole (the commit lock orders the renames; readers retry a mixed pair).
#[test]
fn concurrent_saves_and_loads_of_one_path_never_mix() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("c");
    save_state(&target, &[0u8; 4096], 0);
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        let readers: Vec<_> = (0..2)
            .map(|_| {
                scope.spawn(|| {
                    let mut loads = 0;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let values = values_of(&target);
                        assert!(values.iter().all(|&v| v == values[0]), "a mix of saves");
                        loads += 1;
                    }
                    loads
                })
            })
            .collect();
        let writers: Vec<_> = (1..=3u8)
            .map(|w| {
                let target = &target;
                scope.spawn(move || {
                    for i in 0..40u8 {
                        save_state(target, &[w.wrapping_mul(64).wrapping_add(i); 4096], 0);
                    }
                })
            })
            .collect();
        for w in writers {
            w.join().unwrap();
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for r in readers {
            assert!(r.join().unwrap() > 0);
        }
    });
    assert!(pending_temps(&target).is_empty());
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
}
