//! The cost model behind ncclGroupSimulateEnd on layouts that need no processes.
//!
//!     cargo run --release --example cost_model -- synthetic [RANKS...]
//!     cargo run --release --example cost_model -- cells CELLS_FILE
//!
//! `synthetic`: for 1024 and 8192 ranks (or the given counts), 8 ranks to a host, the tuner's
//! pick, predicted time and bus bandwidth from 8 B to 8 GiB by powers of 4, on two fabrics
//! whose parameters are printed with the tables.
//!
//! `cells`: for each line of scripts/cost_model_check.sh's raw output (`cell mode=... n=...
//! coll=... bytes=... share=...`), one line `pick MODE N COLL BYTES ALGO LIBRARY_US SHARED_US
//! LOADED_US`: the tuner's pick on the cell's layout, the model's time as the library sees that
//! layout (ncclGroupSimulateEnd's figure, each simulated host with this machine's cores), the
//! model told the truth of this machine (all N processes share its cores), and the same with
//! only the cores other work left: `share` is the fraction of a core each of `nproc` busy
//! probes got just before the run, so other work keeps about nproc/share - nproc threads
//! runnable, and N runnable ranks get nproc * N / (N + those) cores.

use comm::testing::cost::{synthetic, Fabric, Link};

/// The knobs the library leaves to the environment: read them once here as it does.
fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn cells(path: &str) -> Result<(), String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
    let c = cores();
    for line in text.lines().filter(|l| l.starts_with("cell ")) {
        let get = |k: &str| {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(k).and_then(|v| v.strip_prefix('=')))
                .map(str::to_owned)
                .ok_or_else(|| format!("no {k} in {line}"))
        };
        let (mode, coll) = (get("mode")?, get("coll")?);
        let n: usize = get("n")?.parse().map_err(|e| format!("{e}"))?;
        let bytes: usize = get("bytes")?.parse().map_err(|e| format!("{e}"))?;
        let share: f32 = get("share")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(1.0);
        let per_host = match mode.as_str() {
            "shm" => n,
            "hosts" => 1,
            m => {
                n / m
                    .strip_prefix("hosts:")
                    .and_then(|k| k.parse().ok())
                    .unwrap_or(1)
            }
        };
        // The library's view: the interface speed it reads here (none for this machine's
        // virtual interface: its 10 Gbit/s default), each host with this machine's cores.
        let library = Fabric::host_memory(1250.0, c, per_host);
        let shared = Fabric::host_memory(1250.0, c, n);
        let others = (c as f32 / share.max(0.01) - c as f32).max(0.0);
        let loaded = Fabric {
            cores_per_host: (c as f32 * n as f32 / (n as f32 + others)).min(c as f32),
            ..shared
        };
        let (algo, p) = synthetic(&coll, bytes, n, per_host, &library)?;
        let (_, q) = synthetic(&coll, bytes, n, per_host, &shared)?;
        let (_, r) = synthetic(&coll, bytes, n, per_host, &loaded)?;
        println!(
            "pick {mode} {n} {coll} {bytes} {algo} {:.2} {:.2} {:.2}",
            p.us, q.us, r.us
        );
    }
    Ok(())
}

fn size(b: usize) -> String {
    match b {
        b if b >= 1 << 30 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

fn tables(ranks: &[usize]) -> Result<(), String> {
    let per_host = 8;
    let fabrics = [
        (
            "device-class: NVLink-class links inside a host (2 us, 360 GB/s a rank), \
             8 NICs of 400 Gb/s a host (5 us, 50 GB/s each), reductions at 1 TB/s, \
             1 us of work per message, a core per rank",
            Fabric {
                intra: Link {
                    latency_us: 2.0,
                    bytes_per_us: 360_000.0,
                },
                inter: Link {
                    latency_us: 5.0,
                    bytes_per_us: 50_000.0,
                },
                nics_per_host: 8,
                message_us: 1.0,
                reduce_bytes_per_us: 1_000_000.0,
                cores_per_host: per_host as f32,
                ranks_per_host: per_host,
                wake_us: 5.0,
            },
        ),
        (
            "host memory: shared memory inside a host (the library's constants), \
             one NIC of 400 Gb/s a host (25 us over TCP, 50 GB/s), a core per rank",
            Fabric {
                nics_per_host: 1,
                ..Fabric::host_memory(50_000.0, per_host, per_host)
            },
        ),
    ];
    for (what, fabric) in &fabrics {
        for &n in ranks {
            println!(
                "\n{n} ranks, {} hosts of {per_host}; {what}\n",
                n / per_host
            );
            println!("| collective | size | algorithm | predicted us | algbw GB/s | busbw GB/s | hops inside / between hosts | bound |");
            println!("|---|---|---|---|---|---|---|---|");
            for coll in ["allreduce", "allgather", "reducescatter"] {
                let mut b = 8usize;
                while b <= 8 << 30 {
                    // Below a float a rank the all-gather and reduce-scatter move nothing.
                    if coll != "allreduce" && b < 4 * n {
                        b *= 4;
                        continue;
                    }
                    let (algo, p) = synthetic(coll, b, n, per_host, fabric)?;
                    let algbw = b as f64 / p.us as f64 / 1e3;
                    let factor = match coll {
                        "allreduce" => 2.0 * (n - 1) as f64 / n as f64,
                        _ => (n - 1) as f64 / n as f64,
                    };
                    println!(
                        "| {coll} | {} | {algo} | {:.1} | {algbw:.3} | {:.3} | {} / {} | {} |",
                        size(b),
                        p.us,
                        algbw * factor,
                        p.hops_intra,
                        p.hops_inter,
                        if p.cpu_us > p.path_us {
                            "cores"
                        } else {
                            "path"
                        },
                    );
                    b *= 4;
                }
            }
        }
    }
    Ok(())
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("cells") if args.len() == 2 => cells(&args[1]),
        Some("synthetic") => {
            let ranks: Result<Vec<usize>, _> = args[1..].iter().map(|a| a.parse()).collect();
            match ranks {
                Ok(r) if r.is_empty() => tables(&[1024, 8192]),
                Ok(r) => tables(&r),
                Err(e) => Err(format!("rank counts: {e}")),
            }
        }
        _ => Err("usage: cost_model synthetic [RANKS...] | cost_model cells CELLS_FILE".into()),
    };
    if let Err(e) = result {
        eprintln!("cost_model: {e}");
        std::process::exit(1);
    }
}
