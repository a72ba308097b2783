// ---- Cross-entropy over a vocabulary (ops/loss). ----

#define CE_NEG_INF __int_as_float(0xff800000)

// Online (max, sum of exp) pairs: (m, s) stands for s · e^m. Combining two is exact up to rounding;
// an empty side (m = -inf) is skipped so that -inf - -inf never makes a NaN.
__device__ __forceinline__ void ce_combine(float& m, float& s, float m2, float s2) {
    if (m2 == CE_NEG_INF) return;
    if (m == CE_NEG_INF) { m = m2; s = s2; return; }
    float mx = fmaxf(m, m2);
    s = s * __expf(m - mx) + s2 * __expf(m2 - mx);
    m = mx;
}

// Block-wide combine of (m, s) over every thread (any blockDim that is a multiple of 32, at most
// 1024); every thread returns the block's pair.
__device__ __forceinline__ void ce_block_combine(float& m, float& s) {
    __shared__ float sm[32], ss[32];
    for (int o = 16; o > 0; o >>= 1) {
        float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
        ce_combine(m, s, m2, s2);
    }
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) { sm[warp] = m; ss[warp] = s; }
    __syncthreads();
    m = lane < (blockDim.x >> 5) ? sm[lane] : CE_NEG_INF;
    s = lane < (blockDim.x >> 5) ? ss[lane] : 0.f;
    for (int o = 16; o > 0; o >>= 1) {
        float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
        ce_combine(m, s, m2, s2);
    }
    __syncthreads();  // the shared pairs may be reused by the caller's next reduction
}

// Deterministic block sum (fixed tree for a fixed blockDim); every thread returns the total.
__device__ __forceinline__ float ce_block_sum(float v) {
    __shared__ float part[32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
    __syncthreads();
    v = (threadIdx.x & 31) < (blockDim.x >> 5) ? part[threadIdx.x & 31] : 0.f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    return v;
}

// A target is counted unless it equals the ignore index (when there is one).
__device__ __forceinline__ bool ce_counted(int t, long ignore, long has_ignore) { return !(has_ignore && t == ignore); }

// count[0] = number of counted targets (one block; exact in f32 up to 2^24 tokens, checked on the host).
extern "C" __global__ void ce_count(const int* targets, long tokens, long ignore, long has_ignore, float* count) {
    float c = 0.f;
    for (long r = threadIdx.x; r < tokens; r += blockDim.x) c += ce_counted(targets[r], ignore, has_ignore) ? 1.f : 0.f;
    c = ce_block_sum(c);
    if (threadIdx.x == 0) count[0] = c;
}

// Fused cross-entropy, one block per token row of `vocab` logits, f32 math in registers (no f32 copy
// of the logits anywhere). Pass 1 streams the row once, in chunks of blockDim × 4 elements, keeping an
// online (max, sum of exp) per thread; the block combines them into the row's log-sum-exp. It writes
// row_loss[r] = lse − x[target] (0 for an ignored row, NaN for a target outside the vocabulary:
// the host cannot check device targets, and a NaN loss is visible where a clamp would not be) and
// lse[r]. With `backward`, pass 2 streams the row again and writes
// dlogits = grad · (softmax − onehot) / count (0 on ignored rows) in the logits' dtype; dlogits may
// be the logits buffer itself (each element is read before the same thread overwrites it).
#define CE_FUSED(T, sfx, load, store)                                                                     \
extern "C" __global__ void ce_fused_##sfx(const T* logits, T* dlogits, const int* targets, long vocab,     \
                                          long ignore, long has_ignore, const float* count, float grad,      \
                                          float* row_loss, float* lse_out, long backward) {                 \
    long r = blockIdx.x;                                                                                  \
    const T* x = logits + r * vocab;                                                                      \
    float m = CE_NEG_INF, s = 0.f;                                                                         \
    long step = (long)blockDim.x * 4, j = threadIdx.x;                                                    \
    for (; j + 3 * (long)blockDim.x < vocab; j += step) {                                                 \
        float v0 = load(x[j]), v1 = load(x[j + blockDim.x]);                                              \
        float v2 = load(x[j + 2 * blockDim.x]), v3 = load(x[j + 3 * blockDim.x]);                         \
        float mx = fmaxf(fmaxf(v0, v1), fmaxf(v2, v3));                                                   \
        ce_combine(m, s, mx, __expf(v0 - mx) + __expf(v1 - mx) + __expf(v2 - mx) + __expf(v3 - mx));      \
    }                                                                                                     \
    for (; j < vocab; j += blockDim.x) { float v = load(x[j]); ce_combine(m, s, v, 1.f); }                \
    ce_block_combine(m, s);                                                                               \
    float lse = m + __logf(s);                                                                            \
    int t = targets[r];                                                                                   \
    bool counted = ce_counted(t, ignore, has_ignore);                                                     \
    bool valid = t >= 0 && (long)t < vocab;                                                               \
    if (threadIdx.x == 0) {                                                                               \
        row_loss[r] = !counted ? 0.f : valid ? lse - load(x[t]) : __int_as_float(0x7fc00000);              \
        lse_out[r] = lse;                                                                                 \
    }                                                                                                     \
    if (!backward) return;                                                                                \
    __syncthreads();  /* thread 0 read x[t] above; dlogits may alias x */                                 \
    float scale = counted ? grad / count[0] : 0.f;                                                        \
    T* d = dlogits + r * vocab;                                                                           \
    for (j = threadIdx.x; j < vocab; j += blockDim.x) {                                                   \
        float p = __expf(load(x[j]) - lse);                                                               \
        d[j] = store((p - (j == (long)t ? 1.f : 0.f)) * scale);                                           \
    }                                                                                                     \
}
CE_FUSED(bits16, bf16, bf16_to_f32, f32_to_bf16)
CE_FUSED(bits16, f16, f16_to_f32, f32_to_f16)
CE_FUSED(float, f32, f32_to_f32, f32_to_f32)

