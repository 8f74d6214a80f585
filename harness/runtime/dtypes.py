"""The kernels' dtype names and PyTorch's dtypes: the one map between the two spellings."""

from __future__ import annotations

import torch

# Output dtypes of the dequantization kernel by the name its variants use.
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
OUT_NAME = {dtype: name for name, dtype in DTYPES.items()}
# Activation (and fused-matmul output) dtypes by the name the matmul variants use.
ACTIVATION_NAME = {torch.float16: "fp16", torch.bfloat16: "bf16"}
