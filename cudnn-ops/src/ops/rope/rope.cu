
// ---- Decoder-model kernels: embedding lookup, KV-cache writes, rotary embedding. ----

// embed_tokens(ids): row ids[r] of the [vocab, cols] table to row r of y (16-bit elements). Ids come
// from the device, unchecked by the host: an id outside the vocabulary reads nothing and gives a row
// of zeros (see `embedding` in ops/rows.rs).
ELEMENTWISE(embedding_16, (const unsigned* ids, const bits16* table, long vocab, long cols, bits16* y, long n), {
    long id = (long)ids[i / cols];
    y[i] = id < vocab ? table[id * cols + i % cols] : (bits16)0;
})

// Writes `seq` rows of `cols` elements per batch, read with row stride `ss` (a view into the QKV
// buffer), into a cache [batch, max_seq, cols] at rows start.. (StaticCache.update's index_copy_).
// With `starts` (device i32 [batch]; may be null) sequence b starts at starts[b] instead, so a captured
// CUDA graph serves every position; rows that would land outside the cache are skipped.
ELEMENTWISE(cache_rows_16, (const bits16* src, long ss, long seq, long cols, long max_seq, long start,
                            const int* starts, bits16* dst, long n), {
    long c = i % cols, r = i / cols;
    long s = r % seq, b = r / seq;
    long row = (starts ? (long)starts[b] : start) + s;
    if (row >= 0 && row < max_seq) dst[(b * max_seq + row) * cols + c] = src[r * ss + c];
})

// Fused RoPE: rotates Q and K heads in place, f32 math, one rounding. One block per row (token; row r
// is position start + r % seq, rows `ss` elements apart), its threads over the row's (head, pair)s with
// 32-bit index math (a 64-bit division per element made this kernel three times slower than its
// memory traffic). The first `heads` heads of a row (Q, then K) start at element 0; cos/sin are f32
// [positions, dim / 2]. With `starts` (device i32 [batch]; may be null) sequence b starts at
// starts[b] instead of `start`; a row whose position falls outside the tables is left as it is.
#define ROPE_FUSED(T, sfx, load, store)                                                                   \
extern "C" __global__ void rope_fused_##sfx(T* x, long ss, long seq, long heads, long dim, long start,     \
                                            const int* starts, long positions,                            \
                                            const float* cos_t, const float* sin_t) {                     \
    long r = blockIdx.x;                                                                                  \
    int half = (int)dim / 2, pairs = (int)heads * half;                                                   \
    long pos = (starts ? (long)starts[r / seq] : start) + r % seq;                                        \
    if (pos < 0 || pos >= positions) return;                                                              \
    const float* c = cos_t + pos * half;                                                                  \
    const float* s = sin_t + pos * half;                                                                  \
    T* row = x + r * ss;                                                                                  \
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {                                               \
        int h = p / half, j = p - h * half;                                                               \
        T* v = row + h * (int)dim;                                                                        \
        float a = load(v[j]), b = load(v[j + half]), cj = c[j], sj = s[j];                                \
        v[j] = store(a * cj - b * sj);                                                                    \
        v[j + half] = store(b * cj + a * sj);                                                             \
    }                                                                                                     \
}
ROPE_FUSED(bits16, bf16, bf16_to_f32, f32_to_bf16)
ROPE_FUSED(bits16, f16, f16_to_f32, f32_to_f16)

// Hugging Face's apply_rotary_pos_emb as eager runs it on one of Q or K, in the I/O dtype, one op per
// launch: t1 = x * cos; t2 = -x[..., half:]; t3 = cat(t2, x[..., :half]); t4 = t3 * sin; x = t1 + t4.
// x is [rows, heads, dim] with rows `ss` apart; temporaries are packed; cos/sin are [positions, dim]
// in the I/O dtype (both halves, as HF's cat(freqs, freqs)), indexed by position start + row % seq.
#define ROPE_EAGER(T, sfx, load, store)                                                                   \
ELEMENTWISE(rope_mul_cos_##sfx, (const T* x, long ss, long seq, long heads, long dim, long start,         \
                                 const T* cos_t, T* t1, long n), {                                        \
    long e = i % dim, r = i / (dim * heads), h = (i / dim) % heads;                                       \
    t1[i] = store(load(x[r * ss + h * dim + e]) * load(cos_t[(start + r % seq) * dim + e]));              \
})                                                                                                        \
ELEMENTWISE(rope_neg_half_##sfx, (const T* x, long ss, long heads, long dim, T* t2, long n), {            \
    long half = dim / 2, e = i % half, r = i / (half * heads), h = (i / half) % heads;                    \
    t2[i] = store(-load(x[r * ss + h * dim + half + e]));                                                 \
})                                                                                                        \
ELEMENTWISE(rope_cat_##sfx, (const T* t2, const T* x, long ss, long heads, long dim, T* t3, long n), {    \
    long half = dim / 2, e = i % dim, r = i / (dim * heads), h = (i / dim) % heads;                       \
    t3[i] = e < half ? t2[(r * heads + h) * half + e] : x[r * ss + h * dim + e - half];                   \
})                                                                                                        \
ELEMENTWISE(rope_mul_sin_##sfx, (const T* t3, long seq, long heads, long dim, long start,                 \
                                 const T* sin_t, T* t4, long n), {                                        \
    long e = i % dim, r = i / (dim * heads);                                                              \
    t4[i] = store(load(t3[i]) * load(sin_t[(start + r % seq) * dim + e]));                                \
})                                                                                                        \
ELEMENTWISE(rope_add_##sfx, (const T* t1, const T* t4, long ss, long heads, long dim, T* x, long n), {    \
    long e = i % dim, r = i / (dim * heads), h = (i / dim) % heads;                                       \
    x[r * ss + h * dim + e] = store(load(t1[i]) + load(t4[i]));                                           \
})
ROPE_EAGER(bits16, bf16, bf16_to_f32, f32_to_bf16)
ROPE_EAGER(bits16, f16, f16_to_f32, f32_to_f16)

// Padded attention's sequence lengths, clamped into [0, capacity] in an op-owned buffer: the Q lengths
// at out[0..n], the K/V lengths at out[kv_at..kv_at + n]. cuDNN reads the lengths on the device; a
// length past the capacity would make it read K/V rows (and write O rows) past the buffers.
ELEMENTWISE(clamp_seq_lens, (const int* q, const int* kv, long cap_q, long cap_kv, long kv_at, int* out, long n), {
    long a = q[i], b = kv[i];
    out[i] = (int)(a < 0 ? 0 : a > cap_q ? cap_q : a);
    out[kv_at + i] = (int)(b < 0 ? 0 : b > cap_kv ? cap_kv : b);
})