// loss[0] = Σ row_loss / count[0], one block, in a fixed order (deterministic); 0 / 0 = NaN when no
// token is counted, as in PyTorch.
extern "C" __global__ void ce_mean(const float* row_loss, long tokens, const float* count, float* loss) {
    float acc = 0.f;
    for (long r = threadIdx.x; r < tokens; r += blockDim.x) acc += row_loss[r];
    acc = ce_block_sum(acc);
    if (threadIdx.x == 0) loss[0] = acc / count[0];
}

// ---- The eager baseline: logits.float(), log_softmax, nll_loss (mean), and their backward. ----

// log_softmax over rows of `vocab` f32 values, one block per row: max, sum of exp, write (PyTorch's
// block softmax does the same three passes).
extern "C" __global__ void ce_log_softmax_f32(const float* x, long vocab, float* y) {
    const float* row = x + (long)blockIdx.x * vocab;
    float* out = y + (long)blockIdx.x * vocab;
    float m = CE_NEG_INF, s = 0.f;
    for (long j = threadIdx.x; j < vocab; j += blockDim.x) m = fmaxf(m, row[j]);
    ce_block_combine(m, s);  // s = 0: a max-only reduction
    float mx = m, sum = 0.f;
    for (long j = threadIdx.x; j < vocab; j += blockDim.x) sum += __expf(row[j] - mx);
    float lse = mx + __logf(ce_block_sum(sum));
    for (long j = threadIdx.x; j < vocab; j += blockDim.x) out[j] = row[j] - lse;
}

// nll_loss(reduction="mean") forward as one block (PyTorch's 2-D reduce kernel): loss[0] the loss,
// total[0] the total weight (the counted tokens). A target outside the vocabulary gives a NaN loss.
extern "C" __global__ void ce_nll_forward(const float* logp, const int* targets, long tokens, long vocab,
                                          long ignore, long has_ignore, float* loss, float* total) {
    float acc = 0.f, w = 0.f;
    for (long r = threadIdx.x; r < tokens; r += blockDim.x) {
        int t = targets[r];
        if (!ce_counted(t, ignore, has_ignore)) continue;
        acc -= (t >= 0 && (long)t < vocab) ? logp[r * vocab + t] : __int_as_float(0x7fc00000);
        w += 1.f;
    }
    acc = ce_block_sum(acc);
    w = ce_block_sum(w);
    if (threadIdx.x == 0) { loss[0] = acc / w; total[0] = w; }
}

// nll_loss backward's scatter into a zeroed gradient: g[r, target] = -grad / total_weight.
ELEMENTWISE(ce_nll_backward, (const int* targets, long vocab, long ignore, long has_ignore,
                              const float* total, float grad, float* g, long n), {
    int t = targets[i];
    if (ce_counted(t, ignore, has_ignore) && t >= 0 && (long)t < vocab) g[i * vocab + t] = -grad / total[0];
})

// log_softmax backward, one block per row: gi = g − exp(logp) · Σ g (gi may be g).
extern "C" __global__ void ce_log_softmax_backward_f32(const float* g, const float* logp, long vocab, float* gi) {
    long base = (long)blockIdx.x * vocab;
    float acc = 0.f;
    for (long j = threadIdx.x; j < vocab; j += blockDim.x) acc += g[base + j];
    float sum = ce_block_sum(acc);
    for (long j = threadIdx.x; j < vocab; j += blockDim.x) gi[base + j] = g[base + j] - __expf(logp[base + j]) * sum;
}

// zeros_like for the f32 intermediates.
ELEMENTWISE(bwd_fill_f32, (float* y, float v, long n), y[i] = v)
// x.to(torch.float32) for f32 input is a copy here (PyTorch returns the tensor itself; only the
// in-place and the f32 paths need it).
ELEMENTWISE(copy_f32, (const float* x, float* y, long n), y[i] = x[i])
