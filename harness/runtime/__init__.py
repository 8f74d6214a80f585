"""The kernel's runtime: NVRTC compile and cache, generic launch, this kernel's launch plan, the
drop-in ``dequantize_4bit``, the bitsandbytes patch and the torch op."""
