"""What the evaluation scripts (eval_accuracy.py, system_bench.py) share: the commit label of
a result and its atomic JSON write."""
from __future__ import annotations

import json
import os
import subprocess

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def git_commit():
    """MINIKV_COMMIT when set (a copy of the tree without .git, or with a stale one: a GPU
    box), else git's short HEAD, else None."""
    if os.environ.get("MINIKV_COMMIT"):
        return os.environ["MINIKV_COMMIT"]
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except Exception:
        return None


def write_json(path, obj):
    """Writes through a temporary file, so a run killed mid-write keeps the previous version."""
    with open(path + ".part", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".part", path)
