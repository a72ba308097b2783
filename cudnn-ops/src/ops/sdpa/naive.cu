
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

// ---- Naive attention backward: the math path's autograd, one op per launch. ----

// p = exp(s - lse[row]) over [rows, cols] f32 scores: the forward's softmax recomputed from its saved
// log-sum-exp (a row whose lse is not finite has every key masked: its probabilities are 0).
ELEMENTWISE(exp_sub_rows_f32, (const float* s, const float* lse, long cols, float* p, long n), {
    float m = lse[i / cols];
    p[i] = fabsf(m) < __int_as_float(0x7f800000) ? expf(s[i] - m) : 0.f;
})

// delta[row] = (dO * O).sum(-1) in f32 over strided [b, h, s, d] 16-bit tensors, one thread per row.
#define ROW_DOT(name, to_f32)                                                                          \
ELEMENTWISE(name, (const bits16* x, const bits16* y, long heads, long seq, long dim,                   \
                   long xb, long xh, long xs, long yb, long yh, long ys, float* out, long n), {         \
    long s = i % seq, h = (i / seq) % heads, b = i / (seq * heads);                                    \
    const bits16* xr = x + b * xb + h * xh + s * xs;                                                   \
    const bits16* yr = y + b * yb + h * yh + s * ys;                                                   \
    float acc = 0.f;                                                                                   \
    for (long e = 0; e < dim; ++e) acc += to_f32(xr[e]) * to_f32(yr[e]);                               \
    out[i] = acc;                                                                                      \
})
ROW_DOT(row_dot_bf16, bf16_to_f32)
ROW_DOT(row_dot_f16, f16_to_f32)

// torch._softmax_backward_data with the row sums precomputed: ds = p * (dp - delta[row]).
ELEMENTWISE(softmax_backward_f32, (const float* p, const float* dp, const float* delta, long cols, float* ds, long n),
            ds[i] = p[i] * (dp[i] - delta[i / cols]))

// repeat_interleave's backward: the f32 gradient of the repeated [b, h_q, s, d] heads (packed) summed
// over each group of `group` query heads into the strided [b, h_kv, s, d] gradient of K or V.
#define GROUP_SUM(name, from_f32)                                                                      \
ELEMENTWISE(name, (const float* src, long heads_kv, long group, long seq, long dim,                    \
                   long db, long dh, long ds, bits16* dst, long n), {                                  \
    long e = i % dim, r = i / dim;                                                                     \
    long s = r % seq; r /= seq;                                                                        \
    long h = r % heads_kv, b = r / heads_kv;                                                           \
    const float* from = src + (((b * heads_kv + h) * group) * seq + s) * dim + e;                      \
    float acc = 0.f;                                                                                   \
    for (long g = 0; g < group; ++g) acc += from[g * seq * dim];                                       \
    dst[b * db + h * dh + s * ds + e] = from_f32(acc);                                                 \
})
GROUP_SUM(group_sum_f32_bf16, f32_to_bf16)
GROUP_SUM(group_sum_f32_f16, f32_to_f16)
