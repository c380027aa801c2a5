"""The one table of FA4 GPU generations (fusion_pass/kernels/fa4/generations.py) and its readers: the kernels'
dispatch, the fa4 backend (availability, ``auto``, self-check, the selftest's plan) and the policy."""

import pytest
import torch

from fusion_pass.kernels.fa4 import forward, generations
from fusion_pass.runtime import policy
from fusion_pass.runtime.backends import fa4 as fa4_backend


def test_every_generation_of_the_table_has_its_kernels_and_nothing_else_does():
    names = [g.name for g in generations.GENERATIONS]
    assert sorted(forward._MODULES) == sorted(names)
    for g in generations.GENERATIONS:
        module = forward._MODULES[g.name]
        assert module.usable is getattr(module, f"fa4_{g.name}_usable")
        assert forward.generation_head_dims(g.name) == module.SUPPORTED_HEAD_DIMS
        assert module.__name__.endswith(g.name) and g.kernel_module == f"{g.name}_kernel"
    families = [f for g in generations.GENERATIONS for f in g.families]
    assert len(families) == len(set(families))  # a compute capability maps to one generation


@pytest.mark.parametrize("arch", [80, 86, 89, 90, 100, 103, 110, 120, None])
def test_the_readers_agree_on_each_compute_capability(monkeypatch, arch):
    found = generations.for_arch(arch)
    assert (found is not None) is (arch is not None and arch // 10 in (9, 10, 11))
    monkeypatch.setattr(fa4_backend, "device_arch", lambda index: arch)
    fast, why = fa4_backend.FA4Backend().fast_on(torch.device("cuda", 0))
    assert fast is (found is not None), why
    needed, why = fa4_backend.FA4Backend().self_check_needed(torch.device("cuda", 0))
    assert needed is (found is not None and not found.run_on_hardware), why
    if arch is not None:
        assert policy.generation(torch.device("cuda", 0)) == (found.name if found else f"sm{arch}")
    plan = fa4_backend.FA4Backend.canary_generations
    assert list(plan) == [f"{g.label} ({g.gpus})" for g in generations.GENERATIONS]
