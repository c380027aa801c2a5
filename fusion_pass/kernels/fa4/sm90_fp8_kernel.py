"""FlashAttention-4's SM90 forward with a static per-tensor FP8 epilogue (CuTe DSL; needs FA4).

Imported only by :mod:`fusion_pass.kernels.fa4.sm90_fp8` when the FP8 kernel is compiled (it imports
``flash_attn.cute`` and ``cutlass`` at its top, as :mod:`.sm90_kernel` does).

:class:`FlashAttentionForwardSm90Fp8Static` subclasses the NVFP4 kernel
(:class:`~fusion_pass.kernels.fa4.sm90_kernel.FlashAttentionForwardSm90Nvfp4`): FA4's main loop unchanged, the
base's ``mma`` (which stashes ``aux_data.tensors`` on ``self`` while the kernel body is traced) and its put-back of
masked values (first in the epilogue) inherited.
It overrides:

``__init__``
    FA4's constructor arguments plus the keyword ``nan_byte`` (``0x7E``: NaN -> +448, vLLM's CUDA op, the default;
    ``0x7F``: the canonical NaN, the native form Inductor compiles), a compile-time constant.
``__call__`` (host, ``@cute.jit``)
    ``(mQ, mK, mV, mO, mOut, mAux, softmax_scale, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mPageTable, stream)``:
    FA4's ``__call__`` with ``(mOut, mAux)`` packed into ``AuxData`` (``mAux``: here the inverse scale ``mInv``; the
    group subclass's scales).
``epilogue`` (device, ``@cute.jit``)
    The NVFP4 epilogue's first half unchanged (fp32 accumulator -> query dtype -> ``sO`` through FA4's stmatrix
    copy, no TMA store), then every epilogue thread reads 16 consecutive elements of one row of ``sO``
    (two 128-bit shared loads, the NVFP4 epilogue's thread layout), computes ``q = x * inv`` (``mul.rn.f32``),
    clamps it to ``[-448, 448]`` with ``min.f32`` / ``max.f32`` (which return the non-NaN operand: NaN -> +448,
    ±Inf -> ±448, exactly vLLM's ``fmaxf(-448, fminf(q, 448))``), converts pairs with
    ``cvt.rn.satfinite.e4m3x2.f32`` (round to nearest even) and, for ``nan_byte == 0x7F``, sets the low bit of the
    byte of every NaN product (``0x7E | 1``). The 16 bytes go out as two 8-byte stores. That last step, per
    thread and chunk of 16 values, is :meth:`~FlashAttentionForwardSm90Fp8Static.write_chunk`: the hook another
    FP8 format's subclass overrides (:mod:`.sm90_fp8_group_kernel`). Because the values
    quantized are exactly the bf16/fp16 values FA4 would have stored, the bytes equal
    ``fp8.quantize_static(FA4's own output, inv)`` bit for bit.

Tensors: ``mQ``, ``mK``, ``mV``, ``mO``, the offsets and the paged pair as :mod:`.sm90_kernel`; ``mOut`` uint8
``[T, H*Dv]`` row-major (the float8_e4m3fn bytes; token ``t``, column ``h*Dv + d``), 16-byte aligned; ``mInv``
float32 ``[1]``, the inverse scale, read on the device. Rows outside the sequences are not written.
"""

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Uint32, Uint64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from flash_attn.cute import utils as fa_utils
from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
from flash_attn.cute.named_barrier import NamedBarrierFwd

from fusion_pass.kernels.fa4.sm90_kernel import FlashAttentionForwardSm90Nvfp4

__all__ = ["ELEMS", "FlashAttentionForwardSm90Fp8Static", "NAN_BYTES", "e4m3x4_static"]

NAN_BYTES = (0x7E, 0x7F)
"""The bytes a NaN product may become: +448 (vLLM's ``static_scaled_fp8_quant``) or the canonical NaN."""

ELEMS = 16
"""Elements (and output bytes) per thread and pass: one row, 16 consecutive columns."""


