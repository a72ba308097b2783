// ---- Naive RMSNorm: LlamaRMSNorm.forward as eager runs it, one op per launch (casts in common.cu). ----

// x.pow(2)
ELEMENTWISE(pow2_f32, (const float* x, float* y, long n), { float v = x[i]; y[i] = v * v; })
// v + eps
ELEMENTWISE(add_scalar_f32, (const float* x, float s, float* y, long n), y[i] = x[i] + s)
// torch.rsqrt(v)
ELEMENTWISE(rsqrt_f32, (const float* x, float* y, long n), y[i] = rsqrtf(x[i]))
// x * r, r broadcast along rows of length `cols`. Broadcast indices use 32-bit division, as PyTorch's
// IntDivider does (callers keep n < 2^32); on the H200 this measured the same as 64-bit division.
ELEMENTWISE(mul_rows_f32, (const float* x, const float* r, long cols, float* y, long n), y[i] = x[i] * r[(unsigned)i / (unsigned)cols])
// weight * x, weight broadcast over rows; computed in f32, rounded to the I/O type
ELEMENTWISE(mul_weight_bf16, (const bits16* w, const bits16* x, long cols, bits16* y, long n),
            y[i] = f32_to_bf16(bf16_to_f32(w[(unsigned)i % (unsigned)cols]) * bf16_to_f32(x[i])))
ELEMENTWISE(mul_weight_f16, (const bits16* w, const bits16* x, long cols, bits16* y, long n),
            y[i] = f32_to_f16(f16_to_f32(w[(unsigned)i % (unsigned)cols]) * f16_to_f32(x[i])))
ELEMENTWISE(mul_weight_f32, (const float* w, const float* x, long cols, float* y, long n),
            y[i] = w[(unsigned)i % (unsigned)cols] * x[i])

// The sum of the `cols` f32 values at `row` over one block (f32 accumulation, tree reduction); the
// result is valid in thread 0.
__device__ float block_row_sum_f32(const float* row, long cols) {
    __shared__ float partial[32];
    // Four independent accumulators keep four loads in flight per thread (PyTorch's reduce kernel also
    // unrolls its input loop).
    float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
    long j = threadIdx.x;
    for (; j + 3 * (long)blockDim.x < cols; j += 4 * (long)blockDim.x) {
        a0 += row[j];
        a1 += row[j + blockDim.x];
        a2 += row[j + 2 * blockDim.x];
        a3 += row[j + 3 * blockDim.x];
    }
    for (; j < cols; j += blockDim.x) a0 += row[j];
    float acc = (a0 + a1) + (a2 + a3);
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x < 32) {
        acc = threadIdx.x < (blockDim.x >> 5) ? partial[threadIdx.x] : 0.f;
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
    }
    return acc;
}

// x.mean(-1, keepdim=True): one block per row.
extern "C" __global__ void mean_rows_f32(const float* x, long cols, float* y) {
    float sum = block_row_sum_f32(x + (long)blockIdx.x * cols, cols);
    if (threadIdx.x == 0) y[blockIdx.x] = sum / (float)cols;
}

// ---- Naive RMSNorm backward: eager autograd of LlamaRMSNorm (naive.rs lists the sequence). ----

// a * b elementwise in the I/O dtype (MulBackward0's grad * other), f32 math, one rounding
ELEMENTWISE(rms_bwd_mul_bf16, (const bits16* a, const bits16* b, bits16* y, long n),
            y[i] = f32_to_bf16(bf16_to_f32(a[i]) * bf16_to_f32(b[i])))
ELEMENTWISE(rms_bwd_mul_f16, (const bits16* a, const bits16* b, bits16* y, long n),
            y[i] = f32_to_f16(f16_to_f32(a[i]) * f16_to_f32(b[i])))
ELEMENTWISE(rms_bwd_mul_f32, (const float* a, const float* b, float* y, long n), y[i] = a[i] * b[i])
// a * b, a + b in f32
ELEMENTWISE(mul_f32, (const float* a, const float* b, float* y, long n), y[i] = a[i] * b[i])
ELEMENTWISE(add_f32, (const float* a, const float* b, float* y, long n), y[i] = a[i] + b[i])
// result.pow(3)
ELEMENTWISE(pow3_f32, (const float* x, float* y, long n), { float v = x[i]; y[i] = v * v * v; })
// grad.expand(rows, cols) / cols: MeanBackward1 (32-bit broadcast division, as mul_rows_f32)
ELEMENTWISE(expand_div_f32, (const float* g, long cols, float d, float* y, long n),
            y[i] = g[(unsigned)i / (unsigned)cols] / d)

// x.sum(-1, keepdim=True): one block per row.
extern "C" __global__ void sum_rows_f32(const float* x, long cols, float* y) {
    float sum = block_row_sum_f32(x + (long)blockIdx.x * cols, cols);
    if (threadIdx.x == 0) y[blockIdx.x] = sum;
}

// x.sum(0) of a row-major [rows, cols] matrix (the sum_to of a broadcast weight's gradient, a Linear
// bias gradient): blocks of 32 columns x 32 row lanes, f32 accumulation, one rounding to the output
// type. Also used by the naive matmul backward's bias gradient.
#define COLSUM(name, Tin, Tout, load, store)                                                      \
extern "C" __global__ void name(const Tin* x, long rows, long cols, Tout* y) {                    \
    __shared__ float part[32][33];                                                                \
    long c = (long)blockIdx.x * 32 + threadIdx.x;                                                 \
    float acc = 0.f;                                                                              \
    if (c < cols) {                                                                               \
        for (long r = threadIdx.y; r < rows; r += blockDim.y) acc += load(x[r * cols + c]);       \
    }                                                                                             \
    part[threadIdx.y][threadIdx.x] = acc;                                                         \
    __syncthreads();                                                                              \
    if (threadIdx.y == 0 && c < cols) {                                                           \
        float s = 0.f;                                                                            \
        for (int k = 0; k < (int)blockDim.y; ++k) s += part[k][threadIdx.x];                      \
        y[c] = store(s);                                                                          \
    }                                                                                             \
}
COLSUM(colsum_bf16_bf16, bits16, bits16, bf16_to_f32, f32_to_bf16)
COLSUM(colsum_f16_f16, bits16, bits16, f16_to_f32, f32_to_f16)
COLSUM(colsum_f32_f32, float, float, f32_to_f32, f32_to_f32)
COLSUM(colsum_bf16_f32, bits16, float, bf16_to_f32, f32_to_f32)
COLSUM(colsum_f16_f32, bits16, float, f16_to_f32, f32_to_f32)
