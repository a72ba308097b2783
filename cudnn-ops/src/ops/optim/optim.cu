// ---- Optimizer step and gradient clipping over many tensors at once (ops/optim). ----

// A multi-tensor table: OPT_FIELDS 64-bit values per tensor (device addresses and sizes), uploaded by
// the host once per distinct tensor list. Tensor i covers the blocks first[i] .. first[i + 1]; each
// block handles OPT_CHUNK consecutive elements of one tensor.
#define OPT_FIELDS 8
#define OPT_CHUNK 65536
#define OPT_PARAM 0
#define OPT_GRAD 1
#define OPT_M 2
#define OPT_V 3
#define OPT_MASTER 4
#define OPT_LEN 5
#define OPT_FIRST 6

// The tensor whose blocks include `block` (binary search over the first blocks, ascending).
__device__ __forceinline__ int opt_tensor(const long long* table, long tensors, long long block) {
    long lo = 0, hi = tensors - 1;
    while (lo < hi) {
        long mid = (lo + hi + 1) >> 1;
        if (table[mid * OPT_FIELDS + OPT_FIRST] <= block) lo = mid; else hi = mid - 1;
    }
    return lo;
}

// Fused AdamW (torch.optim.AdamW's formula, f32 math): for each element, with g scaled by grad_scale[1]
// when given (clipping), p read from the f32 master copy when there is one:
//   p *= 1 − lr·wd;  m = β₁m + (1 − β₁)g;  v = β₂v + (1 − β₂)g²;  p −= step_size · m / (√v / bc2_sqrt + eps)
// then m, v, the master copy and the parameter (rounded to its dtype) are written.
#define ADAMW(P, G, sfx, load_p, store_p, load_g)                                                         \
extern "C" __global__ void adamw_##sfx(const long long* table, long tensors, float lr, float beta1,         \
                                       float beta2, float eps, float weight_decay, float step_size,        \
                                       float bc2_sqrt, const float* grad_scale) {                          \
    int t = opt_tensor(table, tensors, blockIdx.x);                                                       \
    const long long* e = table + t * OPT_FIELDS;                                                          \
    P* p = (P*)e[OPT_PARAM];                                                                              \
    const G* g = (const G*)e[OPT_GRAD];                                                                   \
    float* m = (float*)e[OPT_M];                                                                          \
    float* v = (float*)e[OPT_V];                                                                          \
    float* master = (float*)e[OPT_MASTER];                                                                \
    long long begin = (blockIdx.x - e[OPT_FIRST]) * (long long)OPT_CHUNK;                                 \
    long long end = begin + OPT_CHUNK < e[OPT_LEN] ? begin + OPT_CHUNK : e[OPT_LEN];                       \
    float gs = grad_scale ? grad_scale[1] : 1.f, decay = 1.f - lr * weight_decay;                         \
    for (long long i = begin + threadIdx.x; i < end; i += blockDim.x) {                                   \
        float gi = load_g(g[i]) * gs;                                                                     \
        float pi = master ? master[i] : load_p(p[i]);                                                     \
        float mi = beta1 * m[i] + (1.f - beta1) * gi;                                                     \
        float vi = beta2 * v[i] + (1.f - beta2) * gi * gi;                                                \
        pi = pi * decay - step_size * mi / (sqrtf(vi) / bc2_sqrt + eps);                                  \
        m[i] = mi;                                                                                        \
        v[i] = vi;                                                                                        \
        if (master) master[i] = pi;                                                                       \
        p[i] = store_p(pi);                                                                               \
    }                                                                                                     \
}
ADAMW(bits16, bits16, bf16_bf16, bf16_to_f32, f32_to_bf16, bf16_to_f32)
ADAMW(bits16, float, bf16_f32, bf16_to_f32, f32_to_bf16, f32_to_f32)
ADAMW(float, bits16, f32_bf16, f32_to_f32, f32_to_f32, bf16_to_f32)
ADAMW(float, float, f32_f32, f32_to_f32, f32_to_f32, f32_to_f32)

