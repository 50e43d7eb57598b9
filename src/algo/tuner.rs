//! Picks the algorithm for a collective from its kind, its size, the rank count, how the ranks
//! spread over hosts and whether its buffers are in device memory, unless `COMM_ALGO` /
//! `NCCL_ALGO` overrides it. Ranks of one host talk over shared memory (or the network, with
//! `COMM_SHM_DISABLE`), ranks of different hosts over the network; the tuner counts hosts, not
//! links, since a link inside a host is never slower than one between hosts.

use super::{Collective, HostLayout};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Algorithm {
    Ring,
    Tree,
    /// One-shot: every rank reads every input.
    Direct,
    /// Two-shot: a direct reduce-scatter, then a direct all-gather.
    TwoShot,
    /// Inside each host, then across hosts, then inside each host again (`hier.rs`).
    Hier,
}

impl Algorithm {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Algorithm::Ring => "ring",
            Algorithm::Tree => "tree",
            Algorithm::Direct => "direct",
            Algorithm::TwoShot => "twoshot",
            Algorithm::Hier => "hier",
        }
    }

    /// NCCL_ALGO syntax: a comma-separated list, case-insensitive (`Ring`, `Tree`, plus our
    /// `Direct`, `TwoShot` and `Hier`); a leading `^` excludes the listed ones. Unknown names
    /// are ignored.
    pub(crate) fn parse_list(spec: &str) -> Vec<Algorithm> {
        let (exclude, list) = match spec.trim().strip_prefix('^') {
            Some(rest) => (true, rest),
            None => (false, spec.trim()),
        };
        let named: Vec<Algorithm> = list
            .split(',')
            .filter_map(|w| match w.trim().to_ascii_lowercase().as_str() {
                "ring" => Some(Algorithm::Ring),
                "tree" => Some(Algorithm::Tree),
                "direct" | "oneshot" | "one_shot" => Some(Algorithm::Direct),
                "twoshot" | "two_shot" => Some(Algorithm::TwoShot),
                "hier" | "hierarchical" => Some(Algorithm::Hier),
                _ => None,
            })
            .collect();
        let all = [
            Algorithm::Ring,
            Algorithm::Tree,
            Algorithm::Direct,
            Algorithm::TwoShot,
            Algorithm::Hier,
        ];
        if exclude {
            all.into_iter().filter(|a| !named.contains(a)).collect()
        } else {
            named
        }
    }
}

/// What the tuner knows about the communicator.
#[derive(Clone, Debug)]
pub(crate) struct Tuner {
    /// Algorithms allowed by COMM_ALGO / NCCL_ALGO (all when unset).
    pub allowed: Vec<Algorithm>,
    /// All-reduces up to this many bytes go one-shot (every rank reads every input), on up to
    /// `direct_max_ranks` ranks.
    pub direct_max: usize,
    pub direct_max_ranks: usize,
    /// Messages up to this many bytes prefer the tree over the ring.
    pub tree_max: usize,
    /// How many hosts the ranks are on, and how many ranks each has when all have as many.
    pub hosts: usize,
    pub per_host: Option<usize>,
}

impl Tuner {
    pub(crate) fn from_env(nranks: usize, layout: Option<&HostLayout>) -> Tuner {
        let allowed = crate::env::ALGO
            .text()
            .map(|s| Algorithm::parse_list(&s))
            .filter(|v| !v.is_empty())
            .unwrap_or_else(|| {
                vec![
                    Algorithm::Ring,
                    Algorithm::Tree,
                    Algorithm::Direct,
                    Algorithm::Hier,
                ]
            });
        // One-shot sends n-1 copies of the input from every rank: worth it only while the
        // message is tiny compared to what the ring's 2(n-1) latency hops cost.
        let direct_max = crate::env::DIRECT_MAX_BYTES
            .size_if_set()
            .unwrap_or(match nranks {
                0..=2 => 64 << 10,
                3..=4 => 32 << 10,
                _ => 8 << 10,
            });
        // A one-shot all-reduce sends the whole buffer to every other rank, N-1 messages a
        // rank, where a tree sends about 2 log2 N: past a few tens of ranks the tree wins even
        // for 8 bytes (the cost model puts the crossover near 16 ranks with a core each, and
        // on 32 and 128 ranks sharing two cores the tree measured 2x and 6x faster). A size
        // bound set by the user keeps one-shot at any rank count.
        let direct_max_ranks = if crate::env::DIRECT_MAX_BYTES.size_if_set().is_some() {
            usize::MAX
        } else {
            super::ONE_SHOT_MAX_PEERS
        };
        let tree_max = crate::env::TREE_MAX_BYTES.size();
        Tuner {
            allowed,
            direct_max,
            direct_max_ranks,
            tree_max,
            hosts: layout.map_or(1, |l| l.hosts()),
            per_host: layout.map_or(Some(nranks), |l| l.per_host()),
        }
    }

