//! Reading CUPTI activity records out of raw buffer bytes, and matching kernels to their launch calls.
//!
//! Nothing here calls CUPTI: the buffer walk (`cuptiActivityGetNextRecord`, which alone knows each
//! record's size) yields record offsets, and [`parse_records`] reads the fields the profiler needs from
//! the bytes at those offsets, by the offsets of the bindgen structs. Only the leading fields of a kernel
//! record are read (up to `name`); they sit at the same offsets in every `CUpti_ActivityKernel4` to
//! `CUpti_ActivityKernel10`, so a library that emits a longer, newer record is read correctly too.

use crate::bindings::{CUpti_Activity, CUpti_ActivityAPI, CUpti_ActivityKernel10, CUpti_ActivityKind};
use crate::KernelRecord;
use std::collections::HashMap;
use std::ffi::{c_char, CStr};
use std::mem::{offset_of, size_of};

/// Bytes of a kernel record that are read: everything up to and including the `name` pointer.
const KERNEL_PREFIX: usize = offset_of!(CUpti_ActivityKernel10, name) + size_of::<*const c_char>();
/// Bytes of an API record that are read (the whole record).
const API_SIZE: usize = size_of::<CUpti_ActivityAPI>();

// The offsets read below, pinned to the values gcc's `offsetof` gives for the CUPTI 13.0.85 headers
// (x86-64). bindgen's layout assertions in `bindings.rs` check the whole structs against clang; these
// pin the prefix the parser relies on, which is identical in CUpti_ActivityKernel4..10 (checked with gcc
// against `cupti_activity_deprecated.h`), so a change here means the record format changed.
const _: () = {
    assert!(offset_of!(CUpti_Activity, kind) == 0);
    assert!(offset_of!(CUpti_ActivityKernel10, kind) == 0);
    assert!(offset_of!(CUpti_ActivityKernel10, start) == 16);
    assert!(offset_of!(CUpti_ActivityKernel10, end) == 24);
    assert!(offset_of!(CUpti_ActivityKernel10, deviceId) == 40);
    assert!(offset_of!(CUpti_ActivityKernel10, correlationId) == 92);
    assert!(offset_of!(CUpti_ActivityKernel10, name) == 104);
    assert!(KERNEL_PREFIX == 112);
    assert!(size_of::<CUpti_ActivityKernel10>() == 216);
    assert!(offset_of!(CUpti_ActivityAPI, kind) == 0);
    assert!(offset_of!(CUpti_ActivityAPI, cbid) == 4);
    assert!(offset_of!(CUpti_ActivityAPI, start) == 8);
    assert!(offset_of!(CUpti_ActivityAPI, end) == 16);
    assert!(offset_of!(CUpti_ActivityAPI, correlationId) == 32);
    assert!(API_SIZE == 40);
    assert!(size_of::<CUpti_ActivityKind>() == 4);
};

/// A kernel record as read from a buffer, before its launch call is matched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RawKernel {
    pub name: String,
    pub start_ns: u64,
    pub end_ns: u64,
    pub device: u32,
    pub correlation_id: u32,
}

/// The part of a driver or runtime API record used to time a launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ApiCall {
    pub correlation_id: u32,
    /// Host time the call was entered (CUPTI clock, ns).
    pub start_ns: u64,
}

/// What one buffer held, reduced to what the profiler needs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Parsed {
    pub kernels: Vec<RawKernel>,
    pub api: Vec<ApiCall>,
    /// Records of other kinds, skipped.
    pub other: usize,
    /// Records shorter than their kind requires, or offsets outside the buffer.
    pub unreadable: usize,
}

/// The name given to a kernel record whose `name` pointer is null.
pub(crate) const UNNAMED: &str = "(unnamed kernel)";

fn u32_at(rec: &[u8], off: usize) -> u32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&rec[off..off + 4]);
    u32::from_ne_bytes(b)
}

fn u64_at(rec: &[u8], off: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&rec[off..off + 8]);
    u64::from_ne_bytes(b)
}

