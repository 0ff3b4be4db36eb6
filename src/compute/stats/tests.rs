use super::*;

fn tensor(data_type: DataType, bytes: &[u8]) -> Tensor<'_> {
    Tensor::whole(
        data_type,
        Input {
            bytes,
            release: None,
        },
    )
}

fn packed(data_type: DataType, bytes: &[u8], elements: usize) -> Tensor<'_> {
    Tensor {
        elements,
        ..tensor(data_type, bytes)
    }
}

fn f64_bytes(values: &[f64]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn figures_of(data_type: DataType, bytes: &[u8], threads: usize) -> Figures {
    statistics(&[tensor(data_type, bytes)], threads, &mut |_| Ok(())).unwrap()[0]
}

fn close(a: f64, b: f64, rtol: f64) -> bool {
    (a - b).abs() <= rtol * b.abs()
}

#[test]
fn counts_min_max_and_moments_of_a_small_tensor() {
    let values = [
        1.0,
        f64::NAN,
        2.0,
        f64::INFINITY,
        3.0,
        f64::NEG_INFINITY,
        4.0,
    ];
    let f = figures_of(DataType::Double, &f64_bytes(&values), 1);
    assert_eq!((f.nan, f.posinf, f.neginf, f.finite), (1, 1, 1, 4));
    assert_eq!((f.min, f.max, f.mean), (1.0, 4.0, 2.5));
    assert!(close(f.std, 1.25f64.sqrt(), 1e-15));
    assert!(close(f.l2, 30f64.sqrt(), 1e-15));
}

#[test]
fn no_finite_values_no_figures() {
    let f = figures_of(DataType::Double, &f64_bytes(&[f64::NAN, f64::NAN]), 1);
    assert_eq!((f.nan, f.finite), (2, 0));
    assert!(f.min.is_nan() && f.mean.is_nan() && f.l2.is_nan());
    let empty = figures_of(DataType::Float, &[], 1);
    assert_eq!(empty.finite, 0);
}

#[test]
fn the_result_does_not_depend_on_threads_and_std_does_not_collapse() {
    // 1e8 plus noise of about 1e-3, over many pieces: a naive sum of squares loses it all.
    let values: Vec<f64> = (0..200_003)
        .map(|i| 1e8 + ((i * 7919) % 1000) as f64 * 1e-6)
        .collect();
    let bytes = f64_bytes(&values);
    let one = figures_of(DataType::Double, &bytes, 1);
    let four = figures_of(DataType::Double, &bytes, 4);
    assert_eq!(one, four);
    let n = values.len() as f64;
    let mean = values.iter().map(|v| v - 1e8).sum::<f64>() / n;
    let var = values.iter().map(|v| (v - 1e8 - mean).powi(2)).sum::<f64>() / n;
    assert!(
        close(one.std, var.sqrt(), 1e-6),
        "{} vs {}",
        one.std,
        var.sqrt()
    );
}

#[test]
fn float64_near_its_largest_and_smallest_does_not_overflow_or_vanish() {
    let big = f64_bytes(&[f64::MAX, f64::MAX, -f64::MAX, f64::MAX]);
    let f = figures_of(DataType::Double, &big, 1);
    assert_eq!(f.mean, f64::MAX / 2.0);
    assert!(close(f.std, f64::MAX * 0.75f64.sqrt(), 1e-15));
    assert!(f.l2.is_infinite(), "sqrt(4) * MAX is beyond float64");
    let three = figures_of(DataType::Double, &f64_bytes(&[1e300; 3]), 1);
    assert!(close(three.l2, 1e300 * 3f64.sqrt(), 1e-15));
    let tiny = figures_of(DataType::Double, &f64_bytes(&[1e-300, -1e-300]), 1);
    assert!(close(tiny.std, 1e-300, 1e-15) && close(tiny.l2, 1e-300 * 2f64.sqrt(), 1e-15));
}

#[test]
fn every_type_widens_as_numpy() {
    let f = figures_of(DataType::Int8, &[0x80, 0x7f, 0], 1);
    assert_eq!((f.min, f.max), (-128.0, 127.0));
    let f = figures_of(DataType::Uint64, &u64::MAX.to_le_bytes(), 1);
    assert_eq!(f.max, u64::MAX as f64);
    let f = figures_of(DataType::Bool, &[0, 1, 2], 1);
    assert_eq!((f.min, f.max), (0.0, 1.0));
    assert!(close(f.l2, 2f64.sqrt(), 1e-15));
    // float16 1.0, -inf, NaN; bfloat16 -2.0
    let f = figures_of(DataType::Float16, &[0x00, 0x3c, 0x00, 0xfc, 0x00, 0x7e], 1);
    assert_eq!((f.finite, f.neginf, f.nan, f.max), (1, 1, 1, 1.0));
    let f = figures_of(DataType::Bfloat16, &[0x00, 0xc0], 1);
    assert_eq!(f.min, -2.0);
}

#[test]
fn refused_types_and_ragged_lengths_are_errors() {
    let e = statistics(&[tensor(DataType::String, &[1])], 1, &mut |_| Ok(()));
    assert!(e.is_err());
    let e = statistics(&[tensor(DataType::Float, &[1, 2, 3])], 1, &mut |_| Ok(()));
    assert!(e.is_err());
}

#[test]
fn change_figures() {
    let a = f64_bytes(&[1.0, 2.0, f64::NAN, f64::INFINITY, 5.0, f64::NAN]);
    let b = f64_bytes(&[1.0, 4.0, f64::NAN, 3.0, 2.0, 1.0]);
    let c = changes(
        &[(tensor(DataType::Double, &a), tensor(DataType::Double, &b))],
        1,
        &mut |_| Ok(()),
    )
    .unwrap()[0];
    assert_eq!((c.changed, c.nonfinite, c.max_abs), (4, 2, 3.0));
    assert!(close(c.l2, 13f64.sqrt(), 1e-15));
    assert!(close(c.norm_a, 30f64.sqrt(), 1e-15));
    assert!(close(c.relative, (13.0f64 / 30.0).sqrt(), 1e-15));
    let d = changes(
        &[(tensor(DataType::Double, &a), tensor(DataType::Float, &a))],
        1,
        &mut |_| Ok(()),
    );
    assert!(d.is_err(), "types differ");
}

#[test]
fn histogram_as_numpy() {
    let values = f64_bytes(&[0.0, 0.5, 1.0, 1.0, -1.0, 2.0, f64::NAN, 0.25]);
    let edges = [0.0, 0.25, 0.5, 0.75, 1.0];
    let counts = histogram(&tensor(DataType::Double, &values), &edges, 2).unwrap();
    assert_eq!(counts, [1, 1, 1, 2]);
    assert!(histogram(&tensor(DataType::Double, &values), &[0.0], 1).is_err());
}

#[test]
fn progress_is_told_every_byte_and_can_stop_the_pass() {
    let bytes = vec![0u8; 4 * (PIECE * 3 + 5)];
    let mut told = 0;
    statistics(&[tensor(DataType::Float, &bytes)], 2, &mut |n| {
        told += n;
        Ok(())
    })
    .unwrap();
    assert_eq!(told, bytes.len() as u64);
    let stopped = statistics(&[tensor(DataType::Float, &bytes)], 2, &mut |_| {
        Err(Error::invalid_state("stop"))
    });
    assert!(stopped.is_err());
}

#[test]
fn pieces_of_constant_values_combine_by_their_shifts() {
    // Each piece is constant (no spread of its own): all of the std is between the pieces.
    let mut values = vec![1.0; PIECE];
    values.extend(vec![2.0; PIECE]);
    values.extend(vec![1e8; 3]);
    let f = figures_of(DataType::Double, &f64_bytes(&values), 2);
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    let std = (values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n).sqrt();
    assert!(
        close(f.mean, mean, 1e-14) && close(f.std, std, 1e-12),
        "{f:?}"
    );
}

#[test]
fn relative_change_where_both_norms_are_beyond_float64() {
    // From 1e308 to 0 four times: both L2 norms are 2e308 (inf), their ratio 1.
    let a = f64_bytes(&[1e308; 4]);
    let b = f64_bytes(&[0.0; 4]);
    let c = changes(
        &[(tensor(DataType::Double, &a), tensor(DataType::Double, &b))],
        1,
        &mut |_| Ok(()),
    )
    .unwrap()[0];
    assert_eq!(
        (c.l2, c.norm_a, c.relative),
        (f64::INFINITY, f64::INFINITY, 1.0)
    );
    let zero = changes(
        &[(tensor(DataType::Double, &b), tensor(DataType::Double, &a))],
        1,
        &mut |_| Ok(()),
    )
    .unwrap()[0];
    assert!(zero.relative.is_nan(), "a's norm is 0");
}

#[test]
fn packed_types_unpack_the_low_nibble_first_and_stop_at_the_count() {
    // INT4 -8, 7, then 3 and a high nibble of padding (0xf: -1, not counted).
    let t = packed(DataType::Int4, &[0x78, 0xf3], 3);
    let f = statistics(&[t], 1, &mut |_| Ok(())).unwrap()[0];
    assert_eq!((f.finite, f.min, f.max), (3, -8.0, 7.0));
    assert!(close(f.mean, 2.0 / 3.0, 1e-15));
    let t = packed(DataType::Uint4, &[0x78, 0xf3], 4);
    let f = statistics(&[t], 1, &mut |_| Ok(())).unwrap()[0];
    assert_eq!((f.min, f.max), (3.0, 15.0));
    assert!(close(f.mean, 33.0 / 4.0, 1e-15));
    // FLOAT4E2M1: 0b0111 = 6, 0b1001 = -0.5, 0b0010 = 1, 0b1000 = -0.
    let t = packed(DataType::Float4E2M1, &[0x97, 0x82], 4);
    let f = statistics(&[t], 1, &mut |_| Ok(())).unwrap()[0];
    assert_eq!((f.min, f.max, f.nan), (-0.5, 6.0, 0));
    // INT2: 0b10 = -2, 0b01 = 1, 0b11 = -1, then padding.
    let t = packed(DataType::Int2, &[0b1111_0110], 3);
    let f = statistics(&[t], 1, &mut |_| Ok(())).unwrap()[0];
    assert_eq!((f.finite, f.min, f.max), (3, -2.0, 1.0));
    assert!(close(f.mean, -2.0 / 3.0, 1e-15));
    // FLOAT8E8M0: 2^0, 2^-127, NaN.
    let f = figures_of(DataType::Float8E8M0, &[127, 0, 255], 1);
    assert_eq!((f.finite, f.nan, f.max, f.min), (2, 1, 1.0, pow2(-127)));
}

#[test]
fn packed_pieces_split_on_whole_bytes_and_count_their_bytes() {
    // 3 pieces and a bit of UINT4, the last byte half used: every piece unpacks its own bytes.
    let n = 2 * PIECE + 3;
    let bytes: Vec<u8> = (0..n.div_ceil(2)).map(|i| (i % 251) as u8).collect();
    let want: Vec<f64> = (0..n)
        .map(|i| f64::from((bytes[i / 2] >> (4 * (i % 2))) & 0xf))
        .collect();
    let mut told = 0u64;
    let t = packed(DataType::Uint4, &bytes, n);
    let f = statistics(&[t], 3, &mut |b| {
        told += b;
        Ok(())
    })
    .unwrap()[0];
    assert_eq!(told, bytes.len() as u64);
    let exact = want.iter().sum::<f64>() / n as f64;
    assert_eq!(f.finite, n as u64);
    assert!(close(f.mean, exact, 1e-13));
    // One byte too many, or too few, for the count.
    for (len, elements) in [(3, 4), (1, 3), (2, 5)] {
        let bytes = vec![0u8; len];
        let e = statistics(&[packed(DataType::Int4, &bytes, elements)], 1, &mut |_| {
            Ok(())
        });
        assert!(e.is_err(), "{len} bytes, {elements} elements");
    }
    // A pair whose counts differ, though their bytes are as long.
    let bytes = [0u8; 2];
    let pair = (
        packed(DataType::Int4, &bytes, 3),
        packed(DataType::Int4, &bytes, 4),
    );
    assert!(changes(&[pair], 1, &mut |_| Ok(())).is_err());
}
