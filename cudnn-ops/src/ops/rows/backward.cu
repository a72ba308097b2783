// ---- Embedding backward (ops/rows/backward): dtable[ids[r]] += dy[r], f32 accumulation. ----

// Atomic scatter-add (index_add_'s kernel): one thread per element of dy; the order in which rows of
// the same id land is the hardware's, so the low bits of f32 sums vary between runs. Ids outside the
// vocabulary add nothing (the forward gave them a zero row).
#define EMBEDDING_BACKWARD_ATOMIC(T, sfx, load)                                                           \
ELEMENTWISE(embedding_backward_atomic_##sfx, (const unsigned* ids, const T* dy, long vocab, long cols,     \
                                              float* dt, long n), {                                       \
    long id = (long)ids[i / cols];                                                                        \
    if (id < vocab) atomicAdd(dt + id * cols + i % cols, load(dy[i]));                                    \
})
EMBEDDING_BACKWARD_ATOMIC(bits16, bf16, bf16_to_f32)
EMBEDDING_BACKWARD_ATOMIC(bits16, f16, f16_to_f32)
EMBEDDING_BACKWARD_ATOMIC(float, f32, f32_to_f32)

// Deterministic, sort-free: block b owns vocabulary rows [b·EMB_TILE, (b + 1)·EMB_TILE) and is the
// only writer of their gradient, so it needs no atomics. It scans all ids in segments of EMB_SEG
// tokens, compacts the tokens whose id falls in its tile into a shared list in token order (a
// block-wide ballot prefix), then adds their dy rows, thread c owning columns c, c + blockDim, ...:
// every element is a sum in token order, the same bits on every run (and the order a sequential CPU
// loop uses). Scanning costs (vocab / EMB_TILE) · rows id reads, from L2; a tile holding most tokens
// (one very frequent id) serializes on its block.
#define EMB_TILE 32
#define EMB_SEG 4096
#define EMBEDDING_BACKWARD_DET(T, sfx, load)                                                              \
extern "C" __global__ void embedding_backward_det_##sfx(const unsigned* ids, long rows, const T* dy,      \
                                                        long vocab, long cols, float* dt, long accumulate) { \
    __shared__ int list[EMB_SEG];                                                                         \
    __shared__ int warp_hits[32];                                                                         \
    __shared__ int listed;                                                                                \
    long v0 = (long)blockIdx.x * EMB_TILE, v1 = v0 + EMB_TILE < vocab ? v0 + EMB_TILE : vocab;            \
    if (!accumulate)                                                                                      \
        for (long k = threadIdx.x; k < (v1 - v0) * cols; k += blockDim.x) dt[v0 * cols + k] = 0.f;        \
    __syncthreads();                                                                                      \
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;                                                 \
    for (long seg = 0; seg < rows; seg += EMB_SEG) {                                                      \
        long seg_end = seg + EMB_SEG < rows ? seg + EMB_SEG : rows;                                       \
        if (threadIdx.x == 0) listed = 0;                                                                 \
        __syncthreads();                                                                                  \
        for (long base = seg; base < seg_end; base += blockDim.x) {                                       \
            long r = base + threadIdx.x;                                                                  \
            long id = r < seg_end ? (long)ids[r] : -1;                                                    \
            bool hit = id >= v0 && id < v1;                                                               \
            unsigned ballot = __ballot_sync(0xffffffffu, hit);                                            \
            if (lane == 0) warp_hits[warp] = __popc(ballot);                                              \
            __syncthreads();                                                                              \
            int at = listed;                                                                              \
            for (int w = 0; w < warp; ++w) at += warp_hits[w];                                            \
            if (hit) list[at + __popc(ballot & ((1u << lane) - 1u))] = (int)(r - seg);                    \
            __syncthreads();                                                                              \
            if (threadIdx.x == 0)                                                                         \
                for (int w = 0; w < (int)(blockDim.x >> 5); ++w) listed += warp_hits[w];                  \
            __syncthreads();                                                                              \
        }                                                                                                 \
        for (int k = 0; k < listed; ++k) {                                                                \
            long r = seg + list[k];                                                                       \
            float* out = dt + (long)ids[r] * cols;                                                        \
            const T* in = dy + r * cols;                                                                  \
            for (long c = threadIdx.x; c < cols; c += blockDim.x) out[c] += load(in[c]);                  \
        }                                                                                                 \
        __syncthreads();                                                                                  \
    }                                                                                                     \
}
EMBEDDING_BACKWARD_DET(bits16, bf16, bf16_to_f32)
EMBEDDING_BACKWARD_DET(bits16, f16, f16_to_f32)
EMBEDDING_BACKWARD_DET(float, f32, f32_to_f32)

// ---- The eager baseline: embedding_dense_backward (zeros, sort, segment reduction). ----

// torch.sort of the ids, stable, with their positions (cub's radix sort in PyTorch): the rank of
// token r is the number of ids below its own plus the equal ids before it, counted over tiles of ids
// in shared memory. An id outside the vocabulary sorts as `vocab` (last) and is skipped by the sum.
extern "C" __global__ void embedding_eager_sort(const unsigned* ids, long rows, long vocab, int* sorted, int* order) {
    __shared__ unsigned tile[256];
    long r = (long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned key = r < rows ? ((long)ids[r] < vocab ? ids[r] : (unsigned)vocab) : 0u;
    long rank = 0;
    for (long base = 0; base < rows; base += blockDim.x) {
        long j = base + threadIdx.x;
        unsigned k = j < rows ? ids[j] : 0u;
        tile[threadIdx.x] = (long)k < vocab ? k : (unsigned)vocab;
        __syncthreads();
        long count = rows - base < (long)blockDim.x ? rows - base : (long)blockDim.x;
        for (long q = 0; q < count; ++q) {
            unsigned other = tile[q];
            rank += other < key || (other == key && base + q < r);
        }
        __syncthreads();
    }
    if (r < rows) { sorted[rank] = (int)key; order[rank] = (int)r; }
}

// The segment reduction (PyTorch's compute_grad_weight and sum_and_scatter in one): the thread of
// column c at the first sorted position of a run of equal ids sums the run's dy rows in sorted
// (token) order in f32 and adds the sum to that id's gradient row.
#define EMBEDDING_EAGER_SEGMENT_SUM(T, sfx, load)                                                         \
ELEMENTWISE(embedding_eager_segment_sum_##sfx, (const int* sorted, const int* order, long rows,            \
                                                const T* dy, long vocab, long cols, float* dt, long n), {  \
    long p = i / cols, c = i % cols;                                                                      \
    int id = sorted[p];                                                                                   \
    if ((long)id < vocab && (p == 0 || sorted[p - 1] != id)) {                                            \
        float acc = 0.f;                                                                                  \
        for (long q = p; q < rows && sorted[q] == id; ++q) acc += load(dy[(long)order[q] * cols + c]);    \
        dt[(long)id * cols + c] += acc;                                                                   \
    }                                                                                                     \
})
EMBEDDING_EAGER_SEGMENT_SUM(bits16, bf16, bf16_to_f32)
EMBEDDING_EAGER_SEGMENT_SUM(bits16, f16, f16_to_f32)
EMBEDDING_EAGER_SEGMENT_SUM(float, f32, f32_to_f32)
