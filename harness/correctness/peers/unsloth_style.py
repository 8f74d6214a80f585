"""Unsloth's ``fast_dequantize`` call path, reproduced without importing unsloth.

It calls bitsandbytes' C kernels directly, skipping bitsandbytes' Python: the 8-bit decode of the
nested absmax into a buffer reused across calls, the offset add, then the 4-bit dequantization
into a preallocated output. Three launches, the leanest way QLoRA users call bitsandbytes today.
nf4 with nested statistics only, as Unsloth's fast path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from harness.runtime.dtypes import DTYPES

_SUFFIX = {dtype: name for name, dtype in DTYPES.items() if name != "fp32"}


def dequantizer(A: torch.Tensor, quant_state) -> tuple[Callable[[], torch.Tensor], torch.Tensor]:
    """(a call that dequantizes ``A`` into one reused output, that output)."""
    import bitsandbytes.functional as F

    if not quant_state.nested or quant_state.quant_type != "nf4" or quant_state.dtype not in _SUFFIX:
        raise ValueError("the Unsloth-style path takes nf4 with nested statistics and fp16/bf16 output only")
    state2 = quant_state.state2
    absmax8 = quant_state.absmax
    absmax_buf = torch.empty(absmax8.numel(), dtype=torch.float32, device=A.device)
    out = torch.empty(quant_state.shape, dtype=quant_state.dtype, device=A.device)
    decode8 = F.lib.cdequantize_blockwise_fp32
    decode4 = getattr(F.lib, f"cdequantize_blockwise_{_SUFFIX[quant_state.dtype]}_nf4")
    pointers = (state2.code.data_ptr(), absmax8.data_ptr(), state2.absmax.data_ptr(), absmax_buf.data_ptr())
    offset, blocksize2, n_absmax = quant_state.offset, state2.blocksize, absmax8.numel()
    a_ptr, out_ptr, blocksize, n = A.data_ptr(), out.data_ptr(), quant_state.blocksize, out.numel()

    def run() -> torch.Tensor:
        stream = torch.cuda.current_stream(A.device).cuda_stream
        decode8(*pointers, blocksize2, n_absmax, stream)
        absmax_buf.add_(offset)
        decode4(None, a_ptr, absmax_buf.data_ptr(), out_ptr, blocksize, n, stream)
        return out

    return run, out
