// ---- Fused attention's helper kernel (run before the cuDNN plan). ----

// Padded attention's sequence lengths, clamped into [0, capacity] in an op-owned buffer: the Q lengths
// at out[0..n], the K/V lengths at out[kv_at..kv_at + n]. cuDNN reads the lengths on the device; a
// length past the capacity would make it read K/V rows (and write O rows) past the buffers.
ELEMENTWISE(clamp_seq_lens, (const int* q, const int* kv, long cap_q, long cap_kv, long kv_at, int* out, long n), {
    long a = q[i], b = kv[i];
    out[i] = (int)(a < 0 ? 0 : a > cap_q ? cap_q : a);
    out[kv_at + i] = (int)(b < 0 ? 0 : b > cap_kv ? cap_kv : b);
})
