#!/usr/bin/env python3
"""bench/sass_lines.py — static SASS instruction counts of one CUDA kernel by source line,
without a GPU: where a kernel's instructions come from, before and after a change.

    python3 bench/sass_lines.py OBJECT --kernel SUBSTRING [--source FILE] [--top N]
        [--range NAME:FIRST-LAST ...] [--arch sm_90a]

OBJECT is a CUDA object (`build/kernels/CMakeFiles/minikv_cuda.dir/decode_k4v2_warp.cu.o`)
or a cubin, compiled with line information (the library's CUDA objects are: -lineinfo).
--kernel picks the one kernel whose mangled name contains SUBSTRING (e.g.
"decode_k4v2_warp_kernelI6__halfLi128ELi4E"); the list of names is printed when none or
several match. Each instruction is counted against the last line of --source (default: the
file that defines the kernel) in its inline chain, so an inlined helper's instructions count
at the line that calls it. Prints the total, the --top lines with their text, and the
--range sums (line numbers of --source, inclusive).

Counts are static: a loop the compiler did not unroll counts once, code on a path a launch
never takes counts in full. Needs cuobjdump and nvdisasm: a CUDA toolkit's, or the PyPI
wheels nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm (on PATH, in $CUDA_HOME/bin, or in
/usr/local/cuda/bin).
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

FILE_LINE = re.compile(r'^\s*//## File "([^"]+)", line (\d+)')
INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+\S")
FUNCTION = re.compile(r"^\.text\.(\S+):$")


def tool(name):
    for d in [None, os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin"), "/usr/local/cuda/bin"]:
        path = shutil.which(name, path=d)
        if path:
            return path
    sys.exit(f"sass_lines.py: {name} not found (a CUDA toolkit, or pip install nvidia-cuda-{name})")


def cubin_of(obj, arch, tmp):
    """The cubin for `arch` inside a CUDA object (or obj itself when it is a cubin)."""
    if obj.endswith(".cubin"):
        return obj
    subprocess.run([tool("cuobjdump"), "-xelf", "all", os.path.abspath(obj)], cwd=tmp, check=True,
                   stdout=subprocess.DEVNULL)
    cubins = sorted(glob.glob(os.path.join(tmp, "*.cubin")))
    mine = [c for c in cubins if f".{arch}." in os.path.basename(c)]
    if len(mine) != 1:
        sys.exit(f"sass_lines.py: {len(mine)} cubins for {arch} in {obj}: {[os.path.basename(c) for c in cubins]}")
    return mine[0]


def count_lines(listing, kernel, source):
    """{line: instructions} of the kernel whose name contains `kernel`, attributed to the
    last line of `source` (or of the kernel's own file) in each instruction's inline chain."""
    names = [m.group(1) for m in map(FUNCTION.match, listing) if m]
    chosen = [n for n in names if kernel in n]
    if len(chosen) != 1:
        sys.exit(f"sass_lines.py: {len(chosen)} kernels match {kernel!r}; the kernels:\n  " + "\n  ".join(names))
    counts, inside, line, src_file = collections.Counter(), False, None, source
    for text in listing:
        m = FUNCTION.match(text)
        if m:
            inside = m.group(1) == chosen[0]
            continue
        if not inside:
            continue
        m = FILE_LINE.match(text)
        if m:
            if src_file is None:  # the first location of the kernel is in its own file
                src_file = m.group(1)
            if os.path.basename(m.group(1)) == os.path.basename(src_file):
                line = int(m.group(2))
            continue
        if INSTRUCTION.match(text):
            counts[line] += 1
    return chosen[0], src_file, counts


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("object")
    ap.add_argument("--kernel", required=True, help="a substring of the kernel's mangled name")
    ap.add_argument("--source", help="attribute to lines of this file (default: the kernel's own)")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--range", action="append", default=[], metavar="NAME:FIRST-LAST")
    ap.add_argument("--arch", default="sm_90a")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cubin = cubin_of(args.object, args.arch, tmp)
        listing = subprocess.run([tool("nvdisasm"), "-gi", "-c", cubin], check=True, capture_output=True,
                                 text=True).stdout.splitlines()
    name, src_file, counts = count_lines(listing, args.kernel, args.source)
    text = []
    if src_file and os.path.exists(src_file):
        with open(src_file) as f:
            text = f.read().splitlines()
    total = sum(counts.values())
    print(f"{name}\n{total} instructions; by line of {src_file} ({counts.get(None, 0)} before any)")
    for line, n in counts.most_common(args.top):
        if line is None:
            continue
        src = text[line - 1].strip()[:88] if text and line <= len(text) else ""
        print(f"{n:6d}  {line:5d}  {src}")
    for r in args.range:
        label, _, span = r.rpartition(":")
        first, _, last = span.partition("-")
        n = sum(v for k, v in counts.items() if k is not None and int(first) <= k <= int(last or first))
        print(f"{n:6d}  {label or span}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
