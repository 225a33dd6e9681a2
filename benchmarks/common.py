"""Shared benchmark helpers: the device-copy ceiling every bandwidth number is quoted against
(:func:`device_copy_bandwidth`), and the one CUDA-graph timer (:func:`time_calls`: device time per call,
without the Python launch path) with its eager fallback for peers that cannot be captured."""

from __future__ import annotations

import functools
import math
import os
import statistics
import subprocess
import time

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


def _wall_time(fn, iters: int = 3) -> float:
    """Median wall-clock seconds of one call: the CPU smoke runs' timer (no GPU)."""
    fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


# The copies every ceiling is taken from (the faster counts): name -> fn(src, dst).
COPY_METHODS = {"memcpy (Tensor.copy_)": lambda src, dst: dst.copy_(src),
                "elementwise (torch.neg)": lambda src, dst: torch.neg(src, out=dst)}


def device_copy_bandwidth(nbytes: int = 2 * 2**30) -> tuple[float, dict]:
    """The one "% of copy" ceiling of every benchmark: the best of the COPY_METHODS (a cudaMemcpy
    device-to-device copy and an elementwise kernel) over ``nbytes`` buffers, counting bytes read +
    written. Returns (bytes/s, {method: bytes/s}). Without a GPU (smoke runs): the same on a 64 MiB
    host buffer, wall clock."""
    gpu = torch.cuda.is_available()
    nbytes = nbytes if gpu else 2**26
    src = torch.randn(nbytes // 4, device="cuda" if gpu else "cpu")
    dst = torch.empty_like(src)
    timer = _time if gpu else _wall_time
    res = {name: 2 * nbytes / timer(lambda copy=copy: copy(src, dst)) for name, copy in COPY_METHODS.items()}
    del src, dst
    if gpu:
        torch.cuda.empty_cache()
    return max(res.values()), res


def time_calls(calls: list, *, fill_ms: float = 0.0, min_ms: float = 30.0, max_calls: int = 200) -> float:
    """Seconds per call, the one timer of the benchmarks: a CUDA graph of ``calls`` (each a no-argument
    callable, typically one per rotated weight or input copy so the working set exceeds L2), in order,
    repeated round-robin until the graph lasts ``fill_ms`` (at most ``max_calls`` calls; 0: each call
    once), replayed until ``min_ms`` of device time passed; device time over every call replayed.
    Without a GPU: the median wall clock of the calls (CPU smoke runs)."""
    if not torch.cuda.is_available():
        return statistics.median(_wall_time(c, 1) for c in calls)
    warm_up(calls)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n = len(calls)
    if fill_ms > 0:
        start.record()
        calls[0]()
        end.record()
        end.synchronize()
        n = max(n, min(max_calls, math.ceil(fill_ms / max(start.elapsed_time(end), 1e-3))))
        n = math.ceil(n / len(calls)) * len(calls)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n):
            calls[i % len(calls)]()
    graph.replay()
    torch.cuda.synchronize()
    reps = max(3, min(1000, int(min_ms / max(_replays_ms(graph, 1), 1e-3))))
    ms = _replays_ms(graph, reps)
    del graph
    return ms / 1e3 / (reps * n)


def warm_up(calls) -> None:
    """Each call once on a side stream (compilation, autotuning, lazy allocations) before a graph capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def _replays_ms(graph, reps: int) -> float:
    """Device ms of ``reps`` back-to-back replays of a CUDA ``graph`` (CUDA events around them)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _us_per_call(fn, calls: int, cuda: bool, spin: bool) -> float:
    """µs per call of ``fn(0) .. fn(calls - 1)``, the median of three loops after one warm-up call. ``spin``: a
    spin kernel queued before each loop keeps the GPU busy and the clock stops before the sync (host time
    alone); else the sync ends each timed loop (wall time)."""
    fn(0)
    runs = []
    for _ in range(3):
        if cuda:
            torch.cuda.synchronize()
            if spin:
                torch.cuda._sleep(HOST_SPIN_CYCLES)
        t = time.perf_counter()
        for i in range(calls):
            fn(i)
        if cuda and not spin:
            torch.cuda.synchronize()
        runs.append((time.perf_counter() - t) / calls * 1e6)
    if cuda:
        torch.cuda.synchronize()
    return statistics.median(runs)


def wall_us_per_call(fn, calls: int, cuda: bool) -> float:
    """Wall µs per call of ``calls`` back-to-back eager calls ``fn(0) .. fn(calls - 1)`` with one sync at the end,
    the median of three such loops (after one warm-up call): the device time when the GPU is the bottleneck,
    more when the host path is."""
    return _us_per_call(fn, calls, cuda, spin=False)


#: spin cycles queued ahead of a host-time loop: ~0.2 s on an H200, longer than the loops' launches
HOST_SPIN_CYCLES = 400_000_000


def host_us_per_call(fn, calls: int, cuda: bool) -> float:
    """Host µs per call of ``fn(0) .. fn(calls - 1)`` while a spin kernel queued first keeps the GPU busy: the
    launch path alone (Python, dispatch, kernel launches), never waiting for the GPU; the median of three
    loops after one warm-up call. Without a GPU: plain wall time per call."""
    return _us_per_call(fn, calls, cuda, spin=True)


