"""What each rank process of a multi-process test does (run by rank_main.py).

Most scenarios run the default group on backend "comm" and a second group on gloo over the
same ranks, give both the same inputs, and compare: gloo is the reference. Inputs are small
integers, so sums and products are exact in every dtype and the results must be equal.
"""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

R = dist.ReduceOp
INT_DTYPES = [torch.int8, torch.uint8, torch.int32, torch.int64]
FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def data(ctx, shape, dtype, salt=0, lo=-4, hi=5, rank=None):
    """Deterministic small-integer data of this rank (or ``rank``)."""
    g = torch.Generator().manual_seed(1000 * (ctx.rank if rank is None else rank) + salt)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype == torch.uint8:
        lo = max(lo, 0)
    t = torch.randint(lo, hi, shape, generator=g)
    if dtype.is_complex:
        return torch.complex(t.float(), t.flip(-1).float()).to(dtype)
    return t.to(dtype)


def same(a, b, what=""):
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{what}[{i}]")
        return
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    if a.dtype.is_floating_point or a.dtype.is_complex:
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(a, b), f"{what}: {a} != {b}"


def origin(group):
    """How the communicator behind ``group`` was made: "init" or "split"."""
    try:
        return group._get_backend(torch.device("cpu")).engine.origin
    except RuntimeError:  # the ProcessGroup plumbing of older torch: the group is the backend
        return group.engine.origin


# gloo groups stay referenced until the process ends: dropping one can deadlock older torch
# (~ProcessGroupGloo joins its threads holding the GIL; see rank_main.py).
KEEP = []


def gloo_group(ranks=None):
    group = dist.new_group(ranks, backend="gloo")
    KEEP.append(group)
    return group


def init_comm(ctx, **kwargs):
    import comm_torch  # noqa: F401  (torch before 2.15 has no entry point; see entry_point)

    dist.init_process_group("comm", store=ctx.store(), rank=ctx.rank, world_size=ctx.world, **kwargs)
    return dist.group.WORLD, gloo_group()


# gloo has no int16: its reference runs on int32 copies, cast back (the values are small).
GLOO_STANDIN = {torch.int16: torch.int32}


def both(ctx, comm, gloo, fn, *tensors, expected=None):
    """Runs ``fn(group, *copies)`` on each backend with its own copies of ``tensors``; returns
    the two lists of tensors after the call. Where this torch's gloo refuses the call (older
    releases lack some dtypes and list variants), ``expected()`` gives the reference."""
    a = [t.clone() for t in tensors]
    b = [t.clone().to(GLOO_STANDIN.get(t.dtype, t.dtype)) for t in tensors]
    fn(comm, *a)
    try:
        fn(gloo, *b)
    except RuntimeError:
        if expected is None:
            raise
        return a, expected()
    return a, [y.to(x.dtype) for x, y in zip(tensors, b)]


def gloo_reduce_scatter(gloo, stacked, op, me):
    """reduce_scatter's reference: gloo's all_reduce of every block, and this rank's block
    (older gloo ignores the op of reduce_scatter_tensor)."""
    full = stacked.clone()
    dist.all_reduce(full, op=op, group=gloo)
    return full[me]


# ----------------------------------------------------------------------------------------
# Every operation, compared with gloo.


