// ---- Greedy decoding on the device: the argmax of each logits row (ops/argmax). ----

// The pick word of a row (ops/argmax/mod.rs `Pick`): the id of the largest logit, the lowest such id
// on ties, below 2^30; ARGMAX_BROKEN | id for a NaN at the first bad id, ARGMAX_BROKEN | ARGMAX_INF | id
// for +inf there; ARGMAX_MASKED when every logit is -inf.
#define ARGMAX_BROKEN 0x80000000u
#define ARGMAX_INF 0x40000000u
#define ARGMAX_MASKED 0xffffffffu
#define ARGMAX_NEG_INF __int_as_float(0xff800000)
#define ARGMAX_POS_INF __int_as_float(0x7f800000)

// (v, j) beats (best, at): larger, or equal at a lower id. NaN beats nothing and nothing beats it
// (it only flags the row); -inf == -inf, so a row of -inf keeps its first id.
__device__ __forceinline__ void argmax_take(float& best, long& at, float v, long j) {
    if (v > best || (v == best && j < at)) { best = v; at = j; }
}

// One block per row of `vocab` logits (`stride` elements apart), f32 compares on the exact f32 value
// of each element. Each thread scans its strided share keeping its best (value, id) and its first
// NaN or +inf id; the block combines them (a total order on (value, id), so the result does not
// depend on the thread count). Writes picks[r], and ids[r] (may be null: e.g. the next decode step's
// input ids) = the argmax, a valid id even for a broken row (0 for a row of -inf).
#define ARGMAX(T, sfx, load)                                                                              \
extern "C" __global__ void argmax_##sfx(const T* logits, long vocab, long stride, unsigned* picks,          \
                                        unsigned* ids) {                                                  \
    __shared__ float s_best[32];                                                                          \
    __shared__ long s_at[32], s_bad[32];                                                                  \
    const T* x = logits + (long)blockIdx.x * stride;                                                      \
    float best = ARGMAX_NEG_INF;                                                                          \
    long at = vocab, bad = vocab, j = threadIdx.x;                                                        \
    const long b = blockDim.x;                                                                            \
    for (; j + 7 * b < vocab; j += 8 * b) {                                                               \
        float v[8];                                                                                       \
        _Pragma("unroll") for (int k = 0; k < 8; ++k) v[k] = load(x[j + k * b]);                          \
        _Pragma("unroll") for (int k = 0; k < 8; ++k) {                                                   \
            argmax_take(best, at, v[k], j + k * b);                                                       \
            if ((v[k] != v[k] || v[k] == ARGMAX_POS_INF) && j + k * b < bad) bad = j + k * b;             \
        }                                                                                                 \
    }                                                                                                     \
    for (; j < vocab; j += b) {                                                                           \
        float v = load(x[j]);                                                                             \
        argmax_take(best, at, v, j);                                                                      \
        if ((v != v || v == ARGMAX_POS_INF) && j < bad) bad = j;                                          \
    }                                                                                                     \
    for (int o = 16; o > 0; o >>= 1) {                                                                    \
        float v = __shfl_xor_sync(0xffffffffu, best, o);                                                  \
        long a = __shfl_xor_sync(0xffffffffu, at, o), d = __shfl_xor_sync(0xffffffffu, bad, o);          \
        if (a < vocab) argmax_take(best, at, v, a);                                                       \
        bad = d < bad ? d : bad;                                                                          \
    }                                                                                                     \
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;                  \
    if (lane == 0) { s_best[warp] = best; s_at[warp] = at; s_bad[warp] = bad; }                           \
    __syncthreads();                                                                                      \
    if (warp != 0) return;                                                                                \
    best = lane < warps ? s_best[lane] : ARGMAX_NEG_INF;                                                  \
    at = lane < warps ? s_at[lane] : vocab;                                                               \
    bad = lane < warps ? s_bad[lane] : vocab;                                                             \
    for (int o = 16; o > 0; o >>= 1) {                                                                    \
        float v = __shfl_xor_sync(0xffffffffu, best, o);                                                  \
        long a = __shfl_xor_sync(0xffffffffu, at, o), d = __shfl_xor_sync(0xffffffffu, bad, o);          \
        if (a < vocab) argmax_take(best, at, v, a);                                                       \
        bad = d < bad ? d : bad;                                                                          \
    }                                                                                                     \
    if (lane != 0) return;                                                                                \
    unsigned pick;                                                                                        \
    if (bad < vocab) {                                                                                    \
        float v = load(x[bad]);                                                                           \
        pick = ARGMAX_BROKEN | (v != v ? 0u : ARGMAX_INF) | (unsigned)bad;                                \
    } else if (best == ARGMAX_NEG_INF) {                                                                  \
        pick = ARGMAX_MASKED;                                                                             \
    } else {                                                                                              \
        pick = (unsigned)at;                                                                              \
    }                                                                                                     \
    picks[blockIdx.x] = pick;                                                                             \
    if (ids) ids[blockIdx.x] = at < vocab ? (unsigned)at : 0u;                                            \
}
ARGMAX(bits16, bf16, bf16_to_f32)
ARGMAX(bits16, f16, f16_to_f32)
ARGMAX(float, f32, f32_to_f32)
