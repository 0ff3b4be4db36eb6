//! The flatbuffers verifier, walked over our schema with one leniency that
//! ONNX Runtime's files need.
//!
//! The generated Rust verifier demands that an int64 vector's elements be
//! 8-byte aligned; ONNX Runtime's C++ builder writes empty `dims` vectors on a
//! 4-byte boundary (its C++ verifier only checks the 4-byte length prefix). So
//! these mirror types verify exactly what the generated code verifies, field by
//! field, except that int64 vectors need 4-byte alignment. Reading them is still
//! sound: the decoder (`reader.rs`) copies every scalar out, aligned or not.

use flatbuffers::{
    ForwardsUOffset, InvalidFlatbuffer, Vector, Verifiable, Verifier, VerifierOptions,
};

use crate::generated::onnxruntime::fbs;

type VResult = Result<(), InvalidFlatbuffer>;

/// Verifies `buf` as a `Checkpoint` root (identifier checked by the caller).
pub fn verify_checkpoint(opts: &VerifierOptions, buf: &[u8]) -> VResult {
    let mut v = Verifier::new(opts, buf);
    <ForwardsUOffset<CheckpointTable>>::run_verifier(&mut v, 0)
}

/// A vector of int64 whose elements may sit on a 4-byte boundary.
struct Int64s;

impl Verifiable for Int64s {
    fn run_verifier(v: &mut Verifier, pos: usize) -> VResult {
        v.is_aligned::<u32>(pos)?;
        let len = v.get_uoffset(pos)? as usize;
        v.range_in_buffer(pos.saturating_add(4), len.saturating_mul(8))
    }
}

type Table<T> = ForwardsUOffset<T>;
type List<'a, T> = ForwardsUOffset<Vector<'a, ForwardsUOffset<T>>>;
type Str<'a> = ForwardsUOffset<&'a str>;

struct CheckpointTable;
struct ModuleStateTable;
struct TensorTable;
struct OptimizerGroupTable;
struct ParameterOptimizerStateTable;
struct PropertyBagTable;
struct IntPropertyTable;
struct FloatPropertyTable;
struct StringPropertyTable;

impl Verifiable for CheckpointTable {
    fn run_verifier(v: &mut Verifier, pos: usize) -> VResult {
        use fbs::Checkpoint as T;
        v.visit_table(pos)?
            .visit_field::<i32>("version", T::VT_VERSION, false)?
            .visit_field::<Table<ModuleStateTable>>("module_state", T::VT_MODULE_STATE, false)?
            .visit_field::<List<OptimizerGroupTable>>(
                "optimizer_groups",
                T::VT_OPTIMIZER_GROUPS,
                false,
            )?
            .visit_field::<Table<PropertyBagTable>>("property_bag", T::VT_PROPERTY_BAG, false)?
            .finish();
        Ok(())
    }
}

impl Verifiable for ModuleStateTable {
    fn run_verifier(v: &mut Verifier, pos: usize) -> VResult {
        use fbs::ModuleState as T;
        v.visit_table(pos)?
            .visit_field::<List<TensorTable>>(
                "requires_grad_params",
                T::VT_REQUIRES_GRAD_PARAMS,
                false,
            )?
            .visit_field::<List<TensorTable>>("frozen_params", T::VT_FROZEN_PARAMS, false)?
            .visit_field::<bool>("is_nominal_state", T::VT_IS_NOMINAL_STATE, false)?
            .visit_field::<bool>("has_external_data", T::VT_HAS_EXTERNAL_DATA, false)?
            .finish();
        Ok(())
    }
}