    /// The choice for device buffers: one-shot for small all-reduces, two-shot for medium ones,
    /// the ring beyond (COMM_DEVICE_ONESHOT_MAX / COMM_DEVICE_TWOSHOT_MAX move the bounds).
    pub(crate) fn choose_device(
        &self,
        coll: &Collective,
        bytes: usize,
        nranks: usize,
    ) -> Algorithm {
        let ok = |a: Algorithm| self.allowed.contains(&a);
        match coll {
            Collective::AllReduce { .. } if nranks > 1 => {
                let one = crate::env::DEVICE_ONESHOT_MAX.size();
                let two = crate::env::DEVICE_TWOSHOT_MAX.size();
                if ok(Algorithm::Direct) && bytes <= one {
                    Algorithm::Direct
                } else if ok(Algorithm::TwoShot) && bytes <= two {
                    Algorithm::TwoShot
                } else if ok(Algorithm::Ring) {
                    Algorithm::Ring
                } else {
                    self.allowed[0]
                }
            }
            // The device programs of the direct all-gather and reduce-scatter have not been
            // tried on the CPU model of the device path; the ring's have.
            Collective::AllGather { .. } | Collective::ReduceScatter { .. } => Algorithm::Ring,
            _ => self.choose(coll, bytes, nranks),
        }
    }

    /// The largest all-reduce that takes the tree. Past `ONE_SHOT_MAX_PEERS` hosts the
    /// alternatives cross between hosts around a ring of them, 2(H-1) dependent hops, so the
    /// size from which their bandwidth pays grows with the host count H: the bound is
    /// `tree_max` times H / `ONE_SHOT_MAX_PEERS` there (the cost model's crossover on 128 and
    /// 1024 hosts of 8 lies between 2 and 32 MiB, on NIC-class and TCP links alike).
    fn tree_max_between_hosts(&self) -> usize {
        if self.hosts > super::ONE_SHOT_MAX_PEERS {
            self.tree_max
                .saturating_mul(self.hosts / super::ONE_SHOT_MAX_PEERS)
        } else {
            self.tree_max
        }
    }

