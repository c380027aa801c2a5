"""Op vocabularies: the ops a pattern is written over.

A pattern names roles ("the MLA attention op", "the NVFP4 quant op", ...), never
concrete ops; a vocabulary binds the roles to one library's ops. The same
patterns then match graphs built from ``torch.ops.fusion_pass`` and from any other
library given a vocabulary (vLLM's lives with the vLLM integration,
:func:`fusion_pass.vllm.compile.vocabulary.vllm_vocabulary`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch._ops import OpOverload


@dataclass(frozen=True)
class GemmForm:
    """One NVFP4 GEMM op that reads the quant's outputs as they are: the packed codes ``[M, K/2]`` and the
    128x4 swizzled block scales (the bytes the fused attention call writes in their place).

    ``activation`` / ``block_scale`` name the op's arguments that take them (through views, dtype views or
    copies of the same bytes; the codes may also be zero-padded per row). ``expects``: ``(argument, value)``
    pairs a call must have to be this form (others select another format, e.g. MXFP4). ``refuses``:
    ``(argument, value, reason)``: a call with that value reads a layout the fused call does not write and
    is refused with ``reason``. ``emitted_by`` names what emits the form (documentation only).
    """

    name: str
    op: OpOverload
    activation: str
    block_scale: str
    expects: tuple[tuple[str, object], ...] = ()
    refuses: tuple[tuple[str, object, str], ...] = ()
    emitted_by: tuple[str, ...] = ()

    def takes(self, args: dict) -> bool:
        """Whether a call of ``op`` with ``args`` (argument name -> value; a graph node where the graph computes
        it) is this form."""
        return all(not isinstance(args.get(name), torch.fx.Node) and args.get(name) == value
                   for name, value in self.expects)

    def refusal(self, args: dict) -> str | None:
        """The reason a call of this form with ``args`` is refused (the value named, or one known only at run
        time: a graph node), or None."""
        return next((reason for name, value, reason in self.refuses
                     if isinstance(args.get(name), torch.fx.Node) or args.get(name) == value), None)

    def fits(self, op: OpOverload | None) -> bool:
        """Whether ``op`` (None: absent from this build) has the arguments this form names."""
        names = {a.name for a in op._schema.arguments} if op is not None else set()
        wanted = {self.activation, self.block_scale, *(n for n, _ in self.expects), *(n for n, _, _ in self.refuses)}
        return op is not None and wanted <= names


@dataclass(frozen=True)
class OpVocabulary:
    """One library's ops for each role the patterns use.

    ``attention`` / ``mla_attention`` have the schema of vLLM's
    ``unified_attention_with_output`` / ``unified_mla_attention_with_output``
    (mutable ``output``, optional ``output_scale`` and mutable
    ``output_block_scale``); ``nvfp4_quant`` that of ``scaled_fp4_quant.out``;
    ``nvfp4_gemms`` the GEMM forms (:class:`GemmForm`) that may consume the
    quant's outputs: a match needs one of them. ``other_quants`` are quant ops
    of other formats (a match ending in one is refused with a reason, not
    silently skipped); ``refused_quants`` are ``(op, reason)``: NVFP4 quant ops
    writing a layout the fused call does not write (e.g. 8x4 scales), refused
    with their reason.
    """

    name: str
    attention: OpOverload | None
    mla_attention: OpOverload | None
    nvfp4_quant: OpOverload
    nvfp4_gemms: tuple[GemmForm, ...]
    other_quants: tuple[OpOverload, ...] = field(default=())
    refused_quants: tuple[tuple[OpOverload, str], ...] = field(default=())
    fused_attention: OpOverload | None = None
    fused_mla_attention: OpOverload | None = None

    @property
    def nvfp4_gemm(self) -> OpOverload | None:
        """The first GEMM form's op: ``fusion_pass::nvfp4_gemm`` in the project's and in vLLM's vocabulary
        (kept for readers of the one-op vocabulary; a match accepts any form of ``nvfp4_gemms``)."""
        return self.nvfp4_gemms[0].op if self.nvfp4_gemms else None

    def writing_nvfp4(self, role: str) -> OpOverload:
        """The op a replacement calls to have ``role``'s attention write NVFP4: ``fused_<role>``
        when the vocabulary has one (vLLM: an op of this project that applies the run-time guard
        and otherwise calls vLLM's op), else the attention op itself with ``output_scale``."""
        return getattr(self, f"fused_{role}") or getattr(self, role)

    def attention_ops(self) -> dict[OpOverload, str]:
        """Attention op -> role name, for the roles this vocabulary has."""
        ops = {self.attention: "attention", self.mla_attention: "mla_attention"}
        return {op: role for op, role in ops.items() if op is not None}


def fusion_pass_vocabulary() -> OpVocabulary:
    """The project's own ``torch.ops.fusion_pass`` library: its one GEMM form is ``fusion_pass::nvfp4_gemm``."""
    import fusion_pass.ops  # noqa: F401  (registers the ops)

    ops = torch.ops.fusion_pass
    return OpVocabulary(
        name="fusion_pass",
        attention=ops.attention_with_output.default,
        mla_attention=ops.mla_attention_with_output.default,
        nvfp4_quant=ops.scaled_fp4_quant.out,
        nvfp4_gemms=(GemmForm("fusion_pass::nvfp4_gemm", ops.nvfp4_gemm.default, "a", "block_scale_a",
                              emitted_by=("fusion_pass.demo.layers.NVFP4Linear",)),),
        other_quants=(ops.static_scaled_fp8_quant.default, ops.per_token_group_fp8_quant.default),
    )
