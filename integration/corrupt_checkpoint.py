#!/usr/bin/env python3
"""Damage a safetensors checkpoint folder in place, for the corrupted-checkpoint server tests.

    corrupt_checkpoint.py DIR drop-tensor NAME          remove tensor NAME (and its index entry)
    corrupt_checkpoint.py DIR set-scalar NAME VALUE     overwrite every element of NAME with VALUE
"""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def main() -> int:
    d, action, name = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    for f in sorted(d.glob("*.safetensors")):
        tensors = load_file(str(f))
        if name not in tensors:
            continue
        if action == "drop-tensor":
            del tensors[name]
        elif action == "set-scalar":
            tensors[name] = torch.full_like(tensors[name], float(sys.argv[4]))
        else:
            raise SystemExit(f"unknown action {action}")
        save_file(tensors, str(f), metadata={"format": "pt"})
        index = d / "model.safetensors.index.json"
        if action == "drop-tensor" and index.exists():
            idx = json.loads(index.read_text())
            idx["weight_map"].pop(name, None)
            index.write_text(json.dumps(idx, indent=1))
        print(f"{action} {name} in {f.name}")
        return 0
    raise SystemExit(f"{name} not found in {d}")


if __name__ == "__main__":
    sys.exit(main())
