"""The ProcessGroup API of backend "comm" next to gloo's (run by test_pg_api.py).

Each check makes one call, or a short sequence, on a group of each backend over the same ranks
with the same inputs, and compares what a caller of that API can see: the outputs, the value
of each work's future (and whether its tensors are the outputs' memory, as gloo's are), and
for an invalid call the kind of exception (ValueError, RuntimeError, ...). gloo is the
reference; a few checks also state the expected value outright, where gloo and comm agreeing
is not enough (an aliased list reduced once, not twice).

Calls that gloo refuses for one rank only (a root's bad output list) are made by that rank
alone: the others would wait for it forever, on either backend.
"""

import datetime
import time

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from scenarios import data, gloo_group, init_comm, origin

R = dist.ReduceOp
SIZES = [0, 1, 7]  # empty, one element, an odd count


def kind(err):
    """The exception class a caller's ``except`` tells apart. torch's DistBackendError, and
    comm's CommError, are RuntimeErrors."""
    for cls in (ValueError, TypeError, NotImplementedError, IndexError, RuntimeError):
        if isinstance(err, cls):
            return cls.__name__
    return type(err).__name__


def options(cls, **fields):
    """A torch.distributed options object (AllreduceOptions, ...) with ``fields`` set."""
    made = cls()
    for name, value in fields.items():
        setattr(made, name, value)
    return made


def flat(items):
    if isinstance(items, torch.Tensor):
        return [items]
    out = []
    for x in items:
        out.extend(flat(x))
    return out


def future(work, outputs):
    """What ``work``'s future holds once it is waited for, each tensor paired with whether it
    is memory of one of ``outputs`` (gloo's future holds the outputs themselves)."""
    work.wait()
    storages = {o.untyped_storage().data_ptr() for o in flat(outputs) if o.layout == torch.strided}

    def tag(v):
        if isinstance(v, torch.Tensor):
            return (v, v.layout == torch.strided and v.untyped_storage().data_ptr() in storages)
        if isinstance(v, (list, tuple)):
            return [tag(x) for x in v]
        return v

    return tag(work.get_future().value())


def match(a, b, where):
    """Asserts that ``a`` (comm's) and ``b`` (gloo's) are the same observation."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), f"{where}: {a!r} vs {b!r}"
        assert a.layout == b.layout, f"{where}: layout {a.layout} vs {b.layout}"
        a, b = (a.to_dense(), b.to_dense()) if a.layout != torch.strided else (a, b)
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        )
        a, b = a.detach(), b.detach()
        if a.dtype.is_floating_point or a.dtype.is_complex:
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3, msg=lambda m: f"{where}: {m}")
        else:
            assert torch.equal(a, b), f"{where}: {a} vs {b}"
        return
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        assert isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)), f"{where}: {a!r} vs {b!r}"
        assert len(a) == len(b), f"{where}: {len(a)} items vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            match(x, y, f"{where}[{i}]")
        return
    assert a == b, f"{where}: {a!r} vs {b!r}"


class Twin:
    """The two groups over the same ranks, and the comparison of one call on both."""

    def __init__(self, comm, gloo):
        self.comm, self.gloo = comm, gloo

    def outcome(self, group, fn, tensors):
        copies = [t.clone() for t in tensors]
        try:
            seen = fn(group, *copies)
        except Exception as err:  # noqa: BLE001  the kind of failure is what is compared
            return ("error", kind(err), f"{type(err).__name__}: {err}"), copies
        return ("ok", seen), copies

    def same(self, fn, *tensors, expect=None, inputs=True, may_fail=False):
        """``fn(group, *copies of tensors)`` on comm, then on gloo: the same outcome, the same
        inputs afterwards (the outputs of in-place calls; not with ``inputs=False``, where
        gloo leaves them undefined), the same returned observations. ``expect(copies,
        seen)``, where given, checks comm's outcome against the truth."""
        got, got_t = self.outcome(self.comm, fn, tensors)
        ref, ref_t = self.outcome(self.gloo, fn, tensors)
        if not may_fail:
            # A call meant to work, where a mistake of the check itself would fail on both.
            assert ref[0] == "ok", f"gloo failed: {ref[-1]}"
            assert got[0] == "ok", f"comm failed where gloo did not: {got[-1]}"
        if got[0] != ref[0] or (got[0] == "error" and got[1] != ref[1]):
            raise AssertionError(
                f"comm: {got[-1] if got[0] == 'error' else 'returned'}; gloo: {ref[-1] if ref[0] == 'error' else 'returned'}"
            )
        if got[0] == "ok":
            if inputs:
                match(got_t, ref_t, "tensors after the call")
            match(got[1], ref[1], "what the call gave")
            if expect is not None:
                expect(got_t, got[1])
        return got

    def fails(self, fn, *tensors, kind_name="RuntimeError", by_comm=True):
        """Both refuse the call, with an exception of kind ``kind_name``; comm's says it is
        comm's (unless ``by_comm`` is False: refused by torch itself, before any backend)."""
        got = self.same(fn, *tensors, may_fail=True)
        assert got[0] == "error", "both accepted a call that should fail"
        assert got[1] == kind_name, f"refused with {got[2]}, expected a {kind_name}"
        assert not by_comm or "comm" in got[2], f"not refused by the backend: {got[2]}"


