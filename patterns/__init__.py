"""What the fusion pass matches (installed as ``fusion_pass.patterns``).

* :mod:`.vocabulary`: op vocabularies, binding the roles patterns use to one library's ops (vLLM's:
  :mod:`fusion_pass.vllm.compile.vocabulary`), each format's quant op as a graph calls it (:class:`QuantForm`)
  and the GEMM forms a match ends in (:class:`GemmForm`);
* :mod:`.attention_quant`: the pattern table, attention -> quant (-> GEMM), per output format (NVFP4, static
  per-tensor FP8).
"""

from fusion_pass.patterns.attention_quant import PATTERNS, AttentionQuantPattern
from fusion_pass.patterns.vocabulary import GemmForm, OpVocabulary, QuantForm, fusion_pass_vocabulary

__all__ = ["PATTERNS", "AttentionQuantPattern", "GemmForm", "OpVocabulary", "QuantForm", "fusion_pass_vocabulary"]
