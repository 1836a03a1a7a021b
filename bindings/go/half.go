package minikv

import "math"

// F16Bits converts f to IEEE binary16 bits, rounding to nearest even (overflow → ±Inf,
// NaN stays NaN). Use it to fill []uint16 tensors of a DtypeF16 cache.
func F16Bits(f float32) uint16 {
	b := math.Float32bits(f)
	sign := uint16(b>>16) & 0x8000
	exp := int32(b>>23) & 0xff
	mant := b & 0x7fffff
	switch {
	case exp == 0xff: // Inf or NaN
		if mant != 0 {
			return sign | 0x7e00
		}
		return sign | 0x7c00
	case exp > 142: // >= 2^16: overflow
		return sign | 0x7c00
	case exp >= 113: // normal half: exponent 1..30
		h := uint32(exp-112)<<10 | mant>>13
		rest := mant & 0x1fff
		if rest > 0x1000 || (rest == 0x1000 && h&1 == 1) {
			h++ // may carry into the exponent, up to Inf: correct
		}
		return sign | uint16(h)
	case exp >= 102: // subnormal half (or rounds up to the smallest normal)
		m := mant | 0x800000       // implicit bit
		shift := uint32(126 - exp) // value = m * 2^(exp-150); unit = 2^-24
		h := m >> shift
		rest := m & (1<<shift - 1)
		half := uint32(1) << (shift - 1)
		if rest > half || (rest == half && h&1 == 1) {
			h++
		}
		return sign | uint16(h)
	default: // below half of the smallest subnormal: ±0
		return sign
	}
}

// F16Float converts IEEE binary16 bits to float32 (exactly).
func F16Float(h uint16) float32 {
	sign := uint32(h&0x8000) << 16
	exp := uint32(h>>10) & 0x1f
	mant := uint32(h & 0x3ff)
	switch {
	case exp == 0x1f:
		return math.Float32frombits(sign | 0x7f800000 | mant<<13)
	case exp != 0:
		return math.Float32frombits(sign | (exp+112)<<23 | mant<<13)
	case mant == 0:
		return math.Float32frombits(sign)
	default: // subnormal: mant * 2^-24
		f := float32(mant) * (1.0 / (1 << 24))
		if sign != 0 {
			return -f
		}
		return f
	}
}

// BF16Bits converts f to bfloat16 bits, rounding to nearest even (NaN stays NaN). Use it to
// fill []uint16 tensors of a DtypeBF16 cache.
func BF16Bits(f float32) uint16 {
	b := math.Float32bits(f)
	if b&0x7f800000 == 0x7f800000 && b&0x7fffff != 0 {
		return uint16(b>>16) | 0x40 // quiet NaN
	}
	b += 0x7fff + (b>>16)&1
	return uint16(b >> 16)
}

// BF16Float converts bfloat16 bits to float32 (exactly).
func BF16Float(h uint16) float32 { return math.Float32frombits(uint32(h) << 16) }

// F16BitsSlice converts every element of src with F16Bits: float32 data as the []uint16 a
// DtypeF16 cache takes (Prefill16, Append16, Decode16).
func F16BitsSlice(src []float32) []uint16 {
	dst := make([]uint16, len(src))
	for i, f := range src {
		dst[i] = F16Bits(f)
	}
	return dst
}

// BF16BitsSlice converts every element of src with BF16Bits: float32 data as the []uint16 a
// DtypeBF16 cache takes.
func BF16BitsSlice(src []float32) []uint16 {
	dst := make([]uint16, len(src))
	for i, f := range src {
		dst[i] = BF16Bits(f)
	}
	return dst
}

// F16FloatSlice converts IEEE binary16 bits to float32 (exactly), e.g. a DtypeF16 cache's
// output.
func F16FloatSlice(src []uint16) []float32 {
	dst := make([]float32, len(src))
	for i, h := range src {
		dst[i] = F16Float(h)
	}
	return dst
}

// BF16FloatSlice converts bfloat16 bits to float32 (exactly), e.g. a DtypeBF16 cache's
// output.
func BF16FloatSlice(src []uint16) []float32 {
	dst := make([]float32, len(src))
	for i, h := range src {
		dst[i] = BF16Float(h)
	}
	return dst
}
