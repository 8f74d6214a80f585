"""Greedy decoding of a transformers causal LM as one captured CUDA graph per step, over a static
KV cache: the host's Python (transformers', bitsandbytes' and ours) is out of the step's time, as
in transformers' static-cache compile path, without its compile time.

A step reads the last token and its position from fixed GPU buffers, builds its attention mask
from the position, runs the model, writes the argmax into the token buffer and into the step's
column of ``tokens``, and advances the position: replaying the graph ``n`` times decodes ``n``
tokens with no host work but the replays. Whatever path each 4-bit matmul takes (bitsandbytes' or
``patch_bitsandbytes(matmul=True)``'s) is fixed when the graph is captured, so one graph per mode.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def capture(
    run: Callable[[], T], device: torch.device, warmups: int = 1, before_capture: Callable[[], object] = lambda: None
) -> tuple[torch.cuda.CUDAGraph, T]:
    """``run`` captured as a CUDA graph, after ``warmups`` eager calls on a side stream (torch.cuda.graph's
    rule: warm up off the capturing stream) and then ``before_capture``; with what the captured call
    returned (the buffers every replay writes)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmups):
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    before_capture()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = run()
    return graph, result


def static_cache(model: torch.nn.Module, batch: int, length: int):
    """A ``StaticCache`` of ``length`` positions, built with whichever of its constructor's
    arguments this transformers version takes."""
    from transformers import StaticCache

    offered = {
        "config": model.config,
        "max_cache_len": length,
        "max_batch_size": batch,
        "device": model.device,
        "dtype": model.dtype,
    }
    accepted = inspect.signature(StaticCache.__init__).parameters
    return StaticCache(**{k: v for k, v in offered.items() if k in accepted})


class GraphedDecode:
    """Prefill ``ids`` eagerly, then capture one greedy decode step; ``run(n)`` decodes ``n``
    tokens by replaying it and returns them ([batch, n])."""

    WARMUP_STEPS = 2  # compiles and loads every kernel, and fills lazy state, before the capture

    def __init__(self, model: torch.nn.Module, ids: torch.Tensor, new_tokens: int):
        if new_tokens < self.WARMUP_STEPS:
            raise ValueError(f"new_tokens must be at least {self.WARMUP_STEPS}, got {new_tokens}")
        self.model, self.prompt, self.new_tokens = model, ids.shape[1], new_tokens
        device = ids.device
        self.cache = static_cache(model, ids.shape[0], self.prompt + new_tokens)
        with torch.no_grad():
            logits = model(
                input_ids=ids,
                past_key_values=self.cache,
                cache_position=torch.arange(self.prompt, device=device),
                use_cache=True,
            ).logits
        self.first = logits[:, -1].argmax(-1, keepdim=True)
        self.last = self.first.clone()
        self.position = torch.full((1,), self.prompt, dtype=torch.long, device=device)
        self.tokens = torch.zeros(ids.shape[0], new_tokens, dtype=torch.long, device=device)
        # The step's attention mask, built on the GPU from the position (transformers would build
        # one from host constants, which a capture cannot copy): cache slots up to the position
        # open, the rest closed; a 4D mask is taken as given.
        self.slots = torch.arange(self.prompt + new_tokens, device=device)
        self.open = torch.zeros((), dtype=model.dtype, device=device)
        self.closed = torch.full((), torch.finfo(model.dtype).min, dtype=model.dtype, device=device)
        self.graph, _ = capture(self.step, device, self.WARMUP_STEPS, self.reset)
        self.reset()

    def step(self) -> None:
        """One greedy decode step on the fixed buffers (eager, or recorded while capturing)."""
        mask = torch.where(self.slots <= self.position, self.open, self.closed)
        with torch.no_grad():
            logits = self.model(
                input_ids=self.last,
                attention_mask=mask.expand(self.last.shape[0], 1, 1, -1),
                past_key_values=self.cache,
                cache_position=self.position,
                use_cache=True,
            ).logits
        token = logits[:, -1].argmax(-1, keepdim=True)
        self.tokens.index_copy_(1, self.position - self.prompt, token)
        self.last.copy_(token)
        self.position.add_(1)

    def reset(self) -> None:
        """Back to the token the prefill chose: the cache past the prompt is rewritten as it is read."""
        self.last.copy_(self.first)
        self.position.fill_(self.prompt)
        for layer in getattr(self.cache, "layers", ()):  # caches that count their own length on the GPU
            length = getattr(layer, "cumulative_length", None)
            if isinstance(length, torch.Tensor):
                length.fill_(self.prompt)

    def run(self, steps: int | None = None, graphed: bool = True) -> torch.Tensor:
        """Decode ``steps`` tokens (all ``new_tokens`` by default) by replays, or eagerly."""
        steps = self.new_tokens if steps is None else steps
        if not 0 < steps <= self.new_tokens:
            raise ValueError(f"steps must be in 1..{self.new_tokens}, got {steps}")
        self.reset()
        for _ in range(steps):
            if graphed:
                self.graph.replay()
            else:
                self.step()
        return self.tokens[:, :steps].clone()
