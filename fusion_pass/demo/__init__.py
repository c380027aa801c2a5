"""The demo: the NVFP4 layers (:mod:`.layers`), the demo models (:mod:`.models`: a DeepSeek-V3-style MLA stack
and a GQA stack) and the scripted workload ``fusion-pass demo`` runs (:mod:`.workload`)."""