def ops(ctx):
    comm, gloo = init_comm(ctx)
    n, me = ctx.world, ctx.rank
    assert dist.get_backend() == "comm", dist.get_backend()

    # all_reduce: every dtype with SUM, PRODUCT, MIN, MAX.
    def all_reduce(dtype, op, lo=-4, hi=5):
        x = data(ctx, (5, 3), dtype, salt=int(op), lo=lo, hi=hi)
        a, b = both(ctx, comm, gloo, lambda g, t: dist.all_reduce(t, op=op, group=g), x)
        same(a, b, f"all_reduce {dtype} {op}")

    for dtype in FLOAT_DTYPES + INT_DTYPES:
        for op in (R.SUM, R.MIN, R.MAX):
            ctx.check(f"all_reduce/{op.name}/{dtype}", all_reduce, dtype, op)
        ctx.check(f"all_reduce/PRODUCT/{dtype}", all_reduce, dtype, R.PRODUCT, 1, 3)

    for dtype in INT_DTYPES:
        for op in (R.BAND, R.BOR, R.BXOR):
            ctx.check(f"all_reduce/{op.name}/{dtype}", all_reduce, dtype, op, 0, 100)

    def avg(dtype):
        x = data(ctx, (7,), dtype) * n
        a, b = both(ctx, comm, gloo, lambda g, t: dist.all_reduce(t, op=R.AVG if g is comm else R.SUM, group=g), x)
        same(a[0], b[0] / n, f"AVG {dtype}")

    for dtype in (torch.float32, torch.float64):
        ctx.check(f"all_reduce/AVG/{dtype}", avg, dtype)

    def premul(dtype, factor):
        if not hasattr(dist._make_nccl_premul_sum(1.0), "factor"):
            # torch before ReduceOp.factor gives Python backends no way to read the factor.
            ctx.values["premul_sum"] = "this torch does not expose ReduceOp.factor"
            return
        # gloo has no PREMUL_SUM: its reference is the sum of factor * x.
        x = data(ctx, (6,), dtype)
        f = factor if not isinstance(factor, torch.Tensor) else factor.item()
        a = x.clone()
        dist.all_reduce(a, op=dist._make_nccl_premul_sum(factor), group=comm)
        b = x * f
        dist.all_reduce(b, group=gloo)
        same(a, b, f"PREMUL_SUM {dtype} {factor}")

    for dtype in (torch.float32, torch.float64):
        ctx.check(f"all_reduce/PREMUL_SUM/{dtype}/scalar", premul, dtype, 0.5)
        ctx.check(f"all_reduce/PREMUL_SUM/{dtype}/tensor", premul, dtype, torch.tensor([3.0], dtype=dtype))

    def complex_sum():
        x = data(ctx, (4,), torch.complex64)
        a, b = both(ctx, comm, gloo, lambda g, t: dist.all_reduce(t, group=g), x)
        same(a, b, "complex")

    ctx.check("all_reduce/complex64", complex_sum)

    def bool_sum():
        x = data(ctx, (9,), torch.bool)
        a, b = both(ctx, comm, gloo, lambda g, t: dist.all_reduce(t, group=g), x)
        same(a, b, "bool")

    ctx.check("all_reduce/bool", bool_sum)

    def noncontiguous():
        x = data(ctx, (4, 6), torch.float32).t()
        assert not x.is_contiguous()
        a, b = both(ctx, comm, gloo, lambda g, t: dist.all_reduce(t, group=g), x)
        same(a, b, "non-contiguous all_reduce")
        y = data(ctx, (8,), torch.int64)
        ya = y.clone()[::2]  # strided: comm stages it through a contiguous copy
        assert not ya.is_contiguous()
        dist.broadcast(ya, src=n - 1)
        yb = y[::2].contiguous()
        dist.broadcast(yb, src=n - 1, group=gloo)
        same(ya, yb, "non-contiguous broadcast")

    ctx.check("all_reduce/noncontiguous", noncontiguous)

    def empty():
        x = torch.empty(0)
        dist.all_reduce(x)

    ctx.check("all_reduce/empty", empty)

    def all_reduce_coalesced():
        xs = [data(ctx, (3,), torch.float32, 1), data(ctx, (2, 2), torch.float32, 2)]
        a, b = both(ctx, comm, gloo, lambda g, *t: dist.all_reduce_coalesced(list(t), group=g), *xs)
        same(a, b, "all_reduce_coalesced")
        c = [x.clone() for x in xs]
        fut = dist.all_reduce_coalesced(c, group=comm, async_op=True)
        fut.wait()
        same(c, b, "all_reduce_coalesced async")

    ctx.check("all_reduce_coalesced", all_reduce_coalesced)

    def coalescing_manager():
        from torch.distributed.distributed_c10d import _coalescing_manager

        def run(g, x1, x2, big1, big2, rs1, rs2):
            with _coalescing_manager(group=g, async_ops=True) as cm:
                dist.all_reduce(x1, group=g)
                dist.all_reduce(x2, group=g)
            cm.wait()
            with _coalescing_manager(group=g, async_ops=True) as cm:
                dist.all_gather_into_tensor(big1, x1, group=g)
                dist.all_gather_into_tensor(big2, x2, group=g)
            cm.wait()
            with _coalescing_manager(group=g):
                dist.reduce_scatter_tensor(rs1, big1, group=g)
                dist.reduce_scatter_tensor(rs2, big2, group=g)

        x1, x2 = data(ctx, (4,), torch.float32, 1), data(ctx, (3,), torch.float32, 2)
        inputs = [x1, x2, torch.zeros(4 * n), torch.zeros(3 * n), torch.zeros(4), torch.zeros(3)]
        a, b = both(ctx, comm, gloo, run, *inputs)
        same(a, b, "coalescing manager")

    ctx.check("coalescing_manager", coalescing_manager)

    # broadcast and reduce from every root.
    def broadcast(dtype, root):
        x = data(ctx, (3, 2), dtype, salt=root)
        a, b = both(
            ctx,
            comm,
            gloo,
            lambda g, t: dist.broadcast(t, src=root, group=g),
            x,
            expected=lambda: [data(ctx, (3, 2), dtype, salt=root, rank=root)],
        )
        same(a, b, f"broadcast {dtype} root {root}")

    for root in range(n):
        for dtype in (torch.float32, torch.int64, torch.bool, torch.complex64, torch.int16):
            ctx.check(f"broadcast/{dtype}/root{root}", broadcast, dtype, root)

    def reduce(op, root):
        x = data(ctx, (5,), torch.float32, salt=root)
        a, b = both(ctx, comm, gloo, lambda g, t: dist.reduce(t, dst=root, op=op, group=g), x)
        if me == root:
            same(a, b, f"reduce {op} root {root}")

    for root in range(n):
        for op in (R.SUM, R.MAX):
            ctx.check(f"reduce/{op.name}/root{root}", reduce, op, root)

    # all_gather in all its forms.
    def all_gather(dtype):
        x = data(ctx, (2, 3), dtype)
        outs = [torch.zeros(2, 3, dtype=dtype) for _ in range(n)]
        a, b = both(ctx, comm, gloo, lambda g, t, *o: dist.all_gather(list(o), t, group=g), x, *outs)
        same(a[1:], b[1:], f"all_gather {dtype}")
        for r in range(n):
            same(a[1 + r], data(ctx, (2, 3), dtype, rank=r), f"all_gather {dtype} from {r}")

    for dtype in (torch.float32, torch.int32, torch.bool):
        ctx.check(f"all_gather/{dtype}", all_gather, dtype)

    def all_gather_uneven():
        # gloo refuses tensors of different sizes; the expected values are known.
        x = data(ctx, (me + 1,), torch.float32)
        outs = [torch.zeros(r + 1) for r in range(n)]
        dist.all_gather(outs, x)
        for r in range(n):
            same(outs[r], data(ctx, (r + 1,), torch.float32, rank=r), f"uneven all_gather from {r}")

    ctx.check("all_gather/uneven", all_gather_uneven)

    def all_gather_into_tensor():
        x = data(ctx, (3,), torch.float32)
        a, b = both(ctx, comm, gloo, lambda g, o, t: dist.all_gather_into_tensor(o, t, group=g), torch.zeros(3 * n), x)
        same(a[0], b[0], "all_gather_into_tensor")
        flat = b[0]
        # gloo takes no stacked (n, 3) output; the flat result is the reference.
        stacked = torch.zeros(n, 3)
        dist.all_gather_into_tensor(stacked, x)
        same(stacked, flat.view(n, 3), "all_gather_into_tensor stacked")

    ctx.check("all_gather_into_tensor", all_gather_into_tensor)

    def all_gather_coalesced():
        xs = [data(ctx, (2,), torch.float32, 1), data(ctx, (3,), torch.float32, 2)]
        outs = [[torch.zeros(2), torch.zeros(3)] for _ in range(n)]
        dist.all_gather_coalesced(outs, xs)
        for r in range(n):
            same(
                outs[r],
                [data(ctx, (2,), torch.float32, 1, rank=r), data(ctx, (3,), torch.float32, 2, rank=r)],
                f"from {r}",
            )
        outs2 = [[torch.zeros(2), torch.zeros(3)] for _ in range(n)]
        fut = dist.all_gather_coalesced(outs2, xs, async_op=True)
        fut.wait()
        same(outs2, outs, "all_gather_coalesced async")

    ctx.check("all_gather_coalesced", all_gather_coalesced)

    # reduce_scatter.
    def reduce_scatter(op):
        ins = [data(ctx, (4,), torch.float32, salt=10 + r) for r in range(n)]
        out = torch.zeros(4)
        copies = [t.clone() for t in ins]
        dist.reduce_scatter(out, copies, op=op)
        same(out, gloo_reduce_scatter(gloo, torch.stack(ins), op, me), f"reduce_scatter {op}")
        assert all(torch.equal(x, y) for x, y in zip(copies, ins)), "reduce_scatter changed its inputs"

    for op in (R.SUM, R.MAX):
        ctx.check(f"reduce_scatter/{op.name}", reduce_scatter, op)

    def reduce_scatter_tensor(op):
        x = data(ctx, (n * 3,), torch.float32)
        out = torch.zeros(3)
        dist.reduce_scatter_tensor(out, x.clone(), op=op)
        same(out, gloo_reduce_scatter(gloo, x.view(n, 3), op, me), f"reduce_scatter_tensor {op}")

    for op in (R.SUM, R.MIN, R.PRODUCT):
        ctx.check(f"reduce_scatter_tensor/{op.name}", reduce_scatter_tensor, op)

    def reduce_scatter_tensor_avg():
        x = data(ctx, (n * 2,), torch.float64) * n
        a = torch.zeros(2, dtype=torch.float64)
        dist.reduce_scatter_tensor(a, x.clone(), op=R.AVG)
        b = torch.zeros(2, dtype=torch.float64)
        dist.reduce_scatter_tensor(b, x.clone(), group=gloo)
        same(a, b / n, "reduce_scatter_tensor AVG")

    ctx.check("reduce_scatter_tensor/AVG", reduce_scatter_tensor_avg)

    # all_to_all.
    def all_to_all():
        ins = [data(ctx, (2,), torch.float32, salt=r) for r in range(n)]
        outs = [torch.zeros(2) for _ in range(n)]
        a, b = both(
            ctx,
            comm,
            gloo,
            lambda g, *t: dist.all_to_all(list(t[:n]), list(t[n:]), group=g),
            *outs,
            *ins,
            expected=lambda: [data(ctx, (2,), torch.float32, salt=me, rank=p) for p in range(n)],
        )
        same(a[:n], b[:n], "all_to_all")

    ctx.check("all_to_all", all_to_all)

    def all_to_all_uneven():
        # rank r sends r + p + 1 elements to rank p.
        ins = [torch.full((me + p + 1,), float(10 * me + p)) for p in range(n)]
        outs = [torch.zeros(p + me + 1) for p in range(n)]
        dist.all_to_all(outs, ins)
        for p in range(n):
            same(outs[p], torch.full((p + me + 1,), float(10 * p + me)), f"all_to_all uneven from {p}")

    ctx.check("all_to_all/uneven", all_to_all_uneven)

    def all_to_all_single():
        x = data(ctx, (n * 3, 2), torch.float32)
        a, b = both(ctx, comm, gloo, lambda g, o, t: dist.all_to_all_single(o, t, group=g), torch.zeros(n * 3, 2), x)
        same(a[0], b[0], "all_to_all_single")

    ctx.check("all_to_all_single", all_to_all_single)

    def all_to_all_single_splits(dtype):
        # rank r sends (r + p) % 3 rows to rank p (some of them empty).
        in_splits = [(me + p) % 3 for p in range(n)]
        out_splits = [(p + me) % 3 for p in range(n)]
        x = data(ctx, (sum(in_splits), 2), dtype)
        a, b = both(
            ctx,
            comm,
            gloo,
            lambda g, o, t: dist.all_to_all_single(o, t, out_splits, in_splits, group=g),
            torch.zeros(sum(out_splits), 2, dtype=dtype),
            x,
        )
        same(a[0], b[0], f"all_to_all_single with splits {dtype}")

    for dtype in (torch.float32, torch.int64, torch.int16):
        ctx.check(f"all_to_all_single/splits/{dtype}", all_to_all_single_splits, dtype)

    # gather and scatter from every root.
    def gather(root):
        x = data(ctx, (3,), torch.float32, salt=root)
        outs = [torch.zeros(3) for _ in range(n)] if me == root else None
        outs_g = [torch.zeros(3) for _ in range(n)] if me == root else None
        dist.gather(x.clone(), outs, dst=root)
        dist.gather(x.clone(), outs_g, dst=root, group=gloo)
        if me == root:
            same(outs, outs_g, f"gather root {root}")

    def scatter(root):
        ins = [data(ctx, (2, 2), torch.float32, salt=r) for r in range(n)] if me == root else None
        a, b = torch.zeros(2, 2), torch.zeros(2, 2)
        dist.scatter(a, ins, src=root)
        dist.scatter(b, ins, src=root, group=gloo)
        same(a, b, f"scatter root {root}")

    def gather_single(root):
        # dist.gather_single (gather_into_tensor) is newer than some torch releases.
        x = data(ctx, (2, 3), torch.float32, salt=root)
        out = torch.zeros(n, 2, 3) if me == root else None
        try:
            dist.gather_single(x, out, dst=root)
        except RuntimeError as e:
            # torch 2.15's PyBackend trampoline does not forward gather_single to Python
            # backends; the base class refuses it on every rank alike.
            if "does not support gather_single" not in str(e):
                raise
            ctx.values["gather_single"] = "not forwarded by torch"
            return
        if me == root:
            for r in range(n):
                same(out[r], data(ctx, (2, 3), torch.float32, salt=root, rank=r), f"gather_single from {r}")

    for root in range(n):
        ctx.check(f"gather/root{root}", gather, root)
        ctx.check(f"scatter/root{root}", scatter, root)
        if hasattr(dist, "gather_single"):
            ctx.check(f"gather/single/root{root}", gather_single, root)

    # point to point.
    def send_recv():
        right, left = (me + 1) % n, (me - 1) % n
        x = data(ctx, (4,), torch.float32)
        got = torch.zeros(4)
        # Blocking calls around the ring: rank 0 sends first, every other rank receives first.
        if me == 0:
            dist.send(x, right)
            dist.recv(got, left)
        else:
            dist.recv(got, left)
            dist.send(x, right)
        same(got, data(ctx, (4,), torch.float32, rank=left), "send/recv")

    ctx.check("send_recv", send_recv)

    def isend_irecv():
        right, left = (me + 1) % n, (me - 1) % n
        x = data(ctx, (5,), torch.int64)
        got = torch.zeros(5, dtype=torch.int64)
        reqs = [dist.isend(x, right), dist.irecv(got, left)]
        for r in reqs:
            r.wait()
        same(got, data(ctx, (5,), torch.int64, rank=left), "isend/irecv")

    ctx.check("isend_irecv", isend_irecv)

    def p2p_any_order():
        # gloo lets a rank post its irecv before its blocking send; so must comm. Large
        # messages, so no send can complete on its own before the receive is posted.
        right, left = (me + 1) % n, (me - 1) % n
        x = data(ctx, (1 << 18,), torch.float32)
        got = torch.zeros(1 << 18)
        req = dist.irecv(got, left)
        dist.send(x, right)
        req.wait()
        same(got, data(ctx, (1 << 18,), torch.float32, rank=left), "irecv before send")
        # And receives waited on in the reverse order of posting.
        g1, g2 = torch.zeros(1000), torch.zeros(1000)
        r1 = dist.irecv(g1, left)
        r2 = dist.irecv(g2, right)
        s1 = dist.isend(x[:1000], right)
        s2 = dist.isend(x[1000:2000], left)
        for w in (r2, r1, s2, s1):
            w.wait()
        same(g1, data(ctx, (1 << 18,), torch.float32, rank=left)[:1000], "from left")
        same(g2, data(ctx, (1 << 18,), torch.float32, rank=right)[1000:2000], "from right")

    ctx.check("isend_irecv/any_order", p2p_any_order)

    def batch_isend_irecv():
        right, left = (me + 1) % n, (me - 1) % n
        x1, x2 = data(ctx, (3,), torch.float32, 1), data(ctx, (2,), torch.int32, 2)
        g1, g2 = torch.zeros(3), torch.zeros(2, dtype=torch.int32)
        ops = [
            dist.P2POp(dist.irecv, g1, left),
            dist.P2POp(dist.isend, x1, right),
            dist.P2POp(dist.isend, x2, left),
            dist.P2POp(dist.irecv, g2, right),
        ]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        same(g1, data(ctx, (3,), torch.float32, 1, rank=left), "batch from left")
        same(g2, data(ctx, (2,), torch.int32, 2, rank=right), "batch from right")

    ctx.check("batch_isend_irecv", batch_isend_irecv)

    def barrier():
        dist.barrier()
        dist.barrier(async_op=True).wait()

    ctx.check("barrier", barrier)

    # async: two operations in flight at once, wait() and get_future().
    def two_async():
        x = data(ctx, (1000,), torch.float32)
        y = data(ctx, (10,), torch.float32, 3)
        a, big = x.clone(), torch.zeros(10 * n)
        w1 = dist.all_reduce(a, async_op=True)
        w2 = dist.all_gather_into_tensor(big, y, async_op=True)
        fut = w1.get_future()
        seen = []
        chained = fut.then(lambda f: seen.append(f.value()) or "chained")
        w2.wait()
        w1.wait()
        assert chained.wait() == "chained"
        b, bigb = x.clone(), torch.zeros(10 * n)
        dist.all_reduce(b, group=gloo)
        dist.all_gather_into_tensor(bigb, y, group=gloo)
        same(a, b, "async all_reduce")
        same(big, bigb, "async all_gather")
        same(seen[0][0], b, "future value")

    ctx.check("async/two_in_flight", two_async)

    def async_returns_early():
        # An async call returns before the data moves: the rank that is late makes the
        # other's work stay incomplete until it joins.
        x = torch.ones(4)
        if me == 0:
            start = time.monotonic()
            w = dist.all_reduce(x, async_op=True)
            issued = time.monotonic() - start
            w.wait()
            waited = time.monotonic() - start
            assert issued < 0.5 < waited, f"issued in {issued:.3f}s, completed after {waited:.3f}s"
        else:
            time.sleep(1.0)
            dist.all_reduce(x)
        same(x, torch.full((4,), float(n)), "late all_reduce")

    ctx.check("async/returns_early", async_returns_early)

    def library_error():
        # BAND on floats: libcomm refuses it and says why; the message must reach Python.
        import comm_torch

        try:
            dist.all_reduce(torch.ones(3), op=R.BAND)
        except comm_torch.CommError as e:
            assert isinstance(e, RuntimeError)
            if hasattr(dist, "DistBackendError"):
                assert isinstance(e, dist.DistBackendError)
            text = str(e)
            assert "ncclAllReduce" in text and "ncclInvalidArgument" in text, text
            ctx.values["library_error"] = text
        else:
            raise AssertionError("BAND on float32 did not fail")
        dist.barrier()  # the communicator is still usable

    ctx.check("library_error", library_error)

    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------
