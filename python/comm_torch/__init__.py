"""PyTorch and torchcomms backends over libcomm (the ``comm`` collective library).

``import comm_torch`` registers the torch.distributed backend "comm"; on torch 2.15 and
later the ``torch.distributed.backends`` entry point does it without the import. The
torchcomms backend "comm" is in ``comm_torch.torchcomms_backend`` and is found through the
``torchcomms.backends`` entry point.
"""

from importlib import metadata as _metadata

from ._lib import CommError, features, library_path, load_library, version

try:  # pyproject.toml holds the one copy of the version; installing records it here.
    __version__ = _metadata.version("comm-torch")
except _metadata.PackageNotFoundError:  # pragma: no cover - imported from a checkout, not installed
    __version__ = "0+unknown"
__all__ = [
    "CommError",
    "allocate_symmetric_memory",
    "features",
    "free_symmetric_memory",
    "library_path",
    "load_library",
    "register",
    "symm_mem",
    "version",
]

try:
    import torch.distributed as _dist

    _HAVE_DIST = _dist.is_available()
except ImportError:  # pragma: no cover
    _HAVE_DIST = False

if _HAVE_DIST:
    from . import symm_mem
    from .backend import register
    from .symmetric import allocate_symmetric_memory, free_symmetric_memory

    register()
else:  # pragma: no cover

    def register() -> None:
        raise RuntimeError("comm_torch: this torch build has no torch.distributed")
