// ---- Fused RoPE: one kernel, f32 math. ----

// The rotation every kernel below runs on its row: pair p (head h = p / half, element j) of `row`
// (heads `dim` apart) rotates in place by cos `c[j]` and sine `sign * s[j]`, in f32 with one rounding;
// pairs from `q_pairs` on (the K heads, from head q_pairs / half) also go to their head
// `krow + (h - q_pairs / half) * k_stride` (`krow` may be null where q_pairs = pairs). Each thread
// takes pairs first, first + step, ...
#define ROPE_ROTATE_ROW(T, sfx, load, store)                                                              \
__device__ __forceinline__ void rope_rotate_row_##sfx(T* row, int pairs, int q_pairs, int half, int dim,  \
                                                      const float* c, const float* s, float sign,         \
                                                      T* krow, long k_stride, int first, int step) {      \
    for (int p = first; p < pairs; p += step) {                                                           \
        int h = p / half, j = p - h * half;                                                               \
        T* v = row + h * dim;                                                                             \
        float a = load(v[j]), b = load(v[j + half]), cj = c[j], sj = sign * s[j];                         \
        T lo = store(a * cj - b * sj), hi = store(b * cj + a * sj);                                       \
        v[j] = lo;                                                                                        \
        v[j + half] = hi;                                                                                 \
        if (p >= q_pairs) {                                                                               \
            T* k = krow + (long)(h - q_pairs / half) * k_stride;                                          \
            k[j] = lo;                                                                                    \
            k[j + half] = hi;                                                                             \
        }                                                                                                 \
    }                                                                                                     \
}
ROPE_ROTATE_ROW(bits16, bf16, bf16_to_f32, f32_to_bf16)
ROPE_ROTATE_ROW(bits16, f16, f16_to_f32, f32_to_f16)

// Fused RoPE: rotates Q and K heads in place, f32 math, one rounding. Blocks (r, y) per row (token; row r
// is position start + r % seq, rows `ss` elements apart), the gridDim.y blocks of a row splitting its
// (head, pair)s, one pair per thread (a decode step: its single row in one block took 5 us), with
// 32-bit index math (a 64-bit division per element made this kernel three times slower than its
// memory traffic). The first `heads` heads of a row (Q, then K) start at element 0; cos/sin are f32
// [positions, dim / 2]. With `starts` (device i32 [batch]; may be null) sequence b starts at
// starts[b] instead of `start`; with `tokens` (device i32 [2, rows]; may be null) row r is token
// tokens[r] < `sequences` of a packed batch at position tokens[rows + r] (ROPE_TOKEN); a row whose
// position falls outside the tables is left as it is.
// `sign` multiplies the sine: 1 rotates by θ, -1 by -θ (the gradient of the rotation, ops/rope/backward).
// Row r's sequence and position: from the per-token array `tokens` (a packed batch; rows whose
// sequence is outside 0..sequences are skipped), else sequence r / seq at its start (`starts[seqn]`,
// or `start`) plus r % seq. Needs r, seq, start, starts, tokens, sequences in scope.
#define ROPE_TOKEN(seqn, pos)                                                                             \
    if (tokens) {                                                                                         \
        seqn = tokens[r];                                                                                 \
        pos = tokens[gridDim.x + r];                                                                      \
        if (seqn < 0 || seqn >= sequences) return;                                                        \
    } else {                                                                                              \
        seqn = r / seq;                                                                                   \
        pos = (starts ? (long)starts[seqn] : start) + r % seq;                                            \
    }

#define ROPE_FUSED(T, sfx)                                                                                \
extern "C" __global__ void rope_fused_##sfx(T* x, long ss, long seq, long heads, long dim, long start,    \
                                            const int* starts, const int* tokens, long sequences,         \
                                            long positions, const float* cos_t, const float* sin_t,       \
                                            float sign) {                                                 \
    pdl_launch_dependents();                                                                              \
    pdl_wait();                                                                                           \
    long r = blockIdx.x, seqn, pos;                                                                       \
    int half = (int)dim / 2, pairs = (int)heads * half;                                                   \
    ROPE_TOKEN(seqn, pos);                                                                                \
    if (pos < 0 || pos >= positions) return;                                                              \
    const float* c = cos_t + pos * half;                                                                  \
    const float* s = sin_t + pos * half;                                                                  \
    T* row = x + r * ss;                                                                                  \
    int step = (int)(gridDim.y * blockDim.x), first = (int)(blockIdx.y * blockDim.x + threadIdx.x);       \
    rope_rotate_row_##sfx(row, pairs, pairs, half, (int)dim, c, s, sign, nullptr, 0, first, step);        \
}
ROPE_FUSED(bits16, bf16)
ROPE_FUSED(bits16, f16)

