"""What a type checker sees of the package: Config accepts enum names (as the README shows),
and the enums print as names."""
import ast
import dataclasses
import inspect
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import minikv
from minikv import _config

PKG_PARENT = Path(minikv.__file__).resolve().parents[1]


def test_enums_print_as_names():
    with minikv.Cache(minikv.Config(backend="cpu", dtype="f32", num_layers=1, num_heads=2,
                                    num_kv_heads=1, head_dim=32)) as cache:
        assert str(cache.backend) == "CPU" and f"{cache.backend}" == "CPU"
    assert str(minikv.DType.BF16) == "BF16" and f"{minikv.BudgetPolicy.PYRAMID}" == "PYRAMID"
    assert str(minikv.ScoreMode.WINDOW) == "WINDOW" and str(minikv.Status.BAD_STATE) == "BAD_STATE"
    assert str(minikv.Preset.EVICTION_ONLY) == "EVICTION_ONLY"
    assert f"{minikv.DType.F32:d}" == "2" and int(minikv.Backend.CUDA) == 2  # still ints


def test_the_init_signature_for_type_checkers_matches_the_fields():
    """Config's TYPE_CHECKING __init__ must list the dataclass fields, in order: a field
    added to Config and not to it would be invisible to mypy."""
    tree = ast.parse(inspect.getsource(_config))
    config = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Config")
    guarded = next(n for n in config.body if isinstance(n, ast.If)
                   and getattr(n.test, "id", None) == "TYPE_CHECKING")
    init = next(n for n in guarded.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    params = [a.arg for a in init.args.args[1:]]
    assert params == [f.name for f in dataclasses.fields(minikv.Config)]


def _mypy(source, tmp_path):
    if shutil.which("mypy") is None and subprocess.run(
            [sys.executable, "-m", "mypy", "--version"], capture_output=True).returncode != 0:
        pytest.skip("mypy is not installed")
    path = tmp_path / "user.py"
    path.write_text(textwrap.dedent(source))
    env = dict(os.environ, MYPYPATH=str(PKG_PARENT))
    # --follow-imports=silent: judge the user's code, not the package's own internals.
    return subprocess.run([sys.executable, "-m", "mypy", "--follow-imports=silent",
                           "--no-incremental", str(path)], capture_output=True, text=True,
                          env=env, cwd=tmp_path)


def test_mypy_accepts_config_with_enum_names(tmp_path):
    r = _mypy("""
        import minikv
        cfg = minikv.Config(backend="cpu", dtype="f16", num_layers=32, num_heads=32,
                            num_kv_heads=8, head_dim=128, budget_policy="pyramid",
                            score_mode=minikv.ScoreMode.WINDOW, heavy_ratio=0.25)
        backend: minikv.Backend = cfg.backend
        name: str = str(backend)
        """, tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_rejects_a_wrong_type(tmp_path):
    r = _mypy("""
        import minikv
        cfg = minikv.Config(backend=1.5, num_layers="two")
        """, tmp_path)
    assert r.returncode != 0 and "backend" in r.stdout and "num_layers" in r.stdout, r.stdout
