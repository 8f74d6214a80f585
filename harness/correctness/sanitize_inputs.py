"""What every op's sanitizer cases share (``harness.correctness.op_checks``; ``sanitize`` runs each
op's ``OpChecks.sanitize`` under each tool): the weights they quantize, and one line of every input
buffer's address range in ``RANGES``' form, so an uninitialized read can be traced to the buffer
it hit.

Inputs: ``raw`` are random bytes and scales written by PyTorch; ``bnb`` quantizes random weights
with bitsandbytes.
"""

from __future__ import annotations

import re

# A case's line of input buffers: "case LABEL: name 0xSTART+BYTES, ..." (print_ranges writes it,
# the sanitizer's report reader parses it).
RANGES = re.compile(r"^case (?P<label>[^:]+): (?P<ranges>.*)$", re.M)
RANGE = re.compile(r"(\w+) 0x([0-9a-f]+)\+(\d+)")


def weights(inputs: str, shape, quant: str, dtype, nested: bool, device):
    """(packed weights, quant state) of blocks of 64: ``raw`` random bytes and scales, or ``bnb``
    random weights quantized by bitsandbytes."""
    from harness.correctness import cases

    if inputs == "raw":
        case = cases.raw_case(shape, quant, 64, dtype, nested, seed=0, device=device, special_scales=False)
        return case.A, case.quant_state()
    return cases.quantize_weights(shape, quant, 64, nested, dtype, seed=0, device=device)


def print_ranges(label: str, A, qs) -> None:
    """The case's input buffers (the packed tensor and the quant state's), one ``RANGES`` line."""
    import torch

    buffers = {"A": A, "absmax": qs.absmax}
    if qs.nested:
        buffers |= {"code2": qs.state2.code, "absmax2": qs.state2.absmax}
        if isinstance(qs.offset, torch.Tensor) and qs.offset.is_cuda:
            buffers["offset"] = qs.offset
    ranges = ", ".join(f"{k} 0x{t.data_ptr():x}+{t.numel() * t.element_size()}" for k, t in buffers.items())
    print(f"case {label}: {ranges}", flush=True)
