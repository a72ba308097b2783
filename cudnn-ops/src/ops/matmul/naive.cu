// Matmul epilogue kernels (one op per launch after the cuBLAS GEMM), in place on the output D. Each
// reads and writes the output dtype and computes in f32, as eager's bf16/f16/f32 elementwise kernels do.
// Broadcast indices use 32-bit division (callers keep n < 2^32).

// One set per output dtype: T the element type, load/store the f32 conversions from kernels/common.cu.
#define EPI_KERNELS(T, sfx, load, store)                                                                \
/* y + bias, bias broadcast over rows of length cols */                                                \
ELEMENTWISE(epi_bias_##sfx, (T* y, const T* bias, long cols, long n),                                  \
            y[i] = store(load(y[i]) + load(bias[(unsigned)i % (unsigned)cols])))                       \
/* F.silu(y), F.gelu(y), F.gelu(y, approximate="tanh"), F.relu(y) */                                    \
ELEMENTWISE(epi_silu_##sfx, (T* y, long n), y[i] = store(epi_silu(load(y[i]))))                        \
ELEMENTWISE(epi_gelu_##sfx, (T* y, long n), y[i] = store(epi_gelu(load(y[i]))))                        \
ELEMENTWISE(epi_gelu_tanh_##sfx, (T* y, long n), y[i] = store(epi_gelu_tanh(load(y[i]))))              \
ELEMENTWISE(epi_relu_##sfx, (T* y, long n), y[i] = store(epi_relu(load(y[i]))))                        \
/* y * up (the SwiGLU gate) */                                                                         \
ELEMENTWISE(epi_mul_##sfx, (T* y, const T* u, long n), y[i] = store(load(y[i]) * load(u[i])))          \
/* residual + y */                                                                                     \
ELEMENTWISE(epi_add_##sfx, (T* y, const T* r, long n), y[i] = store(load(r[i]) + load(y[i])))

EPI_KERNELS(bits16, bf16, bf16_to_f32, f32_to_bf16)
EPI_KERNELS(bits16, f16, f16_to_f32, f32_to_f16)
EPI_KERNELS(float, f32, f32_to_f32, f32_to_f32)

// y = base + parts[0] + parts[1] + ... over `count` partial products of one matmul stored one after
// another (a row-parallel projection's ranks, gathered; partials.rs) and an optional base (the
// residual; null for none), summed in f32 in that order starting from the first term (so -0 + -0
// stays -0) and rounded once, so every rank that sums the same terms gets the same bits. count >= 1
// (checked on the host). Eight elements a thread, read and written 16 bytes at a time where the
// pointers are 16-byte aligned and n is a multiple of 8.
#define SUM_PARTS_16(sfx, load, store)                                                                  \
extern "C" __global__ void sum_parts_##sfx(const bits16* base, const bits16* parts, long count, bits16* y, \
                                           long n) {                                                    \
    const long i = ((long)blockIdx.x * blockDim.x + threadIdx.x) * 8;                                  \
    if (i >= n) return;                                                                                 \
    float acc[8];                                                                                       \
    const bool seeded = base != 0;                                                                      \
    if ((n & 7) == 0 && ((((unsigned long)parts) | ((unsigned long)y) | ((unsigned long)base)) & 15) == 0) { \
        if (seeded) {                                                                                   \
            const uint4 v = *(const uint4*)(base + i);                                                  \
            const unsigned w[4] = {v.x, v.y, v.z, v.w};                                                 \
            _Pragma("unroll")                                                                           \
            for (int k = 0; k < 4; ++k) {                                                               \
                acc[2 * k] = load((bits16)(w[k] & 0xffffu));                                            \
                acc[2 * k + 1] = load((bits16)(w[k] >> 16));                                            \
            }                                                                                           \
        }                                                                                               \
        for (long r = 0; r < count; ++r) {                                                              \
            const uint4 v = *(const uint4*)(parts + r * n + i);                                         \
            const unsigned w[4] = {v.x, v.y, v.z, v.w};                                                 \
            const bool first = r == 0 && !seeded;                                                       \
            _Pragma("unroll")                                                                           \
            for (int k = 0; k < 4; ++k) {                                                               \
                const float lo = load((bits16)(w[k] & 0xffffu)), hi = load((bits16)(w[k] >> 16));       \
                acc[2 * k] = first ? lo : acc[2 * k] + lo;                                              \
                acc[2 * k + 1] = first ? hi : acc[2 * k + 1] + hi;                                      \
            }                                                                                           \
        }                                                                                               \
        unsigned o[4];                                                                                  \
        _Pragma("unroll")                                                                               \
        for (int k = 0; k < 4; ++k) o[k] = (unsigned)store(acc[2 * k]) | ((unsigned)store(acc[2 * k + 1]) << 16); \
        *(uint4*)(y + i) = make_uint4(o[0], o[1], o[2], o[3]);                                          \
    } else {                                                                                            \
        for (int k = 0; k < 8 && i + k < n; ++k) {                                                      \
            acc[k] = seeded ? load(base[i + k]) + load(parts[i + k]) : load(parts[i + k]);              \
            for (long r = 1; r < count; ++r) acc[k] += load(parts[r * n + i + k]);                      \
            y[i + k] = store(acc[k]);                                                                   \
        }                                                                                               \
    }                                                                                                   \
}
SUM_PARTS_16(bf16, bf16_to_f32, f32_to_bf16)
SUM_PARTS_16(f16, f16_to_f32, f32_to_f16)
extern "C" __global__ void sum_parts_f32(const float* base, const float* parts, long count, float* y, long n) {
    const long i = ((long)blockIdx.x * blockDim.x + threadIdx.x) * 8;
    for (int k = 0; k < 8 && i + k < n; ++k) {
        float acc = base != 0 ? base[i + k] + parts[i + k] : parts[i + k];
        for (long r = 1; r < count; ++r) acc += parts[r * n + i + k];
        y[i + k] = acc;
    }
}

// ---- An FP8 weight dequantized for the 16-bit GEMM (naive.rs `dequantized`; scaled_matmul's naive
// half dequantizes both operands with these). ----
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
