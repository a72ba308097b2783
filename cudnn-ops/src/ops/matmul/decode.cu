// ---- Decode GEMV: D[m, n] = epilogue(x[m, k] · W[n, k]ᵀ) for a few tokens, streaming W once. ----

// A decode step's Linear layers read every weight once and do two flops per weight element per token:
// they are memory bound, and this kernel streams W at close to copy bandwidth (decode.rs). Each warp
// owns R rows of W (R outputs per token) at a time; lane l reads the 16-byte chunks l, l + 32, ... of
// each row (a warp load covers 512 contiguous bytes of a row), U chunks of each row in flight before the
// first is used, W past L1 (each element is read once). The M tokens of x (rows ldx elements apart;
// the rows from m to M repeat row m - 1 and are never written) are read through L1, which the warps of
// an SM share, once per chunk for all R rows. f32 accumulation, a butterfly sum across the warp, then
// lane r·M + t applies the epilogue of row r, token t in f32 and rounds once, as the fused graph does:
// D = ((acc + bias) -> act) * up + res, each step only when its pointer is non-null (act: 0 none,
// 1 silu, 2 gelu, 3 gelu_tanh, 4 relu; decode.rs `activation_code`). D, up and res are packed [m, n].
// k is a multiple of 8; x and W are 16-byte aligned and so are their row strides (checked by decode.rs).
// W is 16-bit (the I/O dtype) or FP8 codes (`GemvW8`: 16 per chunk, k a multiple of 16) with f32
// dequantization factors `ws` (row r's at ws[r · wsr]: wsr 1 per output channel, 0 for one factor)
// multiplying each row's sum before the epilogue, as the FP8 GEMM's scale multiply does.

// The 16-byte loads and the dtype unpacking are in kernels/common.cu (the FP8 GEMV of
// ops/scaled_matmul reads W and x the same way).

// The epilogue's activation (the functions of matmul/naive.cu).
__device__ __forceinline__ float gemv_activation(int act, float v) {
    switch (act) {
        case 1: return epi_silu(v);
        case 2: return epi_gelu(v);
        case 3: return epi_gelu_tanh(v);
        case 4: return epi_relu(v);
        default: return v;
    }
}

// Chunks c, c + S, ..., c + S (V - 1) of the R rows ws (S: the threads that share a row, a warp or a
// block), every load issued before any is used.
template <int R, int V, int S>
__device__ __forceinline__ void gemv_load(const uint4* const (&ws)[R], int c, uint4 (&wv)[V][R]) {
#pragma unroll
    for (int v = 0; v < V; ++v)
#pragma unroll
        for (int r = 0; r < R; ++r) wv[v][r] = gemv_stream16(ws[r] + c + S * v);
}

// Chunks c, c + S, ..., c + S (V - 1) of the R rows ws against the M tokens xs (S: the threads that
// share a row, a warp or a block): every load of W first, then per 8 elements of a chunk one load of
// each token's x (through L1) and the R·M dot products of 8, each added to its accumulator (V·R·M
// independent chains). A chunk of W holds W::E elements: x chunk c·E/8 + j holds its j-th 8.
template <class D, class W, int M, int R, int V, int S = 32>
__device__ __forceinline__ void gemv_step(const uint4* const (&ws)[R], const uint4* const (&xs)[M], int c,
                                          float (&acc)[R][M]) {
    constexpr int XC = W::E / 8;
    uint4 wv[V][R];
    gemv_load<R, V, S>(ws, c, wv);
#pragma unroll
    for (int v = 0; v < V; ++v) {
#pragma unroll
        for (int j = 0; j < XC; ++j) {
            float wf[R][8];
#pragma unroll
            for (int r = 0; r < R; ++r) W::unpack8(wv[v][r], j, wf[r]);
#pragma unroll
            for (int t = 0; t < M; ++t) {
                float xf[8];
                gemv_unpack8<D>(gemv_cached16(xs[t] + (c + S * v) * XC + j), xf);
#pragma unroll
                for (int r = 0; r < R; ++r) acc[r][t] += gemv_dot8(wf[r], xf);
            }
        }
    }
}

