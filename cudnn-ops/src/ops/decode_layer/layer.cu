// ---- A whole decoder layer of a one-token decode step in one launch (ops/decode_layer). ----

// A small model's decode step is bound by its launches, not its bytes: SmolLM2-135M reads 7 MB a
// layer, 1.5 us at the copy bandwidth, and spends ~18 us a layer in six kernels. This kernel runs
// the layer's five phases in one persistent grid (a block per SM, all co-resident), each phase
// ended by a grid barrier:
//   A. the attention prenorm folded into qkv_proj, RoPE, the K/V append (the decode GEMV's
//      norm + rotary form: each warp a head's pair of rows j and j + d/2);
//   B. attention of the one query over the cache, split over keys (a warp per head and split of
//      at least 32 keys), the last warp of a head to finish merging the splits into o;
//   C. o_proj with the residual: x1 = x + o · W_oᵀ;
//   D. the MLP prenorm folded into gate and up, SwiGLU: act = silu(g) · round(u);
//   E. down with the residual: y = x1 + act · W_downᵀ.
// Every block prefetches into L2, before it waits for the kernel before it (programmatic
// dependent launch), its rows of qkv_proj, and with `prefetch_all` those of every phase (a layer
// that fits L2 many times over): the weights stream while the barriers wait. The next kernel may
// launch once the last barrier is passed (no block waits on another after it).
//
// Rounding as the fused kernels of each phase: f32 sums, the projection outputs rounded to the I/O
// dtype once (RoPE rotates the rounded pair, in f32, and rounds again), attention in f32 with o
// rounded, the residual added before the one rounding of each sum (decode.cu's epilogues).
//
// Measured on an H200 (mod.rs): each phase costs 2.6-4 us with its barrier, about a kernel boundary
// under programmatic dependent launch, so a replayed step is no faster than the six launches'.
//
// Data one block writes and another reads inside the launch (q, o, x1, act, the partials, the new
// K/V row) is read around L1 (`ld.global.cg`); weights go through the non-coherent path.

#define LAYER_THREADS 256
#define LAYER_WARPS (LAYER_THREADS / 32)
#define LAYER_KEYS 32
#define LAYER_NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ unsigned layer_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// The grid barrier, one word: every block adds 1 but block 0, which adds 2^31 - (blocks - 1), so
// that once all have arrived the word has moved by 2^31 (its top bit flips, its low bits are as
// they were: 0, the buffer's zeroed start); each block's thread 0 waits for the flip. One atomic
// per block on the way (release: the block's writes before it, ordered by the __syncthreads, are
// visible to whoever acquires the flip), nothing to reset, launch after launch.
__device__ __forceinline__ void layer_sync(unsigned* bar) {
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned add = blockIdx.x == 0 ? 0x80000000u - (gridDim.x - 1) : 1u;
        unsigned old;
        asm volatile("atom.add.release.gpu.global.u32 %0, [%1], %2;" : "=r"(old) : "l"(bar), "r"(add) : "memory");
        while (((old ^ layer_acquire(bar)) & 0x80000000u) == 0) {
        }
    }
    __syncthreads();
}

// The split counter of a head: the arrival's old count (acquire and release at once: the partial
// this warp wrote is visible to the warp that counts last, which sees every other split's).
__device__ __forceinline__ unsigned layer_arrive(unsigned* p) {
    unsigned old;
    asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], 1;" : "=r"(old) : "l"(p) : "memory");
    return old;
}

// 16 bytes written in this launch by another block (around L1).
__device__ __forceinline__ uint4 layer_load_cg(const bits16* p) { return __ldcg(reinterpret_cast<const uint4*>(p)); }

// Prefetches rows [first, ...) stepping `step` (this warp's rows of a phase) of a [n, k] weight into L2.
__device__ __forceinline__ void layer_prefetch(const bits16* w, long n, long k, long first, long step, int lane) {
    const long lines = (k * 2 + 127) / 128;
    for (long row = first; row < n; row += step)
        for (long i = lane; i < lines; i += 32) prefetch_l2(w + row * k + i * 64);
}

