
// ---- Split-KV decode attention ("flash-decoding", ops/sdpa/decode.rs): one query per sequence. ----

// Warps per CTA of sdpa_decode_* (decode.rs launches DECODE_WARPS * 32 threads), keys each lane group
// loads per loop trip before using them (loads in flight), and the most splits (decode.rs MAX_SPLITS).
#define DECODE_WARPS 4
#define DECODE_UNROLL 4
#define DECODE_MAX_SPLITS 64
#define DECODE_PREFETCH_KEYS 64
#define DECODE_NEG_INF __int_as_float(0xff800000)

// Eight 16-bit elements (one 16-byte load; element 0 in the low half of .x) to f32.
__device__ __forceinline__ void decode_unpack8(uint4 u, bool bf16, float* f) {
    const unsigned int w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        if (bf16) {
            f[2 * i] = __uint_as_float(w[i] << 16);
            f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
        } else {
            f[2 * i] = f16_to_f32((bits16)(w[i] & 0xffffu));
            f[2 * i + 1] = f16_to_f32((bits16)(w[i] >> 16));
        }
    }
}

__device__ __forceinline__ uint4 decode_load16(const bits16* p) { return *reinterpret_cast<const uint4*>(p); }

// Sequence b's key count: `cap`, or lens[b] clamped into [0, cap]. Read around L1 (`ld.global.cg`): the
// kernel reads it once before `pdl_wait` (to aim its prefetches) and again after, and the second read
// must see what the kernels before wrote, not a line the first one left in L1.
__device__ __forceinline__ long decode_len(const int* lens, long b, long cap) {
    if (!lens) return cap;
    const long x = __ldcg(lens + b);
    return x < 0 ? 0 : x > cap ? cap : x;
}

// The keys [*start, *end) of split `split` of a sequence of `len` keys, with `per` =
// max(ceil(len / splits), trip) keys a split; returns per.
__device__ __forceinline__ long decode_split(long len, long splits, long split, long trip, long* start, long* end) {
    long per = (len + splits - 1) / splits;
    per = per < trip ? trip : per;
    *start = split * per;
    *end = *start + per < len ? *start + per : len;
    return per;
}

// Element offset of key t's row (from the K/V head's base): t * s_stride, or with a page table slot
// t % page_size of page row_pages[t / page_size] clamped into the pool. `around_l1`: the entry is read
// around L1 (`ld.global.cg`), as the lengths, before `pdl_wait`; after it the table reads go through L1
// (no line of it is there yet, so none is stale).
__device__ __forceinline__ long decode_key_at(long t, long s_stride, long page_stride, const int* row_pages,
                                              long page_size, long num_pages, bool around_l1) {
    if (!row_pages) return t * s_stride;
    const int* entry = row_pages + t / page_size;
    long page = (long)(around_l1 ? __ldcg(entry) : *entry);
    page = page < 0 ? 0 : page >= num_pages ? num_pages - 1 : page;
    return page * page_stride + (t % page_size) * s_stride;
}

