# Can NCCL's copy-engine all-gather (NCCL 2.28+: a communicator with `NCCL_CTA_POLICY_ZERO`, send and receive
# buffers in symmetric windows, one node) stand in for the prefill all-reduce of a row-parallel projection, and
# hide behind the projection's next rows? One process, two GPUs, NCCL through ctypes (`nccl_ctypes.py`), torch
# for memory, GEMMs, streams and CUDA events.
#
# Cases, each the slower GPU's CUDA-event time, mean of `n` back to back, median of the rounds (cases take turns):
# - the collectives alone at the TP2 prefill size (2048 x 4096 bf16, 16 MB): all-reduce (kernel, plain
#   communicator), all-gather (kernel), all-gather and all-to-all on the zero-CTA communicator in windows, and the
#   add that turns a gathered pair into the sum;
# - a TP2 down / o_proj GEMM with the all-reduce after it (what the library does), against the GEMM in 1, 2 or 4
#   row chunks, each chunk's all-gather on a side stream as soon as its rows are written, the pair added there;
#   every pipeline's sum is checked bit for bit against the all-reduce's;
# - which kernels each collective launches (torch.profiler), to see that the zero-CTA one launches none;
# - host time per call, and (with $OUT set) chrome traces of a 2-chunk pipeline and of the GEMM + all-reduce.
# This Python loop launches slower than the GPU runs the chunks, so the pipelines' event times are host-bound:
# read their device times in the traces (results: benches/results/h200-x2/gather/ce-probe-call3.log and
# tensor-parallel.md). Run: cd benches && python3 tp_ce_allgather_probe.py (two GPUs, NCCL 2.28+).
import ctypes, os, statistics
import torch
from nccl_ctypes import BF16, SUM, WIN_SYMMETRIC, lib, nccl_alloc, ok, sz, version, vp

ndev, T, H = 2, 2048, 4096
CTA_POLICY_ZERO = int(os.environ.get("PROBE_CTA_POLICY", "2"))
lib.ncclAllGather.argtypes = [vp, vp, sz, ctypes.c_int, vp, vp]
has_a2a = hasattr(lib, "ncclAlltoAll")
if has_a2a:
    lib.ncclAlltoAll.argtypes = [vp, vp, sz, ctypes.c_int, vp, vp]


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


class Config(ctypes.Structure):  # ncclConfig_t of NCCL 2.28 (llama/src/nccl/raw.rs, ConfigV22800)
    _fields_ = [("size", sz), ("magic", ctypes.c_uint), ("version", ctypes.c_uint)] + [
        (f, ctypes.c_int) for f in ("blocking", "cga", "min_ctas", "max_ctas")] + [
        ("net_name", vp), ("split_share", ctypes.c_int), ("traffic_class", ctypes.c_int), ("comm_name", vp)] + [
        (f, ctypes.c_int) for f in ("collnet", "cta_policy", "shrink_share", "nvls_ctas", "nch_net", "nvl_sched")]


assert ctypes.sizeof(Config) == 80
lib.ncclCommInitRankConfig.argtypes = [ctypes.POINTER(vp), ctypes.c_int, UniqueId, ctypes.c_int, ctypes.POINTER(Config)]


def comms_with(policy):
    u = UniqueId()
    ok(lib.ncclGetUniqueId(ctypes.byref(u)), "ncclGetUniqueId")
    undef = -(1 << 31)
    cfg = Config(80, 0xCAFEBEEF, 22809, 1, undef, undef, undef, None, undef, undef, None, undef, policy, undef,
                 undef, undef, undef)
    comms = [vp() for _ in range(ndev)]
    ok(lib.ncclGroupStart(), "group")
    for d in range(ndev):
        with torch.cuda.device(d):
            ok(lib.ncclCommInitRankConfig(ctypes.byref(comms[d]), ndev, u, d, ctypes.byref(cfg)), "init")
    ok(lib.ncclGroupEnd(), "group")
    return comms


plain = comms_with(-(1 << 31))
zero = comms_with(CTA_POLICY_ZERO)
streams = [torch.cuda.Stream(device=d) for d in range(ndev)]
sides = [torch.cuda.Stream(device=d, priority=-1) for d in range(ndev)]


def window(d, comm, count):
    p, t = nccl_alloc(d, count)
    h = vp()
    with torch.cuda.device(d):
        ok(lib.ncclCommWindowRegister(comm, p.value, count * 2, ctypes.byref(h), WIN_SYMMETRIC), "window")
    return t


def windows(comm, count):
    ok(lib.ncclGroupStart(), "group")
    ts = [window(d, comm[d], count) for d in range(ndev)]
    ok(lib.ncclGroupEnd(), "group")
    return ts