@dsl_user_op
def e4m3x4_static(x0, x1, x2, x3, inv, nan_byte: int, *, loc=None, ip=None) -> Uint32:
    """Four float32 values -> the four float8_e4m3fn bytes of ``clamp(x_j * inv, -448, 448)`` in one 32-bit word
    (``x0`` in bits 0-7): ``mul.rn.f32``; ``min.f32`` / ``max.f32`` (NaN -> +448, ±Inf -> ±448);
    ``cvt.rn.satfinite.e4m3x2.f32`` (``cvt d, a, b`` puts ``a`` in the high byte: pairs go high element first);
    with ``nan_byte == 0x7F`` the low bit of a NaN product's byte is set (``0x7E`` -> ``0x7F``)."""
    assert nan_byte in NAN_BYTES, nan_byte
    values = [Float32(x).ir_value(loc=loc, ip=ip) for x in (x0, x1, x2, x3, inv)]
    lines = ["{", ".reg .f32 q0, q1, q2, q3, p;", ".reg .b16 h0, h1;", ".reg .pred n;", ".reg .b32 m;"]
    for j in range(4):
        lines += [f"mul.rn.f32 q{j}, ${j + 1}, $5;", f"min.f32 q{j}, q{j}, 0f43E00000;",
                  f"max.f32 q{j}, q{j}, 0fC3E00000;"]
    lines += ["cvt.rn.satfinite.e4m3x2.f32 h0, q1, q0;", "cvt.rn.satfinite.e4m3x2.f32 h1, q3, q2;",
              "mov.b32 $0, {h0, h1};"]
    if nan_byte == 0x7F:
        for j in range(4):  # the product again (min/max above dropped its NaN): a NaN test of x_j * inv
            lines += [f"mul.rn.f32 p, ${j + 1}, $5;", "setp.nan.f32 n, p, p;", f"selp.b32 m, {1 << (8 * j)}, 0, n;",
                      "or.b32 $0, $0, m;"]
    lines.append("}")
    word = llvm.inline_asm(T.i32(), values, "\n\t".join(lines), "=r,f,f,f,f,f", loc=loc, ip=ip)
    return Uint32(word)


