//! The NVRTC runtime every custom kernel runs on: one program per op room (the shared helpers of
//! `common.cu`, then the room's `.cu`), compiled to CUBINs in parallel on first use, kept on disk next
//! to the plans ([`store`]) and cached per context, their functions looked up once; launch helpers; the grown-never-shrunk scratch the eager baselines keep their intermediates in; and
//! the cuBLAS GEMM of the naive matmul and attention ([`blas`]).

pub(crate) mod blas;
mod store;

use crate::exec::Exec;
use crate::faults::Zeros;
use crate::{Error, Result};
use cudarc::driver::{CudaFunction, CudaModule, CudaSlice, LaunchConfig, PushKernelArg};
use std::sync::Arc;

use once_cell::unsync::OnceCell;
use std::cell::RefCell;
use std::collections::HashMap;
use std::path::PathBuf;
use std::rc::Rc;

/// Threads per block of the elementwise kernels, and elements each thread handles.
const BLOCK: u32 = 256;
const ITEMS: u32 = 4;

/// The compiled kernels (compiled on the first launch), the scratch memory the eager baselines'
/// intermediates live in, and the buffers fused ops own.
pub struct Kernels {
    /// The kernel cache's folder (in the plan directory when the context had one at its first launch).
    dir: Option<PathBuf>,
    modules: OnceCell<Modules>,
    functions: RefCell<HashMap<String, CudaFunction>>,
    scratch: RefCell<Option<CudaSlice<f32>>>,
    /// The buffers fused ops own, by the name of their [`Owned`] slot (each a `Rc<RefCell<Held<T>>>`).
    owned: RefCell<HashMap<&'static str, Box<dyn std::any::Any>>>,
    /// Custom kernels that ran where a cuDNN plan could have (the decode GEMV), by a hash of their
    /// configuration.
    runs: RefCell<HashMap<u64, KernelRun>>,
}

/// A custom kernel's configuration that a fused op ran in place of a cuDNN plan (the decode GEMV), and
/// how many calls enqueued it: the plan cache lists the plans, this the rest.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct KernelRun {
    /// What ran, e.g. `decode gemv [1, 4096] x [4096, 6144] bf16 epilogue none (gemv_bf16_m1)`.
    pub name: String,
    /// Calls that enqueued it (a captured call counts once, not per replay).
    pub calls: u64,
}

impl Kernels {
    /// An empty registry: nothing compiles here (an op that only needs an op-owned buffer needs no
    /// NVRTC); the programs compile (or load from the kernel cache in `plan_dir`) on the first launch.
    /// The context owns it (`Kernels::get`, in `context.rs`).
    pub(crate) fn new(plan_dir: Option<PathBuf>) -> Self {
        Kernels {
            dir: plan_dir.as_deref().map(store::dir_in),
            modules: OnceCell::new(),
            functions: RefCell::new(HashMap::new()),
            scratch: RefCell::new(None),
            owned: RefCell::new(HashMap::new()),
            runs: RefCell::new(HashMap::new()),
        }
    }

    /// Counts a call of the configuration hashed to `key`, described by `name` (asked on its first).
    pub(crate) fn count_run(&self, key: u64, name: impl FnOnce() -> String) {
        let mut runs = self.runs.borrow_mut();
        runs.entry(key).or_insert_with(|| KernelRun { name: name(), calls: 0 }).calls += 1;
    }

