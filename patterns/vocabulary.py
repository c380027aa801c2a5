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
class QuantForm:
    """One quant op of an output format as a graph calls it.

    ``format``: the :class:`~fusion_pass.formats.OutputFormat`'s name; ``op``: the op; ``input``: its argument
    that reads the attention output; ``buffers``: its mutable arguments, the buffers the fused attention call
    writes in their place (the format's buffers, in order); ``scale_input``: its scale argument the fused call
    passes on as the attention op's ``output_scale`` (NVFP4's global scale, FP8's static scale); ``gemm_scale``:
    the argument (a buffer or ``scale_input``) whose value a GEMM of the format must read as its scale;
    ``requires``: ``(argument, accepted values, reason)``: a call whose argument has another value (or one
    known only at run time) is refused with ``reason``; ``forwards``: ``(argument, attention op argument)``: the
    quant's arguments the fused call takes under the attention op's name (FP8 groups: the group size, UE8M0 and the
    scale layout flags). ``scale_input`` None: the format has no scale input (dynamic scales).
    """

    format: str
    op: OpOverload
    input: str
    buffers: tuple[str, ...]
    scale_input: str | None
    gemm_scale: str
    requires: tuple[tuple[str, tuple, str], ...] = ()
    forwards: tuple[tuple[str, str], ...] = ()

    def refusal(self, args: dict) -> str | None:
        """The reason a call with ``args`` (argument name -> value or graph node) is refused, or None."""
        def value(name):
            v = args.get(name)
            return tuple(v) if isinstance(v, list) else v

        return next((reason for name, accepted, reason in self.requires
                     if isinstance(args.get(name), torch.fx.Node) or value(name) not in accepted), None)


FP8_GROUP_REQUIRES = (
    ("group_size", (128,), "fp8_group_size_not_128"),
    ("eps", (1e-10,), "fp8_group_eps_not_1e-10"),
    ("fp8_min", (-448.0,), "fp8_group_range_not_e4m3"),
    ("fp8_max", (448.0,), "fp8_group_range_not_e4m3"),
    ("scale_ue8m0", (False, True), "fp8_group_ue8m0_not_constant"),
    ("dummy_is_scale_transposed", (False, True), "fp8_group_layout_flag_not_constant"),
    ("dummy_is_tma_aligned", (False, True), "fp8_group_layout_flag_not_constant"),
)
"""What a ``per_token_group_fp8_quant`` call must say for the fused call to write its bytes: 128-column groups,
vLLM's ``eps`` and e4m3 range, and constant flags (forwarded to the fused call)."""

FP8_GROUP_FORWARDS = (("group_size", "quant_group_size"), ("scale_ue8m0", "quant_scale_ue8m0"),
                      ("dummy_is_scale_transposed", "quant_col_major"), ("dummy_is_tma_aligned", "quant_tma_aligned"))
"""The group quant's arguments the fused call takes, under vLLM's MLA attention op's names."""