// Stages v[0..k) (16-bit, written in this launch: around L1) in f32 into `xs`, each multiplied by
// g[j] when `g` is given; returns the sum of v² over the block (every thread gets it).
template <class D>
__device__ __forceinline__ float layer_stage(const bits16* v, const bits16* g, int k, float* xs, float* red) {
    float ss = 0.0f;
    for (int c = threadIdx.x; c < k / 8; c += LAYER_THREADS) {
        float f[8], gf[8];
        gemv_unpack8<D>(layer_load_cg(v + c * 8), f);
        if (g) gemv_unpack8<D>(gemv_cached16((const uint4*)(g + c * 8)), gf);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            ss = fmaf(f[e], f[e], ss);
            xs[c * 8 + e] = g ? f[e] * gf[e] : f[e];
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) red[warp] = ss;
    __syncthreads();
    float total = 0.0f;
#pragma unroll
    for (int i = 0; i < LAYER_WARPS; ++i) total += red[i];
    __syncthreads();
    return total;
}

// The dot products of R rows of W (row pointers ws, k elements) with the staged f32 vector xs, one
// warp: lane l takes the 8-element chunks l, l + 32, ..., four of each row in flight; every lane
// ends with every sum.
// The loads of one trip of `layer_dots` (chunks c, c + 32, c + 64, c + 96 of each row; a chunk past
// the row reads its last chunk, unused).
template <int R>
__device__ __forceinline__ void layer_trip(const bits16* const (&ws)[R], int c, int chunks, uint4 (&wv)[4][R]) {
#pragma unroll
    for (int u = 0; u < 4; ++u) {
        const int cc = min(c + 32 * u, chunks - 1);
#pragma unroll
        for (int r = 0; r < R; ++r) wv[u][r] = gemv_stream16((const uint4*)(ws[r]) + cc);
    }
}

