"""CUDA-event timing shared by the PyTorch comparison scripts (`*_torch.py`)."""
import math
import statistics

import torch


def time_ms(fn, warmup=10, samples=21, cover_ms=1.0, max_batch=200):
    """Median milliseconds per call of `fn`: `warmup` untimed calls, then `samples` CUDA-event samples,
    each over enough back-to-back calls (at most `max_batch`) to cover about `cover_ms`."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    batch = max(1, min(max_batch, math.ceil(cover_ms / max(start.elapsed_time(end), 1e-3))))
    times = []
    for _ in range(samples):
        start.record()
        for _ in range(batch):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / batch)
    return statistics.median(times)
