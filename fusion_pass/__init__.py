"""attn-nvfp4-fusion: attention -> NVFP4 quant -> o_proj fusion for torch.compile.

Importing the package registers the ``torch.ops.fusion_pass`` op library.

* :class:`FusionPass` / :func:`enable`: the Inductor post-grad pass and its registration;
* :func:`backends`: the fused-attention backends and why each is (un)available;
* :mod:`fusion_pass.debug`: graph dumps.
"""

from fusion_pass import ops  # noqa: F401  (registers torch.ops.fusion_pass.*)
from fusion_pass import debug
from fusion_pass.fusion import FusionPass, enable

__version__ = "0.1.0"

__all__ = ["FusionPass", "debug", "enable"]