# Sub-groups.


def subgroups(ctx):
    bound = "bound" in ctx.args
    kwargs = {"device_id": torch.device("cpu:0")} if bound else {}
    comm, gloo = init_comm(ctx, **kwargs)
    n, me = ctx.world, ctx.rank
    evens = list(range(0, n, 2))
    odds = list(range(1, n, 2))

    def new_group():
        sub = dist.new_group(evens)
        sub_g = gloo_group(evens)
        x = data(ctx, (6,), torch.float32)
        if me in evens:
            assert dist.get_backend(sub) == "comm"
            ctx.values["new_group_origin"] = origin(sub)
            a, b = both(ctx, sub, sub_g, lambda g, t: dist.all_reduce(t, group=g), x)
            same(a, b, "new_group all_reduce")
            assert dist.get_world_size(sub) == len(evens) and dist.get_rank(sub) == evens.index(me)
            a, b = both(ctx, sub, sub_g, lambda g, t: dist.broadcast(t, src=evens[-1], group=g), x)
            same(a, b, "new_group broadcast (global rank as src)")
        # The parent still works afterwards.
        a, b = both(ctx, comm, gloo, lambda g, t: dist.all_reduce(t, group=g), x)
        same(a, b, "parent after new_group")

    ctx.check("new_group", new_group)

    def split_group():
        groups = [evens, odds] if odds else [evens]
        sub = dist.split_group(split_ranks=groups)
        mine = evens if me in evens else odds
        sub_g = gloo_group(evens)
        sub_g2 = gloo_group(odds) if odds else None
        ref = sub_g if me in evens else sub_g2
        assert sub is not None and sub is not dist.GroupMember.NON_GROUP_MEMBER
        assert dist.get_world_size(sub) == len(mine)
        ctx.values["split_group_origin"] = origin(sub)
        x = data(ctx, (5,), torch.int64)
        a, b = both(ctx, sub, ref, lambda g, t: dist.all_reduce(t, group=g), x)
        same(a, b, "split_group all_reduce")
        # A split with a rank left out: it gets no group and the others still work.
        left_out = [r for r in range(n) if r != n - 1]
        sub2 = dist.split_group(split_ranks=[left_out])
        if me == n - 1:
            # torch's PyBackend cannot take None from a Python split(); the rank outside
            # gets a placeholder group that refuses to operate (see CommBackend.split).
            if sub2 is not None and sub2 != dist.GroupMember.NON_GROUP_MEMBER:
                try:
                    dist.all_reduce(torch.ones(1), group=sub2)
                except (RuntimeError, ValueError) as e:
                    # torch's own logging may complain first that the rank is not in it
                    assert "not a member" in str(e) or "not part of group" in str(e), str(e)
                else:
                    raise AssertionError("the placeholder group ran a collective")
        else:
            y = torch.ones(3)
            dist.all_reduce(y, group=sub2)
            same(y, torch.full((3,), float(n - 1)), "split_group without the last rank")
        dist.barrier()

    import comm_torch.backend

    if comm_torch.backend.backend_trampoline_available():
        ctx.check("split_group", split_group)
    else:
        ctx.values["split_group"] = "needs torch's PyBackend trampoline (torch 2.15)"
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------
# DistributedDataParallel: the same training on comm and on gloo ends with the same weights.


