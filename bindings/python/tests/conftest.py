"""Test setup: import the package from this source tree (no install needed) and report
which libminikv is under test. Point MINIKV_LIBRARY at a freshly built library, e.g.
MINIKV_LIBRARY=build-py/libminikv.so python -m pytest bindings/python/tests -q"""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import minikv  # noqa: E402


def pytest_report_header(config):
    try:
        return f"libminikv {minikv.library_version()} from {minikv.library_path()}"
    except Exception as e:  # reported by the tests themselves
        return f"libminikv: not loaded ({e})"


@pytest.fixture
def rng():
    return np.random.default_rng(20241127)


NP_DTYPES = {minikv.DType.F16: np.float16, minikv.DType.F32: np.float32}
# Output tolerance (atol = rtol) against float64 attention: the output is rounded to the
# dtype once (fp16: 2^-11 relative) on top of float32 accumulation.
TOLERANCE = {minikv.DType.F16: 2e-3, minikv.DType.F32: 2e-5, minikv.DType.BF16: 1.6e-2}


def cpu_cache(**fields):
    """A CPU cache with the paper's setting (Preset.PAPER) under `fields`."""
    fields.setdefault("backend", minikv.Backend.CPU)
    return minikv.Cache(minikv.Config.from_preset("paper", **fields))
