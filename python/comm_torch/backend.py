"""The torch.distributed backend "comm".

How a pure-Python backend plugs into torch (read from torch's sources, not guessed):

* ``torch.distributed.Backend.register_backend(name, func, extended_api, devices)``
  (torch/distributed/distributed_c10d.py) stores ``func``. ``_new_process_group_helper`` calls
  it as ``func(store, group_rank, group_size, timeout)``, or with ``extended_api=True`` as
  ``func(_DistributedBackendOptions, backend_options)``; the options carry ``store`` (already
  prefixed with the group's name and the device), ``group_rank``, ``group_size``,
  ``timeout``, ``group_id``, ``global_ranks_in_group`` and, on recent torch, ``split_from``.
  We register with ``extended_api=True`` and accept both call forms.
* What the creator returns decides the plumbing. A ``torch._C._distributed_c10d.Backend``
  subclass is registered per device on a C++ ProcessGroup, and torch's PyBackend trampoline
  (torch/csrc/distributed/c10d/py/PyBackend.hpp) forwards every collective, ``split``,
  ``start_coalescing``/``end_coalescing``, ``shutdown`` and the ``supports_*`` properties to
  Python. Where that trampoline is missing (older torch) Python overrides on a Backend are
  never called, so the creator returns a ``torch.distributed.ProcessGroup`` subclass instead,
  which torch uses as the process group itself (PyProcessGroup trampoline,
  torch/csrc/distributed/c10d/PyProcessGroup.hpp).
* Each collective returns a ``torch.distributed.Work``; see ``_core.CommWork``. torch wraps
  what a Backend returns in a holder that hides most of it, so for a group that is comm on
  every device the creator returns a ProcessGroup of its own, ``CommGroup``, with the backend
  registered on it; torch then uses that as the group (see CommGroup).
* torch 2.15 and later find a backend by name through the entry-point group
  ``torch.distributed.backends`` (``Backend._ensure_backend_registered``): the entry point
  must load a callable that takes no arguments and registers the backend. Ours is
  ``comm_torch.backend:register``. Older torch needs ``import comm_torch``.
"""

from __future__ import annotations

import datetime
import os
import threading
import warnings
import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from . import _lib
from ._core import SUM, Engine, Reduction, operation_limit, timeout_seconds
from ._lib import CommError
from ._monitored import monitored_barrier as _monitored_barrier

if TYPE_CHECKING:
    from torch._C._distributed_c10d import (
        AllgatherOptions,
        AllreduceCoalescedOptions,
        AllreduceOptions,
        AllToAllOptions,
        BarrierOptions,
        BroadcastOptions,
        GatherOptions,
        ReduceOptions,
        ReduceScatterOptions,
        ScatterOptions,
    )

    Tensors = list[torch.Tensor]

BACKEND_NAME = "comm"
DEVICES = ["cpu", "cuda"]

try:
    from torch._C._distributed_c10d import Backend as _C10dBackend
except ImportError:  # pragma: no cover - very old torch
    _C10dBackend = None

_REDUCTIONS: dict[Any, Reduction] = {}

# Every backend object until its group is shut down. torch's C++ side holds a backend through
# an intrusive pointer, which does not keep the Python object alive; when nothing in Python
# refers to it either, the object is collected and every call from C++ falls through to the
# base class ("getBackendName is not implemented"). That is what happens under
# TORCH_DISTRIBUTED_DEBUG=DETAIL, where torch wraps the backend in a ProcessGroupWrapper and
# keeps only the wrapper.
_LIVE: set[Any] = set()


def reduction(op: Any) -> Reduction:
    """The engine's Reduction for a torch.distributed ReduceOp (or ReduceOp.RedOpType)."""
    kind_obj = getattr(op, "op", op)
    cached = _REDUCTIONS.get(kind_obj)
    if cached is not None:
        return cached
    name = getattr(kind_obj, "name", None) or str(kind_obj).rsplit(".", 1)[-1]
    kind = name.lower()
    if kind == "premul_sum":
        factor = getattr(op, "factor", None)
        if factor is None:
            raise RuntimeError("comm: PREMUL_SUM needs a factor (torch.distributed._make_nccl_premul_sum)")
        return Reduction("premul_sum", factor)
    if kind not in ("sum", "product", "min", "max", "avg", "band", "bor", "bxor"):
        raise RuntimeError(f"comm: unsupported reduce op {op}")
    made = _REDUCTIONS[kind_obj] = Reduction(kind)
    return made


