"""The FA4 kernel's first compile of a configuration is logged with its time: long work says what it is doing
(the demo's progress lines are tested in tests/demo/test_demo.py)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap

import pytest


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None,
                    reason="flash_attn.cute is not installed (the fa4 extra)")
def test_the_first_fa4_compile_of_a_configuration_logs_one_info_line_with_its_time():
    """Compile (never run) the fused SM90 kernel with fake CUDA tensors, three calls over two configurations:
    one INFO line per configuration, on the first call only."""
    code = textwrap.dedent("""
        import logging, sys
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="LOG %(name)s %(levelname)s %(message)s")
        logging.getLogger("fusion_pass").setLevel(logging.INFO)
        from fusion_pass.kernels.fa4 import sm90 as fa4_sm90
        with FakeTensorMode(allow_non_fake_inputs=True):
            for h, t, dtype in ((16, 1000, torch.bfloat16), (16, 333, torch.bfloat16), (16, 1000, torch.float16)):
                d, dv = 192, 128
                q = torch.empty(t, h, d, dtype=dtype, device="cuda")
                k = torch.empty(t, h, d, dtype=dtype, device="cuda")
                v = torch.empty(t, h, dv, dtype=dtype, device="cuda")
                cu = torch.empty(4, dtype=torch.int32, device="cuda")
                gs = torch.empty(1, dtype=torch.float32, device="cuda")
                out = torch.empty(t, h * dv // 2, dtype=torch.uint8, device="cuda")
                sf = torch.empty(((t + 127) // 128 * 128) * (h * dv // 16), dtype=torch.uint8, device="cuda")
                fa4_sm90.fa4_attention_nvfp4_varlen(q, k, v, cu_seqlens=cu, max_seqlen=700, softmax_scale=0.1,
                                                    causal=True, output=out, output_scale=gs, output_block_scale=sf)
                print("called", t, dtype, flush=True)
    """)
    env = dict(os.environ, FLASH_ATTENTION_ARCH="sm_90", CUTE_DSL_ARCH="sm_90a", FLASH_ATTENTION_NUM_SMS="132")
    env.pop("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", None)  # FA4's in-memory JIT cache: every process compiles
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0 and result.stdout.count("called") == 3, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("LOG fusion_pass INFO fusion_pass: fa4:")]
    assert len(lines) == 2, result.stderr[-3000:]  # bf16 once (the token count is a run-time value), then fp16
    pattern = (r"LOG fusion_pass INFO fusion_pass: fa4: compiled the SM90 NVFP4 attention kernel \({}, head dims "
               r"\(192, 128\), 1 query heads per KV head, causal=True, tile 128x128, 2 stages, overlap=True, PV from "
               r"registers\) in \d+\.\d s; once per "
               r"configuration and process")
    assert re.fullmatch(pattern.format("bfloat16"), lines[0]), lines[0]
    assert re.fullmatch(pattern.format("float16"), lines[1]), lines[1]
