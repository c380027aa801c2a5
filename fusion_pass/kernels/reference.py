"""Dense float32 attention returning the log-sum-exp, and the LSE merge: the attention oracle.

The two primitives both runtimes are built from, and the ``reference`` body of
the kernels' entry points (it sits below both, as :mod:`fusion_pass.nvfp4`
does). Everything is computed in float32 whatever the input dtype, on the
inputs' device.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from fusion_pass.nvfp4.reference import write_rows

__all__ = ["dense_attention", "gather_paged", "merge_attention", "merge_nvfp4", "paged_attention", "varlen_attention"]


def _check_heads(name: str, heads: int, num_heads: int) -> None:
    if heads < 1 or num_heads % heads != 0:
        raise ValueError(f"{name} has {heads} heads, which does not divide the {num_heads} query heads")


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    q_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q`` over ``k``/``v``, with its log-sum-exp.

    Args:
        q: ``[Tq, H, Dqk]``.
        k: ``[Tk, Hk, Dqk]`` with ``H % Hk == 0`` (``Hk`` is ``H`` or the
            number of kv heads; query head ``h`` uses key head ``h // (H // Hk)``).
        v: ``[Tk, Hv, Dv]`` with ``H % Hv == 0``, grouped the same way.
        scale: multiplies ``q @ k^T`` before the softmax.
        causal: if true, query ``i`` (absolute position ``q_offset + i``; keys
            are at positions ``0 .. Tk-1``) sees only keys ``j <= q_offset + i``.
            ``q_offset`` is ignored when ``causal`` is false.

    Returns:
        ``(out, lse)``: float32 ``[Tq, H, Dv]`` and float32 ``[Tq, H]`` where
        ``lse = logsumexp_j(scale * q.k_j)`` over visible keys.  A row with no
        visible key gets ``out = 0`` and ``lse = -inf`` (never NaN).

    Non-finite values: a key a query does not see (``causal``) contributes nothing to its row, whatever its
    value holds (a NaN or Inf in a later token's value does not reach earlier rows). The values of the keys
    a row sees combine as IEEE arithmetic combines them in ``P @ V``: a NaN makes the element NaN (so does an
    Inf whose probability underflowed to 0), ``±Inf`` stays ``±Inf``, ``+Inf`` beside ``-Inf`` makes NaN.
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"q, k, v must be 3-D [T, heads, dim]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    tq, h, d = q.shape
    tk, hk, dk = k.shape
    hv = v.shape[1]
    if dk != d:
        raise ValueError(f"k head dim {dk} != q head dim {d}")
    if v.shape[0] != tk:
        raise ValueError(f"k has {tk} tokens but v has {v.shape[0]}")
    _check_heads("k", hk, h)
    _check_heads("v", hv, h)

    qf, kf, vf = q.float(), k.float(), v.float()
    # Group query heads by the key head they share: [Tq, Hk, H//Hk, D].
    scores = torch.einsum("qkgd,tkd->kgqt", qf.reshape(tq, hk, h // hk, d), kf)
    scores = scores.reshape(h, tq, tk) * scale
    hidden = None
    if causal:
        qpos = torch.arange(tq, device=q.device).unsqueeze(1) + q_offset
        kpos = torch.arange(tk, device=q.device).unsqueeze(0)
        hidden = kpos > qpos  # [Tq, Tk]
        scores = scores.masked_fill(hidden, float("-inf"))

    lse = torch.logsumexp(scores, dim=-1)  # [H, Tq]; -inf for rows with no visible key
    # exp(-inf - 0) = 0 for such rows instead of exp(-inf - -inf) = NaN.
    probs = torch.exp(scores - torch.where(torch.isneginf(lse), 0.0, lse).unsqueeze(-1))
    probs = probs.reshape(hv, h // hv, tq, tk)
    # A masked key has probability 0, and 0 * NaN (or Inf) in P @ V would let a later token's non-finite value
    # reach earlier rows: only when some key is masked (host ints) and v holds a non-finite value (one
    # reduction) are those terms left out.
    if hidden is not None and tq > 0 and tk - 1 > q_offset and not bool(torch.isfinite(vf).all()):
        out = _masked_pv(probs, vf, ~hidden)
    else:
        out = torch.einsum("vgqt,tvd->qvgd", probs, vf)
    return out.reshape(tq, h, v.shape[2]), lse.transpose(0, 1).contiguous()


def _masked_pv(probs: Tensor, vf: Tensor, visible: Tensor) -> Tensor:
    """``P @ V`` (``probs [Hv, G, Tq, Tk]``, float32 ``vf [Tk, Hv, Dv]`` holding a non-finite value) without the
    terms of keys ``visible [Tq, Tk]`` hides, as ``[Tq, Hv, G, Dv]``.

    The finite values go through one matmul with the non-finite ones replaced by 0 (an element whose column of
    ``v`` is finite gets exactly the plain product's value). The non-finite terms ``p * v`` of visible keys are
    added by kind, as IEEE arithmetic combines them in the plain product: any NaN (``v`` NaN, or ``0 * ±Inf``
    where ``p`` underflowed to 0), or ``+Inf`` beside ``-Inf``, makes NaN; else ``±Inf`` where some ``p > 0``
    meets ``±Inf``. Counted by matmuls of indicators, so memory stays that of the scores."""
    finite = torch.isfinite(vf)
    out = torch.einsum("vgqt,tvd->qvgd", probs, torch.where(finite, vf, 0.0))
    vis = visible.to(probs.dtype)  # [Tq, Tk]
    seen = vis.expand_as(probs)
    zero = (probs == 0).to(probs.dtype) * vis
    positive = (probs > 0).to(probs.dtype) * vis
    nan_v, inf_v = torch.isnan(vf).to(probs.dtype), torch.isinf(vf).to(probs.dtype)
    pos_v, neg_v = torch.isposinf(vf).to(probs.dtype), torch.isneginf(vf).to(probs.dtype)

    def count(weights: Tensor, indicator: Tensor) -> Tensor:
        return torch.einsum("vgqt,tvd->qvgd", weights, indicator)

    nan = (count(seen, nan_v) + count(zero, inf_v)) > 0
    pos, neg = count(positive, pos_v) > 0, count(positive, neg_v) > 0
    inf = torch.tensor(float("inf"), device=vf.device)
    extra = torch.where(nan | (pos & neg), torch.tensor(float("nan"), device=vf.device),
                        torch.where(pos, inf, torch.where(neg, -inf, 0.0)))
    return torch.where(torch.isfinite(extra), out, out + extra)


def merge_attention(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over two disjoint key sets into attention over their union.

    Args:
        out_a, out_b: ``[T, H, Dv]`` normalised outputs of the two parts.
        lse_a, lse_b: ``[T, H]`` their log-sum-exps (``-inf`` = no key seen).

    Returns:
        ``(out, lse)`` float32 ``[T, H, Dv]``, ``[T, H]``.  A part with
        ``lse = -inf`` contributes nothing, whatever its ``out`` holds (NaN
        included); rows where both parts are empty are ``out = 0``,
        ``lse = -inf``.
    """
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape or out_a.shape[:2] != lse_a.shape:
        raise ValueError(
            f"merge_attention: shapes out_a {tuple(out_a.shape)}, lse_a {tuple(lse_a.shape)}, "
            f"out_b {tuple(out_b.shape)}, lse_b {tuple(lse_b.shape)} do not match"
        )
    lse_a, lse_b = lse_a.float(), lse_b.float()
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isneginf(m), 0.0, m)
    w_a = torch.exp(lse_a - m)
    w_b = torch.exp(lse_b - m)
    total = w_a + w_b
    lse = m + torch.log(total)
    # Both weights are 0 only where both parts saw nothing; divide by 1 there.
    denom = torch.where(total > 0, total, 1.0).unsqueeze(-1)
    part_a = torch.where(torch.isneginf(lse_a).unsqueeze(-1), 0.0, out_a.float())
    part_b = torch.where(torch.isneginf(lse_b).unsqueeze(-1), 0.0, out_b.float())
    out = (part_a * w_a.unsqueeze(-1) + part_b * w_b.unsqueeze(-1)) / denom
    return out, lse