// One launch does all: CTA `blockIdx.x` = ((b * heads_kv + kvh) * chunks + chunk) * splits + split holds
// query heads h0 = kvh * group + chunk * NH .. (at most NH; all of that K/V head's group when group <= NH)
// over the keys of one split of sequence b. The sequence's key count is `cap`, or lens[b] clamped into
// [0, cap] when `lens` is not null; split s covers keys [s * per, (s + 1) * per) of them, per =
// max(ceil(len / splits), one loop trip), so the work follows the length read on the device while the
// launch stays the same for every length. A key's `dim` elements are read by dim / 8 lanes (16 bytes
// each: K/V base and strides are multiples of 8 elements); each lane group keeps an online softmax
// (running max and sum of exp2 of q.k * scale * log2(e), and the unnormalized output of its 8 columns)
// per query head over the keys it reads. The CTA merges its lane groups in shared memory and writes,
// per query head, row = (b * heads_q + h) * splits + split, the f32 partial acc[row * dim ..] and
// ml[2 row] = max, ml[2 row + 1] = sum (an empty split: max -inf, sum 0, acc 0). The last CTA of a
// (b, kvh, chunk) to finish (a counter per group, counters[(b * heads_kv + kvh) * chunks + chunk], which
// that CTA sets back to 0 for the next launch) merges the partials of the splits that hold keys (a warp
// per head for the weights, a float4 of one head per thread for the sums, each in a fixed order, so
// the result does not depend on which CTA is last) and writes O[b, h] at o + b * o_b + h * o_h:
// acc / sum, or zeros where the sequence has no keys.
// With `table` (paged K/V; may be null) K and V are page pools: key t of sequence b is slot t % page_size
// of page table[b * max_pages + t / page_size] (clamped into the pool's num_pages), at page * k_b +
// slot * k_s (k_b the page stride); without, at b * k_b + t * k_s.
// Programmatic dependent launch (decode.rs): before `pdl_wait` a CTA reads the length (and page table
// rows) only to aim L2 prefetches of its first DECODE_PREFETCH_KEYS keys, addresses clamped into the
// cache, so a value the kernel before is still writing changes nothing but which lines are warm; it
// then lets the next kernel start (`pdl_launch_dependents`: an o-projection GEMV streams its weights
// meanwhile), waits, and reads everything again. Partials and counters are touched after the wait only.
template <bool BF16, int NH>
__device__ __forceinline__ void decode_attention(const bits16* __restrict__ q, const bits16* __restrict__ k,
                                                 const bits16* __restrict__ v, long q_b, long q_h, long k_b,
                                                 long k_h, long k_s, long v_b, long v_h, long v_s,
                                                 const int* __restrict__ lens, long cap, long dim,
                                                 long heads_kv, long group, long chunks, long splits,
                                                 float scale_log2, float* __restrict__ part_acc,
                                                 float* __restrict__ part_ml, int* __restrict__ counters,
                                                 bits16* __restrict__ o, long o_b, long o_h,
                                                 const int* __restrict__ table, long max_pages,
                                                 long page_size, long num_pages) {
    // Lane groups x dim = DECODE_WARPS * 256 for every head dim; at most 128 lane groups (dim 8).
    __shared__ float sm_m[DECODE_WARPS * 32 * NH];
    __shared__ float sm_l[DECODE_WARPS * 32 * NH];
    __shared__ float sm_acc[DECODE_WARPS * 256 * NH];
    __shared__ float sm_scale[NH];
    __shared__ int sm_last;
    const int d = (int)dim, lanes = d / 8, groups = DECODE_WARPS * 32 / lanes;
    long r = blockIdx.x;
    const long split = r % splits;
    r /= splits;
    const long group_id = r;  // (b * heads_kv + kvh) * chunks + chunk
    const int chunk = (int)(r % chunks);
    r /= chunks;
    const long kvh = r % heads_kv, b = r / heads_kv;
    const long h0 = kvh * group + (long)chunk * NH;
    const int nh = min(NH, (int)group - chunk * NH);
    const long heads_q = heads_kv * group;
    const long trip = (long)groups * DECODE_UNROLL;
    // The K/V head's base (the sequence's, without a page table), and the page strides.
    const bits16* kh = k + kvh * k_h + (table ? 0 : b * k_b);
    const bits16* vh = v + kvh * v_h + (table ? 0 : b * v_b);
    const int* row_pages = table ? table + b * max_pages : nullptr;
    const long pk = table ? k_b : 0, pv = table ? v_b : 0;

    // Before the wait: warm L2 with the first keys of this split (the range as the length reads now).
    {
        long start, stop;
        decode_split(decode_len(lens, b, cap), splits, split, trip, &start, &stop);
        stop = stop < start + DECODE_PREFETCH_KEYS ? stop : start + DECODE_PREFETCH_KEYS;
        const int lines = (d * 2 + 127) / 128;  // 128-byte lines of a key's row (16-bit elements)
        for (long i = threadIdx.x; i < (stop - start) * lines; i += blockDim.x) {
            const long t = start + i / lines, line = (i % lines) * 64;
            prefetch_l2(kh + decode_key_at(t, k_s, pk, row_pages, page_size, num_pages, true) + line);
            prefetch_l2(vh + decode_key_at(t, v_s, pv, row_pages, page_size, num_pages, true) + line);
        }
    }
    pdl_launch_dependents();
    pdl_wait();

    const long len = decode_len(lens, b, cap);
    long start, end;
    const long per = decode_split(len, splits, split, trip, &start, &end);

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int grp = warp * (32 / lanes) + lane / lanes, col = (lane % lanes) * 8;
    const bits16* kp = kh + col;
    const bits16* vp = vh + col;

    float qr[NH][8], m[NH], l[NH], acc[NH][8];
#pragma unroll
    for (int j = 0; j < NH; ++j) {
        if (j < nh) {
            decode_unpack8(decode_load16(q + b * q_b + (h0 + j) * q_h + col), BF16, qr[j]);
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            qr[j][e] = j < nh ? qr[j][e] * scale_log2 : 0.f;
            acc[j][e] = 0.f;
        }
        m[j] = DECODE_NEG_INF;
        l[j] = 0.f;
    }
    // Trip counts are the same for the whole CTA, so every lane reaches the shuffles. The next trip's
    // keys are loaded before this trip's are used (two trips of loads in flight per lane).
    uint4 kr[DECODE_UNROLL], vr[DECODE_UNROLL];
    const auto load_trip = [&](long base, uint4 (&kd)[DECODE_UNROLL], uint4 (&vd)[DECODE_UNROLL]) {
#pragma unroll
        for (int u = 0; u < DECODE_UNROLL; ++u) {
            const long t = base + u * groups + grp;
            if (t < end) {
                kd[u] = decode_load16(kp + decode_key_at(t, k_s, pk, row_pages, page_size, num_pages, false));
                vd[u] = decode_load16(vp + decode_key_at(t, v_s, pv, row_pages, page_size, num_pages, false));
            } else {
                kd[u] = uint4{0u, 0u, 0u, 0u};
                vd[u] = kd[u];
            }
        }
    };
    load_trip(start, kr, vr);
    for (long base = start; base < end; base += trip) {
        uint4 kn[DECODE_UNROLL], vn[DECODE_UNROLL];
        load_trip(base + trip, kn, vn);
#pragma unroll
        for (int u = 0; u < DECODE_UNROLL; ++u) {
            float kf[8], s[NH];
            decode_unpack8(kr[u], BF16, kf);
#pragma unroll
            for (int j = 0; j < NH; ++j) {
                float x = 0.f;
#pragma unroll
                for (int e = 0; e < 8; ++e) x += qr[j][e] * kf[e];
                s[j] = x;
            }
            for (int off = lanes >> 1; off > 0; off >>= 1) {
#pragma unroll
                for (int j = 0; j < NH; ++j) s[j] += __shfl_xor_sync(0xffffffffu, s[j], off);
            }
            if (base + u * groups + grp < end) {
                float vf[8];
                decode_unpack8(vr[u], BF16, vf);
#pragma unroll
                for (int j = 0; j < NH; ++j) {
                    const float mn = fmaxf(m[j], s[j]);
                    const float c = exp2f(m[j] - mn), p = exp2f(s[j] - mn);
                    l[j] = l[j] * c + p;
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[j][e] = acc[j][e] * c + p * vf[e];
                    m[j] = mn;
                }
            }
        }
#pragma unroll
        for (int u = 0; u < DECODE_UNROLL; ++u) {
            kr[u] = kn[u];
            vr[u] = vn[u];
        }
    }
#pragma unroll
    for (int j = 0; j < NH; ++j) {
        if (col == 0) {
            sm_m[grp * NH + j] = m[j];
            sm_l[grp * NH + j] = l[j];
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) sm_acc[(grp * NH + j) * d + col + e] = acc[j][e];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < nh * d; i += blockDim.x) {
        const int j = i / d, e = i - j * d;
        float mx = DECODE_NEG_INF;
        for (int g = 0; g < groups; ++g) mx = fmaxf(mx, sm_m[g * NH + j]);
        float a = 0.f, sum = 0.f;
        if (mx != DECODE_NEG_INF) {
            for (int g = 0; g < groups; ++g) {
                const float w = exp2f(sm_m[g * NH + j] - mx);
                a += w * sm_acc[(g * NH + j) * d + e];
                sum += w * sm_l[g * NH + j];
            }
        }
        const long row = (b * heads_q + h0 + j) * splits + split;
        part_acc[row * dim + e] = a;
        if (e == 0) {
            part_ml[2 * row] = mx;
            part_ml[2 * row + 1] = sum;
        }
    }
    // Publish the partials, then count this split done; the last one combines.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const int done = atomicAdd(counters + group_id, 1);
        sm_last = done == (int)splits - 1;
        if (sm_last) counters[group_id] = 0;  // every CTA of the group has counted: ready for the next launch
    }
    __syncthreads();
    if (!sm_last) return;
    __threadfence();
    // Only the splits that hold keys (split s does when s * per < len) take part; the others wrote an
    // empty partial, weight 0. Per head (a warp each): the overall max, each split's weight
    // exp2(max_s - max) into shared memory (sm_m: its reads are done), 1 / the weighted sum.
    const int active = len == 0 ? 0 : (int)min(splits, (len + per - 1) / per);
    for (int j = warp; j < nh; j += DECODE_WARPS) {
        float ms[DECODE_MAX_SPLITS / 32], ls[DECODE_MAX_SPLITS / 32];
        float mx = DECODE_NEG_INF;
#pragma unroll
        for (int u = 0; u < DECODE_MAX_SPLITS / 32; ++u) {
            const int sp = lane + 32 * u;
            ms[u] = DECODE_NEG_INF;
            ls[u] = 0.f;
            if (sp < active) {
                const long row = (b * heads_q + h0 + j) * splits + sp;
                ms[u] = __ldcg(part_ml + 2 * row);
                ls[u] = __ldcg(part_ml + 2 * row + 1);
            }
            mx = fmaxf(mx, ms[u]);
        }
        for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        float sum = 0.f;
#pragma unroll
        for (int u = 0; u < DECODE_MAX_SPLITS / 32; ++u) {
            const int sp = lane + 32 * u;
            const float w = sp < active && mx != DECODE_NEG_INF ? exp2f(ms[u] - mx) : 0.f;
            sm_m[j * DECODE_MAX_SPLITS + sp] = w;
            sum += w * ls[u];
        }
        for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
        if (lane == 0) sm_scale[j] = mx == DECODE_NEG_INF ? 0.f : 1.f / sum;
    }
    __syncthreads();
    // Per thread a float4 of one head's output: the weighted partials of the active splits.
    const int quads = d / 4;
    for (int i = threadIdx.x; i < nh * quads; i += blockDim.x) {
        const int j = i / quads, c = (i - j * quads) * 4;
        const float4* src = reinterpret_cast<const float4*>(part_acc + (b * heads_q + h0 + j) * splits * dim + c);
        const float* w = sm_m + j * DECODE_MAX_SPLITS;
        const long step = dim / 4;
        float4 num = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
        for (int sp = 0; sp < active; ++sp) {
            const float4 x = __ldcg(src + sp * step);
            num.x += w[sp] * x.x;
            num.y += w[sp] * x.y;
            num.z += w[sp] * x.z;
            num.w += w[sp] * x.w;
        }
        const float sc = sm_scale[j];
        const float out[4] = {num.x * sc, num.y * sc, num.z * sc, num.w * sc};
        bits16* dst = o + b * o_b + (h0 + j) * o_h + c;
#pragma unroll
        for (int e = 0; e < 4; ++e) dst[e] = BF16 ? f32_to_bf16(out[e]) : f32_to_f16(out[e]);
    }
}

