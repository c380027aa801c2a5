"""attn-nvfp4-fusion: attention -> NVFP4 quant -> o_proj fusion for torch.compile.

Importing the package registers the ``torch.ops.fusion_pass`` op library.
"""

from fusion_pass import ops  # noqa: F401  (registers torch.ops.fusion_pass.*)

__version__ = "0.1.0"
