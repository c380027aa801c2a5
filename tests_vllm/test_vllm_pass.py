"""The vLLM adapter without an engine: registration object, vocabulary, version gate, splitting-op
warning, and vLLM's VLLM_COMPILE path (configure_post_pass and PostGradPassManager's pass order)."""

import copy
import json
import logging
import pickle
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

import fusion_pass_vllm
from fusion_pass.vllm import FusionPassForVllm, notices, releases
from fusion_pass.vllm.compile import inductor_pass as pass_, report_file


def test_one_liner_object_pickles_deep_copies_and_keeps_its_uuid():
    p = fusion_pass_vllm.PASS
    from vllm.compilation.passes.inductor_pass import InductorPass

    assert isinstance(p, InductorPass)
    p.fusion()  # built: holds OpOverloads and traced templates, which do not pickle
    for other in (pickle.loads(pickle.dumps(p)), copy.deepcopy(p)):
        assert type(other) is FusionPassForVllm and other is not p and other._fusion is None
        assert other.uuid() == p.uuid()
    import vllm

    assert FusionPassForVllm(("mla_attention_nvfp4_quant",)).uuid() != p.uuid()
    vllm_version, base = vllm.__version__, p.uuid()
    try:
        vllm.__version__ = "0.32.99"
        assert FusionPassForVllm().uuid() != base, "the uuid includes the vLLM version"
    finally:
        vllm.__version__ = vllm_version


def test_vllm_vocabulary_names_vllm_ops_and_our_run_time_ops():
    from fusion_pass.vllm.compile.vocabulary import vllm_vocabulary

    fusion_pass_vllm.PASS.fusion()  # registers our run-time ops
    vocab = vllm_vocabulary()
    assert vocab.attention is torch.ops.vllm.unified_attention_with_output.default
    assert vocab.mla_attention is torch.ops.vllm.unified_mla_attention_with_output.default
    assert vocab.writing_quantized("attention") is torch.ops.fusion_pass.vllm_attention_nvfp4.default
    assert vocab.writing_quantized("mla_attention") is torch.ops.fusion_pass.vllm_mla_attention_nvfp4.default
    if not hasattr(torch.ops._C, "scaled_fp4_quant"):  # vLLM's CPU build
        assert vocab.nvfp4_quant is torch.ops.fusion_pass.scaled_fp4_quant.out
        assert vocab.nvfp4_gemm is torch.ops.fusion_pass.nvfp4_gemm.default
    # our ops mirror vLLM's schemas argument for argument (kv_cache_dummy_dep, layer_name's type, ...), then take
    # the project's own last arguments: the standard op the MLA op's group-FP8 arguments (vLLM's has none), both the
    # static FP8 native form's inverse scale
    group = [("quant_group_size", "Optional[int]"), ("quant_scale_ue8m0", "Optional[bool]"),
             ("quant_col_major", "Optional[bool]"), ("quant_tma_aligned", "Optional[bool]")]
    for ours, theirs, own in ((vocab.fused_attention, vocab.attention, group),
                              (vocab.fused_mla_attention, vocab.mla_attention, [])):
        assert [(a.name, str(a.type)) for a in ours._schema.arguments] == \
               [(a.name, str(a.type)) for a in theirs._schema.arguments] + own + [("output_inv_scale",
                                                                                  "Optional[Tensor]")]
        assert vocab.writes_native("attention" if ours is vocab.fused_attention else "mla_attention")


@pytest.mark.parametrize("module", ["fusion_pass.compile.layout", "fusion_pass.compile.matcher",
                                    "fusion_pass.vllm.compile.vocabulary", "fusion_pass.vllm.releases",
                                    "fusion_pass.vllm.adapters.layer", "fusion_pass.vllm.runtime.attention_op"])
def test_the_vllm_pass_uuid_shares_the_compile_time_source_list_and_adds_its_own(monkeypatch, module):
    from fusion_pass.compile import code_hash

    names = dict(code_hash.source_files(code_hash.COMPILE_TIME + pass_.VLLM_COMPILE_TIME))
    before = FusionPassForVllm().uuid()
    read = code_hash._read
    monkeypatch.setattr(code_hash, "_read", lambda p: read(p) + (b"\n# changed\n" if p == names[module] else b""))
    code_hash.code_digest.cache_clear()
    try:
        assert FusionPassForVllm().uuid() != before
    finally:
        monkeypatch.undo()
        code_hash.code_digest.cache_clear()
    assert FusionPassForVllm().uuid() == before


