"""Where init's time went, per phase, from the ranks' "init timings" log lines.

    COMM_DEBUG=INFO COMM_DEBUG_SUBSYS=INIT scripts/scale_bench.sh -n 1024 ...
    python3 scripts/scale_phases.py target/scale/hosts-n1024-r1-1.err [...]

Prints, for each file, the median and the largest value over the ranks of each phase (seconds)
that Comm's init timings line names. A split's communicator logs such a line too; only the
communicator with the most ranks in the file counts.
"""
import re, statistics, sys

LINE = re.compile(r"init timings: rank (\d+)/(\d+) total ([\d.]+) s: (.*)")
PHASE = re.compile(r"([a-z][a-z -]*?) ([\d.]+)")
for path in sys.argv[1:]:
    by_n = {}
    for line in open(path, errors="replace"):
        m = LINE.search(line)
        if not m:
            continue
        phases = {"total": float(m.group(3))}
        for name, v in PHASE.findall(m.group(4).replace("(", ", ").replace(")", "")):
            phases[name.strip()] = float(v)
        by_n.setdefault(int(m.group(2)), []).append(phases)
    if not by_n:
        print(f"{path}: no init timings lines (COMM_DEBUG=INFO, COMM_DEBUG_SUBSYS=INIT)")
        continue
    n = max(by_n)
    rows = by_n[n]
    print(f"{path}: {len(rows)} of {n} ranks")
    for name in rows[0]:
        v = [r[name] for r in rows if name in r]
        print(f"  {name:<22} median {statistics.median(v):8.3f}  max {max(v):8.3f}")
