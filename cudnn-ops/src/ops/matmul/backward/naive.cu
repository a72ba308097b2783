// ---- Naive SwiGLU backward (matmul/backward/naive.rs): eager autograd's elementwise kernels. ----

__device__ __forceinline__ float swiglu_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

#define SWIGLU_BWD_KERNELS(T, sfx, load, store)                                                     \
/* F.silu(gate), recomputing what MulBackward0 saved */                                            \
ELEMENTWISE(swiglu_bwd_silu_##sfx, (const T* x, T* y, long n),                                     \
            { float v = load(x[i]); y[i] = store(v * swiglu_sigmoid(v)); })                        \
/* torch.ops.aten.silu_backward(grad, gate): grad * s * (1 + x * (1 - s)) */                        \
ELEMENTWISE(swiglu_bwd_silu_backward_##sfx, (const T* g, const T* x, T* y, long n),                \
            { float v = load(x[i]); float s = swiglu_sigmoid(v);                                   \
              y[i] = store(load(g[i]) * s * (1.0f + v * (1.0f - s))); })

SWIGLU_BWD_KERNELS(bits16, bf16, bf16_to_f32, f32_to_bf16)
SWIGLU_BWD_KERNELS(bits16, f16, f16_to_f32, f32_to_f16)
SWIGLU_BWD_KERNELS(float, f32, f32_to_f32, f32_to_f32)
