// ---- FP8 quantization of activations: codes and dequantization factors, per row or per tensor. ----
// factor = amax / FP8_MAX (1 where amax is 0), code = round_to_nearest_even(x / factor), saturating:
// the rule of cudnn-ops/src/fp8.rs, bit for bit (the same divisions and roundings, in f32 here and in
// f64 there; every value below is exact in both but the quotient, which both round once to FP8).

// A NaN element does not enter its amax (fmaxf ignores it; torch's amax would give NaN): its row gets
// the factor of its other values, and its code stays NaN.

// Round to nearest even and saturate to an 8-bit float of `man` mantissa bits, exponent bias `bias`,
// largest finite code `max_code` (0x7e for E4M3, 0x7b for E5M2) and value `max_value`.
__device__ __forceinline__ unsigned char quant_encode(float v, int man, int bias, unsigned char max_code,
                                                      float max_value) {
    if (isnan(v)) return 0x7f;
    const unsigned char sign = signbit(v) ? 0x80 : 0;
    const float a = fabsf(v);
    if (a >= max_value) return sign | max_code;
    const float steps = (float)(1 << man);
    int e;
    frexpf(a, &e);                // a = f * 2^e, f in [0.5, 1): a = 1.x * 2^(e - 1)
    int E = e - 1 + bias;         // the biased exponent of a normal code
    if (a == 0.f || E < 1) {      // subnormal: k * 2^(1 - bias - man), k in 0..steps (steps: the smallest normal)
        const float k = rintf(ldexpf(a, bias - 1 + man));
        return sign | (unsigned char)k;
    }
    float f = rintf((ldexpf(a, 1 - e) - 1.f) * steps);  // mantissa, 0..steps
    if (f == steps) {
        f = 0.f;
        E += 1;
    }
    const int code = (E << man) | (int)f;
    return sign | (unsigned char)(code > max_code ? max_code : code);
}

__device__ __forceinline__ unsigned char quant_e4m3(float v) { return quant_encode(v, 3, 7, 0x7e, 448.f); }
__device__ __forceinline__ unsigned char quant_e5m2(float v) { return quant_encode(v, 2, 15, 0x7b, 57344.f); }

// The largest |x| of the block's elements (every thread's `m`), valid in every thread; `shared` holds
// 33 floats.
__device__ __forceinline__ float quant_block_max(float m, float* shared) {
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_down_sync(0xffffffffu, m, o));
    if ((threadIdx.x & 31) == 0) shared[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x < 32) {
        m = threadIdx.x < (blockDim.x >> 5) ? shared[threadIdx.x] : 0.f;
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_down_sync(0xffffffffu, m, o));
        if (threadIdx.x == 0) shared[32] = m;
    }
    __syncthreads();
    const float r = shared[32];
    __syncthreads();
    return r;
}

__device__ __forceinline__ float quant_factor(float amax, float max_value) {
    return amax > 0.f ? amax / max_value : 1.f;
}

// Per row, fused: a block per row finds the row's amax, writes its factor and the row's codes.
#define QUANT_ROWS(src, T, load, fmt, MAXV)                                                               \
extern "C" __global__ void quant_rows_##src##_##fmt(const T* x, long cols, float* factors,                \
                                                    unsigned char* q) {                                   \
    __shared__ float shared[33];                                                                          \
    const T* row = x + (long)blockIdx.x * cols;                                                           \
    float m = 0.f;                                                                                        \
    for (long j = threadIdx.x; j < cols; j += blockDim.x) m = fmaxf(m, fabsf(load(row[j])));              \
    const float f = quant_factor(quant_block_max(m, shared), MAXV);                                       \
    if (threadIdx.x == 0) factors[blockIdx.x] = f;                                                        \
    unsigned char* out = q + (long)blockIdx.x * cols;                                                     \
    for (long j = threadIdx.x; j < cols; j += blockDim.x) out[j] = quant_##fmt(load(row[j]) / f);          \
}

