// ---- Naive scaled matmul: dequantize the FP8 operands to bf16, one elementwise kernel each. ----
// out[i] = value(q[i]) * scale[per_row ? i / cols : 0], in f32, rounded once to bf16. The decoders
// give the exact value of every code (OCP FP8: E4M3 has no infinities and NaN at S.1111.111; E5M2
// is IEEE-like).

__device__ __forceinline__ float fp8_e4m3_to_f32(unsigned char c) {
    const float sign = (c & 0x80) ? -1.f : 1.f;
    const int e = (c >> 3) & 0xf, m = c & 0x7;
    if ((c & 0x7f) == 0x7f) return __int_as_float(0x7fc00000);
    if (e == 0) return sign * ldexpf((float)m, -9);  // subnormal: m/8 * 2^-6
    return sign * ldexpf((float)(8 + m), e - 10);    // (1 + m/8) * 2^(e-7)
}

__device__ __forceinline__ float fp8_e5m2_to_f32(unsigned char c) {
    const float sign = (c & 0x80) ? -1.f : 1.f;
    const int e = (c >> 2) & 0x1f, m = c & 0x3;
    if (e == 31) return m ? __int_as_float(0x7fc00000) : sign * __int_as_float(0x7f800000);
    if (e == 0) return sign * ldexpf((float)m, -16);  // subnormal: m/4 * 2^-14
    return sign * ldexpf((float)(4 + m), e - 17);     // (1 + m/4) * 2^(e-15)
}

ELEMENTWISE(dequant_e4m3_bf16,
            (const unsigned char* q, const float* scale, long per_row, long cols, bits16* out, long n),
            out[i] = f32_to_bf16(fp8_e4m3_to_f32(q[i]) * scale[per_row ? i / cols : 0]))
ELEMENTWISE(dequant_e5m2_bf16,
            (const unsigned char* q, const float* scale, long per_row, long cols, bits16* out, long n),
            out[i] = f32_to_bf16(fp8_e5m2_to_f32(q[i]) * scale[per_row ? i / cols : 0]))
