"""The run time: per attention call, which rows are fused, by which backend, with which context.

Two hosts on one core. The **core**, which vLLM's integration (:mod:`fusion_pass.vllm.runtime`) and the project's
own engine share:

* :mod:`.guard`: one call's rows -> a :class:`~.guard.Decision` (fused, partial, fallback with a reason);
  :mod:`.policy`: which call classes ``auto`` fuses, by measurement;
* :mod:`.row_plan`: the fused rows to a backend's kernels, the others post-quantized;
* :mod:`.backends`: the fused backends, one module each, in one table (:mod:`.backends.registry`);
* :mod:`.settings`: backend choice, context workspace bound, self-check mode, vLLM standard layers' mixed-call
  split, policy mode; :mod:`.counters`: what the guard decided, counted (``counters.counters()``);
  :mod:`.self_check`: the first-use self-check of a fused kernel.

The **stand-in engine** (:mod:`.engine`), the host the demo, the tests and the benchmarks use: batch metadata
and the forward context (:class:`BatchSpec`, :func:`batch`), the layer registry (:func:`register_layer`), the
MLA and standard runtimes with their KV caches, and one call of the project's attention ops
(:mod:`.engine.attention_call`). The core imports nothing of the engine; this package hands the engine's public
names on.
"""

from fusion_pass.kernels.reference import dense_attention, merge_attention
from fusion_pass.runtime.engine.batch import BatchSpec, RequestSpec, batch, current_batch
from fusion_pass.runtime.engine.mla import MLAAttentionImpl
from fusion_pass.runtime.engine.registry import (
    UnknownLayerError,
    clear_kv_caches,
    get_layer,
    register_layer,
    registered_layers,
    restore_kv_caches,
    snapshot_kv_caches,
    unregister_layer,
)
from fusion_pass.runtime.engine.standard import AttentionImpl
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
