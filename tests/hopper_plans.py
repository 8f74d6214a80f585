"""What the driver reports for the fused matmul kernels' plans on an H100 and an H200 alike (132
SMs): blocks an SM and clusters of s splits held at once, index s (cuOccupancyMaxActiveClusters),
for the kernels with the cluster epilogue. The grid tests run the split rules on these."""

from __future__ import annotations

SMS = 132
# The 8-token kernel: 4 blocks an SM, clusters of up to 16 splits (past 8 with the kernel's
# non-portable-size attribute).
M8_PER_SM, M8_CLUSTERS = 4, (0, 528, 264, 163, 124, 94, 79, 69, 62, 51, 44, 37, 37, 30, 30, 28, 28)
# The pair-table kernel at 16 tokens (nested scales): 3 blocks an SM (its 168 registers and 51 KB of
# shared memory), clusters of up to 16 splits. At 16 tokens the plain-scale kernel's plan is M8's.
PAIRS16_PER_SM, PAIRS16_CLUSTERS = 3, (0, 396, 198, 124, 92, 69, 62, 47, 45, 37, 30, 28, 28, 23, 21, 21, 21)
# The pair-table kernel at 32 tokens (nested scales): 2 blocks an SM (225 registers, 72 KB of shared
# memory), clusters of up to 16 splits.
PAIRS32_PER_SM, PAIRS32_CLUSTERS = 2, (0, 264, 132, 79, 62, 47, 39, 32, 30, 23, 21, 16, 16, 14, 14, 14, 14)
# The Hopper kernel at 32 tokens (plain scales): 5 blocks an SM (4 warps of 96 registers), no cluster epilogue.
WIDE32_PER_SM = 5
# The Hopper kernel at 64 tokens: 2 blocks an SM, pairs only (matmul_kernel.CLUSTER_SPLITS).
WIDE64_PER_SM, WIDE64_CLUSTERS = 2, (0, 264, 132)
# The Hopper kernel at 128 tokens: one block an SM (8 warps of 180 registers, or 12 of 168), no cluster epilogue.
WIDE128_PER_SM = 1


def wide128_plans() -> dict:
    """The 128-token tile's plans of both Hopper builds (8 and 12 warps) by warps, as the grid rules
    and ``pick_plan`` read them (no kernels)."""
    from harness.runtime import matmul_kernel as mk

    builds = (mk.WARPS[128], mk.WIDE_WARPS[128])
    return {w: mk.Plan(None, None, 32 * w, WIDE128_PER_SM, SMS, (), mk.WAVES_WIDE, w) for w in builds}
