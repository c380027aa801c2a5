"""attn-nvfp4-fusion: attention -> NVFP4 quant -> o_proj fusion for torch.compile.

Importing the package registers the ``torch.ops.fusion_pass`` op library.

* :class:`FusionPass` / :func:`enable`: the Inductor post-grad pass and its registration;
* :func:`list_backends` (:func:`fusion_pass.backends.list_backends`): the fused-attention
  backends and why each is (un)available;
* :mod:`fusion_pass.debug`: graph dumps.
"""

import warnings

# torch warns at import when NumPy is absent; nothing in this package uses NumPy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

from fusion_pass import ops  # noqa: F401,E402  (registers torch.ops.fusion_pass.*)
from fusion_pass import backends, debug  # noqa: E402
from fusion_pass.backends import list_backends  # noqa: E402
from fusion_pass.fusion import FusionPass, enable  # noqa: E402

__version__ = "0.1.0"

__all__ = ["FusionPass", "backends", "debug", "enable", "list_backends"]
