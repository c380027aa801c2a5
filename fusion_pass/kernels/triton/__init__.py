"""Triton kernels: flash attention with bf16 / NVFP4 / FP8 epilogues (:mod:`.flash_attention`, its output stages in
:mod:`.epilogues`), the NVFP4 quantizer (:mod:`.quantize`), the NVFP4 attention-state merge (:mod:`.merge`) and
the quantization arithmetic they share (:mod:`.nvfp4_math`). Importing a module here needs Triton."""