    /// Every configuration counted, sorted by name.
    pub(crate) fn runs(&self) -> Vec<KernelRun> {
        let mut v: Vec<KernelRun> = self.runs.borrow().values().cloned().collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    /// The buffer of `slot` (see [`Owned`]), grown to at least `len` elements (never shrunk; zeroed
    /// when allocated), held by the returned guard until it drops. Only this context's stream uses
    /// it, so stream order alone keeps it safe. A reallocation moves the buffer epoch (a captured graph
    /// holding the old address is stale), and is refused while the stream captures a CUDA graph
    /// (the allocation and its zeroing would be graph nodes that never ran): run the op once before
    /// capturing. Asking for a slot whose guard is alive is an error, not a second buffer.
    pub(crate) fn owned<T>(&self, ctx: &Exec, slot: Owned<T>, len: usize) -> Result<OwnedBuf<T>>
    where
        T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits + 'static,
    {
        let cell: Rc<RefCell<Held<T>>> = {
            let mut slots = self.owned.borrow_mut();
            let any =
                slots.entry(slot.name).or_insert_with(|| Box::new(Rc::new(RefCell::new(Held::<T>::empty()))));
            any.downcast_ref::<Rc<RefCell<Held<T>>>>()
                .ok_or_else(|| {
                    Error::invalid(format!(
                        "op-owned buffer `{}` asked for with another element type",
                        slot.name
                    ))
                })?
                .clone()
        };
        let mut held = cell.borrow_mut();
        if held.in_use {
            return Err(Error::invalid(format!(
                "op-owned buffer `{}` is already in use by this context",
                slot.name
            )));
        }
        if held.buf.as_ref().is_none_or(|s| s.len() < len) {
            let capturing = ctx.stream().capture_status()?;
            if capturing != cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
                return Err(Error::invalid(format!(
                    "op-owned buffer `{}` would grow to {len} elements while the stream captures a CUDA graph; \
                     run the op once before capturing",
                    slot.name
                )));
            }
            held.buf = None;
            // The old buffer is gone whether or not the new one comes: graphs that hold it are stale.
            ctx.bump_epoch();
            held.buf = Some(ctx.stream().zeros::<T>(len.max(1))?);
        }
        held.in_use = true;
        let buf = held.buf.take();
        drop(held);
        Ok(OwnedBuf { buf, cell })
    }

    /// Scratch f32 elements currently held.
    pub(crate) fn scratch_len(&self) -> usize {
        self.scratch.borrow().as_ref().map_or(0, |s| s.len())
    }

    /// The kernel called `name` (looked up once, then cached); the programs compile on the first call.
    fn function(&self, ctx: &Exec, name: &str) -> Result<CudaFunction> {
        if let Some(f) = self.functions.borrow().get(name) {
            return Ok(f.clone());
        }
        let modules = self.modules.get_or_try_init(|| {
            let t = std::time::Instant::now();
            let (modules, detail) = modules(ctx, self.dir.as_deref())?;
            crate::startup::record("kernels", t.elapsed(), detail);
            Ok::<_, Error>(modules)
        })?;
        // The room whose cubin names the kernel, else every room in turn (a name no room defines is
        // "not found" in each; any other error is the driver's). The index keeps lookups from asking
        // modules that lack the name, which compute-sanitizer reports as API errors.
        let mut found = None;
        let rooms = modules.index.get(name).map(std::slice::from_ref).unwrap_or(&[]);
        let order = rooms.iter().copied().chain((0..modules.all.len()).filter(|i| !rooms.contains(i)));
        for i in order {
            match modules.all[i].load_function(name) {
                Ok(f) => {
                    found = Some(f);
                    break;
                }
                Err(e) if e.0 == cudarc::driver::sys::cudaError_enum::CUDA_ERROR_NOT_FOUND => {}
                Err(e) => return Err(e.into()),
            }
        }
        let f = found.ok_or_else(|| Error::Nvrtc(format!("no kernel named {name} in any room's program")))?;
        self.functions.borrow_mut().insert(name.to_string(), f.clone());
        Ok(f)
    }
}

/// The name of a buffer a fused op owns in its context, declared in the op's room next to the code
/// that uses it (`const PARTIALS: Owned<f32> = Owned::new("split-KV decode partials");`) and asked
/// for with [`Kernels::owned`]: no registry lists the ops' buffers.
pub(crate) struct Owned<T> {
    name: &'static str,
    _element: std::marker::PhantomData<fn() -> T>,
}

impl<T> Owned<T> {
    /// The slot called `name` (unique across the crate's ops).
    pub(crate) const fn new(name: &'static str) -> Self {
        Owned { name, _element: std::marker::PhantomData }
    }
}

impl<T> Clone for Owned<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Owned<T> {}

