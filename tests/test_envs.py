"""Environment variables: read in nvfp4_plugin/envs.py only, every one documented there and in README.md."""

import ast
import re
from pathlib import Path

import pytest

from nvfp4_plugin import envs

PACKAGE = Path(__file__).resolve().parent.parent / "nvfp4_plugin"
README = PACKAGE.parent / "README.md"

#: Modules allowed to touch os.environ besides envs.py, each with its reason. Setting a variable for
#: a child process or around a Triton compile goes through envs.py too, so nothing is needed here
#: today; an entry must say why envs.py cannot do it.
ALLOWED: dict[str, str] = {}

_OS_ENV_NAMES = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def _environment_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, text) of each use of the process environment through ``os``."""
    os_aliases = {"os"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            os_aliases |= {a.asname or a.name for a in node.names if a.name == "os"}
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            found += [(node.lineno, f"from os import {a.name}") for a in node.names if a.name in _OS_ENV_NAMES]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in _OS_ENV_NAMES and isinstance(node.value, ast.Name) \
                and node.value.id in os_aliases:
            found.append((node.lineno, f"{node.value.id}.{node.attr}"))
    return sorted(found)


def test_only_envs_reads_the_environment():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        if rel == "nvfp4_plugin/envs.py" or rel in ALLOWED:
            continue
        for line, text in _environment_uses(ast.parse(path.read_text(), filename=rel)):
            offenders.append(f"{rel}:{line}: {text}")
    assert not offenders, ("read environment variables through nvfp4_plugin.envs (document them there):\n"
                           + "\n".join(offenders))


def test_the_check_sees_every_form():
    src = ("import os\nimport os as o\nfrom os import getenv\n"
           "os.environ.get('A')\no.getenv('B')\nos.environ['C'] = '1'\nos.path.join('a')\n")
    assert [t for _, t in _environment_uses(ast.parse(src))] == [
        "from os import getenv", "os.environ", "o.getenv", "os.environ"]


def test_allow_list_names_existing_files():
    for rel, why in ALLOWED.items():
        assert (PACKAGE.parent / rel).is_file(), rel
        assert why.strip(), rel


def test_every_variable_is_documented():
    constants = {v for k, v in vars(envs).items() if k.isupper() and isinstance(v, str)}
    assert constants <= set(envs.VARIABLES), constants - set(envs.VARIABLES)
    for name, var in envs.VARIABLES.items():
        assert var.name == name
        assert var.reader in ("plugin", "triton", "csrc", "setup.py"), name
        assert var.values.strip() and var.default.strip() and var.effect.strip(), name


def test_readme_table_lists_every_variable():
    text = README.read_text()
    section = text.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    listed = {name for row in rows for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", row.split("|")[1])}
    missing = sorted(set(envs.VARIABLES) - listed)
    assert not missing, f"README.md's environment variable table lacks {missing}"


def test_readers_follow_the_environment(monkeypatch):
    for name in envs.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert envs.forced_op_backend() is None
    assert envs.forced_layer_backend(envs.LINEAR_BACKEND) is None
    assert envs.act_mode("w4a16") == "w4a16"
    assert envs.flashinfer_mm_backend() == "cutlass"
    assert envs.log_level() == "INFO"
    assert envs.gemm_config_dir() is None
    assert not envs.gemm_compile_only() and not envs.triton_interpret()

    monkeypatch.setenv(envs.OP_BACKEND, "reference")
    monkeypatch.setenv(envs.MOE_BACKEND, "hopper_triton")
    monkeypatch.setenv(envs.ACT_MODE, "")
    monkeypatch.setenv(envs.LOG_LEVEL, "debug")
    monkeypatch.setenv(envs.GEMM_COMPILE_ONLY, "1")
    monkeypatch.setenv(envs.TRITON_INTERPRET, "0")
    assert envs.forced_op_backend() == "reference"
    assert envs.forced_layer_backend(envs.MOE_BACKEND) == "hopper_triton"
    assert envs.act_mode("w4a16") == ""  # set but empty: given as is, the caller rejects it
    assert envs.log_level() == "DEBUG"
    assert envs.gemm_compile_only() and not envs.triton_interpret()
    with pytest.raises(ValueError, match="var: expected NVFP4_PLUGIN_LINEAR_BACKEND or NVFP4_PLUGIN_MOE_BACKEND"):
        envs.forced_layer_backend("NVFP4_PLUGIN_OP_BACKEND")


def test_setters_restore_and_scope(monkeypatch):
    import os

    for name in (envs.DISABLE_MMA_V3, envs.GEMM_COMPILE_ONLY):  # restored at teardown even if set here
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    with envs.triton_mma_v2():
        assert os.environ[envs.DISABLE_MMA_V3] == "1"
    assert envs.DISABLE_MMA_V3 not in os.environ
    monkeypatch.setenv(envs.DISABLE_MMA_V3, "0")
    with pytest.raises(RuntimeError):
        with envs.triton_mma_v2():
            raise RuntimeError
    assert os.environ[envs.DISABLE_MMA_V3] == "0"

    monkeypatch.setenv(envs.TRITON_INTERPRET, "1")
    env = envs.compile_worker_env()
    assert env[envs.GEMM_COMPILE_ONLY] == "1" and envs.TRITON_INTERPRET not in env
    assert os.environ[envs.TRITON_INTERPRET] == "1" and envs.GEMM_COMPILE_ONLY not in os.environ

    envs.default_gemm_compile_only()
    assert os.environ[envs.GEMM_COMPILE_ONLY] == "1"
    monkeypatch.setenv(envs.GEMM_COMPILE_ONLY, "0")
    envs.default_gemm_compile_only()
    assert os.environ[envs.GEMM_COMPILE_ONLY] == "0"
