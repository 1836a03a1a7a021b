//! Element types of host slices: `f32`, and the 16-bit [`F16`] / [`Bf16`] bit containers.
//!
//! The library reads and writes raw IEEE binary16 / bfloat16 bits; these newtypes tag
//! which one a `u16` holds (so a slice cannot be handed to a cache of the other 16-bit
//! type) and convert to and from `f32` with round-to-nearest-even, no dependencies.

use crate::Dtype;

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for super::F16 {}
    impl Sealed for super::Bf16 {}
}

/// An element type the library reads and writes in host memory. Sealed: implemented for
/// `f32` ([`Dtype::F32`]), [`F16`] ([`Dtype::F16`]) and [`Bf16`] ([`Dtype::Bf16`]), each
/// with the size and bit layout of its dtype.
pub trait Element: Copy + Send + Sync + 'static + sealed::Sealed {
    /// The cache dtype these elements are.
    const DTYPE: Dtype;
    /// Lossy conversion from `f32` (round to nearest even).
    fn from_f32(x: f32) -> Self;
    /// Exact conversion to `f32`.
    fn to_f32(self) -> f32;
}

impl Element for f32 {
    const DTYPE: Dtype = Dtype::F32;
    fn from_f32(x: f32) -> f32 {
        x
    }
    fn to_f32(self) -> f32 {
        self
    }
}

/// IEEE binary16, as raw bits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct F16(pub u16);

/// bfloat16 (the upper half of an `f32`), as raw bits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct Bf16(pub u16);

impl F16 {
    /// `x` rounded to the nearest IEEE binary16 (ties to even; overflow to infinity, NaN stays a
    /// NaN). An inherent function: no trait import needed.
    ///
    /// ```
    /// assert_eq!(minikv::F16::from_f32(1.0).to_f32(), 1.0);
    /// ```
    pub fn from_f32(x: f32) -> F16 {
        let b = x.to_bits();
        let sign = ((b >> 16) & 0x8000) as u16;
        let exp = ((b >> 23) & 0xff) as i32;
        let man = b & 0x7f_ffff;
        if exp == 0xff {
            // Inf stays Inf; NaN stays a (quiet) NaN with the top payload bits.
            let nan = if man != 0 { 0x200 | (man >> 13) as u16 } else { 0 };
            return F16(sign | 0x7c00 | nan);
        }
        let e = exp - 127 + 15; // rebias
        if e >= 0x1f {
            return F16(sign | 0x7c00); // overflow: Inf
        }
        let (base, rem, halfway) = if e <= 0 {
            // binary16 subnormal (or zero): the value in units of 2^-24.
            if e < -10 {
                return F16(sign); // below half the smallest subnormal
            }
            let m = man | 0x80_0000;
            let shift = (14 - e) as u32;
            (m >> shift, m & ((1 << shift) - 1), 1u32 << (shift - 1))
        } else {
            (((e as u32) << 10) | (man >> 13), man & 0x1fff, 0x1000)
        };
        // Ties to even; a carry may roll into the exponent, which is the right result
        // (up to Inf).
        let rounded =
            if rem > halfway || (rem == halfway && base & 1 == 1) { base + 1 } else { base };
        F16(sign | rounded as u16)
    }

    /// The exact `f32` value.
    pub fn to_f32(self) -> f32 {
        let h = self.0 as u32;
        let sign = (h & 0x8000) << 16;
        let exp = (h >> 10) & 0x1f;
        let man = h & 0x3ff;
        let bits = match exp {
            0 => {
                // Zero or subnormal: man * 2^-24, exact in f32.
                let mag = man as f32 * f32::from_bits(0x3380_0000);
                return f32::from_bits(sign | mag.to_bits());
            }
            0x1f => sign | 0x7f80_0000 | (man << 13),
            _ => sign | ((exp + 112) << 23) | (man << 13),
        };
        f32::from_bits(bits)
    }

    /// [`F16::from_f32`] of every element: `f32` data as the slice a [`Dtype::F16`]
    /// cache takes.
    ///
    /// ```
    /// let bits = minikv::F16::from_f32_slice(&[0.5, -2.0]);
    /// assert_eq!(minikv::F16::to_f32_vec(&bits), vec![0.5, -2.0]);
    /// ```
    pub fn from_f32_slice(src: &[f32]) -> Vec<F16> {
        src.iter().map(|&x| F16::from_f32(x)).collect()
    }

    /// [`F16::to_f32`] of every element, e.g. a [`Dtype::F16`] cache's output (exact).
    pub fn to_f32_vec(src: &[F16]) -> Vec<f32> {
        src.iter().map(|x| x.to_f32()).collect()
    }
}

impl Element for F16 {
    const DTYPE: Dtype = Dtype::F16;

    fn from_f32(x: f32) -> F16 {
        F16::from_f32(x)
    }

    fn to_f32(self) -> f32 {
        F16::to_f32(self)
    }
}

impl Bf16 {
    /// `x` rounded to the nearest bfloat16 (ties to even; overflow to infinity, NaN stays a
    /// NaN). An inherent function: no trait import needed.
    ///
    /// ```
    /// assert_eq!(minikv::Bf16::from_f32(1.0).to_f32(), 1.0);
    /// ```
    pub fn from_f32(x: f32) -> Bf16 {
        let b = x.to_bits();
        if x.is_nan() {
            return Bf16(((b >> 16) | 0x40) as u16); // keep it a quiet NaN
        }
        let rounding = 0x7fff + ((b >> 16) & 1);
        Bf16((b.wrapping_add(rounding) >> 16) as u16)
    }

