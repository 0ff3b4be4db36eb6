//! Helpers shared by the cargo integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use flatbuffers::FlatBufferBuilder;
use ortckpt::generated::onnxruntime::fbs;

pub fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data")
}

/// Every golden checkpoint written by ONNX Runtime (1.19.2, and 1.16's version-1 files),
/// with its JSON description.
pub fn golden_files() -> Vec<(PathBuf, PathBuf)> {
    let mut out = Vec::new();
    let mut dirs = vec![data_dir().join("ort-vectors")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path
                .extension()
                .is_none_or(|e| e != "json" && e != "md" && e != "onnx")
            {
                // A version-1 file (ONNX Runtime 1.16) is described by its version-2 twin's JSON:
                // version 2 changed nothing a version-1 file holds.
                let described = path.display().to_string().replace("_v1.ckpt", "_v2.ckpt");
                let json = PathBuf::from(format!("{described}.json"));
                assert!(json.exists(), "{} has no JSON description", path.display());
                out.push((path, json));
            }
        }
    }
    out.sort();
    assert_eq!(out.len(), 29, "expected the 29 golden files in tests/data");
    out
}

/// How a hand-built tensor should look; each field can be left out or bent.
pub struct RawTensor<'a> {
    pub name: Option<&'a str>,
    pub dims: Option<&'a [i64]>,
    pub data_type: i32,
    pub raw_data: Option<&'a [u8]>,
    pub external_data_offset: i64,
}

impl<'a> RawTensor<'a> {
    pub fn float(name: &'a str, dims: &'a [i64], raw: &'a [u8]) -> Self {
        RawTensor {
            name: Some(name),
            dims: Some(dims),
            data_type: 1,
            raw_data: Some(raw),
            external_data_offset: -1,
        }
    }
}

/// Builds a checkpoint with the generated code directly, so tests can write
/// files that ortckpt's own encoder would refuse to produce.
pub fn build_raw(
    version: i32,
    trainable: Option<&[RawTensor]>,
    frozen: Option<&[RawTensor]>,
) -> Vec<u8> {
    let mut fbb = FlatBufferBuilder::new();
    let requires_grad_params = trainable.map(|l| raw_tensors(&mut fbb, l));
    let frozen_params = frozen.map(|l| raw_tensors(&mut fbb, l));
    let args = fbs::ModuleStateArgs {
        requires_grad_params,
        frozen_params,
        ..Default::default()
    };
    let module_state = Some(fbs::ModuleState::create(&mut fbb, &args));
    let root = fbs::Checkpoint::create(
        &mut fbb,
        &fbs::CheckpointArgs {
            version,
            module_state,
            optimizer_groups: None,
            property_bag: None,
        },
    );
    fbs::finish_checkpoint_buffer(&mut fbb, root);
    fbb.finished_data().to_vec()
}

fn raw_tensors<'f>(
    fbb: &mut FlatBufferBuilder<'f>,
    list: &[RawTensor],
) -> flatbuffers::WIPOffset<flatbuffers::Vector<'f, flatbuffers::ForwardsUOffset<fbs::Tensor<'f>>>>
{
    let offsets: Vec<_> = list
        .iter()
        .map(|t| {
            let args = fbs::TensorArgs {
                name: t.name.map(|n| fbb.create_string(n)),
                doc_string: None,
                dims: t.dims.map(|d| fbb.create_vector(d)),
                data_type: fbs::TensorDataType(t.data_type),
                raw_data: t.raw_data.map(|r| fbb.create_vector(r)),
                string_data: None,
                external_data_offset: t.external_data_offset,
            };
            fbs::Tensor::create(fbb, &args)
        })
        .collect();
    fbb.create_vector(&offsets)
}
