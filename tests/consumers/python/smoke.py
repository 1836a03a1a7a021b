"""A user's first program with the installed wheel: run from a directory outside the source
tree, with no MINIKV_LIBRARY, it must find the library the wheel bundles, accept it under
the version rule, and run create -> prefill -> append -> decode -> stats -> close.
scripts/test.sh builds the wheel, installs it into a fresh venv and runs this file."""
import os
import sys

import numpy as np

import minikv

assert "MINIKV_LIBRARY" not in os.environ, "the smoke test must find the library by itself"
package_dir = os.path.dirname(os.path.abspath(minikv.__file__))
library = minikv.library_path()
assert os.path.dirname(os.path.abspath(library)) == package_dir, \
    f"loaded {library}, not the copy bundled in {package_dir}"
assert minikv.library_version() == minikv.__version__, (minikv.library_version(), minikv.__version__)

H, HKV, D, L = 4, 2, 64, 40
cfg = minikv.Config(backend="cpu", dtype="f32", num_layers=1, num_heads=H, num_kv_heads=HKV,
                    head_dim=D, max_sequences=2, max_seq_len=128)
rng = np.random.default_rng(7)
with minikv.Cache(cfg) as cache:
    q = rng.standard_normal((2 * L, H, D), dtype=np.float32)
    k = rng.standard_normal((2 * L, HKV, D), dtype=np.float32)
    v = np.full((2 * L, HKV, D), 0.5, dtype=np.float32)  # attention of a constant is that constant
    out = cache.prefill(0, [0, 1], [0, L, 2 * L], q, k, v)
    cache.append(0, [0, 1], k[:2], v[:2])
    o = cache.decode(0, [0, 1], q[:2])
    assert np.allclose(out, 0.5, atol=1e-6) and np.allclose(o, 0.5, atol=1e-6)
    stats = cache.memory_stats()
    assert stats.tokens_seen == 2 * (L + 1), stats
    print(f"minikv {minikv.__version__} from {library}: backend {cache.backend}, "
          f"{stats.tokens_cached} of {stats.tokens_seen} tokens kept")
sys.exit(0)
