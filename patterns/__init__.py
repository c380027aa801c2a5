"""What the fusion pass matches (installed as ``fusion_pass.patterns``).

* :mod:`.vocabulary`: op vocabularies, binding the roles patterns use to one library's ops (vLLM's:
  :mod:`fusion_pass.vllm.compile.vocabulary`), and the NVFP4 GEMM forms a match ends in (:class:`GemmForm`);
* :mod:`.attention_quant`: the pattern table, attention -> NVFP4 quant (-> NVFP4 GEMM).
"""

from fusion_pass.patterns.attention_quant import PATTERNS, AttentionQuantPattern
from fusion_pass.patterns.vocabulary import GemmForm, OpVocabulary, fusion_pass_vocabulary

__all__ = ["PATTERNS", "AttentionQuantPattern", "GemmForm", "OpVocabulary", "fusion_pass_vocabulary"]
