"""Worker subprocess that compiles, checks and times configs, so a bad config cannot take the tuner down.

The tuner talks to one long-lived ``spawn``ed worker (its compile cache and CUDA context survive
across trials and tasks). A request that times out kills the worker (a hang); a worker that dies
(segfault, abort, fatal CUDA error) is a crash; either way the tuner records the trial and starts a
fresh worker. Fatal CUDA errors poison the context, so the worker exits after reporting them.
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
    mid = [rng.randint(1, max(1, max_len - 1)) for _ in range(2)]
    return [max_len, *mid, 1, 0]


class _Session:
    """Per-task state in the worker: timing inputs, correctness inputs and their references."""

    def __init__(self, msg: dict[str, Any]) -> None:
        import torch

        from autotune import measure
        from autotune.registry import get_op
        from autotune.tasks import Task

        t0 = time.perf_counter()
        self.task = Task.from_dict(msg["task"])
        self.op = get_op(self.task.kernel)
        self.device = measure.device()
        self.dtype = getattr(torch, self.task.dtype)
        seed = self.task.seed
        self.inputs = self.op.make_inputs(self.task, self.task.lengths(), 1000 * seed + 1, self.device, self.dtype)
        self.check_inputs = self.op.make_inputs(
            self.task, check_lengths(self.task.max_len, seed), 1000 * seed + 2, self.device, self.dtype
        )
        self.ref32 = self.op.reference(self.check_inputs, torch.float32)
        self.ref_lo = self.ref32 if self.dtype == torch.float32 else self.op.reference(self.check_inputs, self.dtype)
        self.flops = self.op.flops(self.inputs)
        self.cuda_graph = bool(msg.get("cuda_graph", False))
        self.setup_s = time.perf_counter() - t0

    def _config(self, msg: dict[str, Any]):
        from autotune.registry import get_backend

        backend = get_backend(self.task.kernel, msg["backend"])
        return backend, backend.space.make(msg["config"])

    def evaluate(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Compile (first launch, on poisoned outputs), read the report, check, quick-time."""
        from autotune import measure

        backend, config = self._config(msg)
        out = self.op.alloc_out(self.check_inputs)
        nbytes = sum(t.numel() * t.element_size() for t in self.check_inputs.values() if hasattr(t, "numel"))
        measure.poison_allocator(2 * nbytes)
        t0 = time.perf_counter()
        try:
            with measure.capture_compiled(backend.jit_functions()) as kernels:
                outs = backend.launch(self.check_inputs, config, out)
                measure.synchronize()
        except Exception as e:  # noqa: BLE001 - any failure of the first launch is a compile failure
            return _failure("compile", e)
        compile_s = time.perf_counter() - t0
        if backend.compile_report is not None:
            report = backend.compile_report(self.check_inputs, config)
        else:
            report = measure.compile_report(kernels)
        res: dict[str, Any] = {"report": report, "compile_s": compile_s}
        spills = report.get("n_spills")
        if spills is not None and spills > msg.get("spill_limit", 1 << 30):
            return {**res, "status": "spill", "error": f"{spills} spills > limit {msg['spill_limit']}"}
        ok, detail = measure.check_outputs(outs, self.ref32, self.ref_lo, self.op.output_names)
        res["check"] = detail
        if not ok:
            return {**res, "status": "incorrect", "error": f"outside tolerance: {detail}"}
        try:
            median, spread = self._time(backend, config, quick=msg.get("quick", True))
        except Exception as e:  # noqa: BLE001
            return {**res, **_failure("crash", e)}
        return {**res, "status": "ok", "median_ms": median, "spread_ms": spread}

    def _time(self, backend, config, quick: bool) -> tuple[float, float]:
        from autotune import measure

        out = self.op.alloc_out(self.inputs)
        launch = lambda: backend.launch(self.inputs, config, out)
        return measure.bench(launch, quick=quick, cuda_graph=self.cuda_graph)

    def time(self, msg: dict[str, Any]) -> dict[str, Any]:
        backend, config = self._config(msg)
        try:
            median, spread = self._time(backend, config, quick=msg.get("quick", False))
        except Exception as e:  # noqa: BLE001
            return _failure("crash", e)
        return {"status": "ok", "median_ms": median, "spread_ms": spread}


def _failure(status: str, e: BaseException) -> dict[str, Any]:
    text = f"{type(e).__name__}: {e}"
    fatal = any(m in text for m in FATAL_MARKERS)
    return {"status": status, "error": text[-2000:], "trace": traceback.format_exc()[-4000:], "fatal": fatal}


def _main(conn, plugins: list[str]) -> None:
    """Worker loop: one request, one reply."""
    from autotune.registry import load_plugins

    load_plugins(plugins)
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
            if cmd == "setup":
                session = None
                session = _Session(msg)
                reply = {"status": "ok", "flops": session.flops, "setup_s": session.setup_s}
            elif session is None:
                reply = {"status": "crash", "error": "no task set up"}
            elif cmd == "noop":
                reply = {"status": "ok"}
            elif cmd == "evaluate":
                reply = session.evaluate(msg)
            elif cmd == "time":
                reply = session.time(msg)
            else:
                reply = {"status": "crash", "error": f"unknown command {cmd!r}"}
        except Exception as e:  # noqa: BLE001 - reported to the tuner, which decides
            reply = _failure("crash", e)
        conn.send(reply)
        if reply.get("fatal"):
            return
