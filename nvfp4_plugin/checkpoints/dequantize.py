"""``nvfp4-plugin dequantize``: an NVFP4 checkpoint -> a plain Hugging Face checkpoint with the exact
dequantized weights.

Every quantized module's ``weight`` becomes ``e2m1 x e4m3 / encode global scale``, the reference
dequantization of the canonical weight (:meth:`Nvfp4Weight.dequantize`, what our layers compute),
in fp32 by default (``bfloat16``/``float16`` round it). For compressed-tensors files and for
ModelOpt files written by ``nvfp4-plugin quantize`` (their ``weight_scale_2`` is a reciprocal fixed
point) that is the file's own ``e2m1 x e4m3 x weight_scale_2`` bit for bit; for ModelOpt files from
other tools the two can differ by one fp32 rounding. Activation and KV-cache scales are dropped
(the output declares no quantization); every other tensor is copied byte for byte, as are the side
files (tokenizer, generation config, chat template). ``config.json`` loses its ``quantization_config``
and ``hf_quant_config.json`` is not written, so any engine or transformers loads the result as an
unquantized model: the ground truth that "weight-only with exactly dequantized weights" must match
(``integration/reference_logprobs.py`` runs it through transformers on the CPU).

Same streaming and atomicity as ``quantize``: one module at a time, written into a temporary folder
next to DST and renamed at the end.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import formats as F
from .config import CONFIG_JSON, HF_QUANT_CONFIG
from .loader import open_checkpoint
from .errors import CheckpointError, problem
from .safetensors_io import ShardedWriter, TensorSpec, copy_side_files, dtype_name, parse_size, staged_output_dir

logger = logging.getLogger("nvfp4_plugin")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: Attention / KV-cache quantization scales a quantized checkpoint may carry; meaningless without it.
KV_SCALE_SUFFIXES = (".k_scale", ".v_scale", ".q_scale", ".kv_scale", ".prob_scale")


def _set_dtype(cfg: dict, dtype: str) -> None:
    """The weight dtype in every place transformers looks (``dtype``, older ``torch_dtype``, nested
    sub-configs such as ``text_config``)."""
    keys = [k for k in ("dtype", "torch_dtype") if k in cfg]
    for k in keys or ["dtype"]:
        cfg[k] = dtype
    for v in cfg.values():
        if isinstance(v, dict) and any(k in v for k in ("dtype", "torch_dtype")):
            _set_dtype(v, dtype)


@dataclass
class DequantizeReport:
    dst: str
    modules: int
    copied: int
    dtype: str
    files: list[str]
    seconds: float

    def summary(self) -> str:
        return (f"wrote {self.dst}: {self.modules} modules dequantized to {self.dtype}, {self.copied} tensors "
                f"copied, {len(self.files)} file(s), {self.seconds:.1f}s")


def dequantize_checkpoint(src, dst, *, dtype: str = "float32", overwrite: bool = False,
                          max_shard_size: str = "5GB") -> DequantizeReport:
    """Write the dequantized twin of the NVFP4 checkpoint ``src`` to ``dst``."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, got {dtype!r}")
    t0 = time.time()
    src, dst = Path(src), Path(dst)
    if dst.exists() and not overwrite:
        raise FileExistsError(f"{dst} exists (pass --overwrite to replace it)")
    if dst.resolve() == src.resolve():
        raise CheckpointError(problem(dst, None, "DST must differ from SRC"))
    torch_dtype = DTYPES[dtype]
    with open_checkpoint(src) as ckpt:
        spec = ckpt.config.spec
        # Plan: every tensor of the source in file order; a quantized module's tensors collapse into
        # one dequantized "<module>.weight" at the place of its packed weight.
        weight_of = {qm.tensors[F.ROLE_WEIGHT].name: m for m, qm in ckpt.modules.items()}
        dropped = {info.name for qm in ckpt.modules.values() for r, info in qm.tensors.items() if r != F.ROLE_WEIGHT}
        items: list[tuple[str, str]] = []  # (kind, name): "deq" module / "copy" tensor
        specs: list[TensorSpec] = []
        for name, info in ckpt.files.tensors.items():
            if name in dropped or name.endswith(KV_SCALE_SUFFIXES):
                continue
            if name in weight_of:
                m = weight_of[name]
                qm = ckpt.modules[m]
                items.append(("deq", m))
                specs.append(TensorSpec(f"{m}.weight", dtype_name(torch_dtype), (qm.n, qm.k)))
            else:
                items.append(("copy", name))
                specs.append(TensorSpec(name, info.dtype, tuple(info.shape)))
        writer = None
        with staged_output_dir(dst) as tmp:
            try:
                copy_side_files(src, tmp, dst, skip_names=(CONFIG_JSON, HF_QUANT_CONFIG))
                cfg = json.loads((src / CONFIG_JSON).read_text())
                cfg.pop("quantization_config", None)
                _set_dtype(cfg, dtype)
                (tmp / CONFIG_JSON).write_text(json.dumps(cfg, indent=2) + "\n")
                writer = ShardedWriter(tmp, specs, parse_size(max_shard_size),
                                       metadata={"format": "pt", "producer": "nvfp4-plugin dequantize"})
                for kind, name in items:
                    if kind == "copy":
                        writer.write_raw(name, ckpt.files.file_of(name), name)
                    else:
                        w = ckpt.load_linear(name).weight
                        writer.write(f"{name}.weight", w.dequantize(torch.float32).to(torch_dtype))
                writer.close()
                files = list(writer.names)
            except BaseException:  # close the open shard before the staging folder is deleted
                if writer is not None:
                    writer.abort()
                raise
        n_mod, n_copy = len(weight_of), sum(k == "copy" for k, _ in items)
    logger.info("nvfp4_plugin: dequantized %d modules of %s (%s)", n_mod, src, spec.name)
    return DequantizeReport(str(dst), n_mod, n_copy, dtype, files, time.time() - t0)
