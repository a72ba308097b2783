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

// 16 bytes of W, not kept in L1.
__device__ __forceinline__ uint4 gemv_stream16(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// 16 bytes of x, kept in L1 for the other warps of the SM.
__device__ __forceinline__ uint4 gemv_cached16(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// The dtypes: two elements of a 32-bit word (the lower one first) in f32, and one element of D, bias,
// up or res to and from f32.
struct GemvBf16 {
    static __device__ __forceinline__ void unpack(unsigned u, float& lo, float& hi) {
        lo = __uint_as_float(u << 16);
        hi = __uint_as_float(u & 0xffff0000u);
    }
    static __device__ __forceinline__ float load(bits16 v) { return bf16_to_f32(v); }
    static __device__ __forceinline__ bits16 store(float f) { return f32_to_bf16(f); }
};
struct GemvF16 {
    static __device__ __forceinline__ void unpack(unsigned u, float& lo, float& hi) {
        lo = f16_to_f32((bits16)(u & 0xffffu));
        hi = f16_to_f32((bits16)(u >> 16));
    }
    static __device__ __forceinline__ float load(bits16 v) { return f16_to_f32(v); }
    static __device__ __forceinline__ bits16 store(float f) { return f32_to_f16(f); }
};

// The 8 elements of a chunk in f32.
template <class D>
__device__ __forceinline__ void gemv_unpack8(uint4 v, float (&f)[8]) {
    D::unpack(v.x, f[0], f[1]);
    D::unpack(v.y, f[2], f[3]);
    D::unpack(v.z, f[4], f[5]);
    D::unpack(v.w, f[6], f[7]);
}

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

// Chunks c, c + 32, ..., c + 32 (V - 1) of the R rows ws against the M tokens xs: every load of W
// first, then per chunk one load of each token's x and the R·M dot products of 8, each added to its
// accumulator (V·R·M independent chains).
template <class D, int M, int R, int V>
__device__ __forceinline__ void gemv_step(const uint4* const (&ws)[R], const uint4* const (&xs)[M], int c,
                                          float (&acc)[R][M]) {
    uint4 wv[V][R];
#pragma unroll
    for (int v = 0; v < V; ++v)
#pragma unroll
        for (int r = 0; r < R; ++r) wv[v][r] = gemv_stream16(ws[r] + c + 32 * v);
#pragma unroll
    for (int v = 0; v < V; ++v) {
        float wf[R][8];
#pragma unroll
        for (int r = 0; r < R; ++r) gemv_unpack8<D>(wv[v][r], wf[r]);
#pragma unroll
        for (int t = 0; t < M; ++t) {
            float xf[8];
            gemv_unpack8<D>(gemv_cached16(xs[t] + c + 32 * v), xf);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                float dot = wf[r][0] * xf[0];
#pragma unroll
                for (int e = 1; e < 8; ++e) dot = fmaf(wf[r][e], xf[e], dot);
                acc[r][t] += dot;
            }
        }
    }
}

// Warps stride over groups of R rows (one group each when the grid has a warp per group).
template <class D, int M, int R, int U>
__device__ __forceinline__ void gemv(const bits16* x, long ldx, const bits16* w, long ldw, int m, int k, int n,
                                     const bits16* bias, int act, const bits16* up, const bits16* res,
                                     bits16* y) {
    const int lane = threadIdx.x & 31, chunks = k >> 3;
    const long warps = ((long)gridDim.x * blockDim.x) >> 5;
    const uint4* xs[M];
#pragma unroll
    for (int t = 0; t < M; ++t) xs[t] = (const uint4*)(x + (long)min(t, m - 1) * ldx);
    for (long row0 = (((long)blockIdx.x * blockDim.x + threadIdx.x) >> 5) * R; row0 < n; row0 += warps * R) {
        const uint4* ws[R];
#pragma unroll
        for (int r = 0; r < R; ++r) ws[r] = (const uint4*)(w + (row0 + r < n ? row0 + r : n - 1) * ldw);
        float acc[R][M];
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int t = 0; t < M; ++t) acc[r][t] = 0.0f;
        int c = lane;
        for (; c + 32 * (U - 1) < chunks; c += 32 * U) gemv_step<D, M, R, U>(ws, xs, c, acc);
        for (; c < chunks; c += 32) gemv_step<D, M, R, 1>(ws, xs, c, acc);
        float v = 0.0f;
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int t = 0; t < M; ++t) {
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) acc[r][t] += __shfl_xor_sync(0xffffffffu, acc[r][t], o);
                if (lane == r * M + t) v = acc[r][t];
            }
        const int r = lane / M, t = lane - r * M;
        const long row = row0 + r;
        if (lane < R * M && row < n && t < m) {
            const long at = (long)t * n + row;
            if (bias) v += D::load(bias[row]);
            v = gemv_activation(act, v);
            if (up) v *= D::load(up[at]);
            if (res) v += D::load(res[at]);
            y[at] = D::store(v);
        }
    }
}

// gemv_<dtype>_m<M>: tokens tile M (m <= M), R rows per warp, U chunks per row in flight; blocks of 128
// threads (decode.rs `BLOCK` and `TILES`).
#define GEMV_KERNEL(sfx, D, M, R, U)                                                                      \
extern "C" __global__ void __launch_bounds__(128) gemv_##sfx##_m##M(                                      \
        const bits16* x, long ldx, const bits16* w, long ldw, long m, long k, long n, const bits16* bias, \
        long act, const bits16* up, const bits16* res, bits16* y) {                                       \
    gemv<D, M, R, U>(x, ldx, w, ldw, (int)m, (int)k, (int)n, bias, (int)act, up, res, y);                 \
}
#define GEMV_TILES(sfx, D)                                                                                \
    GEMV_KERNEL(sfx, D, 1, 1, 8)                                                                          \
    GEMV_KERNEL(sfx, D, 2, 2, 4)                                                                          \
    GEMV_KERNEL(sfx, D, 4, 2, 4)                                                                          \
    GEMV_KERNEL(sfx, D, 8, 4, 2)
GEMV_TILES(bf16, GemvBf16)
GEMV_TILES(f16, GemvF16)
