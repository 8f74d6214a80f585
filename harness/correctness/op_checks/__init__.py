"""The judge's half of each op, one ``OpChecks`` an op in ``CHECKS``, keyed by the name of the
op's product half (``harness.runtime.ops.OPS``; tests/test_op_registry.py holds the two together).
Each op's battery of calls, valid and bad, is a module beside its checks (``*_battery.py``), which
only the tests import. Another op adds its modules here and one line in ``CHECKS``.
"""

from harness.correctness.op_checks import dequantize, matmul
from harness.correctness.op_checks.unit import OpChecks

CHECKS: dict[str, OpChecks] = {c.name: c for c in (dequantize.CHECKS, matmul.CHECKS)}
