"""Batch metadata and the forward context.

:class:`BatchSpec` describes the current batch the way vLLM's attention metadata does: requests in order,
decode requests (``query_len == 1``) first, then prefills; the tokens of the batch are the requests' new
tokens concatenated in that order. :func:`batch` / :func:`current_batch` are the forward context: the caller
wraps a model forward in ``with batch(spec):`` and the attention ops read the spec.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ContextManager, Iterator, Sequence

import torch

from fusion_pass.nvfp4.checks import ArgumentError, check_int

__all__ = ["RequestSpec", "BatchSpec", "batch", "current_batch"]


def _check_request_id(where: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ArgumentError(f"{where} must be a non-empty str, got {type(value).__name__} {value!r}")
    return value


def _check_lens(name: str, values: Any) -> list:
    """``values`` (one entry per request) as a list: a sequence or another iterable (a numpy array), not a str;
    else ArgumentError naming ``name``."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise ArgumentError(f"BatchSpec.from_lens: {name} must be a sequence with one entry per request, got "
                            f"{type(values).__name__} {values!r}")
    return list(values)


@dataclass(frozen=True)
class RequestSpec:
    """One request's share of a batch.

    ``query_len`` new tokens are computed in this step; ``context_len`` tokens of
    the same request are already in the KV cache (so the new tokens sit at
    absolute positions ``context_len .. context_len + query_len - 1``).
    """

    request_id: str
    query_len: int
    context_len: int = 0

    def __post_init__(self) -> None:
        owner = f"RequestSpec {_check_request_id('RequestSpec: request_id', self.request_id)!r}"
        object.__setattr__(self, "query_len", check_int(f"{owner}: query_len", self.query_len, minimum=1))
        object.__setattr__(self, "context_len", check_int(f"{owner}: context_len", self.context_len, minimum=0))

    @property
    def is_decode(self) -> bool:
        """One new token (vLLM's decode threshold of 1), whatever the context."""
        return self.query_len == 1

    @property
    def is_chunked_prefill(self) -> bool:
        """A prefill (more than one new token) with tokens already cached."""
        return not self.is_decode and self.context_len > 0


