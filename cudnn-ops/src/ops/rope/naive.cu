// ---- Naive RoPE: apply_rotary_pos_emb as eager runs it, five kernels per Q or K. ----

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