impl Verifiable for TensorTable {
    fn run_verifier(v: &mut Verifier, pos: usize) -> VResult {
        use fbs::Tensor as T;
        v.visit_table(pos)?
            .visit_field::<Str>("name", T::VT_NAME, false)?
            .visit_field::<Str>("doc_string", T::VT_DOC_STRING, false)?
            .visit_field::<ForwardsUOffset<Int64s>>("dims", T::VT_DIMS, false)?
            .visit_field::<fbs::TensorDataType>("data_type", T::VT_DATA_TYPE, false)?
            .visit_field::<ForwardsUOffset<Vector<u8>>>("raw_data", T::VT_RAW_DATA, false)?
            .visit_field::<List<&str>>("string_data", T::VT_STRING_DATA, false)?
            .visit_field::<i64>("external_data_offset", T::VT_EXTERNAL_DATA_OFFSET, false)?
            .finish();
        Ok(())
    }
}

impl Verifiable for OptimizerGroupTable {
    fn run_verifier(v: &mut Verifier, pos: usize) -> VResult {
        use fbs::OptimizerGroup as T;
        v.visit_table(pos)?
            .visit_field::<Str>("group_name", T::VT_GROUP_NAME, false)?
            .visit_field::<i64>("step", T::VT_STEP, false)?
            .visit_field::<f32>("initial_learning_rate", T::VT_INITIAL_LEARNING_RATE, false)?
            .visit_field::<List<ParameterOptimizerStateTable>>(
                "optimizer_states",
                T::VT_OPTIMIZER_STATES,
                false,
            )?
            .finish();
        Ok(())
    }
}

impl Verifiable for ParameterOptimizerStateTable {
    fn run_verifier(v: &mut Verifier, pos: usize) -> VResult {
        use fbs::ParameterOptimizerState as T;
        v.visit_table(pos)?
            .visit_field::<Str>("param_name", T::VT_PARAM_NAME, false)?
            .visit_field::<List<TensorTable>>("momentums", T::VT_MOMENTUMS, false)?
            .finish();
        Ok(())
    }
}

impl Verifiable for PropertyBagTable {
    fn run_verifier(v: &mut Verifier, pos: usize) -> VResult {
        use fbs::PropertyBag as T;
        v.visit_table(pos)?
            .visit_field::<List<IntPropertyTable>>("ints", T::VT_INTS, false)?
            .visit_field::<List<FloatPropertyTable>>("floats", T::VT_FLOATS, false)?
            .visit_field::<List<StringPropertyTable>>("strings", T::VT_STRINGS, false)?
            .finish();
        Ok(())
    }
}

impl Verifiable for IntPropertyTable {
    fn run_verifier(v: &mut Verifier, pos: usize) -> VResult {
        use fbs::IntProperty as T;
        v.visit_table(pos)?
            .visit_field::<Str>("name", T::VT_NAME, false)?
            .visit_field::<i64>("value", T::VT_VALUE, false)?
            .finish();
        Ok(())
    }
}

impl Verifiable for FloatPropertyTable {
    fn run_verifier(v: &mut Verifier, pos: usize) -> VResult {
        use fbs::FloatProperty as T;
        v.visit_table(pos)?
            .visit_field::<Str>("name", T::VT_NAME, false)?
            .visit_field::<f32>("value", T::VT_VALUE, false)?
            .finish();
        Ok(())
    }
}

impl Verifiable for StringPropertyTable {
    fn run_verifier(v: &mut Verifier, pos: usize) -> VResult {
        use fbs::StringProperty as T;
        v.visit_table(pos)?
            .visit_field::<Str>("name", T::VT_NAME, false)?
            .visit_field::<Str>("value", T::VT_VALUE, false)?
            .finish();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// ONNX Runtime's nominal checkpoint: its empty dims vectors sit 4 bytes off 8.
    fn ort_nominal_file() -> Vec<u8> {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/data/ort-vectors/protos_nominal.ckpt"
        );
        std::fs::read(path).unwrap()
    }

    #[test]
    fn int64_vectors_on_4_byte_boundaries_pass_like_in_onnx_runtime() {
        let buf = ort_nominal_file();
        let generated = fbs::root_as_checkpoint(&buf).unwrap_err();
        assert!(
            matches!(generated, InvalidFlatbuffer::Unaligned { .. }),
            "{generated}"
        );
        verify_checkpoint(&VerifierOptions::default(), &buf).unwrap();
    }
}