@pytest.mark.parametrize("version, line", [("0.32.0", "0.32"), ("0.32.1+cpu", "0.32"), ("0.33.0", "0.33"),
                                           ("0.33.2+cu130", "0.33"), ("0.34.0", "0.34"), ("0.34", "0.34"),
                                           ("0.31.9", None), ("0.35.0", None), ("0.340.0", None), ("1.0.0", None)])
def test_the_gate_accepts_exactly_the_listed_releases(version, line):
    release = releases.release_of(version)
    assert (release.line if release else None) == line
    refused = releases.refusal(version)
    if line is None:  # one line naming the supported releases
        assert "\n" not in refused and "0.32.x, 0.33.x, 0.34.x" in refused and version in refused
    else:
        assert refused is None and pass_.version_supported(version)


def test_other_vllm_versions_are_left_alone_with_the_reason_logged_and_reported(monkeypatch, caplog, tmp_path):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.40.0")
    monkeypatch.setattr(notices, "_notices", {})
    monkeypatch.setenv("FUSION_PASS_DUMP", str(tmp_path))
    p = FusionPassForVllm()
    with caplog.at_level(logging.WARNING, logger="vllm.fusion_pass"):
        assert p.fusion() is None
        graph = torch.fx.Graph()
        graph.output(None)
        p(graph)  # a no-op, not an error
    assert "vLLM 0.40.0 is not a supported release (supported: 0.32.x, 0.33.x, 0.34.x" in p.disabled_reason
    assert caplog.text.count("does not rewrite in this process") == 1
    report = p.report()
    assert report["disabled_reason"] == p.disabled_reason
    assert [n["key"] for n in report["notices"]] == ["release"]
    # the report file says it too, and `fusion-pass report` prints it (never a silent no-op)
    written = json.loads(report_file.report_path(tmp_path).read_text())
    assert written["notices"][0]["key"] == "release" and written["disabled_reason"] == p.disabled_reason
    p._report_file.close()
    from fusion_pass.compile import process_reports

    text = process_reports.format_summary(process_reports.summarize(tmp_path))
    assert "notices (why the pass could not act):" in text and "not a supported release" in text


def test_attention_as_a_splitting_op_is_named():
    split = SimpleNamespace(splitting_ops=["vllm::unified_mla_attention_with_output", "vllm::other"],
                            use_inductor_graph_partition=False)
    assert notices.splitting_attention_ops(split) == ["vllm::unified_mla_attention_with_output"]
    split.use_inductor_graph_partition = True
    assert notices.splitting_attention_ops(split) == []
    assert notices.splitting_attention_ops(SimpleNamespace(splitting_ops=[], use_inductor_graph_partition=False)) == []


def _config(mode=3, breakable=False, eager=False, splitting_ops=(), partition=False, with_pass=True):
    post = FusionPassForVllm() if with_pass else None
    return SimpleNamespace(
        compilation_config=SimpleNamespace(mode=mode, use_breakable_cudagraph=breakable, splitting_ops=list(splitting_ops),
                                           use_inductor_graph_partition=partition,
                                           inductor_compile_config={"post_grad_custom_post_pass": post}),
        model_config=SimpleNamespace(enforce_eager=eager))


@pytest.mark.parametrize("config, key, says", [
    (dict(mode=0, breakable=True), "not_compiled", "VLLM_USE_BREAKABLE_CUDAGRAPH=0"),
    (dict(mode=0, eager=True), "not_compiled", "enforce_eager"),
    (dict(mode=0), "not_compiled", "mode=3"),
    (dict(splitting_ops=["vllm::unified_attention_with_output"]), "attention_split", "use_inductor_graph_partition=True"),
    (dict(splitting_ops=["vllm::unified_attention_with_output"], partition=True), None, None),
    (dict(mode=0, with_pass=False), None, None),     # the pass is not configured: nothing to say
    (dict(), None, None),
])
def test_a_config_that_keeps_the_pass_from_acting_is_said_once(monkeypatch, caplog, config, key, says):
    monkeypatch.setattr(notices, "_notices", {})
    with caplog.at_level(logging.WARNING, logger="vllm.fusion_pass"):
        found = notices.check_config(_config(**config))
        notices.check_config(_config(**config))  # said once per process
    assert found == ([key] if key else [])
    assert [n["key"] for n in notices.notices()] == found
    if key:
        assert caplog.text.count("fusion_pass: ") == 1 and says in caplog.text
    else:
        assert caplog.text == ""