// Programmatic dependent launch (decode.rs; `pdl_wait`, `prefetch_l2` in common.cu): before waiting for the kernel
// before it, a GEMV prefetches the chunks c, c + S, ... below `upto` of each of its first rows into L2
// (W does not come from the previous kernel in a decoder, and a prefetch is right even if it did: L2
// is where every SM's writes land, and nothing enters a register or L1 before the wait), then waits.
// Each GEMV calls this once, before it reads x or writes D. It lets the next kernel launch
// (`pdl_launch_dependents`) once its first row group's loads are all issued, so the next GEMV's
// blocks take the SMs this one's last blocks leave and prefetch while those drain, not earlier
// (prefetched lines would be evicted by the rest of this kernel's stream).
template <int R>
__device__ __forceinline__ void gemv_prefetch_then_wait(const uint4* const (&ws)[R], int c, int S, int upto) {
#pragma unroll
    for (int r = 0; r < R; ++r)
        for (int i = c; i < upto; i += S) prefetch_l2(ws[r] + i);
    pdl_wait();
}

// Warps stride over groups of R rows (one group each when the grid has a warp per group). With
// `trigger` 0 the GEMV never lets the next kernel start early (decode.rs `before_collective`).
template <class D, class W, int M, int R, int U>
__device__ __forceinline__ void gemv(const bits16* x, long ldx, const typename W::T* w, long ldw,
                                     const float* wsc, int wsr, int m, int k, int n, const bits16* bias,
                                     int act, const bits16* up, const bits16* res, bits16* y, int trigger) {
    const int lane = threadIdx.x & 31, chunks = k / W::E;
    const long warps = ((long)gridDim.x * blockDim.x) >> 5;
    const uint4* xs[M];
#pragma unroll
    for (int t = 0; t < M; ++t) xs[t] = (const uint4*)(x + (long)min(t, m - 1) * ldx);
    const long first = (((long)blockIdx.x * blockDim.x + threadIdx.x) >> 5) * R;
    {
        const uint4* ws[R];
#pragma unroll
        for (int r = 0; r < R; ++r) ws[r] = (const uint4*)(w + min(first + r, (long)n - 1) * ldw);
        gemv_prefetch_then_wait<R>(ws, lane, 32, first < n ? min(chunks, 32 * U) : 0);
    }
    for (long row0 = first; row0 < n; row0 += warps * R) {
        const uint4* ws[R];
#pragma unroll
        for (int r = 0; r < R; ++r) ws[r] = (const uint4*)(w + (row0 + r < n ? row0 + r : n - 1) * ldw);
        float acc[R][M];
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int t = 0; t < M; ++t) acc[r][t] = 0.0f;
        int c = lane;
        for (; c + 32 * (U - 1) < chunks; c += 32 * U) gemv_step<D, W, M, R, U>(ws, xs, c, acc);
        for (; c < chunks; c += 32) gemv_step<D, W, M, R, 1>(ws, xs, c, acc);
        if (trigger && row0 == first) pdl_launch_dependents();
        float v = gemv_warp_sums<R, M>(acc, lane);
        const int r = lane / M, t = lane - r * M;
        const long row = row0 + r;
        if (lane < R * M && row < n && t < m) {
            const long at = (long)t * n + row;
            if (wsc) v *= wsc[row * wsr];
            if (bias) v += D::load(bias[row]);
            v = gemv_activation(act, v);
            if (up) v *= D::load(up[at]);
            if (res) v += D::load(res[at]);
            y[at] = D::store(v);
        }
    }
}