// Deterministic block sum (fixed tree for a fixed blockDim).
__device__ __forceinline__ float opt_block_sum(float v) {
    __shared__ float part[32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
    __syncthreads();
    v = (threadIdx.x & 31) < (blockDim.x >> 5) ? part[threadIdx.x & 31] : 0.f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    return v;
}

// Global gradient norm, pass 1: partial[b] = Σ g² over block b's chunk (no atomics: the same inputs
// give the same bits on every run).
#define GRAD_SUMSQ(G, sfx, load_g)                                                                        \
extern "C" __global__ void grad_sumsq_##sfx(const long long* table, long tensors, float* partial) {        \
    int t = opt_tensor(table, tensors, blockIdx.x);                                                       \
    const long long* e = table + t * OPT_FIELDS;                                                          \
    const G* g = (const G*)e[OPT_GRAD];                                                                   \
    long long begin = (blockIdx.x - e[OPT_FIRST]) * (long long)OPT_CHUNK;                                 \
    long long end = begin + OPT_CHUNK < e[OPT_LEN] ? begin + OPT_CHUNK : e[OPT_LEN];                       \
    float acc = 0.f;                                                                                      \
    for (long long i = begin + threadIdx.x; i < end; i += blockDim.x) { float x = load_g(g[i]); acc += x * x; } \
    acc = opt_block_sum(acc);                                                                             \
    if (threadIdx.x == 0) partial[blockIdx.x] = acc;                                                      \
}
GRAD_SUMSQ(bits16, bf16, bf16_to_f32)
GRAD_SUMSQ(bits16, f16, f16_to_f32)
GRAD_SUMSQ(float, f32, f32_to_f32)

// Pass 2, one block: out[0] = √Σ partial (f64 accumulation in a fixed order), out[1] the clipping
// coefficient min(1, max_norm / (norm + 1e-6)) as clip_grad_norm_ computes it (1 when max_norm ≤ 0,
// i.e. no clipping asked).
extern "C" __global__ void grad_norm_finish(const float* partial, long blocks, float max_norm, float* out) {
    __shared__ double part[32];
    double acc = 0.0;
    for (long b = threadIdx.x; b < blocks; b += blockDim.x) acc += (double)partial[b];
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        double total = 0.0;
        for (int w = 0; w < (int)(blockDim.x >> 5); ++w) total += part[w];
        float norm = (float)sqrt(total);
        out[0] = norm;
        out[1] = max_norm > 0.f ? fminf(1.f, max_norm / (norm + 1e-6f)) : 1.f;
    }
}

// Clipping: g *= coefficient[1] in place (the coefficient as grad_norm_finish wrote it, on the device:
// no synchronization with the host).
#define GRAD_SCALE(G, sfx, load_g, store_g)                                                               \
extern "C" __global__ void grad_scale_##sfx(const long long* table, long tensors, const float* coefficient) { \
    int t = opt_tensor(table, tensors, blockIdx.x);                                                       \
    const long long* e = table + t * OPT_FIELDS;                                                          \
    G* g = (G*)e[OPT_GRAD];                                                                               \
    long long begin = (blockIdx.x - e[OPT_FIRST]) * (long long)OPT_CHUNK;                                 \
    long long end = begin + OPT_CHUNK < e[OPT_LEN] ? begin + OPT_CHUNK : e[OPT_LEN];                       \
    float c = coefficient[1];                                                                             \
    for (long long i = begin + threadIdx.x; i < end; i += blockDim.x) g[i] = store_g(load_g(g[i]) * c);   \
}
GRAD_SCALE(bits16, bf16, bf16_to_f32, f32_to_bf16)
GRAD_SCALE(bits16, f16, f16_to_f32, f32_to_f16)
GRAD_SCALE(float, f32, f32_to_f32, f32_to_f32)

// ---- The eager baseline: torch.optim.AdamW(foreach=False, fused=False), one tensor at a time, one
// kernel per elementary op (_single_tensor_adamw), f32 moments. ----

// param.mul_(1 − lr·wd) (on the master copy when there is one)
ELEMENTWISE(adamw_eager_decay_bf16, (bits16* p, float f, long n), p[i] = f32_to_bf16(bf16_to_f32(p[i]) * f))
ELEMENTWISE(adamw_eager_decay_f32, (float* p, float f, long n), p[i] = p[i] * f)
// exp_avg.lerp_(grad, 1 − β₁)
ELEMENTWISE(adamw_eager_lerp_bf16, (float* m, const bits16* g, float w, long n), m[i] += w * (bf16_to_f32(g[i]) - m[i]))
ELEMENTWISE(adamw_eager_lerp_f32, (float* m, const float* g, float w, long n), m[i] += w * (g[i] - m[i]))
// exp_avg_sq.mul_(β₂)
ELEMENTWISE(adamw_eager_mul_f32, (float* v, float s, long n), v[i] *= s)
// exp_avg_sq.addcmul_(grad, grad, value=1 − β₂)
ELEMENTWISE(adamw_eager_addcmul_bf16, (float* v, const bits16* g, float s, long n), { float x = bf16_to_f32(g[i]); v[i] += s * x * x; })
ELEMENTWISE(adamw_eager_addcmul_f32, (float* v, const float* g, float s, long n), v[i] += s * g[i] * g[i])
// denom = exp_avg_sq.sqrt()
ELEMENTWISE(adamw_eager_sqrt_f32, (const float* v, float* d, long n), d[i] = sqrtf(v[i]))
// denom / bias_correction2_sqrt
ELEMENTWISE(adamw_eager_div_f32, (float* d, float s, long n), d[i] = d[i] / s)
// param.addcdiv_(exp_avg, denom, value=-step_size)
ELEMENTWISE(adamw_eager_addcdiv_bf16, (bits16* p, const float* m, const float* d, float s, long n),
            p[i] = f32_to_bf16(bf16_to_f32(p[i]) + s * m[i] / d[i]))
