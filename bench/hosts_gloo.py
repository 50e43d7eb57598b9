#!/usr/bin/env python3
"""torch.distributed's gloo backend on CPU tensors, measured the way the nccl-tests-style
binaries measure: for each size, warm-up calls, a barrier, then the wall-clock time of `-n`
calls, averaged over the ranks; algbw and busbw with nccl-tests' byte counts and factors
(all_reduce: count x size and 2(n-1)/n; all_gather: count x n x size and (n-1)/n, the per-rank
chunk aligned down to 16 bytes). Float32 sum. Writes a JSON file shaped like the harness's -J
document (only the keys bench_hosts.sh reads) so that both are read the same way.

One process per rank, started by any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT (torchrun-style); GLOO_SOCKET_IFNAME chooses gloo's interface.

    RANK=r WORLD_SIZE=n MASTER_ADDR=a MASTER_PORT=p python bench/hosts_gloo.py all_reduce \
        -b 16 -e 64M -f 4 -n 20 -w 5 -J out.json

all_reduce is timed in place (gloo reduces the tensor it is given) and reported in the
"in_place" entry; all_gather through all_gather_into_tensor (out of place, "out_of_place").
"""
import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist


def parse_size(s):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    s = s.strip().upper()
    if s and s[-1] in units:
        return int(float(s[:-1]) * units[s[-1]])
    return int(s)


def sizes(lo, hi, factor):
    s = lo
    while s <= hi:
        yield s
        s = s * factor if factor > 1 else s + 1


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("collective", choices=["all_reduce", "all_gather"])
    p.add_argument("-b", "--minbytes", default="16")
    p.add_argument("-e", "--maxbytes", default="64M")
    p.add_argument("-f", "--stepfactor", type=int, default=2)
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("-w", "--warmup_iters", type=int, default=5)
    p.add_argument("-c", "--check", type=int, default=1, help="check the result of one call per size (0: no)")
    p.add_argument("-J", "--output_file")
    a = p.parse_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ.get('MASTER_PORT', '29500')}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    n = world
    elt = 4  # float32
    results = []
    if rank == 0:
        print(f"# gloo {a.collective} torch {torch.__version__} ranks {n}")
        print("#       size         count     time   algbw   busbw  #wrong")
    start_time = time.strftime("%Y-%m-%d %H:%M:%S")
    for size in sizes(parse_size(a.minbytes), parse_size(a.maxbytes), a.stepfactor):
        count = size // elt
        if a.collective == "all_reduce":
            total = count * elt
            factor = 2 * (n - 1) / n
            buf = torch.full((count,), float(rank + 1))

            def call():
                dist.all_reduce(buf)

            def check():
                buf.fill_(float(rank + 1))
                call()
                want = n * (n + 1) / 2
                return int((buf != want).sum())

            place = "in_place"
        else:
            per = (count // n) & ~(16 // elt - 1)
            count = per
            total = per * n * elt
            factor = (n - 1) / n
            inp = torch.full((per,), float(rank + 1))
            out = torch.empty(per * n)

            def call():
                dist.all_gather_into_tensor(out, inp)

            def check():
                out.fill_(-1.0)
                call()
                want = torch.arange(1, n + 1, dtype=torch.float32).repeat_interleave(per)
                return int((out != want).sum())

            place = "out_of_place"
        wrong = 0
        if a.check:
            wrong = check()
        for _ in range(a.warmup_iters):
            call()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(a.iters):
            call()
        elapsed = time.perf_counter() - t0
        # Average the time over the ranks, and sum the errors, as nccl-tests does.
        stats = torch.tensor([elapsed / max(a.iters, 1), float(wrong)], dtype=torch.float64)
        dist.all_reduce(stats)
        t = stats[0].item() / n
        wrong = int(stats[1].item())
        algbw = total / t / 1e9 if t > 0 else 0.0
        busbw = algbw * factor
        row = {"size": total, "count": count, "type": "float", "redop": "sum",
               place: {"time": t * 1e6, "alg_bw": algbw, "bus_bw": busbw, "nwrong": float(wrong)}}
        results.append(row)
        if rank == 0:
            print(f"{total:12d}  {count:12d}  {t * 1e6:9.2f}  {algbw:6.2f}  {busbw:6.2f}  {wrong:6d}", flush=True)
    if rank == 0 and a.output_file:
        doc = {"version": 2, "start_time": start_time, "args": sys.argv, "backend": "gloo",
               "config": {"collective": a.collective, "nranks": n, "torch": torch.__version__},
               "results": results, "end_time": time.strftime("%Y-%m-%d %H:%M:%S")}
        with open(a.output_file, "w") as f:
            json.dump(doc, f)
    bad = sum(r.get("in_place", r.get("out_of_place"))["nwrong"] for r in results)
    dist.destroy_process_group()
    return 7 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
