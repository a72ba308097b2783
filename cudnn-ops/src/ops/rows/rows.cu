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

// cache_rows_16 into a page pool: rows at positions start.. (or starts[b]..) of each sequence go
// through the page table; rows that would land outside the table are skipped.
ELEMENTWISE(cache_rows_paged_16, (const bits16* src, long ss, long seq, long cols, long start, const int* starts,
                                  const int* table, long max_pages, long page_size, long page_stride,
                                  long head_stride, long slot_stride, long head_dim, long num_pages,
                                  bits16* dst, long n), {
    long c = i % cols, r = i / cols;
    long s = r % seq, b = r / seq;
    long pos = (starts ? (long)starts[b] : start) + s;
    long at = paged_at(table, b, pos, max_pages, page_size, page_stride, head_stride, slot_stride, num_pages,
                       c / head_dim, c % head_dim);
    if (at >= 0) dst[at] = src[r * ss + c];
})

// The first `rows` positions of each sequence out of a page pool into a contiguous [batch, max_seq,
// cols] buffer (gather_pages); an entry outside the pool gives zeros.
ELEMENTWISE(gather_rows_paged_16, (const bits16* src, const int* table, long max_pages, long page_size,
                                   long page_stride, long head_stride, long slot_stride, long head_dim,
                                   long num_pages, long cols, long rows, long max_seq, bits16* dst, long n), {
    long c = i % cols, r = i / cols;
    long p = r % rows, b = r / rows;
    long at = paged_at(table, b, p, max_pages, page_size, page_stride, head_stride, slot_stride, num_pages,
                       c / head_dim, c % head_dim);
    dst[(b * max_seq + p) * cols + c] = at >= 0 ? src[at] : (bits16)0;
})