// Fused RoPE with the K/V append of a decode step or prefill: rope_fused_*, and the rotated K heads and
// the V heads of each row also go to row `pos` of their sequence's `[max_seq, h_kv * dim]` caches (kc,
// vc), so one launch does what RoPE and two cache-row copies did. Rows whose position falls outside the
// tables or the cache are left as they are and not appended.
#define ROPE_APPEND(T, sfx)                                                                               \
extern "C" __global__ void rope_append_##sfx(T* x, long ss, long seq, long heads_q, long heads_kv,        \
                                             long dim, long start, const int* starts, long positions,     \
                                             const float* cos_t, const float* sin_t, T* kc, T* vc,        \
                                             long max_seq) {                                              \
    pdl_launch_dependents();                                                                              \
    pdl_wait();                                                                                           \
    long r = blockIdx.x, seqn = r / seq;                                                                  \
    int half = (int)dim / 2, q_pairs = (int)heads_q * half;                                               \
    int pairs = (int)(heads_q + heads_kv) * half, kv_cols = (int)(heads_kv * dim);                        \
    long pos = (starts ? (long)starts[seqn] : start) + r % seq;                                           \
    if (pos < 0 || pos >= positions || pos >= max_seq) return;                                            \
    const float* c = cos_t + pos * half;                                                                  \
    const float* s = sin_t + pos * half;                                                                  \
    T* row = x + r * ss;                                                                                  \
    T* krow = kc + (seqn * max_seq + pos) * kv_cols;                                                      \
    T* vrow = vc + (seqn * max_seq + pos) * kv_cols;                                                      \
    int step = (int)(gridDim.y * blockDim.x), first = (int)(blockIdx.y * blockDim.x + threadIdx.x);       \
    rope_rotate_row_##sfx(row, pairs, q_pairs, half, (int)dim, c, s, 1.0f, krow, dim, first, step);       \
    const T* vsrc = row + (heads_q + heads_kv) * dim;                                                     \
    for (int e = first; e < kv_cols; e += step) vrow[e] = vsrc[e];                                        \
}
ROPE_APPEND(bits16, bf16)
ROPE_APPEND(bits16, f16)

// rope_append_* into page pools: the rotated K heads and the V heads of each row go to position `pos`
// of their sequence through the page table (`paged_at`, common.cu; the pools' page, head and slot
// strides, ops/rows/pages.rs), positions per sequence or, with `tokens`, per token (ROPE_TOKEN).
// Rows whose position falls outside the tables or the page table are left as they are and not
// appended.
#define ROPE_APPEND_PAGED(T, sfx)                                                                         \
extern "C" __global__ void rope_append_paged_##sfx(T* x, long ss, long seq, long heads_q, long heads_kv,  \
                                                   long dim, long start, const int* starts,               \
                                                   const int* tokens, long sequences, long positions,     \
                                                   const float* cos_t, const float* sin_t, T* kc, T* vc,  \
                                                   const int* table, long max_pages, long page_size,      \
                                                   long page_stride, long head_stride, long slot_stride,  \
                                                   long head_dim, long num_pages) {                       \
    pdl_launch_dependents();                                                                              \
    pdl_wait();                                                                                           \
    long r = blockIdx.x, seqn, pos;                                                                       \
    int half = (int)dim / 2, q_pairs = (int)heads_q * half;                                               \
    int pairs = (int)(heads_q + heads_kv) * half, kv_cols = (int)(heads_kv * dim);                        \
    ROPE_TOKEN(seqn, pos);                                                                                \
    if (pos < 0 || pos >= positions) return;                                                              \
    const long base = paged_at(table, seqn, pos, max_pages, page_size, page_stride, head_stride,          \
                               slot_stride, num_pages, 0, 0);                                             \
    if (base < 0) return;                                                                                 \
    const float* c = cos_t + pos * half;                                                                  \
    const float* s = sin_t + pos * half;                                                                  \
    T* row = x + r * ss;                                                                                  \
    int step = (int)(gridDim.y * blockDim.x), first = (int)(blockIdx.y * blockDim.x + threadIdx.x);       \
    rope_rotate_row_##sfx(row, pairs, q_pairs, half, (int)dim, c, s, 1.0f, kc + base, head_stride,        \
                          first, step);                                                                   \
    const T* vsrc = row + (heads_q + heads_kv) * dim;                                                     \
    for (int e = first; e < kv_cols; e += step) {                                                         \
        const long h = e / head_dim, j = e - h * head_dim;                                                \
        vc[base + h * head_stride + j] = vsrc[e];                                                         \
    }                                                                                                     \
}
ROPE_APPEND_PAGED(bits16, bf16)
ROPE_APPEND_PAGED(bits16, f16)