    pub(crate) fn choose(&self, coll: &Collective, bytes: usize, nranks: usize) -> Algorithm {
        let ok = |a: Algorithm| self.allowed.contains(&a);
        match coll {
            Collective::AllReduce { .. } => {
                if !ok(Algorithm::Direct) && !ok(Algorithm::Tree) && !ok(Algorithm::Ring) {
                    return self.allowed[0];
                }
                // Several hosts with several ranks each: beyond one-shot sizes, only one
                // share per rank crosses between hosts.
                let hier = self.hosts > 1 && self.per_host.is_some_and(|p| p > 1);
                let tree_max = self.tree_max_between_hosts();
                if ok(Algorithm::Direct)
                    && bytes <= self.direct_max
                    && nranks <= self.direct_max_ranks
                {
                    Algorithm::Direct
                } else if hier
                    && ok(Algorithm::Hier)
                    && (self.hosts <= super::ONE_SHOT_MAX_PEERS
                        || bytes > tree_max
                        || !ok(Algorithm::Tree))
                {
                    // Past a few hosts, the hierarchy's exchange between hosts is a ring of
                    // them (2(H-1) dependent hops): small messages take the tree.
                    Algorithm::Hier
                } else if ok(Algorithm::Tree) && nranks > 2 && bytes <= tree_max {
                    Algorithm::Tree
                } else if ok(Algorithm::Ring) {
                    Algorithm::Ring
                } else {
                    self.allowed[0]
                }
            }
            Collective::Broadcast { .. } | Collective::Reduce { .. } => {
                if ok(Algorithm::Tree)
                    && (nranks > 2 && bytes <= self.tree_max || !ok(Algorithm::Ring))
                {
                    Algorithm::Tree
                } else {
                    Algorithm::Ring
                }
            }
            // `bytes` is one rank's block. With two ranks the ring is already one hop.
            // One hop to every peer on one host (the segments are mapped once); across hosts
            // only up to `direct_max_ranks`, since each rank would hold a connection to every
            // other rank.
            Collective::AllGather { .. } | Collective::ReduceScatter { .. } => {
                let fits = bytes <= self.direct_max
                    && (self.hosts == 1 || nranks <= self.direct_max_ranks);
                if ok(Algorithm::Direct) && nranks > 2 && (fits || !ok(Algorithm::Ring)) {
                    Algorithm::Direct
                } else {
                    Algorithm::Ring
                }
            }
            _ => Algorithm::Ring,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn algo_lists_parse_like_nccl_algo() {
        assert_eq!(Algorithm::parse_list("ring"), vec![Algorithm::Ring]);
        assert_eq!(
            Algorithm::parse_list("Tree,RING"),
            vec![Algorithm::Tree, Algorithm::Ring]
        );
        assert_eq!(
            Algorithm::parse_list("^tree"),
            vec![
                Algorithm::Ring,
                Algorithm::Direct,
                Algorithm::TwoShot,
                Algorithm::Hier
            ]
        );
        assert_eq!(Algorithm::parse_list("Hier"), vec![Algorithm::Hier]);
        assert!(Algorithm::parse_list("nvls").is_empty());
    }

    #[test]
    fn small_all_reduces_go_direct_and_large_ones_ring() {
        let t = Tuner {
            allowed: vec![Algorithm::Ring, Algorithm::Tree, Algorithm::Direct],
            direct_max: 1024,
            direct_max_ranks: 16,
            tree_max: 1 << 20,
            hosts: 1,
            per_host: Some(4),
        };
        let ar = Collective::AllReduce { count: 0 };
        assert_eq!(t.choose(&ar, 8, 4), Algorithm::Direct);
        assert_eq!(t.choose(&ar, 4096, 4), Algorithm::Tree);
        assert_eq!(t.choose(&ar, 64 << 20, 4), Algorithm::Ring);
        assert_eq!(t.choose(&ar, 4096, 2), Algorithm::Ring);
        // All-gather and reduce-scatter: one hop for small blocks on more than two ranks.
        for c in [
            Collective::AllGather { count: 0 },
            Collective::ReduceScatter { count: 0 },
        ] {
            assert_eq!(t.choose(&c, 8, 4), Algorithm::Direct);
            assert_eq!(t.choose(&c, 8, 2), Algorithm::Ring);
            assert_eq!(t.choose(&c, 4096, 4), Algorithm::Ring);
            assert_eq!(t.choose_device(&c, 8, 4), Algorithm::Ring);
        }
        // Past `direct_max_ranks`, small all-reduces take the tree; all-gathers keep their one
        // hop (the ring sends as many messages a rank, in N-1 dependent hops).
        assert_eq!(t.choose(&ar, 8, 16), Algorithm::Direct);
        assert_eq!(t.choose(&ar, 8, 17), Algorithm::Tree);
        assert_eq!(
            t.choose(&Collective::AllGather { count: 0 }, 8, 128),
            Algorithm::Direct
        );
        let ring_only = Tuner {
            allowed: vec![Algorithm::Ring],
            ..t
        };
        assert_eq!(ring_only.choose(&ar, 8, 4), Algorithm::Ring);
    }

    #[test]
    fn several_ranks_on_each_of_several_hosts_go_hierarchical() {
        let hosts = |h: &[u8]| super::super::HostLayout::new(h, 0);
        let two_by_two = hosts(&[0, 0, 1, 1]).unwrap();
        let t = Tuner {
            allowed: vec![
                Algorithm::Ring,
                Algorithm::Tree,
                Algorithm::Direct,
                Algorithm::Hier,
            ],
            direct_max: 1024,
            direct_max_ranks: 16,
            tree_max: 1 << 20,
            hosts: two_by_two.hosts(),
            per_host: two_by_two.per_host(),
        };
        let ar = Collective::AllReduce { count: 0 };
        assert_eq!(t.choose(&ar, 8, 4), Algorithm::Direct);
        assert_eq!(t.choose(&ar, 4096, 4), Algorithm::Hier);
        assert_eq!(t.choose(&ar, 64 << 20, 4), Algorithm::Hier);
        // One rank per host, or hosts of different sizes: the flat algorithms.
        let one_each = hosts(&[0, 1, 2]).unwrap();
        let uneven = hosts(&[0, 0, 1]).unwrap();
        for l in [one_each, uneven] {
            let t = Tuner {
                hosts: l.hosts(),
                per_host: l.per_host(),
                ..t.clone()
            };
            assert_eq!(t.choose(&ar, 64 << 20, 3), Algorithm::Ring);
        }
        // COMM_ALGO=ring keeps the flat ring.
        let ring_only = Tuner {
            allowed: vec![Algorithm::Ring],
            ..t
        };
        assert_eq!(ring_only.choose(&ar, 64 << 20, 4), Algorithm::Ring);
        assert!(hosts(&[5, 5, 5]).is_none(), "one host is no layout");
    }

    /// Many hosts: no choice makes a rank connect to every host or every rank. Small
    /// all-reduces take the tree (the hierarchy's exchange between more than
    /// `ONE_SHOT_MAX_PEERS` hosts is a ring of them), large ones the hierarchy; all-gathers
    /// and reduce-scatters across hosts keep the one-hop exchange only on a few ranks.
    #[test]
    fn many_hosts_bound_the_peers_each_rank_talks_to() {
        use super::super::{HostLayout, ONE_SHOT_MAX_PEERS};
        let per = 8;
        let spread = |hosts: usize| {
            let of: Vec<usize> = (0..hosts * per).map(|r| r / per).collect();
            let l = HostLayout::new(&of, HostLayout::default_direct_max(hosts)).unwrap();
            Tuner {
                allowed: vec![
                    Algorithm::Ring,
                    Algorithm::Tree,
                    Algorithm::Direct,
                    Algorithm::Hier,
                ],
                direct_max: 8 << 10,
                direct_max_ranks: ONE_SHOT_MAX_PEERS,
                tree_max: 256 << 10,
                hosts: l.hosts(),
                per_host: l.per_host(),
            }
        };
        let ar = Collective::AllReduce { count: 0 };
        let ag = Collective::AllGather { count: 0 };
        let few = spread(ONE_SHOT_MAX_PEERS);
        let n = ONE_SHOT_MAX_PEERS * per;
        assert_eq!(few.choose(&ar, 8, n), Algorithm::Hier);
        assert_eq!(few.choose(&ar, 64 << 20, n), Algorithm::Hier);
        let many = spread(128);
        assert_eq!(many.choose(&ar, 8, 1024), Algorithm::Tree);
        // The tree's bound grows with the hosts: 128 / 16 times 256 KiB.
        assert_eq!(many.choose(&ar, 2 << 20, 1024), Algorithm::Tree);
        assert_eq!(many.choose(&ar, (2 << 20) + 1, 1024), Algorithm::Hier);
        assert_eq!(few.choose(&ar, (256 << 10) + 1, n), Algorithm::Hier);
        let flat = Tuner {
            per_host: Some(1),
            ..many.clone()
        };
        assert_eq!(flat.choose(&ar, 2 << 20, 1024), Algorithm::Tree);
        assert_eq!(flat.choose(&ar, (2 << 20) + 1, 1024), Algorithm::Ring);
        assert_eq!(many.choose(&ag, 8, 1024), Algorithm::Ring);
        assert_eq!(spread(2).choose(&ag, 8, 16), Algorithm::Direct);
        assert_eq!(
            HostLayout::default_direct_max(ONE_SHOT_MAX_PEERS + 1),
            0,
            "never one-shot between many hosts"
        );
        // Told to use nothing else, the one-hop all-gather is still the choice.
        let direct_only = Tuner {
            allowed: vec![Algorithm::Direct],
            ..many
        };
        assert_eq!(direct_only.choose(&ag, 8, 1024), Algorithm::Direct);
    }
}
