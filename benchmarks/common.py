"""Shared benchmark helpers: the device-copy ceiling every bandwidth number is quoted against."""

from __future__ import annotations

import torch


def _time(fn, iters: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(3):
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / iters)
    return sorted(times)[1]


def device_copy_bandwidth(nbytes: int = 2 * 2**30) -> tuple[float, dict]:
    """Best of a cudaMemcpy device-to-device copy and an elementwise kernel (torch.neg) over
    ``nbytes`` buffers, counting bytes read + written. Returns (bytes/s, {method: bytes/s})."""
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    res = {"memcpy (Tensor.copy_)": 2 * nbytes / _time(lambda: dst.copy_(src)),
           "elementwise (torch.neg)": 2 * nbytes / _time(lambda: torch.neg(src, out=dst))}
    del src, dst
    torch.cuda.empty_cache()
    return max(res.values()), res