def varlen_attention(q, k, v, cu_seqlens, causal, softmax_scale, cu_seqlens_k) -> tuple[Tensor, Tensor]:
    """float32 ``(out [T, H, Dv], lse [T, H])`` of attention per sequence: sequence ``b``'s queries are rows
    ``[c[b], c[b+1])`` of ``q`` (rows outside every sequence: ``out`` 0, ``lse`` -inf), its keys and values rows
    ``[ck[b], ck[b+1])`` of ``k`` / ``v`` with ``ck = cu_seqlens_k`` (default ``cu_seqlens``); causal attention is
    aligned bottom-right (:func:`dense_attention` with ``q_offset = Lk - Lq``). Reads ``cu_seqlens`` back."""
    starts = cu_seqlens.tolist()
    starts_k = starts if cu_seqlens_k is None else cu_seqlens_k.tolist()
    out = q.new_zeros((q.shape[0], q.shape[1], v.shape[2]), dtype=torch.float32)
    lse = q.new_full((q.shape[0], q.shape[1]), float("-inf"), dtype=torch.float32)
    for a, b, ka, kb in zip(starts[:-1], starts[1:], starts_k[:-1], starts_k[1:]):
        if b > a:
            out[a:b], lse[a:b] = dense_attention(
                q[a:b], k[ka:kb], v[ka:kb], scale=softmax_scale, causal=causal, q_offset=(kb - ka) - (b - a)
            )
    return out, lse


