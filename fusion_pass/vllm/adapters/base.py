"""What an attention-backend adapter supplies: the one interface the guard and the fused rows read.

A fused call writes a layer's prefill rows with the project's fused kernel; everything else a vLLM backend owns
comes through its adapter: which rows the step holds (read from host-side metadata only), why the adapter cannot
compute this call's decode rows apart, why it cannot read this layer's cached context, and the decode rows
themselves, computed by vLLM's own code so that their bytes are the unfused graph's. MLA layers are stated in the
same terms (:mod:`.mla`); standard layers have one adapter per vLLM attention backend (:mod:`.cpu_attn`,
:mod:`.flash_attn`, :mod:`.flashinfer`), looked up by the backend's name (:mod:`.registry`).
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["BackendAdapter"]


class BackendAdapter(Protocol):
    """A vLLM attention backend, as the fused path uses it.

    Attributes:
        NAME: vLLM's backend name (``AttentionBackend.get_name()``: ``"CPU_ATTN"``, ``"FLASH_ATTN"``,
            ``"FLASHINFER"``), or ``"MLA"`` for every MLA backend.
        BUILDER: ``(module, class)`` of the backend's metadata builder whose ``build`` gets the host-rows hook
            (:func:`fusion_pass.vllm.adapters.host_rows.install_build_hook`), or None when its metadata holds the
            host values itself.
        SPLITS_MIXED: whether the backend itself computes a call's decode rows and prefill rows in separate launches
            (MLA, FlashInfer): fusing the prefill rows of a mixed call then adds no launch, so such calls are fused
            whatever the split setting; a backend that attends every row in one launch (FLASH_ATTN, CPU_ATTN) has
            its mixed calls split only when asked (:func:`fusion_pass.runtime.settings.split_mixed`).

    A standard backend's adapter also hands a whole call to one paged launch
    (:class:`fusion_pass.vllm.adapters.paged.PagedKVCache`: ``paged_refusal(layer, md, kv_cache)`` says why not,
    ``paged_inputs(layer, md, rows, kv_cache, device)`` gives the cache's pages, offsets, lengths and block table);
    the guard prefers that launch to the split where the backend and the policy run it.
    """

    NAME: str
    BUILDER: tuple[str, str] | None
    SPLITS_MIXED: bool

    def rows(self, md, dcp_world_size: int):
        """The step's rows (:class:`fusion_pass.vllm.adapters.host_rows.StepRows`) from host-side values of the
        metadata only, kept on ``md``; None when the metadata holds no host copy of the batch."""

    def decode_refusal(self, layer, md) -> str | None:
        """Why the adapter cannot compute this call's decode rows apart from its prefill rows, or None."""

    def context_refusal(self, layer, kv_cache) -> str | None:
        """Why the adapter cannot read the cached context of this layer's prefills from ``kv_cache``, or None."""

    def run_decode(self, layer, md, rows, inputs, kv_cache, out) -> str:
        """vLLM's attention of the call's decode rows (``rows.decode``, in order) into ``out`` (``[D, H * Dv]``
        in the query dtype), computed as the backend's unfused path computes them. ``inputs``: the op's tensor
        inputs (standard: ``query, key, value``; MLA: ``q, kv_c_normed, k_pe`` and the op's extra arguments).
        Returns how they were computed (a name counted by the adapter, e.g. ``"sub_batch"``)."""
