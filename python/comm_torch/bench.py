"""dist.all_reduce on CPU tensors with backend "comm" and with gloo, side by side.

    python -m comm_torch.bench [--ranks 2] [--sizes 8,64M] [--rounds 5]

Every rank process creates both groups (the default group on gloo, a second group on comm)
and the two backends take turns on each size, round after round, so both see the same
machine state. Reported per size: the best round's time per call and busbw
(bytes * 2(n-1)/n / time, as nccl-tests reports it), and comm's ratio to gloo.
The targets of the issue are checked at the end: 64 MiB float32 busbw at least 3x gloo's,
8-byte all_reduce at least 10x faster.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text):
    text = text.strip().upper().rstrip("B")
    unit = text[-1] if text and text[-1] in UNITS else ""
    return int(float(text[: len(text) - len(unit)]) * UNITS[unit])


def human(nbytes):
    for unit in ("G", "M", "K"):
        if nbytes >= UNITS[unit] and nbytes % UNITS[unit] == 0:
            return f"{nbytes // UNITS[unit]} {unit}iB"
    return f"{nbytes} B"


def iterations(nbytes):
    # Enough calls per round to measure, few enough to keep a round well under a second.
    if nbytes <= 4096:
        return 2000
    return max(10, min(200, (1 << 30) // max(nbytes, 1)))


def worker(rank, world, store_path, sizes, rounds, out_path):
    import torch
    import torch.distributed as dist

    import comm_torch  # noqa: F401  (registers "comm" on torch without the entry point)

    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    groups = {"gloo": dist.group.WORLD, "comm": dist.new_group(backend="comm")}
    results = {}
    for nbytes in sizes:
        count = max(1, nbytes // 4)
        n = iterations(nbytes)
        tensors = {name: torch.ones(count, dtype=torch.float32) for name in groups}
        best = {name: float("inf") for name in groups}
        for name, group in groups.items():  # warm-up
            for _ in range(min(n, 20)):
                dist.all_reduce(tensors[name], group=group)
        for _ in range(rounds):
            for name, group in groups.items():
                t = tensors[name]
                dist.barrier(group=groups["gloo"])
                start = time.perf_counter()
                for _ in range(n):
                    dist.all_reduce(t, group=group)
                elapsed = torch.tensor([(time.perf_counter() - start) / n], dtype=torch.float64)
                # A round lasts as long as its slowest rank.
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=groups["gloo"])
                best[name] = min(best[name], elapsed.item())
        results[nbytes] = best
    if rank == 0:
        with open(out_path, "w") as f:
            for nbytes, best in results.items():
                f.write(f"{nbytes} {best['gloo']!r} {best['comm']!r}\n")
    dist.destroy_process_group()


def report(world, rows, torch_version):
    factor = 2 * (world - 1) / world
    lines = [
        f"dist.all_reduce, float32, CPU tensors, {world} ranks, torch {torch_version}",
        "",
        "| size | gloo time | gloo busbw | comm time | comm busbw | comm/gloo busbw | gloo/comm time |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    verdicts = []
    for nbytes, tg, tc in rows:
        bw_g = nbytes * factor / tg / 1e9
        bw_c = nbytes * factor / tc / 1e9
        lines.append(
            f"| {human(nbytes)} | {tg * 1e6:.1f} us | {bw_g:.2f} GB/s | {tc * 1e6:.1f} us | "
            f"{bw_c:.2f} GB/s | {bw_c / bw_g:.2f}x | {tg / tc:.2f}x |"
        )
        if nbytes == 64 << 20:
            verdicts.append(("64 MiB busbw >= 3x gloo", bw_c / bw_g, 3.0))
        if nbytes == 8:
            verdicts.append(("8 B time <= gloo / 10", tg / tc, 10.0))
    lines.append("")
    for what, got, need in verdicts:
        lines.append(f"{what}: {got:.2f}x -> {'met' if got >= need else 'MISSED'}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--sizes", default="8,4K,1M,64M", help="bytes per rank, comma separated (K, M, G)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--worker", nargs=3, metavar=("RANK", "STORE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]

    if args.worker:
        rank, store, out = args.worker
        worker(int(rank), args.ranks, store, sizes, args.rounds, out)
        return 0

    import torch

    from comm_torch import _lib

    try:
        _lib.load_library()  # fail here, once, rather than in every rank
    except ImportError as err:
        print(f"bench: {err}", file=sys.stderr)
        return 2

    with tempfile.TemporaryDirectory(prefix="comm-bench-") as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "out")
        cmd = [
            sys.executable,
            "-m",
            "comm_torch.bench",
            "--ranks",
            str(args.ranks),
            "--sizes",
            args.sizes,
            "--rounds",
            str(args.rounds),
        ]
        procs = [subprocess.Popen(cmd + ["--worker", str(r), store, out]) for r in range(args.ranks)]
        codes = [p.wait() for p in procs]
        if any(codes):
            print(f"bench: a rank failed (exit codes {codes})", file=sys.stderr)
            return 1
        rows = []
        with open(out) as f:
            for line in f:
                nbytes, tg, tc = line.split()
                rows.append((int(nbytes), float(tg), float(tc)))
    print(report(args.ranks, rows, torch.__version__))
    return 0


if __name__ == "__main__":
    sys.exit(main())
