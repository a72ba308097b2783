# Do NCCL symmetric windows make a decode step's one-row all-reduces faster inside CUDA graphs, and are
# their sums right there? One process, a thread per GPU (as the Rust team), NCCL through ctypes (the
# wheel's library, `nccl_ctypes.py`), torch for memory, kernels, streams, graphs and CUDA events.
#
# Each GPU captures one graph of `LAYERS` steps that mimic a decode step's residual stream: two buffers
# take turns, step i writes x[i % 2] = (src[i] + x[(i - 1) % 2]) * 0.25 (one elementwise kernel, as the
# projection before an all-reduce), then all-reduces it over the GPUs (in place, or out of place into the
# other window). Cases: plain cudaMalloc buffers (what the library does), both buffers in one symmetric
# window (in place), and each buffer in a window of its own (in place). Every case's final buffers are
# compared bit for bit with the plain case's after each round of replays (same inputs, same kernels; a
# sum of two values is exact in either order), then each case is timed: `REPLAYS` replays back to back
# per round on both GPUs at once, the slower GPU counting, per step (kernel + all-reduce).
import ctypes, os, statistics, sys, threading
import torch
from nccl_ctypes import BF16, SUM, WIN_SYMMETRIC, lib, nccl_alloc, ok, sz, version, vp

LAYERS, HIDDEN = 64, 4096
REPLAYS = int(os.environ.get("PROBE_REPLAYS", "50"))
ROUNDS = int(os.environ.get("PROBE_ROUNDS", "5"))

os.environ.setdefault("NCCL_RUNTIME_CONNECT", "0")
os.environ.setdefault("NCCL_GRAPH_MIXING_SUPPORT", "0")
ndev = 2
comms = (vp * ndev)()
ok(lib.ncclCommInitAll(comms, ndev, (ctypes.c_int * ndev)(*range(ndev))), "ncclCommInitAll")


def register(ptrs_counts):
    """Registers one window per (device -> (ptr, bytes)) in a group; returns the handles."""
    hs = [vp() for _ in range(ndev)]
    ok(lib.ncclGroupStart(), "group")
    for d in range(ndev):
        p, n = ptrs_counts[d]
        with torch.cuda.device(d):
            ok(lib.ncclCommWindowRegister(comms[d], p, n, ctypes.byref(hs[d]), WIN_SYMMETRIC), "window")
    ok(lib.ncclGroupEnd(), "group")
    return hs


def setup(kind):
    """Per device: the two residual buffers x0, x1 (views), and what to free."""
    bufs, undo = [], []
    if kind == "plain":
        for d in range(ndev):
            x = torch.zeros(2 * HIDDEN, dtype=torch.bfloat16, device=f"cuda:{d}")
            bufs.append((x[:HIDDEN], x[HIDDEN:]))
        return bufs, undo
    # ncclMemAlloc rounds up to its granularity; a window covers what we register.
    allocs = [[nccl_alloc(d, 1 << 20) for _ in range(2)] for d in range(ndev)]
    if kind == "window-one":  # both buffers in one window (the two halves of one allocation)
        for d in range(ndev):
            t = allocs[d][0][1]
            bufs.append((t[:HIDDEN], t[HIDDEN:2 * HIDDEN]))
        hs = register([(allocs[d][0][0].value, (1 << 20) * 2) for d in range(ndev)])
        undo.append(hs)
    else:  # "window-two": a window per buffer
        for d in range(ndev):
            bufs.append((allocs[d][0][1][:HIDDEN], allocs[d][1][1][:HIDDEN]))
        for j in range(2):
            undo.append(register([(allocs[d][j][0].value, (1 << 20) * 2) for d in range(ndev)]))
    for b in bufs:
        for x in b:
            x.zero_()
    return bufs, (undo, allocs)