def launch_paths_us(fn, calls: int, cuda: bool, rounds: int = 5) -> tuple[float, float]:
    """``(direct, triton)``: :func:`host_us_per_call` with the plugin's direct launches of compiled kernels
    (``NVFP4_PLUGIN_FAST_LAUNCH`` unset, the default) and with every launch through Triton's ``kernel[grid]``
    (``=0``) in the same process, alternated ``rounds`` times (the host's speed drifts by tens of µs between
    loops); the median of each."""
    saved = os.environ.pop("NVFP4_PLUGIN_FAST_LAUNCH", None)
    direct, triton_path = [], []
    try:
        for _ in range(rounds):
            os.environ.pop("NVFP4_PLUGIN_FAST_LAUNCH", None)
            direct.append(host_us_per_call(fn, calls, cuda))
            os.environ["NVFP4_PLUGIN_FAST_LAUNCH"] = "0"
            triton_path.append(host_us_per_call(fn, calls, cuda))
    finally:
        os.environ.pop("NVFP4_PLUGIN_FAST_LAUNCH", None)
        if saved is not None:
            os.environ["NVFP4_PLUGIN_FAST_LAUNCH"] = saved
    return statistics.median(direct), statistics.median(triton_path)


def cprofile_calls(fn, calls: int, cuda: bool, top: int = 25) -> list[str]:
    """Markdown: cProfile over ``fn(0) .. fn(calls - 1)`` (on a GPU a spin kernel queued first keeps it busy, so no
    call waits for it), the ``top`` functions by own time and by cumulative time, paths relative to the repo."""
    import cProfile
    import io
    import pstats
    from pathlib import Path

    fn(0)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda._sleep(HOST_SPIN_CYCLES)
    prof = cProfile.Profile()
    prof.enable()
    for i in range(calls):
        fn(i)
    prof.disable()
    if cuda:
        torch.cuda.synchronize()
    md = []
    for key, title in (("tottime", "own time"), ("cumulative", "cumulative time")):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(top)
        text = buf.getvalue().replace(str(Path(__file__).resolve().parents[1]) + "/", "")
        md += [f"cProfile, {calls} calls, top {top} by {title} (cProfile slows Python about twofold):", "",
               "```", text.strip(), "```", ""]
    return md


def time_sustained(fn, *, warm_s: float = 1.5, meas_s: float = 1.5, per_graph: int = 5) -> tuple[float, float]:
    """``(sustained, burst)`` µs per call of ``fn()``: a CUDA graph of ``per_graph`` calls replayed for ``warm_s``
    seconds (the GPU reaches its steady clock: under heavy tensor-core load an H200 sits at its power cap,
    ~1.5 GHz, instead of its 1.98 GHz boost), then for ``meas_s`` seconds timed; ``burst``: about 30 ms of
    replays of the rested GPU after three untimed ones (its clock up from idle), what :func:`time_calls` sees."""
    warm_up([fn])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    time.sleep(0.5)                 # a rested GPU, as a short benchmark finds it
    for _ in range(3):
        graph.replay()
    one = max(_replays_ms(graph, 1) / 1e3, 1e-6)                     # seconds per replay
    n = max(1, int(0.03 / one))
    one = max(_replays_ms(graph, n) / 1e3 / n, 1e-6)
    burst = one / per_graph * 1e6
    for _ in range(max(1, int(warm_s / one))):
        graph.replay()
    reps = max(1, int(meas_s / one))
    ms = _replays_ms(graph, reps)
    del graph
    return ms * 1e3 / (reps * per_graph), burst


def time_graph(fn, args_list, min_ms: float = 30.0) -> float:
    """Seconds per call of ``fn(*args)``, a CUDA graph of one call per argument tuple (:func:`time_calls`)."""
    return time_calls([functools.partial(fn, *a) for a in args_list], min_ms=min_ms)


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


#: nvidia-smi query of the SM clock (MHz), board power (W) and active clock-throttle reasons (bit mask;
#: 0x4 = software power cap), sampled every 100 ms by :class:`GpuClockSampler`.
SMI_QUERY = ("clocks.sm", "power.draw", "clocks_throttle_reasons.active")
POWER_CAP_BIT = 0x4


def smi_command(gpu: int | str, period_ms: int = 100) -> list[str]:
    return ["nvidia-smi", f"--query-gpu={','.join(SMI_QUERY)}", "--format=csv,noheader,nounits",
            f"-lms={period_ms}", f"--id={gpu}"]