/// A slot's buffer while no guard holds it, and whether one does.
struct Held<T> {
    buf: Option<CudaSlice<T>>,
    in_use: bool,
}

impl<T> Held<T> {
    fn empty() -> Self {
        Held { buf: None, in_use: false }
    }
}

/// An op-owned buffer, held for one call ([`Kernels::owned`]); it goes back to its slot on drop.
pub(crate) struct OwnedBuf<T> {
    buf: Option<CudaSlice<T>>,
    cell: Rc<RefCell<Held<T>>>,
}

impl<T> std::ops::Deref for OwnedBuf<T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        self.buf.as_ref().expect("held until drop")
    }
}

impl<T> std::ops::DerefMut for OwnedBuf<T> {
    fn deref_mut(&mut self) -> &mut CudaSlice<T> {
        self.buf.as_mut().expect("held until drop")
    }
}

impl<T> Drop for OwnedBuf<T> {
    fn drop(&mut self) {
        let mut held = self.cell.borrow_mut();
        held.buf = self.buf.take();
        held.in_use = false;
    }
}

/// The program of each room: `common.cu`, then the room's file.
fn programs() -> impl Iterator<Item = (&'static str, [&'static str; 2])> {
    crate::sources::KERNEL_ROOMS.iter().map(|&(room, text)| (room, [crate::sources::KERNEL_COMMON, text]))
}

/// Compiles the rooms `which` (indices into [`programs`]) for `arch`, on at most as many threads as
/// the machine has cores.
fn compile_rooms(which: &[usize], arch: (i32, i32)) -> Vec<(usize, std::result::Result<Vec<u8>, String>)> {
    let rooms: Vec<_> = programs().collect();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(which.len()).max(1);
    let mut out: Vec<_> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    let mut mine = Vec::new();
                    while let Some(&i) = which.get(next.fetch_add(1, std::sync::atomic::Ordering::Relaxed)) {
                        let (room, [common, text]) = rooms[i];
                        mine.push((
                            i,
                            crate::raw::nvrtc::compile_cubin(&[common, text].concat(), room, arch),
                        ));
                    }
                    mine
                })
            })
            .collect();
        workers.into_iter().flat_map(|w| w.join().expect("an NVRTC thread panicked")).collect()
    });
    out.sort_by_key(|(i, _)| *i);
    out
}

/// Every room's module for this device: its CUBIN from the kernel cache in `dir` where it holds one
/// for this source, options, NVRTC and driver, else compiled (rooms in parallel) and stored there; a
/// cached CUBIN the driver does not load is compiled again and replaced. Also a line saying which.
/// The rooms' loaded modules, and which module defines each kernel name their cubins list.
struct Modules {
    all: Vec<Arc<CudaModule>>,
    index: HashMap<String, usize>,
}

/// The kernel names a cubin defines: each entry function has an ELF section `.text.<name>`, whose name
/// sits NUL-terminated in the section-name table. Other `.text.` sections (device functions kept
/// apart) only add names no launch asks for.
fn kernel_names(cubin: &[u8]) -> Vec<String> {
    const TEXT: &[u8] = b".text.";
    let mut names = Vec::new();
    let mut at = 0;
    while let Some(i) = cubin[at..].windows(TEXT.len()).position(|w| w == TEXT) {
        let start = at + i + TEXT.len();
        let len = cubin[start..]
            .iter()
            .take_while(|&&c| c.is_ascii_alphanumeric() || c == b'_' || c == b'$')
            .count();
        if len > 0 && cubin.get(start + len) == Some(&0) {
            names.push(String::from_utf8_lossy(&cubin[start..start + len]).into_owned());
        }
        at = start;
    }
    names.sort();
    names.dedup();
    names
}

