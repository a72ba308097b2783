# NCCL through ctypes for the probes (`tp_nccl_register_probe.py`, `tp_symmetric_graph_probe.py`,
# `tp_ce_allgather_probe.py`): the library of the nvidia-nccl-cu13 wheel, the argument types of the calls
# they make, `ok` to turn a status into an exception, the library's version, and bf16 buffers from
# `ncclMemAlloc` as torch tensors.
import ctypes, glob, os
import torch
import nvidia.nccl as nccl_pkg

lib = ctypes.CDLL(sorted(glob.glob(os.path.join(list(nccl_pkg.__path__)[0], "lib", "libnccl.so*")))[0])
vp, sz = ctypes.c_void_p, ctypes.c_size_t
BF16, SUM, WIN_SYMMETRIC = 9, 0, 1


def ok(status, what):
    if status != 0:
        msg = lib.ncclGetErrorString(status)
        raise RuntimeError(f"{what}: {ctypes.cast(msg, ctypes.c_char_p).value.decode()} ({status})")


lib.ncclGetErrorString.restype = vp
lib.ncclAllReduce.argtypes = [vp, vp, sz, ctypes.c_int, ctypes.c_int, vp, vp]
lib.ncclMemAlloc.argtypes = [ctypes.POINTER(vp), sz]
lib.ncclMemFree.argtypes = [vp]
lib.ncclCommRegister.argtypes = [vp, vp, sz, ctypes.POINTER(vp)]
lib.ncclCommDeregister.argtypes = [vp, vp]
lib.ncclCommDestroy.argtypes = [vp]
has_window = hasattr(lib, "ncclCommWindowRegister")
if has_window:
    lib.ncclCommWindowRegister.argtypes = [vp, vp, sz, ctypes.POINTER(vp), ctypes.c_int]
    lib.ncclCommWindowDeregister.argtypes = [vp, vp]
version = ctypes.c_int()
ok(lib.ncclGetVersion(ctypes.byref(version)), "ncclGetVersion")


class Raw:  # a device pointer torch can view (bf16 as int16)
    def __init__(self, ptr, count):
        self.__cuda_array_interface__ = {"shape": (count,), "typestr": "<i2", "data": (ptr, False), "version": 3}


def nccl_alloc(d, count):
    """`count` bf16 elements from ncclMemAlloc on GPU `d`: the pointer and a torch view of them."""
    with torch.cuda.device(d):
        p = vp()
        ok(lib.ncclMemAlloc(ctypes.byref(p), count * 2), "ncclMemAlloc")
        return p, torch.as_tensor(Raw(p.value, count), device=f"cuda:{d}").view(torch.bfloat16)