def ddp(ctx):
    from torch.nn.parallel import DistributedDataParallel as DDP

    comm, gloo = init_comm(ctx)
    steps = int(ctx.args[0]) if ctx.args else 5

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))

    models = {}
    for name, group in (("comm", comm), ("gloo", gloo)):
        # bucket_cap_mb small enough for several buckets, so allreduces overlap backward.
        model = DDP(make(), process_group=group, bucket_cap_mb=0.001)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(ctx.rank)
        for _ in range(steps):
            x = torch.randn(8, 16, generator=g)
            y = torch.randn(8, 4, generator=g)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
        models[name] = [p.detach().clone() for p in model.parameters()]

    def compare():
        for p, q in zip(models["comm"], models["gloo"]):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        # and the ranks agree with each other
        for p in models["comm"]:
            ref = p.clone()
            dist.broadcast(ref, src=0)
            assert torch.equal(ref, p)

    ctx.check("ddp_matches_gloo", compare)
    ctx.values["first_param_sum"] = float(models["comm"][0].sum())
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------
# A rank that dies.


def dead_rank(ctx):
    import comm_torch

    _world, _gloo = init_comm(ctx)
    victim = ctx.world - 1
    dist.barrier()
    if ctx.rank == victim:
        time.sleep(0.5)  # the others are inside their collectives by now
        os._exit(17)

    def blocked_collective_fails():
        start = time.monotonic()
        x = torch.ones(1 << 16)
        try:
            if ctx.rank == 0:
                dist.all_reduce(x)
            else:
                dist.all_reduce(x, async_op=True).wait()
        except comm_torch.CommError as e:
            ctx.values["error"] = str(e)
            ctx.values["seconds"] = time.monotonic() - start
            assert "ncclRemoteError" in str(e) or "ncclTimeout" in str(e) or "ncclSystemError" in str(e), str(e)
        else:
            raise AssertionError("all_reduce with a dead peer succeeded")

    ctx.check("blocked_collective_fails", blocked_collective_fails)

    def later_calls_fail():
        for call in (lambda: dist.barrier(), lambda: dist.all_reduce(torch.ones(2), async_op=True).wait()):
            try:
                call()
            except RuntimeError:
                pass
            else:
                raise AssertionError("a collective after the peer died succeeded")

    ctx.check("later_calls_fail", later_calls_fail)
    # No destroy_process_group: the communicator has a dead member.


# ----------------------------------------------------------------------------------------
# Registration without importing comm_torch (torch >= 2.15 uses the entry point).


def entry_point(ctx):
    assert "comm_torch" not in sys.modules
    dist.init_process_group(backend="comm", store=ctx.store(), rank=ctx.rank, world_size=ctx.world)

    def works():
        assert dist.get_backend() == "comm"
        x = torch.full((3,), float(ctx.rank + 1))
        dist.all_reduce(x)
        same(x, torch.full((3,), float(sum(range(1, ctx.world + 1)))), "all_reduce")
        assert "comm_torch" in sys.modules  # loaded by torch through the entry point

    ctx.check("entry_point", works)
    dist.destroy_process_group()


def process_group_fallback(ctx):
    """The ProcessGroup-subclass plumbing used where torch lacks the PyBackend trampoline
    (forced with COMM_TORCH_PROCESS_GROUP=1)."""
    import comm_torch.backend as cb

    comm, gloo = init_comm(ctx)
    n = ctx.world

    def is_fallback():
        assert not cb.backend_trampoline_available()
        assert isinstance(comm, cb.CommProcessGroup), type(comm)

    ctx.check("is_fallback", is_fallback)

    def collectives():
        x = data(ctx, (4,), torch.float32)
        for fn in (
            lambda g, t: dist.all_reduce(t, group=g),
            lambda g, t: dist.broadcast(t, src=0, group=g),
            lambda g, t: dist.all_reduce(t, op=R.MAX, group=g),
        ):
            a, b = both(ctx, comm, gloo, fn, x)
            same(a, b, "fallback")
        outs = [torch.zeros(4) for _ in range(n)]
        dist.all_gather(outs, x)
        same(outs[ctx.rank], x, "fallback all_gather")
        w = dist.all_reduce(x.clone(), async_op=True)
        w.wait()
        dist.barrier()

    ctx.check("collectives", collectives)

    def ddp_step():
        from torch.nn.parallel import DistributedDataParallel as DDP

        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(4, 2))
        model(torch.randn(3, 4)).sum().backward()

    ctx.check("ddp", ddp_step)
    dist.destroy_process_group()


