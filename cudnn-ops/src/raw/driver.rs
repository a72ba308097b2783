//! The CUDA driver calls the crate makes past cudarc's safe layer: library probe, driver version,
//! memory-pool counters, the workspace memset and the programmatic (PDL) kernel launch. Each wrapper is safe: it holds or checks what the
//! call needs (the buffer alive and long enough, out-pointers of the right type).
//!
//! Driver API docs: <https://docs.nvidia.com/cuda/cuda-driver-api/>.

use crate::{Error, Result};
use cudarc::driver::sys::{self, CUmemPool_attribute as P};
use cudarc::driver::{CudaSlice, DevicePtr};
use std::rc::Rc;

/// Whether the driver library (libcuda) can be opened; cudarc panics on its first call otherwise.
pub(crate) fn library_present() -> bool {
    super::library_present("cuda")
}

/// `cuDriverGetVersion()` (e.g. 13000); 0 where the library is missing or the call fails.
pub(crate) fn driver_version() -> i32 {
    if !library_present() {
        return 0;
    }
    let mut v = 0;
    // SAFETY: the library is present (checked above); `v` is a valid out-pointer for an int.
    let _ = unsafe { sys::cuDriverGetVersion(&mut v) };
    v
}

/// The current memory pool of `device` (where cudarc's stream-ordered allocations come from). The
/// caller makes the device's context current.
fn mem_pool(device: sys::CUdevice) -> Result<sys::CUmemoryPool> {
    let mut pool = std::ptr::null_mut();
    // SAFETY: `pool` is a valid out-pointer; an unknown device is an error status, not undefined.
    unsafe { sys::cuDeviceGetMemPool(&mut pool, device).result()? };
    Ok(pool)
}

/// Bytes in use now in `device`'s current memory pool, and the most in use since its high-water
/// mark was last reset. The caller makes the device's context current.
pub(crate) fn pool_usage(device: sys::CUdevice) -> Result<(u64, u64)> {
    let pool = mem_pool(device)?;
    let (mut now, mut high) = (0u64, 0u64);
    // SAFETY: `pool` was just read from the device (a device's pool is not destroyed while its
    // context lives); both attributes are written as one u64 into the pointed-to value.
    unsafe {
        sys::cuMemPoolGetAttribute(pool, P::CU_MEMPOOL_ATTR_USED_MEM_CURRENT, (&mut now as *mut u64).cast())
            .result()?;
        sys::cuMemPoolGetAttribute(pool, P::CU_MEMPOOL_ATTR_USED_MEM_HIGH, (&mut high as *mut u64).cast())
            .result()?;
    }
    Ok((now, high))
}

/// Starts a new high-water mark for [`pool_usage`] at the memory in use now.
pub(crate) fn reset_pool_peak(device: sys::CUdevice) -> Result<()> {
    let pool = mem_pool(device)?;
    let mut zero = 0u64;
    // SAFETY: `pool` as in `pool_usage`; the driver reads this attribute as a u64 and accepts only 0.
    unsafe {
        sys::cuMemPoolSetAttribute(pool, P::CU_MEMPOOL_ATTR_USED_MEM_HIGH, (&mut zero as *mut u64).cast())
            .result()?;
    }
    Ok(())
}

/// The first `bytes` of a device buffer, with the buffer kept alive: a plan's workspace for one
/// execution, which cuDNN before 9.19 needs zeroed before each ([`crate::Features::zeroes_workspace`]).
pub(crate) struct DeviceBytes {
    addr: u64,
    bytes: usize,
    buf: Rc<CudaSlice<u8>>,
}

impl DeviceBytes {
    /// The first `bytes` of `buf`, addressed for work on the buffer's own stream; an error if `buf`
    /// is shorter.
    pub(crate) fn new(buf: Rc<CudaSlice<u8>>, bytes: usize) -> Result<Self> {
        if bytes > buf.len() {
            return Err(Error::invalid(format!("{bytes} bytes asked of a {}-byte buffer", buf.len())));
        }
        let addr = buf.device_ptr(buf.stream()).0;
        Ok(DeviceBytes { addr, bytes, buf })
    }