send_w = windows(zero, T * H)  # a rank's partial rows
recv_w = windows(zero, ndev * T * H)  # every rank's, chunk by chunk: [chunk][rank][rows, H]
plain_buf = [torch.empty(T * H, dtype=torch.bfloat16, device=f"cuda:{d}") for d in range(ndev)]
plain_out = [torch.empty(ndev * T * H, dtype=torch.bfloat16, device=f"cuda:{d}") for d in range(ndev)]
sums = [torch.empty(T, H, dtype=torch.bfloat16, device=f"cuda:{d}") for d in range(ndev)]


def group(calls):
    ok(lib.ncclGroupStart(), "group")
    for d in range(ndev):
        with torch.cuda.device(d):
            ok(calls(d), "collective")
    ok(lib.ncclGroupEnd(), "group")


def all_reduce(bufs, n=None, ss=streams):
    group(lambda d: lib.ncclAllReduce(bufs[d].data_ptr(), bufs[d].data_ptr(), n or bufs[d].numel(), BF16, SUM, plain[d],
                                      ss[d].cuda_stream))


def all_gather(comms, send, recv, count, ss=streams):
    group(lambda d: lib.ncclAllGather(send[d], recv[d], count, BF16, comms[d], ss[d].cuda_stream))


def sync():
    for d in range(ndev):
        torch.cuda.synchronize(d)


def timed(run, n):
    """Mean us of `n` runs, the slower GPU (events on the main streams)."""
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(ndev)]
    for d in range(ndev):
        ev[d][0].record(streams[d])
    for _ in range(n):
        run()
    for d in range(ndev):
        ev[d][1].record(streams[d])
    sync()
    return max(ev[d][0].elapsed_time(ev[d][1]) for d in range(ndev)) * 1e3 / n


def table(cases, n, rounds):
    for run in cases.values():
        for _ in range(3):
            run()
    sync()
    times = {k: [] for k in cases}
    for _ in range(rounds):
        for k, run in cases.items():
            times[k].append(timed(run, n))
    out = {}
    for k in cases:
        out[k] = statistics.median(times[k])
        print(f"| {k} | {out[k]:.2f} | {' / '.join(f'{x:.1f}' for x in times[k])} |", flush=True)
    return out


print(f"NCCL {version.value}, {torch.cuda.get_device_name(0)} x {ndev}, CTA policy {CTA_POLICY_ZERO}", flush=True)
g = torch.Generator(device="cpu").manual_seed(11)
for d in range(ndev):
    send_w[d].copy_(torch.randn(T * H, generator=g).to(torch.bfloat16).to(f"cuda:{d}"))
    plain_buf[d].copy_(send_w[d])
sync()

# 1. The collectives alone.
s_ptr = [t.data_ptr() for t in send_w]
r_ptr = [t.data_ptr() for t in recv_w]
all_gather(zero, s_ptr, r_ptr, T * H)
sync()
want = torch.cat([send_w[d].cpu() for d in range(ndev)])
print("zero-CTA all-gather wrong elements:", [int((recv_w[d].cpu() != want).sum()) for d in range(ndev)], flush=True)

def add_pairs():
    for d in range(ndev):
        with torch.cuda.device(d), torch.cuda.stream(streams[d]):
            torch.add(recv_w[d][:T * H].view(T, H), recv_w[d][T * H:].view(T, H), out=sums[d])


