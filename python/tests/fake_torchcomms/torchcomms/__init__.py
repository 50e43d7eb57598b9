"""A stand-in for torchcomms (not on PyPI) that behaves like its Python-backend path.

It reproduces what comm_torch relies on, after torchcomms' own sources:
* ``register_backend(name, cls)`` / ``_is_backend_registered(name)`` and the factory that
  instantiates the class per communicator and calls ``init(device, name, options)``
  (comms/torchcomms/TorchCommBackendPy.cpp);
* the lazy load of an unknown backend through the ``torchcomms.backends`` entry point named
  after it (``_load_backend`` in comms/torchcomms/__init__.py);
* ``TorchComm`` forwarding each call with the Python-backend argument lists and turning a
  None result into a completed work, anything else into a work that calls its ``wait()``.
"""

from importlib.metadata import entry_points

from ._comms import (  # noqa: F401
    CommOptions,
    RedOpType,
    ReduceOp,
    TorchComm,
    TorchCommBackend,
    TorchWork,
    _is_backend_registered,
    new_comm,
    register_backend,
)


def _load_backend(backend):
    found = entry_points(group="torchcomms.backends", name=backend)
    if not found:
        raise ModuleNotFoundError(f"failed to find backend {backend}, is it registered via entry_points.txt?")
    (entry,) = found
    entry.load()
