
// ---- Split-KV decode attention ("flash-decoding", ops/sdpa/decode.rs): one query per sequence. ----

// Warps per CTA of sdpa_decode_* (decode.rs launches DECODE_WARPS * 32 threads), keys each lane group
// loads per loop trip before using them (loads in flight), and the most splits (decode.rs MAX_SPLITS).
#define DECODE_WARPS 4
#define DECODE_UNROLL 4
#define DECODE_MAX_SPLITS 64
#define DECODE_PREFETCH_KEYS 64
// CTAs per SM the tensor-core form is built for (its register budget).
#define DECODE_MMA_CTAS 3
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
// max(ceil(len / splits) rounded up to a multiple of `align`, trip) keys a split (trip a multiple of
// align); returns per.
__device__ __forceinline__ long decode_split(long len, long splits, long split, long trip, long align,
                                            long* start, long* end) {
    long per = (len + splits - 1) / splits;
    per = (per + align - 1) / align * align;
    per = per < trip ? trip : per;
    *start = split * per;
    *end = *start + per < len ? *start + per : len;
    return per;
}

// Element offset of key t's row (from the K/V head's base): t * s_stride, or with a page table slot
// t % page_size of page row_pages[t / page_size] clamped into the pool. `around_l1`: the entry is read
// around L1 (`ld.global.cg`), as the lengths, before `pdl_wait`; after it the table reads go through L1
// (no line of it is there yet, so none is stale).
__device__ __forceinline__ void decode_page_slot(long t, const int* row_pages, long page_size, long num_pages,
                                                 bool around_l1, long* page, long* slot) {
    // 32-bit division (t and page_size are checked dims below 2^31; a 64-bit one is a long routine).
    const unsigned int tu = (unsigned int)t, ps = (unsigned int)page_size, p = tu / ps;
    const int* entry = row_pages + p;
    const long at = (long)(around_l1 ? __ldcg(entry) : *entry);
    *page = at < 0 ? 0 : at >= num_pages ? num_pages - 1 : at;
    *slot = (long)(tu - p * ps);
}

__device__ __forceinline__ long decode_key_at(long t, long s_stride, long page_stride, const int* row_pages,
                                              long page_size, long num_pages, bool around_l1) {
    if (!row_pages) return t * s_stride;
    long page, slot;
    decode_page_slot(t, row_pages, page_size, num_pages, around_l1, &page, &slot);
    return page * page_stride + slot * s_stride;
}

// Where a split CTA works: CTA `blockIdx.x` = ((b * heads_kv + kvh) * chunks + chunk) * splits + split
// holds query heads h0 = kvh * group + chunk * NH .. (nh of them, at most NH) over one split of
// sequence b's keys; kh / vh are the K/V head's base (the sequence's, without a page table), pk / pv
// the page strides (0 without).
struct DecodeCta {
    long b, split, group_id, h0, heads_q, pk, pv;
    int nh;
    const bits16* kh;
    const bits16* vh;
    const int* row_pages;
};

template <int NH>
__device__ __forceinline__ DecodeCta decode_cta(const bits16* k, const bits16* v, long k_b, long k_h, long v_b,
                                                long v_h, long heads_kv, long group, long chunks, long splits,
                                                const int* table, long max_pages) {
    DecodeCta x;
    long r = blockIdx.x;
    x.split = r % splits;
    r /= splits;
    x.group_id = r;  // (b * heads_kv + kvh) * chunks + chunk
    const int chunk = (int)(r % chunks);
    r /= chunks;
    const long kvh = r % heads_kv;
    x.b = r / heads_kv;
    x.h0 = kvh * group + (long)chunk * NH;
    x.nh = min(NH, (int)group - chunk * NH);
    x.heads_q = heads_kv * group;
    x.kh = k + kvh * k_h + (table ? 0 : x.b * k_b);
    x.vh = v + kvh * v_h + (table ? 0 : x.b * v_b);
    x.row_pages = table ? table + x.b * max_pages : nullptr;
    x.pk = table ? k_b : 0;
    x.pv = table ? v_b : 0;
    return x;
}

