//! Every checkpoint ONNX Runtime wrote (tests/data/ort-vectors) decodes to exactly
//! what its JSON says, and survives a save/load round trip through ortckpt.

mod common;

use ortckpt::format::{Stored, Tensor};
use ortckpt::{load, save, LoadedCheckpoint, SaveOptions};
use serde_json::Value;
use sha2::{Digest, Sha256};

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn tensor_json(loaded: &LoadedCheckpoint, t: &Tensor<Stored>) -> Value {
    let bytes = match &t.data {
        Stored::Absent => &[][..],
        _ => loaded.bytes(t).unwrap(),
    };
    serde_json::json!({
        "name": t.name,
        "dtype": t.data_type.name(),
        "dims": t.dims,
        "nbytes": bytes.len(),
        "sha256": sha256_hex(bytes),
    })
}

/// The JSON description of a loaded checkpoint, in the golden files' shape.
fn describe(loaded: &LoadedCheckpoint) -> Value {
    let ckpt = loaded.checkpoint();
    let mut parameters = Vec::new();
    for (requires_grad, list) in [(true, &ckpt.trainable), (false, &ckpt.frozen)] {
        for t in list {
            let mut v = tensor_json(loaded, t);
            v["requires_grad"] = requires_grad.into();
            parameters.push(v);
        }
    }
    let groups: Vec<Value> = ckpt
        .optimizer_groups
        .iter()
        .map(|g| {
            let states: Vec<Value> = g
                .states
                .iter()
                .map(|s| {
                    let momentums: Vec<Value> =
                        s.momentums.iter().map(|m| tensor_json(loaded, m)).collect();
                    serde_json::json!({"param_name": s.param_name, "momentums": momentums})
                })
                .collect();
            serde_json::json!({
                "group_name": g.name,
                "step": g.step,
                "initial_learning_rate": g.initial_learning_rate as f64,
                "optimizer_states": states,
            })
        })
        .collect();
    let p = &ckpt.properties;
    let ints: serde_json::Map<String, Value> = p
        .ints
        .iter()
        .map(|(k, v)| (k.clone(), (*v).into()))
        .collect();
    let floats: serde_json::Map<String, Value> = p
        .floats
        .iter()
        .map(|(k, v)| (k.clone(), (*v as f64).into()))
        .collect();
    let strings: serde_json::Map<String, Value> = p
        .strings
        .iter()
        .map(|(k, v)| (k.clone(), v.clone().into()))
        .collect();
    serde_json::json!({
        "version": 2,
        "has_external_data": ckpt.has_external_data,
        "is_nominal_state": ckpt.is_nominal,
        "parameters": parameters,
        "optimizer_groups": groups,
        "properties": {"ints": ints, "floats": floats, "strings": strings},
    })
}

#[test]
fn golden_files_decode_to_their_json() {
    for (ckpt_path, json_path) in common::golden_files() {
        let mut expected: Value =
            serde_json::from_slice(&std::fs::read(&json_path).unwrap()).unwrap();
        let loaded = load(&ckpt_path).unwrap_or_else(|e| panic!("{e}"));
        let mut described = describe(&loaded);
        if loaded.checkpoint().version == 1 {
            // ONNX Runtime 1.16 wrote parameters in another order than its version-2 twin.
            for v in [&mut described, &mut expected] {
                v["parameters"]
                    .as_array_mut()
                    .unwrap()
                    .sort_by_key(|p| p["name"].as_str().unwrap().to_owned());
            }
        }
        assert_eq!(described, expected, "{}", ckpt_path.display());
    }
}

#[test]
fn golden_files_round_trip_through_ortckpt() {
    let dir = tempfile::tempdir().unwrap();
    for (ckpt_path, json_path) in common::golden_files() {
        let expected: Value = serde_json::from_slice(&std::fs::read(&json_path).unwrap()).unwrap();
        let loaded = load(&ckpt_path).unwrap();
        let out = dir.path().join("copy.ckpt");
        save(
            &out,
            &loaded.as_payloads().unwrap(),
            &SaveOptions::default(),
        )
        .unwrap();
        let reloaded = load(&out).unwrap();
        // ortckpt writes the state-path order (sorted by name); compare as sets.
        let sorted = |mut v: Value| {
            v["parameters"].as_array_mut().unwrap().sort_by_key(|p| {
                (
                    !p["requires_grad"].as_bool().unwrap(),
                    p["name"].as_str().unwrap().to_owned(),
                )
            });
            v
        };
        assert_eq!(
            sorted(describe(&reloaded)),
            sorted(expected),
            "{}",
            ckpt_path.display()
        );
    }
}
