// ---- FP8-weight GEMV: y[m, n] = x[m, k] · (W[n, k] · scale[n or 0])ᵀ for a few tokens. ----
// The decode GEMV of ops/matmul/decode.cu over a weight of FP8 codes: half the bytes of a bf16 weight,
// so a memory-bound decode step reads half as much. Each warp owns R rows of W at a time; lane l reads
// the 16-byte chunks l, l + 32, ... of each row (16 codes each, a warp load covering 512 contiguous
// bytes), W past L1; the M tokens of x (bf16 or f16, rows ldx elements apart; tokens m..M repeat
// token m - 1 and are never written) through L1, two 16-byte chunks per W chunk. f32 accumulation, a
// butterfly sum across the warp, then lane r·M + t scales row r, token t by its factor and rounds
// once. k is a multiple of 16; x, W and their row strides are 16-byte aligned (checked by gemv.rs).

// Four FP8 codes (the low byte first) in f32: on sm_89 and later two `cvt.rn.f16x2.{e4m3,e5m2}x2`
// (exact: every FP8 value is an f16), else the exact decoders of common.cu.
template <int E5M2>
__device__ __forceinline__ void f8gemv_unpack4(unsigned u, float* f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned lo, hi;
    if (E5M2) {
        asm("{ .reg .b16 a, b; mov.b32 {a, b}, %2; cvt.rn.f16x2.e5m2x2 %0, a; cvt.rn.f16x2.e5m2x2 %1, b; }"
            : "=r"(lo), "=r"(hi) : "r"(u));
    } else {
        asm("{ .reg .b16 a, b; mov.b32 {a, b}, %2; cvt.rn.f16x2.e4m3x2 %0, a; cvt.rn.f16x2.e4m3x2 %1, b; }"
            : "=r"(lo), "=r"(hi) : "r"(u));
    }
    f[0] = f16_to_f32((bits16)(lo & 0xffffu));
    f[1] = f16_to_f32((bits16)(lo >> 16));
    f[2] = f16_to_f32((bits16)(hi & 0xffffu));
    f[3] = f16_to_f32((bits16)(hi >> 16));
#else
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned char c = (unsigned char)(u >> (8 * i));
        f[i] = E5M2 ? fp8_e5m2_to_f32(c) : fp8_e4m3_to_f32(c);
    }
#endif
}

template <class D, int E5M2, int M, int R>
__device__ __forceinline__ void f8gemv(const bits16* x, long ldx, const unsigned char* w, long ldw,
                                       const float* scale, int per_row, int m, int k, int n, bits16* y) {
    const int lane = threadIdx.x & 31, chunks = k >> 4;
    const long warps = ((long)gridDim.x * blockDim.x) >> 5;
    const uint4* xs[M];
#pragma unroll
    for (int t = 0; t < M; ++t) xs[t] = (const uint4*)(x + (long)min(t, m - 1) * ldx);
    const long first = (((long)blockIdx.x * blockDim.x + threadIdx.x) >> 5) * R;
    for (long row0 = first; row0 < n; row0 += warps * R) {
        const uint4* ws[R];
#pragma unroll
        for (int r = 0; r < R; ++r) ws[r] = (const uint4*)(w + (row0 + r < n ? row0 + r : n - 1) * ldw);
        float acc[R][M];
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int t = 0; t < M; ++t) acc[r][t] = 0.0f;
        for (int c = lane; c < chunks; c += 32) {
            uint4 wv[R];
#pragma unroll
            for (int r = 0; r < R; ++r) wv[r] = gemv_stream16(ws[r] + c);
            float wf[R][16];
#pragma unroll
            for (int r = 0; r < R; ++r) {
                f8gemv_unpack4<E5M2>(wv[r].x, wf[r]);
                f8gemv_unpack4<E5M2>(wv[r].y, wf[r] + 4);
                f8gemv_unpack4<E5M2>(wv[r].z, wf[r] + 8);
                f8gemv_unpack4<E5M2>(wv[r].w, wf[r] + 12);
            }
#pragma unroll
            for (int t = 0; t < M; ++t) {
                float lo[8], hi[8];
                gemv_unpack8<D>(gemv_cached16(xs[t] + 2 * c), lo);
                gemv_unpack8<D>(gemv_cached16(xs[t] + 2 * c + 1), hi);
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    float dot = acc[r][t];
#pragma unroll
                    for (int e = 0; e < 8; ++e) dot = fmaf(wf[r][e], lo[e], dot);
#pragma unroll
                    for (int e = 0; e < 8; ++e) dot = fmaf(wf[r][8 + e], hi[e], dot);
                    acc[r][t] = dot;
                }
            }
        }
        const float v = gemv_warp_sums<R, M>(acc, lane);
        const int r = lane / M, t = lane - r * M;
        const long row = row0 + r;
        if (lane < R * M && row < n && t < m) y[(long)t * n + row] = D::store(v * scale[per_row ? row : 0]);
    }
}

// f8gemv_<x dtype>_<W format>_m<M>: tokens tile M (m <= M), R rows per warp; blocks of 128 threads
// (gemv.rs `BLOCK`).
#define F8GEMV_KERNEL(sfx, D, fmt, E5M2, M, R)                                                            \
extern "C" __global__ void __launch_bounds__(128) f8gemv_##sfx##_##fmt##_m##M(                            \
        const bits16* x, long ldx, const unsigned char* w, long ldw, const float* scale, long per_row,    \
        long m, long k, long n, bits16* y) {                                                              \
    f8gemv<D, E5M2, M, R>(x, ldx, w, ldw, scale, (int)per_row, (int)m, (int)k, (int)n, y);                \
}
#define F8GEMV_TILES(sfx, D, fmt, E5M2)                                                                   \
    F8GEMV_KERNEL(sfx, D, fmt, E5M2, 1, 2)                                                                \
    F8GEMV_KERNEL(sfx, D, fmt, E5M2, 2, 2)                                                                \
    F8GEMV_KERNEL(sfx, D, fmt, E5M2, 4, 2)                                                                \
    F8GEMV_KERNEL(sfx, D, fmt, E5M2, 8, 2)
F8GEMV_TILES(bf16, GemvBf16, e4m3, 0)
F8GEMV_TILES(bf16, GemvBf16, e5m2, 1)
F8GEMV_TILES(f16, GemvF16, e4m3, 0)
F8GEMV_TILES(f16, GemvF16, e5m2, 1)