@dataclass(frozen=True)
class GemmForm:
    """One GEMM op that reads a quant's outputs as they are (NVFP4: the packed codes ``[M, K/2]`` and the
    128x4 swizzled block scales; FP8 static: the codes ``[M, K]`` and the quant's scale): the bytes the fused
    attention call writes in their place. ``format``: the output format's name.

    ``activation`` / ``block_scale`` name the op's arguments that take the codes and the quant's scale
    (:attr:`QuantForm.gemm_scale`; through views, dtype views or copies of the same bytes; NVFP4 codes may
    also be zero-padded per row). ``expects``: ``(argument, value)``
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
    format: str = "nvfp4"

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
    with their reason. ``fp8_static_quant`` / ``fp8_static_gemms``: the same for
    static per-tensor FP8 (``static_scaled_fp8_quant``'s schema), ``fp8_group_quant`` /
    ``fp8_group_gemms`` for FP8 128-column groups (``per_token_group_fp8_quant``'s schema; the format
    ``fp8_group128``, its UE8M0 scales forwarded); None / empty: the vocabulary does not fuse that format. :meth:`quant_form` and
    :meth:`gemm_forms` give a format's ops by the format's name.
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
    fp8_static_quant: OpOverload | None = None
    fp8_static_gemms: tuple[GemmForm, ...] = field(default=())
    fp8_group_quant: OpOverload | None = None
    fp8_group_gemms: tuple[GemmForm, ...] = field(default=())

    def quant_form(self, fmt: str) -> QuantForm | None:
        """The quant op of format ``fmt`` in this vocabulary, as a :class:`QuantForm` (None: not bound here)."""
        if fmt == "nvfp4":
            return QuantForm("nvfp4", self.nvfp4_quant, "input", ("output", "output_scale"), "input_scale",
                             "output_scale", (("is_sf_swizzled_layout", (True,), "quant_scales_not_swizzled"),))
        if fmt == "fp8_static" and self.fp8_static_quant is not None:
            return QuantForm("fp8_static", self.fp8_static_quant, "input", ("result",), "scale", "scale",
                             (("group_shape", (None, (-1, -1)), "fp8_static_quant_is_grouped"),))
        if fmt == "fp8_group128" and self.fp8_group_quant is not None:
            return QuantForm("fp8_group128", self.fp8_group_quant, "input", ("output_q", "output_s"), None,
                             "output_s", FP8_GROUP_REQUIRES, FP8_GROUP_FORWARDS)
        return None

    def gemm_forms(self, fmt: str) -> tuple[GemmForm, ...]:
        """The GEMM forms of format ``fmt`` a match must end in."""
        return {"nvfp4": self.nvfp4_gemms, "fp8_static": self.fp8_static_gemms,
                "fp8_group128": self.fp8_group_gemms}.get(fmt, ())

    def foreign_quants(self, fmt: str) -> tuple[OpOverload, ...]:
        """The quant ops a match of format ``fmt`` refuses as another format's (``quant_is_another_format``):
        ``other_quants`` and the quant ops of the other formats this vocabulary binds."""
        bound = (self.quant_form(f) for f in ("nvfp4", "fp8_static", "fp8_group128") if f != fmt)
        return self.other_quants + tuple(form.op for form in bound if form is not None and form.op is not None)

    @property
    def nvfp4_gemm(self) -> OpOverload | None:
        """The first GEMM form's op: ``fusion_pass::nvfp4_gemm`` in the project's and in vLLM's vocabulary
        (kept for readers of the one-op vocabulary; a match accepts any form of ``nvfp4_gemms``)."""
        return self.nvfp4_gemms[0].op if self.nvfp4_gemms else None

    def writing_quantized(self, role: str) -> OpOverload:
        """The op a replacement calls to have ``role``'s attention write its quantized output (every format: the
        op tells the format from the buffers it is given): ``fused_<role>``
        when the vocabulary has one (vLLM: an op of this project that applies the run-time guard
        and otherwise calls vLLM's op), else the attention op itself with ``output_scale``."""
        return getattr(self, f"fused_{role}") or getattr(self, role)

    def writes_native(self, role: str) -> bool:
        """Whether ``role``'s quantized-output op takes ``output_inv_scale`` (static FP8 in the native form, the
        graph's reciprocal of the scale: this project's ops) and the vocabulary has a static FP8 GEMM form."""
        op = self.writing_quantized(role)
        return bool(self.fp8_static_gemms) and op is not None and any(
            a.name == "output_inv_scale" for a in op._schema.arguments)

    def attention_ops(self) -> dict[OpOverload, str]:
        """Attention op -> role name, for the roles this vocabulary has."""
        ops = {self.attention: "attention", self.mla_attention: "mla_attention"}
        return {op: role for op, role in ops.items() if op is not None}


def fusion_pass_vocabulary() -> OpVocabulary:
    """The project's own ``torch.ops.fusion_pass`` library: its NVFP4 GEMM form is ``fusion_pass::nvfp4_gemm``, its
    static FP8 quant ``fusion_pass::static_scaled_fp8_quant`` (vLLM's schema) and its FP8 GEMM ``aten::_scaled_mm``,
    its group FP8 quant ``fusion_pass::per_token_group_fp8_quant`` (vLLM's schema) and GEMM
    ``fusion_pass::fp8_group_gemm``."""
    import fusion_pass.ops  # noqa: F401  (registers the ops)

    ops = torch.ops.fusion_pass
    return OpVocabulary(
        name="fusion_pass",
        attention=ops.attention_with_output.default,
        mla_attention=ops.mla_attention_with_output.default,
        nvfp4_quant=ops.scaled_fp4_quant.out,
        nvfp4_gemms=(GemmForm("fusion_pass::nvfp4_gemm", ops.nvfp4_gemm.default, "a", "block_scale_a",
                              emitted_by=("fusion_pass.demo.layers.NVFP4Linear",)),),
        fp8_static_quant=ops.static_scaled_fp8_quant.default,
        fp8_static_gemms=(GemmForm("aten::_scaled_mm", torch.ops.aten._scaled_mm.default, "self", "scale_a",
                                   emitted_by=("torch._scaled_mm (vLLM's per-tensor FP8 fallback linear)",),
                                   format="fp8_static"),),
        fp8_group_quant=ops.per_token_group_fp8_quant.default,
        fp8_group_gemms=(GemmForm("fusion_pass::fp8_group_gemm", ops.fp8_group_gemm.default, "a", "a_scales",
                                  emitted_by=("a block-FP8 o_proj (DeepSeek-style checkpoints)",),
                                  format="fp8_group128"),),
    )
