"""The attention heatmap report: TFLOP/s and MFU over batch x length, per direction, head dim and heads.

``measure_grid`` times the public call (``autotune.runtime.ops.hstu_attention``, tuned and default configs)
on uniform-length causal batches, as the published CUTLASS HSTU heatmap does; ``write_report`` turns
rows (measured here, or read back from a CSV) into one CSV and PNG heatmaps per (direction, head dim,
heads, source), plus a ratio map against a reference table the user passes (for example the
published CUTLASS numbers). Rows are plain dicts with the keys of ``COLUMNS``.
"""

from __future__ import annotations

import csv
import math
import re
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

DIRECTIONS = ("fwd", "bwd", "both")
MAX_TOKENS = 1 << 20  # cells of more rows than this are left out of a measured grid
GRID_BATCHES = tuple(2**i for i in range(8))  # 1 .. 128
GRID_LENGTHS = tuple(2**i for i in range(7, 15))  # 128 .. 16K
KEY = ("direction", "dqk", "heads", "batch", "length")
COLUMNS = (*KEY, "source", "ms", "tflops", "mfu")


def _key(row: dict[str, Any]) -> tuple:
    return tuple(str(row[k]) for k in KEY)


_INTS = ("dqk", "heads", "batch", "length")
_EXTRA = "\0extra"  # DictReader's key for the fields of a row longer than its header
_SOURCE_OK = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")  # goes into PNG file names: no separators, no dot-dot


def _number(text: str | None, where: str, column: str, optional: bool) -> float:
    """A finite non-negative number of a table cell; '' (or 'nan') is a missing value where ``optional``."""
    t = (text or "").strip()
    try:
        v = float(t) if t else math.nan
    except ValueError:
        v = None
    if v is not None and math.isnan(v) and optional:
        return math.nan
    if v is None or not math.isfinite(v) or v < 0:
        raise ValueError(f"{where}: column {column}: {text!r} is not a finite non-negative number")
    return v


def read_table(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a heatmap CSV (ours, or a reference with at least the KEY columns and ``tflops``).

    Every row is checked (``ValueError`` naming the file, line, column and value): ``direction`` one of
    ``DIRECTIONS``, positive integer ``dqk``/``heads``/``batch``/``length``, finite non-negative ``tflops``
    (``ms``, ``mfu`` where given; empty is a missing value), a ``source`` usable in a file name (``reference``
    when the column is absent), and no cell twice for one source. Header names are stripped; an empty table,
    or a header naming a column twice, is refused.
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"heatmap table {path} does not exist")
    if not path.is_file():
        raise ValueError(f"heatmap table {path} is not a file")
    try:
        return _read_rows(path)
    except (csv.Error, UnicodeDecodeError) as e:  # a binary file, UTF-16, a cell past the csv module's limit
        raise ValueError(f"heatmap table {path}: not a UTF-8 CSV table ({e})") from None


def _read_rows(path: Path) -> list[dict[str, Any]]:
    with path.open(newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f, restkey=_EXTRA)
        if not reader.fieldnames:
            raise ValueError(f"heatmap table {path} is empty (no header line)")
        # Names stripped as cells are ('direction, dqk, ...' is a common spelling); a name given twice is refused:
        # DictReader keeps the last column of a name, so 'tflops,tflops' read the second silently.
        header = reader.fieldnames = [h.strip() for h in reader.fieldnames]
        twice = sorted({h for h in header if h and header.count(h) > 1})
        if twice:
            raise ValueError(f"heatmap table {path}: column {', '.join(twice)} given twice in the header")
        need = (*KEY, "tflops")
        missing = [c for c in need if c not in header]
        if missing:
            raise ValueError(f"heatmap table {path}: needs columns {', '.join(need)}; missing {', '.join(missing)}")
        rows, seen = [], {}
        for r in reader:
            where = f"{path}:{reader.line_num}"
            if _EXTRA in r:
                raise ValueError(f"{where}: {len(header) + len(r[_EXTRA])} fields, the header has {len(header)}")
            if any(v is None for v in r.values()):
                n = sum(v is not None for v in r.values())
                raise ValueError(f"{where}: {n} fields, the header has {len(header)}")
            r["direction"] = r["direction"].strip()
            if r["direction"] not in DIRECTIONS:
                raise ValueError(f"{where}: column direction: {r['direction']!r} is not one of {', '.join(DIRECTIONS)}")
            for k in _INTS:
                t = r[k].strip()
                if not (t.isascii() and t.isdigit()) or int(t) <= 0:
                    raise ValueError(f"{where}: column {k}: {r[k]!r} is not a positive integer")
                r[k] = int(t)
            r["tflops"] = _number(r["tflops"], where, "tflops", optional=True)
            for k in ("ms", "mfu"):
                if r.get(k, "").strip():
                    v = _number(r[k], where, k, optional=True)
                    r[k] = "" if math.isnan(v) else v
            source = r.setdefault("source", "reference").strip()
            if not _SOURCE_OK.fullmatch(source):
                raise ValueError(f"{where}: column source: {r['source']!r} is not a name (letters, digits, _.+-)")
            r["source"] = source
            cell = (*_key(r), source)
            if cell in seen:
                raise ValueError(f"{where}: cell {', '.join(cell)} again (first at line {seen[cell]})")
            seen[cell] = reader.line_num
            rows.append(r)
    if not rows:
        raise ValueError(f"heatmap table {path} has a header but no rows")
    return rows