// Per tensor, fused: each block's amax over a grid-stride share into `partials`, one block reduces
// them to the factor, then every element's code.
#define QUANT_TENSOR(src, T, load, fmt, MAXV)                                                             \
extern "C" __global__ void quant_amax_##src(const T* x, long n, float* partials) {                        \
    __shared__ float shared[33];                                                                          \
    float m = 0.f;                                                                                        \
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)    \
        m = fmaxf(m, fabsf(load(x[i])));                                                                  \
    m = quant_block_max(m, shared);                                                                       \
    if (threadIdx.x == 0) partials[blockIdx.x] = m;                                                       \
}                                                                                                         \
extern "C" __global__ void quant_tensor_##src##_##fmt(const T* x, long n, const float* factor,             \
                                                      unsigned char* q) {                                 \
    const float f = factor[0];                                                                            \
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)    \
        q[i] = quant_##fmt(load(x[i]) / f);                                                               \
}

// The factor of a tensor from its blocks' partial maxima (one block).
#define QUANT_FACTOR(fmt, MAXV)                                                                           \
extern "C" __global__ void quant_factor_##fmt(const float* partials, long blocks, float* factor) {        \
    __shared__ float shared[33];                                                                          \
    float m = 0.f;                                                                                        \
    for (long i = threadIdx.x; i < blocks; i += blockDim.x) m = fmaxf(m, partials[i]);                    \
    m = quant_block_max(m, shared);                                                                       \
    if (threadIdx.x == 0) factor[0] = quant_factor(m, MAXV);                                              \
}

#define QUANT_ALL(src, T, load)                                                                           \
    QUANT_ROWS(src, T, load, e4m3, 448.f)                                                                 \
    QUANT_ROWS(src, T, load, e5m2, 57344.f)                                                               \
    QUANT_TENSOR(src, T, load, e4m3, 448.f)                                                               \
    extern "C" __global__ void quant_tensor_##src##_e5m2(const T* x, long n, const float* factor,          \
                                                         unsigned char* q) {                              \
        const float f = factor[0];                                                                        \
        for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) \
            q[i] = quant_e5m2(load(x[i]) / f);                                                            \
    }
QUANT_ALL(bf16, bits16, bf16_to_f32)
QUANT_ALL(f16, bits16, f16_to_f32)
QUANT_ALL(f32, float, f32_to_f32)
QUANT_FACTOR(e4m3, 448.f)
QUANT_FACTOR(e5m2, 57344.f)

// ---- Naive: the eager decomposition, x.float() -> abs -> amax(dim) (per tensor: quant_amax_f32 and
// quant_factor above, torch's two-stage reduction) -> amax / FP8_MAX (1 where 0) -> x / factor ->
// .to(fp8), each step a launch, f32 in between. ----
// x.float() is common.cu's cast_{bf16,f16}_f32; then x.abs():
ELEMENTWISE(quant_naive_abs, (const float* x, float* y, long n), y[i] = fabsf(x[i]))

// amax over each row of `cols` (a block per row).
extern "C" __global__ void quant_naive_amax_rows(const float* a, long cols, float* amax) {
    __shared__ float shared[33];
    const float* row = a + (long)blockIdx.x * cols;
    float m = 0.f;
    for (long j = threadIdx.x; j < cols; j += blockDim.x) m = fmaxf(m, row[j]);
    m = quant_block_max(m, shared);
    if (threadIdx.x == 0) amax[blockIdx.x] = m;
}

ELEMENTWISE(quant_naive_factor_e4m3, (float* f, long n), f[i] = quant_factor(f[i], 448.f))
ELEMENTWISE(quant_naive_factor_e5m2, (float* f, long n), f[i] = quant_factor(f[i], 57344.f))
ELEMENTWISE(quant_naive_div, (const float* a, const float* f, long per_row, long cols, float* y, long n),
            y[i] = a[i] / f[per_row ? i / cols : 0])
ELEMENTWISE(quant_naive_cast_e4m3, (const float* y, unsigned char* q, long n), q[i] = quant_e4m3(y[i]))
ELEMENTWISE(quant_naive_cast_e5m2, (const float* y, unsigned char* q, long n), q[i] = quant_e5m2(y[i]))
