// What every op's kernels share: 16-bit element conversions, the ELEMENTWISE launch shape and the
// dtype casts. The NVRTC program is this file followed by each room's .cu (kernels/mod.rs). Kernels
// follow PyTorch eager: one op per launch, f32 intermediates in device memory; self-contained (no
// CUDA headers needed on the target). Each elementwise thread handles ITEMS elements spaced a block
// apart (PyTorch's unrolled loop), so every load instruction of a warp is coalesced.

#define ITEMS 4
typedef unsigned short bits16;

__device__ __forceinline__ float bf16_to_f32(bits16 h) { return __uint_as_float(((unsigned int)h) << 16); }
__device__ __forceinline__ bits16 f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bits16)((u >> 16) | 0x40u);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);                                            // round to nearest even
    return (bits16)(u >> 16);
}
__device__ __forceinline__ float f16_to_f32(bits16 h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ bits16 f32_to_f16(float f) { bits16 h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
__device__ __forceinline__ float f32_to_f32(float f) { return f; }

#define ELEMENTWISE(name, params, ...)                                                   \
extern "C" __global__ void name params {                                                 \
    long base = (long)blockIdx.x * blockDim.x * ITEMS + threadIdx.x;                     \
    _Pragma("unroll")                                                                    \
    for (int k = 0; k < ITEMS; ++k) {                                                    \
        long i = base + (long)k * blockDim.x;                                            \
        if (i < n) { __VA_ARGS__; }                                                      \
    }                                                                                    \
}

// x.to(torch.float32)
ELEMENTWISE(cast_bf16_f32, (const bits16* x, float* y, long n), y[i] = bf16_to_f32(x[i]))
ELEMENTWISE(cast_f16_f32, (const bits16* x, float* y, long n), y[i] = f16_to_f32(x[i]))
// x.to(input_dtype)
ELEMENTWISE(cast_f32_bf16, (const float* x, bits16* y, long n), y[i] = f32_to_bf16(x[i]))
ELEMENTWISE(cast_f32_f16, (const float* x, bits16* y, long n), y[i] = f32_to_f16(x[i]))

// The address of element (head h, column e) of position `pos` of sequence b in a page pool read
// through `table` ([batch, max_pages] i32; ops/rows/pages.rs): page table[b][pos / page_size], slot
// pos % page_size, with the pool's page, head and slot strides. -1 where the position is outside the
// table or its entry outside the pool (the host checks entries; the kernels bound them once more).
__device__ __forceinline__ long paged_at(const int* table, long b, long pos, long max_pages, long page_size,
                                         long page_stride, long head_stride, long slot_stride, long num_pages,
                                         long h, long e) {
    if (pos < 0 || pos >= max_pages * page_size) return -1;
    const long page = (long)table[b * max_pages + pos / page_size];
    if (page < 0 || page >= num_pages) return -1;
    return page * page_stride + h * head_stride + (pos % page_size) * slot_stride + e;
}

// Programmatic dependent launch (Hopper and later; kernels/mod.rs `launch_programmatic`). A kernel
// launched with programmatic stream serialization may start while the kernel before it on the stream
// drains: `pdl_wait` waits until that kernel has completed and its writes are visible (at once when
// the launch was an ordinary one), so nothing the previous kernel may write is read or written before
// it; `pdl_launch_dependents` lets the next such kernel start early. Both are no-ops below sm_90.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// L2 prefetch of the line holding `p` (no register, no wait; what a programmatic launch may do before
// `pdl_wait`: L2 is where every SM's writes land, so a prefetched line is never stale).
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// The scalar activations of the matmul epilogues, shared by the eager epilogue kernels
// (ops/matmul/naive.cu) and the decode GEMV (ops/matmul/decode.cu).
__device__ __forceinline__ float epi_silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float epi_gelu(float x) { return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f)); }
__device__ __forceinline__ float epi_gelu_tanh(float x) {
    const float beta = 0.79788456080286536f;  // sqrt(2 / pi)
    const float kappa = 0.044715f;
    return 0.5f * x * (1.0f + tanhf(beta * (x + kappa * x * x * x)));
}
__device__ __forceinline__ float epi_relu(float x) { return x <= 0.0f ? 0.0f : x; }  // NaN propagates