def reference_rows(rows: Sequence[dict[str, Any]], name: str | Path = "reference") -> list[dict[str, Any]]:
    """The rows of one source of a reference table: ``tuned`` where present, else its only source;
    ``ValueError`` naming the sources when there are several and none is ``tuned``."""
    sources = sorted({r.get("source", "reference") for r in rows})
    if len(sources) <= 1:
        return list(rows)
    if "tuned" not in sources:
        raise ValueError(f"reference table {name} holds sources {', '.join(sources)}: keep one (or a 'tuned' one)")
    return [r for r in rows if r.get("source") == "tuned"]


def write_csv(rows: Iterable[dict[str, Any]], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(COLUMNS), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({c: _cell(r.get(c, "")) for c in COLUMNS})
    return path


def _cell(value: Any) -> Any:
    """A CSV cell: a missing value ('' , None, a NaN or infinite number) is written empty, never 'nan' or 'inf'."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return ""
    return value


def _ratio(ours: float, theirs: float) -> float | None:
    """``ours / theirs`` where both are values and the quotient is finite (a reference of 0, or one so small
    that the quotient overflows, has none)."""
    if not (theirs > 0 and math.isfinite(ours)):
        return None
    q = ours / theirs
    return q if math.isfinite(q) else None


def ratio_rows(rows: Sequence[dict[str, Any]], reference: Sequence[dict[str, Any]], source: str) -> list[dict]:
    """``source`` TFLOP/s over the reference's, cell by cell (cells missing on either side, or without a finite
    ratio, say a reference value of zero or none, are left out: ``reference_coverage`` counts them)."""
    ref: dict[tuple, float] = {}
    for r in reference:
        if _key(r) in ref:
            raise ValueError(f"reference has cell {', '.join(_key(r))} twice (pass the rows of one source)")
        ref[_key(r)] = float(r["tflops"])
    out = []
    for r in rows:
        if r.get("source") != source or _key(r) not in ref:
            continue
        q = _ratio(float(r["tflops"]), ref[_key(r)])
        if q is not None:
            out.append({**{k: r[k] for k in KEY}, "source": f"{source}/reference", "tflops": q})
    return out


def reference_coverage(rows: Sequence[dict[str, Any]], reference: Sequence[dict[str, Any]]) -> dict[str, int]:
    """How the reference lines up with the rows' cells: matched (a value above 0 there, a value of some source
    here: a ratio), matched but without a value on one side, and rows' cells it lacks."""
    ref = {_key(r): float(r["tflops"]) for r in reference}
    ours = {_key(r) for r in rows}
    usable = {_key(r) for r in rows if _key(r) in ref and _ratio(float(r["tflops"]), ref[_key(r)]) is not None}
    return {"matched": len(usable), "unusable": len((ours & set(ref)) - usable), "missing": len(ours - set(ref))}


