"""The operations of an Engine: torch's collectives and point-to-point calls.

Most of them make one library call on one or two dense buffers; those are entries of
``_CALLS`` (which call, on which buffers, whether it reduces, whether it names a rank, when a
staged output is copied back), run by ``Collectives._call``. The others are compositions:
lists packed into one buffer around one call (``Engine._wrapped``), or several calls in one
library group (``Engine.group``). Every operation returns a CommWork whose future yields
``result``. ``Collectives`` is a mixin of ``Engine`` (``_engine.py``), which supplies the
communicator, ``_issue`` and the rest.
"""

from __future__ import annotations

import ctypes
import time
from typing import Callable, NamedTuple

import torch

from . import _lib
from ._lib import CommError
from ._types import _DTYPES, _OPS, SUM
from ._work import DONE, CommWork, _deferred, completed_work

_byref = ctypes.byref


def _pack(tensors, flat):
    """Copies ``tensors`` one after another into the 1-d scratch buffer ``flat``. Detached:
    autograd refuses ``cat(out=...)`` of inputs that require grad, and packing is this
    library's own step, of which gloo has no autograd-visible counterpart."""
    if tensors:
        torch.cat([t.detach().reshape(-1) for t in tensors], out=flat)


def _unpack(flat, tensors):
    """Copies consecutive pieces of ``flat`` into ``tensors``, in list order."""
    off = 0
    for t in tensors:
        t.copy_(flat[off : off + t.numel()].view(t.shape))
        off += t.numel()


def _same_kind(tensors, what):
    """The rule of gloo for the tensors of one rank in one call: one layout, dtype, device and
    shape (RuntimeError naming the first that differs)."""
    first = tensors[0]
    for i, t in enumerate(tensors):
        if t.layout != first.layout:
            raise RuntimeError(
                f"comm: {what}: invalid tensor layout at index {i} (expected {first.layout}, got {t.layout})"
            )
        if t.dtype != first.dtype or t.device != first.device:
            raise RuntimeError(
                f"comm: {what}: invalid tensor type at index {i} (expected {first.dtype} on {first.device}, "
                f"got {t.dtype} on {t.device})"
            )
        if t.shape != first.shape:
            raise RuntimeError(
                f"comm: {what}: invalid tensor size at index {i} (expected {tuple(first.shape)}, got {tuple(t.shape)})"
            )


# How several tensors of one rank combine before the all-reduce (all_reduce_joint). AVG and
# PREMUL_SUM are linear, so the tensors add up first and the op applies once, across ranks;
# gloo divides an AVG by the number of ranks only, and so does this.
_FOLDS = {
    "sum": lambda acc, t: acc.add_(t),
    "avg": lambda acc, t: acc.add_(t),
    "premul_sum": lambda acc, t: acc.add_(t),
    "product": lambda acc, t: acc.mul_(t),
    "min": lambda acc, t: torch.minimum(acc, t, out=acc),
    "max": lambda acc, t: torch.maximum(acc, t, out=acc),
    "band": lambda acc, t: acc.bitwise_and_(t),
    "bor": lambda acc, t: acc.bitwise_or_(t),
    "bxor": lambda acc, t: acc.bitwise_xor_(t),
}


class _Call(NamedTuple):
    """A library call on dense buffers: ``call(<buffers>, count, datatype, [op], [rank], comm,
    stream)``."""

    name: str  # the libcomm entry point
    # "in_place": (buf, buf), "pair": (input, output), "send": (input,), "recv": (output,)
    buffers: str
    reduces: bool  # takes a reduction op after the datatype (the count is then the output's)
    rank: str | None  # what the rank argument is, for the range check; None: it takes none
    back: Callable[[int, int | None], bool]  # (this rank, the rank argument): copy a staged output back?


def _always(_rank, _peer):
    return True


_CALLS = {
    "all_reduce": _Call("ncclAllReduce", "in_place", True, None, _always),
    "broadcast": _Call("ncclBroadcast", "in_place", False, "root", lambda rank, root: rank != root),
    "reduce": _Call("ncclReduce", "in_place", True, "root", lambda rank, root: rank == root),
    "all_gather_single": _Call("ncclAllGather", "pair", False, None, _always),
    "reduce_scatter_single": _Call("ncclReduceScatter", "pair", True, None, _always),
    "send": _Call("ncclSend", "send", False, "destination rank", lambda _rank, _peer: False),
    "recv": _Call("ncclRecv", "recv", False, "source rank", _always),
}


