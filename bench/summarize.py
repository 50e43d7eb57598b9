#!/usr/bin/env python3
"""Medians over rounds of compare_mpi.sh's JSON files, and ours/MPI ratios, as a markdown table."""
import glob
import json
import os
import re
import statistics
import sys


def load(out, lib):
    runs = {}
    for path in glob.glob(os.path.join(out, f"{lib}.*.json")):
        coll = os.path.basename(path).split(".")[1]
        with open(path) as f:
            data = json.load(f)
        for row in data["results"]:
            for place in ("out_of_place", "in_place"):
                key = (coll, row["size"], place)
                runs.setdefault(key, []).append(row[place])
    return runs


def main(out):
    comm, mpi = load(out, "comm"), load(out, "mpi")
    bounds = []
    for path in glob.glob(os.path.join(out, "membw.*.txt")):
        m = re.search(r"copy bandwidth, 2 processes at once: ([0-9.]+)", open(path).read())
        if m:
            bounds.append(float(m.group(1)))
    if bounds:
        b = statistics.median(bounds)
        print(f"copy bandwidth (median of {len(bounds)}): {b:.2f} GB/s, all_reduce busbw bound {b / 2:.2f} GB/s\n")
    print("| collective | size | placement | comm time (us) | MPI time (us) | comm busbw | MPI busbw | busbw ratio | time ratio (comm/MPI) |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for key in sorted(comm, key=lambda k: (k[0], k[1], k[2])):
        if key not in mpi:
            continue
        c, m = comm[key], mpi[key]
        ct = statistics.median(x["time"] for x in c)
        mt = statistics.median(x["time"] for x in m)
        cb = statistics.median(x["bus_bw"] for x in c)
        mb = statistics.median(x["bus_bw"] for x in m)
        coll, size, place = key
        ratio = f"{cb / mb:.2f}x" if mb > 0 else "-"
        print(f"| {coll} | {size} | {place} | {ct:.2f} | {mt:.2f} | {cb:.2f} | {mb:.2f} | {ratio} | {ct / mt:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1])