// gemv_<dtype>[_<fp8 weight>]_m<M>: tokens tile M (m <= M), R rows per warp, U chunks per row in
// flight; blocks of 128 threads (decode.rs `BLOCK` and `TILES`). `sfx` names x's dtype and W's format
// (`bf16` for bf16 weights, `bf16_e4m3` for E4M3 codes).
#define GEMV_KERNEL_NAMED(name, D, W, M, R, U)                                                             \
extern "C" __global__ void __launch_bounds__(128) name(                                                    \
        const bits16* x, long ldx, const typename W::T* w, long ldw, const float* wsc, long wsr, long m,   \
        long k, long n, const bits16* bias, long act, const bits16* up, const bits16* res, bits16* y,      \
        long trigger) {                                                                                    \
    gemv<D, W, M, R, U>(x, ldx, w, ldw, wsc, (int)wsr, (int)m, (int)k, (int)n, bias, (int)act, up, res, y, \
                        (int)trigger);                                                                     \
}
#define GEMV_KERNEL(sfx, D, W, M, R, U) GEMV_KERNEL_NAMED(gemv_##sfx##_m##M, D, W, M, R, U)
// gemv_<dtype>[_<fp8 weight>]_m1_u<U>: the one-token tile with U chunks of each row in flight instead
// of 3 (decode.rs `LONG_ROWS`).
#define GEMV_KERNEL_U(sfx, D, W, U) GEMV_KERNEL_NAMED(gemv_##sfx##_m1_u##U, D, W, 1, 1, U)
#define GEMV_TILES(sfx, D, W)                                                                             \
    GEMV_KERNEL(sfx, D, W, 1, 1, 3)                                                                       \
    GEMV_KERNEL_U(sfx, D, W, 2)                                                                           \
    GEMV_KERNEL(sfx, D, W, 2, 2, 4)                                                                       \
    GEMV_KERNEL(sfx, D, W, 4, 2, 4)                                                                       \
    GEMV_KERNEL(sfx, D, W, 8, 4, 2)
GEMV_TILES(bf16, GemvBf16, GemvW16<GemvBf16>)
GEMV_TILES(f16, GemvF16, GemvW16<GemvF16>)
GEMV_TILES(bf16_e4m3, GemvBf16, GemvW8<0>)
GEMV_TILES(bf16_e5m2, GemvBf16, GemvW8<1>)
GEMV_TILES(f16_e4m3, GemvF16, GemvW8<0>)
GEMV_TILES(f16_e5m2, GemvF16, GemvW8<1>)

// ---- The one-token GEMV with its input's RMSNorm and/or the SwiGLU's up projection fused. ----

// Two forms of a decode step's projections in one launch each (decode.rs `Gemv::norm`, `Gemv::dual`):
// - NORM (the prenorm before qkv_proj, or before the MLP's gate and up): y = inv · Σ_j W[j] · (x[j] ·
//   norm_w[j]) with inv = rsqrt(mean(x²) + ε), a scalar of the token, so it multiplies the sums at the
//   end instead of x at the start: the lanes read x and norm_w per chunk through L1 beside W's chunk,
//   and while a warp (or block) streams its first row group it also sums x² over the chunks it reads,
//   which together cover the row; no pass over x, no barrier and no shared memory before W streams.
//   f32 throughout, one rounding at the end (the normalized row is not rounded to the I/O dtype in
//   between, as the RMSNorm graph writing it would).
// - DUAL (the SwiGLU's gate and up): each warp streams the rows `row` of both W (the gate) and W_up
//   (the same layout), and the epilogue's gate multiplier is U = round(x · W_upᵀ) (rounded to the I/O
//   dtype as the up projection's output would be) instead of a buffer.
// One token; warps own R rows of W (and of W_up), U chunks of each in flight; blocks of 128 threads.

// NORM: chunks c, c + S, ..., c + S (V - 1) of the RW rows ws against x · norm_w (S: the threads
// that share a row, a warp or a block); with `want_ss` also the sum of x² over those chunks into ss.
template <class D, class W, int RW, int V, int S>
__device__ __forceinline__ void gemv_norm_step(const uint4* const (&ws)[RW], const uint4* xg, const uint4* gg,
                                               int c, float (&acc)[RW][1], float& ss, bool want_ss) {
    constexpr int XC = W::E / 8;
    uint4 wv[V][RW];
    gemv_load<RW, V, S>(ws, c, wv);
#pragma unroll
    for (int v = 0; v < V; ++v) {
#pragma unroll
        for (int j = 0; j < XC; ++j) {
            const int at = (c + S * v) * XC + j;
            float xf[8], gf[8];
            gemv_unpack8<D>(gemv_cached16(xg + at), xf);
            gemv_unpack8<D>(gemv_cached16(gg + at), gf);
            if (want_ss) {
#pragma unroll
                for (int e = 0; e < 8; ++e) ss = fmaf(xf[e], xf[e], ss);
            }
#pragma unroll
            for (int e = 0; e < 8; ++e) xf[e] *= gf[e];
#pragma unroll
            for (int r = 0; r < RW; ++r) {
                float wf[8];
                W::unpack8(wv[v][r], j, wf);
                acc[r][0] += gemv_dot8(wf, xf);
            }
        }
    }
}