#define SDPA_DECODE(sfx, BF16, NH)                                                                      \
extern "C" __global__ void __launch_bounds__(DECODE_WARPS * 32)                                          \
sdpa_decode_##sfx##_h##NH(const bits16* q, const bits16* k, const bits16* v, long q_b, long q_h,       \
                          long k_b, long k_h, long k_s, long v_b, long v_h, long v_s, const int* lens,  \
                          long cap, long dim, long heads_kv, long group, long chunks, long splits,      \
                          float scale_log2, float* part_acc, float* part_ml, int* counters, bits16* o,  \
                          long o_b, long o_h, const int* table, long max_pages, long page_size,         \
                          long num_pages) {                                                             \
    decode_attention<BF16, NH>(q, k, v, q_b, q_h, k_b, k_h, k_s, v_b, v_h, v_s, lens, cap, dim,         \
                               heads_kv, group, chunks, splits, scale_log2, part_acc, part_ml,          \
                               counters, o, o_b, o_h, table, max_pages, page_size, num_pages);          \
}
SDPA_DECODE(bf16, true, 1)
SDPA_DECODE(bf16, true, 2)
SDPA_DECODE(bf16, true, 4)
SDPA_DECODE(bf16, true, 8)
SDPA_DECODE(f16, false, 1)
SDPA_DECODE(f16, false, 2)
SDPA_DECODE(f16, false, 4)
SDPA_DECODE(f16, false, 8)