def user_patterns(ctx):
    """Patterns found by using the backend as a training script would, each of which hung or
    gave wrong data: a collective issued from a future's callback on the same group (DDP's
    PowerSGD hook), an isend left unsent while the thread runs a collective on another group,
    uneven all_gather into a non-contiguous output, and tags (ignored, with a warning)."""
    import warnings

    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD

    init_comm(ctx)
    n, me = ctx.world, ctx.rank

    def collective_in_then():
        # Asynchronous and synchronous collectives on the same group from a `then`
        # callback, the future of one waited inside it.
        def chained(_fut):
            u = torch.full((3,), float(me + 1))
            dist.all_reduce(u, async_op=True).get_future().wait()
            v = torch.full((3,), 2.0)
            dist.all_reduce(v)
            return u + v

        t = torch.ones(4)
        fut = dist.all_reduce(t, async_op=True).get_future().then(chained)
        got = fut.wait()
        want = n * (n + 1) / 2 + 2 * n
        same(got, torch.full((3,), float(want)), "all-reduces from a then callback")
        same(t, torch.full((4,), float(n)), "the first all-reduce")

    ctx.check("collective_in_then", collective_in_then)

    def powersgd_ddp():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        state = powerSGD.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powerSGD.powerSGD_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        for step in range(5):
            torch.manual_seed(100 + step * n + me)
            x, y = torch.randn(8, 16), torch.randn(8, 4)
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        # Every rank applied the same averaged gradients: the parameters agree.
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(n)]
        dist.all_gather(gathered, flat)
        for r in range(n):
            same(gathered[r], flat, f"rank {r}'s parameters after PowerSGD steps")

    ctx.check("powersgd_ddp", powersgd_ddp)

    def isend_then_other_group():
        sub = dist.new_group(list(range(n)))
        x = torch.full((7,), float(me))
        if me == 0:
            req = dist.isend(x, 1)
            y = torch.ones(2)
            dist.all_reduce(y, group=sub)
            req.wait()
        elif me == 1:
            got = torch.zeros(7)
            dist.recv(got, 0)
            same(got, torch.zeros(7), "the isend's data")
            y = torch.ones(2)
            dist.all_reduce(y, group=sub)
        else:
            y = torch.ones(2)
            dist.all_reduce(y, group=sub)
        same(y, torch.full((2,), float(n)), "the subgroup's all-reduce")
        dist.destroy_process_group(sub)

    ctx.check("isend_then_other_group", isend_then_other_group)

    def uneven_all_gather_noncontiguous():
        # Rank r gathers r + 1 elements into columns of a 2-row tensor (non-contiguous).
        outs = [torch.zeros(2, r + 1).t()[:, 0] for r in range(n)]
        dist.all_gather(outs, torch.arange(me + 1, dtype=torch.float32) + 10 * me)
        for r in range(n):
            same(outs[r], torch.arange(r + 1, dtype=torch.float32) + 10 * r, f"rank {r}'s part")

    ctx.check("uneven_all_gather_noncontiguous", uneven_all_gather_noncontiguous)

    def tags_warn():
        if n < 2 or me > 1:
            return
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            x = torch.full((3,), float(me))
            if me == 0:
                dist.send(x, 1, tag=5)
            else:
                dist.recv(x, 0, tag=5)
                same(x, torch.zeros(3), "a tagged message")
        assert any("tags are ignored" in str(w.message) for w in seen), [str(w.message) for w in seen]

    ctx.check("tags_warn", tags_warn)

    def any_source_then_send():
        # Rank 0 posts a receive from any source, then sends to rank 1, which answers only
        # after it received: the send used to wait behind the pending receive forever.
        if me > 1:
            return
        if me == 0:
            got = torch.zeros(4)
            r = dist.irecv(got)
            s = dist.isend(torch.full((4,), 7.0), 1)
            s.wait()
            r.wait()
            same(got, torch.full((4,), 8.0), "the answer")
        else:
            x = torch.zeros(4)
            dist.recv(x, 0)
            same(x, torch.full((4,), 7.0), "rank 0's send")
            dist.send(x + 1, 0)

    ctx.check("any_source_then_send", any_source_then_send)
    dist.destroy_process_group()


def group_timeout(ctx):
    """init_process_group(timeout=3 s): rank 0's collective with a rank that comes 12 s late
    fails after about the timeout, as with gloo (it used to block until the rank came, or
    forever)."""
    import datetime

    import comm_torch  # noqa: F401

    dist.init_process_group(
        "comm", store=ctx.store(), rank=ctx.rank, world_size=ctx.world, timeout=datetime.timedelta(seconds=3)
    )

    def late_rank():
        t = torch.ones(4)
        if ctx.rank == 1:
            time.sleep(12)
        start = time.monotonic()
        try:
            dist.all_reduce(t)
        except RuntimeError as e:
            took = time.monotonic() - start
            if ctx.rank == 0:
                assert "timed out" in str(e), str(e)
                assert took < 9, f"the all-reduce failed after {took:.1f} s, not about 3"
        else:
            # The late rank may still find what rank 0 sent before it gave up.
            assert ctx.rank != 0, "rank 0's all-reduce succeeded"

    ctx.check("late_rank", late_rank)
    dist.destroy_process_group()


def work_handles(ctx):
    """What a caller of torch.distributed gets back: on a group that is comm on every device,
    the backend's own work (is_completed() after wait(), the sender of a receive from any
    source) and the name "comm"; on a mixed group, torch's own group, still working."""
    import comm_torch.backend as cb

    comm, _ = init_comm(ctx)
    n, me = ctx.world, ctx.rank

    def group_is_comms():
        assert isinstance(comm, cb.CommGroup), type(comm)
        assert comm.name() == "comm" and comm._get_backend_name() == "comm"
        assert isinstance(comm._get_backend(torch.device("cpu")), cb.CommBackend)

    ctx.check("group_is_comms", group_is_comms)

    def completion_after_wait():
        if me == 0:
            works = [dist.isend(torch.full((5,), float(peer)), peer) for peer in range(1, n)]
        else:
            got = torch.zeros(5)
            works = [dist.irecv(got, 0)]
        for w in works:
            w.wait()
            assert w.is_completed() and w.is_success(), "wait() returned but the work is not completed"
        if me != 0:
            assert torch.equal(got, torch.full((5,), float(me)))
        x = torch.ones(4)
        w = dist.all_reduce(x, async_op=True)
        w.wait()
        assert w.is_completed() and torch.equal(x, torch.full((4,), float(n)))
        ops = [
            dist.P2POp(dist.isend, torch.full((2,), float(me)), (me + 1) % n),
            dist.P2POp(dist.irecv, torch.zeros(2), (me - 1) % n),
        ]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
            assert w.is_completed()
        assert torch.equal(ops[1].tensor, torch.full((2,), float((me - 1) % n)))
        # Under the old name, torch's ProcessGroup reaches the backend through the new one.
        out = torch.zeros(2 * n)
        w = comm._allgather_base(out, torch.full((2,), float(me)))
        w.wait()
        assert w.is_completed() and torch.equal(out, torch.arange(n).float().repeat_interleave(2))
        with dist._coalescing_manager(group=comm, async_ops=True) as cm:
            dist.all_reduce(torch.ones(2))
            dist.all_reduce(torch.ones(3))
        cm.wait()

    ctx.check("completion_after_wait", completion_after_wait)

    def any_source_names_sender():
        if me == 0:
            senders = set()
            for _ in range(1, n):
                t = torch.full((3,), -1.0)
                src = dist.recv(t)  # from any source: torch asks the work for _source_rank()
                assert torch.equal(t, torch.full((3,), float(src))), (src, t)
                senders.add(src)
            assert senders == set(range(1, n)), senders
        else:
            dist.send(torch.full((3,), float(me)), 0)
        dist.barrier()

    ctx.check("any_source_names_sender", any_source_names_sender)

    def ddp_logs_comm():
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(torch.nn.Linear(4, 2))
        model(torch.randn(3, 4)).sum().backward()
        assert model._get_ddp_logging_data().get("backend_name") == "comm"

    ctx.check("ddp_logs_comm", ddp_logs_comm)

    def mixed_group_is_torchs():
        # comm for cpu only: torch must build the other device's backend on its own group.
        mixed = dist.new_group(backend="cpu:comm,cuda:gloo")
        assert not isinstance(mixed, cb.CommGroup), type(mixed)
        assert isinstance(mixed._get_backend(torch.device("cpu")), cb.CommBackend)
        x = torch.ones(2)
        dist.all_reduce(x, group=mixed)
        assert torch.equal(x, torch.full((2,), float(n)))

    ctx.check("mixed_group_is_torchs", mixed_group_is_torchs)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------
