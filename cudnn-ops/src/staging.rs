//! Host-to-device uploads through pinned staging buffers ([`Uploader`]): what a model's weights take
//! at load.
//!
//! A copy from pageable host memory goes through the driver's own small staging area and runs at a
//! fraction of the bus's rate (a 15 GB Llama-3.1-8B's weight upload took 3.6-4.3 s on an H200 host
//! that way). Here two
//! pinned buffers take turns: host threads fill one while the copy engine moves the other, and a
//! buffer is refilled once the copy out of it has finished (its event). A tensor made of several host
//! parts (Q, K and V rows into one projection) is uploaded as their concatenation without a host copy
//! of the whole, and a part need not be a slice: a [`Source`] writes its values into the pinned
//! buffer as it is staged (a memory-mapped checkpoint's tensor, converted from its file's dtype on the
//! fill threads, so the weights are read straight into the staging buffers).

use crate::{Cudnn, Element, Error, Result};
use cudarc::driver::{CudaEvent, CudaSlice, DevicePtrMut, PinnedHostSlice};

/// Bytes of each of the two pinned buffers, unless asked otherwise.
pub const DEFAULT_STAGE_BYTES: usize = 64 << 20;

/// Most host threads that fill a buffer (each a run of at least [`MIN_THREAD_BYTES`]).
const FILL_THREADS: usize = 8;

/// Fewest bytes a fill thread writes: smaller chunks are written by the calling thread alone.
const MIN_THREAD_BYTES: usize = 4 << 20;

/// Host values an [`Uploader`] stages: a slice (copied), or values made as they are staged, such as a
/// memory-mapped checkpoint's tensor converted from its file's dtype, so that no host copy of the
/// whole is made first. Written from several threads at once, each its own range.
pub trait Source<T>: Sync {
    /// Elements it holds.
    fn len(&self) -> usize;

    /// Whether it holds none.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Writes elements `start..start + out.len()` (within [`Source::len`]) into `out`.
    fn write(&self, start: usize, out: &mut [T]);
}

impl<T: Copy + Sync> Source<T> for &[T] {
    fn len(&self) -> usize {
        <[T]>::len(self)
    }

    fn write(&self, start: usize, out: &mut [T]) {
        out.copy_from_slice(&self[start..start + out.len()]);
    }
}

impl<T: Copy + Sync> Source<T> for Vec<T> {
    fn len(&self) -> usize {
        Vec::len(self)
    }

    fn write(&self, start: usize, out: &mut [T]) {
        out.copy_from_slice(&self[start..start + out.len()]);
    }
}

/// One pinned buffer and the event recorded after the last copy out of it.
struct Stage {
    host: PinnedHostSlice<u8>,
    copied: CudaEvent,
}

/// Uploads host values into new device buffers on a context's stream through two pinned buffers
/// (see the [module docs](self)). Dropping it waits for the copies still reading its buffers.
pub struct Uploader {
    stages: [Stage; 2],
    turn: usize,
    threads: usize,
}

impl Uploader {
    /// Two pinned buffers of `stage_bytes` each (at least 4 KiB) on `ctx`'s device.
    pub fn new(ctx: &Cudnn, stage_bytes: usize) -> Result<Self> {
        let bytes = stage_bytes.max(4096);
        let cu = ctx.stream().context();
        let stage = || -> Result<Stage> {
            // SAFETY: the buffer's bytes are unset; `upload_from` writes every byte it copies out
            // before the copy is enqueued, and nothing else reads them.
            let host = unsafe { cu.alloc_pinned::<u8>(bytes) }?;
            Ok(Stage { host, copied: cu.new_event(None)? })
        };
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(FILL_THREADS);
        Ok(Uploader { stages: [stage()?, stage()?], turn: 0, threads })
    }

    /// Bytes of each buffer.
    pub fn stage_bytes(&self) -> usize {
        self.stages[0].host.len()
    }

    /// A new device buffer on `ctx`'s stream holding `parts` one after the other. The host slices
    /// may be dropped as soon as this returns; the device buffer is ready in stream order.
    pub fn upload<T: Element>(&mut self, ctx: &Cudnn, parts: &[&[T]]) -> Result<CudaSlice<T>> {
        let sources: Vec<&dyn Source<T>> = parts.iter().map(|p| p as &dyn Source<T>).collect();
        self.upload_from(ctx, &sources)
    }

