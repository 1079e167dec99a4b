"""Host time of one public-call training step (forward + backward through autograd) on a short shape.

    python benchmarks/profile_call_host.py --head-dim 256 --length 1024 --batch 1 --out DIR

Times ``--steps`` steps (grads reset each step, as in training): the host's enqueue time per step against
the wall time, so a host-bound shape shows enqueue ~ wall. Then writes a ``torch.profiler`` table (self
CPU time per op and Python function, GPU time per kernel) and a cProfile listing by cumulative time to
``--out``. Uses the shipped artifacts, as training does.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.cli_args import at_least, attention_head_dims, needs_gpu, usage_errors  # noqa: E402


def check_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors before the artifacts load: ``--steps 0`` divided by zero after the warm-up steps, a batch of
    0 or a head dim above the kernels' failed building the inputs, and an ``--out`` that cannot be written
    lost the profiles at the end."""
    from autotune.tuning.cli_checks import writable_folder

    with usage_errors(p):
        attention_head_dims("--head-dim", args.head_dim, kernel=False)  # the public call pads a smaller head dim
        at_least(args, 1, "--heads", "--length", "--batch", "--steps")
        writable_folder("--out", args.out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--out", default="benchmarks/results/call_host_time")
    args = p.parse_args(argv)
    check_options(p, args)
    needs_gpu("profile_call_host.py")

    import autotune
    from autotune.runtime.ops import hstu_attention
    from kernel_templates.hstu_attention.testing import make_jagged_inputs

    autotune.load()
    d, n = args.head_dim, args.length
    inp = make_jagged_inputs([n] * args.batch, args.heads, d, d, torch.bfloat16, "cuda", seed=0, max_seq_len=n)
    q, k, v = (t.detach().requires_grad_(True) for t in (inp.q, inp.k, inp.v))
    do = torch.randn_like(inp.v)

    def step() -> None:
        q.grad = k.grad = v.grad = None
        hstu_attention(q, k, v, inp.seq_offsets, n).backward(do)

    for _ in range(20):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    print(f"enqueue {1e6 * (t1 - t0) / args.steps:.1f} us/step, wall {1e6 * (t2 - t0) / args.steps:.1f} us/step")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(20):
            step()
        torch.cuda.synchronize()
    (out / "torchprof_step.txt").write_text(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40))
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(args.steps):
        step()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(60)
    (out / "prof_step_cum.txt").write_text(s.getvalue())


if __name__ == "__main__":
    main()