// The chunks from `c` on of the RW rows ws, S threads sharing a row, U chunks of each in flight,
// then one at a time: against x · norm_w (summing x² into ss with `want_ss`) with NORM, else x.
template <class D, class W, int RW, int U, int S, bool NORM>
__device__ __forceinline__ void gemv_row_sums(const uint4* const (&ws)[RW], const bits16* x, const bits16* norm_w,
                                              int c, int chunks, float (&acc)[RW][1], float& ss, bool want_ss) {
    if (NORM) {
        const uint4 *xg = (const uint4*)x, *gg = (const uint4*)norm_w;
        for (; c + S * (U - 1) < chunks; c += S * U)
            gemv_norm_step<D, W, RW, U, S>(ws, xg, gg, c, acc, ss, want_ss);
        for (; c < chunks; c += S) gemv_norm_step<D, W, RW, 1, S>(ws, xg, gg, c, acc, ss, want_ss);
    } else {
        const uint4* const xs[1] = {(const uint4*)x};
        for (; c + S * (U - 1) < chunks; c += S * U) gemv_step<D, W, 1, RW, U, S>(ws, xs, c, acc);
        for (; c < chunks; c += S) gemv_step<D, W, 1, RW, 1, S>(ws, xs, c, acc);
    }
}

// ROPE (qkv_proj in a decode step): the output row is a token's Q, K and V heads of `d` elements;
// each warp owns the pair of rows (h·d + j, h·d + j + d/2) of head h, rounds both sums as the
// projection's output, rotates them by position `*pos` (cos/sin of `[positions, d / 2]`, f32, one
// rounding, as rope_append does) in the Q and K heads, writes them to y, and writes K and V heads
// also to row `*pos` of the caches `[max_seq, h_kv · d]`. A position outside the tables or the cache
// leaves the row unrotated and the caches untouched (as rope_append).
struct GemvRope {
    const float* cos;
    const float* sin;
    long positions;
    const int* pos;
    bits16* kc;
    bits16* vc;
    long max_seq;
    int heads_q, heads_kv, dim;
};

// Row pair g of a ROPE GEMV (sums a, b of rows h·d + j and h·d + j + d/2, before the bias): rounds
// them as the projection's output, rotates Q and K heads, writes y and, for K and V heads, the caches.
template <class D>
__device__ __forceinline__ void gemv_rope_pair(const GemvRope& rope, long g, int half, float a, float b,
                                               const bits16* bias, bits16* y) {
    const int h = (int)(g / half), j = (int)(g % half);
    const long r0 = (long)h * 2 * half + j, r1 = r0 + half;
    if (bias) {
        a += D::load(bias[r0]);
        b += D::load(bias[r1]);
    }
    a = D::load(D::store(a));
    b = D::load(D::store(b));
    const long pos = *rope.pos;
    const bool in = pos >= 0 && pos < rope.positions && pos < rope.max_seq;
    const bool rotated = h < rope.heads_q + rope.heads_kv;
    float lo = a, hi = b;
    if (in && rotated) {
        const float c = rope.cos[pos * half + j], sn = rope.sin[pos * half + j];
        lo = a * c - b * sn;
        hi = b * c + a * sn;
    }
    const bits16 slo = D::store(lo), shi = D::store(hi);
    y[r0] = slo;
    y[r1] = shi;
    if (in && h >= rope.heads_q) {
        const int hh = rotated ? h - rope.heads_q : h - rope.heads_q - rope.heads_kv;
        bits16* cache = rotated ? rope.kc : rope.vc;
        const long at = pos * (long)rope.heads_kv * rope.dim + (long)hh * rope.dim + j;
        cache[at] = slo;
        cache[at + half] = shi;
    }
}

// The row of W that slot r of row group g reads: g·R + r, or with ROPE (R = 2) row j and j + d/2 of
// head h, for g = h·(d/2) + j.
template <int R, bool ROPE>
__device__ __forceinline__ long gemv_group_row(long g, int r, int half) {
    if (ROPE) return (g / half) * 2 * half + g % half + r * half;
    return g * R + r;
}

