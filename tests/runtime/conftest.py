"""Fixtures of the run-time tests."""

import pytest

from fusion_pass import runtime
from layer_cases import Layer, gqa_layer, mla_layer


@pytest.fixture(params=["mla", "gqa"])
def layer(request):
    impl, op, make = mla_layer() if request.param == "mla" else gqa_layer()
    name = f"runtime_tests.{request.param}"
    runtime.register_layer(name, impl)
    yield Layer(name, impl, op, make)
    runtime.unregister_layer(name)