ELEMENTWISE(adamw_eager_addcdiv_f32, (float* p, const float* m, const float* d, float s, long n), p[i] += s * m[i] / d[i])
// grad * clip_coef into an f32 temporary (clip_grad_norm_'s mul_, without touching the caller's grads)
ELEMENTWISE(adamw_eager_scale_bf16, (const bits16* g, const float* c, float* y, long n), y[i] = bf16_to_f32(g[i]) * c[1])
ELEMENTWISE(adamw_eager_scale_f32, (const float* g, const float* c, float* y, long n), y[i] = g[i] * c[1])

// ---- The eager gradient norm and clipping: clip_grad_norm_(foreach=False). ----

// torch.linalg.vector_norm(g) of one tensor in one launch (PyTorch's reduce kernel): each block sums
// squares over a grid-stride range in f32 and writes its partial; the last block to arrive (a fence,
// then a counter) sums the partials in block order, writes √ to out[0] and resets the counter to 0
// for the next launch. Launch at most 1024 blocks (the partials buffer).
#define GRAD_NORM_EAGER(G, sfx, load_g)                                                                   \
extern "C" __global__ void grad_norm_eager_##sfx(const G* g, long n, float* partial, unsigned* counter,   \
                                                 float* out) {                                            \
    __shared__ bool last;                                                                                 \
    float acc = 0.f;                                                                                      \
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) { \
        float x = load_g(g[i]);                                                                           \
        acc += x * x;                                                                                     \
    }                                                                                                     \
    acc = opt_block_sum(acc);                                                                             \
    if (threadIdx.x == 0) {                                                                               \
        partial[blockIdx.x] = acc;                                                                        \
        __threadfence();                                                                                  \
        last = atomicAdd(counter, 1u) == gridDim.x - 1;                                                   \
    }                                                                                                     \
    __syncthreads();                                                                                      \
    if (!last) return;                                                                                    \
    __threadfence();                                                                                      \
    float total = 0.f;                                                                                    \
    for (long b = threadIdx.x; b < gridDim.x; b += blockDim.x) total += ((volatile float*)partial)[b];    \
    total = opt_block_sum(total);                                                                         \
    if (threadIdx.x == 0) { out[0] = sqrtf(total); *counter = 0u; }                                       \
}
GRAD_NORM_EAGER(bits16, bf16, bf16_to_f32)
GRAD_NORM_EAGER(bits16, f16, f16_to_f32)
GRAD_NORM_EAGER(float, f32, f32_to_f32)

// max_norm / (total + 1e-6) as eager divides a Python scalar by a tensor: reciprocal, then mul.
ELEMENTWISE(clip_eager_reciprocal_f32, (const float* x, float* y, long n), y[i] = 1.f / x[i])
ELEMENTWISE(clip_eager_mul_scalar_f32, (const float* x, float s, float* y, long n), y[i] = x[i] * s)
// torch.clamp(coef, max=1.0)
ELEMENTWISE(clip_eager_clamp_max_f32, (const float* x, float hi, float* y, long n), y[i] = fminf(x[i], hi))
// g.mul_(clip_coef_clamped), per tensor
ELEMENTWISE(clip_eager_mul_bf16, (bits16* g, const float* c, long n), g[i] = f32_to_bf16(bf16_to_f32(g[i]) * c[0]))
ELEMENTWISE(clip_eager_mul_f16, (bits16* g, const float* c, long n), g[i] = f32_to_f16(f16_to_f32(g[i]) * c[0]))
ELEMENTWISE(clip_eager_mul_f32, (float* g, const float* c, long n), g[i] = g[i] * c[0])