// ---- The decode GEMV's loads and unpacking (ops/matmul/decode.cu). ----
// 16 bytes of a weight, not kept in L1.
__device__ __forceinline__ uint4 gemv_stream16(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// 16 bytes of the activations, kept in L1 for the other warps of the SM.
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

// The warp's sums of every acc[r][t] (a butterfly over the 32 lanes, every lane ending with every
// sum); lane r·M + t returns sum (r, t), the others 0.
template <int R, int M>
__device__ __forceinline__ float gemv_warp_sums(float (&acc)[R][M], int lane) {
    float v = 0.0f;
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int t = 0; t < M; ++t) {
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) acc[r][t] += __shfl_xor_sync(0xffffffffu, acc[r][t], o);
            if (lane == r * M + t) v = acc[r][t];
        }
    return v;
}

// The dot product of 8 elements of W and of x in f32, in the order every GEMV form sums them (the
// decode GEMV, ops/matmul/decode.cu, and the one-launch decode layer, ops/decode_layer/layer.cu).
__device__ __forceinline__ float gemv_dot8(const float (&w)[8], const float (&x)[8]) {
    float dot = w[0] * x[0];
#pragma unroll
    for (int e = 1; e < 8; ++e) dot = fmaf(w[e], x[e], dot);
    return dot;
}

// The 8 elements of a chunk in f32.
template <class D>
__device__ __forceinline__ void gemv_unpack8(uint4 v, float (&f)[8]) {
    D::unpack(v.x, f[0], f[1]);
    D::unpack(v.y, f[2], f[3]);
    D::unpack(v.z, f[4], f[5]);
    D::unpack(v.w, f[6], f[7]);
}


// ---- FP8 codes to f32, exactly (OCP FP8: E4M3 has no infinities and NaN at S.1111.111; E5M2 is
// IEEE-like). cudnn-ops/src/fp8.rs is the host's side. ----
__device__ __forceinline__ float fp8_e4m3_to_f32(unsigned char c) {
    const float sign = (c & 0x80) ? -1.f : 1.f;
    const int e = (c >> 3) & 0xf, m = c & 0x7;
    if ((c & 0x7f) == 0x7f) return __int_as_float(0x7fc00000);
    if (e == 0) return sign * ldexpf((float)m, -9);  // subnormal: m/8 * 2^-6
    return sign * ldexpf((float)(8 + m), e - 10);    // (1 + m/8) * 2^(e-7)
}

__device__ __forceinline__ float fp8_e5m2_to_f32(unsigned char c) {
    const float sign = (c & 0x80) ? -1.f : 1.f;
    const int e = (c >> 2) & 0x1f, m = c & 0x3;
    if (e == 31) return m ? __int_as_float(0x7fc00000) : sign * __int_as_float(0x7f800000);
    if (e == 0) return sign * ldexpf((float)m, -16);  // subnormal: m/4 * 2^-14
    return sign * ldexpf((float)(4 + m), e - 17);     // (1 + m/4) * 2^(e-15)
}

// Four FP8 codes of a 32-bit word (the low byte first) in f32: on sm_89 and later two
// `cvt.rn.f16x2.{e4m3,e5m2}x2` (exact: every FP8 value is an f16), else the exact decoders above.
template <int E5M2>
__device__ __forceinline__ void fp8x4_to_f32(unsigned u, float* f) {
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

// The decode GEMV's weight formats: `T` the element, `E` elements per 16-byte chunk, and `unpack8(v,
// j, f)` the j-th 8 of a chunk's elements in f32 (j < E / 8). 16-bit weights in the I/O dtype D, or
// FP8 codes (their dequantization factors multiply the row's sum at the end).
template <class D>
struct GemvW16 {
    typedef bits16 T;
    enum { E = 8 };
    static __device__ __forceinline__ void unpack8(uint4 v, int, float (&f)[8]) { gemv_unpack8<D>(v, f); }
};
template <int E5M2>
struct GemvW8 {
    typedef unsigned char T;
    enum { E = 16 };
    static __device__ __forceinline__ void unpack8(uint4 v, int j, float (&f)[8]) {
        fp8x4_to_f32<E5M2>(j ? v.z : v.x, f);
        fp8x4_to_f32<E5M2>(j ? v.w : v.y, f + 4);
    }
};
