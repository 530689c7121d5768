"""Loss curves of runs, read from their metrics.jsonl (nothing else: no model, no process group).

`plot_runs` writes one PNG for `llmtrain plot`: training loss with validation loss (dashed, markers),
learning rate, gradient norm and tokens/s, one colour per run, against the step or cumulative tokens.
`refresh` redraws a run's own RUN_DIR/curves.png (what `train` calls at each evaluation and at the
end). `text_report` is the terminal view of `plot --text`: a sparkline of the loss and the numbers.

matplotlib is imported only to draw, and only its object-oriented API with the Agg canvas: no
pyplot, no display, no global figure state in a training process.
"""

from __future__ import annotations

import io
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmtrain import rundir
from llmtrain.errors import ConfigError
from llmtrain.fsutil import check_output_file, write_atomic
from llmtrain.train.metrics import read_metrics

if TYPE_CHECKING:
    from matplotlib.figure import Figure

CURVES_FILE = rundir.CURVES_FILE
X_AXES = ("step", "tokens")
FIGSIZE_IN, DPI = (12.0, 7.5), 100
PIXELS = (1200, 750)  # width, height of the PNG: FIGSIZE_IN x DPI
SPARK = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 60  # characters of the loss sparkline (buckets of records, averaged)


@dataclass
class RunCurves:
    """One run's records, split: training records (with `loss`) and evaluations with a finite val_loss."""

    label: str  # the legend's name: the directory name, with parents where two runs share it
    path: Path
    train: list[dict[str, Any]]
    val: list[dict[str, Any]]


# ---------------------------------------------------------------- reading runs


def load_runs(run_dirs: list[Path]) -> list[RunCurves]:
    """Each run's curves; bad input (not a run, no metrics yet, given twice) refused in one line."""
    resolved = [p.resolve() for p in run_dirs]
    for i, path in enumerate(resolved):
        if path in resolved[:i]:
            raise ConfigError(f"{run_dirs[i]}: given twice; name each RUN_DIR once")
    return [_load_run(path, label) for path, label in zip(run_dirs, run_labels(resolved), strict=True)]


def _load_run(run_dir: Path, label: str) -> RunCurves:
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: no such run directory; list runs with `llmtrain runs`")
    if not (run_dir / rundir.CONFIG_FILE).is_file():
        raise ConfigError(
            f"{run_dir}: not a run directory (no {rundir.CONFIG_FILE}); pass the RUN_DIR of a run"
        )
    records = read_metrics(run_dir / rundir.METRICS_FILE)
    train = [r for r in records if "loss" in r]
    if not train:
        raise ConfigError(
            f"{run_dir}: no metrics yet ({rundir.METRICS_FILE} holds no training step); plot it once it has logged one"
        )
    val = [r for r in records if _finite(r.get("val_loss"))]
    return RunCurves(label, run_dir, train, val)


def run_labels(paths: list[Path]) -> list[str]:
    """Each run's directory name; where two share it, as many parent directories as tell them apart."""
    parts = [p.parts for p in paths]
    labels = []
    for i, own in enumerate(parts):
        depth = 1
        while depth < len(own) and any(o[-depth:] == own[-depth:] for j, o in enumerate(parts) if j != i):
            depth += 1
        labels.append(str(Path(*own[-depth:])))
    return labels


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _number(value: Any) -> float:
    """A metric as a float for plotting: null (a non-finite value) becomes NaN, a gap in the line."""
    return float(value) if isinstance(value, (int, float)) else math.nan


# ---------------------------------------------------------------- the PNG


def check_x(x: str) -> None:
    if x not in X_AXES:
        raise ConfigError(f"--x {x}: unknown x axis; use --x step or --x tokens")


def plot_runs(run_dirs: list[Path], out: Path | None, x: str, force: bool) -> Path:
    """Draw the runs into one PNG and write it atomically; returns its path.

    Default `out`: RUN_DIR/curves.png for one run, curves.png here for several. A run's own curves.png
    (the file `train` keeps up to date) is replaced as `train` would; any other existing file needs
    `force`, as for every verb's --out. Everything is checked before anything is written.
    """
    check_x(x)
    if out is not None and out.suffix.lower() != ".png":
        raise ConfigError(f"--out {out}: writes PNG only; give a path ending in .png")
    runs = load_runs(run_dirs)
    if out is None:
        out = run_dirs[0] / CURVES_FILE if len(run_dirs) == 1 else Path(CURVES_FILE)
    if not out.parent.is_dir():
        raise ConfigError(
            f"--out {out}: no directory {out.parent}; create it or pass a path in an existing one"
        )
    if out.resolve() not in {(p / CURVES_FILE).resolve() for p in run_dirs}:
        check_output_file(out, "--out", force)
    png = render_png(runs, x)
    try:
        write_atomic(out, png)
    except OSError as exc:
        raise ConfigError(f"--out {out}: cannot write it ({exc.strerror}); pass a writable path") from None
    return out


def refresh(run_dir: Path) -> Path:
    """Redraw RUN_DIR/curves.png from the run's metrics.jsonl, against the step."""
    out = run_dir / CURVES_FILE
    write_atomic(out, render_png([_load_run(run_dir, run_dir.name)], "step"))
    return out


def render_png(runs: list[RunCurves], x: str) -> bytes:
    buffer = io.BytesIO()
    figure(runs, x).savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()