UNSUPPORTED_PLUGIN_PROBE = textwrap.dedent('''
    import sys, torch, vllm
    vllm.__version__ = sys.argv[1]
    from vllm.v1.attention.backend import AttentionMetadataBuilder
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder
    from fusion_pass.vllm import notices, plugin
    plugin.register()
    print("OPS", hasattr(torch.ops.fusion_pass, "vllm_attention_nvfp4"),
          hasattr(torch.ops.fusion_pass, "vllm_mla_attention_nvfp4"))
    print("HOOKS", getattr(AttentionMetadataBuilder.__init__, "__fusion_pass_hook__", False),
          getattr(CPUAttentionMetadataBuilder.build, "__fusion_pass_hook__", False))
    print("NOTICES", [n["key"] for n in notices.notices()])
''')


@pytest.mark.parametrize("version, registered", [("0.40.0", False), ("0.31.0", False), (None, True)])
def test_on_an_unlisted_release_the_plugin_registers_nothing(version, registered):
    import vllm

    proc = subprocess.run([sys.executable, "-c", UNSUPPORTED_PLUGIN_PROBE, version or vllm.__version__],
                          capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert f"OPS {registered} {registered}" in proc.stdout, log[-3000:]
    assert f"HOOKS {registered} {registered}" in proc.stdout, log[-3000:]
    assert ("NOTICES ['release']" if not registered else "NOTICES []") in proc.stdout, log[-3000:]
    if not registered:
        assert log.count("is not a supported release") == 1


VLLM_COMPILE_PROBE = textwrap.dedent('''
    import logging
    from vllm.config import CompilationConfig, CompilationMode, VllmConfig, set_current_vllm_config
    from vllm.compilation.backends import VllmBackend
    from fusion_pass.vllm import FusionPassForVllm

    def configured(**cc):
        # vLLM's CUDA-only fusions stay off: their classes are only imported on CUDA (is_cuda_alike)
        vc = VllmConfig(compilation_config=CompilationConfig(
            inductor_passes={"post_grad_custom_post_pass": "fusion_pass_vllm.PASS"},
            pass_config={"fuse_rope_kvcache_cat_mla": False, "fuse_attn_quant": False}, **cc))
        vc.compilation_config.mode = CompilationMode.VLLM_COMPILE   # what vLLM keeps on CUDA
        with set_current_vllm_config(vc):
            backend = VllmBackend(vc)
            backend.configure_post_pass()
        return vc, backend

    vc, backend = configured(splitting_ops=[])
    names = [type(p).__name__ for p in backend.pass_manager.passes]
    print("PASSES", names)
    assert names[-1] == "FusionPassForVllm", names
    assert type(backend.inductor_config["post_grad_custom_post_pass"]).__name__ == "PostGradPassManager"
    ours = backend.pass_manager.passes[-1]
    assert isinstance(ours, FusionPassForVllm)
    # attention as a splitting op: the pass says so when it runs
    vc, backend = configured(splitting_ops=["vllm::unified_mla_attention_with_output"])
    import torch
    g = torch.fx.Graph(); g.output(None)
    with set_current_vllm_config(vc):
        backend.pass_manager.passes[-1](g)
    print("OK")
''')


def test_vllm_compile_mode_accepts_the_pass_last_in_the_post_grad_pass_manager(tmp_path):
    proc = subprocess.run([sys.executable, "-c", VLLM_COMPILE_PROBE], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "VLLM_DISABLE_COMPILE_CACHE": "1"})
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    assert "OK" in proc.stdout
    assert "attention is a splitting op (vllm::unified_mla_attention_with_output)" in log


# ---------------------------------------------------------------- graphs vLLM's own attention+quant fusion rewrote

H, DV, T = 4, 64, 8
LAYER = "model.layers.0.self_attn.attn"


