"""``autotune.ops``: the public attention call under its short name (``autotune.ops.hstu_attention``).

The same module object as ``autotune.runtime.ops`` (its one home), so the custom ops are registered once and
whatever a caller sets on one name is seen through the other.
"""

from __future__ import annotations

import sys

from autotune.runtime import ops as _runtime_ops

sys.modules[__name__] = _runtime_ops