    /// The exact `f32` value.
    pub fn to_f32(self) -> f32 {
        f32::from_bits((self.0 as u32) << 16)
    }

    /// [`Bf16::from_f32`] of every element: `f32` data as the slice a [`Dtype::Bf16`]
    /// cache takes.
    ///
    /// ```
    /// let bits = minikv::Bf16::from_f32_slice(&[0.5, -2.0]);
    /// assert_eq!(minikv::Bf16::to_f32_vec(&bits), vec![0.5, -2.0]);
    /// ```
    pub fn from_f32_slice(src: &[f32]) -> Vec<Bf16> {
        src.iter().map(|&x| Bf16::from_f32(x)).collect()
    }

    /// [`Bf16::to_f32`] of every element, e.g. a [`Dtype::Bf16`] cache's output (exact).
    pub fn to_f32_vec(src: &[Bf16]) -> Vec<f32> {
        src.iter().map(|x| x.to_f32()).collect()
    }
}

impl Element for Bf16 {
    const DTYPE: Dtype = Dtype::Bf16;

    fn from_f32(x: f32) -> Bf16 {
        Bf16::from_f32(x)
    }

    fn to_f32(self) -> f32 {
        Bf16::to_f32(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_known_values() {
        let cases: [(f32, u16); 12] = [
            (0.0, 0x0000),
            (-0.0, 0x8000),
            (1.0, 0x3c00),
            (-2.0, 0xc000),
            (0.5, 0x3800),
            (65504.0, 0x7bff), // largest finite
            (65520.0, 0x7c00), // rounds up to Inf
            (f32::INFINITY, 0x7c00),
            (5.960_464_5e-8, 0x0001),     // smallest subnormal 2^-24
            (2.980_232_2e-8, 0x0000),     // exactly half of it: ties to even (0)
            (1.0 + 1.0 / 2048.0, 0x3c00), // tie between 0x3c00 and 0x3c01: even
            (1.0 + 3.0 / 2048.0, 0x3c02), // tie between 0x3c01 and 0x3c02: even
        ];
        for (x, bits) in cases {
            assert_eq!(F16::from_f32(x).0, bits, "from_f32({x:e})");
        }
        assert!(F16::from_f32(f32::NAN).to_f32().is_nan());
    }

    #[test]
    fn f16_round_trips_every_finite_value() {
        for bits in 0..=u16::MAX {
            let h = F16(bits);
            let x = h.to_f32();
            if x.is_nan() {
                assert_eq!(bits & 0x7c00, 0x7c00);
                continue;
            }
            assert_eq!(F16::from_f32(x).0, bits, "bits {bits:#06x} -> {x:e}");
        }
    }

    #[test]
    fn f16_rounding_matches_f64_nearest() {
        // Random f32 in the normal range: the chosen half must be a nearest one.
        let mut s = 0x1234_5678_u32;
        for _ in 0..20_000 {
            s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            let x = f32::from_bits((s & 0x807f_ffff) | ((s % 30 + 100) << 23));
            let h = F16::from_f32(x);
            let err = (h.to_f32() as f64 - x as f64).abs();
            for n in [F16(h.0.wrapping_add(1)), F16(h.0.wrapping_sub(1))] {
                let other = (n.to_f32() as f64 - x as f64).abs();
                if other.is_nan() {
                    continue; // the neighbour of +-0 across the sign bit
                }
                assert!(err <= other, "{x:e}: {:#06x} is not nearest", h.0);
            }
        }
    }

    #[test]
    fn bulk_conversions_are_the_scalar_ones() {
        let mut src = vec![0.0, -0.0, 1.0, -2.0, 65504.0, 65520.0, 1e-8, f32::INFINITY, f32::NAN];
        let mut s = 0x9e37_79b9_u32;
        for _ in 0..1000 {
            s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            src.push(f32::from_bits((s & 0x807f_ffff) | ((s % 40 + 107) << 23)));
        }
        let (f16, bf16) = (F16::from_f32_slice(&src), Bf16::from_f32_slice(&src));
        let (back16, back_bf) = (F16::to_f32_vec(&f16), Bf16::to_f32_vec(&bf16));
        assert_eq!((f16.len(), back_bf.len()), (src.len(), src.len()));
        for (i, &x) in src.iter().enumerate() {
            assert_eq!(f16[i], F16::from_f32(x), "{x:e}");
            assert_eq!(bf16[i], Bf16::from_f32(x), "{x:e}");
            assert_eq!(back16[i].to_bits(), f16[i].to_f32().to_bits());
            assert_eq!(back_bf[i].to_bits(), bf16[i].to_f32().to_bits());
            // The Element trait's conversions are the same functions.
            assert_eq!(<F16 as Element>::from_f32(x), f16[i]);
            assert_eq!(<Bf16 as Element>::from_f32(x), bf16[i]);
        }
    }

    #[test]
    fn bf16_known_values() {
        assert_eq!(Bf16::from_f32(1.0).0, 0x3f80);
        assert_eq!(Bf16::from_f32(-3.0).0, 0xc040);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
        assert_eq!(Bf16::from_f32(1.0 + 1.0 / 256.0).0, 0x3f80);
        assert_eq!(Bf16::from_f32(1.0 + 3.0 / 256.0).0, 0x3f82);
        assert_eq!(Bf16(0x4049).to_f32(), 3.140_625);
        assert!(Bf16::from_f32(f32::NAN).to_f32().is_nan());
    }
}
