//! Binomial-tree schedules: a message crosses log2(n) hops instead of n-1, which wins when
//! latency dominates and the ranks are many. Every chunk is sliced so the levels of the tree
//! work on different slices at once.

use super::{Buf, Operand, Region, Schedule, Shape, Step};

/// Parent and children of `rank` in the binomial tree rooted at `root`: the node at relative
/// position v receives from v minus its lowest set bit and sends to v + 2^k for every 2^k below
/// that bit. Children come smallest subtree first.
pub(crate) fn binomial(rank: usize, root: usize, n: usize) -> (Option<usize>, Vec<usize>) {
    let v = (rank + n - root) % n;
    let abs = |rel: usize| (rel + root) % n;
    let mut children = Vec::new();
    let mut mask = 1;
    while mask < n {
        if v & mask != 0 {
            break;
        }
        if v + mask < n {
            children.push(abs(v + mask));
        }
        mask <<= 1;
    }
    let parent = (v != 0).then(|| abs(v - (v & v.wrapping_neg())));
    (parent, children)
}

/// This rank's parent and children in the tree rooted at `root`. On several hosts, a tree of
/// trees: a binomial tree over one leader per host (the root on its own host, elsewhere the
/// host's first rank), and inside each host a binomial tree rooted at its leader. Each host but
/// the root's then receives once across hosts, the least a broadcast can. Children come
/// inside-host first, so that a reduction takes the nearer (sooner) contributions first.
pub(crate) fn tree_of(shape: &Shape, root: usize) -> (Option<usize>, Vec<usize>) {
    let Some(l) = shape.hosts.as_deref() else {
        return binomial(shape.rank, root, shape.nranks);
    };
    let root_host = l.place[root].0;
    let leader = |host: usize| {
        if host == root_host {
            root
        } else {
            l.members[host][0]
        }
    };
    let (h, local) = l.place[shape.rank];
    let members = &l.members[h];
    let (up, down) = binomial(local, l.place[leader(h)].1, members.len());
    let mut parent = up.map(|i| members[i]);
    let mut children: Vec<usize> = down.into_iter().map(|i| members[i]).collect();
    if shape.rank == leader(h) {
        let (up, down) = binomial(h, root_host, l.hosts());
        parent = up.map(leader);
        children.extend(down.into_iter().map(leader));
    }
    (parent, children)
}

/// Reduce up the tree towards `root`; partial sums accumulate in `acc_buf`.
fn reduce_into(s: &mut Schedule, bytes: usize, root: usize, shape: &Shape, acc_buf: Buf) {
    let (parent, children) = tree_of(shape, root);
    let slices = shape.slices(Buf::Send, 0, bytes);
    for mine in slices {
        let acc = Region::new(acc_buf, mine.offset, mine.len);
        if children.is_empty() {
            match parent {
                Some(p) => s.push(Step::Send {
                    peer: p,
                    src: Operand::input(mine),
                }),
                None => s.push(Step::Local {
                    dst: acc,
                    a: Operand::input(mine),
                    b: None,
                    last: true,
                }),
            }
            continue;
        }
        for (i, &c) in children.iter().enumerate() {
            let with = if i == 0 {
                Operand::input(mine)
            } else {
                Operand::partial(acc)
            };
            s.push(Step::Recv {
                peer: c,
                dst: acc,
                reduce_with: Some(with),
                last: parent.is_none() && i == children.len() - 1,
            });
        }
        if let Some(p) = parent {
            s.push(Step::Send {
                peer: p,
                src: Operand::partial(acc),
            });
        }
    }
}

/// Broadcast down the tree from `root`, of data found in `src` at the root.
fn broadcast_from(s: &mut Schedule, bytes: usize, root: usize, shape: &Shape, src: Buf) {
    let (parent, children) = tree_of(shape, root);
    for dst in shape.slices(Buf::Recv, 0, bytes) {
        let from = match parent {
            Some(p) => {
                s.push(Step::Recv {
                    peer: p,
                    dst,
                    reduce_with: None,
                    last: false,
                });
                dst
            }
            None => Region::new(src, dst.offset, dst.len),
        };
        // Largest subtree first: it has the longest way to go.
        for &c in children.iter().rev() {
            s.push(Step::Send {
                peer: c,
                src: Operand::partial(from),
            });
        }
    }
}

