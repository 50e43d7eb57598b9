#!/usr/bin/env python3
"""Plot comm-bench (or nccl-tests) -J JSON files: bus bandwidth and time against size.

    plot.py [-o out.png] [--op sum] [--dtype float] [--root 0] [--in-place] \
            file.json [label=other.json ...]

One line per input file (labelled with the file name, or with LABEL from `LABEL=path`); when a
file holds several datatype/op/root combinations after filtering, each gets its own line,
labelled with the combination. Both panels use a log-2 size axis; time is log-scaled too.
"""
import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def parse_input(arg):
    """`label=path` or `path` (a path that exists wins over the split)."""
    if "=" in arg and not os.path.exists(arg):
        label, path = arg.split("=", 1)
        return label, path
    return os.path.basename(arg), arg


def number(v):
    """nccl-tests writes NaN as the string "nan"; such points are skipped."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if f == f else None


def series(doc, args):
    """{(type, redop, root): [(size, busbw, time), ...]} from one document."""
    column = "in_place" if args.in_place else "out_of_place"
    out = {}
    for row in doc.get("results", []):
        if args.dtype and row.get("type") != args.dtype:
            continue
        if args.op and row.get("redop") != args.op:
            continue
        root = str(row.get("root", "")).strip()
        if args.root is not None and root != str(args.root):
            continue
        cell = row.get(column)
        if not isinstance(cell, dict):
            continue
        t = number(cell.get("time", cell.get("cpu_time")))
        bw = number(cell.get("bus_bw"))
        size = row.get("size", 0)
        if t is None or bw is None or size <= 0:
            continue  # log axes: size 0 has no place
        out.setdefault((row.get("type"), row.get("redop"), root), []).append((size, bw, t))
    return out


def human(n):
    for unit in ("B", "K", "M", "G", "T"):
        if n < 1024 or unit == "T":
            return f"{n:g}{unit}"
        n /= 1024
    return str(n)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", help="JSON files written with -J (optionally LABEL=path)")
    p.add_argument("-o", "--output", default="bench.png", help="PNG to write (default bench.png)")
    p.add_argument("--op", help="only rows with this redop (sum, prod, ..., none)")
    p.add_argument("--dtype", help="only rows with this datatype (float, half, ...)")
    p.add_argument("--root", type=int, help="only rows with this root")
    p.add_argument("--in-place", action="store_true", help="plot the in-place columns instead")
    p.add_argument("--title", help="figure title")
    args = p.parse_args()

    fig, (ax_bw, ax_t) = plt.subplots(1, 2, figsize=(13, 5))
    lines = 0
    for arg in args.inputs:
        label, path = parse_input(arg)
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            print(f"plot.py: cannot read {path}: {e}", file=sys.stderr)
            return 1
        groups = series(doc, args)
        if not groups:
            print(f"plot.py: {path}: no rows match", file=sys.stderr)
            continue
        for key, points in sorted(groups.items(), key=lambda kv: str(kv[0])):
            points.sort()
            sizes = [s for s, _, _ in points]
            name = label if len(groups) == 1 else f"{label} ({'/'.join(k for k in key if k)})"
            ax_bw.plot(sizes, [b for _, b, _ in points], marker="o", markersize=3, label=name)
            ax_t.plot(sizes, [t for _, _, t in points], marker="o", markersize=3, label=name)
            lines += 1
    if lines == 0:
        print("plot.py: nothing to plot", file=sys.stderr)
        return 1

    column = "in-place" if args.in_place else "out-of-place"
    for ax, ylabel, logy in ((ax_bw, "bus bandwidth (GB/s)", False), (ax_t, "time (us)", True)):
        ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: human(v)))
        ax.legend(fontsize=8)
    ax_bw.set_title(f"bus bandwidth ({column})")
    ax_t.set_title(f"time per operation ({column})")
    if args.title:
        fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