@dataclass(frozen=True)
class BatchSpec:
    """The requests of one forward step, decodes first (vLLM's order).

    ``dcp_world_size`` (decode-context-parallel world size) is carried for the
    fusion guard; the runtime here always computes on the full, local cache.
    """

    requests: tuple[RequestSpec, ...]
    dcp_world_size: int = 1

    def __post_init__(self) -> None:
        requests = self.requests
        if isinstance(requests, (str, bytes)) or not hasattr(requests, "__iter__"):
            raise ArgumentError(f"BatchSpec: requests must be a sequence of RequestSpec, got {type(requests).__name__} "
                                f"{requests!r}")
        requests = tuple(requests)
        if not requests:
            raise ArgumentError("BatchSpec: requests must not be empty")
        for i, r in enumerate(requests):
            if not isinstance(r, RequestSpec):
                raise ArgumentError(f"BatchSpec: requests must be a sequence of RequestSpec, got "
                                    f"{type(r).__name__} {r!r} at requests[{i}]")
        object.__setattr__(self, "requests", requests)
        object.__setattr__(self, "dcp_world_size", check_int("BatchSpec: dcp_world_size", self.dcp_world_size,
                                                             minimum=1))
        seen: set[str] = set()
        for r in requests:
            if r.request_id in seen:
                raise ValueError(f"BatchSpec: duplicate request_id {r.request_id!r}")
            seen.add(r.request_id)
        first_prefill = None
        for r in requests:
            if not r.is_decode:
                if first_prefill is None:
                    first_prefill = r
            elif first_prefill is not None:
                raise ValueError(
                    f"BatchSpec: decode request {r.request_id!r} comes after prefill request "
                    f"{first_prefill.request_id!r}; decode requests (query_len == 1) must come first"
                )

    @classmethod
    def from_lens(
        cls,
        query_lens: Sequence[int],
        context_lens: Sequence[int] | None = None,
        request_ids: Sequence[str] | None = None,
        *,
        dcp_world_size: int = 1,
    ) -> "BatchSpec":
        """Build a spec from per-request lengths (ints, numpy's too); ids default to ``"r0", "r1", ...``. A wrong
        type or length raises ArgumentError naming the argument (and the entry) before a spec is built."""
        fn = "BatchSpec.from_lens"
        query_lens = [check_int(f"{fn}: query_lens[{i}]", q, minimum=1)
                      for i, q in enumerate(_check_lens("query_lens", query_lens))]
        n = len(query_lens)
        context_lens = [0] * n if context_lens is None else [
            check_int(f"{fn}: context_lens[{i}]", c, minimum=0) for i, c in enumerate(_check_lens("context_lens",
                                                                                                  context_lens))]
        request_ids = [f"r{i}" for i in range(n)] if request_ids is None else [
            _check_request_id(f"{fn}: request_ids[{i}]", r) for i, r in enumerate(_check_lens("request_ids",
                                                                                              request_ids))]
        if len(context_lens) != n or len(request_ids) != n:
            raise ArgumentError(
                f"BatchSpec.from_lens: got {n} query_lens, {len(context_lens)} context_lens "
                f"and {len(request_ids)} request_ids"
            )
        return cls(
            tuple(RequestSpec(i, q, c) for i, q, c in zip(request_ids, query_lens, context_lens)),
            dcp_world_size=dcp_world_size,
        )

    # The derived facts below are computed once per spec (a spec is immutable; one step's spec is read by every
    # attention layer of the model): cached_property stores them in the instance's __dict__, outside the fields.

    @cached_property
    def num_tokens(self) -> int:
        return sum(r.query_len for r in self.requests)

    @cached_property
    def num_decodes(self) -> int:
        return sum(1 for r in self.requests if r.is_decode)

    @property
    def num_decode_tokens(self) -> int:
        # Decode requests have exactly one token each.
        return self.num_decodes

    @property
    def num_prefills(self) -> int:
        return len(self.requests) - self.num_decodes

    @cached_property
    def has_chunked_prefill(self) -> bool:
        return any(r.is_chunked_prefill for r in self.requests)

    @property
    def kind(self) -> str:
        """``"prefill"``, ``"decode"``, ``"mixed"`` (decodes + prefills) or
        ``"chunked"`` (prefills only, at least one with cached context)."""
        if self.num_prefills == 0:
            return "decode"
        if self.num_decodes > 0:
            return "mixed"
        return "chunked" if self.has_chunked_prefill else "prefill"

    @cached_property
    def _query_start_loc(self) -> tuple[int, ...]:
        locs = [0]
        for r in self.requests:
            locs.append(locs[-1] + r.query_len)
        return tuple(locs)

    def query_start_loc(self) -> list[int]:
        """Cumulative token offsets, length ``len(requests) + 1``, starting at 0 (a new list)."""
        return list(self._query_start_loc)

    def positions(self, device: torch.device | str | None = None) -> torch.Tensor:
        """int64 ``[num_tokens]``: each token's absolute position in its request."""
        return torch.cat(
            [
                torch.arange(r.context_len, r.context_len + r.query_len, dtype=torch.int64, device=device)
                for r in self.requests
            ]
        )



_local = threading.local()


def batch(spec: BatchSpec) -> ContextManager[BatchSpec]:
    """Make ``spec`` the current batch of this thread for the ``with`` body.

    Nestable: on exit the previously current batch (or none) is restored. ``spec`` that is not a
    :class:`BatchSpec` raises ArgumentError here, at the call.
    """
    if not isinstance(spec, BatchSpec):
        raise ArgumentError(f"batch: spec must be a BatchSpec, got {type(spec).__name__} {spec!r}")
    return _current(spec)


@contextmanager
def _current(spec: BatchSpec) -> Iterator[BatchSpec]:
    previous = getattr(_local, "spec", None)
    _local.spec = spec
    try:
        yield spec
    finally:
        _local.spec = previous


def current_batch() -> BatchSpec:
    """The batch set by the innermost enclosing :func:`batch` of this thread."""
    spec = getattr(_local, "spec", None)
    if spec is None:
        raise RuntimeError(
            "fusion_pass attention runtime: no batch is set: wrap the forward in "
            "`with fusion_pass.runtime.batch(spec):` so the attention ops know the "
            "requests of the batch"
        )
    return spec