# ----------------------------------------------------------------------------------------
# The API, collective by collective.


def api(ctx):
    comm, gloo = init_comm(ctx)
    twin = Twin(comm, gloo)
    n, me = ctx.world, ctx.rank
    check = ctx.check
    # Off the fast inline path: the work goes to the executor's thread, as async_op=True does.
    a_sync = {"asyncOp": True}

    # -- all_reduce, one tensor per rank: dtypes, sizes, ops; the future holds [tensor].
    def all_reduce(dtype, size, op):
        lo, hi = (1, 3) if op == R.PRODUCT else (-4, 5)
        x = data(ctx, (size,), dtype, salt=size, lo=lo, hi=hi)

        def call(g, t):
            return future(g.allreduce([t], options(c10d.AllreduceOptions, reduceOp=op, **a_sync)), [t])

        twin.same(call, x)

    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.int8, torch.uint8):
        for size in SIZES:
            check(f"all_reduce/{dtype}/{size}", all_reduce, dtype, size, R.SUM)
    for op in (R.PRODUCT, R.MIN, R.MAX, R.AVG):
        check(f"all_reduce/{op}", all_reduce, torch.float32, 7, op)

    def all_reduce_sync_future():
        # A synchronous call's work still holds its outputs (a finished call returned a
        # shared work whose future held None).
        def call(g, t):
            return future(g.allreduce([t], options(c10d.AllreduceOptions, asyncOp=False)), [t])

        twin.same(call, data(ctx, (5,), torch.float32))

    check("all_reduce/sync_future", all_reduce_sync_future)

    # -- all_reduce of several tensors per rank: gloo reduces the list jointly.
    def all_reduce_joint(dtype, size, op):
        lo, hi = (1, 3) if op == R.PRODUCT else (-4, 5)
        xs = [data(ctx, (size, 2), dtype, salt=10 + i, lo=lo, hi=hi) for i in range(3)]

        def call(g, *ts):
            return future(g.allreduce(list(ts), options(c10d.AllreduceOptions, reduceOp=op, **a_sync)), ts)

        def expect(ts, _seen):
            # Every tensor holds the reduction over all ranks of all three.
            everything = [
                data(ctx, (size, 2), dtype, salt=10 + i, lo=lo, hi=hi, rank=r) for r in range(n) for i in range(3)
            ]
            stacked = torch.stack(everything).double()
            want = {
                R.SUM: stacked.sum(0),
                R.PRODUCT: stacked.prod(0),
                R.MIN: stacked.min(0).values,
                R.MAX: stacked.max(0).values,
                R.AVG: stacked.sum(0) / n,
            }[op]
            for t in ts:
                torch.testing.assert_close(t.double(), want, rtol=1e-3, atol=1e-3)

        if op == R.AVG:
            # gloo divides only the first tensor of the list by the number of ranks and
            # leaves the sum in the others: the expected value is the reference here.
            got, copies = twin.outcome(comm, call, xs)
            assert got[0] == "ok", got
            expect(copies, got[1])
            twin.same(lambda g, *ts: call(g, *ts)[0], *xs, inputs=False)
        else:
            twin.same(call, *xs, expect=expect)

    for op in (R.SUM, R.PRODUCT, R.MIN, R.MAX, R.AVG):
        check(f"all_reduce_joint/{op}", all_reduce_joint, torch.float32, 3, op)
    for size in SIZES:
        check(f"all_reduce_joint/int64/{size}", all_reduce_joint, torch.int64, size, R.SUM)

    def all_reduce_joint_sparse():
        def sparse(salt):
            g = torch.Generator().manual_seed(100 * me + salt)
            idx = torch.randint(0, 6, (1, 3), generator=g)
            return torch.sparse_coo_tensor(idx, torch.randint(-3, 4, (3, 2), generator=g).float(), (6, 2))

        def call(g, a, b):
            return future(g.allreduce([a, b], options(c10d.AllreduceOptions, **a_sync)), [])

        twin.same(call, sparse(1), sparse(2))

    check("all_reduce_joint/sparse", all_reduce_joint_sparse)

    def all_reduce_sparse():
        g0 = torch.Generator().manual_seed(me)
        x = torch.sparse_coo_tensor(torch.randint(0, 9, (1, 4), generator=g0), torch.ones(4), (9,))

        def call(g, t):
            return future(g.allreduce([t], options(c10d.AllreduceOptions, **a_sync)), [])

        twin.same(call, x)

    check("all_reduce/sparse", all_reduce_sparse)

    def all_reduce_joint_refused():
        ok = data(ctx, (4,), torch.float32)

        def call(*ts):
            return lambda g, *_: g.allreduce(list(ts)).wait()

        twin.fails(call(ok, torch.zeros(5)))  # sizes differ
        twin.fails(call(ok, torch.zeros(4, dtype=torch.float64)))  # dtypes differ
        twin.fails(call(ok.to_sparse(), ok))  # layouts differ
        twin.fails(lambda g: g.allreduce([ok.to_sparse()], options(c10d.AllreduceOptions, reduceOp=R.MAX)).wait())

    check("all_reduce_joint/refused", all_reduce_joint_refused)

    # -- all_reduce_coalesced: packed and reduced once, whatever the list aliases.
    def coalesced(tensors_of, want_of=None, op=R.SUM):
        base = data(ctx, (12,), torch.float32, salt=3)

        def call(g, b):
            ts = tensors_of(b)
            return future(
                g.allreduce_coalesced(ts, options(c10d.AllreduceCoalescedOptions, reduceOp=op, **a_sync)), [b]
            )

        def expect(ts, _seen):
            everything = torch.stack([data(ctx, (12,), torch.float32, salt=3, rank=r) for r in range(n)])
            total = everything.sum(0) if op == R.SUM else everything.max(0).values
            torch.testing.assert_close(ts[0], want_of(total) if want_of else total)

        twin.same(call, base, expect=expect)

    check("all_reduce_coalesced/distinct", coalesced, lambda b: [b[0:5], b[5:6], b[6:6], b[6:12].view(2, 3)])
    check("all_reduce_coalesced/same_tensor_twice", coalesced, lambda b: [b, b])
    check("all_reduce_coalesced/same_tensor_twice_max", coalesced, lambda b: [b, b], None, R.MAX)
    check("all_reduce_coalesced/aliased_and_other", coalesced, lambda b: [b[:6], b[6:], b[:6]])
    check("all_reduce_coalesced/overlapping_views", coalesced, lambda b: [b[0:8], b[4:12]])
    check("all_reduce_coalesced/view_of_itself", coalesced, lambda b: [b, b[3:9]])

    def coalesced_dist_api():
        # dist.all_reduce_coalesced, and the coalescing manager (its fast path calls
        # allreduce_coalesced), with one tensor twice.
        x = data(ctx, (6,), torch.int64)

        def call(g, t, u):
            dist.all_reduce_coalesced([t, t, u], group=g)
            with dist._coalescing_manager(group=g):
                dist.all_reduce(u, group=g)
                dist.all_reduce(u, group=g)

        def expect(ts, _seen):
            total = sum(data(ctx, (6,), torch.int64, rank=r) for r in range(n))
            assert torch.equal(ts[0], total), (ts[0], total)
            assert torch.equal(ts[1], total * n), (ts[1], total * n)

        twin.same(call, x, x.clone(), expect=expect)

    check("all_reduce_coalesced/dist_api", coalesced_dist_api)

    # -- broadcast: one tensor, several (the root's tensor rootTensor reaches all of them).
    def broadcast(dtype, size, root):
        x = data(ctx, (size,), dtype, salt=size)

        def call(g, t):
            return future(g.broadcast([t], options(c10d.BroadcastOptions, rootRank=root, **a_sync)), [t])

        twin.same(call, x)

    for dtype in (torch.float32, torch.int8, torch.complex64):
        for size in SIZES:
            check(f"broadcast/{dtype}/{size}", broadcast, dtype, size, n - 1)
    check("broadcast/root0", broadcast, torch.float64, 7, 0)

    def broadcast_noncontiguous():
        twin.same(lambda g, t: dist.broadcast(t.t(), src=n - 1, group=g), data(ctx, (3, 5), torch.float32))

    check("broadcast/noncontiguous", broadcast_noncontiguous)

    def broadcast_joint(root_tensor, size):
        xs = [data(ctx, (size,), torch.float32, salt=20 + i) for i in range(3)]

        def call(g, *ts):
            o = options(c10d.BroadcastOptions, rootRank=n - 1, rootTensor=root_tensor, **a_sync)
            return future(g.broadcast(list(ts), o), ts)

        twin.same(call, *xs)

    for root_tensor in (0, 2):
        for size in (1, 7):
            check(f"broadcast_joint/root_tensor{root_tensor}/{size}", broadcast_joint, root_tensor, size)

    def broadcast_refused():
        x = torch.ones(3)
        twin.fails(lambda g: g.broadcast([x], options(c10d.BroadcastOptions, rootRank=0, rootTensor=1)).wait())
        twin.fails(lambda g: g.broadcast([x, torch.ones(4)], options(c10d.BroadcastOptions, rootRank=0)).wait())
        twin.fails(lambda g: g.broadcast([x], options(c10d.BroadcastOptions, rootRank=n)).wait())

    check("broadcast/refused", broadcast_refused)

    # -- reduce
    def reduce(root, op):
        x = data(ctx, (7,), torch.float32, salt=root)

        def call(g, t):
            work = g.reduce([t], options(c10d.ReduceOptions, rootRank=root, reduceOp=op, **a_sync))
            seen = future(work, [t])
            # Elsewhere than on the root gloo leaves the tensor part-reduced (it works in it).
            return (seen, t) if me == root else len(seen)

        twin.same(call, x, inputs=False)

    for root in (0, n - 1):
        check(f"reduce/root{root}", reduce, root, R.SUM)
    check("reduce/max", reduce, n - 1, R.MAX)

    def reduce_refused():
        twin.fails(lambda g: g.reduce([torch.ones(2), torch.ones(2)], options(c10d.ReduceOptions, rootRank=0)).wait())
        twin.fails(lambda g: g.reduce([torch.ones(2)], options(c10d.ReduceOptions, rootRank=0, rootTensor=1)).wait())
        twin.fails(lambda g: g.reduce([torch.ones(2)], options(c10d.ReduceOptions, rootRank=n)).wait())

    check("reduce/refused", reduce_refused)

    # -- all_gather: lists, one tensor and a flat output, coalesced variants; futures.
    def all_gather(dtype, size):
        x = data(ctx, (size,), dtype, salt=size)

        def call(g, t):
            outs = [torch.full((size,), 9, dtype=dtype) for _ in range(n)]
            return future(g.allgather([outs], [t], options(c10d.AllgatherOptions, **a_sync)), outs)

        twin.same(call, x)

    for dtype in (torch.float32, torch.int64, torch.bfloat16):
        for size in SIZES:
            check(f"all_gather/{dtype}/{size}", all_gather, dtype, size)

    def all_gather_joint(size):
        xs = [data(ctx, (size,), torch.float32, salt=30 + i) for i in range(2)]

        def call(g, *ts):
            lists = [[torch.zeros(size) for _ in range(2 * n)] for _ in range(2)]
            return future(g.allgather(lists, list(ts), options(c10d.AllgatherOptions, **a_sync)), lists), lists

        twin.same(call, *xs)

    for size in (1, 7):
        check(f"all_gather_joint/{size}", all_gather_joint, size)

    def all_gather_into_tensor(size, rows):
        x = data(ctx, (rows, size), torch.float32)

        def call(g, t):
            out = torch.zeros(rows * n, size)
            return future(g._allgather_base(out, t, options(c10d.AllgatherOptions, **a_sync)), [out]), out

        twin.same(call, x)

    for size in SIZES:
        check(f"all_gather_into_tensor/{size}", all_gather_into_tensor, size, 2)

    def all_gather_coalesced():
        xs = [data(ctx, (s,), torch.float32, salt=s) for s in (1, 3, 0)]

        def call(g, *ts):
            lists = [[torch.zeros(t.shape) for t in ts] for _ in range(n)]
            return future(g.allgather_coalesced(lists, list(ts), options(c10d.AllgatherOptions, **a_sync)), lists)

        twin.same(call, *xs)

    check("all_gather_coalesced", all_gather_coalesced)

    def all_gather_into_tensor_coalesced():
        xs = [data(ctx, (s,), torch.float32, salt=s) for s in (2, 1, 5)]

        def call(g, *ts):
            outs = [torch.zeros(t.numel() * n) for t in ts]
            work = g.allgather_into_tensor_coalesced(outs, list(ts), options(c10d.AllgatherOptions, **a_sync))
            return future(work, outs), outs

        twin.same(call, *xs)

    check("all_gather_into_tensor_coalesced", all_gather_into_tensor_coalesced)

    def all_gather_refused():
        x = torch.ones(2)
        twin.fails(lambda g: dist.all_gather([torch.zeros(2) for _ in range(n + 1)], x, group=g))
        twin.fails(lambda g: dist.all_gather([torch.zeros(3) for _ in range(n)], x, group=g))
        twin.fails(lambda g: dist.all_gather_into_tensor(torch.zeros(2 * n + 1), x, group=g))
        twin.fails(lambda g: g._allgather_base(torch.zeros(2 * n, dtype=torch.float64), x).wait())
        twin.fails(lambda g: g.allgather([[torch.zeros(2)] * (2 * n)], [x, x]).wait())  # one list for two inputs
        twin.fails(lambda g: g.allgather([[torch.zeros(2)] * n] * 2, [x, x]).wait())  # lists too short
        twin.fails(lambda g: g.allgather([[torch.zeros(2)] * (2 * n)] * 2, [x, torch.ones(3)]).wait())

    check("all_gather/refused", all_gather_refused)

    # -- gather and scatter; the root's future holds the list, the others' nothing.
    def gather(root, size):
        x = data(ctx, (size,), torch.float32, salt=size)

        def call(g, t):
            outs = [[torch.zeros(size) for _ in range(n)]] if me == root else []
            return future(g.gather(outs, [t], options(c10d.GatherOptions, rootRank=root, **a_sync)), outs), outs

        twin.same(call, x)

    for root in (0, n - 1):
        for size in SIZES:
            check(f"gather/root{root}/{size}", gather, root, size)

    def scatter(root, size):
        def call(g, t):
            ins = [[data(ctx, (size,), torch.float32, salt=r) for r in range(n)]] if me == root else []
            return future(g.scatter([t], ins, options(c10d.ScatterOptions, rootRank=root, **a_sync)), [t])

        twin.same(call, torch.zeros(size))

    for root in (0, n - 1):
        for size in SIZES:
            check(f"scatter/root{root}/{size}", scatter, root, size)

    def gather_scatter_refused():
        x = torch.ones(2)
        # Several tensors: every rank refuses.
        twin.fails(lambda g: g.gather([[torch.zeros(2)] * n], [x, x], options(c10d.GatherOptions, rootRank=0)).wait())
        twin.fails(lambda g: g.scatter([x, x], [], options(c10d.ScatterOptions, rootRank=n - 1)).wait())
        if me == 0:  # the root alone refuses its own bad list
            twin.fails(lambda g: dist.gather(x, [torch.zeros(2)] * (n + 1), dst=0, group=g))
            twin.fails(lambda g: dist.gather(x, [torch.zeros(3)] * n, dst=0, group=g))
            twin.fails(lambda g: dist.scatter(x, [torch.ones(2)] * (n + 1), src=0, group=g))
            twin.fails(lambda g: dist.scatter(x, [torch.ones(3)] * n, src=0, group=g))

    check("gather_scatter/refused", gather_scatter_refused)

    # -- reduce_scatter: blocks of one size, and of a different size per rank (gloo takes
    # both); reduce_scatter_tensor. gloo's works for these have no future to compare.
    def reduce_scatter(sizes, op, dtype=torch.float32):
        lo, hi = (1, 3) if op == R.PRODUCT else (-4, 5)
        ins = [data(ctx, (sizes[r],), dtype, salt=r, lo=lo, hi=hi) for r in range(n)]

        def call(g, out, *blocks):
            g.reduce_scatter([out], [list(blocks)], options(c10d.ReduceScatterOptions, reduceOp=op)).wait()

        def expect(ts, _seen):
            total = torch.stack([data(ctx, (sizes[me],), dtype, salt=me, lo=lo, hi=hi, rank=r) for r in range(n)])
            if op == R.SUM:
                torch.testing.assert_close(ts[0], total.sum(0).to(dtype))

        twin.same(call, torch.zeros(sizes[me], dtype=dtype), *ins, expect=expect)

    for op in (R.SUM, R.MAX, R.PRODUCT, R.AVG):
        check(f"reduce_scatter/even/{op}", reduce_scatter, [3] * n, op)
        check(f"reduce_scatter/uneven/{op}", reduce_scatter, [(2 * r + 1) % 4 for r in range(n)], op)
    check("reduce_scatter/uneven/zero_one_odd", reduce_scatter, [[0, 1, 7][r % 3] for r in range(n)], R.SUM)
    check("reduce_scatter/uneven/int32", reduce_scatter, [r + 1 for r in range(n)], R.SUM, torch.int32)
    check("reduce_scatter/empty", reduce_scatter, [0] * n, R.SUM)

    def reduce_scatter_tensor(size, op):
        x = data(ctx, (n * size,), torch.float32, salt=size)

        def call(g, out, t):
            g._reduce_scatter_base(out, t, options(c10d.ReduceScatterOptions, reduceOp=op)).wait()

        twin.same(call, torch.zeros(size), x)

    for size in SIZES:
        check(f"reduce_scatter_tensor/{size}", reduce_scatter_tensor, size, R.SUM)
    check("reduce_scatter_tensor/max", reduce_scatter_tensor, 5, R.MAX)

    def reduce_scatter_refused():
        x = torch.ones(2)
        twin.fails(lambda g: dist.reduce_scatter(torch.zeros(2), [x] * (n + 1), group=g))
        twin.fails(lambda g: dist.reduce_scatter(torch.zeros(3), [x] * n, group=g))  # not this rank's size
        twin.fails(lambda g: dist.reduce_scatter_tensor(torch.zeros(2), torch.ones(2 * n + 1), group=g))
        opts = options(c10d.ReduceScatterOptions)
        twin.fails(lambda g: g.reduce_scatter([x, x], [[x] * n, [x] * n], opts).wait())

    check("reduce_scatter/refused", reduce_scatter_refused)

    # -- all_to_all_single and all_to_all
    def all_to_all_single(splits_of, dtype=torch.float32, cols=3):
        in_splits = [splits_of(me, p) for p in range(n)]
        out_splits = [splits_of(p, me) for p in range(n)]
        x = data(ctx, (sum(in_splits), cols), dtype)

        def call(g, t):
            out = torch.full((sum(out_splits), cols), 7, dtype=dtype)
            opts = options(c10d.AllToAllOptions, **a_sync)
            return future(g.alltoall_base(out, t, out_splits, in_splits, opts), [out]), out

        twin.same(call, x)

    check("all_to_all_single/even", all_to_all_single, lambda s, d: 2)
    check("all_to_all_single/uneven", all_to_all_single, lambda s, d: (s + 2 * d) % 3)
    check("all_to_all_single/int8", all_to_all_single, lambda s, d: 1, torch.int8, 1)

    def all_to_all_single_refused():
        x = torch.ones(n)
        # A non-contiguous input: gloo and NCCL refuse it with a ValueError.
        twin.fails(
            lambda g: dist.all_to_all_single(torch.zeros(2 * n), torch.ones(4 * n)[::2], group=g),
            kind_name="ValueError",
        )
        twin.fails(lambda g: dist.all_to_all_single(torch.zeros(n), x, [1] * (n + 1), [1] * (n + 1), group=g))
        twin.fails(lambda g: dist.all_to_all_single(torch.zeros(n), x, [2] * n, [2] * n, group=g))
        twin.fails(lambda g: dist.all_to_all_single(torch.zeros(n + 1), torch.ones(n + 1), group=g))
        twin.fails(lambda g: dist.all_to_all_single(torch.zeros(2 * n), x, group=g))
        twin.fails(lambda g: dist.all_to_all([torch.zeros(1)] * (n + 1), [torch.ones(1)] * (n + 1), group=g))

    check("all_to_all_single/refused", all_to_all_single_refused)

    def all_to_all():
        ins = [data(ctx, (2, 2), torch.float32, salt=p) for p in range(n)]

        def call(g, *ts):
            outs = [torch.zeros(2, 2) for _ in range(n)]
            return future(g.alltoall(outs, list(ts), options(c10d.AllToAllOptions, **a_sync)), outs), outs

        twin.same(call, *ins)

    check("all_to_all", all_to_all)

    # -- point to point (gloo's works have no future), barrier
    def send_recv(size):
        nxt, prv = (me + 1) % n, (me - 1) % n
        x = data(ctx, (size,), torch.float32)

        def call(g, t):
            got = torch.zeros(size)
            works = [g.send([t], nxt, 0), g.recv([got], prv, 0)]
            for w in works:
                w.wait()
            return got

        twin.same(call, x)

    for size in SIZES[1:]:
        check(f"send_recv/{size}", send_recv, size)

    def recv_any_source():
        def call(g, t):
            if me == 0:
                senders = []
                for _ in range(n - 1):
                    got = torch.zeros(3)
                    senders.append(dist.recv(got, group=g))
                    assert torch.equal(got, torch.full((3,), float(senders[-1]))), (got, senders[-1])
                return sorted(senders)
            dist.send(torch.full((3,), float(me)), 0, group=g)
            return None

        twin.same(call, torch.zeros(1))

    check("recv_any_source", recv_any_source)

    def p2p_refused():
        twin.fails(lambda g: g.send([torch.ones(2), torch.ones(2)], (me + 1) % n, 0).wait())
        twin.fails(lambda g: g.recv([torch.ones(2), torch.ones(2)], (me - 1) % n, 0).wait())

    check("p2p/refused", p2p_refused)

    def barrier():
        twin.same(lambda g: future(g.barrier(options(c10d.BarrierOptions, **a_sync)), []))

    check("barrier", barrier)

    # -- inference mode and grad mode: the work runs under the issuer's modes.
    def inference_mode(async_op):
        # Inference tensors made and used under inference mode, the works waited for after
        # it; each call has tensors of its own (gloo may run asynchronous calls at once).
        def call(g):
            with torch.inference_mode():
                x = torch.full((2, 3), float(me + 1))
                outs = [torch.zeros(2, 3) for _ in range(n)]
                reduced, sent = torch.full((3, 2), float(me)), torch.full((3, 2), float(me))
                scattered = torch.zeros(me + 1)
                y = torch.ones(3)
                gathered = [torch.zeros(2, 3) for _ in range(n)] if me == 0 else None
                works = [
                    dist.all_gather(outs, x, group=g, async_op=async_op),
                    dist.all_reduce(reduced.t(), group=g, async_op=async_op),  # through a staged copy
                    dist.broadcast(sent.t(), src=0, group=g, async_op=async_op),
                    dist.reduce_scatter(scattered, [torch.ones(r + 1) for r in range(n)], group=g, async_op=async_op),
                    dist.all_reduce_coalesced([y, y], group=g, async_op=async_op),
                    dist.gather(x, gathered, dst=0, group=g, async_op=async_op),
                    dist.barrier(group=g, async_op=async_op),
                ]
            for w in works:
                if w is not None:
                    w.wait()
            return outs, reduced, sent, scattered, y, gathered or []

        twin.same(call)

    check("inference_mode/async", inference_mode, True)
    check("inference_mode/sync", inference_mode, False)

    def grad_mode():
        # Leaves that require grad take the outputs under no_grad on both; under grad mode
        # both refuse the in-place copy, as autograd does.
        def call(g, enabled):
            outs = [torch.zeros(2, requires_grad=True) for _ in range(n)]
            with torch.set_grad_enabled(enabled):
                dist.all_gather(outs, torch.full((2,), float(me)), group=g, async_op=True).wait()
            return outs

        twin.same(lambda g: call(g, False))
        twin.fails(lambda g: call(g, True), by_comm=False)

        def leaves(g):
            a, b = torch.ones(2, requires_grad=True), torch.ones(3, requires_grad=True)
            with torch.no_grad():
                work = g.allreduce_coalesced([a, b], options(c10d.AllreduceCoalescedOptions, **a_sync))
            work.wait()
            return a, b

        twin.same(leaves)

    check("grad_mode", grad_mode)

    # -- invalid reductions
    def reductions_refused():
        twin.fails(lambda g: dist.all_reduce(torch.ones(2), op=R.BAND, group=g))
        twin.fails(
            lambda g: dist.all_reduce(torch.ones(2, dtype=torch.complex64), op=R.MAX, group=g),
            kind_name="ValueError",
            by_comm=False,
        )

    check("reductions/refused", reductions_refused)
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------
# A receive from any source and the collectives after it.


