//! Host-to-device uploads through pinned staging buffers ([`Uploader`]): what a model's weights take
//! at load.
//!
//! A copy from pageable host memory goes through the driver's own small staging area and runs at a
//! fraction of the bus's rate (a 15 GB Llama-3.1-8B's weight upload took 3.6-4.3 s on an H200 host
//! that way). Here two
//! pinned buffers take turns: host threads fill one while the copy engine moves the other, and a
//! buffer is refilled once the copy out of it has finished (its event). A tensor made of several host
//! parts (Q, K and V rows into one projection) is uploaded as their concatenation without a host copy
//! of the whole.

use crate::{Cudnn, Element, Error, Result};
use cudarc::driver::{CudaEvent, CudaSlice, DevicePtrMut, PinnedHostSlice};

/// Bytes of each of the two pinned buffers, unless asked otherwise.
pub const DEFAULT_STAGE_BYTES: usize = 64 << 20;

/// Host threads that fill a buffer (each a run of at least [`MIN_THREAD_BYTES`]).
const FILL_THREADS: usize = 4;

/// Fewest bytes a fill thread copies: smaller chunks are copied by the calling thread alone.
const MIN_THREAD_BYTES: usize = 4 << 20;

/// One pinned buffer and the event recorded after the last copy out of it.
struct Stage {
    host: PinnedHostSlice<u8>,
    copied: CudaEvent,
}

/// Uploads host slices into new device buffers on a context's stream through two pinned buffers
/// (see the [module docs](self)). Dropping it waits for the copies still reading its buffers.
pub struct Uploader {
    stages: [Stage; 2],
    turn: usize,
}

impl Uploader {
    /// Two pinned buffers of `stage_bytes` each (at least 4 KiB) on `ctx`'s device.
    pub fn new(ctx: &Cudnn, stage_bytes: usize) -> Result<Self> {
        let bytes = stage_bytes.max(4096);
        let cu = ctx.stream().context();
        let stage = || -> Result<Stage> {
            // SAFETY: the buffer's bytes are unset; `upload` writes every byte it copies out before
            // the copy is enqueued, and nothing else reads them.
            let host = unsafe { cu.alloc_pinned::<u8>(bytes) }?;
            Ok(Stage { host, copied: cu.new_event(None)? })
        };
        Ok(Uploader { stages: [stage()?, stage()?], turn: 0 })
    }

    /// Bytes of each buffer.
    pub fn stage_bytes(&self) -> usize {
        self.stages[0].host.len()
    }

    /// A new device buffer on `ctx`'s stream holding `parts` one after the other. The host slices
    /// may be dropped as soon as this returns; the device buffer is ready in stream order.
    pub fn upload<T: Element>(&mut self, ctx: &Cudnn, parts: &[&[T]]) -> Result<CudaSlice<T>> {
        let len = parts.iter().try_fold(0usize, |n, p| n.checked_add(p.len()));
        let len = len.ok_or_else(|| Error::invalid("upload: the parts' lengths overflow"))?;
        let stream = ctx.stream();
        // SAFETY: every element is written below, in stream order, before the buffer is used; on an
        // error the buffer is dropped unread.
        let mut dst = unsafe { stream.alloc::<T>(len) }?;
        if len == 0 {
            return Ok(dst);
        }
        // Each part's bytes: `Element`s are plain data (`DeviceRepr`, valid as any bit pattern the
        // host holds), so their bytes are what the device gets.
        let bytes: Vec<&[u8]> = parts
            .iter()
            // SAFETY: a `&[T]` of plain-data elements viewed as its `size_of_val` bytes, for as long
            // as the borrow of `parts`.
            .map(|p| unsafe {
                std::slice::from_raw_parts(p.as_ptr().cast::<u8>(), std::mem::size_of_val(*p))
            })
            .collect();
        let total: usize = bytes.iter().map(|b| b.len()).sum();
        let (base, _written) = dst.device_ptr_mut(stream);
        let mut at = Cursor { parts: &bytes, part: 0, offset: 0 };
        let mut sent = 0;
        while sent < total {
            let stage = &mut self.stages[self.turn];
            self.turn ^= 1;
            // The last copy out of this buffer has read it.
            stage.copied.synchronize()?;
            let host = stage.host.as_mut_slice()?;
            let n = host.len().min(total - sent);
            fill(&mut host[..n], &mut at);
            // SAFETY: `base + sent` and the `n` bytes after it lie in `dst` (`sent + n <= total`, the
            // bytes of `len` elements); the source is pinned memory that stays unwritten until the
            // event recorded next has passed (checked above before every refill, and by `Drop`).
            unsafe {
                cudarc::driver::result::memcpy_htod_async(base + sent as u64, &host[..n], stream.cu_stream())
            }?;
            stage.copied.record(stream)?;
            sent += n;
        }
        drop(_written);
        Ok(dst)
    }
}

