"""Launching a compiled Triton (or Gluon) kernel again without Triton's per-call argument binding.

``kernel[grid](*args)`` costs 30-60 µs of host time in ``JITFunction.run`` (the generated binder, the
cache key, the global-value check, the launch metadata) before the launcher itself runs. Eager engine
steps (a prefill of thousands of tokens runs outside CUDA graphs) launch ~10 of our kernels per layer,
and vLLM's prefill profile had the host keeping pace with the GPU: the GPU idled between steps while
the host caught up (issue 37). :class:`FastLaunch` keys each launch on what Triton specializes a
kernel on and, from the second launch of a key on, calls the compiled kernel's launcher directly, with
tensors passed as their device addresses (the launcher then skips its per-pointer driver query).

The key is never coarser than Triton's specialization, so a cached kernel is only reused where
Triton would pick the same one: per tensor its dtype and whether its address is 16-byte aligned; per
int whether it is 1, divisible by 16, and which integer type holds it; constexprs as Triton keys them
(ints by value, anything else by type and text); bools, options (``num_warps``...) and everything else by
value; Gluon tensor descriptors by element type, block
shape, layout, padding and the divisibility of their shape and strides; plus the current device.
Launch hooks (a Triton profiler), the CPU interpreter, a process without a CUDA device and Triton
versions other than 3.6 take Triton's own path; so does every launch when ``NVFP4_PLUGIN_FAST_LAUNCH=0``.

The first launch of a key goes through Triton, which compiles the kernel unless its caches hold it. Layers
launch every kernel they can select while the engine starts (their warm-up); a first launch outside it that
compiles is logged as a warning naming the kernel (:mod:`.late_compile`).
"""

from __future__ import annotations

import functools
import time

import torch
import triton
from triton import knobs

from .. import envs
from ._runtime import interpreting
from .late_compile import note_first_launch

#: the launcher call below is Triton 3.6's (CompiledKernel.run(grid x3, stream, function, packed metadata,
#: launch metadata, enter hook, exit hook, *every parameter)); other versions take Triton's path
_VERSION_OK = tuple(int(p) for p in triton.__version__.split(".")[:2]) == (3, 6)

_I32 = 1 << 31
_U64 = 1 << 63


def _int_code(v: int) -> int:
    """Triton's specialization of an int argument as one small code: == 1, divisible by 16, beyond int32,
    beyond int64 (unsigned), beyond uint64 (Triton refuses it; its own key keeps it apart)."""
    return (v == 1) * 2 + (v % 16 == 0) + (not -_I32 <= v < _I32) * 4 + (v >= _U64) * 8 + (v >= _U64 * 2) * 16


def _desc_key(d):
    dims = tuple((s == 1, s % 16 == 0) for s in (*d.shape, *d.strides))
    # a plain Triton TensorDescriptor has no layout (Gluon's does)
    return ("desc", d.base.dtype, d.base.data_ptr() % 16 == 0, tuple(d.block_shape), getattr(d, "layout", None),
            d.padding, dims)


@functools.lru_cache(maxsize=1)
def _cuda() -> bool:
    """A CUDA device in this process (read once: without one, e.g. when compiling for sm_90a on a CPU machine,
    every launch is Triton's)."""
    return torch.cuda.is_available()


def _hooked(hook) -> bool:
    """A launch hook is set: Triton's HookChain with a hook in it, or (older Triton) any callable."""
    return hook is not None and bool(getattr(hook, "calls", True))


def arg_key(v):
    """One argument's share of the launch key (see the module docstring)."""
    if isinstance(v, torch.Tensor):
        return (v.dtype, v.data_ptr() % 16 == 0, v.is_cuda)
    if isinstance(v, bool):
        return ("b", v)
    if isinstance(v, int):
        return _int_code(v)
    if isinstance(v, float):
        return "f"
    if v is None:
        return None
    if hasattr(v, "block_shape") and hasattr(v, "base"):
        return _desc_key(v)
    if isinstance(v, (tuple, list)):
        raise TypeError("a tuple argument: Triton's own path")     # its elements may be tensors (keyed by id)
    return ("v", type(v), v)


