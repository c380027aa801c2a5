"""Never slower, by measurement: whether ``auto`` fuses a call of a given class on a given GPU generation.

A fused call is only worth taking where it is faster than the unfused path the user would otherwise run. Whether
it is depends on the call's *class*: the GPU generation, and how its rows would be written (:data:`ROW_PLANS`):

* ``prefill``: a call of prefill rows only, one fused launch (with or without cached context);
* ``mixed_split_free``: decode rows beside prefill rows, where the unfused backend computes the two apart anyway
  (vLLM's MLA layers, FlashInfer): the fused launch replaces the prefill launch;
* ``mixed_split``: decode rows beside prefill rows of a backend that attends every row in one launch (vLLM's
  FLASH_ATTN and CPU_ATTN, the project's runtime where the one call is refused): fusing the prefill rows adds a
  launch for the decode rows;
* ``mixed_one_call``: every row of such a call, decode rows included, in one fused launch over the paged cache.

:data:`POLICY_TABLE` says, per generation and class, whether ``auto`` fuses and on which measurement (or, where
nothing was measured, on what). A class the table refuses falls back with reason ``slower_here``; the table is
shown by ``fusion-pass backends`` and :func:`describe`. The setting :func:`fusion_pass.runtime.settings.policy_mode`
(``FUSION_PASS_POLICY``) replaces it: ``measured`` (the default) reads the table, ``always`` fuses every class a
backend can run. A backend named explicitly (``FUSION_PASS_BACKEND=fa4``) runs wherever it works, as before; the
table speaks for ``auto`` only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusion_pass.runtime import settings

__all__ = ["POLICY_TABLE", "ROW_PLANS", "Rule", "describe", "generation", "verdict"]

ROW_PLANS = ("prefill", "mixed_split_free", "mixed_split", "mixed_one_call")
"""How a call's rows are written (module docstring)."""


@dataclass(frozen=True)
class Rule:
    """One entry of the table: ``auto`` fuses calls of class ``rows`` on ``generation`` iff ``fuse``;
    ``measured`` says whether ``evidence`` is this project's measurement (else what the choice rests on)."""

    generation: str
    rows: str
    fuse: bool
    measured: bool
    evidence: str


_TRACE = "bench/serving_trace.py --clock graph, H200, 2026-12-02 (docs/benchmarks.md)"
_KERNELS = "bench/attention.py, H200, 2026-12-02 (docs/benchmarks.md)"
_PAGED = "bench/serving_trace.py --clock graph --page-size 16, H200, 2026-12-05 (docs/benchmarks.md)"
_PAGED_H100 = "the same bench, H100, 2026-12-05"

POLICY_TABLE: tuple[Rule, ...] = (
    Rule("cpu", "prefill", True, False, "the CPU path: the reference backend, what the tests and the demo run"),
    Rule("cpu", "mixed_split_free", True, False, "the CPU path"),
    Rule("cpu", "mixed_split", True, False, "the CPU path"),
    Rule("cpu", "mixed_one_call", True, False, "the CPU path"),
    Rule("sm90", "prefill", True, True,
         f"fused FA4 at 0.98x-1.30x of FA4 + quant and 0.89x-2.00x of cuDNN + quant over 24 prefill shapes "
         f"({_KERNELS}; vLLM's FA3 + quant not measured)"),
    Rule("sm90", "mixed_split_free", False, True,
         f"prefill rows fused beside separately computed decode rows: 1.008x overall at budget 2048 but 0.985x at "
         f"8192, 4 and 17 of 59 steps below 0.99x (MLA; {_TRACE})"),
    Rule("sm90", "mixed_split", False, True,
         f"the split adds a launch: 0.907x-0.953x of one unfused call overall, 35-49 of 59 steps below 0.99x "
         f"(MLA and GQA, budgets 2048 and 8192; {_TRACE})"),
    Rule("sm90", "mixed_one_call", False, True,
         f"the paged fused call against FA4's paged call + quant: 0.999x-1.011x overall on the steps with prefill "
         f"rows, 0.983x-0.989x on decode-only steps, no step resolved beyond the noise of identical calls "
         f"(0.91x-1.10x) (MLA and GQA, budgets 2048 and 8192; {_PAGED}); again on an H100 with the variants "
         f"interleaved, 0.999x-1.013x overall, worst steps 0.93x-0.97x ({_PAGED_H100}): no measurable gain; FA4 "
         f"has no split-KV decode on SM90 where vLLM's FA3 splits long decode rows"),
    Rule("sm100", "prefill", True, False,
         "no Blackwell GPU was lent to this project: FA4 is the fastest published SM100 prefill "
         "kernel, and the fused call replaces its launch and the quant's"),
    Rule("sm100", "mixed_split_free", True, False,
         "the unfused backend (vLLM's MLA, FlashInfer) launches the prefill rows apart anyway; the "
         "fused launch replaces that one"),
    Rule("sm100", "mixed_split", False, False, "the split adds a launch (measured slower on SM90)"),
    Rule("sm100", "mixed_one_call", False, False,
         "FA4's decode rows against FlashInfer's trtllm-gen decode kernels are unknown"),
)
"""The policy, one rule per (generation, row plan); what a generation without rules gets: :func:`verdict`."""

_RULES = {(r.generation, r.rows): r for r in POLICY_TABLE}


def generation(device) -> str:
    """``"cpu"``, ``"sm90"``, ``"sm100"`` (SM100/SM110) or ``"sm<NN>"`` for another CUDA device; ``"cuda"`` when
    its compute capability cannot be read."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    from fusion_pass.kernels.fa4.generations import for_arch
    from fusion_pass.runtime.backends.fa4 import device_arch

    arch = device_arch(device.index)
    if arch is None:
        return "cuda"
    found = for_arch(arch)
    return found.name if found is not None else f"sm{arch}"


def verdict(device, rows: str) -> tuple[bool, str]:
    """``(fuse, why)`` for a call of row plan ``rows`` (one of :data:`ROW_PLANS`) on ``device`` under the
    configured policy mode (module docstring). A generation the table does not list: fused only as ``prefill``
    (where the backend is the only kernel of its kind), the rest not measured and not fused."""
    if rows not in ROW_PLANS:
        raise ValueError(f"rows={rows!r} is not a row plan; one of {', '.join(ROW_PLANS)}")
    if settings.policy_mode() == "always":
        return True, f"{settings.POLICY_ENV}=always"
    gen = generation(device)
    rule = _RULES.get((gen, rows))
    if rule is None:
        if rows == "prefill":
            return True, f"no measurement on {gen}; prefill calls are fused"
        return False, f"not measured on {gen}"
    return rule.fuse, ("measured: " if rule.measured else "not measured: ") + rule.evidence


def describe(device=None) -> list[dict]:
    """The table as rows ``{"generation", "rows", "fuse", "measured", "evidence"}``; with ``device``, only its
    generation's."""
    gen = None if device is None else generation(device)
    return [dict(generation=r.generation, rows=r.rows, fuse=r.fuse, measured=r.measured, evidence=r.evidence)
            for r in POLICY_TABLE if gen is None or r.generation == gen]