def clock_summary(lines) -> dict:
    """Median / lowest SM clock, median power and the share of samples throttled by the power cap, from
    nvidia-smi lines of :data:`SMI_QUERY` (lines that do not parse are skipped)."""
    mhz, watts, capped = [], [], 0
    for ln in lines:
        parts = [p.strip() for p in ln.split(",")]
        if len(parts) != 3:
            continue
        try:
            m, w, r = float(parts[0]), float(parts[1]), int(parts[2], 16)
        except ValueError:
            continue
        mhz.append(m)
        watts.append(w)
        capped += bool(r & POWER_CAP_BIT)
    if not mhz:
        return {"samples": 0}
    return {"samples": len(mhz), "sm_mhz_median": statistics.median(mhz), "sm_mhz_min": min(mhz),
            "power_w_median": round(statistics.median(watts), 1), "power_capped_share": round(capped / len(mhz), 2)}


class GpuClockSampler:
    """``with GpuClockSampler() as s: ...`` samples the SM clock and power of the (first visible) GPU while the
    block runs; ``s.summary`` is :func:`clock_summary` of it (``{"error": ...}`` without nvidia-smi). Under
    sustained tensor-core load an H200 runs at its power cap (~1.5 GHz instead of 1.98 GHz boost): two
    configurations can differ in tokens/s by their clocks, not only by their work."""

    def __init__(self, gpu: int | str | None = None, command: list[str] | None = None):
        if gpu is None:       # the first visible GPU: an index or a UUID, as nvidia-smi --id takes either
            gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
        self.command = command or smi_command(gpu)
        self.summary: dict = {}
        self._proc = None

    def __enter__(self):
        try:
            self._proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        except OSError as exc:
            self.summary = {"error": f"{type(exc).__name__}: {exc}"}
        return self

    def __exit__(self, *exc):
        if self._proc is not None:
            self._proc.terminate()
            try:
                out, err = self._proc.communicate(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                out, err = self._proc.communicate()
            self.summary = clock_summary(out.splitlines())
            if not self.summary["samples"]:   # e.g. a field this driver does not know, or no such GPU
                why = (err or out).strip().splitlines()
                self.summary["error"] = why[-1][:200] if why else f"nvidia-smi exited with {self._proc.returncode}"
        return False


def _proc_stat(pid: int) -> tuple[str, int, float, int] | None:
    """``(name, parent pid, user + system CPU seconds, CPU it last ran on)`` of a live process, from
    ``/proc/PID/stat``; None if it is gone (or not Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    name = text[text.index("(") + 1:text.rindex(")")]
    rest = text[text.rindex(")") + 2:].split()       # fields from 3 (state) on
    return name, int(rest[1]), (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK"), int(rest[36])


def process_tree(root: int | None = None) -> dict[int, tuple[str, float, int]]:
    """``pid -> (name, CPU seconds, last CPU)`` of ``root`` (default: this process) and every descendant."""
    root = os.getpid() if root is None else root
    stats = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            st = _proc_stat(int(entry))
            if st is not None:
                stats[int(entry)] = st
    tree, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in stats and pid not in tree:
            name, _, cpu, last = stats[pid]
            tree[pid] = (name, cpu, last)
            todo += [c for c, st in stats.items() if st[1] == pid]
    return tree


def machine_cpu_s() -> tuple[float, float] | None:
    """``(busy, stolen)`` CPU seconds of the whole machine since boot, from ``/proc/stat``: busy is user, nice,
    system, irq and softirq time of every CPU; stolen is the time the hypervisor ran something else while a
    CPU of this (virtual) machine wanted to run. None where there is no ``/proc/stat``."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    v = [int(x) for x in fields[1:]] + [0] * 8
    tick = os.sysconf("SC_CLK_TCK")
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / tick, v[7] / tick


class TreeCpuMeter:
    """``with TreeCpuMeter() as m: ...``: CPU seconds each process of this process's tree spent in the block
    (``m.cpu_s``: ``"name[pid]" -> seconds``, processes alive at both ends) and the CPUs they last ran on
    (``m.cpus``). An engine whose steps wait on its host loop shows that loop's process near one CPU second
    per second of the block: whether a slow engine process does more host work per step or gets less of a
    CPU is then in the numbers. The whole machine's busy and stolen CPU seconds in the block
    (``m.machine_busy_s``, ``m.steal_s``; None without ``/proc/stat``) tell whether something outside the
    tree, or the hypervisor, took CPU time from it."""

    def __enter__(self):
        self._t0 = time.perf_counter()
        self._start = process_tree()
        self._m0 = machine_cpu_s()
        return self

    def __exit__(self, *exc):
        self.wall_s = time.perf_counter() - self._t0
        m1 = machine_cpu_s()
        self.machine_busy_s = self.steal_s = None
        if self._m0 is not None and m1 is not None:
            self.machine_busy_s = round(m1[0] - self._m0[0], 3)
            self.steal_s = round(m1[1] - self._m0[1], 3)
        end = process_tree()
        self.cpu_s = {f"{name}[{pid}]": round(cpu - self._start[pid][1], 4)
                      for pid, (name, cpu, _) in end.items() if pid in self._start}
        self.cpus = {f"{name}[{pid}]": last for pid, (name, _, last) in end.items()}
        return False

    def busiest(self, n: int = 3) -> list[tuple[str, float]]:
        """The ``n`` processes with the most CPU seconds in the block."""
        return sorted(self.cpu_s.items(), key=lambda kv: -kv[1])[:n]
