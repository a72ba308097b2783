// ---- Decoder row moves, one kernel each on both backends: embedding lookup, KV-cache writes. ----

// embed_tokens(ids): row ids[r] of the [vocab, cols] table to row r of y (16-bit elements). Ids come
// from the device, unchecked by the host: an id outside the vocabulary reads nothing and gives a row
// of zeros (see `embedding` in ops/rows/mod.rs).
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
