//! The narrow floats' conversions, bit for bit as NumPy (float16) and ml_dtypes (bfloat16)
//! make them: widening is exact, narrowing rounds to nearest even (overflowing to infinity).
//! A NaN stays a NaN of the same sign (its payload is not promised).

/// A float16's value as a float32 (exact).
#[inline(always)]
pub fn f16_bits_to_f32(h: u16) -> f32 {
    let sign = u32::from(h & 0x8000) << 16;
    let exponent = u32::from(h >> 10) & 0x1f;
    let mantissa = u32::from(h & 0x3ff);
    let bits = match (exponent, mantissa) {
        (0, 0) => sign,
        // Subnormal: mantissa * 2^-24, exact in float32.
        (0, m) => sign | (m as f32 * f32::from_bits(0x3380_0000)).to_bits(),
        (0x1f, m) => sign | 0x7f80_0000 | (m << 13),
        (e, m) => sign | ((e + 112) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

/// `q` (a value in units of the result's last place, `rem` beyond it out of `2 * half`)
/// rounded to nearest, ties to even.
#[inline(always)]
fn nearest_even(q: u32, rem: u32, half: u32) -> u32 {
    if rem > half || (rem == half && q & 1 == 1) {
        q + 1
    } else {
        q
    }
}

/// A float32 rounded to the nearest float16, ties to even; too large: infinity.
#[inline(always)]
pub fn f32_to_f16_bits(x: f32) -> u16 {
    let f = x.to_bits();
    let sign = ((f >> 16) & 0x8000) as u16;
    let abs = f & 0x7fff_ffff;
    let magnitude = if abs > 0x7f80_0000 {
        0x7e00 | ((abs >> 13) & 0x3ff) // NaN: quiet, the top of its payload kept
    } else if abs >= 0x4780_0000 {
        0x7c00 // 65536 and above, and infinity (65520 up to 65536 rounds there below)
    } else if abs < 0x3880_0000 {
        // Below float16's smallest normal (2^-14): a subnormal, in units of 2^-24.
        if abs < 0x3300_0000 {
            0 // under half the smallest subnormal
        } else {
            let exponent = abs >> 23; // 102..=112
            let significand = (abs & 0x7f_ffff) | 0x80_0000;
            let shift = 126 - exponent; // 14..=24
            let rem = significand & ((1 << shift) - 1);
            nearest_even(significand >> shift, rem, 1 << (shift - 1))
        }
    } else {
        // Normal: the exponent rebased (127 to 15), 13 bits of significand rounded off; a
        // carry moves into the exponent (up to infinity), as it should.
        let rebased = abs - (112 << 23);
        nearest_even(rebased >> 13, rebased & 0x1fff, 0x1000)
    };
    sign | magnitude as u16
}

/// A bfloat16's value as a float32 (exact: its upper half).
#[inline(always)]
pub fn bf16_bits_to_f32(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// A float32 rounded to the nearest bfloat16, ties to even; NaN: ml_dtypes' quiet NaN.
#[inline(always)]
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    let f = x.to_bits();
    if x.is_nan() {
        return if f >> 31 == 1 { 0xffc0 } else { 0x7fc0 };
    }
    let lsb = (f >> 16) & 1;
    (f.wrapping_add(0x7fff + lsb) >> 16) as u16
}

/// A float8 type's encoding, for rounding a float32 into it as ml_dtypes does (ONNX's four
/// types; see `stats::float8_value` for their values).
#[derive(Clone, Copy, Debug)]
pub struct Float8 {
    /// Mantissa bits.
    pub mantissa: u32,
    pub bias: i32,
    /// The largest finite magnitude's bits.
    pub largest: u8,
    /// What a magnitude above `largest` becomes (infinity, or NaN where there is none).
    pub too_large: u8,
    /// The NaN a NaN becomes.
    pub nan: u8,
    /// FNUZ: no negative zero, and NaN (0x80) has no sign.
    pub fnuz: bool,
}

pub const E4M3FN: Float8 = Float8 {
    mantissa: 3,
    bias: 7,
    largest: 0x7e,
    too_large: 0x7f,
    nan: 0x7f,
    fnuz: false,
};
pub const E4M3FNUZ: Float8 = Float8 {
    mantissa: 3,
    bias: 8,
    largest: 0x7f,
    too_large: 0x80,
    nan: 0x80,
    fnuz: true,
};
pub const E5M2: Float8 = Float8 {
    mantissa: 2,
    bias: 15,
    largest: 0x7b,
    too_large: 0x7c,
    nan: 0x7e,
    fnuz: false,
};
pub const E5M2FNUZ: Float8 = Float8 {
    mantissa: 2,
    bias: 16,
    largest: 0x7f,
    too_large: 0x80,
    nan: 0x80,
    fnuz: true,
};

/// A float32 rounded to the nearest value of `format`, ties to even (one rounding, from the
/// float32's value); beyond its largest value: `too_large`; a NaN: its NaN.
#[inline(always)]
pub fn f32_to_f8_bits(x: f32, format: Float8) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let signed = |magnitude: u8| {
        if format.fnuz && (magnitude == 0 || magnitude == 0x80) {
            magnitude // (no negative zero; NaN is 0x80 whatever the sign)
        } else {
            sign | magnitude
        }
    };
    if x.is_nan() {
        return signed(format.nan);
    }
    if x.is_infinite() {
        return signed(format.too_large);
    }
    let m = format.mantissa as i32;
    let smallest_normal = 1 - format.bias;
    // The value's exponent, no lower than the smallest normal's (below it the grid is the
    // subnormals'): the value in units of that exponent's last mantissa place, rounded.
    let exponent = ((x.to_bits() >> 23) & 0xff) as i32 - 127;
    let e = exponent.max(smallest_normal);
    let units = (f64::from(x.abs()) * f64::powi(2.0, m - e)).round_ties_even() as u32;
    let code = if e == smallest_normal && units < (1 << m) {
        units // a subnormal (or zero)
    } else {
        // Exponent field e + bias, then the mantissa; units == 2^(m+1) carries into the exponent.
        (((e + format.bias) as u32) << m) + units - (1 << m)
    };
    if code > u32::from(format.largest) {
        signed(format.too_large)
    } else {
        signed(code as u8)
    }
}

/// Whether a float8 of `format` is finite (not NaN, not infinity).
#[inline(always)]
pub fn f8_is_finite(bits: u8, format: Float8) -> bool {
    if format.fnuz {
        bits != 0x80
    } else {
        bits & 0x7f <= format.largest
    }
}