template <class D, class W, int R, int U, bool NORM, bool DUAL, bool ROPE = false>
__device__ __forceinline__ void gemv_fused(const bits16* x, const bits16* norm_w, float eps,
                                           const typename W::T* w, const typename W::T* w_up, long ldw,
                                           const float* wsc, const float* usc, int wsr, int k, int n,
                                           const bits16* bias, int act, const bits16* up, const bits16* res,
                                           bits16* y, GemvRope rope = {}) {
    constexpr int RW = DUAL ? 2 * R : R;  // rows streamed per warp: W's, then W_up's
    const int lane = threadIdx.x & 31, chunks = k / W::E, half = ROPE ? rope.dim / 2 : 1;
    const long warps = ((long)gridDim.x * blockDim.x) >> 5;
    const long groups = ROPE ? n / 2 : (n + R - 1) / R;
    const long first = ((long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    // Row slot r of group g, clamped into W (the group past the last row reads the last row, unused).
    auto row_of = [&](long g, int r) { return min(gemv_group_row<R, ROPE>(g, r, half), (long)n - 1); };
    {
        const uint4* ws[RW];
#pragma unroll
        for (int r = 0; r < RW; ++r) ws[r] = (const uint4*)((DUAL && r >= R ? w_up : w) + row_of(first, r % R) * ldw);
        gemv_prefetch_then_wait<RW>(ws, lane, 32, first < groups ? min(chunks, 32 * U) : 0);
    }
    float inv = 1.0f;  // NORM: rsqrt(mean(x²) + ε), from the first row group on
    for (long g = first; g < groups; g += warps) {
        const uint4* ws[RW];
#pragma unroll
        for (int r = 0; r < RW; ++r) ws[r] = (const uint4*)((DUAL && r >= R ? w_up : w) + row_of(g, r % R) * ldw);
        float acc[RW][1];
#pragma unroll
        for (int r = 0; r < RW; ++r) acc[r][0] = 0.0f;
        const bool want_ss = NORM && g == first;
        float ss = 0.0f;
        gemv_row_sums<D, W, RW, U, 32, NORM>(ws, x, norm_w, lane, chunks, acc, ss, want_ss);
        if (g == first) pdl_launch_dependents();
        if (want_ss) {
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
            inv = rsqrtf(ss / (float)k + eps);
        }
        float v = 0.0f, u = 0.0f;
#pragma unroll
        for (int r = 0; r < RW; ++r) {
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) acc[r][0] += __shfl_xor_sync(0xffffffffu, acc[r][0], o);
            if (lane == r) v = acc[r][0] * inv;
            if (DUAL && lane == r - R) u = acc[r][0] * inv;
        }
        if (ROPE) {
            // Every lane holds both sums; lane 0 writes the pair.
            if (lane == 0) {
                float a = acc[0][0] * inv, b = acc[1][0] * inv;
                if (wsc) {
                    a *= wsc[gemv_group_row<R, ROPE>(g, 0, half) * wsr];
                    b *= wsc[gemv_group_row<R, ROPE>(g, 1, half) * wsr];
                }
                gemv_rope_pair<D>(rope, g, half, a, b, bias, y);
            }
            continue;
        }
        const long row = g * R + lane;
        if (lane < R && row < n) {
            if (wsc) v *= wsc[row * wsr];
            if (DUAL && usc) u *= usc[row * wsr];
            if (bias) v += D::load(bias[row]);
            v = gemv_activation(act, v);
            if (DUAL) v *= D::load(D::store(u));
            else if (up) v *= D::load(up[row]);
            if (res) v += D::load(res[row]);
            y[row] = D::store(v);
        }
    }
}

// The fused and block forms' arguments: x, the prologue's norm weight and ε, W and W_up (16-bit or FP8
// codes with their factors wsc and usc, wsr apart), the shape, the epilogue's inputs and D.
#define GEMV_FORM_PARAMS(W)                                                                                \
        const bits16* x, const bits16* norm_w, float eps, const typename W::T* w, const typename W::T* w_up, \
        long ldw, const float* wsc, const float* usc, long wsr, long k, long n, const bits16* bias, long act, \
        const bits16* up, const bits16* res, bits16* y
#define GEMV_FORM_ARGS \
    x, norm_w, eps, w, w_up, ldw, wsc, usc, (int)wsr, (int)k, (int)n, bias, (int)act, up, res, y
// gemv_<dtype>[_<fp8 weight>]_m1_<form>: form norm, dual or norm_dual; R rows of W (and of W_up) per
// warp, U chunks of each in flight (decode.rs `FUSED_TILES`).
#define GEMV_FUSED_KERNEL(sfx, D, W, form, R, U, NORM, DUAL)                                               \
extern "C" __global__ void __launch_bounds__(128) gemv_##sfx##_m1_##form(GEMV_FORM_PARAMS(W)) {            \
    gemv_fused<D, W, R, U, NORM, DUAL>(GEMV_FORM_ARGS);                                                    \
}
// gemv_<dtype>_m1_rope, gemv_<dtype>_m1_norm_rope: qkv_proj with RoPE and the K/V append (ROPE
// above), R = 2 rows (a head's pair) per warp, U chunks of each in flight (decode.rs `FUSED_TILES`;
// the `_u4` forms: `DEEP_ROPE_CHUNKS`, for grids of few row pairs per SM).
#define GEMV_ROPE_KERNEL(sfx, D, W, form, R, U, NORM)                                                      \
extern "C" __global__ void __launch_bounds__(128) gemv_##sfx##_m1_##form(                                  \
        GEMV_FORM_PARAMS(W), const float* cos_t, const float* sin_t, long positions, const int* pos,       \
        bits16* kc, bits16* vc, long max_seq, long heads_q, long heads_kv, long dim) {                     \
    const GemvRope rope = {cos_t, sin_t, positions, pos, kc, vc, max_seq, (int)heads_q, (int)heads_kv,     \
                           (int)dim};                                                                      \
    gemv_fused<D, W, R, U, NORM, false, true>(GEMV_FORM_ARGS, rope);                                       \
}
#define GEMV_FUSED(sfx, D, W)                                                                             \
    GEMV_FUSED_KERNEL(sfx, D, W, norm, 2, 1, true, false)                                                 \
    GEMV_FUSED_KERNEL(sfx, D, W, dual, 1, 4, false, true)                                                 \
    GEMV_FUSED_KERNEL(sfx, D, W, norm_dual, 2, 1, true, true)                                             \
    GEMV_ROPE_KERNEL(sfx, D, W, rope, 2, 2, false)                                                        \
    GEMV_ROPE_KERNEL(sfx, D, W, norm_rope, 2, 2, true)                                                    \
    GEMV_ROPE_KERNEL(sfx, D, W, rope_u4, 2, 4, false)                                                     \
    GEMV_ROPE_KERNEL(sfx, D, W, norm_rope_u4, 2, 4, true)