def check_plotting() -> None:
    """matplotlib draws the PNGs: a ``ValueError`` naming the extra that installs it, before anything is written."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("the heatmap PNGs need matplotlib: pip install 'hstu-autotune[dev]' (or matplotlib)") from None


def _grid(rows: Sequence[dict[str, Any]], value: str) -> tuple[list[int], list[int], list[list[float]]]:
    batches = sorted({int(r["batch"]) for r in rows})
    lengths = sorted({int(r["length"]) for r in rows})
    cells = {(int(r["batch"]), int(r["length"])): float(r[value]) for r in rows if r.get(value) not in ("", None)}
    return batches, lengths, [[cells.get((b, n), math.nan) for n in lengths] for b in batches]


def plot(
    rows: Sequence[dict[str, Any]],
    path: str | Path,
    title: str,
    value: str = "tflops",
    fmt: str = ".0f",
    label: str | None = None,
) -> Path:
    """One heatmap PNG: batch down, length across, each cell annotated with its value; ``label`` names the
    colour bar (default ``value``)."""
    import matplotlib

    from autotune.runtime.buckets import format_bucket

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches, lengths, grid = _grid(rows, value)
    fig, ax = plt.subplots(figsize=(1.1 * len(lengths) + 2, 0.6 * len(batches) + 1.5))
    image = ax.imshow(grid, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(lengths)), [format_bucket(n) for n in lengths])
    ax.set_yticks(range(len(batches)), [str(b) for b in batches])
    ax.set_xlabel("sequence length")
    ax.set_ylabel("batch")
    ax.set_title(title)
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            if math.isfinite(v):
                ax.text(j, i, format(v, fmt), ha="center", va="center", color="white", fontsize=8)
    fig.colorbar(image, ax=ax, label=label or value)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# The report's own files in its folder: a new report removes an older one's first (a report without a reference
# would otherwise sit beside the last one's ratio maps, and a smaller grid beside a larger one's PNGs).
REPORT_FILES = ("heatmap.csv", "ratio.csv", "*_tflops.png", "*_mfu.png", "*_ratio.png")


def write_report(
    rows: Sequence[dict[str, Any]],
    out_dir: str | Path,
    reference: Sequence[dict[str, Any]] | None = None,
    reference_name: str | Path = "reference",
) -> dict[str, list]:
    """CSV of every row, and per (direction, dqk, heads, source) a TFLOP/s heatmap (an MFU one where
    rows have it); with ``reference``, a ratio CSV and ratio heatmaps of every source against it.

    Returns {"csv": paths, "png": paths, "notes": what the reader should know (cells the reference lacks or
    has no usable value for)}; a reference that matches none of the rows' cells is a ``ValueError``."""
    out = Path(out_dir)
    check_plotting()
    notes: list[str] = []
    if reference:
        cover = reference_coverage(rows, reference)
        if not cover["matched"]:
            raise ValueError(
                f"--reference {reference_name}: none of its cells (direction, dqk, heads, batch, length) with a "
                f"value above 0 is among the {len({_key(r) for r in rows})} cells measured, with a value there"
            )
        if cover["unusable"] or cover["missing"]:
            notes.append(
                f"--reference {reference_name}: ratios for {cover['matched']} cells; {cover['missing']} cells have no "
                f"reference cell, {cover['unusable']} a reference value of 0 or none (or no value of their own)"
            )
    if out.is_dir():
        for pattern in REPORT_FILES:
            for old in out.glob(pattern):
                old.unlink()
    files: dict[str, list] = {"csv": [write_csv(rows, out / "heatmap.csv")], "png": [], "notes": notes}
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["direction"], int(r["dqk"]), int(r["heads"]), r.get("source", "")), []).append(r)
    for (direction, dqk, heads, source), group in sorted(groups.items()):
        stem = f"{direction}_d{dqk}_h{heads}_{source}"
        title = f"{direction} d{dqk} h{heads} {source}: TFLOP/s"
        files["png"].append(plot(group, out / f"{stem}_tflops.png", title))
        if any(r.get("mfu") not in ("", None) for r in group):
            files["png"].append(plot(group, out / f"{stem}_mfu.png", title.replace("TFLOP/s", "MFU"), "mfu", ".2f"))
    if reference:
        ratios = [x for s in sorted({r.get("source", "") for r in rows}) for x in ratio_rows(rows, reference, s)]
        files["csv"].append(write_csv(ratios, out / "ratio.csv"))
        by: dict[tuple, list[dict[str, Any]]] = {}
        for r in ratios:
            by.setdefault((r["direction"], int(r["dqk"]), int(r["heads"]), r["source"]), []).append(r)
        for (direction, dqk, heads, source), group in sorted(by.items()):
            name = f"{direction}_d{dqk}_h{heads}_{source.replace('/', '_vs_')}_ratio.png"
            title = f"{direction} d{dqk} h{heads} {source}"
            files["png"].append(plot(group, out / name, title, fmt=".2f", label="ratio"))
    return files