/// Reads the records at `offsets` (each the start of one record) in `buf`, the valid bytes of one
/// activity buffer. Kernel names are copied.
///
/// # Safety
/// The `name` field of every kernel record (kind `CONCURRENT_KERNEL` or `KERNEL`) in `buf` at the
/// given offsets must be null or point to a NUL-terminated string readable for the duration of the
/// call (CUPTI's name pointers stay valid for the life of the process).
pub(crate) unsafe fn parse_records(buf: &[u8], offsets: impl IntoIterator<Item = usize>) -> Parsed {
    let mut out = Parsed::default();
    for off in offsets {
        let Some(rec) = buf.get(off..) else {
            out.unreadable += 1;
            continue;
        };
        if rec.len() < size_of::<CUpti_ActivityKind>() {
            out.unreadable += 1;
            continue;
        }
        let kind = CUpti_ActivityKind(u32_at(rec, offset_of!(CUpti_Activity, kind)));
        match kind {
            CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL
            | CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_KERNEL => {
                if rec.len() < KERNEL_PREFIX {
                    out.unreadable += 1;
                    continue;
                }
                let name_off = offset_of!(CUpti_ActivityKernel10, name);
                // SAFETY: `rec` has at least KERNEL_PREFIX = name_off + size_of pointer bytes (checked
                // above), so the unaligned read stays inside the slice; any bit pattern is a valid
                // pointer value.
                let name_ptr = unsafe { rec.as_ptr().add(name_off).cast::<*const c_char>().read_unaligned() };
                let name = if name_ptr.is_null() {
                    UNNAMED.to_string()
                } else {
                    // SAFETY: the caller guarantees a non-null name pointer in a kernel record points
                    // to a NUL-terminated string that is readable now; it is copied before returning.
                    unsafe { CStr::from_ptr(name_ptr) }.to_string_lossy().into_owned()
                };
                out.kernels.push(RawKernel {
                    name,
                    start_ns: u64_at(rec, offset_of!(CUpti_ActivityKernel10, start)),
                    end_ns: u64_at(rec, offset_of!(CUpti_ActivityKernel10, end)),
                    device: u32_at(rec, offset_of!(CUpti_ActivityKernel10, deviceId)),
                    correlation_id: u32_at(rec, offset_of!(CUpti_ActivityKernel10, correlationId)),
                });
            }
            CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_DRIVER
            | CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_RUNTIME => {
                if rec.len() < API_SIZE {
                    out.unreadable += 1;
                    continue;
                }
                out.api.push(ApiCall {
                    correlation_id: u32_at(rec, offset_of!(CUpti_ActivityAPI, correlationId)),
                    start_ns: u64_at(rec, offset_of!(CUpti_ActivityAPI, start)),
                });
            }
            _ => out.other += 1,
        }
    }
    out
}