fn modules(ctx: &Exec, dir: Option<&std::path::Path>) -> Result<(Modules, String)> {
    if !crate::raw::nvrtc::library_present() {
        return Err(Error::Nvrtc("libnvrtc.so was not found: install the CUDA 13 NVRTC library".into()));
    }
    let arch = ctx.info().compute_capability;
    let nvrtc = crate::raw::nvrtc::version().map_err(Error::Nvrtc)?;
    let options = crate::raw::nvrtc::options(arch);
    let driver = ctx.info().driver_version;
    let rooms: Vec<_> = programs().collect();
    let keys: Vec<String> =
        rooms.iter().map(|(room, text)| store::key(room, text, &options, nvrtc, driver)).collect();
    let mut notes = Vec::new();
    let mut cubins: Vec<Option<Vec<u8>>> = keys
        .iter()
        .map(|k| match dir.map(|d| store::load(d, k)) {
            Some(store::Lookup::Hit(image)) => Some(image),
            Some(store::Lookup::Unusable(why)) => {
                notes.push(format!("unusable: {why}"));
                None
            }
            _ => None,
        })
        .collect();
    let cached: Vec<bool> = cubins.iter().map(Option::is_some).collect();
    let mut unsaved = None;
    let mut store_compiled = |cubins: &mut Vec<Option<Vec<u8>>>, which: &[usize]| -> Result<()> {
        for (i, cubin) in compile_rooms(which, arch) {
            let cubin = cubin.map_err(Error::Nvrtc)?;
            if let Some(d) = dir {
                if let Err(e) = store::save(d, &keys[i], &cubin) {
                    unsaved.get_or_insert_with(|| format!("not stored in {}: {e}", d.display()));
                }
            }
            cubins[i] = Some(cubin);
        }
        Ok(())
    };
    let missing: Vec<usize> = (0..rooms.len()).filter(|&i| cubins[i].is_none()).collect();
    store_compiled(&mut cubins, &missing)?;
    let load = |cubin: Option<Vec<u8>>| {
        ctx.stream()
            .context()
            .load_module(cudarc::nvrtc::Ptx::from_binary(cubin.expect("loaded or compiled")))
    };
    let mut modules = Vec::with_capacity(rooms.len());
    let mut index = HashMap::new();
    let mut recompiled = 0;
    for i in 0..rooms.len() {
        for name in cubins[i].as_deref().map(kernel_names).unwrap_or_default() {
            index.entry(name).or_insert(i);
        }
        let module = match load(cubins[i].take()) {
            Ok(m) => m,
            Err(e) if cached[i] => {
                notes.push(format!("the cached {} did not load ({e:?}): compiled again", rooms[i].0));
                recompiled += 1;
                store_compiled(&mut cubins, &[i])?;
                load(cubins[i].take())?
            }
            Err(e) => return Err(e.into()),
        };
        modules.push(module);
    }
    let loaded = cached.iter().filter(|&&c| c).count() - recompiled;
    let mut detail = format!(
        "{} rooms: {} compiled (NVRTC {}.{}, sm_{}{}), {loaded} loaded",
        rooms.len(),
        rooms.len() - loaded,
        nvrtc.0,
        nvrtc.1,
        arch.0,
        arch.1
    );
    match dir {
        Some(d) => detail += &format!(" from {}", d.display()),
        None => detail += " (no plan directory: nothing kept on disk)",
    }
    if let Some(first) = notes.first() {
        detail += &format!("; {} note(s), e.g. {first}", notes.len());
    }
    if let Some(why) = unsaved {
        detail += &format!("; {why}");
    }
    Ok((Modules { all: modules, index }, detail))
}

/// A device buffer by address: `len` elements at `addr` on `stream`, for a call that binds a part of a
/// buffer it holds, a second handle on it, or the scratch. It records nothing itself: the borrow it
/// was taken from (or the scratch, owned by the context) orders it on the one stream of the call, and
/// that borrow's guard must outlive every use.
pub(crate) struct View {
    pub(crate) addr: u64,
    pub(crate) len: usize,
    pub(crate) stream: std::sync::Arc<cudarc::driver::CudaStream>,
}

impl<T> cudarc::driver::DeviceSlice<T> for View {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &std::sync::Arc<cudarc::driver::CudaStream> {
        &self.stream
    }
}

impl<T> cudarc::driver::DevicePtr<T> for View {
    fn device_ptr<'a>(
        &'a self,
        _stream: &'a cudarc::driver::CudaStream,
    ) -> (u64, cudarc::driver::SyncOnDrop<'a>) {
        (self.addr, cudarc::driver::SyncOnDrop::Sync(None))
    }
}

