// ---- RoPE backward (ops/rope/backward): the gradient of a rotation by θ is the rotation by −θ. ----

// Fused: rope_fused_* with sign -1 (fused.cu).

// Eager autograd of out = x·cos + cat(−x₂, x₁)·sin, for a gradient g of out (Q or K heads of a QKV
// gradient, rows `ss` apart), in the I/O dtype, one op per launch:
//   t1 = g·cos            (MulBackward; rope_mul_cos_* of the forward)
//   t2 = g·sin            (MulBackward)
//   t3 = −t2[..., :half]  (NegBackward of −x₂)
//   t4 = cat(t2[..., half:], t3)  (CatBackward and the two SliceBackwards, as one tensor)
//   g_x = t1 + t4         (AccumulateGrad; rope_add_* of the forward, written back in place)
#define ROPE_BACKWARD_EAGER(T, sfx, load, store)                                                          \
ELEMENTWISE(rope_bwd_mul_sin_##sfx, (const T* x, long ss, long seq, long heads, long dim, long start,     \
                                     const T* sin_t, T* t2, long n), {                                    \
    long e = i % dim, r = i / (dim * heads), h = (i / dim) % heads;                                       \
    t2[i] = store(load(x[r * ss + h * dim + e]) * load(sin_t[(start + r % seq) * dim + e]));              \
})                                                                                                        \
ELEMENTWISE(rope_bwd_neg_first_##sfx, (const T* t2, long dim, T* t3, long n), {                           \
    long half = dim / 2, e = i % half, rh = i / half;                                                     \
    t3[i] = store(-load(t2[rh * dim + e]));                                                               \
})                                                                                                        \
ELEMENTWISE(rope_bwd_cat_##sfx, (const T* t2, const T* t3, long dim, T* t4, long n), {                    \
    long half = dim / 2, e = i % dim, rh = i / dim;                                                       \
    t4[i] = e < half ? t2[rh * dim + half + e] : t3[rh * half + e - half];                                \
})
ROPE_BACKWARD_EAGER(bits16, bf16, bf16_to_f32, f32_to_bf16)
ROPE_BACKWARD_EAGER(bits16, f16, f16_to_f32, f32_to_f16)
