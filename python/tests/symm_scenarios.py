"""Scenarios for symmetric memory, windows and one-sided operations (run by rank_main.py as
``symm_scenarios:NAME``). With the argument ``hosts`` the ranks pose as two hosts by parity
(COMM_HOSTID), so neighbours reach each other over TCP instead of shared memory."""

import os
import threading
import time

import torch
import torch.distributed as dist


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
    t = symm_mem.empty(n, dtype=torch.float64)
    hdl = symm_mem.rendezvous(t, dist.group.WORLD)

    def timed(name, fn):
        start = time.monotonic()
        ctx.check(name, fn)
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
        hdl.barrier()
        peer = hdl.get_buffer(nxt, (3, 4), torch.float64)
        assert torch.equal(peer, torch.full((3, 4), nxt + 0.5, dtype=torch.float64)), peer
        hdl.barrier()
        f = comm_torch.allocate_symmetric_memory((2, 3), torch, dtype=torch.float32, axis_order="F")
        assert f.shape == (2, 3) and f.stride() == (1, 2)
        comm_torch.free_symmetric_memory(a, b, f)
        assert not symm_mem.is_symm_mem_tensor(a) and not symm_mem.is_symm_mem_tensor(b)
        expect(ValueError, comm_torch.free_symmetric_memory, a)  # freed already: local error

    ctx.check("equal_shapes", equal_shapes)

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

    ctx.check("unequal_shapes", unequal_shapes)

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

    ctx.check("errors", errors)
    dist.barrier()
    dist.destroy_process_group()
