//! Tensor data types: ONNX codes, names and element sizes.

use crate::error::{Error, ErrorKind, Result};

/// A tensor element type, by its ONNX `TensorProto.DataType` code.
///
/// Codes 0-20 are ONNX Runtime's `TensorDataType` enum; 21 (UINT4) and 22 (INT4)
/// are written by ONNX Runtime's saver as raw numbers and stored two per byte.
/// 23-26 are ONNX's later codes, which a training build of ONNX Runtime's main
/// writes as they are: FLOAT4E2M1 (two per byte, like INT4), FLOAT8E8M0, and
/// UINT2/INT2 (four per byte, the first value in the lowest bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum DataType {
    Undefined = 0,
    Float = 1,
    Uint8 = 2,
    Int8 = 3,
    Uint16 = 4,
    Int16 = 5,
    Int32 = 6,
    Int64 = 7,
    String = 8,
    Bool = 9,
    Float16 = 10,
    Double = 11,
    Uint32 = 12,
    Uint64 = 13,
    Complex64 = 14,
    Complex128 = 15,
    Bfloat16 = 16,
    Float8E4M3Fn = 17,
    Float8E4M3Fnuz = 18,
    Float8E5M2 = 19,
    Float8E5M2Fnuz = 20,
    Uint4 = 21,
    Int4 = 22,
    Float4E2M1 = 23,
    Float8E8M0 = 24,
    Uint2 = 25,
    Int2 = 26,
}

/// Every data type, in code order.
pub const ALL_DATA_TYPES: [DataType; 27] = [
    DataType::Undefined,
    DataType::Float,
    DataType::Uint8,
    DataType::Int8,
    DataType::Uint16,
    DataType::Int16,
    DataType::Int32,
    DataType::Int64,
    DataType::String,
    DataType::Bool,
    DataType::Float16,
    DataType::Double,
    DataType::Uint32,
    DataType::Uint64,
    DataType::Complex64,
    DataType::Complex128,
    DataType::Bfloat16,
    DataType::Float8E4M3Fn,
    DataType::Float8E4M3Fnuz,
    DataType::Float8E5M2,
    DataType::Float8E5M2Fnuz,
    DataType::Uint4,
    DataType::Int4,
    DataType::Float4E2M1,
    DataType::Float8E8M0,
    DataType::Uint2,
    DataType::Int2,
];

impl DataType {
    /// The type for an ONNX code; codes beyond 26 are an error.
    pub fn from_code(code: i32) -> Result<Self> {
        usize::try_from(code)
            .ok()
            .and_then(|i| ALL_DATA_TYPES.get(i).copied())
            .ok_or_else(|| Error::new(ErrorKind::UnsupportedDataType(code)))
    }

    pub fn code(self) -> i32 {
        self as i32
    }

    /// ONNX's upper-case name, as ONNX Runtime prints it.
    pub fn name(self) -> &'static str {
        use DataType::*;
        match self {
            Undefined => "UNDEFINED",
            Float => "FLOAT",
            Uint8 => "UINT8",
            Int8 => "INT8",
            Uint16 => "UINT16",
            Int16 => "INT16",
            Int32 => "INT32",
            Int64 => "INT64",
            String => "STRING",
            Bool => "BOOL",
            Float16 => "FLOAT16",
            Double => "DOUBLE",
            Uint32 => "UINT32",
            Uint64 => "UINT64",
            Complex64 => "COMPLEX64",
            Complex128 => "COMPLEX128",
            Bfloat16 => "BFLOAT16",
            Float8E4M3Fn => "FLOAT8E4M3FN",
            Float8E4M3Fnuz => "FLOAT8E4M3FNUZ",
            Float8E5M2 => "FLOAT8E5M2",
            Float8E5M2Fnuz => "FLOAT8E5M2FNUZ",
            Uint4 => "UINT4",
            Int4 => "INT4",
            Float4E2M1 => "FLOAT4E2M1",
            Float8E8M0 => "FLOAT8E8M0",
            Uint2 => "UINT2",
            Int2 => "INT2",
        }
    }

    /// Bits per element for types stored in `raw_data`; `None` for STRING
    /// (stored in `string_data`) and UNDEFINED (no size at all).
    pub fn bits(self) -> Option<u64> {
        use DataType::*;
        match self {
            Undefined | String => None,
            Uint2 | Int2 => Some(2),
            Uint4 | Int4 | Float4E2M1 => Some(4),
            Uint8 | Int8 | Bool | Float8E4M3Fn | Float8E4M3Fnuz | Float8E5M2 | Float8E5M2Fnuz
            | Float8E8M0 => Some(8),
            Uint16 | Int16 | Float16 | Bfloat16 => Some(16),
            Float | Int32 | Uint32 => Some(32),
            Int64 | Double | Uint64 | Complex64 => Some(64),
            Complex128 => Some(128),
        }
    }

    /// Bytes that `elements` values take in `raw_data` (sub-byte types round up).
    /// `None` when the type has no byte size or the count overflows.
    pub fn byte_len(self, elements: u64) -> Option<u64> {
        let bits = elements.checked_mul(self.bits()?)?;
        Some(bits.div_ceil(8))
    }
}

