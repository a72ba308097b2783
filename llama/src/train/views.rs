//! Writable views of the Q, K and V heads of one fused QKV gradient buffer.
//!
//! The attention backward writes dQ, dK and dV with the strides of Q, K and V, which live in one
//! `[tokens, (h_q + 2·h_kv)·d]` buffer (the QKV projection's output), so the three gradients land
//! interleaved in one buffer too, row by row, where RoPE's backward and the projection's backward read
//! them. Their element sets are disjoint, but their address ranges overlap, which cudarc's views (one
//! contiguous range each, split only at a point) cannot express. [`QkvViews`] borrows the buffer
//! mutably once and hands out three views that start at the Q, K and V offsets of the first row and
//! reach to the buffer's end; each op reads and writes only the elements its strides name.

use cudnn_llm_ops::cudarc::driver::{
    CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop,
};
use std::marker::PhantomData;
use std::sync::Arc;

/// A view from `offset` to the end of a buffer that [`QkvViews`] holds mutably borrowed.
pub(crate) struct Strided<'a, T> {
    ptr: u64,
    len: usize,
    stream: &'a Arc<CudaStream>,
    _buffer: PhantomData<&'a mut [T]>,
}

impl<T> DeviceSlice<T> for Strided<'_, T> {
    fn len(&self) -> usize {
        self.len
    }

    fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
}

// The buffer's guard (held by `QkvViews`) waited for its earlier reads and writes when it was taken
// and records the views' writes when it drops; every op runs on that one stream.
impl<T> DevicePtr<T> for Strided<'_, T> {
    fn device_ptr<'b>(&'b self, _stream: &'b CudaStream) -> (u64, SyncOnDrop<'b>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

impl<T> DevicePtrMut<T> for Strided<'_, T> {
    fn device_ptr_mut<'b>(&'b mut self, _stream: &'b CudaStream) -> (u64, SyncOnDrop<'b>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

/// The Q, K and V views of a fused QKV buffer whose rows hold `heads_q` query heads, then `heads_kv`
/// key heads, then `heads_kv` value heads of `head_dim` each.
pub(crate) struct QkvViews<'a, T> {
    /// Q, K and V, each from its first element to the buffer's end.
    pub(crate) views: [Strided<'a, T>; 3],
    _guard: SyncOnDrop<'a>,
}

impl<'a, T> QkvViews<'a, T> {
    /// The views of `buf` (on `stream`, the stream the ops run on). A buffer shorter than one row's Q
    /// and K heads gives empty views (which the ops' length checks refuse).
    pub(crate) fn new(
        buf: &'a mut CudaSlice<T>,
        stream: &'a Arc<CudaStream>,
        heads_q: usize,
        heads_kv: usize,
        head_dim: usize,
    ) -> Self {
        let len = buf.len();
        let (base, guard) = buf.device_ptr_mut(stream);
        let elem = std::mem::size_of::<T>() as u64;
        let view = |offset: usize| {
            let offset = offset.min(len);
            Strided { ptr: base + elem * offset as u64, len: len - offset, stream, _buffer: PhantomData }
        };
        let views = [view(0), view(heads_q * head_dim), view((heads_q + heads_kv) * head_dim)];
        QkvViews { views, _guard: guard }
    }
}