    /// The device address.
    pub(crate) fn addr(&self) -> u64 {
        self.addr
    }

    /// Enqueues zeroing the bytes on the buffer's stream (`cuMemsetD8Async`).
    pub(crate) fn zero(&self) -> Result<()> {
        let stream = self.buf.stream().cu_stream();
        // SAFETY: `addr` is `buf`'s address, held alive by `self`, and `bytes` <= its length (checked
        // in `new`); u8 zeros are a valid pattern; the memset goes to the stream `buf` was allocated
        // on, as cudarc asks.
        unsafe { cudarc::driver::result::memset_d8_async(self.addr, 0, self.bytes, stream)? };
        Ok(())
    }
}

/// Enqueues `f` on `stream` with `cuLaunchKernelEx` and the programmatic stream serialization
/// attribute (programmatic dependent launch, compute capability 9.0+): the kernel may start once
/// every block of the kernel before it on the stream has started and called
/// `griddepcontrol.launch_dependents` (or exited), and must `griddepcontrol.wait` before it reads or
/// writes anything that kernel may write (`pdl_wait` in `kernels/common.cu`). A CUDA-graph capture
/// records the pair as a programmatic dependency (CUDA 12.3+).
///
/// # Safety
///
/// `params` holds one pointer per kernel parameter, in the order and with the types of `f`'s
/// signature, each pointing to a live value for the duration of the call; `f` belongs to a module
/// loaded in `stream`'s context, which is current on this thread; every pointer the kernel
/// dereferences covers what it touches; and the kernel waits (`griddepcontrol.wait`) before it
/// touches memory the previous kernel on the stream may write.
pub(crate) unsafe fn launch_programmatic(
    f: sys::CUfunction,
    cfg: cudarc::driver::LaunchConfig,
    stream: sys::CUstream,
    params: &mut [*mut std::ffi::c_void],
) -> Result<()> {
    // SAFETY: an all-zero launch attribute is a valid value of the C union (padding and ints).
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let config = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream,
        attrs: &mut attr,
        numAttrs: 1,
    };
    // SAFETY: `config` and `attr` live through the call; the driver copies both before returning.
    // The caller guarantees `f`, `stream`, the current context and `params` as documented above;
    // `extra` is null (parameters come through `params` only).
    unsafe { sys::cuLaunchKernelEx(&config, f, params.as_mut_ptr(), std::ptr::null_mut()).result()? };
    Ok(())
}

/// How many nodes of `graph` (a captured, instantiated graph) launch kernels, and how many nodes it
/// has (a child-graph node counts as one node, its kernels not at all; stream capture makes none).
pub(crate) fn graph_kernels(graph: &cudarc::driver::CudaGraph) -> Result<(usize, usize)> {
    let g = graph.cu_graph();
    let mut count = 0usize;
    // SAFETY: `g` is the live graph `graph` owns; a null node array asks for the count only.
    unsafe { sys::cuGraphGetNodes(g, std::ptr::null_mut(), &mut count).result()? };
    let mut nodes: Vec<sys::CUgraphNode> = vec![std::ptr::null_mut(); count];
    let mut filled = count;
    // SAFETY: `nodes` has room for `filled` handles, which the driver writes.
    unsafe { sys::cuGraphGetNodes(g, nodes.as_mut_ptr(), &mut filled).result()? };
    let mut kernels = 0;
    for &node in &nodes[..filled.min(count)] {
        let mut kind = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        // SAFETY: `node` is a node of the live graph; `kind` a valid out-pointer.
        unsafe { sys::cuGraphNodeGetType(node, &mut kind).result()? };
        kernels += usize::from(kind == sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL);
    }
    Ok((kernels, filled.min(count)))
}