/// Gives every kernel the start time of the API call with its correlation id (the earliest, should a
/// runtime and a driver record share one). Returns the kernels, sorted by GPU start, and how many found
/// no API record (their `launch_ns` is 0).
pub(crate) fn match_launches(kernels: Vec<RawKernel>, api: &[ApiCall]) -> (Vec<KernelRecord>, usize) {
    let mut launch: HashMap<u32, u64> = HashMap::with_capacity(api.len());
    for a in api {
        launch.entry(a.correlation_id).and_modify(|t| *t = (*t).min(a.start_ns)).or_insert(a.start_ns);
    }
    let mut unmatched = 0;
    let mut out: Vec<KernelRecord> = kernels
        .into_iter()
        .map(|k| {
            let launch_ns = launch.get(&k.correlation_id).copied().unwrap_or_else(|| {
                unmatched += 1;
                0
            });
            KernelRecord { name: k.name, launch_ns, start_ns: k.start_ns, end_ns: k.end_ns, device: k.device }
        })
        .collect();
    out.sort_by_key(|k| (k.start_ns, k.end_ns));
    (out, unmatched)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::ffi::CString;

    /// Builds activity buffers in place from the bindgen structs, 8-byte aligned like CUPTI's.
    pub(crate) struct BufferBuilder {
        words: Vec<u64>,
        pub offsets: Vec<usize>,
        /// The `deviceId` of the kernel records pushed from now on.
        device: u32,
    }

    impl BufferBuilder {
        pub(crate) fn new() -> Self {
            Self { words: Vec::new(), offsets: Vec::new(), device: 0 }
        }

        /// Appends a zeroed record of `T`'s size and returns a pointer to it for the caller to fill.
        fn push<T>(&mut self) -> *mut T {
            let off = self.words.len() * 8;
            self.words.resize(self.words.len() + size_of::<T>().div_ceil(8), 0);
            self.offsets.push(off);
            // SAFETY: the words just added start at byte `off` and cover size_of::<T>() bytes; the
            // pointer is 8-byte aligned, which every record struct needs (align 8).
            unsafe { self.words.as_mut_ptr().cast::<u8>().add(off).cast::<T>() }
        }

        pub(crate) fn kernel(
            &mut self,
            name: Option<&CString>,
            start: u64,
            end: u64,
            corr: u32,
        ) -> &mut Self {
            let p = self.push::<CUpti_ActivityKernel10>();
            // SAFETY: `p` points to zeroed, writable, aligned memory of the struct's size inside
            // `self.words`; fields are assigned by place (no references into the packed struct).
            unsafe {
                (*p).kind = CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL;
                (*p).start = start;
                (*p).end = end;
                (*p).completed = end;
                (*p).correlationId = corr;
                (*p).deviceId = self.device;
                (*p).gridX = 7;
                (*p).name = name.map_or(std::ptr::null(), |n| n.as_ptr());
                (*p).graphNodeId = 0xdead_beef;
            }
            self
        }

        /// Kernel records pushed from now on ran on GPU `device`.
        pub(crate) fn on_device(&mut self, device: u32) -> &mut Self {
            self.device = device;
            self
        }

        pub(crate) fn api(&mut self, kind: CUpti_ActivityKind, start: u64, end: u64, corr: u32) -> &mut Self {
            let p = self.push::<CUpti_ActivityAPI>();
            // SAFETY: as in `kernel`.
            unsafe {
                (*p).kind = kind;
                (*p).cbid = 307;
                (*p).start = start;
                (*p).end = end;
                (*p).processId = 1;
                (*p).threadId = 2;
                (*p).correlationId = corr;
            }
            self
        }

        /// A record of another kind (a memcpy record's first 48 bytes).
        pub(crate) fn other(&mut self) -> &mut Self {
            let p = self.push::<[u64; 6]>();
            // SAFETY: `p` points to 48 zeroed, aligned bytes inside `self.words`.
            unsafe {
                (*p)[0] = CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_MEMCPY.0 as u64;
                (*p)[1] = 99;
            }
            self
        }

        pub(crate) fn bytes(&self) -> &[u8] {
            // SAFETY: every byte of `words` is initialised (zeroes or written fields); u8 has no
            // alignment or validity requirements; the slice borrows `self`.
            unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast::<u8>(), self.words.len() * 8) }
        }
    }

    #[test]
    fn kernel_gets_launch_time_from_matching_api_record() {
        let gemm = CString::new("sm90_xmma_gemm_f16f16_f32").unwrap();
        let norm = CString::new("rmsnorm_kernel").unwrap();
        let mut b = BufferBuilder::new();
        b.api(CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_DRIVER, 1_000, 1_200, 41)
            .other()
            .kernel(Some(&gemm), 5_000, 9_000, 41)
            .on_device(1)
            .kernel(Some(&norm), 3_000, 4_000, 77);
        // SAFETY: kernel name pointers point to the CStrings above, alive for the call.
        let parsed = unsafe { parse_records(b.bytes(), b.offsets.iter().copied()) };
        assert_eq!(parsed.other, 1);
        assert_eq!(parsed.unreadable, 0);
        assert_eq!(parsed.api, [ApiCall { correlation_id: 41, start_ns: 1_000 }]);
        assert_eq!(parsed.kernels.len(), 2);
        assert_eq!(
            parsed.kernels[0],
            RawKernel {
                name: gemm.to_str().unwrap().into(),
                start_ns: 5_000,
                end_ns: 9_000,
                device: 0,
                correlation_id: 41
            }
        );
        let (kernels, unmatched) = match_launches(parsed.kernels, &parsed.api);
        assert_eq!(unmatched, 1);
        // Sorted by GPU start: the unmatched one first.
        assert_eq!(
            kernels,
            [
                KernelRecord {
                    name: "rmsnorm_kernel".into(),
                    launch_ns: 0,
                    start_ns: 3_000,
                    end_ns: 4_000,
                    device: 1
                },
                KernelRecord {
                    name: "sm90_xmma_gemm_f16f16_f32".into(),
                    launch_ns: 1_000,
                    start_ns: 5_000,
                    end_ns: 9_000,
                    device: 0
                },
            ]
        );
    }

    #[test]
    fn runtime_records_match_and_earliest_call_wins() {
        let k = CString::new("k").unwrap();
        let mut b = BufferBuilder::new();
        b.kernel(Some(&k), 500, 600, 5)
            .api(CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_RUNTIME, 100, 150, 5)
            .api(CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_DRIVER, 110, 140, 5)
            .kernel(None, 700, 800, 6)
            .api(CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_RUNTIME, 200, 250, 6);
        // SAFETY: the one non-null name points to `k`, alive for the call.
        let parsed = unsafe { parse_records(b.bytes(), b.offsets.iter().copied()) };
        let (kernels, unmatched) = match_launches(parsed.kernels, &parsed.api);
        assert_eq!(unmatched, 0);
        assert_eq!(kernels[0].launch_ns, 100);
        assert_eq!(
            kernels[1],
            KernelRecord { name: UNNAMED.into(), launch_ns: 200, start_ns: 700, end_ns: 800, device: 0 }
        );
    }

    #[test]
    fn short_records_and_bad_offsets_are_counted_not_read() {
        let mut b = BufferBuilder::new();
        b.api(CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_DRIVER, 1, 2, 3);
        let bytes = b.bytes();
        // An API record cut short, an offset past the end, and a kernel kind with too few bytes.
        let mut kernel_head = [0u8; 64];
        kernel_head[..4]
            .copy_from_slice(&CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL.0.to_ne_bytes());
        // SAFETY: no kernel record is long enough to have its name read.
        let parsed = unsafe { parse_records(&bytes[..API_SIZE - 1], [0, 1000]) };
        assert_eq!(parsed, Parsed { unreadable: 2, ..Parsed::default() });
        // SAFETY: as above.
        let parsed = unsafe { parse_records(&kernel_head, [0]) };
        assert_eq!(parsed.unreadable, 1);
        // A record of an unknown (newer) kind is skipped, never misread.
        let mut unknown = [0u8; 16];
        unknown[..4].copy_from_slice(&0x7fff_0000u32.to_ne_bytes());
        // SAFETY: not a kernel record.
        let parsed = unsafe { parse_records(&unknown, [0]) };
        assert_eq!(parsed, Parsed { other: 1, ..Parsed::default() });
    }

    #[test]
    fn a_longer_newer_kernel_record_reads_the_same() {
        // A record larger than CUpti_ActivityKernel10 (a future Kernel11 appends fields): only the
        // prefix is read.
        let k = CString::new("future").unwrap();
        let mut b = BufferBuilder::new();
        b.kernel(Some(&k), 10, 20, 1).other();
        let bytes = b.bytes();
        // SAFETY: the name points to `k`.
        let parsed = unsafe { parse_records(bytes, [0]) };
        assert_eq!(parsed.kernels[0].name, "future");
        assert_eq!((parsed.kernels[0].start_ns, parsed.kernels[0].end_ns), (10, 20));
    }
}
