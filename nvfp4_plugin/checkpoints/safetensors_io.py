"""Streaming safetensors I/O: header-only inspection, one-tensor reads, and sequential sharded writes.

Why not ``safetensors.safe_open``: it memory-maps whole files, and every page a conversion touches
stays resident (and counted in the process RSS) until the file is closed. Reading each tensor with
``pread`` into its own buffer keeps host memory at "the tensors in flight", and parsing headers
ourselves lets validation report truncated or inconsistent files by name before any data is read.
Writing is streamed the same way: the header (names, dtypes, shapes, offsets) is known from the plan,
so it is written first and each tensor is appended as soon as it exists. Files are standard
safetensors (readable by ``safetensors``, transformers, vLLM and SGLang).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import queue
import shutil
import signal
import struct
import tempfile
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import CheckpointError, ProblemCollector, problem

#: safetensors dtype string <-> torch dtype (only the ones torch can hold).
DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
    "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _attr):
        DTYPES[_name] = getattr(torch, _attr)
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
DTYPE_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
               "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}

#: The safetensors library refuses headers above 100 MB; so do we.
MAX_HEADER_BYTES = 100_000_000
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
COPY_CHUNK_BYTES = 64 << 20


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES[dtype]


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: file, dtype string, shape and byte range (relative to the data start)."""

    name: str
    file: str  # absolute path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return DTYPES.get(self.dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def describe(self) -> str:
        return f"{self.dtype} {list(self.shape)}"


