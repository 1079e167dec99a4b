"""Worker subprocess that compiles, checks and times configs, so a bad config cannot take the tuner down.

The tuner talks to one long-lived ``spawn``ed worker (its compile cache and CUDA context survive
across trials and tasks). A request that times out kills the worker (a hang); a worker that dies
(segfault, abort, fatal CUDA error) is a crash. The tuner decides what follows (``autotune.tuning.tuner``):
a retry on a fresh worker, a health probe with a known-good config after any failed request, and
set-up failures treated as infrastructure, never as a config's fault. Every output that is timed is
first checked against the reference on the same inputs (outputs pre-filled with NaN and guarded, inputs
fingerprinted: ``bounds``), and checked again after its timed launches (one more launch into the timed
output, and the fingerprints of every batch the session holds: a stray write made only in a timed loop);
the final winner is re-checked on several shapes, masks and dtypes of its bucket (``verify``). A write
that lands outside everything fingerprinted (another process's memory, the allocator's free blocks) is
seen only through its effects: the health probe after a failure, and the re-check.
"""

from __future__ import annotations

import multiprocessing as mp
import random
import time
import traceback
from typing import Any

FATAL_MARKERS = ("illegal memory access", "unspecified launch failure", "CUDA error", "misaligned address")


class WorkerError(Exception):
    """The worker hung ('timeout') or died ('crash')."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Worker:
    """Parent-side handle: ``call(msg, timeout)`` returns the reply dict or raises ``WorkerError``."""

    def __init__(self, plugins: list[str]) -> None:
        self.plugins = list(plugins)
        self._proc: mp.process.BaseProcess | None = None
        self._conn = None
        self.task_key: str | None = None
        self.restarts = 0

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_main, args=(child, self.plugins), daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        self.task_key = None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    def call(self, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        if not self.alive():
            self.start()
        assert self._conn is not None
        try:
            self._conn.send(msg)
            if not self._conn.poll(timeout):
                self.kill()
                raise WorkerError("timeout", f"no reply within {timeout:.0f} s (hang?)")
            reply = self._conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError, OSError):
            code = self._proc.exitcode if self._proc else None
            if self._proc is not None:
                self._proc.join(5)
                code = self._proc.exitcode
            self.kill()
            raise WorkerError("crash", f"worker died (exit code {code})") from None
        if reply.get("fatal"):
            self.kill()
        return reply

    def kill(self) -> None:
        """Stop the worker (it is replaced on the next call)."""
        if self._proc is not None:
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join(10)
            self.restarts += 1
        if self._conn is not None:
            self._conn.close()
        self._proc, self._conn, self.task_key = None, None, None

    def close(self) -> None:
        if self.alive():
            try:
                self._conn.send({"cmd": "exit"})
                self._proc.join(5)
            except OSError:
                pass
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._proc, self._conn, self.task_key = None, None, None


# ----------------------------------------------------------------------------------------- child side


def check_lengths(max_len: int, seed: int) -> list[int]:
    """A small correctness batch: the longest sequence, two odd random lengths, a single token, an empty one."""
    rng = random.Random(f"check:{seed}:{max_len}")
    # Odd, so never a multiple of a tile: a kernel wrong on partial last tiles is caught on the first launch.
    mid = [min(max_len, rng.randint(1, max(1, max_len - 1)) | 1) for _ in range(2)]
    return [max_len, *mid, 1, 0]


def verify_lengths(max_len: int, seed: int) -> dict[str, list[int]]:
    """The winner's extra shapes: many short sequences (odd lengths, empty and single ones) and one
    very long sequence beside tiny ones. Deterministic per (seed, max_len)."""
    rng = random.Random(f"verify:{seed}:{max_len}")
    short_cap = max(1, min(max_len, 96))
    many_short = [rng.randint(0, short_cap) for _ in range(94)] + [1, 0]
    one_long = [1, max_len, 0, rng.randint(1, max(1, min(max_len, 33)))]
    return {"many-short": many_short, "one-long": one_long}


def verify_dtypes(task_dtype: str, on_gpu: bool) -> tuple[str, ...]:
    """Both half types on a GPU (plus fp32 when tuned in fp32); off the GPU the interpreter's
    bfloat16 is wrong, so the task's dtype and float16."""
    if on_gpu:
        out = ("bfloat16", "float16") + (("float32",) if task_dtype == "float32" else ())
    else:
        out = (task_dtype, "float16")
    return tuple(dict.fromkeys((task_dtype, *out)))