_tag_warned = False


def _note_tag(tag: int) -> None:
    """Tags do not match messages (as with NCCL, unlike gloo): say so once, the first time a
    program passes one, since a receive posted out of order then takes another tag's data."""
    global _tag_warned
    if tag and not _tag_warned:
        _tag_warned = True
        warnings.warn(
            "comm: point-to-point tags are ignored, as with NCCL: messages between two ranks "
            "match in the order the sends and receives are called, not by tag",
            stacklevel=3,
        )


def _async(opts: Any) -> bool:
    # AllreduceOptions and friends carry asyncOp on recent torch (dist.* sets it from
    # async_op); without it, treat the call as asynchronous, which is always correct.
    return getattr(opts, "asyncOp", True)


def _single(items: list[Any], what: str, kind: str) -> Any:
    """The one element of a list that must hold one (RuntimeError naming the rule otherwise;
    gloo refuses several tensors per rank for these operations too)."""
    if len(items) != 1:
        raise RuntimeError(
            f"comm: {what} requires a single-element {kind}, got {len(items)} elements (one tensor per rank "
            f"and call; only all_reduce, broadcast and all_gather take several)"
        )
    return items[0]


def _root_tensor(opts: Any, what: str) -> None:
    root_tensor = getattr(opts, "rootTensor", 0)
    if root_tensor != 0:
        raise RuntimeError(f"comm: {what}: invalid root tensor: {root_tensor} (a list of one tensor)")


def _future_value(lists: list[Any]) -> list[Any]:
    """What gloo's future holds for output lists ``lists`` (returnFutureWithOutput): nothing
    for no lists, the one list itself, else the lists."""
    if not lists:
        return []
    if len(lists) == 1:
        return lists[0]
    return lists