def _vllm_prequantized(kind: str, block_scale: bool):
    """What vLLM's AttnQuantFusionPass / MLAAttnQuantFusionPass leave behind (their replacements, in eager form):
    a fresh uint8 output, the quant's int32 scale buffer viewed as fp8, the GEMM reading both."""
    def fn(q, k, v, scale_i32, gs, dep, w, w_scale, alpha):
        if kind == "mla":
            out = torch.empty(q.shape[0], H * DV // 2, dtype=torch.uint8)
            op = torch.ops.vllm.unified_mla_attention_with_output
        else:
            out = torch.empty(q.shape[0], H, DV // 2, dtype=torch.uint8)
            op = torch.ops.vllm.unified_attention_with_output
        osv = scale_i32.view(torch.float8_e4m3fn) if block_scale else None
        op(q, k, v, out, LAYER, output_scale=gs, output_block_scale=osv, kv_cache_dummy_dep=dep)
        a = out.reshape(-1, H * DV // 2)
        return torch.ops.fusion_pass.nvfp4_gemm(a, w, scale_i32.view(torch.float8_e4m3fn), w_scale, alpha,
                                                torch.bfloat16)

    bf = torch.bfloat16
    if kind == "mla":
        qkv = (torch.randn(T, H, 128, dtype=bf), torch.randn(T, 512, dtype=bf), torch.randn(T, 1, 64, dtype=bf))
    else:
        qkv = (torch.randn(T, H, DV, dtype=bf), torch.randn(T, 2, DV, dtype=bf), torch.randn(T, 2, DV, dtype=bf))
    return fn, (*qkv, torch.zeros(128, 4, dtype=torch.int32), torch.ones(1), torch.empty(0, dtype=bf),
                torch.zeros(32, H * DV // 2, dtype=torch.uint8), torch.zeros(128, 16, dtype=torch.float8_e4m3fn),
                torch.ones(1))


def _trace(fn, args, form):
    from torch._subclasses.functional_tensor import dispatch_functionalize
    from torch.fx.experimental.proxy_tensor import make_fx

    with torch._inductor.config.patch(enable_auto_functionalized_v2=form == "v2"):
        return make_fx(dispatch_functionalize(fn), tracing_mode="fake")(*args)


def _attention_nodes(gm):
    from fusion_pass.compile import matcher

    return [(n, matcher.wrapped_op(n)[0]) for n in gm.graph.nodes if matcher.wrapped_op(n)[0] is not None]


@pytest.mark.parametrize("form", ["v1", "v2"])
@pytest.mark.parametrize("kind", ["mla", "standard"])
def test_a_graph_vllms_fusion_rewrote_is_retargeted_once_with_its_arguments_kept(kind, form):
    fusion = FusionPassForVllm().fusion()
    gm = _trace(*_vllm_prequantized(kind, block_scale=True), form)
    ((node, op),) = _attention_nodes(gm)
    before = dict(node.kwargs)
    users = set(node.users)
    fusion(gm.graph)
    report = fusion.graphs[-1]
    pattern = "mla_attention_nvfp4_prequantized" if kind == "mla" else "attention_nvfp4_prequantized"
    assert (report.candidates, report.rewritten, report.retargeted) == (1, 1, 1)
    assert report.layers == [{"layer": LAYER, "pattern": pattern, "outcome": "retargeted"}]
    ((node2, op2),) = _attention_nodes(gm)
    ours = torch.ops.fusion_pass.vllm_mla_attention_nvfp4 if kind == "mla" else torch.ops.fusion_pass.vllm_attention_nvfp4
    assert node2 is node and op2 is ours.default
    assert dict(node2.kwargs) == before and set(node2.users) == users  # the call is retargeted, nothing else
    gm.graph.lint()
    assert "retargeted" in report.line()
    fusion(gm.graph)  # never rewritten twice: our op is not a candidate
    assert fusion.graphs[-1].candidates == 0


@pytest.mark.parametrize("kind", ["mla", "standard"])
def test_an_attention_given_only_a_global_scale_is_refused_not_retargeted(kind):
    """output_scale without output_block_scale is another format's fused output (FP8): no entry applies."""
    fusion = FusionPassForVllm().fusion()
    gm = _trace(*_vllm_prequantized(kind, block_scale=False), "v1")
    ((node, op),) = _attention_nodes(gm)
    fusion(gm.graph)
    report = fusion.graphs[-1]
    assert report.rewritten == 0 and report.refused == {"attention_already_quantized": 1}
    assert _attention_nodes(gm) == [(node, op)]
