"""Reference attention runtime behind the ``torch.ops.fusion_pass`` attention ops.

The ops look up the layer's impl by ``layer_name`` (:func:`get_layer`), read
the batch from the forward context (:func:`current_batch`) and call
``impl.forward(...)``.  Attention is computed in float32 in plain PyTorch, on
whatever device the inputs live on.
"""

from fusion_pass.runtime.context import (
    BatchSpec,
    RequestSpec,
    batch,
    clear_kv_caches,
    current_batch,
    get_layer,
    register_layer,
    registered_layers,
    restore_kv_caches,
    snapshot_kv_caches,
    unregister_layer,
)
from fusion_pass.dense import attention_with_lse, merge_attention
from fusion_pass.runtime.mla import MLAAttentionImpl
from fusion_pass.runtime.standard import AttentionImpl

__all__ = [
    "RequestSpec",
    "BatchSpec",
    "batch",
    "current_batch",
    "register_layer",
    "get_layer",
    "unregister_layer",
    "registered_layers",
    "clear_kv_caches",
    "snapshot_kv_caches",
    "restore_kv_caches",
    "MLAAttentionImpl",
    "AttentionImpl",
    "attention_with_lse",
    "merge_attention",
]