impl<T> cudarc::driver::DevicePtrMut<T> for View {
    fn device_ptr_mut<'a>(
        &'a mut self,
        _stream: &'a cudarc::driver::CudaStream,
    ) -> (u64, cudarc::driver::SyncOnDrop<'a>) {
        (self.addr, cudarc::driver::SyncOnDrop::Sync(None))
    }
}

/// Scratch f32 memory of at least `len` elements (grown, never shrunk), as a device address. Like
/// PyTorch's caching allocator, it keeps allocation out of the timed kernels.
pub(crate) fn scratch(ctx: &Exec, kernels: &Kernels, len: usize) -> Result<u64> {
    use cudarc::driver::DevicePtr;
    let mut s = kernels.scratch.borrow_mut();
    if s.as_ref().is_none_or(|s| s.len() < len) {
        *s = None;
        // The old scratch is gone whether or not the new one comes: graphs that hold it are stale.
        ctx.bump_epoch();
        *s = Some(ctx.stream().zeros::<f32>(len)?);
    }
    let slice = s.as_ref().expect("just allocated");
    let (addr, _guard) = slice.device_ptr(ctx.stream());
    Ok(addr)
}

/// The device address of an optional buffer read by a kernel (0, a null pointer, for `None`), with
/// the guard that records the read when it drops.
pub(crate) fn optional_ptr<'a, T>(
    buf: Option<&'a dyn cudarc::driver::DevicePtr<T>>,
    stream: &'a cudarc::driver::CudaStream,
) -> (u64, Option<cudarc::driver::SyncOnDrop<'a>>) {
    match buf {
        Some(b) => {
            let (p, g) = b.device_ptr(stream);
            (p, Some(g))
        }
        None => (0, None),
    }
}

/// The device address of an optional buffer written by a kernel (0, a null pointer, for `None`), with
/// the guard that records the write when it drops.
pub(crate) fn optional_ptr_mut<'a, 'b: 'a, T>(
    buf: Option<&'a mut (dyn cudarc::driver::DevicePtrMut<T> + 'b)>,
    stream: &'a cudarc::driver::CudaStream,
) -> (u64, Option<cudarc::driver::SyncOnDrop<'a>>) {
    match buf {
        Some(b) => {
            let (p, g) = b.device_ptr_mut(stream);
            (p, Some(g))
        }
        None => (0, None),
    }
}

/// A kernel argument: device addresses are passed as 64-bit values.
#[derive(Clone, Copy)]
pub(crate) enum Arg {
    Ptr(u64),
    F32(f32),
    I64(i64),
}

pub(crate) fn launch(
    ctx: &Exec,
    kernels: &Kernels,
    name: &str,
    cfg: LaunchConfig,
    args: &[Arg],
) -> Result<()> {
    let f = kernels.function(ctx, name)?;
    let mut launch = ctx.stream().launch_builder(&f);
    for a in args {
        match a {
            Arg::Ptr(p) => launch.arg(p),
            Arg::F32(v) => launch.arg(v),
            Arg::I64(v) => launch.arg(v),
        };
    }
    // SAFETY: callers pass arguments in the order and types of the kernel's signature in its .cu file,
    // with every pointer covering the elements (or rows) the kernel touches (checked by the op).
    unsafe { launch.launch(cfg) }?;
    Ok(())
}