GEMV_FUSED(bf16, GemvBf16, GemvW16<GemvBf16>)
GEMV_FUSED(f16, GemvF16, GemvW16<GemvF16>)
// FP8 weights take the fused forms in E4M3 (the weights' format; E5M2 is the gradients').
GEMV_FUSED(bf16_e4m3, GemvBf16, GemvW8<0>)
GEMV_FUSED(f16_e4m3, GemvF16, GemvW8<0>)

// ---- The one-token GEMV with a block per row group: for the smaller projections. ----

// The forms above with the k chunks of each row shared by a block's 128 threads instead of a warp's
// 32 (decode.rs `Split::Block`): thread i reads the chunks i, i + 128, ... of the block's R rows (and
// of W_up's), so a row of a few thousand elements is one round of U loads per thread instead of
// several per lane, and the grid has a block per R rows (several blocks per SM slot where the warp form
// would run one wave and a fraction: qkv and o_proj of an 8B model). The warps' sums (and with NORM
// their sums of x² over the first row group) meet in shared memory; thread r < R writes row r's output
// with the epilogue. The rows a block owns are the same for all its threads, so every barrier is
// reached by the whole block.
#define GEMV_WARPS 4
template <class D, class W, int R, int U, bool NORM, bool DUAL>
__device__ __forceinline__ void gemv_block(const bits16* x, const bits16* norm_w, float eps,
                                           const typename W::T* w, const typename W::T* w_up, long ldw,
                                           const float* wsc, const float* usc, int wsr, int k, int n,
                                           const bits16* bias, int act, const bits16* up, const bits16* res,
                                           bits16* y) {
    constexpr int RW = DUAL ? 2 * R : R;
    constexpr int S = 32 * GEMV_WARPS;
    __shared__ float part[GEMV_WARPS][RW + 1];  // the warps' row sums, then (NORM) their sums of x²
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, chunks = k / W::E;
    const long first = (long)blockIdx.x * R;
    float inv = 1.0f;  // NORM: rsqrt(mean(x²) + ε), from the first row group on
    for (long row0 = first; row0 < n; row0 += (long)gridDim.x * R) {
        const uint4* ws[RW];
#pragma unroll
        for (int r = 0; r < RW; ++r) {
            const long row = row0 + (r % R) < n ? row0 + (r % R) : n - 1;
            ws[r] = (const uint4*)((DUAL && r >= R ? w_up : w) + row * ldw);
        }
        if (row0 == first) gemv_prefetch_then_wait<RW>(ws, tid, S, min(chunks, S * U));
        float acc[RW][1];
#pragma unroll
        for (int r = 0; r < RW; ++r) acc[r][0] = 0.0f;
        const bool want_ss = NORM && row0 == first;
        float ss = 0.0f;
        gemv_row_sums<D, W, RW, U, S, NORM>(ws, x, norm_w, tid, chunks, acc, ss, want_ss);
        if (row0 == first) pdl_launch_dependents();
#pragma unroll
        for (int r = 0; r < RW; ++r) {
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) acc[r][0] += __shfl_xor_sync(0xffffffffu, acc[r][0], o);
            if (lane == 0) part[warp][r] = acc[r][0];
        }
        if (want_ss) {
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
            if (lane == 0) part[warp][RW] = ss;
        }
        __syncthreads();
        if (want_ss) {
            float sum = 0.0f;
#pragma unroll
            for (int i = 0; i < GEMV_WARPS; ++i) sum += part[i][RW];
            inv = rsqrtf(sum / (float)k + eps);
        }
        const long row = row0 + tid;
        if (tid < R && row < n) {
            float v = 0.0f, u = 0.0f;
#pragma unroll
            for (int i = 0; i < GEMV_WARPS; ++i) {
                v += part[i][tid];
                if (DUAL) u += part[i][R + tid];
            }
            v *= inv;
            u *= inv;
            if (wsc) v *= wsc[row * wsr];
            if (DUAL && usc) u *= usc[row * wsr];
            if (bias) v += D::load(bias[row]);
            v = gemv_activation(act, v);
            if (DUAL) v *= D::load(D::store(u));
            else if (up) v *= D::load(up[row]);
            if (res) v += D::load(res[row]);
            y[row] = D::store(v);
        }
        __syncthreads();
    }
}

