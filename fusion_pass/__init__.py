"""attn-nvfp4-fusion: attention -> NVFP4 quant -> o_proj fusion for torch.compile.

Importing the package registers the ``torch.ops.fusion_pass`` op library. The folders follow when code runs:

* :mod:`fusion_pass.compile`: the pass (:class:`FusionPass`; :func:`enable`, which returns an :class:`EnabledPass`),
  the matcher, the layout proofs, graph dumps (:mod:`fusion_pass.compile.debug`, also ``fusion_pass.debug``);
* :mod:`fusion_pass.patterns`: the pattern table and op vocabularies;
* :mod:`fusion_pass.ops`: the op library, where compile time and run time meet;
* :mod:`fusion_pass.runtime`: per call, the guard, the row plan, the fused backends
  (:func:`list_backends`, :func:`use_backend`, :func:`set_backend`) and the settings;
* :mod:`fusion_pass.kernels`: attention and NVFP4 kernels (FA4, Triton, the PyTorch reference);
* :mod:`fusion_pass.nvfp4`: the format, byte-exact;
* :mod:`fusion_pass.vllm`: the vLLM integration (needs vLLM); :mod:`fusion_pass.demo`: the demo models and workload.

``fusion_pass.PASS`` (the vLLM pass, ``fusion_pass.vllm.PASS``) exists once :mod:`fusion_pass.vllm` is imported, which
sets it: vLLM looks a pass name ``fusion_pass.vllm.PASS`` up in this package's namespace. This module imports no vLLM.
"""

import warnings

# torch warns at import when NumPy is absent; nothing in this package uses NumPy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

from fusion_pass import ops  # noqa: F401,E402  (registers torch.ops.fusion_pass.*)
from fusion_pass.compile import debug  # noqa: E402
from fusion_pass.compile.graph_pass import EnabledPass, FusionPass, enable  # noqa: E402
from fusion_pass.runtime.backends import list_backends  # noqa: E402
from fusion_pass.runtime.settings import set_backend, use_backend  # noqa: E402

__version__ = "0.1.0"

__all__ = ["EnabledPass", "FusionPass", "debug", "enable", "list_backends", "set_backend", "use_backend"]