class FlashAttentionForwardSm90Fp8Static(FlashAttentionForwardSm90Nvfp4):
    """FA4's SM90 forward whose epilogue writes static per-tensor FP8 (module docstring)."""

    def __init__(self, *args, nan_byte: int = 0x7E, **kwargs):
        if nan_byte not in NAN_BYTES:
            raise ValueError(f"nan_byte must be one of {[hex(b) for b in NAN_BYTES]}, got {nan_byte!r}")
        super().__init__(*args, **kwargs)
        self.nan_byte = nan_byte

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mOut: cute.Tensor,
        mAux: cute.Tensor,
        softmax_scale: Float32,
        mCuSeqlensQ: Optional[cute.Tensor] = None,
        mCuSeqlensK: Optional[cute.Tensor] = None,
        mSeqUsedK: Optional[cute.Tensor] = None,
        mPageTable: Optional[cute.Tensor] = None,
        stream: cuda.CUstream = None,  # last: TVM-FFI fills it with the caller's current stream
    ):
        FlashAttentionForwardSm90.__call__(
            self,
            mQ,
            mK,
            mV,
            mO,
            None,  # mLSE
            softmax_scale,
            mCuSeqlensQ,
            mCuSeqlensK,
            mSeqUsedK=mSeqUsedK,
            mPageTable=mPageTable,
            aux_data=self.aux_data(mQ, mK, mV, mPageTable, (mOut, mAux)),
            stream=stream,
        )

    @cute.jit
    def epilogue(
        self,
        acc_O: cute.Tensor,
        lse: cute.Tensor,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        sO: cute.Tensor,
        seqlen,
        gmem_tiled_copy_O: cute.TiledCopy,
        tma_atom_O: Optional[cute.CopyAtom],
        tiled_mma: cute.TiledMma,
        tidx: cutlass.Int32,
        m_block: cutlass.Int32,
        head_idx: cutlass.Int32,
        batch_idx: cutlass.Int32,
    ):
        assert mLSE is None, "the FP8 epilogue writes no LSE"
        assert not self.pack_gqa, "the FP8 epilogue needs pack_gqa=False (one head per tile)"
        mOut, mAux = self._outputs  # stashed by the inherited mma (mAux: the format's second tensor)
        self.put_back_masked_values(acc_O, lse, seqlen, tiled_mma, tidx, m_block, head_idx, batch_idx)

        # 1) FA4's own first half (as the NVFP4 epilogue): fp32 acc -> query dtype -> sO (stmatrix)
        rO = cute.make_fragment_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        cute.arch.barrier(barrier_id=int(NamedBarrierFwd.Epilogue), number_of_threads=self.num_epilogue_threads)
        smem_atom = fa_utils.get_smem_store_atom(self.arch.major * 10 + self.arch.minor, self.dtype)
        smem_thr = cute.make_tiled_copy_C(smem_atom, tiled_mma).get_slice(tidx)
        cute.copy(smem_atom, smem_thr.retile(rO), smem_thr.partition_D(sO))
        # 2) every epilogue thread may now read any element of sO
        cute.arch.barrier(barrier_id=int(NamedBarrierFwd.Epilogue), number_of_threads=self.num_epilogue_threads)

        # 3) thread t reads 16 consecutive elements (chunk t % cpr) of rows t // cpr + k * rows_per_pass
        chunks_per_row = self.tile_hdimv // ELEMS
        thr_layout = cute.make_ordered_layout(
            (self.num_epilogue_threads // chunks_per_row, chunks_per_row), order=(1, 0)
        )
        load_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        tiled_load = cute.make_tiled_copy_tv(load_atom, thr_layout, cute.make_layout((1, ELEMS)))
        thr_load = tiled_load.get_slice(tidx)
        tOsO = thr_load.partition_S(sO)
        tOcO = thr_load.partition_S(cute.make_identity_tensor((self.tile_m, self.tile_hdimv)))
        tOrO = cute.make_fragment_like(tOsO, self.dtype)
        cute.autovec_copy(tOsO, tOrO)

        mOut64 = cute.recast_tensor(mOut, Uint64)  # [T, H*Dv/8]: 8 bytes a word
        rows_left = seqlen.seqlen_q - m_block * self.tile_m
        row0 = seqlen.offset_q + m_block * self.tile_m
        for i in cutlass.range_constexpr(cute.size(tOrO, mode=[1])):
            x = cute.make_fragment_like(tOrO[None, i, None], Float32)
            x.store(tOrO[None, i, None].load().to(Float32))
            # rows past this sequence's end belong to the next sequence's CTA (or are padding): the hook skips them
            self.write_chunk(x, tOcO[0, i, 0][0], tOcO[0, i, 0][1], rows_left, row0, head_idx, mOut64, mAux)

    @cute.jit
    def write_chunk(self, x: cute.Tensor, r_loc, c_loc, rows_left, row0, head_idx, mOut64: cute.Tensor,
                    mInv: cute.Tensor):
        """One thread's 16 float32 values ``x`` of tile row ``r_loc``, columns ``c_loc ..`` of head ``head_idx``:
        their static FP8 bytes into ``mOut64`` (row ``row0 + r_loc``) when the row is the sequence's
        (``r_loc < rows_left``). The hook a format's subclass overrides (every lane calls it)."""
        if r_loc < rows_left:
            inv = mInv[0]
            w0 = e4m3x4_static(x[0], x[1], x[2], x[3], inv, self.nan_byte)
            w1 = e4m3x4_static(x[4], x[5], x[6], x[7], inv, self.nan_byte)
            w2 = e4m3x4_static(x[8], x[9], x[10], x[11], inv, self.nan_byte)
            w3 = e4m3x4_static(x[12], x[13], x[14], x[15], inv, self.nan_byte)
            col = (head_idx * self.tile_hdimv + c_loc) // 8
            mOut64[row0 + r_loc, col] = Uint64(w0) | (Uint64(w1) << 32)
            mOut64[row0 + r_loc, col + 1] = Uint64(w2) | (Uint64(w3) << 32)
