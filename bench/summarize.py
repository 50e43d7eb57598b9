#!/usr/bin/env python3
"""The tables of compare_mpi.sh: per rank count and pinning, per collective, size and placement,
comm's time against the best MPI of the same round, as a speed ratio (best MPI time / comm
time: above 1 comm is faster) with its median, min and max across rounds.

A cell is marked `<` where the median ratio is below 1.0, and `~` where comm's own time varied
by more than 2x across rounds (a bimodal cell). The header gives the memory-bandwidth bound
(bench/membw) and where the 64 MiB all-reduce stands against it.

With runs of an older library ("base", COMPARE_BASELINE), a second set of tables puts the new
library beside the old one: per cell, the old library's time over the new one's in the same round
(above 1 the new one is faster) and each library's ratio against the best MPI of its round.

    summarize.py <out-dir>          (the directory compare_mpi.sh wrote)
"""
import glob
import json
import os
import re
import statistics
import sys

NAME = re.compile(r"^(comm|base|openmpi|mpich)\.(.+)\.n(\d+)\.(pinned|unpinned)\.r(\d+)\.json$")
PLACES = ("out_of_place", "in_place")


def load(out):
    """{(coll, n, pin, size, place): {lib: {round: (time_us, busbw)}}}"""
    cells = {}
    for path in glob.glob(os.path.join(out, "*.json")):
        m = NAME.match(os.path.basename(path))
        if not m:
            continue
        lib, coll, n, pin, rnd = m.group(1), m.group(2), int(m.group(3)), m.group(4), int(m.group(5))
        with open(path) as f:
            data = json.load(f)
        for row in data["results"]:
            for place in PLACES:
                r = row.get(place)
                if not r or r.get("time") is None:
                    continue
                key = (coll, n, pin, row["size"], place)
                cells.setdefault(key, {}).setdefault(lib, {})[rnd] = (r["time"], r["bus_bw"])
    return cells


OURS = ("comm", "base")


def ratios(libs, who="comm"):
    """Per round where `who` (comm, or the older build) and at least one MPI ran: best MPI
    time / its time."""
    comm = libs.get(who, {})
    out = []
    for rnd, (t, _) in comm.items():
        mpi = [libs[l][rnd][0] for l in libs if l not in OURS and rnd in libs[l]]
        if mpi and t > 0:
            out.append(min(mpi) / t)
    return out


def best_mpi(libs):
    med = {l: statistics.median(t for t, _ in v.values()) for l, v in libs.items() if l not in OURS and v}
    if not med:
        return None, None
    lib = min(med, key=med.get)
    return lib, med[lib]


def fmt_size(b):
    for unit, shift in (("M", 20), ("K", 10)):
        if b >= 1 << shift and b % (1 << shift) == 0:
            return f"{b >> shift}{unit}"
    return str(b)


def cell(libs):
    """(text, ahead, bimodal) for one placement of one row, or None where comm did not run."""
    comm = libs.get("comm")
    rs = ratios(libs)
    if not comm or not rs:
        return None
    times = [t for t, _ in comm.values()]
    ct = statistics.median(times)
    lib, mt = best_mpi(libs)
    med = statistics.median(rs)
    ahead = med >= 1.0
    bimodal = min(times) > 0 and max(times) > 2 * min(times)
    mark = ("" if ahead else "<") + ("~" if bimodal else "")
    text = f"{ct:.2f} | {mt:.2f} {lib} | {med:.2f}{mark} [{min(rs):.2f}, {max(rs):.2f}]"
    return text, ahead, bimodal


def membw(out):
    bounds = []
    for path in glob.glob(os.path.join(out, "membw.*.txt")):
        with open(path) as f:
            m = re.search(r"copy bandwidth, 2 processes at once: ([0-9.]+)", f.read())
        if m:
            bounds.append(float(m.group(1)))
    return statistics.median(bounds) if bounds else None


