"""How far a 4-bit model's results are from exact arithmetic: an fp64 copy of a bitsandbytes-quantized
transformers model whose weights are the exactly dequantized 4-bit weights (and of its LoRA
adapter), decode logits under teacher forcing (one token per step through the KV cache, as
``generate`` decodes), and the two numbers a matmul mode is judged by: relative error against
the fp64 result and top-1 agreement.

The fp64 model removes every rounding but the quantization itself, so bitsandbytes' own bf16
result and the fused matmul's are both measured against the same exact answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def fp64_reference(model: torch.nn.Module) -> torch.nn.Module:
    """A float64 copy of a quantized causal LM (or a peft model's base): each 4-bit weight (a
    parameter with a quant state, inside ``Linear4bit`` or peft's wrapper of it) dequantized by
    bitsandbytes (its bits; ours are the same), every other tensor converted."""
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM

    config = model.config
    with torch.device(model.device):
        ref = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float64, attn_implementation="eager")
    state = {}
    for key in ref.state_dict():
        owner, _, leaf = key.rpartition(".")
        module = model.get_submodule(owner)
        tensor = getattr(module, leaf)
        if getattr(tensor, "quant_state", None) is not None:
            tensor = bnb.functional.dequantize_4bit(tensor.data, tensor.quant_state)
        state[key] = tensor.detach().double()
    ref.load_state_dict(state)
    return ref.eval()


@torch.no_grad()
def decode_logits(model: torch.nn.Module, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """Logits predicting tokens ``prompt + 1 ...`` of ``ids`` [batch, seq]: the prompt in one
    forward, then one token per step through the KV cache. Returns [batch, seq - prompt, vocab] fp64."""
    out = model(input_ids=ids[:, :prompt], use_cache=True)
    cache, steps = out.past_key_values, [out.logits[:, -1]]
    for t in range(prompt, ids.shape[1] - 1):
        out = model(input_ids=ids[:, t : t + 1], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        steps.append(out.logits[:, -1])
    return torch.stack(steps, dim=1).double()


@torch.no_grad()
def prefill_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits.double()


@dataclass(frozen=True)
class Distance:
    relative_error: float  # ‖logits − reference‖₂ / ‖reference‖₂
    top1_agreement: float  # share of positions whose argmax is the reference's
    decided: int  # positions where the reference's top-1 leads its top-2 by more than the tie margin
    decided_misses: int  # decided positions whose argmax is not the reference's

    def __str__(self) -> str:
        return (
            f"relative error {self.relative_error:.3e}, top-1 agreement {self.top1_agreement:.4f}, "
            f"{self.decided_misses} misses of {self.decided} decided positions"
        )


def relative_error(got: torch.Tensor, reference: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(got.double() - reference) / torch.linalg.vector_norm(reference))


def fp64_qlora(m):
    """An fp64 copy of a ``qlora.QLoRAModel``: the base as ``fp64_reference``, the same LoRA
    configuration, every adapter weight copied; same input tokens."""
    from peft import get_peft_model

    from harness.correctness import qlora

    config = m.model.peft_config["default"]
    ref = get_peft_model(fp64_reference(m.model.get_base_model()), config)
    adapters = {k: v.detach().double() for k, v in m.model.state_dict().items() if "lora_" in k}
    missing = set(adapters) - set(ref.state_dict())
    if missing:
        raise ValueError(f"adapter weights with no place in the fp64 copy: {sorted(missing)[:3]}")
    ref.load_state_dict(adapters, strict=False)
    return qlora.QLoRAModel(ref, m.input_ids)


def tie_margin(result: torch.Tensor, reference: torch.Tensor) -> float:
    """Twice the largest logit error of ``result``: a reference lead smaller than this can flip
    under that much rounding, so a top-1 there is a coin toss, not a verdict."""
    return 2 * float((result.double() - reference).abs().max())


def distance(logits: torch.Tensor, reference: torch.Tensor, margin: float = 0.0) -> Distance:
    agree = logits.argmax(-1) == reference.argmax(-1)
    top2 = reference.topk(2, dim=-1).values
    decided = (top2[..., 0] - top2[..., 1]) > margin
    misses = int((decided & ~agree).sum())
    return Distance(relative_error(logits, reference), float(agree.double().mean()), int(decided.sum()), misses)
