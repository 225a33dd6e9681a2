#!/usr/bin/env python3
"""Write a minimal ``nvfp4_plugin-<version>.dist-info`` (METADATA + entry_points.txt) into DIR.

On a machine where the package runs from a source tree on PYTHONPATH instead of being pip-installed
(the offline GPU machine), putting DIR on PYTHONPATH lets the engines discover the plugin through
importlib.metadata entry points exactly as after `pip install`. The entry points are read from
pyproject.toml, so they cannot drift.
"""

import sys
import tomllib
from pathlib import Path


def main() -> int:
    root = Path(__file__).resolve().parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    d = Path(sys.argv[1]) / f"nvfp4_plugin-{project['version']}.dist-info"
    d.mkdir(parents=True, exist_ok=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    lines = []
    for group, eps in project.get("entry-points", {}).items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {target}" for name, target in eps.items()]
        lines.append("")
    (d / "entry_points.txt").write_text("\n".join(lines))
    print(f"wrote {d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
