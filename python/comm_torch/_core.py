"""The engine shared by the torch.distributed and torchcomms backends, by its old name.

It lives in four modules: ``_types`` (the dtypes and reductions libcomm takes), ``_work``
(what an operation returns, and the executor that runs a communicator's operations in
order), ``_engine`` (the communicator: its life, tasks, groups, deferred point-to-point calls)
and ``_collectives`` (the operations, most of them entries of one table). The names the
backends and the tests import are re-exported here.
"""

from ._collectives import _FOLDS, _pack, _same_kind, _unpack
from ._engine import Engine, operation_limit, timeout_seconds
from ._types import _DTYPES, _OPS, SUM, Reduction
from ._work import DONE, CommWork, Executor, Task, completed_work, flush_deferred_p2p

__all__ = [
    "DONE",
    "SUM",
    "_DTYPES",
    "_FOLDS",
    "_OPS",
    "CommWork",
    "Engine",
    "Executor",
    "Reduction",
    "Task",
    "_pack",
    "_same_kind",
    "_unpack",
    "completed_work",
    "flush_deferred_p2p",
    "operation_limit",
    "timeout_seconds",
]
