"""Symmetric memory on CPU tensors, side by side with the two-step alternatives.

    python -m comm_torch.bench_symm [--ranks 2] [--shape 1024,4096,64] [--dtype float32]
                                    [--buffer 64M] [--rounds 7] [--threads 1]

Two measurements, each alternating its variants round after round in one run, so that both
see the same machine state (a round lasts as long as its slowest rank; medians over rounds):

* all-gather + matmul, shape M,K,N: every rank holds an (M, K) shard of A and the same (K, N)
  B. ``fused`` is ``comm_torch.fused.all_gather_matmul`` (each peer's chunk multiplied in
  place as soon as its signal arrives); ``two-step`` is ``dist.all_gather`` on the comm
  backend, ``torch.cat``, then one matmul. The run also times the all-gather (with the cat)
  and the matmul alone, to give the share of communication in the two-step time.
* get_buffer reads in place: rank 0 sums rank 1's buffer through ``get_buffer`` and, taking
  turns with it call by call in random order, a local tensor of the same size (a plain torch tensor, and a
  buffer of its own from ``symm_mem.empty``); the other ranks wait. Medians over the calls.
  Then rank 1 sums that same buffer itself against a plain tensor of its own: the speed of
  the memory the peer read, for its owner.

Every rank runs ``torch.set_num_threads(threads)`` (default 1: with one rank per core, more
intra-op threads only oversubscribe the cores), the same for every variant.
"""

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

from .bench import human, parse_size

DTYPES = ("float32", "float64", "bfloat16")


def _timed_rounds(variants, rounds, iters, dist, torch):
    """{name: [seconds per call, one per round]}, the variants taking turns each round."""
    times = {name: [] for name in variants}
    for fn in variants.values():  # warm-up (and, for the fused path, the workspace)
        fn()
        fn()
    for _ in range(rounds):
        for name, fn in variants.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[name].append(elapsed.item())
    return times


def _matmul_rows(rank, world, shape, dtype, rounds, iters, dist, torch):
    from comm_torch.fused import all_gather_matmul

    m, k, n = shape
    gen = torch.Generator().manual_seed(rank)
    shard = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(k, n, generator=torch.Generator().manual_seed(1234)).to(dtype)
    parts = [torch.empty_like(shard) for _ in range(world)]

    def gather():
        dist.all_gather(parts, shard)
        return torch.cat(parts)

    full = gather()

    def two_step():
        return gather() @ b

    def fused():
        return all_gather_matmul(shard, b, return_a=False)[1]

    _, check = all_gather_matmul(shard, b)
    want = two_step()
    tol = 1e-10 if dtype == torch.float64 else 2e-2 if dtype == torch.bfloat16 else 1e-4
    rel = float((check.float() - want.float()).norm() / want.float().norm())
    if rel > tol:
        raise AssertionError(f"fused all_gather_matmul differs from all_gather then matmul: {rel}")
    return _timed_rounds(
        {"fused": fused, "two-step": two_step, "all_gather": gather, "matmul": lambda: full @ b},
        rounds,
        iters,
        dist,
        torch,
    )