/// Launches `name` as [`launch`] does, but as a programmatic dependent launch (PDL) where the context
/// allows it ([`Exec::programmatic_launch`]: compute capability 9.0+, not turned off): the kernel may
/// start while the previous kernel on the stream drains. Only for kernels that call `pdl_wait`
/// (`common.cu`) before they touch anything the previous kernel may write, and that read nothing but
/// with L2 prefetches before it; they are correct launched either way (`pdl_wait` returns at once
/// after an ordinary launch).
pub(crate) fn launch_programmatic(
    ctx: &Exec,
    kernels: &Kernels,
    name: &str,
    cfg: LaunchConfig,
    args: &[Arg],
) -> Result<()> {
    if !ctx.programmatic_launch() {
        return launch(ctx, kernels, name, cfg, args);
    }
    let f = kernels.function(ctx, name)?;
    ctx.bind()?;
    let mut params: Vec<*mut std::ffi::c_void> = args
        .iter()
        .map(|a| match a {
            Arg::Ptr(p) => p as *const u64 as *mut std::ffi::c_void,
            Arg::F32(v) => v as *const f32 as *mut std::ffi::c_void,
            Arg::I64(v) => v as *const i64 as *mut std::ffi::c_void,
        })
        .collect();
    // SAFETY: as in `launch`, callers pass the arguments in the order and types of the kernel's
    // signature, every pointer covering what the kernel touches; each parameter pointer points into
    // `args`, borrowed for the call; `f` was loaded in the stream's context, bound just above; and
    // the kernels launched this way wait (`pdl_wait`) before touching what the kernel before them
    // may write (the callers' contract above).
    unsafe {
        crate::raw::driver::launch_programmatic(f.cu_function(), cfg, ctx.stream().cu_stream(), &mut params)
    }
}

/// The kernel-name suffix of `dtype` (its name: `bf16`, `f16`, `f32`) when `allowed` holds it; else
/// an [`Error::NotSupported`] of `op` saying which dtypes of `what` it takes.
pub(crate) fn suffix_of(
    op: &str,
    what: &str,
    dtype: crate::DataType,
    allowed: &[crate::DataType],
) -> Result<&'static str> {
    if allowed.contains(&dtype) {
        return Ok(dtype.name());
    }
    let names: Vec<&str> = allowed.iter().map(|d| d.name()).collect();
    let takes = match names.split_last() {
        Some((last, [])) => last.to_string(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => "nothing".into(),
    };
    Err(crate::Error::NotSupported { op: op.into(), reason: format!("takes {takes} {what}, not {dtype}") })
}

/// The float element types most kernels take.
pub(crate) const FLOATS: [crate::DataType; 3] =
    [crate::DataType::BF16, crate::DataType::F16, crate::DataType::F32];

/// [`suffix_of`] over [`FLOATS`]: `bf16`, `f16` or `f32`.
pub(crate) fn float_suffix(op: &str, what: &str, dtype: crate::DataType) -> Result<&'static str> {
    suffix_of(op, what, dtype, &FLOATS)
}

/// The kernel-name suffix of an FP8 dtype (`e4m3`, `e5m2`); another dtype is
/// [`crate::Error::NotSupported`] naming `op` and `what`.
pub(crate) fn fp8_suffix(op: &str, what: &str, dtype: crate::DataType) -> Result<&'static str> {
    match dtype {
        crate::DataType::F8E4M3 => Ok("e4m3"),
        crate::DataType::F8E5M2 => Ok("e5m2"),
        other => Err(crate::Error::NotSupported {
            op: op.into(),
            reason: format!("takes FP8 {what}, not {other}"),
        }),
    }
}

