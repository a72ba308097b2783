// ---- Naive LayerNorm: PyTorch eager's layer_norm CUDA kernel, one launch, a block per row. ----
// As eager's vectorized_layer_norm_kernel: the row's statistics in f32 (here two passes, the mean and
// then the biased variance, where eager uses Welford), then y = (x - mean) * rstd * w + b in f32,
// rounded once to the I/O type; the training statistics written by thread 0.

// The sum of every thread's v over the block (blockDim.x a multiple of 32, at most 1024), valid in
// every thread; `shared` holds 33 floats.
__device__ __forceinline__ float layer_norm_block_sum(float v, float* shared) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) shared[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x < 32) {
        v = threadIdx.x < (blockDim.x >> 5) ? shared[threadIdx.x] : 0.f;
        for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
        if (threadIdx.x == 0) shared[32] = v;
    }
    __syncthreads();
    float sum = shared[32];
    __syncthreads();  // the next call reuses `shared`
    return sum;
}

__device__ __forceinline__ float layer_norm_f32_id(float v) { return v; }

#define LAYER_NORM(T, sfx, load, store)                                                                   \
extern "C" __global__ void layer_norm_##sfx(const T* x, const T* w, const T* b, long cols, float eps,    \
                                            T* y, float* mean_out, float* rstd_out) {                    \
    __shared__ float shared[33];                                                                          \
    const T* row = x + (long)blockIdx.x * cols;                                                           \
    float s = 0.f;                                                                                        \
    for (long j = threadIdx.x; j < cols; j += blockDim.x) s += load(row[j]);                              \
    const float mean = layer_norm_block_sum(s, shared) / (float)cols;                                    \
    float q = 0.f;                                                                                        \
    for (long j = threadIdx.x; j < cols; j += blockDim.x) {                                               \
        const float d = load(row[j]) - mean;                                                              \
        q += d * d;                                                                                       \
    }                                                                                                     \
    const float rstd = rsqrtf(layer_norm_block_sum(q, shared) / (float)cols + eps);                      \
    T* out = y + (long)blockIdx.x * cols;                                                                 \
    for (long j = threadIdx.x; j < cols; j += blockDim.x)                                                 \
        out[j] = store((load(row[j]) - mean) * rstd * load(w[j]) + load(b[j]));                          \
    if (threadIdx.x == 0 && mean_out) {                                                                   \
        mean_out[blockIdx.x] = mean;                                                                      \
        rstd_out[blockIdx.x] = rstd;                                                                      \
    }                                                                                                     \
}
LAYER_NORM(bits16, bf16, bf16_to_f32, f32_to_bf16)
LAYER_NORM(bits16, f16, f16_to_f32, f32_to_f16)
LAYER_NORM(float, f32, layer_norm_f32_id, layer_norm_f32_id)
