"""The judge's half of each op, one ``OpChecks`` an op in ``CHECKS``, keyed by the name of the
op's product half (``harness.runtime.ops.OPS``; tests/test_op_registry.py holds the two together).
Another op adds its module here and one line in ``CHECKS``.
"""

from harness.correctness.op_checks import dequantize, matmul
from harness.correctness.op_checks.unit import OpChecks

CHECKS: dict[str, OpChecks] = {c.name: c for c in (dequantize.CHECKS, matmul.CHECKS)}
