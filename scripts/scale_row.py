"""One markdown row of the scale benchmark from its ranks' "scale ..." lines (bench/scale.c).

    python3 scripts/scale_row.py FILE MODE N ROOTS RC

FILE holds every rank's output; RC is the driver's exit status. Used by scale_bench.sh and
scale_netns.sh, whose header rows name the columns.
"""
import statistics, sys
path, mode, n, roots, rc = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
rows = []
for line in open(path):
    if line.startswith("scale "):
        rows.append(dict(kv.split("=", 1) for kv in line.split()[1:]))
def col(k):
    return [float(r[k]) for r in rows]
def mm(k, fmt="{:.1f}"):
    v = col(k)
    return (fmt + "/" + fmt).format(statistics.median(v), max(v)) if v else "-"
if len(rows) != n or rc != 0:
    status = f"FAILED rc={rc}, {len(rows)}/{n} ranks reported"
else:
    status = "ok" if all(r["check"] == "ok" for r in rows) else "WRONG RESULTS"
conns = int(sum(col("sockets")) / 2) if rows else "-"
thr = int(max(col("threads"))) if rows else "-"
rss = "{:.1f}".format(max(col("rss_kib")) / 1024) if rows else "-"
# The job's init: from the first rank's start to the last rank's end (the late ranks' forks
# included), and the CPU time of every rank's init together (less disturbed by other work on
# the machine than the times).
if rows and "init_start" in rows[0]:
    job = "{:.0f}, {:.2f}".format(max(col("init_end")) - min(col("init_start")),
                                  sum(col("init_cpu_ms")) / 1e3)
    cpu = mm("init_cpu_ms")
else:
    job = cpu = "-"
print(f"| {mode} | {n} | {roots} | {mm('init_ms')} | {mm('split_ms')} | {mm('first_ms')} | "
      f"{mm('tenth_ms', '{:.2f}')} | {mm('fds', '{:.0f}')} | {thr} | {rss} | {conns} | "
      f"{cpu} | {job} | {status} |")
