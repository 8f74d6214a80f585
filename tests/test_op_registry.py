"""One registry of ops (``harness.runtime.ops.OPS``, each op's product half) and the judge's
(``harness.correctness.op_checks.CHECKS``, each op's judge half): an op missing from either, or a
half without the other, fails here on the CPU instead of in the middle of a GPU session."""

from __future__ import annotations

import importlib

import pytest
import torch

from harness.correctness import op_checks
from harness.perf import catalog
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


def test_every_op_has_its_judge_half_under_its_own_name_and_the_perf_catalog_times_it():
    assert list(op_checks.CHECKS) == NAMES, "one judge half an op, in the registry's order"
    assert all(checks.name == name for name, checks in op_checks.CHECKS.items())
    timed = {case.kind for case in catalog.timed_cases()}
    assert timed == set(NAMES), "the perf catalog times every op"


def test_every_ops_entries_are_what_the_sanitizer_filters_by():
    from harness.correctness import sanitize

    assert all(sanitize.KERNEL_FILTER in entry for op in ops.OPS for entry in op.entries)
