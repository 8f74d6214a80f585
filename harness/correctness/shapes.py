"""The shapes catalog (``harness/correctness/data/shapes.json``), shared by the correctness and perf suites."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from importlib import resources


@dataclass(frozen=True)
class WeightShape:
    model: str
    layer: str
    shape: tuple[int, ...]

    @property
    def id(self) -> str:
        return f"{self.model}.{self.layer}"

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@functools.cache
def _catalog() -> dict:
    return json.loads(resources.files("harness.correctness").joinpath("data/shapes.json").read_text())


def model_shapes(unique: bool = True) -> list[WeightShape]:
    """Every model weight shape; ``unique`` keeps the first layer of each distinct shape per model."""
    out, seen = [], set()
    for model, layers in _catalog()["models"].items():
        for layer, shape in layers.items():
            key = (model, tuple(shape))
            if unique and key in seen:
                continue
            seen.add(key)
            out.append(WeightShape(model, layer, tuple(shape)))
    return out


def full_matrix_shapes() -> list[WeightShape]:
    wanted = {tuple(x) for x in _catalog()["full_matrix_models"]}
    return [s for s in model_shapes(unique=False) if (s.model, s.layer) in wanted]


def odd_shapes() -> list[tuple[int, ...]]:
    return [tuple(s) for s in _catalog()["odd"]]