print("\n| collective, 2048 x 4096 bf16 | us (median) | rounds |\n|---|---:|---|")
cases = {
    "all-reduce, kernel (plain buffer)": lambda: all_reduce(plain_buf),
    "all-gather, kernel (plain buffers)": lambda: all_gather(plain, [t.data_ptr() for t in plain_buf],
                                                             [t.data_ptr() for t in plain_out], T * H),
    "all-gather, zero-CTA comm, windows": lambda: all_gather(zero, s_ptr, r_ptr, T * H),
    "add of the gathered pair (torch)": add_pairs,
}
if has_a2a:
    cases["all-to-all, zero-CTA comm, windows"] = lambda: group(
        lambda d: lib.ncclAlltoAll(s_ptr[d], r_ptr[d], T * H // ndev, BF16, zero[d], streams[d].cuda_stream))
table(cases, 20, 7)

# 2. Which kernels each launches.
from torch.profiler import ProfilerActivity, profile

for name in ("all-reduce, kernel (plain buffer)", "all-gather, zero-CTA comm, windows"):
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            cases[name]()
            sync()
        kinds = sorted({e.name for e in prof.events()})
        print(f"{name}: activities {kinds}", flush=True)
    except Exception as e:  # the profile is a check, not the point
        print(f"{name}: no profile ({e})", flush=True)



def trace(name, run):
    out_dir = os.environ.get("OUT")
    if not out_dir:
        return
    try:
        run()
        sync()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                run()
            sync()
        prof.export_chrome_trace(os.path.join(out_dir, f"trace-{name}.json"))
    except Exception as e:
        print(f"trace {name}: {e}", flush=True)

# 3. A row-parallel projection and its reduction: all-reduce after it, or row chunks gathered beside the next.
for proj, K in (("down", 7168), ("o_proj", 2048)):
    a = [torch.randn(T, K, generator=g).to(torch.bfloat16).to(f"cuda:{d}") / 8 for d in range(ndev)]
    w = [torch.randn(K, H, generator=g).to(torch.bfloat16).to(f"cuda:{d}") / 8 for d in range(ndev)]
    ar_out = [torch.empty(T, H, dtype=torch.bfloat16, device=f"cuda:{d}") for d in range(ndev)]
    done = [[torch.cuda.Event() for _ in range(8)] for _ in range(ndev)]

    def gemm_all_reduce():
        for d in range(ndev):
            with torch.cuda.device(d), torch.cuda.stream(streams[d]):
                torch.matmul(a[d], w[d], out=ar_out[d])
        all_reduce([t.view(-1) for t in ar_out])

    def gemm_alone():
        for d in range(ndev):
            with torch.cuda.device(d), torch.cuda.stream(streams[d]):
                torch.matmul(a[d], w[d], out=ar_out[d])

    def chunked(chunks, add_on_side=True):
        rows = T // chunks

        def run():
            for c in range(chunks):
                lo = c * rows
                for d in range(ndev):
                    with torch.cuda.device(d), torch.cuda.stream(streams[d]):
                        torch.matmul(a[d][lo:lo + rows], w[d], out=send_w[d][lo * H:(lo + rows) * H].view(rows, H))
                        done[d][c].record(streams[d])
                        sides[d].wait_event(done[d][c])
                base = ndev * lo * H
                all_gather(zero, [s_ptr[d] + lo * H * 2 for d in range(ndev)],
                           [r_ptr[d] + base * 2 for d in range(ndev)], rows * H, ss=sides)
                for d in range(ndev):
                    with torch.cuda.device(d), torch.cuda.stream(sides[d]):
                        pair = recv_w[d][base:base + ndev * rows * H].view(ndev, rows, H)
                        torch.add(pair[0], pair[1], out=sums[d][lo:lo + rows])
            for d in range(ndev):
                with torch.cuda.device(d):
                    done[d][7].record(sides[d])
                    streams[d].wait_event(done[d][7])

        return run

    gemm_all_reduce()
    sync()
    for chunks in (1, 2, 4):
        chunked(chunks)()
        sync()
        wrong = [int((sums[d].cpu() != ar_out[d].cpu()).sum()) for d in range(ndev)]
        print(f"{proj}, {chunks} chunks: elements unlike the all-reduce's {wrong}", flush=True)
    print(f"\n| {proj} 2048 x {K} -> 4096, TP2 | us (median) | rounds |\n|---|---:|---|")
    table({
        f"{proj} GEMM alone": gemm_alone,
        f"{proj} GEMM, then all-reduce": gemm_all_reduce,
        f"{proj} GEMM, zero-CTA all-gather + add, 1 chunk": chunked(1),
        f"{proj} 2 chunks": chunked(2),
        f"{proj} 4 chunks": chunked(4),
    }, 20, 7)
    trace(f"{proj}-2chunks", chunked(2))
    trace(f"{proj}-allreduce", gemm_all_reduce)

# 4. Where the chunked forms lose: host time per call, the add on window memory and on cudaMalloc memory, and
# a traced iteration of each pipeline (chrome traces under $OUT when set).
import time

copies = [torch.empty(ndev * T * H, dtype=torch.bfloat16, device=f"cuda:{d}") for d in range(ndev)]


def add_copies():
    for d in range(ndev):
        with torch.cuda.device(d), torch.cuda.stream(streams[d]):
            torch.add(copies[d][:T * H].view(T, H), copies[d][T * H:].view(T, H), out=sums[d])


def host_us(run, n=20):
    sync()
    t = time.perf_counter()
    for _ in range(n):
        run()
    host = (time.perf_counter() - t) * 1e6 / n
    sync()
    return host


print("\n| call | host us per call | GPU us |\n|---|---:|---:|")
for k, run in (("all-reduce, kernel", cases["all-reduce, kernel (plain buffer)"]),
               ("all-gather, zero-CTA", cases["all-gather, zero-CTA comm, windows"]),
               ("add, window memory", add_pairs), ("add, cudaMalloc memory", add_copies)):
    print(f"| {k} | {host_us(run):.1f} | {timed(run, 20):.1f} |", flush=True)
