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

// x.mean(-1, keepdim=True): one block per row, f32 accumulation, tree reduction.
extern "C" __global__ void mean_rows_f32(const float* x, long cols, float* y) {
    __shared__ float partial[32];
    const float* row = x + (long)blockIdx.x * cols;
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
        if (threadIdx.x == 0) y[blockIdx.x] = acc / (float)cols;
    }
}
