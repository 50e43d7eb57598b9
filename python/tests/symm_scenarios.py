"""Scenarios for symmetric memory, windows and one-sided operations (run by rank_main.py as
``symm_scenarios:NAME``). With the argument ``hosts`` the ranks pose as two hosts by parity
(COMM_HOSTID), so neighbours reach each other over TCP instead of shared memory."""

import ctypes
import os
import sys
import threading
import time

import torch
import torch.distributed as dist


def run_check(ctx, name, fn):
    """ctx.check, printing a failure at once (a failed check desynchronises the ranks, and the
    log is then all that tells which one failed)."""
    ctx.check(name, fn)
    result = ctx.checks.get(name)
    if result not in (None, "ok"):
        print(f"check {name} failed on rank {ctx.rank}:\n{result}", file=sys.stderr, flush=True)


def init(ctx):
    if "hosts" in ctx.args:
        os.environ["COMM_HOSTID"] = f"symm-host-{ctx.rank % 2}"
    import comm_torch  # noqa: F401

    dist.init_process_group("comm", store=ctx.store(), rank=ctx.rank, world_size=ctx.world)


def symm_mem(ctx):
    init(ctx)
    from comm_torch import CommError, symm_mem

    r, w = ctx.rank, ctx.world
    nxt, prv = (r + 1) % w, (r - 1) % w
    split_hosts = "hosts" in ctx.args
    n = 256
    # Before the first window: 16 channels per window instead of the library's 32.
    pad_bytes = 16 * 4 * w
    symm_mem.set_signal_pad_size(pad_bytes)
    t = symm_mem.empty(n, dtype=torch.float64)
    hdl = symm_mem.rendezvous(t, dist.group.WORLD)

    def timed(name, fn):
        start = time.monotonic()
        run_check(ctx, name, fn)
        ctx.values[f"{name}_s"] = round(time.monotonic() - start, 3)

    def reachable(peer):
        return not split_hosts or peer % 2 == r % 2

    def basics():
        assert hdl.rank == r and hdl.world_size == w
        assert symm_mem.rendezvous(t) is hdl, "rendezvous is cached per allocation and group"
        assert symm_mem.is_symm_mem_tensor(t) and not symm_mem.is_symm_mem_tensor(torch.empty(4))
        assert hdl.buffer_ptrs[r] == t.data_ptr()
        assert hdl.buffer_size >= n * 8
        for peer in range(w):
            assert bool(hdl.buffer_ptrs[peer]) == reachable(peer), (peer, hdl.buffer_ptrs)
            assert bool(hdl.signal_pad_ptrs[peer]) == reachable(peer), (peer, hdl.signal_pad_ptrs)
        assert hdl.signal_pad_size % (4 * w) == 0 and hdl.signal_pad_size >= 8 * 4 * w

    timed("basics", basics)

    def pads_zero(channels):
        for peer in range(w):
            if not reachable(peer):
                continue
            pad = hdl.get_signal_pad(peer)
            assert pad.dtype == torch.uint32 and pad.numel() == hdl.signal_pad_size // 4
            words = pad[: max(channels) * w + w].to(torch.int64)
            for ch in channels:
                got = words[ch * w : ch * w + w]
                assert int(got.abs().sum()) == 0, f"rank {peer}'s pad, channel {ch}: {got.tolist()}"

    def peer_fills():
        # The seeds' example: a peer fills our buffer through get_buffer, then signals.
        t.fill_(-1)
        hdl.barrier(channel=0)
        if reachable(nxt):
            peer = hdl.get_buffer(nxt, (n,), torch.float64)
            peer.copy_(torch.arange(n, dtype=torch.float64) + 1000 * r)
        hdl.put_signal(nxt, channel=1)
        hdl.wait_signal(prv, channel=1)
        if reachable(prv):
            assert torch.equal(t, torch.arange(n, dtype=torch.float64) + 1000 * prv), t[:4]
        else:
            assert torch.equal(t, torch.full((n,), -1.0, dtype=torch.float64))
        hdl.barrier(channel=2)
        pads_zero([0, 1])
        hdl.barrier(channel=2)

    timed("peer_fills", peer_fills)

    def storage_offset_view():
        if not reachable(nxt):
            return
        view = hdl.get_buffer(nxt, (4, 2), torch.float64, storage_offset=8)
        ints = hdl.get_buffer(nxt, (n * 2,), torch.int32)
        assert view.data_ptr() == hdl.buffer_ptrs[nxt] + 64
        assert ints.data_ptr() == hdl.buffer_ptrs[nxt]
        try:
            hdl.get_buffer(nxt, (n + 1,), torch.float64)
        except ValueError:
            pass
        else:
            raise AssertionError("a view past the end of the buffer was accepted")
        try:
            hdl.put_signal(nxt, channel=hdl.signal_pad_size // 4 // w)
        except ValueError:
            pass
        else:
            raise AssertionError("a channel past the signal pad was accepted")

    timed("storage_offset_view", storage_offset_view)

    def two_threads():
        # Two threads, each on its own pair of channels, ping-pong around the ring at once.
        rounds = 60
        errors = []

        def worker(slot, data_ch, ack_ch):
            try:
                base = slot * 64
                mine = t[base : base + 64]
                for i in range(rounds):
                    value = float(r * 10_000 + slot * 1000 + i)
                    if reachable(nxt):
                        hdl.get_buffer(nxt, (64,), torch.float64, base).fill_(value)
                    hdl.put_signal(nxt, data_ch)
                    hdl.wait_signal(prv, data_ch)
                    if reachable(prv):
                        want = float(prv * 10_000 + slot * 1000 + i)
                        assert bool((mine == want).all()), (slot, i, mine[:2].tolist(), want)
                    hdl.put_signal(prv, ack_ch)
                    hdl.wait_signal(nxt, ack_ch)
            except BaseException as err:  # noqa: BLE001  reported by the main thread
                errors.append(err)

        threads = [threading.Thread(target=worker, args=(s, 3 + 2 * s, 4 + 2 * s)) for s in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not any(th.is_alive() for th in threads), "a channel thread hung"
        if errors:
            raise errors[0]
        hdl.barrier(channel=2)
        pads_zero([0, 1, 3, 4, 5, 6])
        hdl.barrier(channel=2)

    timed("two_threads", two_threads)

    def wait_timeout():
        start = time.monotonic()
        try:
            hdl.wait_signal(nxt, channel=7, timeout_ms=300)
        except CommError as err:
            assert err.result_name == "ncclTimeout", err
        else:
            raise AssertionError("wait_signal returned although nobody signalled")
        took = time.monotonic() - start
        assert 0.25 <= took < 20, took
        hdl.barrier(channel=2)
        pads_zero([0, 1, 7])
        hdl.barrier(channel=2)
        # Still usable afterwards.
        hdl.barrier(channel=7)

    timed("wait_timeout", wait_timeout)

    def module_functions():
        assert symm_mem.get_backend("cpu") == "COMM" and symm_mem.get_backend("meta") is None
        symm_mem.set_backend("COMM")
        expect(RuntimeError, symm_mem.set_backend, "NVSHMEM")
        assert symm_mem.is_nvshmem_available() is False
        expect(RuntimeError, symm_mem.get_mem_pool, "cpu")
        expect(RuntimeError, symm_mem.get_mempool_allocator, torch.device("cpu"))
        assert hdl.signal_pad_size == pad_bytes == symm_mem.get_signal_pad_size(), hdl.signal_pad_size
        symm_mem.set_signal_pad_size(pad_bytes)  # unchanged: allowed
        expect(RuntimeError, symm_mem.set_signal_pad_size, 2 * pad_bytes)  # after the first window
        assert hdl.boxed() is hdl

    timed("module_functions", module_functions)

    def ptrs_dev():
        # Host arrays of world_size 64-bit addresses, the same as buffer_ptrs / signal_pad_ptrs.
        bufs = (ctypes.c_uint64 * w).from_address(hdl.buffer_ptrs_dev)
        pads = (ctypes.c_uint64 * w).from_address(hdl.signal_pad_ptrs_dev)
        assert list(bufs) == hdl.buffer_ptrs and list(pads) == hdl.signal_pad_ptrs, (list(bufs), hdl.buffer_ptrs)
        t[0] = 1.5 * r + 1
        hdl.barrier(channel=0)
        if reachable(nxt):
            assert ctypes.c_double.from_address(bufs[nxt]).value == 1.5 * nxt + 1
        hdl.barrier(channel=0)

    timed("ptrs_dev", ptrs_dev)

    def one_sided():
        # symm_mem.get reads a peer's allocation (in place or over the network), put_signal
        # writes one and counts a signal that wait_signal consumes.
        t.copy_(torch.arange(n, dtype=torch.float64) + 1000 * r)
        hdl.barrier(channel=0)
        dst = torch.zeros(16, dtype=torch.float64)
        symm_mem.get(dst, hdl, nxt, offset=8)
        assert torch.equal(dst, torch.arange(8, 24, dtype=torch.float64) + 1000 * nxt), dst
        symm_mem.get(dst[:4], hdl, prv)
        assert torch.equal(dst[:4], torch.arange(4, dtype=torch.float64) + 1000 * prv), dst
        expect(ValueError, symm_mem.get, dst, hdl, w)
        expect(ValueError, symm_mem.get, dst, hdl, nxt, n - 8)
        expect(ValueError, symm_mem.get, dst, hdl, nxt, -1)
        expect(ValueError, symm_mem.get, torch.zeros(4, 4, dtype=torch.float64).t(), hdl, nxt)
        expect(ValueError, symm_mem.put_signal, torch.zeros(n + 1, dtype=torch.float64), hdl, nxt)
        hdl.barrier(channel=0)
        for i in range(3):
            symm_mem.put_signal(torch.full((n // 2,), float(i * 100 + r), dtype=torch.float64), hdl, nxt)
            symm_mem.wait_signal(hdl, prv)
            got = t[: n // 2]
            assert bool((got == i * 100 + prv).all()), (i, got[:4].tolist())
            hdl.barrier(channel=0)  # nobody puts round i + 1 before round i was checked
        assert torch.equal(t[n // 2 :], torch.arange(n // 2, n, dtype=torch.float64) + 1000 * r)

    timed("one_sided", one_sided)

    def unequal_sizes():
        # As PyTorch's rendezvous, allocations that differ in size between ranks are refused,
        # on every rank (get_buffer over a smaller peer's memory used to crash).
        u = symm_mem.empty(64 + 32 * r, dtype=torch.float32)
        err = expect(RuntimeError, symm_mem.rendezvous, u, dist.group.WORLD)
        assert "differ in size" in str(err) and f"rank {w - 1}: {4 * (64 + 32 * (w - 1))} bytes" in str(err), str(err)

    if w > 1:
        run_check(ctx, "unequal_sizes", unequal_sizes)
    ctx.values["buffer_ptrs_nonzero"] = sum(1 for p in hdl.buffer_ptrs if p)
    dist.barrier()
    dist.destroy_process_group()


def expect(exc, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except exc as err:
        return err
    raise AssertionError(f"{fn.__name__} did not raise {exc.__name__}")


def symmetric_alloc(ctx):
    init(ctx)
    import comm_torch
    from comm_torch import symm_mem

    r, w = ctx.rank, ctx.world
    nxt = (r + 1) % w

    def equal_shapes():
        a = comm_torch.allocate_symmetric_memory((3, 4), torch, dtype=torch.float64)
        b = comm_torch.allocate_symmetric_memory(5, torch, dtype=torch.int32)
        assert a.shape == (3, 4) and a.dtype == torch.float64 and a.is_contiguous()
        assert b.shape == (5,) and b.dtype == torch.int32
        assert symm_mem.is_symm_mem_tensor(a) and symm_mem.is_symm_mem_tensor(b)
        a.fill_(r + 0.5)
        hdl = symm_mem.rendezvous(a)
        assert hdl.buffer_size == 3 * 4 * 8
        # No set_signal_pad_size in this scenario: the library's channels per window (32 unless
        # COMM_WIN_CHANNELS says otherwise).
        assert hdl.signal_pad_size == symm_mem.get_signal_pad_size(), hdl.signal_pad_size
        if not os.environ.get("COMM_WIN_CHANNELS") and not os.environ.get("NCCL_WIN_CHANNELS"):
            assert hdl.signal_pad_size == 32 * 4 * w, hdl.signal_pad_size
        hdl.barrier()
        peer = hdl.get_buffer(nxt, (3, 4), torch.float64)
        assert torch.equal(peer, torch.full((3, 4), nxt + 0.5, dtype=torch.float64)), peer
        hdl.barrier()
        f = comm_torch.allocate_symmetric_memory((2, 3), torch, dtype=torch.float32, axis_order="F")
        assert f.shape == (2, 3) and f.stride() == (1, 2)
        comm_torch.free_symmetric_memory(a, b, f)
        assert not symm_mem.is_symm_mem_tensor(a) and not symm_mem.is_symm_mem_tensor(b)
        expect(ValueError, comm_torch.free_symmetric_memory, a)  # freed already: local error

    run_check(ctx, "equal_shapes", equal_shapes)

    def unequal_shapes():
        err = expect(ValueError, comm_torch.allocate_symmetric_memory, (r + 1, 2), torch, dtype=torch.float64)
        assert "make_symmetric" in str(err), err
        a = comm_torch.allocate_symmetric_memory((r + 1, 2), torch, dtype=torch.float64, make_symmetric=True)
        assert a.shape == (r + 1, 2)
        hdl = symm_mem.rendezvous(a)
        assert hdl.buffer_size == w * 2 * 8, hdl.buffer_size  # the largest rank's size
        # Every rank may address the largest rank's extent of a peer's buffer.
        a.fill_(float(r))
        hdl.barrier()
        whole = hdl.get_buffer(nxt, (w * 2,), torch.float64)
        assert torch.equal(whole[: (nxt + 1) * 2], torch.full(((nxt + 1) * 2,), float(nxt), dtype=torch.float64))
        hdl.barrier()
        comm_torch.free_symmetric_memory(a)

    run_check(ctx, "unequal_shapes", unequal_shapes)

    def errors():
        expect(TypeError, comm_torch.allocate_symmetric_memory, (2,), os)
        expect(
            ValueError,
            comm_torch.allocate_symmetric_memory,
            (2,),
            torch,
            make_symmetric=True,
            skip_symmetric_check=True,
        )
        expect(ValueError, comm_torch.free_symmetric_memory, torch.empty(3))
        expect(TypeError, comm_torch.free_symmetric_memory, [1])
        a = comm_torch.allocate_symmetric_memory((4,), torch)
        b = comm_torch.allocate_symmetric_memory((4,), torch)
        # Different numbers of tensors on the ranks: an error on every rank, nothing freed.
        if r == 0:
            expect(ValueError, comm_torch.free_symmetric_memory, a)
        else:
            expect(ValueError, comm_torch.free_symmetric_memory, a, b)
        assert symm_mem.is_symm_mem_tensor(a) and symm_mem.is_symm_mem_tensor(b)
        comm_torch.free_symmetric_memory(a, b)
        # The group is still usable.
        t = torch.ones(3)
        dist.all_reduce(t)
        assert torch.equal(t, torch.full((3,), float(w)))

    run_check(ctx, "errors", errors)
    dist.barrier()
    dist.destroy_process_group()


def rdma(ctx):
    init(ctx)
    import asyncio

    from comm_torch.rdma import RDMABuffer

    r, w = ctx.rank, ctx.world
    nxt, prv = (r + 1) % w, (r - 1) % w
    total = int(ctx.args[-1]) if ctx.args and ctx.args[-1].isdigit() else 100_000

    def reads_writes():
        mine = torch.arange(64, dtype=torch.float32) + 100 * r
        buf = RDMABuffer(mine)
        assert buf.size() == 256 and buf.owner == r and buf.on(nxt).owner == nxt
        got = torch.zeros(80, dtype=torch.float32)
        assert buf.on(nxt).read_into(got).get() is None
        assert torch.equal(got[:64], torch.arange(64, dtype=torch.float32) + 100 * nxt), got[:4]
        dist.barrier()
        # Write the next rank's buffer; awaited this time.
        src = torch.full((32,), float(-r - 1), dtype=torch.float32)
        asyncio.run(_await(buf.on(nxt).write_from(src)))
        dist.barrier()
        assert torch.equal(mine[:32], torch.full((32,), float(-prv - 1))), mine[:4]
        assert torch.equal(mine[32:], torch.arange(32, 64, dtype=torch.float32) + 100 * r)
        # A memoryview works as well.
        view = memoryview(bytearray(256))
        buf.on(prv).read_into(view).get()
        assert torch.equal(torch.frombuffer(view, dtype=torch.float32)[32:], torch.arange(32, 64) + 100.0 * prv)
        dist.barrier()

    run_check(ctx, "reads_writes", reads_writes)

    def fetch_adds():
        counter = torch.zeros(2, dtype=torch.int64)
        buf = RDMABuffer(counter).on(0)
        share = total // w + (1 if r < total % w else 0)
        olds = torch.zeros(share, 1, dtype=torch.int64)
        futures = [buf.fetch_add(olds[i], 1, offset=8) for i in range(share)]
        results = [f.get(120) for f in futures]
        assert results == olds[:, 0].tolist()
        dist.barrier()
        if r == 0:
            assert int(counter[1]) == total and int(counter[0]) == 0, counter
        # Every old value from 0 to total-1 was seen exactly once across the ranks.
        sizes = [total // w + (1 if q < total % w else 0) for q in range(w)]
        gathered = [torch.zeros(s, dtype=torch.int64) for s in sizes]
        _gather_uneven(gathered, olds[:, 0].contiguous())
        seen = torch.sort(torch.cat(gathered)).values
        assert torch.equal(seen, torch.arange(total)), seen[:8]

    run_check(ctx, "fetch_adds", fetch_adds)

    def cas_lock():
        rounds = 30
        state = torch.zeros(2, dtype=torch.int64)  # [lock, counter] on rank 0
        buf = RDMABuffer(state).on(0)
        old = torch.zeros(1, dtype=torch.int64)
        local = torch.zeros(2, dtype=torch.int64)
        for _ in range(rounds):
            while buf.compare_and_swap(old, 0, r + 1).get(30) != 0:
                time.sleep(0.0005)
            assert int(old[0]) == 0
            buf.read_into(local).get()
            assert int(local[0]) == r + 1, local
            local[1] += 1
            buf.write_from(local).get()  # the counter, unprotected but for the lock
            assert buf.compare_and_swap(old, r + 1, 0).get() == r + 1
        dist.barrier()
        if r == 0:
            assert state.tolist() == [0, rounds * w], state

    run_check(ctx, "cas_lock", cas_lock)

    def validation():
        for bad in (torch.zeros(4, 4), torch.zeros(8)[::2], torch.zeros(0)):
            expect(ValueError, RDMABuffer, bad)
        buf = RDMABuffer(torch.zeros(16, dtype=torch.uint8))
        peer = buf.on(nxt)
        expect(ValueError, peer.read_into, torch.zeros(15, dtype=torch.uint8))
        expect(ValueError, peer.read_into, torch.zeros(32, dtype=torch.uint8)[::2])
        expect(ValueError, peer.write_from, torch.zeros(17, dtype=torch.uint8))
        expect(ValueError, peer.fetch_add, torch.zeros(4, dtype=torch.uint8), 1)
        expect(ValueError, peer.fetch_add, torch.zeros(1, dtype=torch.int64), 1, offset=4)
        expect(ValueError, peer.compare_and_swap, torch.zeros(1, dtype=torch.int64), 0, 1, offset=16)
        expect(ValueError, buf.on, w)
        dist.barrier()

    run_check(ctx, "validation", validation)
    dist.barrier()
    dist.destroy_process_group()


async def _await(fut):
    return await fut


def _gather_uneven(outputs, mine):
    # all_gather of tensors of different lengths: pad to the longest.
    longest = max(o.numel() for o in outputs)
    padded = torch.full((longest,), -1, dtype=mine.dtype)
    padded[: mine.numel()] = mine
    bufs = [torch.empty(longest, dtype=mine.dtype) for _ in outputs]
    dist.all_gather(bufs, padded)
    for out, b in zip(outputs, bufs):
        out.copy_(b[: out.numel()])


def all_gather_matmul(ctx):
    init(ctx)
    from comm_torch.fused import all_gather_matmul as fused

    r, w = ctx.rank, ctx.world
    b = torch.randn(48, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(7))

    def reference(shard):
        parts = [torch.empty_like(shard) for _ in range(w)]
        dist.all_gather(parts, shard)
        full = torch.cat(parts)
        return full, full @ b

    def matches():
        for salt in range(3):  # the workspace is reused from the second call on
            shard = torch.randn(32, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(100 * r + salt))
            a, out = fused(shard, b)
            ref_a, ref_out = reference(shard)
            assert torch.equal(a, ref_a), "the gathered A differs"
            rel = float((out - ref_out).norm() / ref_out.norm())
            assert rel < 1e-12, rel
            ctx.values[f"rel_err_{salt}"] = rel

    run_check(ctx, "matches", matches)

    def back_to_back():
        # Calls with no other collective between them: a rank overwrites its workspace only
        # after every peer released the previous chunk, even when one rank lags. Every other
        # call writes the shard into the workspace itself (shard_workspace, no copy).
        from comm_torch.fused import shard_workspace

        calls = 12
        shards = [
            torch.randn(16, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(1000 * r + i))
            for i in range(calls)
        ]
        outs = []
        for i, shard in enumerate(shards):
            if r == w - 1 and i % 3 == 0:
                time.sleep(0.02)  # the others run ahead into the next call
            if i % 2:
                ws = shard_workspace(shard.shape, shard.dtype)
                ws.copy_(shard)
                outs.append(fused(ws, b))
            else:
                outs.append(fused(shard, b))
        for i, shard in enumerate(shards):
            ref_a, ref_out = reference(shard)
            assert torch.equal(outs[i][0], ref_a), f"call {i}: the gathered A differs"
            rel = float((outs[i][1] - ref_out).norm() / ref_out.norm())
            assert rel < 1e-12, (i, rel)

    run_check(ctx, "back_to_back", back_to_back)

    def bench():
        torch.set_num_threads(1)  # one rank per core: more intra-op threads oversubscribe them
        shard = torch.randn(256, 512, dtype=torch.float64, generator=torch.Generator().manual_seed(r))
        bb = torch.randn(512, 256, dtype=torch.float64)
        dist.broadcast(bb, 0)
        iters = 10

        def timed(fn):
            fn()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            dist.barrier()
            return (time.perf_counter() - start) / iters

        def base():
            parts = [torch.empty_like(shard) for _ in range(w)]
            dist.all_gather(parts, shard)
            return torch.cat(parts) @ bb

        ctx.values["fused_s"] = timed(lambda: fused(shard, bb, return_a=False))
        ctx.values["all_gather_then_matmul_s"] = timed(base)
        _, out = fused(shard, bb, return_a=False)
        rel = float((out - base()).norm() / base().norm())
        assert rel < 1e-12, rel

    run_check(ctx, "bench", bench)
    dist.barrier()
    dist.destroy_process_group()
