# Does registering the all-reduce buffer with NCCL make the two-GPU all-reduce faster? One process, two GPUs,
# NCCL through ctypes (the venv's libnccl, `nccl_ctypes.py`), torch only for memory, streams and CUDA events.
# Cases, each in place: a cudaMalloc'd buffer (torch), the same registered with ncclCommRegister, a buffer from
# ncclMemAlloc, the same registered, and the same in a symmetric window. Sizes: one decode row (1 x 4096
# bf16), one TP2 prefill block (2048 x 4096) and 64 MB. Prints a table row per case and size (median of the
# rounds, each the mean of `n` back-to-back all-reduces on both GPUs, the slower GPU counting) and checks
# every case's sum exactly (small integers).
import ctypes, os, statistics, sys
import torch
from nccl_ctypes import BF16, SUM, WIN_SYMMETRIC, has_window, lib, nccl_alloc, ok, sz, version, vp

ndev = 2
comms = (vp * ndev)()
ok(lib.ncclCommInitAll(comms, ndev, (ctypes.c_int * ndev)(*range(ndev))), "ncclCommInitAll")
streams = [torch.cuda.Stream(device=d) for d in range(ndev)]


def buffers(kind, count):
    if kind.startswith("cudaMalloc"):
        bufs = [torch.empty(count, dtype=torch.bfloat16, device=f"cuda:{d}") for d in range(ndev)]
    else:
        bufs = [nccl_alloc(d, count)[1] for d in range(ndev)]
    undo = []
    if kind.endswith("+register"):
        for d in range(ndev):
            h = vp()
            with torch.cuda.device(d):
                ok(lib.ncclCommRegister(comms[d], bufs[d].data_ptr(), count * 2, ctypes.byref(h)), "ncclCommRegister")
            undo.append((lib.ncclCommDeregister, comms[d], h))
    if kind.endswith("+window"):
        hs = [vp() for _ in range(ndev)]
        ok(lib.ncclGroupStart(), "group")
        for d in range(ndev):
            with torch.cuda.device(d):
                ok(lib.ncclCommWindowRegister(comms[d], bufs[d].data_ptr(), count * 2, ctypes.byref(hs[d]), WIN_SYMMETRIC),
                   "ncclCommWindowRegister")
        ok(lib.ncclGroupEnd(), "group")
        undo += [(lib.ncclCommWindowDeregister, comms[d], hs[d]) for d in range(ndev)]
    return bufs, undo


def all_reduce(bufs):
    ok(lib.ncclGroupStart(), "group")
    for d in range(ndev):
        with torch.cuda.device(d):
            ok(lib.ncclAllReduce(bufs[d].data_ptr(), bufs[d].data_ptr(), bufs[d].numel(), BF16, SUM, comms[d],
                                 streams[d].cuda_stream), "ncclAllReduce")
    ok(lib.ncclGroupEnd(), "group")


def sync():
    for d in range(ndev):
        torch.cuda.synchronize(d)


def check(bufs):
    g = torch.Generator().manual_seed(7)
    parts = [torch.randint(-8, 9, (bufs[0].numel(),), generator=g).to(torch.bfloat16) for _ in range(ndev)]
    for d in range(ndev):
        bufs[d].copy_(parts[d].to(f"cuda:{d}"))
    sync()
    all_reduce(bufs)
    sync()
    want = sum(p.float() for p in parts)
    return max(int((b.float().cpu() != want).sum()) for b in bufs)


def time_us(bufs, n):
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(ndev)]
    for d in range(ndev):
        ev[d][0].record(streams[d])
    for _ in range(n):
        all_reduce(bufs)
    for d in range(ndev):
        ev[d][1].record(streams[d])
    sync()
    return max(ev[d][0].elapsed_time(ev[d][1]) for d in range(ndev)) * 1e3 / n


kinds = ["cudaMalloc", "cudaMalloc+register", "ncclMemAlloc", "ncclMemAlloc+register"]
if has_window and os.environ.get("PROBE_WINDOW", "1") == "1":
    kinds.append("ncclMemAlloc+window")
sizes = [("decode 1x4096", 4096, 200), ("prefill 2048x4096", 2048 * 4096, 40), ("64 MB", 32 << 20, 10)]
rounds = int(os.environ.get("PROBE_ROUNDS", "7"))
env = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("NCCL_") and k != "NCCL_DEBUG_FILE")
print(f"NCCL {version.value}, {torch.cuda.get_device_name(0)} x {ndev}; {env}", flush=True)
print("| case | size | us (median) | rounds (us) | wrong elements |")
print("|---|---|---:|---|---:|")
for label, count, n in sizes:
    setup = {k: buffers(k, count) for k in kinds}
    wrong = {k: check(b) for k, (b, _) in setup.items()}
    for b, _ in setup.values():
        for _ in range(3):
            all_reduce(b)
    sync()
    times = {k: [] for k in kinds}
    for _ in range(rounds):  # the cases take turns within each round
        for k, (b, _) in setup.items():
            times[k].append(time_us(b, n))
    for k in kinds:
        t = times[k]
        print(f"| {k} | {label} | {statistics.median(t):.2f} | {' / '.join(f'{x:.1f}' for x in t)} | {wrong[k]} |", flush=True)
    sync()
    for _, undo in setup.values():
        for f, c, h in undo:
            ok(f(c, h), "deregister")
for d in range(ndev):
    lib.ncclCommDestroy(comms[d])
