"""CUDA's launch-grid limits, in one torch-free module: the kernels' input checks and the tuner's task
limits (read before any kernel module loads) both take them from here."""

from __future__ import annotations

# A launch grid's y and z dimensions: the attention kernels that put sequences or row blocks there
# cannot launch past it.
GRID_YZ_MAX = 65535
# A launch grid's x dimension.
GRID_X_MAX = 2**31 - 1
