"""FlashAttention-4 with an NVFP4 epilogue, one module per GPU generation: :mod:`.sm90` (Hopper: checks,
compilation, launch; imports without FA4) and :mod:`.sm90_kernel` (the kernel class, a subclass of FA4's SM90
forward; imports FA4)."""
