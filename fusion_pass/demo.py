"""The demo: a scripted serving workload through the demo models, eager and compiled.

The workload has every batch kind the run-time guard distinguishes, in the
order a server would produce them (each step continues the KV caches of the
previous ones):

1. ``prefill``: three new prompts of different lengths;
2. ``decode``: one token for each of them;
3. ``mixed``: two decodes and a new prompt in one batch;
4. ``prefill``: the first chunk of a long prompt;
5. ``chunked``: its second chunk, attending to the first from the cache.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from fusion_pass import runtime
from fusion_pass.models import (
    GQAConfig,
    MLAConfig,
    build_gqa_model,
    build_mla_model,
    calibrate_nvfp4_inputs,
    release_layers,
)
from fusion_pass.runtime import BatchSpec, RequestSpec

MODELS = ("mla", "gqa")


def workload() -> list[BatchSpec]:
    """The scripted batches; decode requests come first in each, as vLLM orders them."""
    return [
        BatchSpec((RequestSpec("a", 37), RequestSpec("b", 101), RequestSpec("c", 64))),
        BatchSpec((RequestSpec("a", 1, 37), RequestSpec("b", 1, 101), RequestSpec("c", 1, 64))),
        BatchSpec((RequestSpec("a", 1, 38), RequestSpec("b", 1, 102), RequestSpec("d", 50))),
        BatchSpec((RequestSpec("e", 96),)),
        BatchSpec((RequestSpec("e", 80, 96),)),
    ]


@dataclass
class BatchResult:
    model: str
    step: int
    kind: str
    tokens: int
    max_abs_diff: float  # max |compiled - eager| over the stack's output
    max_abs_eager: float  # max |eager|, the scale the difference is to be read against


def build_model(name: str, *, tiny: bool = False, device: str = "cpu", layers: int = 2, prefix: str | None = None):
    """The demo model ``name`` (``mla`` or ``gqa``), NVFP4 inputs calibrated on a fixed batch."""
    if name == "mla":
        cfg = MLAConfig.tiny(num_layers=layers) if tiny else MLAConfig(num_layers=layers)
        model = build_mla_model(cfg, prefix=prefix or name, device=device)
    elif name == "gqa":
        cfg = GQAConfig.tiny(num_layers=layers) if tiny else GQAConfig(num_layers=layers)
        model = build_gqa_model(cfg, prefix=prefix or name, device=device)
    else:
        raise ValueError(f"build_model: name must be one of {MODELS}, got {name!r}")
    spec = BatchSpec((RequestSpec("calibration", 64),))
    calibrate_nvfp4_inputs(model, [(spec, make_inputs(spec, cfg.hidden_size, device, seed=1234))])
    return model


def make_inputs(spec: BatchSpec, hidden_size: int, device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positions int64 [T], hidden bf16 [T, hidden_size])`` for a batch, seeded."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(spec.num_tokens, hidden_size, generator=generator).to(device=device, dtype=torch.bfloat16)
    return spec.positions(device=device), hidden


@torch.no_grad()
def run_workload(model, steps: list[BatchSpec], hidden_size: int, device: str) -> list[torch.Tensor]:
    """Run ``steps`` in order from empty KV caches; returns each step's output."""
    runtime.clear_kv_caches()
    outputs = []
    for i, spec in enumerate(steps):
        positions, hidden = make_inputs(spec, hidden_size, device, seed=i)
        torch._dynamo.mark_dynamic(positions, 0)
        torch._dynamo.mark_dynamic(hidden, 0)
        with runtime.batch(spec):
            outputs.append(model(positions, hidden))
    runtime.clear_kv_caches()
    return outputs


def run_demo(models=MODELS, *, tiny: bool = False, device: str = "cpu", layers: int = 2) -> list[BatchResult]:
    """Run the workload eagerly and under torch.compile for each model; compare per batch."""
    results = []
    steps = workload()
    for name in models:
        model = build_model(name, tiny=tiny, device=device, layers=layers)
        hidden_size = model.norms[0].normalized_shape[0]
        try:
            eager = run_workload(model, steps, hidden_size, device)
            compiled = run_workload(torch.compile(model), steps, hidden_size, device)
        finally:
            release_layers(model)
        for i, (spec, ref, out) in enumerate(zip(steps, eager, compiled)):
            diff = (out.float() - ref.float()).abs().max().item()
            results.append(BatchResult(name, i, spec.kind, spec.num_tokens, diff, ref.float().abs().max().item()))
    return results


def format_table(results: list[BatchResult]) -> str:
    header = f"{'model':<6} {'step':>4} {'kind':<8} {'tokens':>6} {'max|compiled-eager|':>20} {'max|eager|':>11}"
    rows = [
        f"{r.model:<6} {r.step:>4} {r.kind:<8} {r.tokens:>6} {r.max_abs_diff:>20.3e} {r.max_abs_eager:>11.3e}"
        for r in results
    ]
    return "\n".join([header, "-" * len(header), *rows])


def results_json(results: list[BatchResult]) -> dict:
    return {"batches": [asdict(r) for r in results]}
