"""Shared benchmark helpers: the device-copy ceiling every bandwidth number is quoted against, and the
CUDA-graph timers (device time per call, without the Python launch path)."""

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


# The copies every ceiling is taken from (the faster counts): name -> fn(src, dst).
COPY_METHODS = {"memcpy (Tensor.copy_)": lambda src, dst: dst.copy_(src),
                "elementwise (torch.neg)": lambda src, dst: torch.neg(src, out=dst)}


def device_copy_bandwidth(nbytes: int = 2 * 2**30) -> tuple[float, dict]:
    """Best of the COPY_METHODS (a cudaMemcpy device-to-device copy and an elementwise kernel) over
    ``nbytes`` buffers, counting bytes read + written. Returns (bytes/s, {method: bytes/s})."""
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    res = {name: 2 * nbytes / _time(lambda: copy(src, dst)) for name, copy in COPY_METHODS.items()}
    del src, dst
    torch.cuda.empty_cache()
    return max(res.values()), res


def time_graph(fn, args_list, min_ms: float = 30.0) -> float:
    """Seconds per call: a CUDA graph of one call per argument tuple, replayed until min_ms passed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for a in args_list[:2]:
            fn(*a)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for a in args_list:
            fn(*a)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    one = start.elapsed_time(end)
    reps = max(3, min(1000, int(min_ms / max(one, 1e-3))))
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    del graph
    return start.elapsed_time(end) / 1e3 / (reps * len(args_list))


def time_eager(fn, args_list, iters: int = 3) -> float:
    fn(*args_list[0])
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(iters):
        fn(*args_list[i % len(args_list)])
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def time_any(fn, args_list) -> tuple[float, str]:
    try:
        return time_graph(fn, args_list), "graph"
    except Exception:  # a peer that cannot be captured: eager timing (includes launch overhead)
        torch.cuda.synchronize()
        return time_eager(fn, args_list, iters=20), "eager"