def gather_paged(cache: Tensor, seqused_k: Tensor, page_table: Tensor) -> tuple[Tensor, Tensor]:
    """The keys (or values) of every sequence of a paged cache laid out contiguously: ``(dense [sum Lk, Hkv, D],
    cu_seqlens_k int32 [B + 1])`` on the cache's device, where sequence ``b``'s ``Lk = seqused_k[b]`` rows are
    ``cache[page_table[b, j // page_size], j % page_size]`` for ``j < Lk`` (``cache [num_pages, page_size, Hkv,
    D]``, any strides). Only the pages the first ``ceil(Lk / page_size)`` entries of each row list are read, and
    of the last one only the slots below ``Lk``. Reads ``seqused_k`` and ``page_table`` back."""
    page_size = cache.shape[1]
    lengths = [int(n) for n in seqused_k.tolist()]
    table = page_table.tolist()
    if len(table) != len(lengths):
        raise ValueError(f"page_table has {len(table)} rows for {len(lengths)} sequences (seqused_k)")
    parts = []
    for b, n in enumerate(lengths):
        pages = -(-n // page_size)
        if n < 0 or pages > len(table[b]):
            raise ValueError(f"sequence {b}: {n} keys need {pages} pages of {page_size} slots; its page_table row "
                             f"lists {len(table[b])}")
        if n:
            index = torch.tensor(table[b][:pages], dtype=torch.long, device=cache.device)
            parts.append(cache[index].flatten(0, 1)[:n])
    dense = torch.cat(parts) if parts else cache.new_empty((0, *cache.shape[2:]))
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=cache.device)
    return dense, cu


def paged_attention(q, k_cache, v_cache, cu_seqlens, seqused_k, page_table, causal, softmax_scale) -> tuple[Tensor, Tensor]:
    """float32 ``(out [T, H, Dv], lse [T, H])`` of attention over a paged KV cache, FlashAttention's / vLLM's paged
    varlen semantics: sequence ``b``'s queries are rows ``[c[b], c[b+1])`` of ``q [T, H, D]`` (``c =
    cu_seqlens``), its ``Lk = seqused_k[b]`` keys and values the slots of the pages row ``b`` of ``page_table``
    lists (:func:`gather_paged`: key ``j`` is ``k_cache[page_table[b, j // page_size], j % page_size]``;
    ``k_cache [num_pages, page_size, Hkv, D]``, ``v_cache [num_pages, page_size, Hkv, Dv]``, any strides: an
    HND cache seen through ``.transpose(1, 2)`` or keys and values split from one tensor's last dim); causal
    attention aligned bottom-right (query ``i`` sees keys ``j <= i + Lk - Lq``). It is :func:`varlen_attention`
    over the gathered keys, so its NaN / Inf semantics are :func:`dense_attention`'s, and nothing the sequences
    do not use (table entries past ``ceil(Lk / page_size)``, slots past ``Lk``, pages not listed) is read.
    Rows outside every sequence: ``out`` 0, ``lse`` -inf. Reads ``cu_seqlens``, ``seqused_k`` and
    ``page_table`` back."""
    if len(cu_seqlens) != len(seqused_k) + 1:
        raise ValueError(f"cu_seqlens has {len(cu_seqlens)} entries for {len(seqused_k)} sequences (seqused_k)")
    k, cu_k = gather_paged(k_cache, seqused_k, page_table)
    v, _ = gather_paged(v_cache, seqused_k, page_table)
    return varlen_attention(q, k, v, cu_seqlens, causal, softmax_scale, cu_k)


def merge_nvfp4(out_a, lse_a, out_b, lse_b, global_scale, packed, scales, row_start) -> None:
    """float32 :func:`merge_attention` (empty parts ignored),
    then :func:`fusion_pass.nvfp4.quantize_rows_into`'s body, into rows ``[row_start, row_start + M)``."""
    m, h, dv = out_a.shape
    if m == 0 or h * dv == 0:
        return
    merged, _ = merge_attention(out_a, lse_a, out_b, lse_b)
    write_rows(merged.reshape(m, h * dv), global_scale, packed, scales, row_start)

