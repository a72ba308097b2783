# Does an NCCL all-reduce on a side stream run beside a GEMM on this machine? (torch, 2 processes)
import os, torch, torch.distributed as dist
dist.init_process_group("nccl")
r = dist.get_rank(); torch.cuda.set_device(r)
dev = torch.device("cuda", r)
M, K, N = 1024, 7168, 4096          # one chunk of down_proj on a TP2 rank
a = torch.randn(M, K, device=dev, dtype=torch.bfloat16); w = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
buf = torch.randn(1024 * 4096, device=dev, dtype=torch.bfloat16)   # 8 MB
side = torch.cuda.Stream(priority=-1)
def t(f, n=20):
    for _ in range(3): f()
    torch.cuda.synchronize(); dist.barrier()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n): f()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / n * 1e3
def gemm(): a @ w.t()
def ar(): dist.all_reduce(buf)
def seq(): gemm(); ar()
def both():
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side): dist.all_reduce(buf)
    gemm()
    torch.cuda.current_stream().wait_stream(side)
res = {k: t(f) for k, f in [("gemm", gemm), ("allreduce", ar), ("sequential", seq), ("overlapped", both)]}
print(r, {k: round(v, 1) for k, v in res.items()}, "CUDA_DEVICE_MAX_CONNECTIONS=", os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"), flush=True)
dist.destroy_process_group()
