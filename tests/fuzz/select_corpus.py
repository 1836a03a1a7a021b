#!/usr/bin/env python3
"""Chooses the committed fuzz corpus: the designed seeds (seed-*) plus a greedy set cover
of the coverage edges that a libFuzzer run reached.

    <target> -merge=1 -merge_control_file=CTL EMPTY_DIR tests/fuzz/corpus/<target> WORK_DIR
    python3 tests/fuzz/select_corpus.py CTL tests/fuzz/corpus/<target>

reads libFuzzer's merge control file (the COV lines: edges per input), keeps every seed-*,
then repeatedly adds the input covering most edges not covered yet (smaller on ties) until
none adds one, and rewrites the min-* files of the corpus directory with the chosen inputs.
libFuzzer's own -merge=1 keeps an input per new *feature* (edge hit-count buckets, value
profiles): ten times more files for the same edges. scripts/reliability.sh runs this with
FUZZ_MERGE=1.
"""
import hashlib
import os
import shutil
import sys


def main():
    ctl, corpus = sys.argv[1], sys.argv[2]
    lines = open(ctl).read().split("\n")
    n = int(lines[0])
    files = lines[2:2 + n]
    cov = {}
    for ln in lines[2 + n:]:
        p = ln.split()
        if p and p[0] == "COV":
            cov[int(p[1])] = set(p[2:])
    seeds = [i for i, f in enumerate(files) if os.path.basename(f).startswith("seed-")
             and os.path.dirname(os.path.abspath(f)) == os.path.abspath(corpus)]
    covered = set()
    for i in seeds:
        covered |= cov.get(i, set())
    chosen = []
    while True:
        best, gain = None, 0
        for i, c in cov.items():
            g = len(c - covered)
            if g > gain or (g == gain and g > 0 and os.path.getsize(files[i]) < os.path.getsize(files[best])):
                best, gain = i, g
        if not gain:
            break
        chosen.append(best)
        covered |= cov[best]
    data = [open(files[i], "rb").read() for i in chosen]  # read before deleting old min-*
    for f in os.listdir(corpus):
        if f.startswith("min-"):
            os.remove(os.path.join(corpus, f))
    for d in data:
        with open(os.path.join(corpus, "min-" + hashlib.sha1(d).hexdigest()[:16]), "wb") as f:
            f.write(d)
    total = set().union(*cov.values()) if cov else set()
    print(f"{corpus}: {len(seeds)} seeds + {len(chosen)} inputs cover {len(covered)} of {len(total)} edges")


if __name__ == "__main__":
    main()
