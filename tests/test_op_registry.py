"""One registry of ops (``harness.runtime.ops.OPS``) and the tables keyed by it: an op missing from
any of them, or an entry for an op that is not registered, fails here on the CPU instead of in the
middle of a GPU session."""

from __future__ import annotations

import importlib

import pytest
import torch

from harness.correctness import sanitize_cases
from harness.perf import catalog, stage
from harness.runtime import host_launcher, ops, torch_op

NAMES = [op.name for op in ops.OPS]


def test_op_names_are_unique():
    assert len(set(NAMES)) == len(NAMES)


@pytest.mark.parametrize("op", ops.OPS, ids=NAMES)
def test_each_ops_call_module_declares_its_host_path_and_torch_ops(op):
    module = importlib.import_module(op.call_module)
    assert isinstance(module.HOST, host_launcher.HostOp) and module.HOST.name == op.name
    assert module.TORCH_OPS and all(isinstance(t, torch_op.TorchOp) for t in module.TORCH_OPS)
    for t in module.TORCH_OPS:  # registered as the module loaded
        assert hasattr(getattr(torch.ops, torch_op.NAMESPACE), t.name), t.name


def test_the_torch_op_names_are_unique_across_ops():
    names = [t.name for op in ops.OPS for t in importlib.import_module(op.call_module).TORCH_OPS]
    assert len(set(names)) == len(names)


def test_every_tooling_table_is_keyed_by_the_registry():
    assert set(stage.KINDS) == set(NAMES), "perf stage kinds"
    assert set(sanitize_cases.CASES) == set(NAMES), "sanitizer cases"
    timed = {case.kind for case in catalog.timed_cases()}
    assert timed == set(NAMES), "the perf catalog times every op"


def test_every_ops_entries_are_what_the_sanitizer_filters_by():
    from harness.correctness import sanitize

    assert all(sanitize.KERNEL_FILTER in entry for op in ops.OPS for entry in op.entries)
