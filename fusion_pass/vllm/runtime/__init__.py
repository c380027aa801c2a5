"""The vLLM integration at run time, per attention call: the ops the rewritten graph calls (:mod:`.attention_op`),
the guard over vLLM's metadata (:mod:`.guard`), and the fused rows of MLA and standard layers (:mod:`.fused_rows`,
:mod:`.fused_standard`; their buffers by output format: :mod:`.call_buffers` over :mod:`.nvfp4_rows` and
:mod:`.fp8_static_rows`). Imports no vLLM at module level (tests run without vLLM)."""