    /// A new device buffer on `ctx`'s stream holding the values of `parts` one after the other, each
    /// written straight into the pinned buffers by the fill threads. The sources may be dropped as
    /// soon as this returns; the device buffer is ready in stream order.
    pub fn upload_from<T: Element>(&mut self, ctx: &Cudnn, parts: &[&dyn Source<T>]) -> Result<CudaSlice<T>> {
        let len = parts.iter().try_fold(0usize, |n, p| n.checked_add(p.len()));
        let len = len.ok_or_else(|| Error::invalid("upload: the parts' lengths overflow"))?;
        let size = std::mem::size_of::<T>();
        let per_stage = self.stage_bytes() / size;
        if len > 0 && per_stage == 0 {
            return Err(Error::invalid(format!(
                "upload: a {size}-byte element does not fit the staging buffers"
            )));
        }
        let stream = ctx.stream();
        // SAFETY: every element is written below, in stream order, before the buffer is used; on an
        // error the buffer is dropped unread.
        let mut dst = unsafe { stream.alloc::<T>(len) }?;
        if len == 0 {
            return Ok(dst);
        }
        let (base, _written) = dst.device_ptr_mut(stream);
        let mut at = Cursor { parts, part: 0, offset: 0 };
        let mut sent = 0;
        while sent < len {
            let stage = &mut self.stages[self.turn];
            self.turn ^= 1;
            // The last copy out of this buffer has read it.
            stage.copied.synchronize()?;
            let bytes = stage.host.as_mut_slice()?;
            let n = per_stage.min(len - sent);
            let host = &mut bytes[..n * size];
            if !(host.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>()) {
                return Err(Error::invalid("upload: a staging buffer is not aligned for its elements"));
            }
            // SAFETY: `host` is `n · size_of::<T>()` bytes aligned for `T` (checked above), borrowed
            // mutably for this view's life; `Element`s are plain data, valid as any bit pattern.
            let values = unsafe { std::slice::from_raw_parts_mut(host.as_mut_ptr().cast::<T>(), n) };
            fill(values, &mut at, self.threads);
            // SAFETY: `base + sent · size` and the `n · size` bytes after it lie in `dst` (`sent + n
            // <= len`); the source is pinned memory that stays unwritten until the event recorded
            // next has passed (checked above before every refill, and by `Drop`).
            unsafe {
                cudarc::driver::result::memcpy_htod_async(
                    base + (sent * size) as u64,
                    &*host,
                    stream.cu_stream(),
                )
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

/// Where the next element to stage is: part `part`, element `offset`.
struct Cursor<'a, 'b, T> {
    parts: &'a [&'b dyn Source<T>],
    part: usize,
    offset: usize,
}

impl<'a, 'b, T> Cursor<'a, 'b, T> {
    /// The next run of at most `n` elements of one part: the part and the run's start and length
    /// (`None` at the end).
    fn take(&mut self, n: usize) -> Option<(&'b dyn Source<T>, usize, usize)> {
        while self.part < self.parts.len() && self.offset == self.parts[self.part].len() {
            (self.part, self.offset) = (self.part + 1, 0);
        }
        let p = *self.parts.get(self.part)?;
        let (start, run) = (self.offset, n.min(p.len() - self.offset));
        self.offset += run;
        Some((p, start, run))
    }
}

/// Fills `host` with the next `host.len()` values of `at`, on up to `threads` threads.
fn fill<T: Send>(host: &mut [T], at: &mut Cursor<'_, '_, T>, threads: usize) {
    // Consecutive runs of the parts, each into its own piece of `host`.
    let min = (MIN_THREAD_BYTES / std::mem::size_of::<T>()).max(1);
    let piece = (host.len() / threads.max(1)).max(min);
    type Job<'h, 'b, T> = Vec<(&'h mut [T], &'b dyn Source<T>, usize)>;
    let mut jobs: Vec<Job<'_, '_, T>> = Vec::new();
    let mut rest = host;
    while !rest.is_empty() {
        let mut job = Vec::new();
        let mut room = piece.min(rest.len());
        while room > 0 {
            let Some((src, start, n)) = at.take(room) else {
                break; // the caller asks for no more than the parts hold
            };
            let (dst, tail) = std::mem::take(&mut rest).split_at_mut(n);
            rest = tail;
            room -= n;
            job.push((dst, src, start));
        }
        if job.is_empty() {
            break;
        }
        jobs.push(job);
    }
    let write = |job: Job<'_, '_, T>| job.into_iter().for_each(|(d, s, start)| s.write(start, d));
    if jobs.len() == 1 {
        jobs.into_iter().for_each(write);
        return;
    }
    std::thread::scope(|scope| {
        for job in jobs {
            scope.spawn(move || write(job));
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The values `fill` writes over chunks of `chunk` values, concatenated.
    fn staged(parts: &[&[u8]], chunk: usize) -> Vec<u8> {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let sources: Vec<&dyn Source<u8>> = parts.iter().map(|p| p as &dyn Source<u8>).collect();
        let mut at = Cursor { parts: &sources, part: 0, offset: 0 };
        let mut out = Vec::new();
        while out.len() < total {
            let mut host = vec![0xAAu8; chunk.min(total - out.len())];
            fill(&mut host, &mut at, FILL_THREADS);
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

    /// Values made as they are staged: element i is `i · 3 + 1`.
    struct Made(usize);

    impl Source<u32> for Made {
        fn len(&self) -> usize {
            self.0
        }

        fn write(&self, start: usize, out: &mut [u32]) {
            for (i, v) in out.iter_mut().enumerate() {
                *v = ((start + i) * 3 + 1) as u32;
            }
        }
    }

    #[test]
    fn made_values_are_staged_from_their_own_offsets_between_slices() {
        let made = Made((3 << 20) + 5);
        let head: Vec<u32> = vec![7, 8, 9];
        let parts: [&dyn Source<u32>; 3] = [&head, &made, &head];
        let want: Vec<u32> = head
            .iter()
            .copied()
            .chain((0..made.0).map(|i| (i * 3 + 1) as u32))
            .chain(head.iter().copied())
            .collect();
        for chunk in [5, 4096, (1 << 20) + 1, 4 << 20] {
            let mut at = Cursor { parts: &parts, part: 0, offset: 0 };
            let mut out = Vec::new();
            while out.len() < want.len() {
                let mut host = vec![0u32; chunk.min(want.len() - out.len())];
                fill(&mut host, &mut at, 4);
                out.extend_from_slice(&host);
            }
            assert_eq!(out, want, "chunk {chunk}");
        }
    }
}