/// Launches an elementwise kernel over `n` elements: `args`, then `n`. A grid too large for one launch
/// (the kernels have no grid-stride loop) is an error, not a launch that silently covers fewer elements.
pub(crate) fn elementwise(ctx: &Exec, kernels: &Kernels, name: &str, n: usize, args: &[Arg]) -> Result<()> {
    let per_block = (BLOCK * ITEMS) as usize;
    let what = format!("{name}: blocks for {n} elements");
    let cfg = LaunchConfig {
        grid_dim: (crate::checked::launch_dim(&what, n.div_ceil(per_block))?, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut all = args.to_vec();
    all.push(Arg::I64(crate::checked::to_i64(&what, n)?));
    launch(ctx, kernels, name, cfg, &all)
}

#[cfg(test)]
mod tests {
    /// Compiles every kernel where libnvrtc can be loaded (CI fetches it from PyPI; no GPU needed).
    #[test]
    fn kernels_compile_where_nvrtc_is_installed() {
        if !crate::raw::nvrtc::library_present() {
            eprintln!("SKIPPED kernels_compile_where_nvrtc_is_installed: no libnvrtc on the library path");
            return;
        }
        // Each room alone after common.cu (its program), for the architectures the crate runs on, on
        // as many threads as there are cores.
        let all: Vec<usize> = (0..super::programs().count()).collect();
        for cc in [(8, 0), (9, 0)] {
            for (i, cubin) in super::compile_rooms(&all, cc) {
                let room = super::programs().nth(i).unwrap().0;
                if let Err(e) = cubin {
                    panic!("{room} does not compile for sm_{}{}: {e}", cc.0, cc.1);
                }
            }
        }
    }

    /// The kernel names read from a cubin's section names: `.text.<name>` NUL-terminated, nothing else.
    #[test]
    fn kernel_names_are_the_text_sections_of_a_cubin() {
        let fake =
            b"\x7fELF\0.text.pow2_f32\0.nv.info.pow2_f32\0.text.gemv_bf16_m1\0.text.\0.textual\0.text.cut";
        assert_eq!(super::kernel_names(fake), ["gemv_bf16_m1", "pow2_f32"]);
        assert!(super::kernel_names(b"").is_empty());
    }

    /// Where libnvrtc can be loaded: every room's cubin names its kernels, and a kernel name is
    /// defined by one room, or by every room (`common.cu`'s, compiled into each program): a lookup goes
    /// to a room that has it.
    #[test]
    fn each_kernel_name_belongs_to_one_room_or_to_all() {
        if !crate::raw::nvrtc::library_present() {
            eprintln!(
                "SKIPPED each_kernel_name_belongs_to_one_room_or_to_all: no libnvrtc on the library path"
            );
            return;
        }
        let all: Vec<usize> = (0..super::programs().count()).collect();
        let mut rooms_of = std::collections::BTreeMap::<String, Vec<&str>>::new();
        for (i, cubin) in super::compile_rooms(&all, (9, 0)) {
            let room = super::programs().nth(i).unwrap().0;
            let names = super::kernel_names(&cubin.unwrap());
            assert!(!names.is_empty(), "{room}: no kernel names read from its cubin");
            for name in names {
                rooms_of.entry(name).or_default().push(room);
            }
        }
        for (name, rooms) in &rooms_of {
            assert!(rooms.len() == 1 || rooms.len() == all.len(), "kernel {name} is defined by {rooms:?}");
        }
        for (name, rooms) in
            [("pow2_f32", 1), ("mean_rows_f32", 1), ("colsum_bf16_bf16", 1), ("cast_bf16_f32", all.len())]
        {
            assert_eq!(rooms_of.get(name).map(Vec::len), Some(rooms), "{name}: {:?}", rooms_of.get(name));
        }
        println!("{} kernel names in {} rooms", rooms_of.len(), all.len());
    }

    /// Every buffer a fused op owns has a name of its own: two ops declaring one name would share a
    /// buffer (and a counter that must be zero between launches could be left non-zero by the other).
    #[test]
    fn op_owned_buffer_names_are_unique() {
        fn walk(dir: &std::path::Path, names: &mut Vec<(String, String)>) {
            for e in std::fs::read_dir(dir).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    walk(&p, names);
                } else if p.extension().is_some_and(|x| x == "rs") {
                    let text = std::fs::read_to_string(&p).unwrap();
                    for part in text.split("Owned::new(\"").skip(1) {
                        let name = part.split('"').next().unwrap().to_string();
                        names.push((name, p.display().to_string()));
                    }
                }
            }
        }
        let mut names = Vec::new();
        walk(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src"), &mut names);
        // The ops' four, and this file's doc example and test slots.
        assert!(names.len() >= 4, "{names:?}");
        let mut seen = std::collections::HashMap::new();
        for (name, file) in &names {
            if file.ends_with("kernels/mod.rs") || file.ends_with("context.rs") {
                continue; // the doc example and the registry's own test
            }
            if let Some(other) = seen.insert(name.clone(), file.clone()) {
                panic!("op-owned buffer `{name}` is declared in {other} and in {file}");
            }
        }
        assert!(seen.len() >= 4, "{seen:?}");
    }
}