class _Reference:
    """One input set with its fp32 reference and PyTorch's own error in the kernel's dtype."""

    def __init__(self, op: Any, task: Any, lengths: list[int], seed: int, device: str) -> None:
        import torch

        from autotune.tuning import measure

        self.dtype = getattr(torch, task.dtype)
        self.inputs = op.make_inputs(task, lengths, seed, device, self.dtype)
        self.ref32 = op.reference(self.inputs, torch.float32)
        ref_lo = self.ref32 if self.dtype == torch.float32 else op.reference(self.inputs, self.dtype)
        self.errs = measure.torch_errors(self.ref32, ref_lo)
        self.dtypes = [t.dtype for t in ref_lo]  # each output's dtype in PyTorch's own run: its tolerance
        self.names = op.output_names
        self.op = op

    def check(self, backend: Any, config: Any) -> tuple[bool, Any]:
        """Launch ``config`` once on NaN-filled, guarded outputs, synchronise, compare with the reference;
        a write outside the outputs or into an input fails it whatever the outputs hold (``bounds``)."""
        from autotune.tuning import bounds, measure

        guard, prints = bounds.OutputGuard(self.op.alloc_out(self.inputs)), bounds.InputPrints(self.inputs)
        outs = backend.launch(self.inputs, config, guard.outs)
        measure.synchronize()
        verdict = measure.check_outputs(outs, self.ref32, self.errs, self.names, self.dtypes)
        return checked(verdict, guard, prints, self.names)


class StrayWrite(Exception):
    """A checked launch wrote outside its outputs or into its inputs: the process's tensors (inputs,
    references, anything past the guard) can no longer be trusted, so the worker is replaced."""


def _held_prints(check: _Reference, timed: _Reference) -> Any:
    """Fingerprints of what a session holds for every later config (both batches' inputs and references)."""
    from autotune.tuning import bounds

    held = {}
    for label, ref in (("check", check), ("timed", timed)):
        held.update({f"{label} batch {k}": v for k, v in ref.inputs.items()})
        held.update({f"{label} batch reference {n}": r for n, r in zip(ref.names, ref.ref32, strict=False)})
    return bounds.InputPrints(held)


def checked(result: tuple[bool, Any], guard: Any, prints: Any, names: Any) -> tuple[bool, Any]:
    """``check_outputs``'s verdict, or ``StrayWrite`` naming every write the launch made outside its outputs."""
    stray = guard.problems(names) + prints.problems()
    if stray:
        raise StrayWrite("; ".join(stray))
    return result


