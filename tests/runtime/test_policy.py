"""The measured policy (fusion_pass.runtime.policy) and the guard core's one-call and ``slower_here`` decisions, on
generated batches and every (generation, row plan) of the table."""

import itertools

import pytest
import torch

from fusion_pass.nvfp4 import ArgumentError
from fusion_pass.runtime import guard, policy, settings
from fusion_pass.runtime.guard import BatchRows, LayerShape

LAYER = LayerShape("cpu", torch.bfloat16, 4, 64, 64, num_kv_heads=2)


def test_the_table_has_one_rule_per_generation_and_row_plan():
    keys = [(r.generation, r.rows) for r in policy.POLICY_TABLE]
    assert len(keys) == len(set(keys))
    for gen in ("cpu", "sm90", "sm100"):
        assert {rows for g, rows in keys if g == gen} == set(policy.ROW_PLANS), gen
    for rule in policy.POLICY_TABLE:
        assert rule.evidence and not rule.evidence.lower().startswith(("measured", "not measured")), rule
        if rule.generation == "sm90" and rule.measured:
            assert "H200" in rule.evidence and "docs/benchmarks.md" in rule.evidence, rule
    # what the H200 measurements say: only calls of prefill rows are fused there
    assert [r.rows for r in policy.POLICY_TABLE if r.generation == "sm90" and r.fuse] == ["prefill"]


@pytest.mark.parametrize("gen,rows", list(itertools.product(("cpu", "sm90", "sm100", "sm120"), policy.ROW_PLANS)))
def test_verdict_reads_the_table_and_the_setting(monkeypatch, gen, rows):
    monkeypatch.setattr(policy, "generation", lambda device: gen)
    rule = {(r.generation, r.rows): r for r in policy.POLICY_TABLE}.get((gen, rows))
    fuse, why = policy.verdict("cuda", rows)
    if rule is None:  # a generation without rules: prefill calls only
        assert fuse is (rows == "prefill") and gen in why
    else:
        assert fuse is rule.fuse and why.endswith(rule.evidence)
        assert why.startswith("measured: " if rule.measured else "not measured: ")
    with settings.use_policy("always"):
        assert policy.verdict("cuda", rows) == (True, f"{settings.POLICY_ENV}=always")
    with pytest.raises(ValueError, match="not a row plan"):
        policy.verdict("cuda", "decode")


def test_policy_setting_rejects_a_bad_value_naming_its_source(monkeypatch):
    with pytest.raises(ArgumentError, match="set_policy"):
        settings.set_policy("fast")
    monkeypatch.setenv(settings.POLICY_ENV, "sometimes")
    with pytest.raises(ArgumentError, match=settings.POLICY_ENV):
        settings.check_environment()
    monkeypatch.setenv(settings.POLICY_ENV, " Always ")
    assert settings.policy_mode() == "always"


def test_generation_of_the_devices_here():
    assert policy.generation("cpu") == "cpu" and policy.generation(torch.device("meta")) == "meta"
    assert {r["generation"] for r in policy.describe("cpu")} == {"cpu"}
    assert len(policy.describe()) == len(policy.POLICY_TABLE)



def _rows(gen):
    decode = int(torch.randint(0, 4, (1,), generator=gen))
    count = int(torch.randint(1, 4, (1,), generator=gen))
    query = tuple(int(x) for x in torch.randint(2, 9, (count,), generator=gen))
    context = tuple(int(x) * int(torch.randint(0, 2, (1,), generator=gen)) for x in torch.randint(1, 40, (count,),
                                                                                                 generator=gen))
    return BatchRows(decode, query, context)


@pytest.mark.parametrize("seed", range(4))
def test_core_one_call_counts_every_row_and_the_policy_picks_the_plan(monkeypatch, seed):
    """Generated batches through the core with every combination of: the caller offers one call or not, the
    backend has a paged launch or not, the caller's unfused path splits anyway or not, and each generation's rules.
    The decision follows the table: one call where offered, run and fused by the policy; else the split where the
    policy fuses it; else ``slower_here``; a prefill-only call is never a one call."""
    from fusion_pass.runtime.backends import get_backend

    gen = torch.Generator().manual_seed(seed)
    backend = get_backend("reference")
    for _ in range(6):
        rows = _rows(gen)
        d, prefill = rows.decode_tokens, rows.prefill_tokens
        for g, offered, paged, split_free in itertools.product(("cpu", "sm90", "sm100"), (True, False), (True, False),
                                                                (True, False)):
            monkeypatch.setattr(policy, "generation", lambda device, g=g: g)
            monkeypatch.setattr(backend, "handles_paged", paged)
            decision = guard.decide(rows, LAYER, one_call_refusal=None if offered else "not offered",
                                    split_free=split_free)
            rules = {r.rows: r.fuse for r in policy.POLICY_TABLE if r.generation == g}
            one = bool(d) and offered and paged and rules["mixed_one_call"]
            plan = "prefill" if not d else "mixed_split_free" if split_free else "mixed_split"
            case = (rows, g, offered, paged, split_free)
            if one:
                assert (decision.path, decision.one_call, decision.decode_fused) == ("fused", True, d), case
                assert (decision.fused_tokens, decision.post_quantized) == (prefill, {}), case
            elif rules[plan]:
                assert decision.fused and not decision.one_call and decision.decode_fused == 0, case
                assert decision.post_quantized == ({"decode_tokens": d} if d else {}), case
            else:
                assert (decision.reason, decision.post_quantized) == ("slower_here", {"slower_here": rows.num_tokens}), case
                assert plan in decision.detail, case


def test_core_checks_rows_apart_when_the_one_call_does_not_run(monkeypatch):
    """A decode refusal stops a split but not a one call; when the backend has no paged launch it applies after
    the backend is chosen."""
    from fusion_pass.runtime.backends import get_backend

    rows = BatchRows(2, (5,), (7,))
    decision = guard.decide(rows, LAYER, decode_refusal="cannot cut", one_call_refusal=None)
    assert decision.one_call and decision.decode_fused == 2
    monkeypatch.setattr(get_backend("reference"), "handles_paged", False)
    decision = guard.decide(rows, LAYER, decode_refusal="cannot cut", one_call_refusal=None)
    assert (decision.reason, "cannot cut" in decision.detail) == ("decode_tokens", True)
    decision = guard.decide(rows, LAYER, context_refusal="unreadable", one_call_refusal=None)
    assert decision.reason == "chunked_prefill"