class _Ops:
    """torch.distributed's backend interface, shared by both plumbing classes below."""

    # Set by each subclass's __init__.
    engine: Engine
    _timeout: datetime.timedelta
    _store: dist.Store | None
    _monitored_seq: int

    # -- identity
    def getBackendName(self) -> str:
        return BACKEND_NAME

    def __repr__(self) -> str:
        return f"<comm backend {self.engine.name!r} rank {self.engine.rank}/{self.engine.size}>"

    # -- collectives
    #
    # Lists of several tensors per rank (the old one-tensor-per-device form, which the
    # ProcessGroup API still takes) follow gloo: all_reduce, broadcast and all_gather combine
    # them as gloo does; the operations gloo refuses them for refuse them here too.
    #
    # ``result`` is what the work's future holds: what gloo's holds (its outputs, as
    # returnFutureWithOutput gives them: the one list of outputs itself, else the list of
    # lists), and [output] where gloo has no future at all (reduce_scatter, send, recv).
    def allreduce(self, tensors: Tensors, opts: AllreduceOptions | None = None) -> dist.Work:
        op = reduction(opts.reduceOp) if opts is not None else SUM
        async_op = _async(opts) if opts is not None else True
        if len(tensors) == 1:
            if tensors[0].is_sparse:
                return self.engine.sparse_all_reduce(tensors[0], op, async_op, result=tensors)
            return self.engine.all_reduce(tensors[0], op, async_op, result=tensors)
        return self.engine.all_reduce_joint(tensors, op, async_op, result=tensors)

    def allreduce_coalesced(self, tensors: Tensors, opts: AllreduceCoalescedOptions | None = None) -> dist.Work:
        op = reduction(opts.reduceOp) if opts is not None else SUM
        return self.engine.all_reduce_coalesced(tensors, op, _async(opts), result=tensors)

    def allreduce_sparse(self, tensors: Tensors, opts: AllreduceOptions | None = None) -> dist.Work:
        op = reduction(opts.reduceOp) if opts is not None else SUM
        async_op = _async(opts) if opts is not None else True
        if len(tensors) == 1:
            return self.engine.sparse_all_reduce(tensors[0], op, async_op, result=tensors)
        return self.engine.all_reduce_joint(tensors, op, async_op, result=tensors)

    def broadcast(self, tensors: Tensors, opts: BroadcastOptions) -> dist.Work:
        root_tensor = getattr(opts, "rootTensor", 0)
        return self.engine.broadcast_joint(tensors, opts.rootRank, root_tensor, _async(opts), result=tensors)

    def reduce(self, tensors: Tensors, opts: ReduceOptions) -> dist.Work:
        tensor = _single(tensors, "reduce", "tensor list")
        _root_tensor(opts, "reduce")
        return self.engine.reduce(tensor, opts.rootRank, reduction(opts.reduceOp), _async(opts), result=tensors)

    def allgather(
        self, output_tensors: list[Tensors], input_tensors: Tensors, opts: AllgatherOptions | None = None
    ) -> dist.Work:
        return self.engine.all_gather_joint(
            output_tensors, input_tensors, _async(opts), result=_future_value(output_tensors)
        )

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: AllgatherOptions | None = None
    ) -> dist.Work:
        # gloo gathers into the output's chunks, one per rank, and its future holds them.
        chunks = list(torch.chunk(output, self.engine.size)) if output.dim() else [output]
        return self.engine.all_gather_single(output, input, _async(opts), result=chunks)

    _allgather_base = all_gather_single  # the name before torch 2.12

    def allgather_coalesced(
        self, output_lists: list[Tensors], inputs: Tensors, opts: AllgatherOptions | None = None
    ) -> dist.Work:
        return self.engine.all_gather_coalesced(output_lists, inputs, _async(opts), result=_future_value(output_lists))

    def all_gather_single_coalesced(
        self, outputs: Tensors, inputs: Tensors, opts: AllgatherOptions | None = None
    ) -> dist.Work:
        # gloo runs this as allgather_coalesced into each output's chunks: its future holds,
        # per rank, that rank's chunk of every output.
        n = self.engine.size
        chunks = [torch.chunk(o, n) if o.dim() else (o,) for o in outputs]
        per_rank = [[c[r] for c in chunks] for r in range(n)] if all(len(c) == n for c in chunks) else [outputs]
        return self.engine.all_gather_single_coalesced(outputs, inputs, _async(opts), result=_future_value(per_rank))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_tensors: list[Tensors], input_tensors: Tensors, opts: GatherOptions) -> dist.Work:
        inp = _single(input_tensors, "gather", "input tensor list")
        if len(output_tensors) > 1:
            raise RuntimeError(
                f"comm: gather requires a single-element output list (one list of outputs), got {len(output_tensors)}"
            )
        outputs = output_tensors[0] if output_tensors else []
        return self.engine.gather(outputs, inp, opts.rootRank, _async(opts), result=_future_value(output_tensors))

    def gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: GatherOptions) -> dist.Work:
        out = output if self.engine.rank == opts.rootRank else None
        return self.engine.gather_single(out, input, opts.rootRank, _async(opts), result=[output])

    def scatter(self, output_tensors: Tensors, input_tensors: list[Tensors], opts: ScatterOptions) -> dist.Work:
        out = _single(output_tensors, "scatter", "output tensor list")
        if len(input_tensors) > 1:
            raise RuntimeError(
                f"comm: scatter requires a single-element input list (one list of inputs), got {len(input_tensors)}"
            )
        inputs = input_tensors[0] if input_tensors else []
        return self.engine.scatter(out, inputs, opts.rootRank, _async(opts), result=output_tensors)

    def reduce_scatter(
        self, output_tensors: Tensors, input_tensors: list[Tensors], opts: ReduceScatterOptions
    ) -> dist.Work:
        out = _single(output_tensors, "reduce_scatter", "output tensor list")
        inputs = _single(input_tensors, "reduce_scatter", "list of input lists")
        return self.engine.reduce_scatter(out, inputs, reduction(opts.reduceOp), _async(opts), result=output_tensors)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: ReduceScatterOptions) -> dist.Work:
        return self.engine.reduce_scatter_single(output, input, reduction(opts.reduceOp), _async(opts), result=[output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(
        self, outputs: Tensors, inputs: Tensors, opts: ReduceScatterOptions
    ) -> dist.Work:
        return self.engine.reduce_scatter_single_coalesced(
            outputs, inputs, reduction(opts.reduceOp), _async(opts), result=outputs
        )

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def alltoall(
        self, output_tensors: Tensors, input_tensors: Tensors, opts: AllToAllOptions | None = None
    ) -> dist.Work:
        return self.engine.all_to_all(output_tensors, input_tensors, _async(opts), result=output_tensors)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: AllToAllOptions | None = None,
    ) -> dist.Work:
        return self.engine.all_to_all_single(
            output, input, output_split_sizes, input_split_sizes, _async(opts), result=[output]
        )

    alltoall_base = all_to_all_single

    def send(self, tensors: Tensors, dst: int, tag: int = 0) -> dist.Work:
        tensor = _single(tensors, "send", "tensor list")
        _note_tag(tag)
        return self.engine.send(tensor, dst, True, result=tensors)

    def recv(self, tensors: Tensors, src: int, tag: int = 0) -> dist.Work:
        tensor = _single(tensors, "recv", "tensor list")
        _note_tag(tag)
        return self.engine.recv(tensor, src, True, result=tensors)

    def recv_anysource(self, tensors: Tensors, tag: int = 0) -> dist.Work:
        tensor = _single(tensors, "recv_anysource", "tensor list")
        _note_tag(tag)
        return self.engine.recv_any_source(tensor, True, result=tensors)

    def barrier(self, opts: BarrierOptions | None = None) -> dist.Work:
        # The call's own timeout, else the group's (as gloo does); 0 means none.
        timeout = timeout_seconds(getattr(opts, "timeout", None))
        if timeout is None:
            timeout = timeout_seconds(self._timeout)
        return self.engine.barrier(_async(opts) if opts is not None else True, timeout or None, result=[])

    def monitored_barrier(self, opts: BarrierOptions | None = None, wait_all_ranks: bool = False) -> None:
        """Over the group's store; see _monitored.py."""
        timeout = timeout_seconds(getattr(opts, "timeout", None))
        group_timeout = timeout_seconds(self._timeout) or 1800.0
        if timeout is None:
            timeout = group_timeout
        if self._store is None:
            raise CommError("comm: monitored_barrier needs the group's store, which this group was created without")
        self._monitored_seq += 1
        # The other ranks wait for rank 0's verdict at least as long as rank 0 may take to reach one.
        rank_zero_may_take = timeout * (self.engine.size - 1 if wait_all_ranks else 1)
        _monitored_barrier(
            self._store,
            self.engine.rank,
            self.engine.size,
            self._monitored_seq,
            timeout,
            wait_all_ranks,
            max(group_timeout, rank_zero_may_take + 5.0),
        )

    # -- coalescing (batch_isend_irecv and _coalescing_manager)
    @property
    def supports_coalescing(self) -> bool:
        return True

    def start_coalescing(self, device: torch.device | None = None) -> None:
        self.engine.start_coalescing()

    def end_coalescing(self, device: torch.device | None = None) -> dist.Work:
        return self.engine.end_coalescing(async_op=True)

    # -- lifecycle
    def eager_connect_single_device(self, device: torch.device | None = None) -> None:
        pass  # the communicator is created with the backend

    def shutdown(self) -> None:
        _LIVE.discard(self)
        self.engine.destroy()

    def abort(self) -> None:
        _LIVE.discard(self)
        self.engine.abort()

    def _set_sequence_number_for_group(self):
        pass

    def _get_sequence_number_for_group(self):
        return 0


if _C10dBackend is not None:

    class CommBackend(_Ops, _C10dBackend):
        """torch.distributed backend over one libcomm communicator."""

        def __init__(
            self,
            engine: Engine,
            timeout: datetime.timedelta | None = None,
            group_name: str = "",
            global_ranks: list[int] | None = None,
            store: dist.Store | None = None,
        ) -> None:
            _C10dBackend.__init__(self, engine.rank, engine.size)
            self.engine = engine
            self._timeout = timeout if timeout is not None else datetime.timedelta(minutes=30)
            # A rank that never comes fails the group's operations after the group's timeout
            # (init_process_group(timeout=...)), as with gloo, instead of blocking them forever.
            engine.set_timeout(operation_limit(timeout_seconds(self._timeout)))
            self._store = store
            self._monitored_seq = 0
            _LIVE.add(self)
            self._group_name = group_name
            self._global_ranks = list(global_ranks or [])
            self._options = None

        # torch reads ``options`` through getBackendOptions(); a subclass that does not
        # define it sends PyBackend's lookup back into itself (unbounded recursion in
        # split_group on torch 2.15), so it is defined here.
        @property
        def options(self) -> Any:
            if self._options is None:
                opts = _C10dBackend.Options(BACKEND_NAME, self._timeout)
                for attr, value in (("group_name", self._group_name), ("global_ranks_in_group", self._global_ranks)):
                    try:
                        setattr(opts, attr, value)
                    except Exception:  # noqa: BLE001, S110  read-only or missing on some torch releases
                        pass
                self._options = opts
            return self._options

        @property
        def supports_splitting(self) -> bool:
            return True

        def split(self, store: dist.Store, ranks: list[int], opts: Any = None) -> _C10dBackend:
            """ProcessGroup.split_group: ncclCommSplit over this communicator. ``ranks`` are
            ranks of this group; ranks outside it take part with NCCL_SPLIT_NOCOLOR."""
            ranks = [int(r) for r in ranks]
            name = getattr(opts, "group_name", "") or f"{self.engine.name}:split"
            me = self.engine.rank
            if me not in ranks:
                self.engine.split(_lib.SPLIT_NOCOLOR, 0, name)
                # None would be right, but PyBackend::split (torch 2.15) dereferences what
                # Python returns without checking for None (initSlotAndCast), which crashes
                # the process. A placeholder that refuses every operation stands in.
                return _NotAMember(me, len(ranks), name)
            child = self.engine.split(min(ranks), ranks.index(me), name)
            child.separate_p2p()
            timeout = getattr(opts, "_timeout", None) or self._timeout
            return CommBackend(
                child,
                timeout,
                name,
                [self._global_ranks[r] for r in ranks] if self._global_ranks else ranks,
                store,
            )

        def perform_nocolor_split(self, device: torch.device | None = None) -> None:
            """new_group on a rank outside the new group, when the world has a bound device:
            its side of the members' ncclCommSplit (see _new_process_group_helper)."""
            self.engine.split(_lib.SPLIT_NOCOLOR, 0, f"{self.engine.name}:nocolor")

    class _NotAMember(_C10dBackend):
        """What split() gives a rank outside every new group (see CommBackend.split)."""

        def __init__(self, parent_rank, size, name):
            _C10dBackend.__init__(self, 0, size)
            self._why = (
                f"comm: rank {parent_rank} of the parent group is not a member of split group "
                f"{name!r}; torch returns it a placeholder whose operations all fail"
            )

        def getBackendName(self):
            return BACKEND_NAME

        @property
        def options(self):
            return _C10dBackend.Options(BACKEND_NAME)

        def _refuse(self, *args, **kwargs):
            raise RuntimeError(self._why)

        def shutdown(self):
            pass

        def abort(self):
            pass

    for _name in (
        "allreduce",
        "allreduce_coalesced",
        "broadcast",
        "reduce",
        "allgather",
        "all_gather_single",
        "_allgather_base",
        "allgather_coalesced",
        "all_gather_single_coalesced",
        "gather",
        "gather_single",
        "scatter",
        "reduce_scatter",
        "reduce_scatter_single",
        "_reduce_scatter_base",
        "reduce_scatter_single_coalesced",
        "alltoall",
        "all_to_all_single",
        "alltoall_base",
        "send",
        "recv",
        "barrier",
        "split",
        "start_coalescing",
        "end_coalescing",
    ):
        setattr(_NotAMember, _name, _NotAMember._refuse)

    # -- the group torch hands to callers
    #
    # torch wraps every Work that a Python backend returns in PyProcessGroup::PyWorkHolder
    # (WORK_OVERRIDE in torch/csrc/distributed/c10d/py/PyProcessGroup.hpp, used by PyBackend
    # for each operation), and the holder forwards only wait() and get_future(): is_completed()
    # stays false after wait() (it reads the holder's own flag) and _source_rank() throws. So
    # the creator hands torch a ProcessGroup of its own, CommGroup below, which torch then uses
    # as the group itself. Its operations run torch's ProcessGroup code as before (hooks, flight
    # recorder, dispatcher, this backend) and then give the Python caller the CommWork that the
    # backend made instead of the holder. A backend operation leaves its work here, for the
    # group call on the same thread that is waiting for it.
    _issued = threading.local()

    def _leaves_work(op):
        def issue(self, *args, **kwargs):
            work = op(self, *args, **kwargs)
            # Weak: the holder keeps the work alive while the group call is on its way back,
            # and nothing here should keep an operation's tensors alive after it.
            _issued.work = (weakref.ref(self), weakref.ref(work)) if work is not None else None
            return work

        issue.__name__ = op.__name__
        issue.__doc__ = op.__doc__
        return issue

    _WORK_OPS = (
        "allreduce",
        "allreduce_coalesced",
        "allreduce_sparse",
        "broadcast",
        "reduce",
        "allgather",
        "all_gather_single",
        "_allgather_base",
        "allgather_coalesced",
        "all_gather_single_coalesced",
        "allgather_into_tensor_coalesced",
        "gather",
        "gather_single",
        "scatter",
        "reduce_scatter",
        "reduce_scatter_single",
        "_reduce_scatter_base",
        "reduce_scatter_single_coalesced",
        "reduce_scatter_tensor_coalesced",
        "alltoall",
        "all_to_all_single",
        "alltoall_base",
        "send",
        "recv",
        "recv_anysource",
        "barrier",
        "end_coalescing",
    )
    for _name in _WORK_OPS:
        setattr(CommBackend, _name, _leaves_work(getattr(_Ops, _name)))

    _PG = dist.ProcessGroup
    _CUSTOM = _PG.BackendType.CUSTOM

    class CommGroup(_PG):
        """The process group of backend comm (see above for why torch gets one of ours).

        Each operation below calls torch's own ProcessGroup method and returns the backend's
        CommWork in place of the holder torch made around it. Every method is written out under
        the name it overrides, because that is what keeps a C++ caller from looping: when C++
        code (DDP's reducer, say) calls such an operation, PyProcessGroup finds the Python
        override and runs it, and the override's call to the base method comes back to
        PyProcessGroup, which pybind11's get_override answers with "no override" only because
        the Python frame calling it is a function of the same name whose first argument is this
        group (pybind11/pybind11.h, get_type_override). For three operations PyProcessGroup
        also looks for an override under a deprecated name when the current one has none
        (allgather_into_tensor_coalesced, reduce_scatter_tensor_coalesced, alltoall_base);
        overriding those as well would send the two overrides into each other, so they are
        left to torch (whose own Python code calls the current names)."""

        def __init__(
            self,
            backend: CommBackend,
            registered: _C10dBackend,
            store: dist.Store,
            bound_device_id: torch.device | None = None,
        ) -> None:
            _PG.__init__(self, store, backend.engine.rank, backend.engine.size)
            self._comm_backend = backend
            self._set_default_backend(_CUSTOM)
            for device in DEVICES:
                self._register_backend(torch.device(device), _CUSTOM, registered)
            if bound_device_id is not None:
                self.bound_device_id = bound_device_id
            # The backend lives until shutdown (_LIVE) and keeps its group alive that long: C++
            # holds the group through a pointer that does not keep this Python object alive,
            # and without it the overrides would vanish from under C++ callers.
            backend._group = self

        def getBackendName(self) -> str:
            return BACKEND_NAME

        def _own(self, made):
            # Not cleared here: a call under another name (_allgather_base) reaches the backend
            # through the override of the current name (all_gather_single), and both return
            # the same work.
            issued = getattr(_issued, "work", None)
            if issued is not None and issued[0]() is self._comm_backend:
                work = issued[1]()
                if work is not None:
                    return work
            return made

        @staticmethod
        def _clear():
            _issued.work = None

        def allreduce(self, *args: Any, **kwargs: Any) -> dist.Work:
            self._clear()
            return self._own(_PG.allreduce(self, *args, **kwargs))

        def allreduce_coalesced(self, *args: Any, **kwargs: Any) -> dist.Work:
            self._clear()
            return self._own(_PG.allreduce_coalesced(self, *args, **kwargs))

        def broadcast(self, *args: Any, **kwargs: Any) -> dist.Work:
            self._clear()
            return self._own(_PG.broadcast(self, *args, **kwargs))

        def reduce(self, *args: Any, **kwargs: Any) -> dist.Work:
            self._clear()
            return self._own(_PG.reduce(self, *args, **kwargs))

        def allgather(self, *args: Any, **kwargs: Any) -> dist.Work:
            self._clear()
            return self._own(_PG.allgather(self, *args, **kwargs))

        def all_gather_single(self, *args: Any, **kwargs: Any) -> dist.Work:
            self._clear()
            return self._own(_PG.all_gather_single(self, *args, **kwargs))

        def _allgather_base(self, *args: Any, **kwargs: Any) -> dist.Work:
            self._clear()
            return self._own(_PG._allgather_base(self, *args, **kwargs))

        def allgather_coalesced(self, *args: Any, **kwargs: Any) -> dist.Work:
            self._clear()
            return self._own(_PG.allgather_coalesced(self, *args, **kwargs))

        def all_gather_single_coalesced(self, *args: Any, **kwargs: Any) -> dist.Work:
            self._clear()
            return self._own(_PG.all_gather_single_coalesced(self, *args, **kwargs))

        def gather(self, *args: Any, **kwargs: Any) -> dist.Work:
            self._clear()
            return self._own(_PG.gather(self, *args, **kwargs))

        def scatter(self, *args: Any, **kwargs: Any) -> dist.Work:
            self._clear()
            return self._own(_PG.scatter(self, *args, **kwargs))

        def reduce_scatter(self, *args: Any, **kwargs: Any) -> dist.Work:
            self._clear()
            return self._own(_PG.reduce_scatter(self, *args, **kwargs))

        def reduce_scatter_single(self, *args: Any, **kwargs: Any) -> dist.Work:
            self._clear()
            return self._own(_PG.reduce_scatter_single(self, *args, **kwargs))

        def _reduce_scatter_base(self, *args: Any, **kwargs: Any) -> dist.Work:
            self._clear()
            return self._own(_PG._reduce_scatter_base(self, *args, **kwargs))

        def reduce_scatter_single_coalesced(self, *args: Any, **kwargs: Any) -> dist.Work:
            self._clear()
            return self._own(_PG.reduce_scatter_single_coalesced(self, *args, **kwargs))

        def alltoall(self, *args: Any, **kwargs: Any) -> dist.Work:
            self._clear()
            return self._own(_PG.alltoall(self, *args, **kwargs))

        def all_to_all_single(self, *args: Any, **kwargs: Any) -> dist.Work:
            self._clear()
            return self._own(_PG.all_to_all_single(self, *args, **kwargs))

        def barrier(self, *args: Any, **kwargs: Any) -> dist.Work:
            self._clear()
            return self._own(_PG.barrier(self, *args, **kwargs))

        def send(self, *args: Any, **kwargs: Any) -> dist.Work:
            self._clear()
            return self._own(_PG.send(self, *args, **kwargs))

        def recv(self, *args: Any, **kwargs: Any) -> dist.Work:
            self._clear()
            return self._own(_PG.recv(self, *args, **kwargs))

        def recv_anysource(self, *args: Any, **kwargs: Any) -> dist.Work:
            self._clear()
            return self._own(_PG.recv_anysource(self, *args, **kwargs))

        def _end_coalescing(self, *args: Any, **kwargs: Any) -> dist.Work:
            self._clear()
            return self._own(_PG._end_coalescing(self, *args, **kwargs))

    # An operation this torch's ProcessGroup lacks is not overridden either.
    for _name in list(vars(CommGroup)):
        if not _name.startswith("__") and _name not in ("getBackendName", "_own", "_clear") and not hasattr(_PG, _name):
            delattr(CommGroup, _name)

    def _serves_whole_group(torch_group):
        """Whether the group torch is building (the ProcessGroup it passes the creator) is on
        backend comm for every device, so that a CommGroup may take its place. Not when comm
        serves one device of a mixed group ("cpu:comm,cuda:nccl"): torch builds the others'
        backends only for a group of its own."""
        if torch_group is None:
            return False
        try:
            # Backends are registered after the creator returns, one device at a time, and
            # torch gives the group the default backend type of the device it prefers: CUSTOM
            # (comm's) only when that device's backend is a plugin.
            return not torch_group._device_types and torch_group._get_backend_name() == "custom"
        except (AttributeError, RuntimeError):
            return False

    def _as_group(backend, opts, timeout):
        """CommGroup around ``backend`` for the group ``opts`` describes, with what torch would
        have done to the backend (ProcessGroupWrapper under TORCH_DISTRIBUTED_DEBUG=DETAIL)
        and to its own group (the bound device) when given the backend itself."""
        torch_group = opts.process_group
        registered = backend
        if dist.get_debug_level() == dist.DebugLevel.DETAIL and dist.is_gloo_available():
            from torch.distributed import distributed_c10d as c10d

            wrap = getattr(c10d, "_create_process_group_wrapper", None)
            if wrap is not None:
                registered = wrap(
                    wrapped_pg=backend,
                    store_prefix=str(getattr(opts, "group_id", "") or ""),
                    store=opts.store,
                    rank=opts.group_rank,
                    world_size=opts.group_size,
                    timeout=timeout,
                )
        try:
            store = torch_group.get_group_store()
        except (AttributeError, RuntimeError):
            store = opts.store
        return CommGroup(backend, registered, store, getattr(torch_group, "bound_device_id", None))


else:  # pragma: no cover
    CommBackend = None
    CommGroup = None


class CommProcessGroup(_Ops, dist.ProcessGroup):
    """The same backend as a ProcessGroup subclass, for torch without the PyBackend
    trampoline. torch uses it as the group itself; sub-groups are created fresh."""

    def __init__(
        self,
        engine: Engine,
        timeout: datetime.timedelta | None = None,
        group_name: str = "",
        global_ranks: list[int] | None = None,
        store: dist.Store | None = None,
    ) -> None:
        dist.ProcessGroup.__init__(self, engine.rank, engine.size)
        self.engine = engine
        self._timeout = timeout if timeout is not None else datetime.timedelta(minutes=30)
        self._store = store
        self._monitored_seq = 0

    def getRank(self) -> int:
        return self.engine.rank

    def getSize(self) -> int:
        return self.engine.size

    def name(self) -> str:
        return BACKEND_NAME


_probe_result = None


def backend_trampoline_available() -> bool:
    """Whether Python overrides on torch._C._distributed_c10d.Backend reach C++ callers."""
    global _probe_result
    if _probe_result is None:
        if os.environ.get("COMM_TORCH_PROCESS_GROUP") == "1" or _C10dBackend is None:
            _probe_result = False
        else:

            class _Probe(_C10dBackend):
                def getBackendName(self):
                    return "comm-probe"

            try:
                _probe_result = _Probe(0, 1).name() == "comm-probe"
            except Exception:  # noqa: BLE001  any failure means the trampoline cannot be used
                _probe_result = False
    return _probe_result


def _group_key(name):
    return f"comm_torch/unique_id/{name}" if name else "comm_torch/unique_id"


def _every_rank_comes(group_name: str) -> bool:
    """Whether every rank of the default group takes part in creating group ``group_name``,
    as splitting the default group's communicator needs (NCCL's eager init does the same).
    Not under new_group(use_local_synchronization=True): the ranks outside the group return
    before they reach any backend, and never call perform_nocolor_split, so the members'
    split waited for them forever; the members then make a communicator of their own. torch
    names such a group by a hash of its ranks, and any other by the count of groups made so far
    (distributed_c10d._process_group_name), which is how the two are told apart here. Nor when
    torch builds sub-groups through torchcomms, where non-members never split either."""
    if not group_name.isdigit():
        return False
    try:
        from torch.distributed import distributed_c10d as c10d

        return not c10d._use_torchcomms_enabled()
    except (AttributeError, ImportError):
        return True


def create_backend(*args: Any, **kwargs: Any) -> dist.ProcessGroup | _C10dBackend:
    """The creator torch calls for each process group on backend "comm"."""
    split_from = None
    global_ranks = []
    opts = None
    if len(args) == 2 or (len(args) == 1 and "backend_options" in kwargs):
        opts = args[0]
        store, rank, size, timeout = opts.store, opts.group_rank, opts.group_size, opts.timeout
        name = str(getattr(opts, "group_id", "") or "")
        global_ranks = list(getattr(opts, "global_ranks_in_group", None) or [])
        split_from = getattr(opts, "split_from", None)
    elif len(args) == 4:
        store, rank, size, timeout = args
        name = ""
    else:
        raise TypeError(f"comm: unexpected backend creator arguments {args!r}")

    if CommBackend is not None and isinstance(split_from, CommBackend) and global_ranks and _every_rank_comes(name):
        # new_group with a bound device: the members split the default group's
        # communicator; the other ranks call perform_nocolor_split.
        engine = split_from.engine.split(min(global_ranks), rank, name or "split")
        if engine.rank != rank or engine.size != size:
            raise CommError(f"comm: split gave rank {engine.rank}/{engine.size}, torch expects {rank}/{size}")
    else:
        engine = Engine.from_store(store, rank, size, name or "world", key=_group_key(name))
    # Sends and receives on a communicator of their own, so that neither kind holds the other
    # up (see Engine.separate_p2p); every rank of the group is here.
    engine.separate_p2p()

    if backend_trampoline_available():
        backend = CommBackend(engine, timeout, name, global_ranks or list(range(size)), store)
        if opts is not None and _serves_whole_group(getattr(opts, "process_group", None)):
            return _as_group(backend, opts, timeout)
        return backend
    return CommProcessGroup(engine, timeout, name, global_ranks, store)


_registered = False
_register_lock = threading.Lock()


def register() -> None:
    """Registers backend "comm" with torch.distributed (idempotent). This is the target of
    the ``torch.distributed.backends`` entry point, and ``import comm_torch`` calls it."""
    global _registered
    with _register_lock:
        if _registered or "COMM" in getattr(dist.Backend, "_plugins", {}):
            _registered = True
            return
        try:
            dist.Backend.register_backend(BACKEND_NAME, create_backend, extended_api=True, devices=DEVICES)
        except TypeError:  # torch before the ``devices`` argument
            dist.Backend.register_backend(BACKEND_NAME, create_backend, extended_api=True)
        _registered = True
