"""torchao's NF4 tensor (the QLoRA path of torchtune) as a timing peer.

torchao stores its own NF4 format (int8-quantized block scales, its own packing), so its output
is not comparable bit for bit with bitsandbytes'; what is compared is the time to turn the same
weight shape back into a dense tensor, ``NF4Tensor.get_original_weight()``, as torchtune's
``linear_nf4`` does on every forward and backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def dequantizer(shape, dtype: torch.dtype, blocksize: int, seed: int, device) -> Callable[[], torch.Tensor]:
    """A callable that dequantizes a freshly quantized random weight of ``shape``.

    Raises ImportError when torchao is not installed.
    """
    from torchao.quantization import to_nf4

    g = torch.Generator(device=device).manual_seed(seed)
    weight = torch.randn(tuple(shape), generator=g, device=device).to(dtype)
    nf4 = to_nf4(weight, block_size=blocksize, scaler_block_size=256)
    del weight
    return nf4.get_original_weight
