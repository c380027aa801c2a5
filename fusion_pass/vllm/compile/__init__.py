"""The vLLM integration at compile time: the pass as a vLLM ``InductorPass`` (:mod:`.inductor_pass`), the one
:data:`PASS` vLLM's pass names refer to (:mod:`.registration`), vLLM's op vocabulary and NVFP4 GEMM forms
(:mod:`.vocabulary`), which layers vLLM's own attention + quant rewrite is left to (:mod:`.layer_check`) and the
per-process report file (:mod:`.report_file`)."""
