"""Pattern/replacement pairs matched by the fusion pass (installed as ``fusion_pass.patterns``)."""
