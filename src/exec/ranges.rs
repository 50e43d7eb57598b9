//! Byte ranges of a group's operations: a union of ranges that answers overlaps, and the
//! question both executors ask of a group before they order its send/recv calls apart from
//! its collectives.

/// A union of byte ranges, kept as disjoint `start -> end` entries.
#[derive(Default)]
pub(crate) struct Intervals(pub(crate) std::collections::BTreeMap<u64, u64>);

impl Intervals {
    pub(crate) fn insert(&mut self, start: u64, len: u64) {
        if len == 0 {
            return;
        }
        let (mut lo, mut hi) = (start, start + len);
        // Absorb every range that touches [lo, hi).
        while let Some((&s, &e)) = self.0.range(..=hi).next_back() {
            if e < lo {
                break;
            }
            self.0.remove(&s);
            lo = lo.min(s);
            hi = hi.max(e);
        }
        self.0.insert(lo, hi);
    }

    pub(crate) fn overlaps(&self, start: u64, len: u64) -> bool {
        len > 0
            && self
                .0
                .range(..start + len)
                .next_back()
                .is_some_and(|(_, &e)| e > start)
    }
}

/// What one operation of a group reads and writes: whether it is a send/recv call, and its
/// send and receive buffers as (start, length) as far as its schedule reads and writes them.
#[derive(Clone, Copy)]
pub(crate) struct OpBytes {
    pub p2p: bool,
    pub read: (u64, u64),
    pub write: (u64, u64),
}

/// Whether a group holds send/recv calls and collectives both, and no send/recv call shares
/// bytes with a collective where either writes them: then its send/recv calls may be ordered
/// apart from its collectives (each kind still in the order called). Where they share such
/// bytes, the group's calls keep the order called: a send/recv call that waits for a
/// collective (or one a collective waits for) cannot be moved past it.
pub(crate) fn kinds_apart<I>(ops: I) -> bool
where
    I: IntoIterator<Item = OpBytes>,
    I::IntoIter: Clone,
{
    let ops = ops.into_iter();
    // Most groups (and every call alone) hold one kind: they are told so without a map.
    let (mut p2p, mut collectives) = (false, false);
    for o in ops.clone() {
        p2p |= o.p2p;
        collectives |= !o.p2p;
    }
    if !(p2p && collectives) {
        return false;
    }
    let (mut touched, mut written) = (Intervals::default(), Intervals::default());
    for o in ops.clone().filter(|o| !o.p2p) {
        touched.insert(o.read.0, o.read.1);
        touched.insert(o.write.0, o.write.1);
        written.insert(o.write.0, o.write.1);
    }
    let meets = |o: &OpBytes| {
        touched.overlaps(o.write.0, o.write.1) || written.overlaps(o.read.0, o.read.1)
    };
    !ops.filter(|o| o.p2p).any(|o| meets(&o))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn intervals_merge_and_answer_overlaps() {
        let mut iv = Intervals::default();
        iv.insert(10, 5); // [10, 15)
        iv.insert(20, 5); // [20, 25)
        assert!(!iv.overlaps(15, 5));
        assert!(iv.overlaps(14, 1));
        assert!(iv.overlaps(0, 11));
        assert!(!iv.overlaps(0, 10));
        assert!(!iv.overlaps(12, 0));
        iv.insert(15, 5); // joins both: [10, 25)
        assert_eq!(iv.0.len(), 1);
        assert!(iv.overlaps(24, 100));
        assert!(!iv.overlaps(25, 100));
    }

    /// Whether a range of `a` overlaps one of `b`, ranges as (start, end).
    fn any_overlap(a: &[(u64, u64)], b: &[(u64, u64)]) -> bool {
        let mut iv = Intervals::default();
        b.iter().for_each(|&(s, e)| iv.insert(s, e - s));
        a.iter().any(|&(s, e)| iv.overlaps(s, e - s))
    }

    #[test]
    fn ranges_overlap_only_where_they_share_a_byte() {
        let b = [(300, 400), (100, 200)];
        // Touching ends share nothing; one byte in does.
        assert!(!any_overlap(&[(200, 300), (400, 500), (0, 100)], &b));
        assert!(any_overlap(&[(199, 201)], &b));
        assert!(any_overlap(&[(399, 1000)], &b));
        // Inside one, around one, and past a short one under a long one.
        assert!(any_overlap(&[(150, 160)], &b));
        assert!(any_overlap(&[(50, 450)], &b));
        let nested = [(0, 1000), (10, 20)];
        assert!(any_overlap(&[(500, 600)], &nested));
        assert!(!any_overlap(&[], &nested));
        assert!(!any_overlap(&[(0, 10)], &[]));
    }

    #[test]
    fn the_kinds_are_apart_only_where_neither_writes_what_the_other_touches() {
        let op = |p2p, read, write| OpBytes { p2p, read, write };
        let coll = || op(false, (0, 8), (64, 8));
        // Both read the same bytes, or only adjacent bytes meet: apart.
        assert!(kinds_apart([op(true, (0, 8), (0, 0)), coll()]));
        assert!(kinds_apart([op(true, (8, 8), (72, 8)), coll()]));
        // The send reads what the collective writes; the receive writes what it reads.
        assert!(!kinds_apart([op(true, (68, 4), (0, 0)), coll()]));
        assert!(!kinds_apart([op(true, (0, 0), (4, 4)), coll()]));
        // One kind alone is not a mix, whatever its bytes.
        assert!(!kinds_apart([
            op(true, (0, 8), (0, 0)),
            op(true, (0, 0), (0, 8))
        ]));
        assert!(!kinds_apart([coll(), coll()]));
    }
}
