// ---- Naive scaled matmul: dequantize the FP8 operands to bf16, one elementwise kernel each. ----
// out[i] = value(q[i]) * scale[per_row ? i / cols : 0], in f32, rounded once to the output type (the
// FP8 decoders are in kernels/common.cu).

#define DEQUANT(fmt, sfx, store)                                                                         \
ELEMENTWISE(dequant_##fmt##_##sfx,                                                                       \
            (const unsigned char* q, const float* scale, long per_row, long cols, bits16* out, long n),    \
            out[i] = store(fp8_##fmt##_to_f32(q[i]) * scale[per_row ? i / cols : 0]))
DEQUANT(e4m3, bf16, f32_to_bf16)
DEQUANT(e5m2, bf16, f32_to_bf16)
DEQUANT(e4m3, f16, f32_to_f16)
DEQUANT(e5m2, f16, f32_to_f16)
