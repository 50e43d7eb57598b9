#!/usr/bin/env python3
"""Import cycles between the top-level modules of src/ (non-test code): for each pair of
modules that name each other through `crate::`, the files and lines that do. Exit status 1
when there is a cycle. Usage: scripts/module_cycles.py [src dir]"""
import collections
import os
import re
import sys

root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "src")
tops = {n[:-3] if n.endswith(".rs") else n for n in os.listdir(root) if n != "lib.rs"}
uses = collections.defaultdict(list)  # (from, to) -> ["file:line"]
for dirpath, _, files in os.walk(root):
    for f in files:
        path = os.path.join(dirpath, f)
        rel = os.path.relpath(path, root)
        if not f.endswith(".rs") or f == "tests.rs" or "/tests/" in rel:
            continue
        top = rel.split(os.sep)[0].removesuffix(".rs")
        text = open(path).read().split("#[cfg(test)]\nmod tests")[0]
        for n, line in enumerate(text.split("\n"), 1):
            if line.lstrip().startswith("//"):
                continue
            for m in re.finditer(r"crate::([a-z_]+)", line):
                if m.group(1) != top and m.group(1) in tops:
                    uses[(top, m.group(1))].append(f"{rel}:{n}")
pairs = sorted({tuple(sorted(k)) for k in uses if (k[1], k[0]) in uses})
for a, b in pairs:
    print(f"{a} <-> {b}")
    for k in ((a, b), (b, a)):
        print(f"  {k[0]} -> {k[1]}: {', '.join(uses[k][:4])}{' ...' if len(uses[k]) > 4 else ''}")
print(f"{len(pairs)} cycle(s) between top-level modules")
sys.exit(1 if pairs else 0)
