"""One setup factory for the end-to-end QLoRA check and its perf case: a small Llama built from
a config with random weights (no downloads), quantized by transformers' bitsandbytes integration
(nf4, double quantization, bf16 compute), with a peft LoRA adapter on every projection.

Two decoder layers at Llama-3.3-70B's sizes by default: every 4-bit weight shape of the real
model is there (q/o 8192x8192, k/v 1024x8192, gate/up 28672x8192, down 8192x28672).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

LLAMA_3_3_70B = {
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class QLoRAModel:
    model: torch.nn.Module  # a peft PeftModel
    input_ids: torch.Tensor


def save_random_llama(directory: str, layers: int = 2, vocab: int = 4096, seed: int = 0, dims=None) -> None:
    """A Llama checkpoint with random bf16 weights, written with save_pretrained."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, num_hidden_layers=layers, max_position_embeddings=4096, **(dims or LLAMA_3_3_70B)
    )
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    del model
    torch.cuda.empty_cache()


# Qwen3-32B's layer sizes (its q and k norms and head size of 128 are the architecture's own).
QWEN3_32B = {
    "hidden_size": 5120,
    "intermediate_size": 25600,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
}


def save_random_model(directory: str, architecture: str, layers: int, vocab: int = 4096, seed: int = 0) -> None:
    """A checkpoint of ``architecture`` ("llama": Llama-3.3-70B's sizes, "qwen3": Qwen3-32B's) with
    random bf16 weights, written with save_pretrained."""
    if architecture == "llama":
        return save_random_llama(directory, layers, vocab, seed)
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(vocab_size=vocab, num_hidden_layers=layers, max_position_embeddings=4096, **QWEN3_32B)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    del model
    torch.cuda.empty_cache()


SMALL_LLAMA = {"hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 16, "num_key_value_heads": 4}


def load_quantized(directory: str, device_map: dict | None = None) -> torch.nn.Module:
    """The checkpoint quantized on load by transformers (nf4, nested, bf16 compute), on the current
    GPU or where ``device_map`` puts its modules."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    return AutoModelForCausalLM.from_pretrained(
        directory,
        quantization_config=quant,
        device_map=device_map or {"": torch.cuda.current_device()},
        dtype=torch.bfloat16,
        attn_implementation="eager",  # deterministic backward: no atomics in the attention kernel
    )


def split_over_two_gpus(layers: int) -> dict:
    """A ``device_map`` for a Llama of ``layers`` decoder layers: the embedding and the first half
    of the layers on GPU 0, the rest, the final norm and the head on GPU 1 (accelerate moves the
    activations between them)."""
    # Every module named: accelerate gives a "" entry's device to every submodule's inputs, also
    # those of a layer mapped elsewhere.
    first = {name: 0 for name in ("model.embed_tokens", "model.rotary_emb")}
    layer_map = {f"model.layers.{i}": int(i >= layers // 2) for i in range(layers)}
    return {**first, **layer_map, "model.norm": 1, "lm_head": 1}


def random_tokens(vocab: int, batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g, device="cuda")


def load_qlora(directory: str, seq: int = 256, seed: int = 0, batch: int = 1) -> QLoRAModel:
    """Quantize the checkpoint on load and add a LoRA adapter whose A and B are both random
    (seeded), so a merge changes the weights. ``batch`` x ``seq`` tokens per step: bitsandbytes'
    forward dequantizes (the gemm_4bit fallback) once that exceeds 1536."""
    from peft import LoraConfig, get_peft_model

    base = load_quantized(directory)
    torch.manual_seed(seed)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS, init_lora_weights=False)
    model = get_peft_model(base, lora)
    return QLoRAModel(model, random_tokens(base.config.vocab_size, batch, seq, seed))


def train_step(m: QLoRAModel) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward, loss, backward; returns the loss and every trainable parameter's gradient."""
    m.model.zero_grad(set_to_none=True)
    loss = m.model(input_ids=m.input_ids, labels=m.input_ids).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in m.model.named_parameters() if p.requires_grad}
    return loss.detach().clone(), grads


def state_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of the state dict (packed weights, absmax, nested statistics, norms...)."""
    return {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def wall_times(fn: Callable[[], object], repeats: int) -> list[float]:
    """Seconds per call of ``fn``, each call synchronised: the time a training loop sees."""
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def median_and_noise(samples: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(samples)
    return statistics.median(samples), (statistics.stdev(samples) / mean if len(samples) > 1 else float("inf"))


def temporary_checkpoint(**kwargs) -> tempfile.TemporaryDirectory:
    tmp = tempfile.TemporaryDirectory(prefix="nf4-harness-llama-")
    save_random_llama(tmp.name, **kwargs)
    return tmp