impl Drop for Uploader {
    fn drop(&mut self) {
        // The buffers are freed after this: wait for the copies still reading them. An error here
        // means the context failed; freeing then is all that is left to do.
        for s in &self.stages {
            let _ = s.copied.synchronize();
        }
    }
}

/// Where the next byte to stage is: part `part`, byte `offset`.
struct Cursor<'a> {
    parts: &'a [&'a [u8]],
    part: usize,
    offset: usize,
}

impl<'a> Cursor<'a> {
    /// The next run of at most `n` bytes of one part (empty at the end).
    fn take(&mut self, n: usize) -> &'a [u8] {
        while self.part < self.parts.len() && self.offset == self.parts[self.part].len() {
            (self.part, self.offset) = (self.part + 1, 0);
        }
        let Some(p) = self.parts.get(self.part) else { return &[] };
        let run = &p[self.offset..(self.offset + n).min(p.len())];
        self.offset += run.len();
        run
    }
}

/// Fills `host` with the next `host.len()` bytes of `at`, on up to [`FILL_THREADS`] threads.
fn fill(host: &mut [u8], at: &mut Cursor<'_>) {
    // Consecutive runs of the parts, each into its own piece of `host`.
    let piece = (host.len() / FILL_THREADS).max(MIN_THREAD_BYTES);
    let mut jobs: Vec<Vec<(&mut [u8], &[u8])>> = Vec::new();
    let mut rest = host;
    while !rest.is_empty() {
        let mut job = Vec::new();
        let mut room = piece.min(rest.len());
        while room > 0 {
            let src = at.take(room);
            if src.is_empty() {
                break; // the caller asks for no more than the parts hold
            }
            let (dst, tail) = std::mem::take(&mut rest).split_at_mut(src.len());
            rest = tail;
            room -= src.len();
            job.push((dst, src));
        }
        if job.is_empty() {
            break;
        }
        jobs.push(job);
    }
    let copy = |job: Vec<(&mut [u8], &[u8])>| job.into_iter().for_each(|(d, s)| d.copy_from_slice(s));
    if jobs.len() == 1 {
        jobs.into_iter().for_each(copy);
        return;
    }
    std::thread::scope(|scope| {
        for job in jobs {
            scope.spawn(move || copy(job));
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bytes `fill` writes over chunks of `chunk` bytes, concatenated.
    fn staged(parts: &[&[u8]], chunk: usize) -> Vec<u8> {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let mut at = Cursor { parts, part: 0, offset: 0 };
        let mut out = Vec::new();
        while out.len() < total {
            let mut host = vec![0xAAu8; chunk.min(total - out.len())];
            fill(&mut host, &mut at);
            out.extend_from_slice(&host);
        }
        out
    }

    #[test]
    fn chunks_hold_the_parts_in_order_across_their_edges() {
        let a: Vec<u8> = (0..100u32).map(|i| i as u8).collect();
        let b: Vec<u8> = (0..7u32).map(|i| 200 + i as u8).collect();
        let c: Vec<u8> = (0..(9 << 20) as u32).map(|i| (i % 251) as u8).collect();
        let small: Vec<u8> = [&a[..], &[], &b[..]].concat();
        for chunk in [1, 3, 64, 100, 107, 4096] {
            assert_eq!(staged(&[&a, &[], &b], chunk), small, "chunk {chunk}");
        }
        // Chunks that fill on several threads, the parts' edges inside them.
        let want: Vec<u8> = [&a[..], &[], &b[..], &c[..], &a[..]].concat();
        for chunk in [4096, (5 << 20) + 3, 8 << 20, 64 << 20] {
            assert_eq!(staged(&[&a, &[], &b, &c, &a], chunk), want, "chunk {chunk}");
        }
        assert!(staged(&[&[], &[]], 8).is_empty());
    }
}