def any_source_then_collectives(ctx):
    """Rank 0 posts a receive from any source, then takes part in collectives, and waits
    for the receive last; its sender sends only after those collectives. On one
    communicator the all-reduce waited behind the receive, which waited for a send behind
    the all-reduce: the group hung (until its timeout)."""
    comm, gloo = init_comm(ctx, timeout=datetime.timedelta(seconds=30))
    n, me = ctx.world, ctx.rank

    def on(g, send_first):
        sender = n - 1
        x = torch.full((4,), float(me + 1))
        if me == 0:
            got = torch.zeros(3)
            work = dist.irecv(got, group=g)  # from any source
            dist.all_reduce(x, group=g)
            gathered = [torch.zeros(4) for _ in range(n)]
            dist.all_gather(gathered, x, group=g)
            work.wait()
            return got, x, gathered
        if me == sender and send_first:
            dist.send(torch.full((3,), 5.0), 0, group=g)
        dist.all_reduce(x, group=g)
        gathered = [torch.zeros(4) for _ in range(n)]
        dist.all_gather(gathered, x, group=g)
        if me == sender and not send_first:
            dist.send(torch.full((3,), 5.0), 0, group=g)
        return None, x, gathered

    def check(send_first):
        started = time.monotonic()
        got = on(comm, send_first)
        took = time.monotonic() - started
        ref = on(gloo, send_first)
        match(list(got), list(ref), "after the receive from any source")
        if me == 0:
            assert torch.equal(got[0], torch.full((3,), 5.0)), got[0]
        assert took < 20, f"took {took:.1f} s"

    ctx.check("send_after_collectives", check, False)
    ctx.check("send_before_collectives", check, True)

    def batch_with_collective():
        # Sends and receives coalesced with a collective: one group on each communicator.
        nxt, prv = (me + 1) % n, (me - 1) % n
        got = torch.zeros(2)
        y = torch.ones(3)
        with dist._coalescing_manager(group=comm, device=torch.device("cpu"), async_ops=True) as cm:
            dist.isend(torch.full((2,), float(me)), nxt, group=comm)
            dist.irecv(got, prv, group=comm)
            dist.all_reduce(y, group=comm)
        cm.wait()
        assert torch.equal(got, torch.full((2,), float(prv))), got
        assert torch.equal(y, torch.full((3,), float(n))), y

    ctx.check("batch_with_collective", batch_with_collective)
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------
# new_group(use_local_synchronization=True) when the world has a bound device.