// Before the wait: warm L2 with the first keys of this CTA's split (the range as the length reads
// now), then let the next kernel start and wait for the one before.
__device__ __forceinline__ void decode_prefetch(const DecodeCta& x, const int* lens, long cap, long splits,
                                                long trip, long align, int d, long k_s, long v_s,
                                                long page_size, long num_pages) {
    long start, stop;
    decode_split(decode_len(lens, x.b, cap), splits, x.split, trip, align, &start, &stop);
    stop = stop < start + DECODE_PREFETCH_KEYS ? stop : start + DECODE_PREFETCH_KEYS;
    const int lines = (d * 2 + 127) / 128;  // 128-byte lines of a key's row (16-bit elements)
    for (long i = threadIdx.x; i < (stop - start) * lines; i += blockDim.x) {
        const long t = start + i / lines, line = (i % lines) * 64;
        prefetch_l2(x.kh + decode_key_at(t, k_s, x.pk, x.row_pages, page_size, num_pages, true) + line);
        prefetch_l2(x.vh + decode_key_at(t, v_s, x.pv, x.row_pages, page_size, num_pages, true) + line);
    }
    pdl_launch_dependents();
    pdl_wait();
}

// The end of a split CTA: `groups` partial softmaxes per query head in shared memory (source g, head
// j: max sm_m[g * NH + j], sum sm_l[g * NH + j], unnormalized output sm_acc[(g * NH + j) * dim ..]) are
// merged into the CTA's f32 partial (row (b * heads_q + h0 + j) * splits + split of part_acc and
// part_ml); the last CTA of the group to count itself done merges the splits' partials into O.
// `sm_w` (NH * DECODE_MAX_SPLITS floats; it may be sm_m, read before the barrier) holds the split
// weights of that merge.
template <bool BF16, int NH>
__device__ __forceinline__ void decode_finish(int groups, const float* sm_m, const float* sm_l,
                                              const float* sm_acc, float* sm_w, float* sm_scale, int* sm_last,
                                              long b, long h0, int nh, long heads_q, long dim, long split,
                                              long splits, long group_id, long len, long per,
                                              float* __restrict__ part_acc, float* __restrict__ part_ml,
                                              int* __restrict__ counters, bits16* __restrict__ o, long o_b,
                                              long o_h) {
    const int d = (int)dim;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
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
        *sm_last = done == (int)splits - 1;
        if (*sm_last) counters[group_id] = 0;  // every CTA of the group has counted: ready for the next launch
    }
    __syncthreads();
    if (!*sm_last) return;
    __threadfence();
    // Only the splits that hold keys (split s does when s * per < len) take part; the others wrote an
    // empty partial, weight 0. Per head (a warp each): the overall max, each split's weight
    // exp2(max_s - max) into sm_w, 1 / the weighted sum.
    const int active = len == 0 ? 0 : (int)min(splits, (len + per - 1) / per);
    for (int j = warp; j < nh; j += warps) {
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
            sm_w[j * DECODE_MAX_SPLITS + sp] = w;
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
        const float* w = sm_w + j * DECODE_MAX_SPLITS;
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
    const DecodeCta x = decode_cta<NH>(k, v, k_b, k_h, v_b, v_h, heads_kv, group, chunks, splits, table, max_pages);
    const long trip = (long)groups * DECODE_UNROLL;
    decode_prefetch(x, lens, cap, splits, trip, 1, d, k_s, v_s, page_size, num_pages);
    const long b = x.b, split = x.split, h0 = x.h0, heads_q = x.heads_q;
    const int nh = x.nh;
    const bits16 *kh = x.kh, *vh = x.vh;
    const int* row_pages = x.row_pages;
    const long pk = x.pk, pv = x.pv;
    const long len = decode_len(lens, b, cap);
    long start, end;
    const long per = decode_split(len, splits, split, trip, 1, &start, &end);

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
    decode_finish<BF16, NH>(groups, sm_m, sm_l, sm_acc, sm_m, sm_scale, &sm_last, b, h0, nh, heads_q, dim,
                            split, splits, x.group_id, len, per, part_acc, part_ml, counters, o, o_b, o_h);
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

// ---- The tensor-core form (sm_80+, head dims 64 and 128): the same CTAs, splits, partials and merge,
// with each warp walking tiles of 8 keys through mma.sync. ----
//
// Per tile of 8 keys a warp computes S = Q K^T as an m16n8k16 product per 16 columns of the head dim
// (rows: the CTA's query heads, at most 8 of the 16; the other rows are zeros), an online softmax on
// S's rows, and O^T += V^T P^T as an m16n8k8 product per 16 output columns (rows: columns of the head
// dim, columns: the heads), so P's weights are already where the product wants them and no register
// holds a row without a head. Lane (g = lane / 4, c = lane % 4) loads key g of the tile for S
// (16-byte loads of columns 32 i + 8 c ..) and keys 2 c, 2 c + 1 for V (columns 64 i + 8 g ..): every
// load of a warp covers whole 32-byte sectors of key rows, and the fragments come straight from the
// loaded registers, since a dot product may take its columns in any order (Q's fragments are loaded
// in the order K's arrive) and O's columns follow V's (lane (g, c) ends with heads 2c and 2c + 1 at
// columns 64 i + 8 g ..). Scores, P's weights and O are f32; P enters the product rounded to the input
// type, as flash attention does. Keys past the split's end are neither loaded nor counted (their
// rows are zeros, their scores -inf).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
template <bool BF16>
__device__ __forceinline__ void mma_16816(float* d, const unsigned int* a, unsigned int b0, unsigned int b1) {
    if (BF16) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                     "{%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                     "{%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

template <bool BF16>
__device__ __forceinline__ void mma_1688(float* d, unsigned int a0, unsigned int a1, unsigned int b0) {
    if (BF16) {
        asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
                     "{%0,%1,%2,%3};"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a0), "r"(a1), "r"(b0));
    } else {
        asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
                     "{%0,%1,%2,%3};"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a0), "r"(a1), "r"(b0));
    }
}