class FastLaunch:
    """``FastLaunch(kernel)[grid](*args, **kwargs)``: the same launch as ``kernel[grid](...)``.

    Arguments are those of the kernel (positional or by name; parameters left out take their
    defaults) plus Triton's launch options (``num_warps``, ``num_stages``, compiler options)."""

    def __init__(self, fn):
        self.fn = fn
        self.cache: dict = {}
        self._sig = None

    def _signature(self):
        # read on the first direct launch: the interpreter's functions have no params / constexprs
        if self._sig is None:
            fn = self.fn
            names = list(fn.arg_names)
            const = frozenset(fn.constexprs)
            self._sig = (names, {n: i for i, n in enumerate(names)}, tuple(i in const for i in range(len(names))),
                         {i: p.default for i, p in enumerate(fn.params) if p.has_default})
        return self._sig

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def _bind(self, args, kwargs) -> tuple[list, dict]:
        names, index, _, defaults = self._signature()
        vals = list(args)
        n = len(names)
        if len(vals) < n:
            vals.extend([_MISSING] * (n - len(vals)))
        opts = {}
        for k, v in kwargs.items():
            i = index.get(k)
            if i is None:
                opts[k] = v
            else:
                vals[i] = v
        for i in range(len(args), n):
            if vals[i] is _MISSING:
                if i not in defaults:
                    raise TypeError(f"{getattr(self.fn, '__name__', self.fn)}: missing argument {names[i]!r}")
                vals[i] = defaults[i]
        return vals, opts

    def launch(self, grid, args, kwargs):
        if not _VERSION_OK or not _cuda() or not envs.fast_launch() or _hooked(knobs.runtime.launch_enter_hook) \
                or _hooked(knobs.runtime.launch_exit_hook) or interpreting() or knobs.runtime.debug \
                or knobs.compilation.instrumentation_mode:
            # (Triton adds debug and the instrumentation mode, both settable at run time, to every launch's
            # options and so to its cache key: a launch with either set goes through Triton)
            return self.fn[grid](*args, **kwargs)
        vals, opts = self._bind(args, kwargs)
        const = self._sig[2]
        device = torch.cuda.current_device()
        parts, launch_args = [], []
        tensor = torch.Tensor
        for v, c in zip(vals, const):
            t = type(v)
            if c:
                # Triton keys a constexpr by its text: True, 1 and 1.0 are three kernels
                parts.append(v if t is int else (t, repr(v)))
            elif t is int:
                # _int_code, inline (this loop runs for every argument of every launch)
                parts.append((v == 1) * 2 + (v % 16 == 0) + (not -_I32 <= v < _I32) * 4 + (v >= _U64) * 8
                             + (v >= _U64 * 2) * 16)
            elif t is tensor or isinstance(v, tensor):
                # the launcher takes a pointer as an int as it is; from a tensor it calls data_ptr() and asks
                # the driver to translate the address (cuPointerGetAttribute), ~1 µs per pointer argument
                ptr = v.data_ptr()
                parts.append((v.dtype, ptr % 16 == 0, v.is_cuda))     # a CPU tensor: Triton's path refuses it
                v = ptr
            else:
                try:
                    parts.append(arg_key(v))
                except TypeError:    # a tuple argument: Triton's own path
                    return self.fn[grid](*args, **kwargs)
            launch_args.append(v)
        key = (device, tuple(parts), tuple((k, type(v), v) for k, v in opts.items()) if opts else ())
        try:
            ck = self.cache.get(key)
        except TypeError:            # an unhashable argument: Triton's own path
            return self.fn[grid](*args, **kwargs)
        if ck is None:
            t0 = time.perf_counter()
            ck = self.fn[grid](*args, **kwargs)
            if hasattr(ck, "result"):
                ck = ck.result()
            note_first_launch(self.fn, time.perf_counter() - t0)
            # the interpreter returns no compiled kernel: nothing to launch directly
            if ck is not None and hasattr(ck, "packed_metadata"):
                self.cache[key] = ck
            return ck
        if callable(grid):
            grid = grid(dict(zip(self._sig[0], vals)))
        g0 = grid[0]
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        stream = torch._C._cuda_getCurrentRawStream(device)
        ck.run(g0, g1, g2, stream, ck.function, ck.packed_metadata, None, None, None, *launch_args)
        return ck


_MISSING = object()


_WRAPPERS: dict = {}


def fast(fn) -> FastLaunch:
    """The process's :class:`FastLaunch` of ``fn``: ``fast(kernel)[grid](...)`` in place of ``kernel[grid](...)``."""
    w = _WRAPPERS.get(fn)
    if w is None:
        w = _WRAPPERS[fn] = FastLaunch(fn)
    return w
