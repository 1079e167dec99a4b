"""The op spec record: what the registry, the artifacts and the runtime dispatch know about an op.

Lives beside the configs because every template folder's ``spec.py`` builds one (no upward import);
``autotune.spec`` collects them. Strings (``"module:attr"``) keep it free of torch, triton and cutlass.
The contracts of the named callables are in ``autotune/spec.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BackendSpec:
    """One implementation of a kernel. ``"module:attr"`` strings; None = not provided."""

    name: str
    launcher: str | None
    config: str | None
    space: str | None
    tune_launch: str | None
    sources: tuple[str, ...] = ()
    requires: tuple[str, ...] = ()  # Python modules that must be importable (find_spec, never imported here)
    needs_cuda: bool = False
    compute_capability: tuple[int, int] | None = None  # exact capability the kernel is built for (sm90a)
    interpretable: bool = False  # runs without a GPU under TRITON_INTERPRET=1 (or is plain torch)
    jit_functions: str | None = None  # -> Triton JITFunctions, for compiler reports
    compile_report: str | None = None  # (inputs, config) -> dict, for non-Triton backends
    # dtype name the kernels read offsets/targets in ("int32"); the runtime passes a cast it caches per
    # unchanged tensor instead of the launcher casting on every call. None: any integer dtype.
    index_dtype: str | None = None
    # "module:fn" config -> rows of a sequence one launch-grid block covers along a grid dimension CUDA caps at
    # 65535 (y or z), None when the config's grids hold any length: how long a launch the config can take.
    grid_rows: str | None = None


@dataclass(frozen=True)
class KernelSpec:
    """One tuned kernel: one study per task, one artifact file per GPU."""

    name: str
    direction: str  # "fwd" | "bwd"
    make_inputs: str
    reference: str
    flops: str
    backends: tuple[BackendSpec, ...]
    alloc_out: str | None = None
    bytes: str | None = None  # inputs -> HBM bytes moved (memory-bound ops)
    output_names: tuple[str, ...] = ("out",)
    verify_masks: tuple[str, ...] = ()  # mask features a winner is re-checked on (empty: the task's own)
    default_backend: str | None = None  # what runs when nothing is tuned (None: the first available)
    # "module:fn" (dqk, dv, num_heads, dtype, interpret) -> {backend: config} heuristic defaults, in
    # preference order; None: each backend's search-space default.
    default: str | None = None

    def backend(self, name: str) -> BackendSpec:
        for b in self.backends:
            if b.name == name:
                return b
        raise ValueError(f"{self.name}: no backend {name!r}; has {', '.join(b.name for b in self.backends)}")


@dataclass(frozen=True)
class OpSpec:
    """An op and its kernels (forward, backward, ...)."""

    name: str
    kernels: tuple[KernelSpec, ...]
    doc: str = ""
    sources: tuple[str, ...] = field(default=())  # files every backend of every kernel depends on