def measure_grid(
    dims: Sequence[int],
    heads: Sequence[int],
    batches: Sequence[int] = GRID_BATCHES,
    lengths: Sequence[int] = GRID_LENGTHS,
    directions: Sequence[str] = DIRECTIONS,
    sources: Sequence[str] = ("tuned", "default"),
    peak_tflops: float | None = None,
    max_tokens: int = MAX_TOKENS,
    cuda_graph: bool = False,
    device: str = "cuda",
) -> list[dict[str, Any]]:
    """Time every cell on the GPU through the public call (bf16, causal, uniform lengths).

    ``fwd`` times the forward, ``bwd`` the backward alone (gradients of a kept graph), ``both`` the
    two; FLOPs as docs/CONTRACTS.md counts them. Cells above ``max_tokens`` rows, out of memory, or refused by the call
    (a ``ValueError``: say a length past what a launch grid holds) are left out, with a warning naming the cell,
    so one cell never loses the grid's other timings. Timing: ``autotune.tuning.measure.bench`` (do_bench, L2
    flush, median), after ``measure.warm_gpu`` brings the clocks up. ``cuda_graph`` times CUDA-graph replays of
    the same calls, which leave the host's time out (the backward then runs its autograd node directly, without
    the engine).
    """
    import torch

    from autotune.tuning import measure
    from kernel_templates.hstu_attention import hstu_attention_flops

    rows: list[dict[str, Any]] = []
    measure.warm_gpu()
    for d in dims:
        for h in heads:
            for b in batches:
                for n in lengths:
                    if b * n > max_tokens:
                        continue
                    off = torch.arange(0, (b + 1) * n, n, device=device, dtype=torch.int32)
                    fwd_f, bwd_f = hstu_attention_flops(off.cpu(), h, d, d)
                    flops = {"fwd": fwd_f, "bwd": bwd_f, "both": fwd_f + bwd_f}
                    for source in sources:
                        try:
                            times = _time_cell(b * n, h, d, off, n, source, directions, measure, cuda_graph)
                        except torch.cuda.OutOfMemoryError:
                            torch.cuda.empty_cache()
                            continue
                        except ValueError as e:
                            cell = f"d{d} h{h} b{b} length {n} ({source})"
                            warnings.warn(f"heatmap: cell {cell} left out: {e}", stacklevel=2)
                            continue
                        for direction, ms in times.items():
                            tf = flops[direction] / (ms * 1e-3) / 1e12
                            mfu = tf / peak_tflops if peak_tflops else ""
                            rows.append(dict(direction=direction, dqk=d, heads=h, batch=b, length=n, source=source,
                                             ms=ms, tflops=tf, mfu=mfu))  # fmt: skip
                    torch.cuda.empty_cache()
    return rows


def _time_cell(rows: int, h: int, d: int, off, n: int, source: str, directions, measure, graph: bool) -> dict:
    import torch

    from autotune.runtime.ops import backward_call, hstu_attention

    q, k, v = (torch.randn(rows, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn(rows, h, d, device="cuda", dtype=torch.bfloat16)

    def fwd():
        return hstu_attention(q, k, v, off, n, source=source)

    out = fwd()
    times: dict[str, float] = {}
    if "fwd" in directions:
        with torch.no_grad():
            times["fwd"] = measure.bench(fwd, quick=False, cuda_graph=graph).median_ms
    if "bwd" in directions:
        bwd = backward_call(out, do) if graph else lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
        times["bwd"] = measure.bench(bwd, quick=False, cuda_graph=graph).median_ms
    if "both" in directions:

        def both():  # captured, the backward node runs directly: the autograd engine cannot be captured
            out = fwd()  # kept alive: the node holds its output only weakly
            return backward_call(out, do)() if graph else torch.autograd.grad(out, (q, k, v), do)

        times["both"] = measure.bench(both, quick=False, cuda_graph=graph).median_ms
    return times