# torchcomms, through a fake of its registration and factory (tests/fake_torchcomms).


def torchcomms_abort(ctx):
    """abort_process_on_timeout_or_error=True: a call refused for its arguments raises, but
    losing a peer ends the process with SIGABRT (the launcher expects it), as torchcomms'
    NCCL backend does."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_torchcomms"))
    os.environ["TORCHCOMM_RANK"] = str(ctx.rank)
    os.environ["TORCHCOMM_SIZE"] = str(ctx.world)
    import torchcomms
    from torchcomms import ReduceOp

    n, me = ctx.world, ctx.rank
    comm = torchcomms.new_comm(
        "comm", torch.device("cpu"), name="world", store=ctx.store(), abort_process_on_timeout_or_error=True
    )
    try:
        comm.reduce_scatter_v(torch.zeros(1), [torch.ones(1)] * (n + 1), ReduceOp.SUM, async_op=False)
    except ValueError:
        pass
    comm.barrier(async_op=False)
    if me == n - 1:
        os._exit(0)
    work = comm.all_reduce(torch.ones(4), ReduceOp.SUM, async_op=True)
    try:
        work.wait()
    except RuntimeError as e:
        print(f"the process should have aborted, but the wait raised: {e}", flush=True)
    os._exit(3)


def torchcomms_timeouts(ctx):
    """A communicator's timeout bounds its init and its operations: with the last rank
    absent (init) or late (an all-reduce), the others fail within it, not after
    COMM_INIT_TIMEOUT or whenever the late rank comes."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_torchcomms"))
    os.environ["TORCHCOMM_RANK"] = str(ctx.rank)
    os.environ["TORCHCOMM_SIZE"] = str(ctx.world)
    import torchcomms
    from torchcomms import ReduceOp

    n, me = ctx.world, ctx.rank
    last = me == n - 1
    limit = datetime.timedelta(seconds=2)
    world = torchcomms.new_comm("comm", torch.device("cpu"), name="world", store=ctx.store())

    def init():
        if not last:
            t = time.monotonic()
            try:
                torchcomms.new_comm("comm", torch.device("cpu"), name="absent", store=ctx.store(), timeout=limit)
            except TimeoutError as e:
                assert "not initialized within 2 s" in str(e), str(e)
            except RuntimeError as e:
                # A rank that gave up first (its timeout passed) fails the others' init.
                assert "left before the rendezvous completed" in str(e), str(e)
            else:
                raise AssertionError("an init without the last rank succeeded")
            took = time.monotonic() - t
            assert took < 10, f"the init gave up after {took:.1f} s, its timeout is 2 s"

    ctx.check("init", init)
    world.barrier(async_op=False)

    def operation():
        timed = torchcomms.new_comm("comm", torch.device("cpu"), name="timed", store=ctx.store(), timeout=limit)
        if last:
            time.sleep(8)
        t = time.monotonic()
        try:
            timed.all_reduce(torch.ones(4), ReduceOp.SUM, async_op=False)
        except RuntimeError as e:
            failed = str(e)
        else:
            failed = None
        took = time.monotonic() - t
        if not last:
            assert failed is not None, "an all-reduce with a rank 8 s late succeeded under a 2 s timeout"
            assert took < 6, f"the all-reduce gave up after {took:.1f} s, its timeout is 2 s"
        timed.finalize()

    ctx.check("operation", operation)
    world.barrier(async_op=False)