// Two f32 as one register of two 16-bit elements (x in the low half).
template <bool BF16>
__device__ __forceinline__ unsigned int decode_pack2(float x, float y) {
    const unsigned int lo = BF16 ? f32_to_bf16(x) : f32_to_f16(x);
    const unsigned int hi = BF16 ? f32_to_bf16(y) : f32_to_f16(y);
    return lo | (hi << 16);
}

// One tile's loads for lane (g, c): K row t0 + g (D / 32 loads), V rows t0 + 2c and t0 + 2c + 1 (D / 64
// loads each); rows at or past `end` are zeros and not read.
template <int D>
struct DecodeTile {
    uint4 k[D / 32];
    uint4 v[2][D / 64];
};

template <int D>
__device__ __forceinline__ void decode_tile_load(DecodeTile<D>& r, long t0, long end, int g, int c,
                                                 const DecodeCta& x, long k_s, long v_s, long page_size,
                                                 long num_pages) {
    const uint4 zero = uint4{0u, 0u, 0u, 0u};
    // Key t0 + i's row at kb + i * k_s (vb + i * v_s for V): the tile's 8 keys share one page when
    // pages hold a multiple of 8 (t0 is one), so the table is read once a tile.
    long kb = t0 * k_s, vb = t0 * v_s;
    const bool one_page = !x.row_pages || (page_size & 7) == 0;
    if (x.row_pages && one_page && t0 < end) {
        long page, slot;
        decode_page_slot(t0, x.row_pages, page_size, num_pages, false, &page, &slot);
        kb = page * x.pk + slot * k_s;
        vb = page * x.pv + slot * v_s;
    }
    const long tk = t0 + g;
    if (tk < end) {
        const long at = one_page ? kb + g * k_s : decode_key_at(tk, k_s, x.pk, x.row_pages, page_size, num_pages, false);
        const bits16* row = x.kh + at + 8 * c;
#pragma unroll
        for (int i = 0; i < D / 32; ++i) r.k[i] = decode_load16(row + 32 * i);
    } else {
#pragma unroll
        for (int i = 0; i < D / 32; ++i) r.k[i] = zero;
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const long tv = t0 + 2 * c + e;
        if (tv < end) {
            const long at = one_page ? vb + (2 * c + e) * v_s
                                     : decode_key_at(tv, v_s, x.pv, x.row_pages, page_size, num_pages, false);
            const bits16* row = x.vh + at + 8 * g;
#pragma unroll
            for (int i = 0; i < D / 64; ++i) r.v[e][i] = decode_load16(row + 64 * i);
        } else {
#pragma unroll
            for (int i = 0; i < D / 64; ++i) r.v[e][i] = zero;
        }
    }
}

