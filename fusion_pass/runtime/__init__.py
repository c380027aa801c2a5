"""The run time: per attention call, which rows are fused, by which backend, with which context.

* :mod:`.batch`: :class:`BatchSpec` / :class:`RequestSpec` and the forward context (:func:`batch`);
* :mod:`.registry`: ``layer_name`` -> the layer's runtime (:func:`register_layer`, names global to the process);
* :mod:`.mla`, :mod:`.standard`: the MLA and MHA/GQA runtimes with their KV caches (:mod:`.cache`);
* :mod:`.attention_call`: one call: :mod:`.guard` decision -> :mod:`.row_plan` -> :mod:`.backends` -> kernels;
* :mod:`.counters`: what the guard decided, counted (``counters.counters()``); :mod:`.settings`: backend choice,
  context workspace bound, self-check mode, vLLM standard layers' mixed-call split; :mod:`.self_check`: the
  first-use self-check of a fused kernel.
"""

from fusion_pass.kernels.reference import dense_attention, merge_attention
from fusion_pass.runtime.batch import BatchSpec, RequestSpec, batch, current_batch
from fusion_pass.runtime.mla import MLAAttentionImpl
from fusion_pass.runtime.registry import (
    UnknownLayerError,
    clear_kv_caches,
    get_layer,
    register_layer,
    registered_layers,
    restore_kv_caches,
    snapshot_kv_caches,
    unregister_layer,
)
from fusion_pass.runtime.self_check import run_self_check, self_check_results
from fusion_pass.runtime.settings import (
    context_workspace_tokens,
    self_check_mode,
    set_backend,
    set_context_workspace_tokens,
    set_self_check,
    set_split_mixed,
    split_mixed,
    use_backend,
    use_context_workspace_tokens,
    use_self_check,
    use_split_mixed,
)
from fusion_pass.runtime.standard import AttentionImpl

__all__ = [
    "AttentionImpl",
    "BatchSpec",
    "MLAAttentionImpl",
    "RequestSpec",
    "UnknownLayerError",
    "batch",
    "clear_kv_caches",
    "context_workspace_tokens",
    "current_batch",
    "dense_attention",
    "get_layer",
    "merge_attention",
    "register_layer",
    "registered_layers",
    "restore_kv_caches",
    "run_self_check",
    "self_check_mode",
    "self_check_results",
    "set_backend",
    "set_context_workspace_tokens",
    "set_self_check",
    "set_split_mixed",
    "snapshot_kv_caches",
    "split_mixed",
    "unregister_layer",
    "use_backend",
    "use_context_workspace_tokens",
    "use_self_check",
    "use_split_mixed",
]
