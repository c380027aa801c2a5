"""Hostile arguments at the run time's public entry points (issue 29, item 6b and 6d).

* Integer arguments take numpy integers wherever they take ints (docs/usage.md, "Argument checks"), bools and
  floats refused: every settings setter / ``use_*`` that takes an int, the layers' dimensions, the batch lengths,
  the kernels' host ints.
* A wrong type or shape raises :class:`fusion_pass.nvfp4.ArgumentError` (a ValueError and a TypeError, so code
  catching either keeps working) naming the function, the argument and what was expected, before anything
  changes: the table below is the generated test's input, one row per (entry point, bad argument).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fusion_pass
from fusion_pass import kernels, nvfp4, runtime
from fusion_pass.nvfp4 import ArgumentError
from fusion_pass.runtime import counters, settings
from fusion_pass.runtime.engine.batch import current_batch


@pytest.fixture(autouse=True)
def _clean_state(clean_backend_state):
    yield


def _enter(manager):
    """Enter and leave a context manager (the setters' ``use_*`` form)."""
    with manager:
        pass


def _impl(**overrides):
    kwargs = dict(num_heads=2, num_kv_heads=1, head_dim=16, softmax_scale=0.25)
    kwargs.update(overrides)
    return runtime.AttentionImpl(**kwargs)


def _mla(**overrides):
    kwargs = dict(num_heads=2, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, kv_lora_rank=32,
                  kv_b_proj_weight=torch.zeros(2 * 32, 32), softmax_scale=0.25)
    kwargs.update(overrides)
    return runtime.MLAAttentionImpl(**kwargs)


# ------------------------------------------------------------------ numpy integers work wherever ints do (6b)

NUMPY_INTS = [np.int64(4096), np.int32(4096), np.uint16(4096)]


@pytest.mark.parametrize("tokens", NUMPY_INTS, ids=lambda x: type(x).__name__)
def test_settings_take_numpy_integers(tokens):
    with settings.use_context_workspace_tokens(tokens):
        got = settings.context_workspace_tokens()
        assert got == 4096 and type(got) is int
    assert settings.set_context_workspace_tokens(tokens) is None
    got = settings.context_workspace_tokens()
    assert got == 4096 and type(got) is int
    assert runtime.use_context_workspace_tokens is settings.use_context_workspace_tokens


@pytest.mark.parametrize("bad", [True, False, 4096.0, np.float64(4096), [4096], np.int64(0), np.int64(-1)],
                         ids=repr)
def test_settings_refuse_bools_floats_and_other_types(bad):
    for call in (lambda: _enter(settings.use_context_workspace_tokens(bad)),
                 lambda: settings.set_context_workspace_tokens(bad)):
        with pytest.raises(ArgumentError, match=r"must be a positive number of tokens"):
            call()
    assert settings.context_workspace_tokens() == settings.DEFAULT_CONTEXT_WORKSPACE_TOKENS


def test_layers_batches_and_kernels_take_numpy_integers():
    impl = _impl(num_heads=np.int64(2), num_kv_heads=np.int32(1), head_dim=np.int64(16), v_head_dim=np.int16(16))
    assert (impl.num_heads, impl.num_kv_heads, impl.head_dim, impl.v_head_dim) == (2, 1, 16, 16)
    assert all(type(x) is int for x in (impl.num_heads, impl.num_kv_heads, impl.head_dim, impl.v_head_dim))
    mla = _mla(num_heads=np.int64(2), kv_lora_rank=np.int64(32))
    assert (mla.num_heads, mla.kv_lora_rank) == (2, 32)
    spec = runtime.BatchSpec.from_lens(np.array([1, 5]), np.array([3, 0]), dcp_world_size=np.int64(1))
    assert spec == runtime.BatchSpec.from_lens([1, 5], [3, 0])
    assert runtime.RequestSpec("a", np.int64(3), np.uint8(2)).query_len == 3
    q = k = v = torch.zeros(6, 1, 16, dtype=torch.bfloat16)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    out = kernels.attention(q, k, v, cu, np.int64(6), backend="reference", cu_seqlens_k=cu, max_seqlen_k=np.int32(6))
    assert out.shape == (6, 1, 16)
    assert nvfp4.scale_shape(np.int64(20), np.int64(64)) == (128, 4)
    with pytest.raises(ValueError, match="k must be divisible by 16"):
        nvfp4.scale_shape(20, np.int64(20))  # a numpy integer is checked like an int


# ------------------------------------------------------------------ wrong types and shapes: ArgumentError (6d)

# (id, the call, the words its message must hold: the entry point, the argument, what was expected)
CASES = [
    ("RequestSpec-request_id", lambda: runtime.RequestSpec(1, 3), ["RequestSpec", "request_id", "non-empty str", "int"]),
    ("RequestSpec-query_len-str", lambda: runtime.RequestSpec("a", "3"), ["RequestSpec", "query_len", "an int", "str"]),
    ("RequestSpec-query_len-bool", lambda: runtime.RequestSpec("a", True), ["query_len", "an int", "bool"]),
    ("RequestSpec-context_len-float", lambda: runtime.RequestSpec("a", 3, 2.0), ["context_len", "an int", "float"]),
    ("BatchSpec-requests-int", lambda: runtime.BatchSpec(5), ["BatchSpec", "requests", "sequence of RequestSpec"]),
    ("BatchSpec-requests-item", lambda: runtime.BatchSpec([1]), ["BatchSpec", "requests", "RequestSpec", "int"]),
    ("BatchSpec-dcp_world_size", lambda: runtime.BatchSpec((runtime.RequestSpec("a", 2),), dcp_world_size=1.0),
     ["BatchSpec", "dcp_world_size", "an int", "float"]),
    ("from_lens-bool", lambda: runtime.BatchSpec.from_lens([3, True]),
     ["BatchSpec.from_lens", "query_lens[1]", "an int", "bool"]),
    ("from_lens-int", lambda: runtime.BatchSpec.from_lens(5), ["BatchSpec.from_lens", "query_lens", "sequence", "int"]),
    ("from_lens-str", lambda: runtime.BatchSpec.from_lens("35"), ["BatchSpec.from_lens", "query_lens", "sequence"]),
    ("from_lens-context", lambda: runtime.BatchSpec.from_lens([3], 4), ["from_lens", "context_lens", "sequence"]),
    ("from_lens-context-item", lambda: runtime.BatchSpec.from_lens([3], [0.5]), ["context_lens[0]", "an int"]),
    ("from_lens-ids", lambda: runtime.BatchSpec.from_lens([3], request_ids=[1]), ["request_ids[0]", "non-empty str"]),
    ("from_lens-lengths", lambda: runtime.BatchSpec.from_lens([3, 4], [0]), ["from_lens", "query_lens", "context_lens"]),
    ("batch", lambda: runtime.batch(42), ["batch", "spec", "BatchSpec", "int"]),
    ("register_layer", lambda: runtime.register_layer(1, object()), ["register_layer", "name", "non-empty str", "int"]),
    ("AttentionImpl-num_heads", lambda: _impl(num_heads=2.0), ["AttentionImpl", "num_heads", "positive int", "float"]),
    ("AttentionImpl-head_dim-bool", lambda: _impl(head_dim=True), ["AttentionImpl", "head_dim", "positive int", "bool"]),
    ("AttentionImpl-group", lambda: _impl(num_heads=3, num_kv_heads=2), ["AttentionImpl", "num_heads", "multiple"]),
    ("AttentionImpl-softmax_scale", lambda: _impl(softmax_scale="0.1"), ["AttentionImpl", "softmax_scale", "positive"]),
    ("MLAAttentionImpl-kv_lora_rank", lambda: _mla(kv_lora_rank="32"), ["MLAAttentionImpl", "kv_lora_rank", "int"]),
    ("MLAAttentionImpl-weight", lambda: _mla(kv_b_proj_weight=torch.zeros(3)),
     ["MLAAttentionImpl", "kv_b_proj_weight", "shape"]),
    ("counters-item", lambda: counters.counters(layers=[1]), ["counters", "layers", "layer names (str)", "int"]),
    ("counters-int", lambda: counters.counters(layers=5), ["counters", "layers", "iterable of layer names", "int"]),
    ("list_backends-str", lambda: fusion_pass.list_backends("gpu"), ["list_backends", "device", "'gpu'", "'cuda'"]),
    ("list_backends-float", lambda: runtime.backends.list_backends(3.0), ["list_backends", "device", "float"]),
    ("set_context_workspace_tokens", lambda: settings.set_context_workspace_tokens(True),
     ["set_context_workspace_tokens", "tokens", "positive number of tokens"]),
    ("use_context_workspace_tokens", lambda: _enter(runtime.use_context_workspace_tokens(2.5)),
     ["use_context_workspace_tokens", "tokens", "positive number of tokens"]),
    ("set_backend", lambda: fusion_pass.set_backend(1), ["set_backend", "name", "auto, fa4, triton, reference"]),
    ("kernels-max_seqlen", lambda: kernels.attention(*_qkv_cu(), 6.0, backend="reference"),
     ["attention", "max_seqlen", "non-negative int", "float"]),
]


def _qkv_cu():
    q = torch.zeros(6, 1, 16, dtype=torch.bfloat16)
    return q, q, q, torch.tensor([0, 6], dtype=torch.int32)


def _state():
    return (dict(runtime.registered_layers()), counters.counters(), settings.configured_backend(),
            settings.context_workspace_tokens())


@pytest.mark.parametrize("call, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_wrong_argument_is_an_argument_error_naming_it(call, words):
    before = _state()
    with pytest.raises(ArgumentError) as caught:
        call()
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, TypeError)  # `except` either: still caught
    message = str(caught.value)
    missing = [w for w in words if w not in message]
    assert not missing, f"{missing} not in {message!r}"
    assert _state() == before, "the call changed something before it raised"
    with pytest.raises(RuntimeError, match="no batch is set"):
        current_batch()  # batch(42) did not make 42 (or anything) the current batch


def test_the_table_covers_every_entry_point_of_the_issue():
    ids = {c[0].split("-")[0] for c in CASES}
    assert {"RequestSpec", "from_lens", "batch", "register_layer", "AttentionImpl", "counters",
            "list_backends"} <= ids