// With `use_pre`, `pre` (the first trip's loads, issued before the barrier the phase waits at: weights are
// never written in a step), the first trip uses them.
template <class D, int R>
__device__ __forceinline__ void layer_dots(const bits16* const (&ws)[R], const float* xs, int k, int lane,
                                           float (&acc)[R], const uint4 (&pre)[4][R], bool use_pre) {
    const int chunks = k / 8;
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.0f;
    for (int c = lane; c < chunks; c += 128) {
        uint4 wv[4][R];
        if (use_pre && c == lane) {
#pragma unroll
            for (int u = 0; u < 4; ++u)
#pragma unroll
                for (int r = 0; r < R; ++r) wv[u][r] = pre[u][r];
        } else {
            layer_trip<R>(ws, c, (int)chunks, wv);
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            if (c + 32 * u >= chunks) break;
            const float4 a = *reinterpret_cast<const float4*>(xs + (c + 32 * u) * 8);
            const float4 b = *reinterpret_cast<const float4*>(xs + (c + 32 * u) * 8 + 4);
            const float xf[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
            for (int r = 0; r < R; ++r) {
                float wf[8];
                gemv_unpack8<D>(wv[u][r], wf);
                acc[r] += gemv_dot8(wf, xf);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
}

// DPL 16-bit elements at p (DPL-element aligned, written in this launch: around L1) in f32.
template <class D, int DPL>
__device__ __forceinline__ void layer_load_dpl(const bits16* p, float (&f)[DPL]) {
    if (DPL == 2) {
        const unsigned u = __ldcg(reinterpret_cast<const unsigned*>(p));
        D::unpack(u, f[0], f[DPL - 1]);
    } else if (DPL == 4) {
        const uint2 u = __ldcg(reinterpret_cast<const uint2*>(p));
        float lo[2], hi[2];
        D::unpack(u.x, lo[0], lo[1]);
        D::unpack(u.y, hi[0], hi[1]);
        f[0] = lo[0];
        f[1 % DPL] = lo[1];
        f[2 % DPL] = hi[0];
        f[3 % DPL] = hi[1];
    } else {
#pragma unroll
        for (int i = 0; i < DPL; ++i) f[i] = D::load(__ldcg(p + i));
    }
}

// Attention of query head h over keys [k0, k1) of the cache (rows `stride` elements apart, the K/V
// head at `kh`, `vh`), one warp: lane t scores key k0 + t of each trip of 32 (the query staged in
// f32 at `q`, times `scale` · log2 e), an online softmax over the trips, each lane accumulating its
// DPL = d / 32 output elements. Returns the max and the sum; `acc` holds the unnormalized output.
template <class D, int DPL>
__device__ __forceinline__ void layer_attend(const float* q, const bits16* kh, const bits16* vh, long stride,
                                             long k0, long k1, float scale_log2, int lane, float& m, float& l,
                                             float (&acc)[DPL]) {
    m = LAYER_NEG_INF;
    l = 0.0f;
#pragma unroll
    for (int i = 0; i < DPL; ++i) acc[i] = 0.0f;
    for (long t0 = k0; t0 < k1; t0 += 32) {
        const long t = t0 + lane;
        // Every lane loads a row (the last one past the end, unused): the whole K row in flight.
        const bits16* kr = kh + (t < k1 ? t : k1 - 1) * stride;
        uint4 kv[DPL * 4];
#pragma unroll
        for (int c = 0; c < DPL * 4; ++c) kv[c] = layer_load_cg(kr + c * 8);
        float dot = 0.0f;
#pragma unroll
        for (int c = 0; c < DPL * 4; ++c) {
            float f[8];
            gemv_unpack8<D>(kv[c], f);
#pragma unroll
            for (int e = 0; e < 8; ++e) dot = fmaf(q[c * 8 + e], f[e], dot);
        }
        const float s = t < k1 ? dot * scale_log2 : LAYER_NEG_INF;
        float mx = s;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        const float m_new = fmaxf(m, mx);
        const float p = t < k1 ? exp2f(s - m_new) : 0.0f;
        const float corr = m == LAYER_NEG_INF ? 0.0f : exp2f(m - m_new);
        float ps = p;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
        l = l * corr + ps;
        m = m_new;
#pragma unroll
        for (int i = 0; i < DPL; ++i) acc[i] *= corr;
        // V: sixteen keys' rows in flight at a time (rows past the end clamped; their p is 0).
        const long last = k1 - 1;
#pragma unroll
        for (int j0 = 0; j0 < 32; j0 += 16) {
            float vf[16][DPL];
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                const long row = t0 + j0 + j < last ? t0 + j0 + j : last;
                layer_load_dpl<D, DPL>(vh + row * stride + lane * DPL, vf[j]);
            }
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                const float pj = __shfl_sync(0xffffffffu, p, j0 + j);
#pragma unroll
                for (int i = 0; i < DPL; ++i) acc[i] = fmaf(pj, vf[j][i], acc[i]);
            }
        }
    }
}

// The first trip of rows gw and gw + nw (clamped into the n rows) of a [n, k] weight, for
// `layer_rows`: loaded before the barrier its phase waits at.
__device__ __forceinline__ void layer_preload_rows(const bits16* w, long n, int k, long gw, long nw, int lane,
                                                   uint4 (&pre)[4][2]) {
    const long r = gw < n ? gw : n - 1, r2 = gw + nw < n ? gw + nw : n - 1;
    const bits16* const ws[2] = {w + r * k, w + r2 * k};
    layer_trip<2>(ws, lane, k / 8, pre);
}

// out = res + xs · Wᵀ over the n rows of a [n, k] weight (o_proj and down with their residuals):
// rows r and r + nw of each warp together (two rows' loads in flight; the second clamped into W),
// the first trip from `pre`. `res` may be written in this launch (read around L1).
template <class D>
__device__ __forceinline__ void layer_rows(const bits16* w, long n, int k, const float* xs, const bits16* res,
                                           bits16* out, long gw, long nw, int lane, const uint4 (&pre)[4][2]) {
    for (long r = gw; r < n; r += 2 * nw) {
        const long r2 = r + nw < n ? r + nw : n - 1;
        const bits16* const ws[2] = {w + r * k, w + r2 * k};
        float acc[2];
        layer_dots<D, 2>(ws, xs, k, lane, acc, pre, r == gw);
        if (lane == 0) out[r] = D::store(acc[0] + D::load(__ldcg(res + r)));
        if (lane == 0 && r + nw < n) out[r2] = D::store(acc[1] + D::load(__ldcg(res + r2)));
    }
}

// Phase B's split of `len` keys: `per` keys a split (a multiple of LAYER_KEYS), at most
// `max_splits` and about a warp of the grid each per head; returns the splits.
__device__ __forceinline__ long layer_splits(long len, long nw, int heads_q, int max_splits, long& per) {
    const long by_warps = nw / heads_q > 0 ? nw / heads_q : 1;
    const long cap = by_warps < max_splits ? by_warps : max_splits;
    per = (len + cap - 1) / cap;
    per = (per + LAYER_KEYS - 1) / LAYER_KEYS * LAYER_KEYS;
    per = per < LAYER_KEYS ? LAYER_KEYS : per;
    return len == 0 ? 1 : (len + per - 1) / per;
}

// The keys cached for the query at `pos` (the cache holds max_seq).
__device__ __forceinline__ long layer_keys(long pos, long max_seq) {
    return pos < 0 ? 0 : pos + 1 > max_seq ? max_seq : pos + 1;
}

template <class D, int DPL>
__device__ __forceinline__ void decode_layer(
        const bits16* x, const bits16* attn_norm, const bits16* w_qkv, const bits16* w_o,
        const bits16* mlp_norm, const bits16* w_gate, const bits16* w_up, const bits16* w_down, float eps,
        const float* cos_t, const float* sin_t, long positions, const int* pos_p, bits16* kc, bits16* vc,
        long max_seq, int hidden, int heads_q, int heads_kv, int d, int ffn, float scale_log2,
        int prefetch_all, bits16* q_s, bits16* o_s, bits16* x1, bits16* act, float* part, int max_splits,
        unsigned* counters, unsigned* bar, bits16* y, unsigned long long* clocks) {
    extern __shared__ float layer_xs[];  // the phase's staged input vector, f32
    __shared__ float red[LAYER_WARPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long gw = (long)blockIdx.x * LAYER_WARPS + warp, nw = (long)gridDim.x * LAYER_WARPS;
    const int half = d / 2, qkv_n = (heads_q + 2 * heads_kv) * d, attn_w = heads_q * d;
    const long kv_w = (long)heads_kv * d;
    // Block 0's thread 0 records the global timer (ns) at the start, after the wait for the kernel
    // before, after each barrier and at its end (fused.rs `phase_times`).
    const bool timer = clocks && blockIdx.x == 0 && threadIdx.x == 0;
    auto stamp = [&](int i) {
        if (timer) {
            unsigned long long t;
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
            clocks[i] = t;
        }
    };
    stamp(0);

    // Before the kernel before this one ends: this warp's weight rows into L2.
    {
        const long pairs = (long)(qkv_n / 2);
        for (long g = gw; g < pairs; g += nw) {
            const long r0 = (g / half) * d + g % half;
            layer_prefetch(w_qkv, r0 + 1, hidden, r0, 1, lane);
            layer_prefetch(w_qkv, r0 + half + 1, hidden, r0 + half, 1, lane);
        }
        if (prefetch_all) {
            layer_prefetch(w_o, hidden, attn_w, gw, nw, lane);
            layer_prefetch(w_gate, ffn, hidden, gw, nw, lane);
            layer_prefetch(w_up, ffn, hidden, gw, nw, lane);
            layer_prefetch(w_down, hidden, ffn, gw, nw, lane);
        }
    }
    // This warp's cached keys and values of phase B into L2. The position may still be being written
    // by the kernel before (it is read again after the wait): here it only steers the prefetch, its
    // rows clamped into the cache.
    {
        const long len = layer_keys((long)__ldcg(pos_p), max_seq);
        long per;
        const long splits = layer_splits(len, nw, heads_q, max_splits, per);
        const int group = heads_q / heads_kv;
        for (long item = gw; item < heads_q * splits; item += nw) {
            const long kvh = (item / splits) / group, k0 = (item % splits) * per;
            const long k1 = k0 + per < len ? k0 + per : len;
            for (long t = k0 + lane; t < k1; t += 32)
                for (int i = 0; i < (d * 2 + 127) / 128; ++i) {
                    prefetch_l2(kc + t * kv_w + kvh * d + i * 64);
                    prefetch_l2(vc + t * kv_w + kvh * d + i * 64);
                }
        }
    }
    // The first trip of each warp's first row group of qkv_proj, loaded before the wait.
    uint4 pre_a[4][2];
    {
        const long pairs = (long)(qkv_n / 2), g = gw < pairs ? gw : pairs - 1;
        const long r0 = (g / half) * d + g % half;
        const bits16* const ws[2] = {w_qkv + r0 * hidden, w_qkv + (r0 + half) * hidden};
        layer_trip<2>(ws, lane, hidden / 8, pre_a);
    }
    pdl_wait();
    stamp(1);

    const long pos = (long)__ldcg(pos_p);
    const bool in = pos >= 0 && pos < positions && pos < max_seq;
    const long len = layer_keys(pos, max_seq);  // keys attended

    // A. qkv_proj of the normed x, RoPE, the K/V append; Q heads to q_s.
    {
        const float ss = layer_stage<D>(x, attn_norm, hidden, layer_xs, red);
        const float inv = rsqrtf(ss / (float)hidden + eps);
        for (long g = gw; g < qkv_n / 2; g += nw) {
            const int h = (int)(g / half), j = (int)(g % half);
            const long r0 = (long)h * d + j, r1 = r0 + half;
            const bits16* const ws[2] = {w_qkv + r0 * hidden, w_qkv + r1 * hidden};
            float acc[2];
            layer_dots<D, 2>(ws, layer_xs, hidden, lane, acc, pre_a, g == gw);
            if (lane == 0) {
                const float a = D::load(D::store(acc[0] * inv)), b = D::load(D::store(acc[1] * inv));
                const bool rotated = h < heads_q + heads_kv;
                float lo = a, hi = b;
                if (in && rotated) {
                    const float c = cos_t[pos * half + j], sn = sin_t[pos * half + j];
                    lo = a * c - b * sn;
                    hi = b * c + a * sn;
                }
                const bits16 slo = D::store(lo), shi = D::store(hi);
                if (h < heads_q) {
                    q_s[r0] = slo;
                    q_s[r1] = shi;
                } else if (in) {
                    const int hh = rotated ? h - heads_q : h - heads_q - heads_kv;
                    bits16* cache = rotated ? kc : vc;
                    const long at = pos * kv_w + (long)hh * d + j;
                    cache[at] = slo;
                    cache[at + half] = shi;
                }
            }
        }
        if (!prefetch_all) layer_prefetch(w_o, hidden, attn_w, gw, nw, lane);
    }
    layer_sync(bar);
    stamp(2);

    // B. Attention: items (head, split); the last warp of a head merges its splits into o_s.
    {
        long per;
        const long splits = layer_splits(len, nw, heads_q, max_splits, per);
        const int group = heads_q / heads_kv;
        for (int i = threadIdx.x; i < attn_w / 8; i += LAYER_THREADS) {
            float f[8];
            gemv_unpack8<D>(layer_load_cg(q_s + i * 8), f);
#pragma unroll
            for (int e = 0; e < 8; ++e) layer_xs[i * 8 + e] = f[e];
        }
        __syncthreads();
        const int row = d + 2;  // a partial: acc[d], then m and l
        for (long item = gw; item < heads_q * splits; item += nw) {
            const int h = (int)(item / splits);
            const long s = item % splits;
            const long k0 = s * per, k1 = k0 + per < len ? k0 + per : len;
            const long kvh = h / group;
            float m, l, acc[DPL];
            layer_attend<D, DPL>(layer_xs + h * d, kc + kvh * d, vc + kvh * d, kv_w, k0, k1, scale_log2, lane, m,
                                 l, acc);
            float* pr = part + ((long)h * max_splits + s) * row;
#pragma unroll
            for (int i = 0; i < DPL; ++i) pr[lane * DPL + i] = acc[i];
            if (lane == 0) {
                pr[d] = m;
                pr[d + 1] = l;
            }
            __syncwarp();
            int is_last = 0;
            if (lane == 0) {
                is_last = layer_arrive(counters + h) == (unsigned)(splits - 1);
                if (is_last) atomicExch(counters + h, 0u);
            }
            is_last = __shfl_sync(0xffffffffu, is_last, 0);
            if (!is_last) continue;
            // The merge, lanes over the splits, 32 at a time with a running max: each split's
            // max and sum and sixteen splits' rows loaded before any is used.
            const float* ph = part + (long)h * max_splits * row;
            float mx = LAYER_NEG_INF, sum = 0.0f, out[DPL];
#pragma unroll
            for (int i = 0; i < DPL; ++i) out[i] = 0.0f;
            const long lastt = splits - 1;
            for (long t0 = 0; t0 < splits; t0 += 32) {
                float pa[16][DPL];
#pragma unroll
                for (int j = 0; j < 16; ++j) {
                    const long tj = t0 + j < lastt ? t0 + j : lastt;
#pragma unroll
                    for (int i = 0; i < DPL; ++i) pa[j][i] = __ldcg(ph + tj * row + lane * DPL + i);
                }
                const long t = t0 + lane;
                const float mt = t < splits ? __ldcg(ph + t * row + d) : LAYER_NEG_INF;
                const float lt = t < splits ? __ldcg(ph + t * row + d + 1) : 0.0f;
                float cm = mt;
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) cm = fmaxf(cm, __shfl_xor_sync(0xffffffffu, cm, o));
                const float nm = fmaxf(mx, cm);
                const float corr = mx == LAYER_NEG_INF ? 0.0f : exp2f(mx - nm);
                mx = nm;
                sum *= corr;
#pragma unroll
                for (int i = 0; i < DPL; ++i) out[i] *= corr;
                const float w = mt == LAYER_NEG_INF ? 0.0f : exp2f(mt - nm);
                sum += w * lt;
#pragma unroll
                for (int j = 0; j < 16; ++j) {
                    const float wj = __shfl_sync(0xffffffffu, w, j);
#pragma unroll
                    for (int i = 0; i < DPL; ++i) out[i] = fmaf(wj, pa[j][i], out[i]);
                }
                if (t0 + 16 < splits) {
#pragma unroll
                    for (int j = 0; j < 16; ++j) {
                        const long tj = t0 + 16 + j < lastt ? t0 + 16 + j : lastt;
#pragma unroll
                        for (int i = 0; i < DPL; ++i) pa[j][i] = __ldcg(ph + tj * row + lane * DPL + i);
                    }
#pragma unroll
                    for (int j = 0; j < 16; ++j) {
                        const float wj = __shfl_sync(0xffffffffu, w, 16 + j);
#pragma unroll
                        for (int i = 0; i < DPL; ++i) out[i] = fmaf(wj, pa[j][i], out[i]);
                    }
                }
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            const float r = sum > 0.0f ? 1.0f / sum : 0.0f;
#pragma unroll
            for (int i = 0; i < DPL; ++i) o_s[(long)h * d + lane * DPL + i] = D::store(out[i] * r);
        }
    }
    uint4 pre_c[4][2];
    layer_preload_rows(w_o, hidden, attn_w, gw, nw, lane, pre_c);
    layer_sync(bar);
    stamp(3);

    // C. x1 = x + o · W_oᵀ.
    {
        layer_stage<D>(o_s, nullptr, attn_w, layer_xs, red);
        layer_rows<D>(w_o, hidden, attn_w, layer_xs, x, x1, gw, nw, lane, pre_c);
        if (!prefetch_all) {
            layer_prefetch(w_gate, ffn, hidden, gw, nw, lane);
            layer_prefetch(w_up, ffn, hidden, gw, nw, lane);
        }
    }
    uint4 pre_d[4][4];
    {
        const long r = gw < ffn ? gw : ffn - 1, r2 = gw + nw < ffn ? gw + nw : ffn - 1;
        const bits16* const ws[4] = {w_gate + r * hidden, w_up + r * hidden, w_gate + r2 * hidden,
                                     w_up + r2 * hidden};
        layer_trip<4>(ws, lane, hidden / 8, pre_d);
    }
    layer_sync(bar);
    stamp(4);

    // D. act = silu(g) · round(u) of the normed x1.
    {
        const float ss = layer_stage<D>(x1, mlp_norm, hidden, layer_xs, red);
        const float inv = rsqrtf(ss / (float)hidden + eps);
        for (long r = gw; r < ffn; r += 2 * nw) {
            const long r2 = r + nw < ffn ? r + nw : ffn - 1;
            const bits16* const ws[4] = {w_gate + r * hidden, w_up + r * hidden, w_gate + r2 * hidden,
                                         w_up + r2 * hidden};
            float acc[4];
            layer_dots<D, 4>(ws, layer_xs, hidden, lane, acc, pre_d, r == gw);
            if (lane == 0) {
                const float g = acc[0] * inv, u = acc[1] * inv;
                act[r] = D::store(epi_silu(g) * D::load(D::store(u)));
                if (r + nw < ffn) {
                    const float g2 = acc[2] * inv, u2 = acc[3] * inv;
                    act[r2] = D::store(epi_silu(g2) * D::load(D::store(u2)));
                }
            }
        }
        if (!prefetch_all) layer_prefetch(w_down, hidden, ffn, gw, nw, lane);
    }
    uint4 pre_e[4][2];
    layer_preload_rows(w_down, hidden, ffn, gw, nw, lane, pre_e);
    layer_sync(bar);
    stamp(5);
    // No block waits on another from here on: the next kernel may start.
    pdl_launch_dependents();

    // E. y = x1 + act · W_downᵀ.
    {
        layer_stage<D>(act, nullptr, ffn, layer_xs, red);
        layer_rows<D>(w_down, hidden, ffn, layer_xs, x1, y, gw, nw, lane, pre_e);
    }
    __syncthreads();
    stamp(6);
}

// decode_layer_<dtype>_d<DPL * 32>: head dims 32, 64, 96 and 128 (DPL output elements a lane).
#define DECODE_LAYER_KERNEL(sfx, D, DPL)                                                                   \
extern "C" __global__ void __launch_bounds__(LAYER_THREADS, 2) decode_layer_##sfx##_d##DPL(               \
        const bits16* x, const bits16* attn_norm, const bits16* w_qkv, const bits16* w_o,                  \
        const bits16* mlp_norm, const bits16* w_gate, const bits16* w_up, const bits16* w_down, float eps,  \
        const float* cos_t, const float* sin_t, long positions, const int* pos, bits16* kc, bits16* vc,     \
        long max_seq, long hidden, long heads_q, long heads_kv, long d, long ffn, float scale_log2,         \
        long prefetch_all, bits16* q_s, bits16* o_s, bits16* x1, bits16* act, float* part, long max_splits, \
        unsigned* counters, unsigned* bar, bits16* y, unsigned long long* clocks) {                        \
    decode_layer<D, DPL>(x, attn_norm, w_qkv, w_o, mlp_norm, w_gate, w_up, w_down, eps, cos_t, sin_t,      \
                         positions, pos, kc, vc, max_seq, (int)hidden, (int)heads_q, (int)heads_kv, (int)d, \
                         (int)ffn, scale_log2, (int)prefetch_all, q_s, o_s, x1, act, part, (int)max_splits, \
                         counters, bar, y, clocks);                                                        \
}
#define DECODE_LAYER_DIMS(sfx, D)                                                                         \
    DECODE_LAYER_KERNEL(sfx, D, 1)                                                                        \
    DECODE_LAYER_KERNEL(sfx, D, 2)                                                                        \
    DECODE_LAYER_KERNEL(sfx, D, 3)                                                                        \
    DECODE_LAYER_KERNEL(sfx, D, 4)
DECODE_LAYER_DIMS(bf16, GemvBf16)
DECODE_LAYER_DIMS(f16, GemvF16)