def torchcomms_backend(ctx):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_torchcomms"))
    os.environ["TORCHCOMM_RANK"] = str(ctx.rank)
    os.environ["TORCHCOMM_SIZE"] = str(ctx.world)
    import torchcomms
    from torchcomms import ReduceOp

    n, me = ctx.world, ctx.rank
    assert "comm_torch" not in sys.modules
    comm = torchcomms.new_comm("comm", torch.device("cpu"), name="world", store=ctx.store())
    ref = comm.unsafe_get_backend()  # the Python backend instance

    def identity():
        assert comm.get_rank() == me and comm.get_size() == n
        assert comm.get_backend() == "comm" and comm.get_name() == "world"
        assert type(ref).__module__ == "comm_torch.torchcomms_backend"

    ctx.check("identity", identity)

    def all_reduce():
        for op, expect in (
            (ReduceOp.SUM, float(sum(range(1, n + 1)))),
            (ReduceOp.MAX, float(n)),
            (ReduceOp.AVG, (n + 1) / 2),
        ):
            x = torch.full((4,), float(me + 1))
            comm.all_reduce(x, op, async_op=False)
            same(x, torch.full((4,), expect), f"all_reduce {op.type}")
        x = torch.full((2,), float(me + 1))
        comm.all_reduce(x, ReduceOp.PREMUL_SUM(2.0), async_op=False)
        same(x, torch.full((2,), 2.0 * sum(range(1, n + 1))), "premul")
        x = torch.full((3,), float(me + 1))
        work = comm.all_reduce(x, ReduceOp.SUM, async_op=True)
        work.wait()
        same(x, torch.full((3,), float(sum(range(1, n + 1)))), "async all_reduce")

    ctx.check("all_reduce", all_reduce)

    def others():
        total = float(sum(range(n)))
        x = torch.full((2,), float(me))
        comm.broadcast(x, n - 1, async_op=False)
        same(x, torch.full((2,), float(n - 1)), "broadcast")
        x = torch.full((2,), float(me))
        comm.reduce(x, 0, ReduceOp.SUM, async_op=False)
        if me == 0:
            same(x, torch.full((2,), total), "reduce")
        outs = [torch.zeros(2) for _ in range(n)]
        comm.all_gather(outs, torch.full((2,), float(me)), async_op=False)
        same(outs, [torch.full((2,), float(r)) for r in range(n)], "all_gather")
        outs = [torch.zeros(r + 1) for r in range(n)]
        comm.all_gather_v(outs, torch.full((me + 1,), float(me)), async_op=False)
        same(outs, [torch.full((r + 1,), float(r)) for r in range(n)], "all_gather_v")
        big = torch.zeros(2 * n)
        comm.all_gather_single(big, torch.full((2,), float(me)), async_op=True).wait()
        same(big, torch.arange(n).float().repeat_interleave(2), "all_gather_single")
        out = torch.zeros(2)
        comm.reduce_scatter(out, [torch.full((2,), float(me + r)) for r in range(n)], ReduceOp.SUM, async_op=False)
        same(out, torch.full((2,), total + n * me), "reduce_scatter")
        out = torch.zeros(me + 1)
        comm.reduce_scatter_v(out, [torch.full((r + 1,), float(me)) for r in range(n)], ReduceOp.SUM, async_op=False)
        same(out, torch.full((me + 1,), total), "reduce_scatter_v")
        # A list that does not hold one block per rank, or an output that is not this rank's
        # block, is refused before anything runs (the list was taken as it came), and the
        # communicator stays usable.
        for inputs, output in (
            ([torch.ones(1)] * (n - 1), torch.zeros(1)),
            ([torch.ones(1)] * (n + 1), torch.zeros(1)),
            ([torch.ones(r + 1) for r in range(n)], torch.zeros(me + 2)),
        ):
            try:
                comm.reduce_scatter_v(output, inputs, ReduceOp.SUM, async_op=False)
            except ValueError as e:
                assert "reduce_scatter_v" in str(e), str(e)
            else:
                raise AssertionError(f"reduce_scatter_v accepted {len(inputs)} inputs, output of {output.numel()}")
        out = torch.zeros(2)
        comm.reduce_scatter_single(out, torch.arange(2 * n).float(), ReduceOp.SUM, async_op=False)
        same(out, torch.arange(2 * me, 2 * me + 2).float() * n, "reduce_scatter_single")
        out = torch.zeros(n)
        comm.all_to_all_single(out, torch.full((n,), float(me)), async_op=False)
        same(out, torch.arange(n).float(), "all_to_all_single")
        out = torch.zeros(sum(p + 1 for p in range(n)))
        comm.all_to_all_v_single(
            out, torch.full((n * (me + 1),), float(me)), [p + 1 for p in range(n)], [me + 1] * n, async_op=False
        )
        same(out, torch.cat([torch.full((p + 1,), float(p)) for p in range(n)]), "all_to_all_v_single")
        # Splits covering less than the first dimension (as torchcomms' NCCL backend allows):
        # the rows past them are left alone; more than it is refused.
        out = torch.full((sum(p + 1 for p in range(n)) + 2,), -5.0)
        comm.all_to_all_v_single(
            out, torch.full((n * (me + 1) + 3,), float(me)), [p + 1 for p in range(n)], [me + 1] * n, async_op=False
        )
        same(
            out[:-2], torch.cat([torch.full((p + 1,), float(p)) for p in range(n)]), "all_to_all_v_single, short splits"
        )
        same(out[-2:], torch.full((2,), -5.0), "all_to_all_v_single, rows past the splits")
        try:
            comm.all_to_all_v_single(torch.zeros(n), torch.zeros(n), [1] * n, [2] * n, async_op=False)
        except ValueError as e:
            assert "add up to more than" in str(e), str(e)
        else:
            raise AssertionError("all_to_all_v_single accepted splits larger than its input")
        outs = [torch.zeros(1) for _ in range(n)]
        comm.all_to_all(outs, [torch.full((1,), float(10 * me + p)) for p in range(n)], async_op=False)
        same(outs, [torch.full((1,), float(10 * p + me)) for p in range(n)], "all_to_all")
        comm.barrier(async_op=False)
        comm.barrier(async_op=True).wait()
        out = torch.zeros(2)
        comm.scatter(out, [torch.full((2,), float(r)) for r in range(n)] if me == 0 else [], 0, async_op=False)
        same(out, torch.full((2,), float(me)), "scatter")
        outs = [torch.zeros(2) for _ in range(n)] if me == 0 else []
        comm.gather(outs, torch.full((2,), float(me)), 0, async_op=False)
        if me == 0:
            same(outs, [torch.full((2,), float(r)) for r in range(n)], "gather")
        x = torch.full((3,), float(me))
        got = torch.zeros(3)
        right, left = (me + 1) % n, (me - 1) % n
        w1 = comm.send(x, right, async_op=True)
        w2 = comm.recv(got, left, async_op=True)
        w1.wait()
        w2.wait()
        same(got, torch.full((3,), float(left)), "send/recv")

    ctx.check("collectives", others)

    def split():
        mine = [r for r in range(n) if r % 2 == me % 2]
        sub = comm.split(mine, f"half{me % 2}")
        assert sub.get_size() == len(mine) and sub.get_rank() == mine.index(me)
        x = torch.ones(2)
        sub.all_reduce(x, ReduceOp.SUM, async_op=False)
        same(x, torch.full((2,), float(len(mine))), "split all_reduce")
        sub.finalize()

    ctx.check("split", split)

    def windows():
        # torchcomms main's window API, through the backend (see CommWindow).
        nxt, prv = (me + 1) % n, (me - 1) % n
        win = ref.new_window()
        assert win.get_size() == 0 and win.get_tensor() is None
        t = torch.zeros(16, dtype=torch.float64)
        win.tensor_register(t)
        assert win.get_size() == 128 and win.get_tensor() is t
        assert win.dtype == torch.float64 and win.shape == [16]
        # put() signals once: the wait returns with the data in place.
        win.put(torch.full((4,), float(me + 1), dtype=torch.float64), nxt, 4, False)
        win.wait_signal(prv, False)
        same(t[4:8], torch.full((4,), float(prv + 1), dtype=torch.float64), "put")
        assert int(t[:4].abs().sum()) == 0 and int(t[8:14].abs().sum()) == 0  # [14:] may be in flight
        # put() + signal() deliver two signals; async_op gives a work.
        work = win.put(torch.full((2,), -1.0, dtype=torch.float64), nxt, 14, True)
        work.wait()
        win.signal(nxt, False)
        win.wait_signal(prv, True).wait()
        win.wait_signal(prv, False)
        same(t[14:], torch.full((2,), -1.0, dtype=torch.float64), "put + signal")
        try:
            win.put(torch.ones(4, dtype=torch.float64), nxt, 13, False)
        except ValueError:
            pass
        else:
            raise AssertionError("a put past the window's end was accepted")
        assert win.map_remote_tensor(me).data_ptr() == t.data_ptr()
        if n > 1:
            try:
                win.map_remote_tensor(nxt)  # ordinary memory of another process
            except RuntimeError:
                pass
            else:
                raise AssertionError("map_remote_tensor of a peer's private memory succeeded")
        win.tensor_deregister()
        assert win.get_size() == 0
        # window_allocate: shared memory, so peers on this host map it.
        shared = ref.window_allocate(64)
        mine = shared.get_tensor()
        assert mine.dtype == torch.uint8 and mine.numel() == 64  # a peer may be filling it already
        remote = shared.map_remote_tensor(nxt)
        remote.fill_(me + 1)
        shared.signal(nxt, False)
        shared.wait_signal(prv, False)
        same(mine, torch.full((64,), prv + 1, dtype=torch.uint8), "map_remote_tensor")
        shared.tensor_deregister()
        # Sizes that differ between ranks: puts are bounded by the target's size, not this
        # rank's, and a peer's smaller memory is not mapped with this rank's shape (it was,
        # and writing its end crashed).
        uneven = ref.window_allocate(64 + 64 * me)
        theirs = 64 + 64 * nxt
        try:
            uneven.put(torch.ones(theirs + 1, dtype=torch.uint8), nxt, 0, False)
        except ValueError as e:
            assert f"window of {theirs} bytes" in str(e), str(e)
        else:
            raise AssertionError("a put past the end of a smaller peer window was accepted")
        uneven.put(torch.full((theirs,), me + 1, dtype=torch.uint8), nxt, 0, False)
        uneven.wait_signal(prv, False)
        same(uneven.get_tensor(), torch.full((64 + 64 * me,), prv + 1, dtype=torch.uint8), "uneven put")
        if theirs < 64 + 64 * me:
            try:
                uneven.map_remote_tensor(nxt)
            except ValueError as e:
                assert f"registered {theirs} bytes" in str(e), str(e)
            else:
                raise AssertionError("map_remote_tensor of a smaller peer window succeeded")
        elif n > 1:
            assert uneven.map_remote_tensor(nxt).numel() == 64 + 64 * me
        ref.barrier(False)
        uneven.tensor_deregister()
        # The seed's window API on the same windows: words of a signal buffer set and compared,
        # and get_tensor(rank, sizes, dtype, offset).
        seed = ref.window_allocate(64, signal_size=4)
        seed.put(torch.full((8,), float(me + 1), dtype=torch.float64), nxt, 0, False)
        seed.signal(1, 70 + me, nxt, False)
        seed.wait_signal(1, 70 + prv, "EQ", False)
        same(
            seed.get_tensor(me, (8,), torch.float64, 0),
            torch.full((8,), float(prv + 1), dtype=torch.float64),
            "seed put",
        )
        same(
            seed.get_tensor(nxt, (2,), torch.float64, 6),
            torch.full((2,), float(me + 1), dtype=torch.float64),
            "seed get",
        )
        seed.wait_signal(1, 70, "GE", True).wait()
        try:
            seed.wait_signal(2, 1, "EQ", False, timeout=0.2)
        except TimeoutError as e:
            assert "signal word 2 is 0" in str(e), str(e)
        else:
            raise AssertionError("a wait for a signal nobody sets returned")
        for bad in (lambda: seed.signal(4, 1, nxt, False), lambda: seed.wait_signal(0, 1, "ABOUT", False)):
            try:
                bad()
            except ValueError:
                pass
            else:
                raise AssertionError("a signal word out of range, or an unknown comparison, was accepted")
        ref.barrier(False)
        seed.tensor_deregister()

    ctx.check("windows", windows)
    comm.finalize()


