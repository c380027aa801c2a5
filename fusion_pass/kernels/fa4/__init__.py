"""FlashAttention-4 with an NVFP4 output stage. :mod:`.forward` holds the entry points for whichever GPU
generation the tensors are on; per generation a host module (checks, configuration, compilation; imports
without FA4) and a kernel module (the subclass of FA4's forward; imports FA4): :mod:`.sm90` /
:mod:`.sm90_kernel` (Hopper) and :mod:`.sm100` / :mod:`.sm100_kernel` (Blackwell); Hopper adds :mod:`.sm90_twin` (FA4's class, launched like
the fused kernel) and :mod:`.sm90_configs` (tile configurations per sequence-length class). :mod:`.common` is
the host code they share, :mod:`.launch` the thin launchers, :mod:`.nvfp4_block` the device code (the block
quantization and its stores)."""
