"""The fake's equivalent of torchcomms' compiled ``_comms`` module (see __init__.py)."""

import datetime
import enum


class RedOpType(enum.Enum):
    SUM = 0
    AVG = 1
    PRODUCT = 2
    MIN = 3
    MAX = 4
    BAND = 5
    BOR = 6
    BXOR = 7
    PREMUL_SUM = 8


class ReduceOp:
    def __init__(self, opType, factor=None):
        self.type = opType
        self.factor = factor

    @staticmethod
    def PREMUL_SUM(factor):
        return ReduceOp(RedOpType.PREMUL_SUM, factor)

    def __repr__(self):
        return f"ReduceOp({self.type.name})"


for _t in RedOpType:
    if _t is not RedOpType.PREMUL_SUM:
        setattr(ReduceOp, _t.name, ReduceOp(_t))


class CommOptions:
    def __init__(self, store=None, timeout=None, hints=None, abort_process_on_timeout_or_error=False):
        self.store = store
        self.timeout = timeout or datetime.timedelta(minutes=10)
        self.hints = dict(hints or {})
        self.abort_process_on_timeout_or_error = abort_process_on_timeout_or_error


class TorchCommBackend:
    """Base of Python backends; the real one is a pybind11 trampoline."""

    def __init__(self):
        self._device = None
        self._options = None

    def _set_device_and_options(self, device, options):
        self._device = device
        self._options = options


_registry = {}


def register_backend(name, backend_class):
    _registry[name] = backend_class


def _is_backend_registered(name):
    return name in _registry


class TorchWork:
    def __init__(self, py_work):
        self._work = py_work
        self._done = py_work is None

    def wait(self):
        if not self._done:
            self._work.wait()
            self._done = True

    def is_completed(self):
        return self._done


class TorchComm:
    def __init__(self, backend, device, name, options):
        self._backend = backend
        self._device = device
        self._name = name
        self._options = options

    def unsafe_get_backend(self):
        return self._backend

    def get_rank(self):
        return self._backend.get_rank()

    def get_size(self):
        return self._backend.get_size()

    def get_backend(self):
        return self._backend.get_backend_name()

    def get_name(self):
        return self._backend.get_comm_name()

    def get_device(self):
        return self._device

    def get_options(self):
        return self._options

    def finalize(self):
        self._backend.finalize()

    def split(self, ranks, name, hints=None, timeout=None):
        child = self._backend.split(list(ranks), name, CommOptions(self._options.store, timeout, hints))
        return None if child is None else TorchComm(child, self._device, name, self._options)

    def window_allocate(self, window_size, cpu_buf=False, signal_size=256):
        return self._backend.window_allocate(window_size, cpu_buf, signal_size)


def _forward(method):
    def call(self, *args, hints=None, timeout=None, **kwargs):
        return TorchWork(getattr(self._backend, method)(*args, **kwargs))

    call.__name__ = method
    return call


for _m in (
    "send",
    "recv",
    "broadcast",
    "all_reduce",
    "reduce",
    "all_gather",
    "all_gather_v",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_v",
    "reduce_scatter_single",
    "all_to_all_single",
    "all_to_all_v_single",
    "all_to_all",
    "barrier",
    "scatter",
    "gather",
):
    setattr(TorchComm, _m, _forward(_m))


def new_comm(
    backend,
    device,
    name,
    abort_process_on_timeout_or_error=None,
    timeout=None,
    high_priority_stream=None,
    store=None,
    hints=None,
):
    if not _is_backend_registered(backend):
        import torchcomms

        torchcomms._load_backend(backend)
    if not _is_backend_registered(backend):
        raise RuntimeError(f"backend {backend} did not register itself")
    instance = _registry[backend]()
    options = CommOptions(store, timeout, hints, bool(abort_process_on_timeout_or_error))
    instance.init(device, name, options)
    return TorchComm(instance, device, name, options)