# ----------------------------------------------------------------------------------------
# Work semantics on a world of one rank.


def single_rank(ctx):
    import comm_torch

    dist.init_process_group("comm", store=ctx.store(), rank=0, world_size=1)

    def sync_error():
        try:
            dist.all_reduce(torch.ones(2), op=R.BXOR)
        except comm_torch.CommError as e:
            assert e.result_name == "ncclInvalidArgument" and e.call == "ncclAllReduce", (e.result_name, e.call)
        else:
            raise AssertionError("no error")

    ctx.check("sync_error", sync_error)

    def async_error_in_wait():
        w = dist.all_reduce(torch.ones(2), op=R.BXOR, async_op=True)
        try:
            w.wait()
        except comm_torch.CommError as e:
            assert "integer" in str(e), str(e)
        else:
            raise AssertionError("wait() did not raise")

    ctx.check("async_error_in_wait", async_error_in_wait)

    def async_error_in_future():
        # The future fails at the C++ level too, so consumers such as DDP's reducer see it.
        fut = dist.all_reduce(torch.ones(2), op=R.BXOR, async_op=True).get_future()
        chained = fut.then(lambda f: f.value())
        for f in (fut, chained):
            try:
                f.wait()
            except RuntimeError as e:
                assert "integer" in str(e), str(e)
            else:
                raise AssertionError("the future did not fail")

    ctx.check("async_error_in_future", async_error_in_future)

    def future_value():
        x = torch.arange(3.0)
        fut = dist.all_reduce(x, async_op=True).get_future()
        doubled = fut.then(lambda f: f.value()[0] * 2)
        same(doubled.wait(), torch.arange(3.0) * 2, "then")
        same(fut.value()[0], x, "value")

    ctx.check("future_value", future_value)

    def completion_visible():
        w = dist.all_reduce(torch.ones(3), async_op=True)
        w.wait()
        assert w.get_future().done()
        ctx.values["is_completed_after_wait"] = w.is_completed()

    ctx.check("completion_visible", completion_visible)

    def many_in_flight():
        xs = [torch.full((100,), float(i)) for i in range(50)]
        works = [dist.all_reduce(x, async_op=True) for x in xs]
        for w in reversed(works):
            w.wait()
        for i, x in enumerate(xs):
            same(x, torch.full((100,), float(i)), "in flight")

    ctx.check("many_in_flight", many_in_flight)
    dist.destroy_process_group()

    def after_destroy():
        # A new world in the same process works (a fresh communicator, a fresh store key).
        dist.init_process_group("comm", store=dist.HashStore(), rank=0, world_size=1)
        x = torch.ones(2)
        dist.all_reduce(x)
        dist.destroy_process_group()

    ctx.check("reinit", after_destroy)


# ----------------------------------------------------------------------------------------
# CUDA tensors (needs a GPU; several ranks may share one).


def cuda_ops(ctx):
    import comm_torch

    device = torch.device("cuda", ctx.rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    comm, gloo = init_comm(ctx)
    supported = bool(comm_torch.features() & 0x1)
    ctx.values["device_memory"] = supported
    n = ctx.world

    if not supported:

        def refused():
            try:
                dist.all_reduce(torch.ones(4, device=device))
            except RuntimeError as e:
                assert "COMM_FEATURE_DEVICE_MEMORY" in str(e), str(e)
            else:
                raise AssertionError("a CUDA tensor was accepted without device-memory support")

        ctx.check("refused", refused)
        dist.destroy_process_group()
        return

    def compare(fn, *cpu_tensors):
        gpu = [t.to(device) for t in cpu_tensors]
        cpu = [t.clone() for t in cpu_tensors]
        fn(comm, *gpu)
        fn(gloo, *cpu)
        torch.cuda.synchronize()
        same([t.cpu() for t in gpu], cpu, "cuda vs gloo")

    x = data(ctx, (1024,), torch.float32)
    ctx.check("all_reduce", compare, lambda g, t: dist.all_reduce(t, group=g), x)
    ctx.check("broadcast", compare, lambda g, t: dist.broadcast(t, src=0, group=g), x)
    ctx.check(
        "all_gather_into_tensor",
        compare,
        lambda g, o, t: dist.all_gather_into_tensor(o, t, group=g),
        torch.zeros(1024 * n),
        x,
    )

    def async_on_stream():
        t = x.to(device)
        w = dist.all_reduce(t, async_op=True)
        w.wait()  # the current stream waits for the communication stream
        ref = x.clone()
        dist.all_reduce(ref, group=gloo)
        same(t.cpu(), ref, "async cuda")

    ctx.check("async", async_on_stream)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------
# Receives from any source (commRecvAny), through the backend object: torch's own wrapper of
# the work (PyWorkHolder) hides source_rank(), so dist.recv(src=None) cannot report it.


def any_source(ctx):
    init_comm(ctx)
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    per_sender = 4

    def receives_name_their_sender():
        if ctx.rank == 0:
            seen = {r: 0 for r in range(1, ctx.world)}
            for _ in range((ctx.world - 1) * per_sender):
                t = torch.full((1000,), -1, dtype=torch.int64)
                work = backend.recv_anysource([t], 0)
                work.wait()
                src = work.source_rank()
                assert src in seen, f"source {src}"
                # Each sender's messages arrive in its order, each stamped with its rank.
                assert torch.equal(t, torch.full((1000,), 100 * src + seen[src])), (src, t[:3])
                seen[src] += 1
            assert all(n == per_sender for n in seen.values()), seen
        else:
            # All senders at once, synchronous and asynchronous.
            works = [dist.isend(torch.full((1000,), 100 * ctx.rank + k, dtype=torch.int64), 0) for k in range(2)]
            for w in works:
                w.wait()
            for k in range(2, per_sender):
                dist.send(torch.full((1000,), 100 * ctx.rank + k, dtype=torch.int64), 0)
        # A collective afterwards: the communicator is still in step.
        x = torch.ones(3)
        dist.all_reduce(x)
        assert torch.equal(x, torch.full((3,), float(ctx.world)))

    ctx.check("receives_name_their_sender", receives_name_their_sender)
    dist.destroy_process_group()
