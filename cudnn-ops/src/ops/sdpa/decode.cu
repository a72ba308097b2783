
// ---- Split-KV decode attention ("flash-decoding", ops/sdpa/decode.rs): one query per sequence. ----

// Warps per CTA of sdpa_decode_* (decode.rs launches DECODE_WARPS * 32 threads), keys each lane group
// loads per loop trip before using them (loads in flight), and the most splits (decode.rs MAX_SPLITS).
#define DECODE_WARPS 4
#define DECODE_UNROLL 4
#define DECODE_MAX_SPLITS 64
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
// that CTA sets back to 0 for the next launch) merges the splits' partials in split order and writes
// O[b, h] at o + b * o_b + h * o_h: acc / sum, or zeros where the sequence has no keys.
// With `table` (paged K/V; may be null) K and V are page pools: key t of sequence b is slot t % page_size
// of page table[b * max_pages + t / page_size] (clamped into the pool's num_pages), at page * k_b +
// slot * k_s (k_b the page stride); without, at b * k_b + t * k_s.
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

    long len = cap;
    if (lens) {
        const long x = lens[b];
        len = x < 0 ? 0 : x > cap ? cap : x;
    }
    const long trip = (long)groups * DECODE_UNROLL;
    long per = (len + splits - 1) / splits;
    per = per < trip ? trip : per;
    const long start = split * per;
    const long end = start + per < len ? start + per : len;

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int grp = warp * (32 / lanes) + lane / lanes, col = (lane % lanes) * 8;

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
    const bits16* kp = k + kvh * k_h + col;
    const bits16* vp = v + kvh * v_h + col;
    if (!table) {
        kp += b * k_b;
        vp += b * v_b;
    }
    const int* row_pages = table ? table + b * max_pages : nullptr;
    // Trip counts are the same for the whole CTA, so every lane reaches the shuffles.
    for (long base = start; base < end; base += trip) {
        uint4 kr[DECODE_UNROLL], vr[DECODE_UNROLL];
#pragma unroll
        for (int u = 0; u < DECODE_UNROLL; ++u) {
            const long t = base + u * groups + grp;
            if (t < end) {
                long ko = t * k_s, vo = t * v_s;
                if (row_pages) {
                    long page = (long)row_pages[t / page_size];
                    page = page < 0 ? 0 : page >= num_pages ? num_pages - 1 : page;
                    const long slot = t % page_size;
                    ko = page * k_b + slot * k_s;
                    vo = page * v_b + slot * v_s;
                }
                kr[u] = decode_load16(kp + ko);
                vr[u] = decode_load16(vp + vo);
            } else {
                kr[u] = uint4{0u, 0u, 0u, 0u};
                vr[u] = kr[u];
            }
        }
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
    // The splits' (max, sum) of each head into shared memory (sm_m, sm_l: their reads are done), then
    // per head the overall max, the splits' weights exp2(max_s - max) and 1 / sum.
    for (int i = threadIdx.x; i < nh * (int)splits; i += blockDim.x) {
        const int j = i / (int)splits, s = i - j * (int)splits;
        const long row = (b * heads_q + h0 + j) * splits + s;
        sm_m[j * DECODE_MAX_SPLITS + s] = __ldcg(part_ml + 2 * row);
        sm_l[j * DECODE_MAX_SPLITS + s] = __ldcg(part_ml + 2 * row + 1);
    }
    __syncthreads();
    if (threadIdx.x < nh) {
        const int j = threadIdx.x;
        float mx = DECODE_NEG_INF, sum = 0.f;
        for (int s = 0; s < (int)splits; ++s) mx = fmaxf(mx, sm_m[j * DECODE_MAX_SPLITS + s]);
        for (int s = 0; s < (int)splits; ++s) {
            const float w = mx == DECODE_NEG_INF ? 0.f : exp2f(sm_m[j * DECODE_MAX_SPLITS + s] - mx);
            sm_m[j * DECODE_MAX_SPLITS + s] = w;
            sum += w * sm_l[j * DECODE_MAX_SPLITS + s];
        }
        sm_scale[j] = mx == DECODE_NEG_INF ? 0.f : 1.f / sum;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < nh * d; i += blockDim.x) {
        const int j = i / d, e = i - j * d;
        const float* src = part_acc + (b * heads_q + h0 + j) * splits * dim + e;
        const float* w = sm_m + j * DECODE_MAX_SPLITS;
        float num = 0.f;
#pragma unroll 8
        for (int s = 0; s < (int)splits; ++s) num += w[s] * __ldcg(src + s * dim);
        const float out = num * sm_scale[j];
        o[b * o_b + (h0 + j) * o_h + e] = BF16 ? f32_to_bf16(out) : f32_to_f16(out);
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