// gemv_<dtype>_m1[_<form>]_block: the plain one-token GEMV or a fused form (norm, dual, norm_dual) with
// a block of 4 warps per R rows (and R rows of W_up), U chunks of each per thread in flight (decode.rs
// `BLOCK_TILES`).
#define GEMV_BLOCK_KERNEL(name, D, W, R, U, NORM, DUAL)                                                    \
extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS) name(GEMV_FORM_PARAMS(W)) {                  \
    gemv_block<D, W, R, U, NORM, DUAL>(GEMV_FORM_ARGS);                                                    \
}
#define GEMV_BLOCKS(sfx, D, W)                                                                            \
    GEMV_BLOCK_KERNEL(gemv_##sfx##_m1_block, D, W, 2, 4, false, false)                                    \
    GEMV_BLOCK_KERNEL(gemv_##sfx##_m1_norm_block, D, W, 2, 4, true, false)                                \
    GEMV_BLOCK_KERNEL(gemv_##sfx##_m1_dual_block, D, W, 1, 4, false, true)                                \
    GEMV_BLOCK_KERNEL(gemv_##sfx##_m1_norm_dual_block, D, W, 1, 4, true, true)
// (16-bit weights only: the block split is an A/B option, Gemv::with_split.)
GEMV_BLOCKS(bf16, GemvBf16, GemvW16<GemvBf16>)
GEMV_BLOCKS(f16, GemvF16, GemvW16<GemvF16>)
