"""The graphed decode's host-side rules, without a GPU or transformers (its capture and replay run
in tests/test_e2e_matmul_gpu.py): which cache arguments reach each transformers generation, and
what a reset puts back."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from harness.perf import graphed_decode


def _fake_transformers(monkeypatch, init):
    calls = []

    class StaticCache:
        __init__ = init

        def __new__(cls, *args, **kwargs):
            calls.append(kwargs)
            return object.__new__(cls)

    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(StaticCache=StaticCache))
    return calls


def _model():
    return SimpleNamespace(config="config", device="cuda:0", dtype=torch.bfloat16)


def test_a_static_cache_gets_the_arguments_of_transformers_5(monkeypatch):
    def init(self, config, max_cache_len, offloading=False, offload_only_non_sliding=True, **kwargs):
        pass

    calls = _fake_transformers(monkeypatch, init)
    graphed_decode.static_cache(_model(), batch=8, length=96)
    assert calls == [{"config": "config", "max_cache_len": 96}]


def test_a_static_cache_gets_the_arguments_of_transformers_4(monkeypatch):
    def init(self, config, max_batch_size, max_cache_len, device=None, dtype=torch.float32):
        pass

    calls = _fake_transformers(monkeypatch, init)
    graphed_decode.static_cache(_model(), batch=8, length=96)
    assert calls == [
        {"config": "config", "max_cache_len": 96, "max_batch_size": 8, "device": "cuda:0", "dtype": torch.bfloat16}
    ]


def test_too_few_tokens_for_the_warm_up_is_refused_before_the_model_runs():
    model = SimpleNamespace()  # any use of it would raise AttributeError
    with pytest.raises(ValueError, match="new_tokens must be at least"):
        graphed_decode.GraphedDecode(
            model, torch.zeros(1, 4, dtype=torch.long), graphed_decode.GraphedDecode.WARMUP_STEPS - 1
        )


def test_a_reset_puts_back_the_first_token_the_position_and_every_cache_counter():
    decode = object.__new__(graphed_decode.GraphedDecode)
    decode.prompt, decode.new_tokens = 5, 4
    decode.first = torch.tensor([[7], [9]])
    decode.last = torch.tensor([[1], [2]])
    decode.position = torch.tensor([8])
    counting = [SimpleNamespace(cumulative_length=torch.tensor(8)) for _ in range(2)]
    plain = SimpleNamespace(cumulative_length=3)  # a Python count (a dynamic layer) is not ours to move
    decode.cache = SimpleNamespace(layers=[*counting, plain, SimpleNamespace()])
    decode.reset()
    assert decode.last.tolist() == [[7], [9]] and decode.position.tolist() == [5]
    assert [int(layer.cumulative_length) for layer in counting] == [5, 5] and plain.cumulative_length == 3
    with pytest.raises(ValueError, match=r"steps must be in 1\.\.4"):
        decode.run(5)