def local_new_group(ctx):
    """The members of a new group created with use_local_synchronization=True call
    new_group, the other ranks do not (they need not). With a bound device the members split
    the world's communicator, which needs every rank: they waited for the others forever."""
    init_comm(ctx, device_id=torch.device("cpu:0"))
    n, me = ctx.world, ctx.rank
    members = list(range(n - 1))  # the last rank stays out

    def local():
        sub_g = gloo_group(members)  # every rank (gloo's new_group without local sync)
        if me in members:
            sub = dist.new_group(members, use_local_synchronization=True)
            ctx.values["local_origin"] = origin(sub)
            x = data(ctx, (5,), torch.float32)
            a, b = x.clone(), x.clone()
            dist.all_reduce(a, group=sub)
            dist.all_reduce(b, group=sub_g)
            match(a, b, "all_reduce on the local group")
            got = torch.zeros(5)
            if me == 0 and len(members) > 1:
                dist.send(a, members[1], group=sub)
            elif me == members[-1] and len(members) > 1:
                dist.recv(got, members[0], group=sub)
                match(got, b, "a send on the local group")

    ctx.check("local", local)

    def whole():
        # Without local synchronization every rank comes, and the members still split.
        sub = dist.new_group(members)
        if me in members:
            ctx.values["whole_origin"] = origin(sub)
            x = torch.ones(2)
            dist.all_reduce(x, group=sub)
            match(x, torch.full((2,), float(len(members))), "all_reduce on the split group")

    ctx.check("whole", whole)
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------
# Timeouts