def capture(d, xs, srcs, stream):
    g = torch.cuda.CUDAGraph()
    with torch.cuda.device(d), torch.cuda.graph(g, stream=stream, capture_error_mode="thread_local"):
        s = torch.cuda.current_stream().cuda_stream
        for i in range(LAYERS):
            cur, prev = xs[i % 2], xs[(i - 1) % 2]
            torch.add(srcs[i], prev, out=cur)
            cur.mul_(0.25)
            ok(lib.ncclAllReduce(cur.data_ptr(), cur.data_ptr(), HIDDEN, BF16, SUM, comms[d], s), "allreduce")
    return g


def run_threads(fn):
    errs = []

    def wrap(d):
        try:
            fn(d)
        except Exception as e:  # noqa: BLE001
            errs.append((d, e))

    ts = [threading.Thread(target=wrap, args=(d,)) for d in range(ndev)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errs:
        raise RuntimeError(errs)


kinds = ["plain", "window-one", "window-two"]
gen = torch.Generator().manual_seed(11)
src_cpu = [[torch.randint(-4, 5, (HIDDEN,), generator=gen).to(torch.bfloat16) for _ in range(LAYERS)] for _ in range(ndev)]
srcs = [[s.to(f"cuda:{d}") for s in src_cpu[d]] for d in range(ndev)]
streams = [torch.cuda.Stream(device=d) for d in range(ndev)]
cases = {}
for k in kinds:
    bufs, undo = setup(k)
    graphs = [None] * ndev

    def cap(d, bufs=bufs, graphs=graphs):
        graphs[d] = capture(d, bufs[d], srcs[d], streams[d])

    run_threads(cap)
    cases[k] = (bufs, graphs, undo)
torch.cuda.synchronize(0)
torch.cuda.synchronize(1)
print(f"NCCL {version.value}, {torch.cuda.get_device_name(0)} x {ndev}, {LAYERS} steps per graph", flush=True)
times = {k: [] for k in kinds}
wrong = {k: 0 for k in kinds}
for r in range(ROUNDS):
    finals = {}
    for k in kinds:
        bufs, graphs, _ = cases[k]
        ev = [None] * ndev

        def replay(d, graphs=graphs, ev=ev):
            with torch.cuda.device(d), torch.cuda.stream(streams[d]):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(streams[d])
                for _ in range(REPLAYS):
                    graphs[d].replay()
                b.record(streams[d])
                b.synchronize()
                ev[d] = a.elapsed_time(b)

        # zero the buffers so every case starts alike, then warm up once
        for d in range(ndev):
            with torch.cuda.device(d), torch.cuda.stream(streams[d]):
                for x in bufs[d]:
                    x.zero_()
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        run_threads(replay)
        times[k].append(max(ev) * 1e3 / (REPLAYS * LAYERS))
        for d in range(ndev):
            streams[d].synchronize()
        finals[k] = [torch.cat([x.float().cpu() for x in bufs[d]]) for d in range(ndev)]
    for k in kinds:
        wrong[k] += sum(int((finals[k][d] != finals["plain"][d]).sum()) for d in range(ndev))
    wrong["plain"] += int((finals["plain"][0] != finals["plain"][1]).sum())
# Which NCCL kernels each case's graphs run (CUPTI through torch.profiler, one replay on each GPU).
for k in kinds:
    _, graphs, _ = cases[k]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for d in range(ndev):
            with torch.cuda.device(d), torch.cuda.stream(streams[d]):
                graphs[d].replay()
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
    names = sorted({e.name for e in prof.events() if "nccl" in e.name.lower()})
    print(f"{k}: {', '.join(names) or 'no NCCL kernel seen'}", flush=True)
print("| case | us per step (kernel + all-reduce), median | rounds | elements unlike plain (all rounds) |")
print("|---|---:|---|---:|")
for k in kinds:
    t = times[k]
    print(f"| {k} | {statistics.median(t):.2f} | {' / '.join(f'{x:.2f}' for x in t)} | {wrong[k]} |", flush=True)
