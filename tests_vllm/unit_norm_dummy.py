"""Test-only: vLLM's dummy weights with every RMSNorm weight set to 1, in every process of a served engine.

The plugin imports this module in each vLLM process when ``FUSION_PASS_VLLM_IMPORT`` names it (the server test
does). ``_engine.unit_norm_weights`` says why the norms are set; an in-process engine sets them through
``LLM.apply_model``, which a server does not offer.
"""

from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

from _engine import unit_norm_weights

_dummy_load_weights = DummyModelLoader.load_weights


def load_weights_with_unit_norms(self, model, model_config) -> None:
    _dummy_load_weights(self, model, model_config)
    unit_norm_weights(model)


DummyModelLoader.load_weights = load_weights_with_unit_norms