pub(crate) fn broadcast(count: usize, root: usize, shape: &Shape) -> Schedule {
    let bytes = count * shape.elem;
    let mut s = Schedule::default();
    // In place the root's input already is its output (NCCL allows no other overlap).
    if shape.rank == root && !shape.in_place {
        s.push(Step::Local {
            dst: Region::new(Buf::Recv, 0, bytes),
            a: Operand::partial(Region::new(Buf::Send, 0, bytes)),
            b: None,
            last: false,
        });
    }
    broadcast_from(&mut s, bytes, root, shape, Buf::Send);
    s
}

pub(crate) fn reduce(count: usize, root: usize, shape: &Shape) -> Schedule {
    let bytes = count * shape.elem;
    let mut s = Schedule::default();
    let acc = if shape.rank == root {
        Buf::Recv
    } else {
        s.scratch = bytes;
        Buf::Scratch
    };
    reduce_into(&mut s, bytes, root, shape, acc);
    s
}

/// Reduce to rank 0, then broadcast from it: the result is computed once, so every rank gets
/// the same bits.
pub(crate) fn all_reduce(count: usize, shape: &Shape) -> Schedule {
    let bytes = count * shape.elem;
    let mut s = Schedule::default();
    reduce_into(&mut s, bytes, 0, shape, Buf::Recv);
    if shape.nranks > 1 {
        broadcast_from(&mut s, bytes, 0, shape, Buf::Recv);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::super::{sim, Algorithm, HostLayout, Shape};
    use super::{binomial, tree_of};

    #[test]
    fn binomial_tree_is_a_spanning_tree() {
        for n in 1..=17 {
            for root in 0..n {
                let mut seen_as_child = vec![0; n];
                for r in 0..n {
                    let (parent, children) = binomial(r, root, n);
                    assert_eq!(parent.is_none(), r == root);
                    for c in children {
                        seen_as_child[c] += 1;
                        assert_eq!(binomial(c, root, n).0, Some(r));
                    }
                }
                for (r, seen) in seen_as_child.iter().enumerate() {
                    assert_eq!(*seen, usize::from(r != root), "n={n} root={root} r={r}");
                }
            }
        }
    }

    /// Every rank has one parent but the root, and exactly one edge enters each host other
    /// than the root's.
    #[test]
    fn trees_on_several_hosts_cross_into_each_host_once() {
        let layouts: [&[usize]; 4] = [
            &[0, 1, 0, 1],
            &[0, 0, 0, 1, 1, 1],
            &[2, 0, 1, 2, 0, 1, 1],
            &[0, 1, 2, 3, 4],
        ];
        for hosts in layouts {
            let n = hosts.len();
            let layout = HostLayout::new(hosts, 0);
            for root in 0..n {
                let shape = |rank| Shape {
                    rank,
                    nranks: n,
                    elem: 8,
                    in_place: false,
                    slice_bytes: 64,
                    ring: None,
                    hosts: layout.clone(),
                };
                let mut entering = std::collections::HashMap::new();
                let mut parents = 0;
                for r in 0..n {
                    let (parent, children) = tree_of(&shape(r), root);
                    assert_eq!(parent.is_none(), r == root);
                    for c in children {
                        assert_eq!(tree_of(&shape(c), root).0, Some(r), "{hosts:?} root {root}");
                        parents += 1;
                        if hosts[c] != hosts[r] {
                            *entering.entry(hosts[c]).or_insert(0) += 1;
                        }
                    }
                }
                assert_eq!(parents, n - 1);
                let distinct: std::collections::HashSet<_> = hosts.iter().collect();
                assert_eq!(entering.len(), distinct.len() - 1, "{hosts:?} root {root}");
                assert!(entering.values().all(|&k| k == 1), "{hosts:?} root {root}");
                assert!(!entering.contains_key(&hosts[root]));
            }
            sim::with_hosts(hosts.to_vec(), 0, || {
                for count in [0, 1, 13] {
                    sim::check_all_reduce(n, count, 4, Algorithm::Tree);
                    for root in 0..n {
                        sim::check_broadcast(n, count, root, 4, Algorithm::Tree);
                        sim::check_reduce(n, count, root, 4, Algorithm::Tree);
                    }
                }
            });
        }
    }

    #[test]
    fn tree_collectives_compute_the_reference_result() {
        for n in 1..=9 {
            for count in [0, 1, 5, 13] {
                for slice_elems in [1, 4, 1000] {
                    sim::check_all_reduce(n, count, slice_elems, Algorithm::Tree);
                    for root in 0..n {
                        sim::check_broadcast(n, count, root, slice_elems, Algorithm::Tree);
                        sim::check_reduce(n, count, root, slice_elems, Algorithm::Tree);
                    }
                }
            }
        }
    }
}