class _Session:
    """Per-task state in the worker: timing inputs, correctness inputs and their references."""

    def __init__(self, msg: dict[str, Any]) -> None:
        from autotune.tuning import measure
        from autotune.tuning.registry import get_op
        from autotune.tuning.tasks import Task

        t0 = time.perf_counter()
        self.task = Task.from_dict(msg["task"])
        self.op = get_op(self.task.kernel)
        self.device = measure.device()
        seed = self.task.seed
        self.check_ref = _Reference(
            self.op, self.task, check_lengths(self.task.max_len, seed), 1000 * seed + 2, self.device
        )
        self.timed = _Reference(self.op, self.task, self.task.lengths(), 1000 * seed + 1, self.device)
        self.inputs = self.timed.inputs
        self.flops = self.op.flops(self.inputs)
        self.cuda_graph = bool(msg.get("cuda_graph", False))
        self.held = _held_prints(self.check_ref, self.timed)
        self.setup_s = time.perf_counter() - t0

    def _config(self, msg: dict[str, Any]):
        from autotune.tuning.registry import get_backend

        backend = get_backend(self.task.kernel, msg["backend"])
        return backend, backend.space.make(msg["config"])

    def evaluate(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Compile (first launch, on poisoned outputs), read the report, check, then time (checked)."""
        from autotune.tuning import bounds, measure

        backend, config = self._config(msg)
        ref = self.check_ref
        guard, prints = bounds.OutputGuard(self.op.alloc_out(ref.inputs)), bounds.InputPrints(ref.inputs)
        nbytes = sum(t.numel() * t.element_size() for t in ref.inputs.values() if hasattr(t, "numel"))
        measure.poison_allocator(2 * nbytes)
        t0 = time.perf_counter()
        try:
            with measure.capture_compiled(backend.jit_functions()) as kernels:
                outs = backend.launch(ref.inputs, config, guard.outs)
                measure.synchronize()
        except Exception as e:  # noqa: BLE001 - any failure of the first launch is a compile failure
            return _failure("compile", e)
        compile_s = time.perf_counter() - t0
        if backend.compile_report is not None:
            report = backend.compile_report(ref.inputs, config)
        else:
            report = measure.compile_report(kernels)
        res: dict[str, Any] = {"report": report, "compile_s": compile_s}
        checked((True, None), guard, prints, self.op.output_names)  # a stray write outranks every other verdict
        spills = report.get("n_spills")
        if spills is not None and spills > msg.get("spill_limit", 1 << 30):
            return {**res, "status": "spill", "error": f"{spills} spills > limit {msg['spill_limit']}"}
        ok, detail = measure.check_outputs(outs, ref.ref32, ref.errs, self.op.output_names, ref.dtypes)
        res["check"] = detail
        if not ok:
            return {**res, "status": "incorrect", "error": f"outside tolerance on the check batch: {detail}"}
        return {**res, **self.timed_run(backend, config, quick=msg.get("quick", True))}

    def timed_run(self, backend: Any, config: Any, quick: bool) -> dict[str, Any]:
        """Check the first launch on the timing batch itself, then time it: a config wrong only on
        the timed inputs (a grid too small for many sequences) never gets a time."""
        from autotune.tuning import measure

        try:
            ok, detail = self.timed.check(backend, config)
        except Exception as e:  # noqa: BLE001
            return _failure("crash", e)
        if not ok:
            return {"status": "incorrect", "error": f"outside tolerance on the timed batch: {detail}", "check": detail}
        out = self.op.alloc_out(self.inputs)
        launch = lambda: backend.launch(self.inputs, config, out)
        try:
            t = measure.bench(launch, quick=quick, cuda_graph=self.cuda_graph)
            wrong = self.after_timing(backend, config, out)
        except Exception as e:  # noqa: BLE001
            return _failure("crash", e)
        if wrong is not None:
            return wrong
        return {"status": "ok", "median_ms": t.median_ms, "spread_ms": t.spread_ms, "samples": t.samples}

    def after_timing(self, backend: Any, config: Any, out: Any) -> dict[str, Any] | None:
        """After a config's timed launches (unchecked, many, into one output): one more launch into the same
        output, checked, and the held batches' inputs and references unchanged. A config right on its first
        launches only (stale state) or writing stray memory only in a timed loop fails here: the reply
        (None when right), or ``StrayWrite``."""
        from autotune.tuning import measure

        outs = backend.launch(self.inputs, config, out)
        measure.synchronize()
        stray = self.held.problems()
        if stray:
            raise StrayWrite("while timed: " + "; ".join(stray))
        ok, detail = measure.check_outputs(
            outs, self.timed.ref32, self.timed.errs, self.op.output_names, self.timed.dtypes
        )
        if ok:
            return None
        return {
            "status": "incorrect",
            "error": f"outside tolerance after its timed launches: {detail}",
            "check": detail,
        }

    def time(self, msg: dict[str, Any]) -> dict[str, Any]:
        backend, config = self._config(msg)
        return self.timed_run(backend, config, quick=msg.get("quick", False))

    def probe(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Health check after a failed request: a known-good config on the check batch and on the timed batch,
        synchronised. Both, as a stray write far from a bad config's outputs may have hit either batch's inputs
        or references, and every later config is checked on both."""
        backend, config = self._config(msg)
        for name, ref in (("check", self.check_ref), ("timed", self.timed)):
            try:
                ok, detail = ref.check(backend, config)
            except Exception as e:  # noqa: BLE001
                return _failure("crash", e)
            if not ok:
                return {"status": "incorrect", "error": f"probe outside tolerance on the {name} batch: {detail}"}
        return {"status": "ok"}

    def compare(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Interleaved timings A, B, A, B, ... (each checked on its first launch), so drift in clocks
        or temperature hits both configs alike."""
        from autotune.tuning import measure

        pairs = [self._config(msg["a"]), self._config(msg["b"])]
        times: list[list[float]] = [[], []]
        for side, (backend, config) in enumerate(pairs):
            try:
                ok, detail = self.timed.check(backend, config)
            except StrayWrite as e:
                return {**_failure("incorrect", e), "side": "ab"[side]}
            if not ok:
                return {"status": "incorrect", "side": "ab"[side], "error": f"outside tolerance: {detail}"}
        outs = [self.op.alloc_out(self.inputs) for _ in pairs]
        for _ in range(int(msg.get("rounds", 6))):
            for side, (backend, config) in enumerate(pairs):
                out = outs[side]
                launch = lambda b=backend, c=config, o=out: b.launch(self.inputs, c, o)  # noqa: E731
                times[side].append(measure.bench(launch, quick=True, cuda_graph=self.cuda_graph).median_ms)
        for side, (backend, config) in enumerate(pairs):
            try:
                wrong = self.after_timing(backend, config, outs[side])
            except StrayWrite as e:
                return {**_failure("incorrect", e), "side": "ab"[side]}
            if wrong is not None:
                return {**wrong, "side": "ab"[side]}
        return {"status": "ok", "a_ms": times[0], "b_ms": times[1]}

    def verify(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Re-check a config on the bucket's other shapes, every mask the op has and both dtypes
        (``verify_config``; ``level`` "full" or "quick")."""
        backend, config = self._config(msg)
        return verify_config(self.op, self.task, backend, config, msg.get("level", "full") == "full", self.device)


def verify_cases(op: Any, task: Any, full: bool, on_gpu: bool) -> list[tuple[str, Any, list[int]]]:
    """(label, task variant, lengths) of a winner's re-check. "full": every mask the op verifies x both
    half dtypes on many short sequences, plus one very long sequence with every mask in the task's
    dtype; "quick" (``full`` False): the task's own mask and dtype on both shapes. The task's own mask is
    one of "full"'s too when the op's list lacks it, so "full" never checks less than "quick"."""
    import dataclasses

    masks = tuple(dict.fromkeys((*op.verify_masks, task.mask))) if full else (task.mask,)
    dtypes = verify_dtypes(task.dtype, on_gpu) if full else (task.dtype,)
    shapes = verify_lengths(task.max_len, task.seed)
    cases = []
    for dtype in dtypes:
        for mask in masks:
            variant = dataclasses.replace(task, dtype=dtype, mask=mask)
            for name, lengths in shapes.items():
                if name == "one-long" and dtype != task.dtype:
                    continue  # the long shape adds no compile; one dtype is enough
                cases.append((f"{name}/{mask}/{dtype}", variant, lengths))
    return cases


def verify_config(op: Any, task: Any, backend: Any, config: Any, full: bool, device: str) -> dict[str, Any]:
    """Check ``config`` against the reference on every case of ``verify_cases``; cases the config's
    space rules out for a variant are listed as skipped with the reason. Stops at the first failure."""
    from autotune.tuning.tasks import space_context

    checked, skipped = [], []
    for i, (label, variant, lengths) in enumerate(verify_cases(op, task, full, device == "cuda")):
        reason = backend.space.why_infeasible(config, space_context(variant, device != "cuda"))
        if reason:
            skipped.append(f"{label}: {reason}")
            continue
        try:
            ref = _Reference(op, variant, lengths, 1000 * task.seed + 10 + i, device)
            ok, detail = ref.check(backend, config)
        except Exception as e:  # noqa: BLE001
            return {**_failure("crash", e), "case": label, "checked": checked}
        if not ok:
            return {"status": "incorrect", "case": label, "error": f"{label}: {detail}", "checked": checked}
        checked.append(label)
    return {"status": "ok", "checked": checked, "skipped": skipped}


def recheck(msg: dict[str, Any]) -> dict[str, Any]:
    """``verify_config`` of one artifact entry, without a task session (no timing batch is built)."""
    from autotune.tuning import measure
    from autotune.tuning.registry import get_backend, get_op
    from autotune.tuning.tasks import Task

    task = Task.from_dict(msg["task"])
    backend = get_backend(task.kernel, msg["backend"])
    config = backend.space.make(msg["config"])
    full = msg.get("level", "full") == "full"
    return verify_config(get_op(task.kernel), task, backend, config, full, measure.device())


def _failure(status: str, e: BaseException) -> dict[str, Any]:
    """The reply for an exception; a stray write is the config's fault ("incorrect") and ends the worker."""
    text = f"{type(e).__name__}: {e}"
    fatal = any(m in text for m in FATAL_MARKERS)
    if isinstance(e, StrayWrite):
        status, fatal = "incorrect", True
    return {"status": status, "error": text[-2000:], "trace": traceback.format_exc()[-4000:], "fatal": fatal}


_COMMANDS = ("evaluate", "time", "probe", "compare", "verify")


def _die_with_parent() -> None:
    """Linux: the worker is killed when the tuner process dies (kill -9 included), so an orphaned
    worker never keeps the GPU busy under the next tuner's timings. Elsewhere a no-op."""
    import contextlib
    import ctypes
    import signal
    import sys

    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


def _main(conn, plugins: list[str]) -> None:
    """Worker loop: one request, one reply."""
    from autotune.tuning.registry import load_plugins

    _die_with_parent()
    try:
        load_plugins(plugins)
        unusable = None
    except Exception as e:  # noqa: BLE001 - every reply names it, instead of a worker dying with exit code 1
        unusable = {**_failure("crash", e), "error": f"plugin import failed: {type(e).__name__}: {e}"}
    session: _Session | None = None
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        cmd = msg.get("cmd")
        if cmd == "exit":
            return
        try:
            if unusable is not None:
                reply = unusable
            elif cmd == "setup":
                session = None
                session = _Session(msg)
                reply = {"status": "ok", "flops": session.flops, "setup_s": session.setup_s}
            elif cmd == "ping":  # started and ready (imports and plugins loaded)
                reply = {"status": "ok"}
            elif cmd == "recheck":
                reply = recheck(msg)
            elif session is None:
                reply = {"status": "crash", "error": "no task set up"}
            elif cmd == "noop":
                reply = {"status": "ok"}
            elif cmd in _COMMANDS:
                reply = getattr(session, cmd)(msg)
            else:
                reply = {"status": "crash", "error": f"unknown command {cmd!r}"}
        except Exception as e:  # noqa: BLE001 - reported to the tuner, which decides
            reply = _failure("crash", e)
        conn.send(reply)
        if reply.get("fatal"):
            return
