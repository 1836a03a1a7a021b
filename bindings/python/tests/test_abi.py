"""The ctypes mirrors and enums against include/minikv.h, and library discovery."""
import ctypes
import ctypes.util
import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import minikv
from minikv._types import MemoryStatsStruct, MinikvConfigStruct, _to_enum

REPO = Path(__file__).resolve().parents[3]
HEADER = REPO / "include" / "minikv.h"
PKG_PARENT = Path(minikv.__file__).resolve().parents[1]


def test_struct_layout_matches_the_c_compiler(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler")
    lines = []
    for ctype, struct in (("minikv_config", MinikvConfigStruct),
                          ("minikv_memory_stats", MemoryStatsStruct)):
        lines.append(f'printf("{ctype} sizeof %zu\\n", sizeof({ctype}));')
        for name, _ in struct._fields_:
            lines.append(f'printf("{ctype} {name} %zu %zu\\n", offsetof({ctype}, {name}), '
                         f'sizeof((({ctype} *)0)->{name}));')
    src = tmp_path / "layout.c"
    src.write_text("#include <stdio.h>\n#include <stddef.h>\n#include \"minikv.h\"\n"
                   "int main(void) {\n" + "\n".join(lines) + "\nreturn 0;\n}\n")
    exe = tmp_path / "layout"
    subprocess.run([cc, "-std=c99", f"-I{HEADER.parent}", str(src), "-o", str(exe)], check=True)
    c_side = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split("\n")
    py_side = []
    for ctype, struct in (("minikv_config", MinikvConfigStruct),
                          ("minikv_memory_stats", MemoryStatsStruct)):
        py_side.append(f"{ctype} sizeof {ctypes.sizeof(struct)}")
        for name, _ in struct._fields_:
            field = getattr(struct, name)
            py_side.append(f"{ctype} {name} {field.offset} {field.size}")
    assert [l for l in c_side if l] == py_side


def test_every_struct_field_is_mirrored():
    text = HEADER.read_text()
    for ctype, struct in (("minikv_config", MinikvConfigStruct),
                          ("minikv_memory_stats", MemoryStatsStruct)):
        body = re.search(r"typedef struct %s \{(.*?)\} %s;" % (ctype, ctype), text, re.S).group(1)
        body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
        names = re.findall(r"(\w+)\s*;", body)
        assert names == [n for n, _ in struct._fields_], ctype


def test_appended_config_fields_keep_their_documented_offsets():
    """The fields appended to minikv_config sit where include/minikv.h documents them (the
    compiler comparison above would follow a header that moved them): sink_tokens and
    prefill_staging_tokens in the first layout's tail (96, 100), flush_tokens and its
    reserved tail padding after them (104, 108); 112 bytes in all."""
    offsets = {name: getattr(MinikvConfigStruct, name).offset
               for name in ("reserved_v1_", "sink_tokens", "prefill_staging_tokens",
                            "flush_tokens", "reserved_v3_")}
    assert offsets == {"reserved_v1_": 92, "sink_tokens": 96, "prefill_staging_tokens": 100,
                       "flush_tokens": 104, "reserved_v3_": 108}
    assert ctypes.sizeof(MinikvConfigStruct) == 112
    # The padding stays private: Config has flush_tokens, never the reserved slots.
    names = {f.name for f in dataclasses.fields(minikv.Config)}
    assert "flush_tokens" in names and not {n for n in names if n.startswith("reserved")}


def test_reserved_tail_is_zero_and_checked_by_the_library():
    """reserved_v3_ is the slot the library reads after flush_tokens: the binding leaves it 0
    (to_struct starts from minikv_config_default()), and a non-zero value there is refused
    with VERSION_MISMATCH, which also shows the ctypes field is where the library looks."""
    s = minikv.Config(backend="cpu", num_layers=1, num_heads=2, num_kv_heads=1, head_dim=32,
                      flush_tokens=32).to_struct()
    assert s.reserved_v3_ == 0 and s.flush_tokens == 32
    assert s.struct_size == ctypes.sizeof(MinikvConfigStruct)
    lib = minikv.load()
    handle = ctypes.c_void_p()
    s.reserved_v3_ = 1
    assert lib.minikv_cache_create(ctypes.byref(s), ctypes.byref(handle)) == \
        minikv.Status.VERSION_MISMATCH
    assert "reserved_v3_" in lib.minikv_last_error_message().decode()
    assert not handle.value
    s.reserved_v3_ = 0
    assert lib.minikv_cache_create(ctypes.byref(s), ctypes.byref(handle)) == minikv.Status.OK
    lib.minikv_cache_destroy(handle)


@pytest.mark.parametrize("enum_cls,ctype,prefix", [
    (minikv.Status, "minikv_status", "MINIKV_(?:ERR_)?"),
    (minikv.Backend, "minikv_backend", "MINIKV_BACKEND_"),
    (minikv.DType, "minikv_dtype", "MINIKV_DTYPE_"),
    (minikv.BudgetPolicy, "minikv_budget_policy", "MINIKV_BUDGET_"),
    (minikv.ScoreMode, "minikv_score_mode", "MINIKV_SCORE_"),
    (minikv.Preset, "minikv_preset", "MINIKV_PRESET_")])
def test_enum_values_match_the_header(enum_cls, ctype, prefix):
    body = re.search(r"typedef enum %s \{(.*?)\} %s;" % (ctype, ctype), HEADER.read_text(), re.S).group(1)
    pinned = {m.group(1): int(m.group(2))
              for m in re.finditer(r"\b%s([A-Z0-9_]+)\s*=\s*(\d+)" % prefix, body)}
    assert pinned and {m.name: int(m) for m in enum_cls} == pinned


def test_versions_agree():
    text = HEADER.read_text()
    major = int(re.search(r"#define MINIKV_VERSION_MAJOR (\d+)", text).group(1))
    assert minikv.BINDING_VERSION_MAJOR == major
    lib = minikv.load()
    assert lib.minikv_version_number() // 10000 == major
    assert minikv.library_version().split(".")[0] == str(major)


def test_version_rule():
    """MINIKV_VERSION_COMPATIBLE: the same major version, and not older than the binding."""
    from minikv._library import compatible
    text = HEADER.read_text()
    parts = [int(re.search(r"#define MINIKV_VERSION_%s (\d+)" % p, text).group(1))
             for p in ("MAJOR", "MINOR", "PATCH")]
    assert minikv.__version__ == "%d.%d.%d" % tuple(parts)
    built = parts[0] * 10000 + parts[1] * 100 + parts[2]
    assert minikv.BINDING_VERSION_NUMBER == built
    assert compatible(built) and compatible(built + 1) and compatible(built + 100)
    assert compatible(parts[0] * 10000 + 9999)
    assert not compatible((parts[0] + 1) * 10000)
    if built % 10000:
        assert not compatible(built - 1)
    if parts[0]:
        assert not compatible(parts[0] * 10000 - 1)
    assert compatible(minikv.load().minikv_version_number())


def test_an_older_library_is_refused(monkeypatch):
    """A binding newer than the library (here: pretending to be one minor ahead) refuses it
    with VERSION_MISMATCH naming both versions."""
    from minikv import _library
    path = minikv.library_path()
    monkeypatch.setattr(_library, "BINDING_VERSION_NUMBER", _library.BINDING_VERSION_NUMBER + 100)
    with pytest.raises(minikv.MinikvError) as info:
        _library._open(path)
    assert info.value.status == minikv.Status.VERSION_MISMATCH
    assert minikv.library_version() in info.value.message and minikv.__version__ in info.value.message


def test_config_defaults_come_from_the_library():
    raw = MinikvConfigStruct()
    assert minikv.load().minikv_config_init(ctypes.byref(raw), ctypes.sizeof(raw)) == 0
    assert raw.struct_size == ctypes.sizeof(MinikvConfigStruct)
    cfg = minikv.Config()
    for f in dataclasses.fields(cfg):
        assert getattr(cfg, f.name) == pytest.approx(getattr(raw, f.name)), f.name
    # The defaults documented in the header: MINIKV_PRESET_BALANCED.
    assert (cfg.key_bits, cfg.value_bits, cfg.group_size, cfg.residual_length) == (4, 2, 32, 64)
    assert cfg.sink_tokens == 4 and cfg.budget_policy is minikv.BudgetPolicy.PYRAMID
    # A sliding flush: the oldest 32 tokens of a full 64-token residual.
    assert cfg.flush_tokens == 32 and raw.reserved_v3_ == 0
    assert cfg.score_mode is minikv.ScoreMode.WINDOW
    assert cfg.heavy_ratio == 0.25 and cfg.recent_ratio == 0.25
    assert cfg.backend is minikv.Backend.AUTO and cfg.dtype is minikv.DType.F16
    # Round trip, with enums given by name.
    cfg = minikv.Config(backend="cpu", dtype="bfloat16", budget_policy="PYRAMID",
                        score_mode=1, num_layers=3, max_tokens=2 ** 40, heavy_ratio=0.1,
                        flush_tokens=96)
    back = minikv.Config.from_struct(cfg.to_struct())
    assert back.flush_tokens == 96 and cfg.to_struct().flush_tokens == 96
    assert back.backend is minikv.Backend.CPU and back.dtype is minikv.DType.BF16
    assert back.budget_policy is minikv.BudgetPolicy.PYRAMID and back.score_mode is minikv.ScoreMode.WINDOW
    assert back.max_tokens == 2 ** 40 and back.num_layers == 3
    assert back.heavy_ratio == pytest.approx(0.1)


def _probe(env_lib, package_parent=PKG_PARENT):
    env = dict(os.environ, PYTHONPATH=str(package_parent))
    env.pop("MINIKV_LIBRARY", None)
    if env_lib is not None:
        env["MINIKV_LIBRARY"] = env_lib
    return subprocess.run([sys.executable, "-c", "import minikv; print(minikv.library_path())"],
                          env=env, capture_output=True, text=True)


def test_library_discovery():
    here = minikv.library_path()
    r = _probe(here)
    assert r.returncode == 0 and r.stdout.strip() == here
    r = _probe("/nonexistent/libminikv.so")
    assert r.returncode != 0 and "does not exist" in r.stderr
    # A directory holding the library names it too.
    r = _probe(os.path.dirname(here))
    assert r.returncode == 0 and os.path.dirname(r.stdout.strip()) == os.path.dirname(here)
    assert os.path.basename(r.stdout.strip()).startswith("libminikv")
    # Without the variable: next to the package, the source tree's build dirs, the system.
    r = _probe(None)
    if minikv.candidate_paths():
        assert r.returncode == 0 and r.stdout.strip() == minikv.candidate_paths()[0]
    else:
        assert "cannot find libminikv" in r.stderr


# BALANCED: a 64-token residual flushed 32 tokens at a time; the others flush the whole
# 128-token residual at once.
PRESET_FIELDS = [
    ("balanced", dict(key_bits=4, value_bits=2, group_size=32, sink_tokens=4, budget_policy=1,
                      score_mode=1, residual_length=64, flush_tokens=32)),
    ("paper", dict(key_bits=2, value_bits=2, group_size=16, sink_tokens=0, budget_policy=1,
                   score_mode=0, residual_length=128, flush_tokens=0)),
    (minikv.Preset.QUALITY, dict(key_bits=8, value_bits=8, group_size=32, sink_tokens=4,
                                 budget_policy=0, score_mode=0, residual_length=128,
                                 flush_tokens=0)),
    (3, dict(key_bits=16, value_bits=16, group_size=16, sink_tokens=0, budget_policy=0,
             score_mode=0, residual_length=128, flush_tokens=0)),
]


@pytest.mark.parametrize("preset,fields", PRESET_FIELDS)
def test_presets_set_the_compression_fields(preset, fields):
    cfg = minikv.Config.from_preset(preset, num_layers=3, head_dim=96)
    for name, value in fields.items():
        assert getattr(cfg, name) == value, name
    assert (cfg.heavy_ratio, cfg.recent_ratio) == (0.25, 0.25)
    assert cfg.pyramid_depth == 7.0 and (cfg.window_size, cfg.pool_kernel) == (32, 7)
    # Fields given on top win; the rest are minikv_config_default()'s.
    assert cfg.num_layers == 3 and cfg.head_dim == 96
    assert cfg.max_seq_len == minikv.Config().max_seq_len and cfg.backend is minikv.Backend.AUTO
    assert minikv.Config.from_preset(preset, sink_tokens=7).sink_tokens == 7
    assert minikv.Config.from_preset(preset, flush_tokens=24).flush_tokens == 24


@pytest.mark.parametrize("preset,fields", PRESET_FIELDS)
def test_presets_write_residual_and_flush(preset, fields):
    """minikv_config_preset itself writes residual_length and flush_tokens, whatever the
    struct held (from_preset above starts from the defaults, which hold BALANCED's)."""
    lib = minikv.load()
    s = minikv.Config(residual_length=512, flush_tokens=96).to_struct()
    value = int(_to_enum(minikv.Preset, preset, "preset"))
    assert lib.minikv_config_preset(ctypes.byref(s), value) == 0
    want = (fields["residual_length"], fields["flush_tokens"])
    assert (s.residual_length, s.flush_tokens) == want


class _OldCallerCache(minikv.Cache):
    """A cache created from a struct of a caller built before flush_tokens: struct_size 104,
    so the library must not read flush_tokens (offset 104) or reserved_v3_."""

    def _create(self, struct):
        struct.struct_size = MinikvConfigStruct.flush_tokens.offset
        super()._create(struct)


def test_a_struct_without_flush_tokens_keeps_the_old_behaviour(rng):
    """A caller whose struct ends before flush_tokens (104 bytes) gets its library's
    behaviour: minikv_config_init and every preset give residual_length 128 and write
    nothing from byte 104 on, and minikv_cache_create flushes the whole residual whatever
    those bytes hold."""
    lib = minikv.load()
    size = MinikvConfigStruct.flush_tokens.offset
    assert size == 104
    s = MinikvConfigStruct()
    ctypes.memset(ctypes.byref(s), 0xA5, ctypes.sizeof(s))
    assert lib.minikv_config_init(ctypes.byref(s), size) == 0
    assert (s.struct_size, s.residual_length, s.group_size) == (size, 128, 32)
    assert (s.flush_tokens, s.reserved_v3_) == (0xA5A5A5A5, 0xA5A5A5A5)  # not written
    for preset in minikv.Preset:
        s.residual_length = 32
        assert lib.minikv_config_preset(ctypes.byref(s), int(preset)) == 0
        assert s.residual_length == 128, preset
        assert (s.flush_tokens, s.reserved_v3_) == (0xA5A5A5A5, 0xA5A5A5A5), preset

    # The same config with flush_tokens = 32 (G = 16, R = 64): the old caller's cache
    # flushes all 64 tokens, as one with flush_tokens = 0 does, not the oldest 32.
    cfg = minikv.Config(backend="cpu", dtype="f32", num_layers=1, num_heads=2, num_kv_heads=1,
                        head_dim=32, max_seq_len=256, key_bits=2, value_bits=2, group_size=16,
                        residual_length=64, flush_tokens=32, budget_policy="uniform")
    whole = dataclasses.replace(cfg, flush_tokens=0)
    caches = [_OldCallerCache(cfg), minikv.Cache(whole), minikv.Cache(cfg)]
    try:
        x = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
        q, k, v = x(40, 2, 32), x(40, 1, 32), x(40, 1, 32)
        for c in caches:
            c.prefill(0, [0], [0, 40], q, k, v)
        differed = 0
        for step in range(150):  # flushes after 60, 124 appends (and every 32 for F = 32)
            k, v, q = x(1, 1, 32), x(1, 1, 32), x(1, 2, 32)
            outs = [c.append_decode(0, [0], q, k, v) for c in caches]
            stats = [c.memory_stats() for c in caches]
            assert stats[0] == stats[1], f"step {step}"
            assert outs[0].tobytes() == outs[1].tobytes(), f"step {step}"
            differed += stats[2].used_bytes != stats[1].used_bytes
        assert differed > 50  # a library that read flush_tokens would have failed above
    finally:
        for c in caches:
            c.close()


def test_preset_names_and_errors():
    assert minikv.Config.from_preset("PAPER") == minikv.Config.from_preset(minikv.Preset.PAPER)
    assert minikv.Config.from_preset("balanced") == minikv.Config()  # the default
    with pytest.raises(minikv.MinikvError, match="preset") as e:
        minikv.Config.from_preset("fastest")
    assert e.value.status == minikv.Status.INVALID_ARGUMENT
    # An int the binding does not know reaches the library, whose message names it.
    with pytest.raises(minikv.MinikvError, match=r"preset \(9\)") as e:
        minikv.Config.from_preset(9)
    assert e.value.status == minikv.Status.INVALID_ARGUMENT


def test_explicit_choices_that_fail_say_why(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    r = _probe(str(empty))
    assert r.returncode != 0 and "holds no libminikv.so" in r.stderr and "MINIKV_LIBRARY" in r.stderr
    not_a_library = tmp_path / "libminikv.so"
    not_a_library.write_text("not an ELF file")
    for choice in (str(not_a_library), str(tmp_path)):
        r = _probe(choice)
        assert r.returncode != 0 and "does not load as libminikv" in r.stderr, r.stderr


def test_installed_package_without_library_says_what_to_do(tmp_path):
    """A copy of the package outside any checkout, with no library next to it: the error
    speaks of an installed package (reinstall, MINIKV_LIBRARY), not of building in a tree."""
    if ctypes.util.find_library("minikv"):
        pytest.skip("a libminikv is installed system-wide: the copy would load it")
    shutil.copytree(PKG_PARENT / "minikv", tmp_path / "minikv",
                    ignore=shutil.ignore_patterns("libminikv*", "__pycache__"))
    r = _probe(None, package_parent=tmp_path)
    assert r.returncode != 0
    assert "installed package" in r.stderr and "pip install" in r.stderr
    assert "MINIKV_LIBRARY" in r.stderr and "cmake -S" not in r.stderr