__device__ __forceinline__ unsigned int decode_word(uint4 u, int i) {
    return i == 0 ? u.x : i == 1 ? u.y : i == 2 ? u.z : u.w;
}

template <bool BF16, int NH, int D>
__device__ __forceinline__ void decode_attention_mma(const bits16* __restrict__ q, const bits16* __restrict__ k,
                                                     const bits16* __restrict__ v, long q_b, long q_h, long k_b,
                                                     long k_h, long k_s, long v_b, long v_h, long v_s,
                                                     const int* __restrict__ lens, long cap, long heads_kv,
                                                     long group, long chunks, long splits, float scale_log2,
                                                     float* __restrict__ part_acc, float* __restrict__ part_ml,
                                                     int* __restrict__ counters, bits16* __restrict__ o, long o_b,
                                                     long o_h, const int* __restrict__ table, long max_pages,
                                                     long page_size, long num_pages) {
    __shared__ float sm_m[DECODE_MAX_SPLITS * NH];  // the warps' maxima, then the split weights
    __shared__ float sm_l[DECODE_WARPS * NH];
    __shared__ float sm_acc[DECODE_WARPS * NH * D];
    __shared__ float sm_scale[NH];
    __shared__ int sm_last;
    const DecodeCta x = decode_cta<NH>(k, v, k_b, k_h, v_b, v_h, heads_kv, group, chunks, splits, table, max_pages);
    const long trip = 8 * DECODE_WARPS;  // a tile per warp
    decode_prefetch(x, lens, cap, splits, trip, 8, D, k_s, v_s, page_size, num_pages);
    const long len = decode_len(lens, x.b, cap);
    long start, end;
    const long per = decode_split(len, splits, x.split, trip, 8, &start, &end);

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    // Q's fragments, in the column order K's loads arrive: k-step j = 2 i + h takes columns
    // 32 i + 8 c + 4 h + {0, 1} (low register) and + {2, 3} (high); rows past nh are zeros.
    unsigned int qa[D / 16][4];
    const bool row = g < x.nh;
    const unsigned int* qrow = reinterpret_cast<const unsigned int*>(q + x.b * q_b + (x.h0 + (row ? g : 0)) * q_h);
#pragma unroll
    for (int j = 0; j < D / 16; ++j) {
        const int col = 32 * (j >> 1) + 8 * c + 4 * (j & 1);
        qa[j][0] = row ? qrow[col / 2] : 0u;
        qa[j][1] = 0u;
        qa[j][2] = row ? qrow[col / 2 + 1] : 0u;
        qa[j][3] = 0u;
    }
    float acc[D / 16][4];  // O^T: rows of 16 head-dim columns, columns the heads
#pragma unroll
    for (int n = 0; n < D / 16; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    float m = DECODE_NEG_INF, l = 0.f;  // head g's running max and (this lane's part of the) sum

    DecodeTile<D> cur, next;
    long t0 = start + 8 * warp;
    decode_tile_load<D>(cur, t0, end, g, c, x, k_s, v_s, page_size, num_pages);
    // The trip count is the same for the whole warp (t0 is), so every lane reaches the shuffles.
    for (; t0 < end; t0 += trip) {
        decode_tile_load<D>(next, t0 + trip, end, g, c, x, k_s, v_s, page_size, num_pages);
        float sc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int j = 0; j < D / 16; ++j) {
            const uint4 kw = cur.k[j >> 1];
            const unsigned int b0 = (j & 1) ? kw.z : kw.x, b1 = (j & 1) ? kw.w : kw.y;
            mma_16816<BF16>(sc, qa[j], b0, b1);
        }
        // Head g's scores of keys t0 + 2c, t0 + 2c + 1 (sc[2], sc[3] are row g + 8: no head).
        const float s0 = t0 + 2 * c < end ? sc[0] * scale_log2 : DECODE_NEG_INF;
        const float s1 = t0 + 2 * c + 1 < end ? sc[1] * scale_log2 : DECODE_NEG_INF;
        float mx = fmaxf(s0, s1);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float mn = fmaxf(m, mx);
        // mn is -inf only while no key of the row has been seen: nothing to scale, nothing to add.
        const float cf = mn == DECODE_NEG_INF ? 1.f : exp2f(m - mn);
        const float p0 = mn == DECODE_NEG_INF ? 0.f : exp2f(s0 - mn);
        const float p1 = mn == DECODE_NEG_INF ? 0.f : exp2f(s1 - mn);
        m = mn;
        l = l * cf + p0 + p1;
        // P^T's fragment is (keys 2c, 2c + 1; head g): this lane's weights. Its O^T columns are heads
        // 2c and 2c + 1, whose factors lanes 8c and 8c + 4 hold.
        const unsigned int pb = decode_pack2<BF16>(p0, p1);
        const float cf0 = __shfl_sync(0xffffffffu, cf, 8 * c), cf1 = __shfl_sync(0xffffffffu, cf, 8 * c + 4);
#pragma unroll
        for (int n = 0; n < D / 16; ++n) {
            acc[n][0] *= cf0;
            acc[n][1] *= cf1;
            acc[n][2] *= cf0;
            acc[n][3] *= cf1;
            // V^T's rows g and g + 8 of tile n are columns 64 (n / 4) + 8 g + 2 (n % 4) + {0, 1}:
            // word n % 4 of load n / 4, low and high halves, from keys 2c (low) and 2c + 1 (high).
            const unsigned int w0 = decode_word(cur.v[0][n >> 2], n & 3), w1 = decode_word(cur.v[1][n >> 2], n & 3);
            mma_1688<BF16>(acc[n], __byte_perm(w0, w1, 0x5410), __byte_perm(w0, w1, 0x7632), pb);
        }
        cur = next;
    }
    // Head g's sum over its four lanes; then this warp's softmax state into shared memory.
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (row && c == 0) {
        sm_m[warp * NH + g] = m;
        sm_l[warp * NH + g] = l;
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const int h = 2 * c + e;
        if (h < x.nh) {
            float* dst = sm_acc + (warp * NH + h) * D + 8 * g;
#pragma unroll
            for (int n = 0; n < D / 16; ++n) {
                const int col = 64 * (n >> 2) + 2 * (n & 3);
                dst[col] = acc[n][e];
                dst[col + 1] = acc[n][2 + e];
            }
        }
    }
    decode_finish<BF16, NH>(DECODE_WARPS, sm_m, sm_l, sm_acc, sm_m, sm_scale, &sm_last, x.b, x.h0, x.nh,
                            x.heads_q, D, x.split, splits, x.group_id, len, per, part_acc, part_ml, counters, o,
                            o_b, o_h);
}