def figure(runs: list[RunCurves], x: str) -> Figure:
    """The four panels (loss, learning rate, gradient norm, tokens/s), one colour per run."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import EngFormatter

    # Fixed margins, wide enough for the tick labels these panels get (lr as 0.00175, tokens/s as 2500):
    # the constrained layout measured every label again on each redraw, 0.4 s of a 1.1 s draw.
    fig = Figure(figsize=FIGSIZE_IN, dpi=DPI)
    fig.subplots_adjust(left=0.07, right=0.985, bottom=0.08, top=0.955, wspace=0.17, hspace=0.2)
    FigureCanvasAgg(fig)
    loss, lr, gnorm, speed = fig.subplots(2, 2, sharex=True).flat
    for i, run in enumerate(runs):
        colour = f"C{i % 10}"
        xs = _x_values(run, x)
        loss.plot(xs, [_number(r["loss"]) for r in run.train], color=colour, linewidth=1.5)
        if run.val:
            val_xs = _val_x_values(run, x)
            loss.plot(
                val_xs, [r["val_loss"] for r in run.val], color=colour, linestyle="--", marker="o", ms=4
            )
        lr.plot(xs, [_number(r["lr"]) for r in run.train], color=colour, linewidth=1.5)
        gnorm.plot(xs, [_number(r.get("grad_norm")) for r in run.train], color=colour, linewidth=1.5)
        speed.plot(xs, [_number(r.get("tokens_per_sec")) for r in run.train], color=colour, linewidth=1.5)
    for ax, title in ((loss, "loss"), (lr, "learning rate"), (gnorm, "gradient norm"), (speed, "tokens/s")):
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    for ax in (gnorm, speed):
        ax.set_xlabel(x)
        if x == "tokens":
            ax.xaxis.set_major_formatter(EngFormatter())
    norms = [r["grad_norm"] for run in runs for r in run.train if _finite(r.get("grad_norm"))]
    if norms and min(norms) > 0 and max(norms) > 10 * min(norms):
        gnorm.set_yscale("log")  # early norms are often 10-100x the later ones
    handles = [
        Line2D([], [], color=f"C{i % 10}", linewidth=1.5, label=run.label) for i, run in enumerate(runs)
    ]
    if any(run.val for run in runs):
        handles += [
            Line2D([], [], color="0.3", linewidth=1.5, label="training"),
            Line2D([], [], color="0.3", linestyle="--", marker="o", ms=4, label="validation"),
        ]
    loss.legend(handles=handles, loc="upper right")
    return fig


def _x_values(run: RunCurves, x: str) -> list[float]:
    return [float(r["step"] if x == "step" else r["tokens"]) for r in run.train]


def _val_x_values(run: RunCurves, x: str) -> list[float]:
    """Where the evaluations sit: their step, or the tokens trained by then (evaluation records carry
    no token count; a run trains the same tokens every step, so they lie on the training records' line)."""
    import numpy as np

    steps = [float(r["step"]) for r in run.val]
    if x == "step":
        return steps
    known = [float(r["step"]) for r in run.train]
    return [float(t) for t in np.interp(steps, [0.0, *known], [0.0, *_x_values(run, "tokens")])]


# ---------------------------------------------------------------- the terminal view


def text_report(run_dirs: list[Path]) -> str:
    """`plot --text`: each run's loss as a sparkline, with its first, last and best numbers."""
    return "\n".join(text_view(run) for run in load_runs(run_dirs))


def text_view(run: RunCurves) -> str:
    """One run in four lines: steps and tokens; loss sparkline, first/last/min; best val; last lr and
    the median tokens/s (robust to the slow first interval and to evaluations)."""
    last = run.train[-1]
    losses = [r["loss"] for r in run.train if _finite(r["loss"])]
    lines = [f"{run.label}  {last['step']:,} steps, {last['tokens']:,} tokens"]
    if losses:
        low = min((r for r in run.train if _finite(r["loss"])), key=lambda r: r["loss"])
        lines.append(
            f"  loss {sparkline(losses)}  first {losses[0]:.4f}  last {losses[-1]:.4f}  "
            f"min {low['loss']:.4f} (step {low['step']})"
        )
    else:
        lines.append("  loss: no finite value logged")
    if run.val:
        best = min(run.val, key=lambda r: r["val_loss"])
        lines.append(
            f"  val  best {best['val_loss']:.4f} at step {best['step']} ({len(run.val)} evaluation{'s' * (len(run.val) != 1)})"
        )
    speeds = [r["tokens_per_sec"] for r in run.train if _finite(r.get("tokens_per_sec"))]
    median = f"{statistics.median(speeds):,.0f}" if speeds else "-"
    lines.append(f"  lr   last {last['lr']:.1e}  tokens/s median {median}")
    return "\n".join(lines)


def sparkline(values: list[float], width: int = SPARK_WIDTH) -> str:
    """`values` as at most `width` block characters (means of equal buckets), lowest ▁ to highest █."""
    buckets = min(width, len(values))
    means = [
        statistics.fmean(values[i * len(values) // buckets : (i + 1) * len(values) // buckets])
        for i in range(buckets)
    ]
    low, high = min(means), max(means)
    span = high - low or 1.0
    return "".join(SPARK[round((m - low) / span * (len(SPARK) - 1))] for m in means)