/// Number of elements of a tensor of `data_type` with these dims, with checked arithmetic.
///
/// A negative dim is an error, and so are dims whose non-zero ones need more than
/// `i64::MAX` elements or bytes, even when another dim is 0: such a shape has no
/// NumPy (or ONNX Runtime) representation, empty or not. (Found by fuzzing: dims
/// `[0, 2^62, 2^62]` passed as an empty tensor, then failed in NumPy.)
pub fn element_count(dims: &[i64], data_type: DataType) -> std::result::Result<u64, String> {
    let mut nonzero = 1i64;
    let mut has_zero = false;
    for &d in dims {
        if d < 0 {
            return Err(format!("negative dimension {d} in dims {dims:?}"));
        }
        if d == 0 {
            has_zero = true;
        } else {
            nonzero = nonzero
                .checked_mul(d)
                .ok_or_else(|| format!("dims {dims:?} overflow the element count"))?;
        }
    }
    // Whole bytes per element as NumPy holds them (a str is an object pointer).
    let item_bytes = data_type.bits().map_or(8, |b| b.div_ceil(8).max(1)) as i64;
    if nonzero.checked_mul(item_bytes).is_none() {
        return Err(format!(
            "dims {dims:?} of {} overflow the byte length",
            data_type.name()
        ));
    }
    Ok(if has_zero { 0 } else { nonzero as u64 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn element_counts_are_checked_even_when_a_dim_is_zero() {
        let f32 = DataType::Float;
        assert_eq!(element_count(&[2, 3], f32), Ok(6));
        assert_eq!(element_count(&[], f32), Ok(1));
        assert_eq!(element_count(&[4, 0, 9], f32), Ok(0));
        let e = element_count(&[0, 1 << 62, 1 << 62], f32).unwrap_err();
        assert!(e.contains("overflow the element count"), "{e}");
        let e = element_count(&[0, 1 << 62], f32).unwrap_err();
        assert!(e.contains("overflow the byte length"), "{e}");
        assert_eq!(element_count(&[0, 1 << 62], DataType::Uint8), Ok(0));
        assert!(element_count(&[i64::MAX, 2], f32).is_err());
        assert!(element_count(&[3, -1], f32)
            .unwrap_err()
            .contains("negative dimension -1"));
    }

    #[test]
    fn codes_round_trip_and_unknown_codes_fail() {
        for (i, t) in ALL_DATA_TYPES.iter().enumerate() {
            assert_eq!(t.code() as usize, i);
            assert_eq!(DataType::from_code(i as i32).unwrap(), *t);
        }
        for bad in [-1, 27, 1000, i32::MIN, i32::MAX] {
            let e = DataType::from_code(bad).unwrap_err();
            assert!(matches!(e.kind(), ErrorKind::UnsupportedDataType(c) if *c == bad));
        }
    }

    #[test]
    fn byte_lengths() {
        assert_eq!(DataType::Float.byte_len(6), Some(24));
        assert_eq!(DataType::Int4.byte_len(6), Some(3));
        assert_eq!(DataType::Uint4.byte_len(5), Some(3));
        assert_eq!(DataType::Float4E2M1.byte_len(5), Some(3));
        assert_eq!(DataType::Int2.byte_len(5), Some(2));
        assert_eq!(DataType::Uint2.byte_len(8), Some(2));
        assert_eq!(DataType::Float8E8M0.byte_len(3), Some(3));
        assert_eq!(DataType::Complex128.byte_len(2), Some(32));
        assert_eq!(DataType::String.byte_len(2), None);
        assert_eq!(DataType::Undefined.byte_len(2), None);
        assert_eq!(DataType::Double.byte_len(u64::MAX / 4), None);
    }

    #[test]
    fn element_counts_are_checked() {
        let f = DataType::Float;
        assert_eq!(element_count(&[], f), Ok(1));
        assert_eq!(element_count(&[2, 0, 5], f), Ok(0));
        assert_eq!(element_count(&[16, 8], f), Ok(128));
        assert!(element_count(&[2, -1], f).unwrap_err().contains("negative"));
        assert!(element_count(&[i64::MAX, i64::MAX], f)
            .unwrap_err()
            .contains("overflow"));
    }
}
