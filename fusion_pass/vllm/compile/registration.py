"""The pass object vLLM's pass names refer to.

vLLM resolves an ``inductor_passes`` name ``a.b.PASS`` as ``__import__("a.b").__dict__["PASS"]``; ``__import__``
returns the top-level package, so the name ``"fusion_pass.vllm.PASS"`` is looked up in ``fusion_pass``'s
namespace. Importing this module (``fusion_pass.vllm`` does) creates the one :data:`PASS` and sets
``fusion_pass.PASS`` to it; ``"fusion_pass_vllm.PASS"`` (the top-level module) names the same object.
``import fusion_pass`` alone imports no vLLM and has no ``PASS``.
"""

from __future__ import annotations

import fusion_pass
from fusion_pass.vllm.compile.inductor_pass import FusionPassForVllm

__all__ = ["PASS"]

PASS = FusionPassForVllm()
fusion_pass.PASS = PASS