#define SDPA_DECODE_MMA(sfx, BF16, NH, D)                                                               \
extern "C" __global__ void __launch_bounds__(DECODE_WARPS * 32, DECODE_MMA_CTAS)                        \
sdpa_decode_mma_##sfx##_h##NH##_d##D(const bits16* q, const bits16* k, const bits16* v, long q_b,       \
                                     long q_h, long k_b, long k_h, long k_s, long v_b, long v_h,        \
                                     long v_s, const int* lens, long cap, long dim, long heads_kv,      \
                                     long group, long chunks, long splits, float scale_log2,            \
                                     float* part_acc, float* part_ml, int* counters, bits16* o,         \
                                     long o_b, long o_h, const int* table, long max_pages,              \
                                     long page_size, long num_pages) {                                  \
    decode_attention_mma<BF16, NH, D>(q, k, v, q_b, q_h, k_b, k_h, k_s, v_b, v_h, v_s, lens, cap,       \
                                      heads_kv, group, chunks, splits, scale_log2, part_acc, part_ml,   \
                                      counters, o, o_b, o_h, table, max_pages, page_size, num_pages);   \
}
#define SDPA_DECODE_MMA_HEADS(sfx, BF16, D)                                                             \
SDPA_DECODE_MMA(sfx, BF16, 1, D)                                                                        \
SDPA_DECODE_MMA(sfx, BF16, 2, D)                                                                        \
SDPA_DECODE_MMA(sfx, BF16, 4, D)                                                                        \
SDPA_DECODE_MMA(sfx, BF16, 8, D)
SDPA_DECODE_MMA_HEADS(bf16, true, 64)
SDPA_DECODE_MMA_HEADS(bf16, true, 128)
SDPA_DECODE_MMA_HEADS(f16, false, 64)
SDPA_DECODE_MMA_HEADS(f16, false, 128)
#endif