def _get_buffer_rows(rank, nbytes, rounds, dist, torch):
    from comm_torch import symm_mem

    count = nbytes // 4
    own = symm_mem.empty(count, dtype=torch.float32)
    own.fill_(rank + 1)
    hdl = symm_mem.rendezvous(own)
    local = torch.full((count,), 1.0, dtype=torch.float32)
    peer = hdl.get_buffer(1, (count,), torch.float32)  # rank 1's buffer, in place
    hdl.barrier()
    variants = {"peer get_buffer": peer, "local torch tensor": local, "own symm_mem.empty": own}
    # The variants take turns call by call (a sum of 64 MiB takes milliseconds), in a new
    # random order each turn, so that a change in the machine's load hits them alike; the
    # median of the calls is reported.
    calls = rounds * max(3, (1 << 30) // max(nbytes, 1))
    times = {name: [] for name in variants}
    if rank == 0:
        for t in variants.values():  # warm-up: first touch maps the peer's pages here
            t.sum()
        if float(peer[:1024].sum()) != 2.0 * 1024:
            raise AssertionError("get_buffer(1) does not show rank 1's buffer")
        order, shuffle = list(variants.items()), random.Random(0).shuffle
        for _ in range(calls):
            shuffle(order)  # a fixed order can fall into step with a periodic disturbance
            for name, t in order:
                start = time.perf_counter()
                t.sum()
                times[name].append(time.perf_counter() - start)
    dist.barrier()
    # The owner reads the same memory: rank 1 sums its own buffer and a plain tensor of its
    # own, taking turns, while the others wait. Where the machine gives a process's shared
    # pages a different speed from its private ones, this shows it for the pages rank 0 read.
    owner = torch.zeros(2, dtype=torch.float64)
    if rank == 1:
        own.sum(), local.sum()
        mine = {"own": [], "local": []}
        for _ in range(calls):
            for name, t in (("own", own), ("local", local)):
                start = time.perf_counter()
                t.sum()
                mine[name].append(time.perf_counter() - start)
        owner[0], owner[1] = statistics.median(mine["own"]), statistics.median(mine["local"])
    dist.broadcast(owner, src=1)
    times["rank 1: its own buffer"] = [float(owner[0])]
    times["rank 1: its local tensor"] = [float(owner[1])]
    return times


def worker(rank, world, store_path, args, out_path):
    import json

    import torch
    import torch.distributed as dist

    import comm_torch  # noqa: F401  (registers "comm" on torch without the entry point)

    torch.set_num_threads(args.threads)
    dist.init_process_group("comm", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    shape = tuple(int(s) for s in args.shape.split(","))
    dtype = getattr(torch, args.dtype)
    results = {}
    if args.what in ("all", "matmul"):
        results["matmul"] = _matmul_rows(rank, world, shape, dtype, args.rounds, args.iters, dist, torch)
    if args.what in ("all", "get_buffer") and world >= 2:
        results["get_buffer"] = _get_buffer_rows(rank, parse_size(args.buffer), args.rounds, dist, torch)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def _ms(seconds):
    return f"{seconds * 1e3:.2f} ms"


def report(args, results, torch_version):
    lines = [f"{args.ranks} ranks, torch {torch_version}, {args.threads} intra-op thread(s) per rank"]
    verdicts = []
    rows = results.get("matmul")
    if rows:
        m, k, n = (int(s) for s in args.shape.split(","))
        med = {name: statistics.median(ts) for name, ts in rows.items()}
        lines += [
            "",
            f"all-gather + matmul: shard ({m}, {k}) x ({k}, {n}) {args.dtype}, {args.rounds} rounds of {args.iters}",
            "",
            "| variant | median | best | two-step / variant |",
            "|---|---:|---:|---:|",
        ]
        for name in ("fused", "two-step", "all_gather", "matmul"):
            lines.append(f"| {name} | {_ms(med[name])} | {_ms(min(rows[name]))} | {med['two-step'] / med[name]:.2f}x |")
        share = med["all_gather"] / (med["all_gather"] + med["matmul"])
        per_round = [t / f for f, t in zip(rows["fused"], rows["two-step"])]
        lines += [
            "",
            f"communication share of the two-step time (all_gather / (all_gather + matmul)): {share:.0%}",
            f"two-step / fused per round: {', '.join(f'{r:.2f}' for r in per_round)}",
        ]
        verdicts.append(("fused faster than two-step", med["two-step"] / med["fused"], 1.0))
        verdicts.append(("communication share >= 20%", share / 0.2, 1.0))
    rows = results.get("get_buffer")
    if rows:
        med = {name: statistics.median(ts) for name, ts in rows.items()}
        nbytes = parse_size(args.buffer)
        lines += [
            "",
            f"sum() of {human(nbytes)} float32 on rank 0, {len(rows['local torch tensor'])} calls of each, taking turns",
            "",
            "| tensor | median | GB/s | median / local's | best | best / local's |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        best = {name: min(ts) for name, ts in rows.items()}
        local = "local torch tensor"
        owner = {k: med.pop(k, None) for k in ("rank 1: its own buffer", "rank 1: its local tensor")}
        for name, t in med.items():
            lines.append(
                f"| {name} | {_ms(t)} | {nbytes / t / 1e9:.2f} | {t / med[local]:.3f} | "
                f"{_ms(best[name])} | {best[name] / best[local]:.3f} |"
            )
        ratio, best_ratio = med["peer get_buffer"] / med[local], best["peer get_buffer"] / best[local]
        verdicts.append(("peer get_buffer sum within 10% of local (medians)", 1.10 / ratio, 1.0))
        lines.append(f"\npeer / local: {ratio:.3f} (medians), {best_ratio:.3f} (best calls)")
        own, own_local = owner["rank 1: its own buffer"], owner["rank 1: its local tensor"]
        if own and own_local:
            lines.append(
                f"rank 1 summing that same buffer itself / its own local tensor: {own / own_local:.3f} "
                f"({_ms(own)} / {_ms(own_local)}); rank 0's read through get_buffer / rank 1's own "
                f"read of it, each against its own local tensor: {ratio / (own / own_local):.3f}"
            )
            verdicts.append(
                ("peer get_buffer sum within 10% of the owner's own sum of it", 1.10 / (ratio / (own / own_local)), 1.0)
            )
    lines.append("")
    for what, got, need in verdicts:
        lines.append(f"{what}: {'met' if got >= need else 'MISSED'}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--shape", default="1024,4096,64", help="M,K,N: A shards are (M, K), B is (K, N)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--iters", type=int, default=5, help="calls per round of the matmul variants")
    parser.add_argument("--buffer", default="64M", help="bytes summed through get_buffer")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in every rank")
    parser.add_argument("--what", default="all", choices=("all", "matmul", "get_buffer"))
    parser.add_argument("--worker", nargs=3, metavar=("RANK", "STORE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        rank, store, out = args.worker
        worker(int(rank), args.ranks, store, args, out)
        return 0

    import json

    import torch

    from comm_torch import _lib

    try:
        _lib.load_library()  # fail here, once, rather than in every rank
    except ImportError as err:
        print(f"bench_symm: {err}", file=sys.stderr)
        return 2

    with tempfile.TemporaryDirectory(prefix="comm-bench-symm-") as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "out")
        cmd = [sys.executable, "-m", "comm_torch.bench_symm"] + [
            a for a in (argv if argv is not None else sys.argv[1:]) if a
        ]
        procs = [subprocess.Popen(cmd + ["--worker", str(r), store, out]) for r in range(args.ranks)]
        codes = [p.wait() for p in procs]
        if any(codes):
            print(f"bench_symm: a rank failed (exit codes {codes})", file=sys.stderr)
            return 1
        with open(out) as f:
            results = json.load(f)
    print(report(args, results, torch.__version__))
    return 0


if __name__ == "__main__":
    sys.exit(main())
