
// ---- Naive attention: PyTorch's math-path SDPA, one op per launch, f32 scores in device memory. ----

// key.repeat_interleave(group, dim=1): K/V heads copied into a packed [b, h_q, s, d] tensor. 16-bit
// elements of any strided source (the copy does not care whether they are f16 or bf16).
ELEMENTWISE(repeat_heads_16,
            (const bits16* src, long heads_q, long group, long seq, long dim, long sb, long sh, long ss, bits16* dst, long n),
            {
                long e = i % dim, r = i / dim;
                long s = r % seq; r /= seq;
                long h = r % heads_q, b = r / heads_q;
                dst[i] = src[b * sb + (h / group) * sh + s * ss + e];
            })

// scores * scale
ELEMENTWISE(mul_scalar_f32, (const float* x, float s, float* y, long n), y[i] = x[i] * s)

// scores.masked_fill(~causal, -inf) over [.., s_q, s_kv] rows: key `col` is visible to query `row` when
// col <= row + offset (offset 0: top-left aligned, s_kv - s_q: bottom-right aligned).
ELEMENTWISE(causal_mask_f32, (const float* x, long cols, long rows, long offset, float* y, long n), {
    long col = i % cols, row = (i / cols) % rows;
    y[i] = col <= row + offset ? x[i] : -__int_as_float(0x7f800000);
})

// torch.softmax(scores, dim=-1) in f32, one block per row; also the row's log-sum-exp when `stats` is
// not null (what the fused training graph writes).
extern "C" __global__ void softmax_rows_f32(const float* x, long cols, float* y, float* stats) {
    __shared__ float partial[32];
    __shared__ float shared_value;
    const float* row = x + (long)blockIdx.x * cols;
    float* out = y + (long)blockIdx.x * cols;
    float m = -__int_as_float(0x7f800000);
    for (long j = threadIdx.x; j < cols; j += blockDim.x) m = fmaxf(m, row[j]);
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_down_sync(0xffffffffu, m, o));
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x < 32) {
        m = threadIdx.x < (blockDim.x >> 5) ? partial[threadIdx.x] : -__int_as_float(0x7f800000);
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_down_sync(0xffffffffu, m, o));
        if (threadIdx.x == 0) shared_value = m;
    }
    __syncthreads();
    m = shared_value;
    __syncthreads();
    float sum = 0.f;
    for (long j = threadIdx.x; j < cols; j += blockDim.x) sum += expf(row[j] - m);
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, o);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = sum;
    __syncthreads();
    if (threadIdx.x < 32) {
        sum = threadIdx.x < (blockDim.x >> 5) ? partial[threadIdx.x] : 0.f;
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, o);
        if (threadIdx.x == 0) {
            shared_value = sum;
            if (stats) stats[blockIdx.x] = m + logf(sum);
        }
    }
    __syncthreads();
    float inv = 1.f / shared_value;
    for (long j = threadIdx.x; j < cols; j += blockDim.x) out[j] = expf(row[j] - m) * inv;
}