def main(out):
    cells = load(out)
    if not cells:
        sys.exit(f"no results in {out}")
    b = membw(out)
    libs_seen = sorted({l for v in cells.values() for l in v})
    rounds = max(len(v.get("comm", {})) for v in cells.values())
    print(f"libraries: {', '.join(libs_seen)}; rounds: {rounds}; times in us (medians over rounds)")
    print("ratio = best MPI time / comm time in the same round (above 1.0 comm is faster): "
          "median [min, max]; `<` marks a median below 1.0, `~` a cell where comm's time varied more than 2x\n")
    groups = sorted({(k[1], k[2]) for k in cells}, key=lambda g: (g[0], g[1] != "unpinned"))
    summary = []
    for n, pin in groups:
        if b:
            # All-reduce memory traffic on one host: every rank reads its input and writes its
            # output, at least 2nN bytes against the machine's 2B bytes/s, so t >= nN/B and
            # busbw = (N/t) * 2(n-1)/n <= B * 2(n-1)/n^2.
            bound = b * 2 * (n - 1) / (n * n)
            big = [cells.get(("all_reduce", n, pin, 64 << 20, p), {}).get("comm", {}) for p in PLACES]
            got = [statistics.median(bw for _, bw in v.values()) for v in big if v]
            if got:
                pct = ", ".join(f"{g:.2f} GB/s = {100 * g / bound:.0f}%" for g in got)
                print(f"{n} ranks {pin}: all_reduce 64 MiB busbw (out of place, in place) {pct} "
                      f"of the bound {bound:.2f} GB/s (copy bandwidth {b:.2f} GB/s)")
        print(f"\n### {n} ranks, {pin}\n")
        print("| collective | size | comm (oop) | best MPI (oop) | ratio (oop) | comm (ip) | best MPI (ip) | ratio (ip) |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        total = ahead = bimodal = 0
        worst = []
        for coll in sorted({k[0] for k in cells if k[1:3] == (n, pin)}):
            for size in sorted({k[3] for k in cells if k[:3] == (coll, n, pin)}):
                texts = []
                for place in PLACES:
                    c = cell(cells.get((coll, n, pin, size, place), {}))
                    if c is None:
                        texts.append("- | - | -")
                        continue
                    texts.append(c[0])
                    total += 1
                    ahead += c[1]
                    bimodal += c[2]
                    med = statistics.median(ratios(cells[(coll, n, pin, size, place)]))
                    worst.append((med, f"{coll} {fmt_size(size)} {place.replace('_', ' ')}"))
                print(f"| {coll} | {fmt_size(size)} | {' | '.join(texts)} |")
        worst.sort()
        summary.append(f"{n} ranks {pin}: comm at or ahead of the best MPI in {ahead} of {total} cells, "
                       f"{bimodal} bimodal; slowest: " + "; ".join(f"{w} {r:.2f}" for r, w in worst[:3]))
    print("\n" + "\n".join(summary))
    if any("base" in v for v in cells.values()):
        against_base(cells, groups)


def paired(libs):
    """Per round where both ran: the old library's time / the new one's (above 1: new faster)."""
    new, old = libs.get("comm", {}), libs.get("base", {})
    return [old[r][0] / t for r, (t, _) in new.items() if r in old and t > 0]


def against_base(cells, groups):
    print("\n## The new library against the old one (COMPARE_BASELINE)\n")
    print("new/old = the old library's time / the new one's in the same round (above 1.0 the new one "
          "is faster), median [min, max]; vs MPI = best MPI time / the library's time, medians. "
          "`!` marks a cell where the new library's median ratio against MPI is more than 10% "
          "below the old one's.\n")
    summary = []
    for n, pin in groups:
        print(f"\n### {n} ranks, {pin}\n")
        print("| collective | size | new/old (oop) | vs MPI new, old (oop) | new/old (ip) | vs MPI new, old (ip) |")
        print("|---|---:|---:|---:|---:|---:|")
        all_pairs = []
        flagged = []
        for coll in sorted({k[0] for k in cells if k[1:3] == (n, pin)}):
            for size in sorted({k[3] for k in cells if k[:3] == (coll, n, pin)}):
                texts = []
                for place in PLACES:
                    libs = cells.get((coll, n, pin, size, place), {})
                    p = paired(libs)
                    if not p:
                        texts.append("- | -")
                        continue
                    all_pairs.append(statistics.median(p))
                    rn, ro = ratios(libs, "comm"), ratios(libs, "base")
                    vs = "-"
                    mark = ""
                    if rn and ro:
                        mn, mo = statistics.median(rn), statistics.median(ro)
                        vs = f"{mn:.2f}, {mo:.2f}"
                        if mn < 0.9 * mo:
                            mark = "!"
                            flagged.append(f"{coll} {fmt_size(size)} {place.replace('_', ' ')}")
                    texts.append(f"{statistics.median(p):.2f}{mark} [{min(p):.2f}, {max(p):.2f}] | {vs}")
                print(f"| {coll} | {fmt_size(size)} | {' | '.join(texts)} |")
        if all_pairs:
            summary.append(f"{n} ranks {pin}: median of the cells' new/old ratios {statistics.median(all_pairs):.3f} "
                           f"(cells {min(all_pairs):.2f} to {max(all_pairs):.2f}); "
                           f"{len(flagged)} cells more than 10% behind the old ratio against MPI"
                           + (": " + "; ".join(flagged) if flagged else ""))
    print("\n" + "\n".join(summary))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