class SafetensorsFile:
    """One safetensors file: header parsed and checked on open, tensors read one at a time."""

    def __init__(self, path):
        self.path = str(Path(path).resolve())
        self.name = os.path.basename(self.path)
        self.metadata: dict = {}
        self.tensors: dict[str, TensorInfo] = {}
        self._fd: int | None = None
        self._parse()

    # -- header ---------------------------------------------------------------------------------
    def _parse(self) -> None:
        bad = ProblemCollector()
        try:
            size = os.path.getsize(self.path)
            with open(self.path, "rb") as f:
                raw_len = f.read(8)
                if len(raw_len) < 8:
                    raise CheckpointError(problem(self.name, None, f"not a safetensors file: {size} bytes, "
                                                                   "expected at least an 8-byte header length"))
                (hlen,) = struct.unpack("<Q", raw_len)
                if hlen > MAX_HEADER_BYTES or 8 + hlen > size:
                    raise CheckpointError(problem(self.name, None, f"corrupt header: header length {hlen} bytes, "
                                                                   f"file has {size} bytes"))
                header_bytes = f.read(hlen)
        except OSError as exc:
            raise CheckpointError(problem(self.name, None, f"cannot read: {exc}")) from exc
        try:
            header = json.loads(header_bytes.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(problem(self.name, None, f"corrupt header: not valid JSON ({exc})")) from exc
        if not isinstance(header, dict):
            raise CheckpointError(problem(self.name, None, "corrupt header: expected a JSON object"))
        self.data_start = 8 + hlen
        data_len = size - self.data_start
        self.metadata = header.pop("__metadata__", None) or {}
        spans = []
        for name, entry in header.items():
            try:
                dt, shape, (begin, end) = entry["dtype"], tuple(int(s) for s in entry["shape"]), entry["data_offsets"]
                begin, end = int(begin), int(end)
            except (KeyError, TypeError, ValueError):
                bad.add(self.name, name, f"corrupt header entry {entry!r}: expected dtype, shape, data_offsets")
                continue
            if dt not in DTYPE_SIZES:
                bad.add(self.name, name, f"unsupported dtype {dt!r}")
                continue
            expected = math.prod(shape) * DTYPE_SIZES[dt]
            if end - begin != expected or begin < 0:
                bad.add(self.name, name, f"corrupt header: {dt} {list(shape)} needs {expected} bytes, "
                                         f"data_offsets {[begin, end]} hold {end - begin}")
                continue
            if end > data_len:
                bad.add(self.name, name, f"file truncated: tensor data ends at byte {self.data_start + end}, "
                                         f"file has {size} bytes")
                continue
            spans.append((begin, end, name))
            self.tensors[name] = TensorInfo(name, self.path, dt, shape, begin, end)
        spans.sort()
        for (b0, e0, n0), (b1, _e1, n1) in zip(spans, spans[1:]):
            if b1 < e0:
                bad.add(self.name, n1, f"corrupt header: data of '{n1}' overlaps '{n0}'")
        bad.raise_if_any()

    # -- reads ----------------------------------------------------------------------------------
    def _pread_into(self, view: memoryview, offset: int) -> None:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        done = 0
        while done < len(view):
            n = os.preadv(self._fd, [view[done:]], offset + done)
            if n <= 0:
                raise CheckpointError(problem(self.name, None, f"file truncated while reading at byte {offset + done}"))
            done += n

    def read(self, name: str) -> torch.Tensor:
        """The tensor as a new CPU tensor (its own memory; nothing stays mapped)."""
        info = self.tensors[name]
        buf = torch.empty(info.nbytes, dtype=torch.uint8)
        if info.nbytes:
            self._pread_into(byte_view(buf), self.data_start + info.begin)
        dtype = DTYPES.get(info.dtype)
        if dtype is None:
            raise CheckpointError(problem(self.name, name, f"dtype {info.dtype} has no torch equivalent here"))
        out = buf if dtype == torch.uint8 else buf.view(dtype)
        return out.reshape(info.shape)

    def copy_raw(self, name: str, out, chunk: int = COPY_CHUNK_BYTES) -> None:
        """Append the tensor's bytes to ``out`` (a binary file) in chunks (bounded memory)."""
        info = self.tensors[name]
        buf = bytearray(min(chunk, max(info.nbytes, 1)))
        view = memoryview(buf)
        done = 0
        while done < info.nbytes:
            n = min(len(buf), info.nbytes - done)
            self._pread_into(view[:n], self.data_start + info.begin + done)
            out.write(view[:n])
            done += n

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class CheckpointFiles:
    """All safetensors files of a Hugging Face folder (sharded with an index, single, or a glob)."""

    def __init__(self, directory):
        self.dir = Path(directory)
        self.files: dict[str, SafetensorsFile] = {}
        self.tensors: dict[str, TensorInfo] = {}
        bad = ProblemCollector()
        if not self.dir.is_dir():
            raise CheckpointError(problem(self.dir, None, "not a directory"))
        index_path = self.dir / INDEX_FILE
        weight_map = None
        if index_path.exists():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
                if not isinstance(weight_map, dict):
                    raise TypeError("weight_map is not an object")
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(problem(INDEX_FILE, None, f"corrupt index: {exc}")) from exc
            names = sorted(set(weight_map.values()))
        elif (self.dir / SINGLE_FILE).exists():
            names = [SINGLE_FILE]
        else:
            names = sorted(p.name for p in self.dir.glob("*.safetensors"))
        if not names:
            raise CheckpointError(problem(self.dir, None, "no *.safetensors files (only safetensors checkpoints "
                                                          "are supported)"))
        for fname in names:
            path = self.dir / fname
            if not path.exists():
                bad.add(INDEX_FILE, None, f"references missing file {fname}")
                continue
            try:
                self.files[fname] = SafetensorsFile(path)
            except CheckpointError as exc:
                bad.problems.extend(exc.problems)
        bad.raise_if_any()
        for fname, f in self.files.items():
            for name, info in f.tensors.items():
                if name in self.tensors:
                    other = os.path.basename(self.tensors[name].file)
                    bad.add(fname, name, f"duplicate tensor: also stored in {other}")
                    continue
                if weight_map is not None and weight_map.get(name) != fname:
                    if name not in weight_map:
                        bad.add(fname, name, f"tensor is not listed in {INDEX_FILE}")
                    else:
                        bad.add(INDEX_FILE, name, f"index says {weight_map[name]}, but the tensor is in {fname}")
                    continue
                self.tensors[name] = info
        if weight_map is not None:
            for name, fname in weight_map.items():
                if name not in self.tensors and fname in self.files and name not in self.files[fname].tensors:
                    bad.add(fname, name, f"listed in {INDEX_FILE} but missing from the file")
        bad.raise_if_any()

    def info(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def file_of(self, name: str) -> SafetensorsFile:
        return self.files[os.path.basename(self.tensors[name].file)]

    def read(self, name: str) -> torch.Tensor:
        return self.file_of(name).read(name)

    def relname(self, name: str) -> str:
        return os.path.basename(self.tensors[name].file)

    @property
    def largest_file_bytes(self) -> int:
        return max(os.path.getsize(f.path) for f in self.files.values())

    def close(self) -> None:
        for f in self.files.values():
            f.close()


# ----------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorSpec:
    """A tensor to be written: name, safetensors dtype string and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


def spec_of(name: str, t: torch.Tensor) -> TensorSpec:
    return TensorSpec(name, dtype_name(t.dtype), tuple(t.shape))


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no numpy needed). The caller keeps
    ``t`` alive while the view is in use."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B") if n else memoryview(b"")


def tensor_bytes(t: torch.Tensor) -> tuple[torch.Tensor, memoryview]:
    """(contiguous CPU copy or the tensor itself, its bytes): keep the first alive while writing."""
    t = t.detach().to("cpu").contiguous()
    return t, byte_view(t)


class StreamingSafetensorsWriter:
    """Writes one safetensors file whose tensors are known in advance and arrive in order."""

    def __init__(self, path, specs: Iterable[TensorSpec], metadata: dict | None = None):
        self.path = str(path)
        self.specs = list(specs)
        header: dict = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        offset = 0
        for s in self.specs:
            header[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [offset, offset + s.nbytes]}
            offset += s.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * ((8 - (8 + len(raw)) % 8) % 8)  # align the data start to 8 bytes
        self._f = open(self.path, "wb")
        self._f.write(struct.pack("<Q", len(raw)))
        self._f.write(raw)
        self._next = 0
        self.total_bytes = offset

    def _expect(self, name: str) -> TensorSpec:
        if self._next >= len(self.specs):
            raise RuntimeError(f"{self.path}: unexpected tensor {name!r}: all {len(self.specs)} tensors written")
        s = self.specs[self._next]
        if s.name != name:
            raise RuntimeError(f"{self.path}: expected tensor {s.name!r} next, got {name!r}")
        self._next += 1
        return s

    def write(self, name: str, t: torch.Tensor) -> None:
        s = self._expect(name)
        if dtype_name(t.dtype) != s.dtype or tuple(t.shape) != s.shape:
            raise RuntimeError(f"{self.path}: tensor {name!r}: planned {s.dtype} {list(s.shape)}, "
                               f"got {dtype_name(t.dtype)} {list(t.shape)}")
        if s.nbytes:
            keep, view = tensor_bytes(t)
            self._f.write(view)
            del keep

    def write_raw(self, name: str, src: SafetensorsFile, src_name: str | None = None) -> None:
        s = self._expect(name)
        info = src.tensors[src_name or name]
        if info.nbytes != s.nbytes:
            raise RuntimeError(f"{self.path}: tensor {name!r}: planned {s.nbytes} bytes, source has {info.nbytes}")
        src.copy_raw(src_name or name, self._f)

    def close(self) -> None:
        if self._f.closed:
            return
        missing = len(self.specs) - self._next
        self._f.close()
        if missing:
            raise RuntimeError(f"{self.path}: closed with {missing} planned tensors not written")

    def abort(self) -> None:
        if not self._f.closed:
            self._f.close()


def plan_shards(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Split tensors, in order, into shards of at most ``max_shard_bytes`` (a larger tensor goes alone)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        if shards[-1] and size + s.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    return shards if shards[0] else []


def shard_file_names(n: int) -> list[str]:
    if n == 1:
        return [SINGLE_FILE]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


class ShardedWriter:
    """Writes a planned list of tensors, in order, across shard files plus the index json."""

    def __init__(self, directory, specs: list[TensorSpec], max_shard_bytes: int, metadata: dict | None = None):
        self.dir = Path(directory)
        self.shards = plan_shards(specs, max_shard_bytes)
        self.names = shard_file_names(len(self.shards))
        self.metadata = metadata or {"format": "pt"}
        self._i = -1
        self._w: StreamingSafetensorsWriter | None = None
        self._left = 0
        self.weight_map = {s.name: fname for shard, fname in zip(self.shards, self.names) for s in shard}
        self.total_bytes = sum(s.nbytes for s in specs)

    def _advance(self) -> StreamingSafetensorsWriter:
        while self._w is None or self._left == 0:
            if self._w is not None:
                self._w.close()
            self._i += 1
            if self._i >= len(self.shards):
                raise RuntimeError(f"{self.dir}: more tensors written than planned")
            self._w = StreamingSafetensorsWriter(self.dir / self.names[self._i], self.shards[self._i], self.metadata)
            self._left = len(self.shards[self._i])
        return self._w

    def write(self, name: str, t: torch.Tensor) -> None:
        self._advance().write(name, t)
        self._left -= 1

    def write_raw(self, name: str, src: SafetensorsFile, src_name: str | None = None) -> None:
        self._advance().write_raw(name, src, src_name)
        self._left -= 1

    def close(self) -> None:
        if self._w is not None:
            self._w.close()
        if self._i != len(self.shards) - 1 or self._left:
            raise RuntimeError(f"{self.dir}: closed before all planned tensors were written")
        if len(self.shards) > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": self.weight_map}
            (self.dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")

    def abort(self) -> None:
        if self._w is not None:
            self._w.abort()


def parse_size(text) -> int:
    """``"5GB"``, ``"500MB"``, ``"4.5GiB"`` or a byte count -> bytes."""
    if isinstance(text, int):
        return text
    s = str(text).strip().upper().replace(" ", "")
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    for u, mult in units.items():
        if s.endswith(u):
            return int(float(s[: -len(u)]) * mult)
    return int(s)


class ReadAhead:
    """Iterate ``(item, load(item))`` with ``load`` running on a background thread ``depth`` items ahead.

    File reads release the GIL, so reading the next tensors overlaps with device work on the current
    ones; ``depth`` bounds the host memory held by tensors read but not yet consumed.
    """

    def __init__(self, items: Iterable, load: Callable, depth: int = 2):
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, args=(list(items), load), daemon=True, name="nvfp4-read-ahead")
        self._t.start()

    def _put(self, x) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(x, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, items, load) -> None:
        try:
            for item in items:
                if not self._put((item, load(item))):
                    return
            self._put(None)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
            self._put(exc)

    def __iter__(self):
        while True:
            x = self._q.get()
            if x is None:
                return
            if isinstance(x, BaseException):
                raise x
            yield x

    def close(self) -> None:
        self._stop.set()
        self._t.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


#: Files of a source folder never copied to an output folder: weights in any format and their indexes
#: (the tools write their own), besides the names a tool rewrites itself.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".gguf", ".ckpt")
WEIGHT_INDEXES = (INDEX_FILE, "pytorch_model.bin.index.json")


def copy_side_files(src: Path, out: Path, final: Path, skip_names=()) -> None:
    """Copy what accompanies the weights (tokenizer, generation config, chat template, ...) from
    ``src`` into the staging folder ``out`` of the output folder ``final``: everything but hidden
    entries, weights, weight indexes and ``skip_names``; never ``final`` itself, its staging
    siblings or a folder that contains it (an output may live inside its source)."""
    src, final = Path(src), Path(final).resolve()
    skip = set(WEIGHT_INDEXES) | set(skip_names)
    ignore = shutil.ignore_patterns(*(f"*{s}" for s in WEIGHT_SUFFIXES), ".*")
    for p in src.iterdir():
        if p.name.startswith(".") or p.name in skip or p.suffix in WEIGHT_SUFFIXES:
            continue
        if final.is_relative_to(p.resolve()) or p.name.startswith((f"{final.name}.tmp-", f"{final.name}.old-")):
            continue
        if p.is_dir():
            shutil.copytree(p, Path(out) / p.name, ignore=ignore)
        else:
            shutil.copy2(p, Path(out) / p.name)


@contextlib.contextmanager
def _signals_deferred():
    """SIGINT and SIGTERM wait (are blocked) while the body runs, then arrive as usual."""
    sigs = {signal.SIGINT, signal.SIGTERM}
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextlib.contextmanager
def staged_output_dir(dst: Path):
    """Yield a fresh temporary folder next to ``dst``; when the body completes it replaces ``dst``,
    when the body raises (Ctrl-C and SIGTERM included) it is deleted and ``dst`` is untouched.

    The swap (an existing ``dst`` moved aside, the new folder renamed into place) runs with SIGINT and
    SIGTERM deferred, so it is never cut in half; an interrupt that arrives after ``dst`` is complete
    (during the swap or while the old folder is removed) still propagates, marked with
    ``output_complete = True`` so that callers do not report ``dst`` as unwritten."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{dst.name}.tmp-", dir=dst.parent))
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; DST gets the usual permissions
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    swapped = False
    try:
        with _signals_deferred():
            try:
                if dst.exists():
                    old = Path(tempfile.mkdtemp(prefix=f"{dst.name}.old-", dir=dst.parent))
                    os.rename(dst, old / dst.name)
                    try:
                        os.rename(tmp, dst)
                    except BaseException:
                        os.rename(old / dst.name, dst)  # put the previous folder back
                        raise
                else:
                    os.rename(tmp, dst)
                swapped = True
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                if old is not None:
                    with contextlib.suppress(OSError):
                        os.rmdir(old)  # empty once the previous folder is back; kept (with it) if not
                raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException as exc:
        if swapped:
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            exc.output_complete = True
        raise
