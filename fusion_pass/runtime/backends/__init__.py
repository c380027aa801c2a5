"""The fused backends: one module each (:mod:`.fa4`, :mod:`.triton`, :mod:`.reference`), what a backend is
(:mod:`.base`), the one table of them in ``auto``'s order (:mod:`.registry`) and the choice of one for a layer
(:mod:`.selection`)."""

from fusion_pass.runtime.backends.base import Backend
from fusion_pass.runtime.backends.canary import canary_batches
from fusion_pass.runtime.backends.fa4 import FA4Backend, fa4_status
from fusion_pass.runtime.backends.reference import ReferenceBackend
from fusion_pass.runtime.backends.selection import BACKEND_ORDER, get_backend, list_backends, refresh, select_backend
from fusion_pass.runtime.backends.triton import TritonBackend, triton_availability

__all__ = [
    "BACKEND_ORDER",
    "Backend",
    "FA4Backend",
    "ReferenceBackend",
    "TritonBackend",
    "canary_batches",
    "fa4_status",
    "get_backend",
    "list_backends",
    "refresh",
    "select_backend",
    "triton_availability",
]
