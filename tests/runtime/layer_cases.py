"""Layers and batches the run-time tests share: a registered runtime impl driven through its attention op
(:class:`Layer`), the batch kinds (:data:`SPECS`) and the guard on them (:func:`decide`)."""

import torch

import fusion_pass  # noqa: F401  (registers the ops)
from fusion_pass import nvfp4, runtime
from fusion_pass.ops import scaled_fp4_quant
from fusion_pass.runtime import backends, guard

OPS = torch.ops.fusion_pass
CPU = torch.device("cpu")
MLA_DIMS = dict(num_heads=2, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, kv_lora_rank=32)
GQA_DIMS = dict(num_heads=4, num_kv_heads=2, head_dim=16, v_head_dim=16)


class Layer:
    """A registered runtime impl plus the op that drives it."""

    def __init__(self, name, impl, op, make_inputs):
        self.name, self.impl, self.op, self._make_inputs = name, impl, op, make_inputs

    @property
    def width(self):
        return self.impl.num_heads * self.impl.v_head_dim

    def inputs(self, t, seed=0, dtype=torch.bfloat16):
        return self._make_inputs(t, torch.Generator().manual_seed(seed), dtype)

    def attention32(self, specs_and_inputs):
        """float32 attention of the last batch, replaying every batch on a fresh cache."""
        self.impl.clear_cache()
        out = None
        for spec, inputs in specs_and_inputs:
            out = self.impl.forward(*inputs, spec)
        return out.reshape(out.shape[0], -1)

    def call(self, spec, inputs, gs, *, poison=(0xAB, 0xFF)):
        """Run the NVFP4 form of the op on poisoned buffers; return (output, block scale bytes)."""
        t = spec.num_tokens
        output = torch.full((t, self.width // 2), poison[0], dtype=torch.uint8)
        rows, cols = nvfp4.scale_shape(t, self.width)
        block_scale = torch.full((rows, cols // 4), 0, dtype=torch.int32)
        block_scale.view(torch.uint8).fill_(poison[1])
        with runtime.batch(spec):
            self.op(*inputs, output, self.name, gs, block_scale)
        return output, block_scale.view(torch.uint8).view(rows, cols)

    def call_unfused(self, spec, inputs, gs):
        """The unfused graph: attention op with query-dtype output, then the scaled_fp4_quant wrapper."""
        t = spec.num_tokens
        out = torch.empty(t, self.width, dtype=inputs[0].dtype)
        with runtime.batch(spec):
            self.op(*inputs, out, self.name)
        packed, scales = scaled_fp4_quant(out, gs)
        return packed, scales.view(torch.uint8)


def mla_layer():
    d = MLA_DIMS
    g = torch.Generator().manual_seed(123)
    h, nope, v, lora = d["num_heads"], d["qk_nope_head_dim"], d["v_head_dim"], d["kv_lora_rank"]
    weight = torch.randn(h * (nope + v), lora, generator=g) * lora**-0.5
    impl = runtime.MLAAttentionImpl(**d, kv_b_proj_weight=weight, softmax_scale=(nope + d["qk_rope_head_dim"]) ** -0.5)

    def make(t, gen, dtype):
        rope = d["qk_rope_head_dim"]
        return (
            torch.randn(t, h, nope + rope, generator=gen).to(dtype),
            torch.randn(t, lora, generator=gen).to(dtype),
            torch.randn(t, 1, rope, generator=gen).to(dtype),
        )

    return impl, OPS.mla_attention_with_output, make


def gqa_layer():
    d = GQA_DIMS
    impl = runtime.AttentionImpl(**d, softmax_scale=d["head_dim"] ** -0.5)

    def make(t, gen, dtype):
        return (
            torch.randn(t, d["num_heads"], d["head_dim"], generator=gen).to(dtype),
            torch.randn(t, d["num_kv_heads"], d["head_dim"], generator=gen).to(dtype),
            torch.randn(t, d["num_kv_heads"], d["v_head_dim"], generator=gen).to(dtype),
        )

    return impl, OPS.attention_with_output, make


def padding_mask(t, width):
    """bool [rows, cols] over the swizzled scale buffer: True where (row, column) is padding."""
    rows, cols = nvfp4.scale_shape(t, width)
    n_blocks = width // nvfp4.BLOCK_SIZE
    m = torch.arange(t).unsqueeze(1)
    c = torch.arange(n_blocks).unsqueeze(0)
    real = torch.zeros(rows * cols, dtype=torch.bool)
    real[nvfp4.swizzled_offset(m, c, n_blocks).reshape(-1)] = True
    return (~real).view(rows, cols)


GS = torch.tensor([40.0])


# ---------------------------------------------------------------- guard decisions per batch kind

SPECS = {
    "prefill": runtime.BatchSpec.from_lens([5, 3]),
    "decode": runtime.BatchSpec.from_lens([1, 1], [4, 7]),
    "mixed": runtime.BatchSpec.from_lens([1, 6], [3, 0]),
    "chunked": runtime.BatchSpec.from_lens([5, 4], [0, 6]),
    "decodes+chunked": runtime.BatchSpec.from_lens([1, 5], [2, 4]),
    "dcp2": runtime.BatchSpec.from_lens([5, 3], dcp_world_size=2),
    "chunked+dcp2": runtime.BatchSpec.from_lens([5], [4], dcp_world_size=2),
}


def decide(spec, **overrides):
    kwargs = dict(device=CPU, dtype=torch.bfloat16, num_heads=2, qk_head_dim=24, v_head_dim=16)
    kwargs.update(overrides)
    return guard.decide(guard.BatchRows.from_spec(spec), guard.LayerShape(**kwargs))


def dense_causal(q, k, v, cu, scale):
    """float32 causal attention per sequence of a varlen batch (GQA by head grouping)."""
    out = []
    bounds = cu.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        o, _ = runtime.dense_attention(q[s:e].float(), k[s:e].float(), v[s:e].float(), scale=scale, causal=True)
        out.append(o)
    return torch.cat(out)


def nvfp4_buffers(t, width):
    rows, cols = nvfp4.scale_shape(t, width)
    return torch.empty(t, width // 2, dtype=torch.uint8), torch.empty(rows, cols // 4, dtype=torch.int32)


def cuda_backend_reason(name):
    if not torch.cuda.is_available():
        return "needs a CUDA device (the fa4 / triton fused backends)"
    ok, why = backends.get_backend(name).available()
    return None if ok else f"backend {name} unavailable: {why}"