class Collectives:
    """The operations; see the module docstring."""

    def _call(self, what, output, input=None, op=None, rank=None, async_op=False, result=None):
        """Runs entry ``what`` of _CALLS: ``output`` (for "send", None) and ``input`` (for
        "in_place" and "recv", None) staged to dense buffers, viewed as real numbers for a
        reduction of complex ones, and the call made on them."""
        spec = _CALLS[what]
        if spec.rank is not None:
            self._peer(rank, spec.rank)
        out, staged = (None, False) if output is None else self._dense(output)
        inp = out if input is None else self._dense(input)[0]
        out = inp if out is None else out
        cleanup = opcode = None
        if spec.reduces:
            opcode, cleanup, as_real, code = self._reducer(out.dtype, op)
            inv = torch.view_as_real(inp) if as_real else inp
            outv = torch.view_as_real(out) if as_real else out
            count = outv.numel()
        else:
            inv, outv = inp, out
            code, count = self._movable(inp)
        buffers = {
            "in_place": (outv.data_ptr(), outv.data_ptr()),
            "pair": (inv.data_ptr(), outv.data_ptr()),
            "send": (inv.data_ptr(),),
            "recv": (outv.data_ptr(),),
        }[spec.buffers]
        tail = () if spec.rank is None else (rank,)
        if opcode is None:
            args = (*buffers, count, code, *tail)
        else:

            def args():
                return (*buffers, count, code, opcode(), *tail)

        finish = self._copy_back(staged and spec.back(self.rank, rank), output, out)
        return self._issue(
            spec.name,
            args,
            [t for t in (output, input) if t is not None],
            finish,
            cleanup,
            result,
            async_op,
            keep=(inp, out, inv, outv),
            p2p=spec.buffers in ("send", "recv"),
        )

    def all_reduce(self, tensor, op=SUM, async_op=False, result=None):
        if (
            not async_op
            and self._coalescing is None
            and not self._p2p
            and not self._anys
            and not getattr(_deferred, "engines", None)
            and tensor.is_cpu
            and tensor.is_contiguous()
        ):
            # The common synchronous case in as few Python steps as possible: small
            # all-reduces are bound by this overhead, not by the library.
            code, opcode = _DTYPES.get(tensor.dtype), _OPS.get(op.kind)
            if code is not None and opcode is not None and self.executor.enter_inline():
                try:
                    ptr = tensor.data_ptr()
                    r = self._all_reduce(ptr, ptr, tensor.numel(), code, opcode, self.handle, None)
                finally:
                    self.executor.exit_inline()
                if r:
                    self.lib.check(r, "ncclAllReduce", self.handle)
                return DONE if result is None else CommWork(result, done=True)
        return self._call("all_reduce", tensor, None, op, None, async_op, result)

    def sparse_all_reduce(self, tensor, op=SUM, async_op=False, result=None):
        """All-reduce of a sparse COO tensor, the way gloo does it: every rank's indices and
        values are gathered, then coalescing sums the entries that share an index. Only SUM
        is defined on sparse tensors (gloo refuses the others too). The result replaces the
        tensor's contents. It runs before returning, so the work is already complete."""
        if tensor.layout != torch.sparse_coo:
            raise RuntimeError(f"comm: sparse all_reduce takes sparse COO tensors, got layout {tensor.layout}")
        if op.kind != "sum":
            raise RuntimeError(f"comm: sparse all_reduce supports ReduceOp.SUM only, got {op.kind}")
        self.flush_p2p()
        local = tensor.coalesce()
        # (nnz, sparse_dim) and (nnz, *dense dims): the entries are rows, gathered by rows.
        indices = local.indices().t().contiguous()
        values = local.values().contiguous()
        counts = torch.empty(self.size, dtype=torch.int64)
        self.all_gather_single(counts, torch.tensor([indices.shape[0]], dtype=torch.int64)).wait()
        counts = counts.tolist()
        most = max(counts)

        def gather_rows(rows):
            # Every rank contributes ``most`` rows (padding after its own), so one all-gather does.
            padded = rows.new_zeros((most,) + tuple(rows.shape[1:]))
            padded[: rows.shape[0]] = rows
            out = rows.new_empty((self.size * most,) + tuple(rows.shape[1:]))
            self.all_gather_single(out, padded).wait()
            return torch.cat([out[r * most : r * most + counts[r]] for r in range(self.size)])

        if most:
            summed = torch.sparse_coo_tensor(
                gather_rows(indices).t(), gather_rows(values), tensor.shape, dtype=tensor.dtype
            ).coalesce()
        else:
            summed = torch.sparse_coo_tensor(indices.t(), values, tensor.shape, dtype=tensor.dtype).coalesce()
        tensor.copy_(summed)
        return completed_work([tensor] if result is None else result)

    def all_reduce_coalesced(self, tensors, op=SUM, async_op=False, result=None):
        """Several tensors reduced the way gloo does it: packed into one buffer (one per dtype
        and device), each buffer all-reduced once, the results copied back in list order. A
        tensor listed twice, or views that overlap, are so reduced once, as with gloo; a group
        of in-place all-reduces reduced an aliased tensor once per appearance."""
        for i, t in enumerate(tensors):
            if t.layout != torch.strided:
                raise RuntimeError(f"comm: all_reduce_coalesced takes dense tensors; tensor {i} is {t.layout}")
        if len(tensors) == 1:
            return self.all_reduce(tensors[0], op, async_op, result)
        kinds = {}
        for t in tensors:
            kinds.setdefault((t.dtype, t.device), []).append(t)

        def build():
            for (dtype, device), members in kinds.items():
                flat = torch.empty((sum(t.numel() for t in members),), dtype=dtype, device=device)
                self._wrapped(
                    lambda flat=flat: self.all_reduce(flat, op),
                    lambda flat=flat, members=members: _pack(members, flat),
                    lambda flat=flat, members=members: _unpack(flat, members),
                )

        return self.group(build, tensors if result is None else result, async_op)

    def all_reduce_joint(self, tensors, op=SUM, async_op=False, result=None):
        """Several tensors of one shape and dtype on each rank (one per device, in the
        ProcessGroup API's old multi-device form), reduced jointly as gloo does: all of them,
        on every rank, into one result that every tensor receives. Dense tensors are folded
        into one buffer first and that is all-reduced; sparse ones are summed, then reduced as
        one (see sparse_all_reduce)."""
        _same_kind(tensors, "all_reduce")
        if tensors[0].layout == torch.sparse_coo:
            if op.kind != "sum":
                raise RuntimeError(f"comm: sparse all_reduce supports ReduceOp.SUM only, got {op.kind}")
            with torch.no_grad():
                total = tensors[0].clone()
                for t in tensors[1:]:
                    total = total + t
                self.sparse_all_reduce(total, op)
                for t in tensors:
                    t.copy_(total)
            return completed_work(tensors if result is None else result)
        fold = _FOLDS.get(op.kind)
        if fold is None:
            raise RuntimeError(f"comm: all_reduce of several tensors per rank does not support {op.kind}")
        acc = torch.empty(tensors[0].shape, dtype=tensors[0].dtype, device=tensors[0].device)

        # Detached: gloo folds and writes these tensors in C++, where autograd sees nothing
        # (its leaves that require grad take the result, for one).
        def before():
            acc.copy_(tensors[0].detach())
            for t in tensors[1:]:
                fold(acc, t.detach())

        def after():
            for t in tensors:
                t.detach().copy_(acc)

        return self._wrapped(
            lambda: self.all_reduce(acc, op), before, after, tensors if result is None else result, async_op
        )

    def broadcast(self, tensor, root, async_op=False, result=None):
        return self._call("broadcast", tensor, None, None, root, async_op, result)

    def broadcast_joint(self, tensors, root, root_tensor=0, async_op=False, result=None):
        """Several tensors per rank (the multi-device form): tensor ``root_tensor`` of the
        root reaches every tensor of every rank, as with gloo."""
        _same_kind(tensors, "broadcast")
        if not 0 <= root_tensor < len(tensors):
            raise RuntimeError(f"comm: broadcast: invalid root tensor: {root_tensor} (a list of {len(tensors)})")
        result = tensors if result is None else result
        if len(tensors) == 1:
            return self.broadcast(tensors[0], root, async_op, result)
        source = tensors[root_tensor]

        def after():
            for i, t in enumerate(tensors):
                if i != root_tensor:
                    t.copy_(source)

        return self._wrapped(lambda: self.broadcast(source, root), None, after, result, async_op)

    def reduce(self, tensor, root, op=SUM, async_op=False, result=None):
        return self._call("reduce", tensor, None, op, root, async_op, result)

    def all_gather_single(self, output, input, async_op=False, result=None):
        if output.numel() != input.numel() * self.size or output.dtype != input.dtype:
            raise RuntimeError(
                f"comm: all_gather output must hold {self.size} x {input.numel()} elements of "
                f"{input.dtype}, got {output.numel()} of {output.dtype}"
            )
        return self._call("all_gather_single", output, input, None, None, async_op, result)

    def all_gather(self, outputs, input, async_op=False, result=None):
        """Into a list of tensors: one ncclAllGather into a flat buffer, copied out; tensors
        of different sizes take a group of broadcasts instead."""
        n = self.size
        if len(outputs) != n:
            raise RuntimeError(f"comm: all_gather needs {n} output tensors, got {len(outputs)}")
        for o in outputs:
            if o.dtype != input.dtype:
                raise RuntimeError(f"comm: all_gather output dtype {o.dtype} differs from the input's {input.dtype}")
        result = outputs if result is None else result
        numel = input.numel()
        if all(o.numel() == numel for o in outputs):
            flat = torch.empty((n * numel,), dtype=input.dtype, device=input.device)
            src = input.reshape(-1) if input.is_contiguous() else input

            def after():
                parts = flat.view(n, numel)
                for i, o in enumerate(outputs):
                    o.copy_(parts[i].view(o.shape))

            return self._wrapped(lambda: self.all_gather_single(flat, src), None, after, result, async_op)
        if outputs[self.rank].numel() != numel:
            raise RuntimeError("comm: all_gather output for this rank must match the input's size")

        # This rank broadcasts from a dense buffer it fills when the group runs, then copies
        # into its own output: broadcasting from that output took a staged copy of a
        # non-contiguous one before the input was copied in, and sent zeros.
        mine = torch.empty(input.shape, dtype=input.dtype, device=input.device)

        def build():
            for i, o in enumerate(outputs):
                if i == self.rank:
                    self._wrapped(
                        lambda i=i: self.broadcast(mine, i),
                        before=lambda: mine.copy_(input),
                        after=lambda o=o: o.copy_(mine.reshape(o.shape)),
                    )
                else:
                    self.broadcast(o, i)

        return self.group(build, result, async_op)

    def all_gather_joint(self, output_lists, inputs, async_op=False, result=None):
        """Several inputs per rank (the multi-device form), as gloo gathers them: every output
        list receives, for each rank in order, each of that rank's inputs in order."""
        k, n = len(inputs), self.size
        _same_kind(inputs, "all_gather")
        if len(output_lists) != k:
            raise RuntimeError(
                f"comm: all_gather: requires input/output tensor lists to have the same length "
                f"({k} inputs, {len(output_lists)} output lists)"
            )
        if k == 1:
            return self.all_gather(output_lists[0], inputs[0], async_op, result)
        numel, dtype = inputs[0].numel(), inputs[0].dtype
        for i, outs in enumerate(output_lists):
            if len(outs) != k * n:
                raise RuntimeError(
                    f"comm: all_gather: invalid output tensor list at index {i} (expected length {k * n}, got {len(outs)})"
                )
            for j, o in enumerate(outs):
                if o.dtype != dtype or o.numel() != numel:
                    raise RuntimeError(
                        f"comm: all_gather: output {j} of list {i} is {o.numel()} elements of {o.dtype}; with several "
                        f"inputs per rank every output must match the inputs ({numel} of {dtype})"
                    )
        send = torch.empty((k * numel,), dtype=dtype, device=inputs[0].device)
        recv = torch.empty((n * k * numel,), dtype=dtype, device=inputs[0].device)

        def after():
            for outs in output_lists:
                _unpack(recv, outs)

        return self._wrapped(
            lambda: self.all_gather_single(recv, send),
            lambda: _pack(inputs, send),
            after,
            output_lists if result is None else result,
            async_op,
        )

    def all_gather_coalesced(self, output_lists, inputs, async_op=False, result=None):
        """``output_lists[r][j]`` receives input ``j`` of rank ``r`` (torch's layout)."""
        if len(output_lists) != self.size or any(len(outs) != len(inputs) for outs in output_lists):
            raise RuntimeError(f"comm: all_gather_coalesced needs {self.size} output lists of {len(inputs)} tensors")

        def build():
            for j, inp in enumerate(inputs):
                self.all_gather([outs[j] for outs in output_lists], inp)

        return self.group(build, output_lists if result is None else result, async_op)

    def all_gather_single_coalesced(self, outputs, inputs, async_op=False, result=None):
        def build():
            for out, inp in zip(outputs, inputs):
                self.all_gather_single(out, inp)

        return self.group(build, outputs if result is None else result, async_op)

    def reduce_scatter_single(self, output, input, op=SUM, async_op=False, result=None):
        if input.numel() != output.numel() * self.size or output.dtype != input.dtype:
            raise RuntimeError(
                f"comm: reduce_scatter input must hold {self.size} x {output.numel()} elements of "
                f"{output.dtype}, got {input.numel()} of {input.dtype}"
            )
        return self._call("reduce_scatter_single", output, input, op, None, async_op, result)

    def reduce_scatter(self, output, inputs, op=SUM, async_op=False, result=None):
        """From a list, ``inputs[r]`` reduced into rank r's output. Blocks of one size: packed
        into one buffer inside the task (so an async call returns at once), then one
        ncclReduceScatter. Blocks of different sizes (gloo takes them): one ncclReduce per
        rank, to that rank, all in one group."""
        n = self.size
        if len(inputs) != n:
            raise RuntimeError(f"comm: reduce_scatter needs {n} input tensors, got {len(inputs)}")
        for t in inputs:
            if t.dtype != output.dtype:
                raise RuntimeError("comm: reduce_scatter inputs must each match the output's size and dtype")
        if inputs[self.rank].numel() != output.numel():
            raise RuntimeError(
                f"comm: reduce_scatter input {self.rank} (this rank's block) has {inputs[self.rank].numel()} "
                f"elements, the output {output.numel()}; they must match"
            )
        result = [output] if result is None else result
        sizes = [t.numel() for t in inputs]
        flat = torch.empty((sum(sizes),), dtype=output.dtype, device=output.device)
        if len(set(sizes)) == 1:
            return self._wrapped(
                lambda: self.reduce_scatter_single(output, flat, op),
                lambda: _pack(inputs, flat),
                None,
                result,
                async_op,
            )
        starts = [sum(sizes[:r]) for r in range(n)]
        mine = flat[starts[self.rank] : starts[self.rank] + sizes[self.rank]]

        def build():
            for r in range(n):
                block = flat[starts[r] : starts[r] + sizes[r]]
                self._wrapped(
                    lambda block=block, r=r: self.reduce(block, r, op),
                    # Packed before any reduce of the group runs: a group runs its calls at its end.
                    (lambda: _pack(inputs, flat)) if r == 0 else None,
                    (lambda: output.copy_(mine.view(output.shape))) if r == self.rank else None,
                )

        return self.group(build, result, async_op)

    def reduce_scatter_single_coalesced(self, outputs, inputs, op=SUM, async_op=False, result=None):
        def build():
            for out, inp in zip(outputs, inputs):
                self.reduce_scatter_single(out, inp, op)

        return self.group(build, outputs if result is None else result, async_op)

    def all_to_all_single(self, output, input, output_splits=None, input_splits=None, async_op=False, result=None):
        """Without split sizes one ncclAlltoAll; with them (rows of dim 0) one commAlltoAllv."""
        if output.dtype != input.dtype:
            raise RuntimeError(f"comm: all_to_all output dtype {output.dtype} differs from the input's {input.dtype}")
        if not input.is_contiguous():
            # As gloo and NCCL refuse it (ValueError, their words): split sizes count rows of
            # the input as laid out in memory.
            raise ValueError("comm: all_to_all_single: Tensors must be contiguous (the input is not)")
        n = self.size
        inp, _ = self._dense(input)
        out, staged = self._dense(output)
        code, _ = self._movable(inp)
        unit = inp.element_size() if (code == _lib.UINT8 and _DTYPES.get(inp.dtype) is None) else 1
        sptr, rptr = inp.data_ptr(), out.data_ptr()
        if not output_splits and not input_splits:
            if inp.numel() != out.numel() or inp.numel() % n:
                raise RuntimeError(
                    f"comm: all_to_all_single without split sizes needs input and output of one size "
                    f"divisible by {n}, got {inp.numel()} and {out.numel()}"
                )
            call, args = "ncclAlltoAll", (sptr, rptr, inp.numel() // n * unit, code)
        else:
            in_rows = inp.shape[0] if inp.dim() else 1
            out_rows = out.shape[0] if out.dim() else 1
            in_row = inp.numel() // in_rows if in_rows else 0
            out_row = out.numel() // out_rows if out_rows else 0
            in_splits = [int(s) for s in input_splits] if input_splits else [in_rows // n] * n
            out_splits = [int(s) for s in output_splits] if output_splits else [out_rows // n] * n
            if len(in_splits) != n or len(out_splits) != n:
                raise RuntimeError(f"comm: all_to_all_single split sizes need {n} entries")
            if sum(in_splits) != in_rows or sum(out_splits) != out_rows:
                raise RuntimeError(
                    f"comm: split sizes {in_splits} and {out_splits} do not add up to the first "
                    f"dimensions {in_rows} and {out_rows}"
                )
            arr = ctypes.c_size_t * n
            scounts, sdispls, rcounts, rdispls = arr(), arr(), arr(), arr()
            off = 0
            for p, s in enumerate(in_splits):
                scounts[p], sdispls[p] = s * in_row * unit, off * in_row * unit
                off += s
            off = 0
            for p, s in enumerate(out_splits):
                rcounts[p], rdispls[p] = s * out_row * unit, off * out_row * unit
                off += s
            call, args = "commAlltoAllv", (sptr, scounts, sdispls, rptr, rcounts, rdispls, code)
        return self._issue(
            call, args, [output, input], self._copy_back(staged, output, out), None, result, async_op, keep=(inp, out)
        )

    def all_to_all(self, outputs, inputs, async_op=False, result=None):
        """Lists: inputs packed into one buffer, one ncclAlltoAll (one block size) or
        commAlltoAllv, outputs copied out of one buffer; all in one task."""
        n = self.size
        if len(outputs) != n or len(inputs) != n:
            raise RuntimeError(f"comm: all_to_all needs {n} input and {n} output tensors")
        dtype, device = inputs[0].dtype, inputs[0].device
        if any(t.dtype != dtype for t in list(inputs) + list(outputs)):
            raise RuntimeError("comm: all_to_all tensors must share one dtype")
        send = torch.empty((sum(t.numel() for t in inputs),), dtype=dtype, device=device)
        recv = torch.empty((sum(t.numel() for t in outputs),), dtype=dtype, device=device)
        in_splits = [t.numel() for t in inputs]
        out_splits = [t.numel() for t in outputs]
        uniform = len(set(in_splits + out_splits)) == 1

        make = lambda: self.all_to_all_single(
            recv, send, None if uniform else out_splits, None if uniform else in_splits
        )
        return self._wrapped(
            make,
            lambda: _pack(inputs, send),
            lambda: _unpack(recv, outputs),
            outputs if result is None else result,
            async_op,
        )

    def gather_single(self, output, input, root, async_op=False, result=None, outputs=None):
        """ncclGather into ``output`` (root only); ``outputs`` gets it copied out as a list."""
        self._peer(root, "root")
        inp, _ = self._dense(input)
        code, count = self._movable(inp)
        is_root = self.rank == root
        if is_root:
            if output is None or output.numel() != inp.numel() * self.size or output.dtype != inp.dtype:
                raise RuntimeError(
                    f"comm: gather output on the root must hold {self.size} x {inp.numel()} elements of {inp.dtype}"
                )
            out, staged = self._dense(output)
            rptr = out.data_ptr()
        else:
            out, staged, rptr = None, False, None

        def finish():
            if staged:
                output.copy_(out)
            if outputs is not None:
                parts = out.view(self.size, -1)
                for i, o in enumerate(outputs):
                    o.copy_(parts[i].view(o.shape))

        tensors = [input] + ([output] if is_root else [])
        return self._issue(
            "ncclGather",
            (inp.data_ptr(), rptr, count, code, root),
            tensors,
            finish if is_root else None,
            None,
            result,
            async_op,
            keep=(inp, out),
        )

    def gather(self, outputs, input, root, async_op=False, result=None):
        """Into a list on the root: one ncclGather into a flat buffer, copied out."""
        self._peer(root, "root")
        flat = None
        if self.rank == root:
            if len(outputs) != self.size:
                raise RuntimeError(f"comm: gather needs {self.size} output tensors on the root, got {len(outputs)}")
            for o in outputs:
                if o.numel() != input.numel() or o.dtype != input.dtype:
                    raise RuntimeError("comm: gather outputs must match the input's size and dtype")
            flat = torch.empty((self.size * input.numel(),), dtype=input.dtype, device=input.device)
        return self.gather_single(
            flat, input, root, async_op, outputs if result is None else result, outputs if flat is not None else None
        )

    def scatter(self, output, inputs, root, async_op=False, result=None):
        """ncclScatter from one buffer the root packs from ``inputs`` inside the task."""
        self._peer(root, "root")
        out, staged = self._dense(output)
        code, count = self._movable(out)
        is_root = self.rank == root
        send = None
        if is_root:
            if len(inputs) != self.size:
                raise RuntimeError(f"comm: scatter needs {self.size} input tensors on the root, got {len(inputs)}")
            for t in inputs:
                if t.numel() != out.numel() or t.dtype != out.dtype:
                    raise RuntimeError("comm: scatter inputs must match the output's size and dtype")
            send = torch.empty((self.size * out.numel(),), dtype=out.dtype, device=out.device)
        sptr = send.data_ptr() if send is not None else None
        tensors = [output] + (list(inputs) if is_root else [])
        return self._issue(
            "ncclScatter",
            (sptr, out.data_ptr(), count, code, root),
            tensors,
            self._copy_back(staged, output, out),
            None,
            [output] if result is None else result,
            async_op,
            keep=(out, send),
            before=(lambda: _pack(inputs, send)) if send is not None else None,
        )

    def send(self, tensor, peer, async_op=False, result=None):
        if self._p2p_side is not None:
            return self._p2p_side.send(tensor, peer, async_op, result)
        return self._call("send", None, tensor, None, peer, async_op, result)

    def recv(self, tensor, peer, async_op=False, result=None):
        if self._p2p_side is not None:
            return self._p2p_side.recv(tensor, peer, async_op, result)
        return self._call("recv", tensor, None, None, peer, async_op, result)

    def recv_any_source(self, tensor, async_op=False, result=None):
        """commRecvAny: the next point-to-point message of this size from any rank; the work's
        source_rank() tells which. Deferred like the other sends and receives, it runs on its
        own after their group (it cannot join it: its source is chosen when it runs)."""
        if self._p2p_side is not None:
            return self._p2p_side.recv_any_source(tensor, async_op, result)
        if self._coalescing is not None:
            raise RuntimeError("comm: a receive from any source cannot be coalesced: its source is chosen when it runs")
        buf, staged = self._dense(tensor)
        code, count = self._movable(buf)
        source = ctypes.c_int(-1)
        finish = self._copy_back(staged, tensor, buf)
        # Deferred like the other point-to-point calls, and started after them: a pending
        # receive from any source held the group's executor, so an isend posted after it
        # never left (rank 0: irecv from any source, isend to rank 1, which receives first).
        work = self._issue(
            "commRecvAny",
            (buf.data_ptr(), count, code, _byref(source)),
            [tensor],
            finish,
            None,
            result,
            async_op,
            keep=(buf, source),
            p2p=True,
            alone=True,
        )
        work._source = source
        return work

    def barrier(self, async_op=False, timeout=None, result=None):
        """A one-element all-reduce on host memory, so a dead peer fails it like any collective.

        With ``timeout`` (seconds), a barrier still incomplete that long after it was issued
        fails: a peer that never arrives leaves this rank's library call blocked, so the
        communicator is aborted (which unblocks it, as NCCL's watchdog does on a timeout) and
        wait() raises an error that says the barrier timed out. Later operations on the
        communicator fail."""
        if timeout is None:
            return self.all_reduce(torch.zeros(1, dtype=torch.float32), SUM, async_op, result)
        work = self.all_reduce(torch.zeros(1, dtype=torch.float32), SUM, async_op=True, result=result)
        ms = round(timeout * 1000)

        def expire():
            self.abort()
            return CommError(
                f"comm: rank {self.rank} of group {self.name!r} ({self.size} ranks): barrier exceeded its timeout of {ms} ms (Timed out "
                f"waiting for the other ranks to arrive); the communicator was aborted, so its later "
                f"operations fail",
                call="barrier",
            )

        if not work._done:
            work._deadline = time.monotonic() + timeout
            work._expire = expire
        if not async_op:
            work.wait()
        return work