def timeouts(ctx):
    """A group's timeout bounds an operation a peer never joins, and a wait's timeout bounds
    the wait; both backends raise the same kind of error, in about the same time."""
    init_comm(ctx)
    store = dist.distributed_c10d._get_default_store()
    me = ctx.rank
    short = datetime.timedelta(seconds=2)
    groups = {
        "comm": dist.new_group(backend="comm", timeout=short),
        "gloo": gloo_group_with_timeout(short),
    }
    late = {"comm": dist.new_group(backend="comm"), "gloo": gloo_group()}

    def group_timeout():
        kinds = {}
        for name, g in groups.items():
            if me == 0:
                started = time.monotonic()
                try:
                    dist.all_reduce(torch.ones(3), group=g)
                except Exception as err:  # noqa: BLE001  its kind is compared
                    kinds[name] = kind(err)
                took = time.monotonic() - started
                assert took < 15, f"{name}: the all-reduce gave up after {took:.1f} s, not about 2"
        if me == 0:
            assert kinds == {"comm": "RuntimeError", "gloo": "RuntimeError"}, kinds

    ctx.check("group_timeout", group_timeout)

    def wait_timeout():
        kinds, values = {}, {}
        for name, g in late.items():
            x = torch.full((2,), float(me + 1))
            if me == 0:
                work = dist.all_reduce(x, group=g, async_op=True)
                try:
                    work.wait(timeout=datetime.timedelta(seconds=1))
                except Exception as err:  # noqa: BLE001  its kind is compared
                    kinds[name] = kind(err)
                store.set(f"late/{name}", "go")
            else:
                store.wait([f"late/{name}"])
                work = dist.all_reduce(x, group=g, async_op=True)
            work.wait()
            values[name] = x
        if me == 0:
            assert kinds == {"comm": "RuntimeError", "gloo": "RuntimeError"}, kinds
        match(values["comm"], values["gloo"], "the all-reduce after the late rank came")

    ctx.check("wait_timeout", wait_timeout)
    # The timed-out groups are not used again.
    dist.barrier(group=late["comm"])
    dist.destroy_process_group()


def gloo_group_with_timeout(timeout):
    from scenarios import KEEP

    group = dist.new_group(backend="gloo", timeout=timeout)
    KEEP.append(group)
    return group
