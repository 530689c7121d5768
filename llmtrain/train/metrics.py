"""Training metrics: metrics.jsonl, the console (rich when a terminal, compact lines when not), wandb,
the end-of-run summary table, and throughput (tokens/s, MFU).

Only rank 0 writes or prints; `MetricsLogger` on other ranks computes records but has no side effects.

metrics.jsonl holds one JSON object per line:
- a training record per logged step: `step` (optimizer steps completed), `loss`, `lr`, `grad_norm`,
  `tokens` (cumulative, counting resumed runs), `tokens_per_sec` (over the interval since the previous
  record), `elapsed_s` (training wall time, cumulative across resumes), `skipped` and `spikes`
  (cumulative counts from the stability guard), and `mfu` (a fraction) where the device's peak is known
  (a GPU in planning.hardware's `PEAK_BF16_FLOPS`, or `logging.peak_flops`); a data mixture adds
  `sources`: `{name: {"tokens": cumulative tokens drawn from it, "epoch": its pass under way, 1 first}}`;
- an evaluation record: `{"step", "val_loss", "val_ppl"}`; a mixture adds `sources`:
  `{name: {"val_loss": ...}}`, and `val_loss` is the sources' losses weighted by the mixture.
Non-finite numbers are written as null, so every line is strict JSON.

A resumed run truncates the file to the records at or before the checkpoint's step and appends, so the
file never holds a step twice.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import string
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TextIO

from rich.progress import BarColumn, Progress, TaskID, TextColumn
from rich.table import Table

from llmtrain import rundir, terminal
from llmtrain.config import TrainConfig, to_dict
from llmtrain.parallel.node import output_relayed
from llmtrain.planning.flops import flops_per_token
from llmtrain.planning.hardware import peak_flops_for_name

if TYPE_CHECKING:
    import torch

METRICS_FILE = rundir.METRICS_FILE
WANDB_ID_FILE = f"{rundir.WANDB_DIR}/llmtrain_run_id"
WandbMode = Literal["off", "offline", "online"]


# ---------------------------------------------------------------- FLOPs and MFU


def peak_flops(device: torch.device | str | None = None) -> float | None:
    """Peak dense BF16 FLOP/s of one accelerator; None on CPU (so MFU is omitted there) or unknown GPUs."""
    import torch

    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type != "cuda":
        return None
    if not torch.cuda.is_available():
        return None
    return peak_flops_for_name(torch.cuda.get_device_name(dev))


def mfu(tokens_per_sec: float, flops_per_token: float, peak_flops_total: float) -> float:
    """Model FLOPs utilisation as a fraction: achieved FLOP/s over peak.

    `tokens_per_sec` is the whole job's throughput and `peak_flops_total` the peak of all its devices
    (peak per device x world size).
    """
    if peak_flops_total <= 0:
        raise ValueError(f"peak_flops_total must be positive, got {peak_flops_total}")
    return tokens_per_sec * flops_per_token / peak_flops_total


# ---------------------------------------------------------------- metrics.jsonl


def _clean(value: Any) -> Any:
    """JSON-safe numbers: non-finite floats become null; everything else as is."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file; a torn last line (a crash mid-write) is ignored."""
    p = Path(path)
    if not p.exists():
        return []
    records = []
    for line in p.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


def truncate_metrics(path: str | Path, step: int) -> list[dict[str, Any]]:
    """Drop the records with `step` greater than `step` (and any torn line); returns the records kept.

    The file is rewritten through a temporary file and a rename, so a crash leaves the old or the new
    file, never half of one.
    """
    p = Path(path)
    if not p.exists():
        return []
    kept = [r for r in read_metrics(p) if r["step"] <= step]
    tmp = p.with_name(p.name + ".tmp")
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, p)
    return kept


# ---------------------------------------------------------------- the logger


def _fmt_duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def _fmt_loss(value: float | None) -> str:
    return "nan" if value is None else f"{value:.4f}"


class MetricsLogger:
    """Writes metrics.jsonl, prints progress, logs to wandb; rank 0 only.

    Use: `logger.start(step, tokens)` right before the loop (so setup time is not counted as
    throughput), `log_step(...)` every `log_every` steps, `log_eval(...)` after each evaluation,
    `warn(...)` for events, `close()` at the end (prints the summary table and returns it as a dict).
    `resume_step` truncates metrics.jsonl to the records at or before it and continues the file;
    `resume_step=0` (a fresh run) starts the file afresh. `clock` gives the time in seconds (tests feed
    their own).
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        total_steps: int,
        rank: int = 0,
        resume_step: int = 0,
        flops_per_token: float | None = None,
        peak_flops_total: float | None = None,
        wandb_mode: WandbMode = "off",
        wandb_project: str = "llmtrain",
        run_name: str | None = None,
        wandb_config: dict[str, Any] | None = None,
        interactive: bool | None = None,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.run_dir = Path(run_dir)
        self._clock = clock
        self.path = self.run_dir / METRICS_FILE
        self.total_steps = total_steps
        self.enabled = rank == 0
        self.flops_per_token = flops_per_token
        self.peak_flops_total = peak_flops_total
        self.stream = stream if stream is not None else sys.stdout
        if interactive is None:
            interactive = self.stream.isatty() and not output_relayed()
        self.interactive = interactive
        self.console = terminal.console(file=self.stream, force_terminal=self.interactive, highlight=False)
        self._file: TextIO | None = None
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._wandb_run: Any = None

        self.last_train: dict[str, Any] | None = None
        self.best_val_loss: float | None = None
        self._elapsed_before = 0.0  # training wall time of earlier sessions (resume)
        if self.enabled:
            self._open_file(resume_step)
            if wandb_mode != "off":
                self._init_wandb(wandb_mode, wandb_project, run_name, wandb_config or {}, resume_step)
        self.start(resume_step, self.last_train["tokens"] if self.last_train else 0)

    @classmethod
    def from_config(
        cls,
        cfg: TrainConfig,
        run_dir: str | Path,
        *,
        rank: int = 0,
        resume_step: int = 0,
        device: torch.device | str | None = None,
        world_size: int = 1,
        interactive: bool | None = None,
    ) -> MetricsLogger:
        """A logger for this run: FLOPs per token from the model shape, peak from the device x world size.

        `world_size` is the process group's (every process drives one device), not `cfg.world_size`: a
        launcher may start more processes than --gpus x --nodes says. `logging.peak_flops`, when set, is
        the peak of one device; otherwise the device's known BF16 peak (none on CPU: no MFU).
        """
        per_device = cfg.logging.peak_flops
        if per_device is None and device is not None:
            per_device = peak_flops(device)
        return cls(
            run_dir,
            total_steps=cfg.total_steps,
            rank=rank,
            resume_step=resume_step,
            flops_per_token=flops_per_token(cfg.model, cfg.train.seq_len),
            peak_flops_total=per_device * world_size if per_device else None,
            wandb_mode=cfg.logging.wandb,
            wandb_project=cfg.logging.wandb_project,
            run_name=cfg.logging.run_name or Path(run_dir).name,
            # The resolved config only: never the environment, so WANDB_API_KEY cannot reach wandb's config.
            wandb_config=to_dict(cfg),
            interactive=interactive,
        )

    # ---- set-up
    def _open_file(self, resume_step: int) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.truncate_after(resume_step)

    def truncate_after(self, step: int) -> list[dict[str, Any]]:
        """Keep only the records at or before `step` and continue from them (a resume from `step`).

        Restores what the kept records say: the last training record (cumulative tokens and elapsed
        time continue from it) and the best validation loss. Returns the kept records.
        """
        if not self.enabled:
            return []
        if self._file is not None:
            self._file.close()
        kept = truncate_metrics(self.path, step)
        self.last_train, self.best_val_loss, self._elapsed_before = None, None, 0.0
        for record in kept:
            if "val_loss" in record and record["val_loss"] is not None:
                self._note_val_loss(record["val_loss"])
            elif "loss" in record:
                self.last_train = record
        if self.last_train is not None:
            self._elapsed_before = float(self.last_train.get("elapsed_s") or 0.0)
        # Line-buffered append; each write is flushed too, so a crash loses at most the current line.
        self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 (held open until close())
        return kept

    def _init_wandb(
        self, mode: WandbMode, project: str, name: str | None, config: dict[str, Any], resume_step: int
    ) -> None:
        import wandb

        id_file = self.run_dir / WANDB_ID_FILE
        id_file.parent.mkdir(parents=True, exist_ok=True)
        # One wandb run per run directory: a resume continues it under the same id. (Online, wandb
        # ignores steps at or below ones it has already seen, e.g. steps replayed after a crash.)
        run_id = id_file.read_text().strip() if resume_step > 0 and id_file.exists() else None
        if run_id is None:
            run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
            id_file.write_text(run_id + "\n")
        self._wandb_run = wandb.init(
            project=project,
            name=name,
            id=run_id,
            resume="allow",
            dir=str(self.run_dir),  # wandb writes under run_dir/wandb
            mode="offline" if mode == "offline" else "online",
            config=config,
            # console="off": wandb must not wrap stdout (it would break the progress display and isatty).
            settings=wandb.Settings(console="off"),
        )

    def start(self, step: int, tokens: int) -> None:
        """Start the throughput clock at (step, tokens): call right before the first training step."""
        now = self._clock()
        self._start_time = now
        self._start_step = step
        self._start_tokens = tokens
        self._last_time = now
        self._last_tokens = tokens
        self._last_step = step
        self._seconds_per_step: float | None = None
        if self.enabled and self.interactive and self._progress is None and step < self.total_steps:
            self._progress = Progress(
                TextColumn("[bold]step {task.completed}/{task.total}"),
                BarColumn(),
                TextColumn("{task.fields[stats]}"),
                console=self.console,
            )
            self._task = self._progress.add_task("train", total=self.total_steps, completed=step, stats="")
            self._progress.start()
        elif self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=step)

    # ---- records
    def log_step(
        self,
        step: int,
        *,
        loss: float,
        lr: float,
        grad_norm: float | None,
        tokens: int,
        skipped: int = 0,
        spikes: int = 0,
        sources: dict[str, dict[str, int]] | None = None,
        comm_bytes: dict[str, int] | None = None,
        **extra: float,
    ) -> dict[str, Any]:
        """Record a training step (after `step` updates, `tokens` trained in total); returns the record.
        `comm_bytes`: this rank's collective bytes in the step, inside one node and across nodes."""
        now = self._clock()
        interval = now - self._last_time
        tokens_per_sec = (tokens - self._last_tokens) / interval if interval > 0 else 0.0
        if step > self._last_step > self._start_step:
            # Only an interval after the session's first step sets the pace: the first one holds
            # torch.compile's warm-up (a minute or more on a CPU), which would stretch the estimate for
            # the whole run ("eta 1:43:07" at step 1 of a 2-minute run).
            self._seconds_per_step = interval / (step - self._last_step)
        self._last_time, self._last_tokens, self._last_step = now, tokens, step
        record: dict[str, Any] = {
            "step": step,
            "loss": _clean(float(loss)),
            "lr": lr,
            "grad_norm": None if grad_norm is None else _clean(float(grad_norm)),
            "tokens": tokens,
            "tokens_per_sec": tokens_per_sec,
            "elapsed_s": self._elapsed_before + (now - self._start_time),
            "skipped": skipped,
            "spikes": spikes,
        }
        run_mfu = self._mfu(tokens_per_sec)
        if run_mfu is not None:
            record["mfu"] = run_mfu
        record.update({k: _clean(v) for k, v in extra.items()})
        if sources is not None:
            record["sources"] = sources
        if comm_bytes is not None:
            record["comm_bytes"] = comm_bytes
        self.last_train = record
        if self.enabled:
            self._write(record)
            self._show_step(record)
        return record

    def log_eval(self, step: int, val_loss: float, sources: dict[str, float] | None = None) -> dict[str, Any]:
        """Record an evaluation: validation loss and perplexity (exp of the loss), and per source of a
        mixture its own validation loss."""
        val_ppl = math.exp(val_loss) if val_loss < 700 else math.inf
        record: dict[str, Any] = {
            "step": step,
            "val_loss": _clean(float(val_loss)),
            "val_ppl": _clean(val_ppl),
        }
        line = f"eval step {step} val_loss {_fmt_loss(record['val_loss'])} val_ppl {val_ppl:.2f}"
        if sources:
            record["sources"] = {name: {"val_loss": _clean(float(loss))} for name, loss in sources.items()}
            each = ", ".join(f"{name} {_fmt_loss(v['val_loss'])}" for name, v in record["sources"].items())
            line += f" ({each})"
        self._note_val_loss(val_loss)
        if self.enabled:
            self._write(record)
            self._print(line)
        return record

    def warn(self, message: str) -> None:
        """A one-line warning (e.g. a skipped step) on rank 0's console, above the progress bar."""
        if self.enabled:
            self._print(f"warning: {message}", style="yellow")

    def _note_val_loss(self, val_loss: float) -> None:
        if math.isfinite(val_loss) and (self.best_val_loss is None or val_loss < self.best_val_loss):
            self.best_val_loss = val_loss

    def _mfu(self, tokens_per_sec: float) -> float | None:
        if not self.flops_per_token or not self.peak_flops_total:
            return None
        return mfu(tokens_per_sec, self.flops_per_token, self.peak_flops_total)

    def _write(self, record: dict[str, Any]) -> None:
        assert self._file is not None
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._wandb_run is not None:
            values = {k: v for k, v in record.items() if k != "step" and v is not None}
            self._wandb_run.log(values, step=record["step"])

    # ---- console
    def _eta(self, step: int) -> float | None:
        """At the pace of the steps since the previous record, from the second record of a session on
        (log_step: the first interval holds the warm-up); None until then."""
        if self._seconds_per_step is None:
            return None
        return self._seconds_per_step * max(self.total_steps - step, 0)

    def format_step(self, record: dict[str, Any]) -> str:
        """The compact machine-readable line of a training record."""
        parts = [
            f"step {record['step']}/{self.total_steps}",
            f"loss {_fmt_loss(record['loss'])}",
            f"lr {record['lr']:.1e}",
            f"gnorm {'nan' if record['grad_norm'] is None else format(record['grad_norm'], '.3f')}",
            f"tok/s {record['tokens_per_sec']:.0f}",
        ]
        if "mfu" in record:
            parts.append(f"mfu {100 * record['mfu']:.1f}%")
        if record["skipped"]:
            parts.append(f"skipped {record['skipped']}")
        eta = self._eta(record["step"])
        if eta is not None:
            parts.append(f"eta {_fmt_duration(eta)}")
        return " ".join(parts)

    def _show_step(self, record: dict[str, Any]) -> None:
        line = self.format_step(record)
        if self._progress is not None and self._task is not None:
            stats = line.split(" ", 2)[2]  # everything after "step N/T"
            self._progress.update(self._task, completed=record["step"], stats=stats)
        else:
            self._print(line)

    def _print(self, line: str, style: str | None = None) -> None:
        if self.interactive:
            self.console.print(line, style=style, markup=False)
        else:
            print(line, file=self.stream, flush=True)

    # ---- the end
    def summary(self) -> dict[str, Any]:
        """The run's headline numbers (this session's average throughput)."""
        last = self.last_train or {}
        now = self._clock()
        session = now - self._start_time
        tokens = last.get("tokens", self._start_tokens)
        tokens_per_sec = (tokens - self._start_tokens) / session if session > 0 else 0.0
        out: dict[str, Any] = {
            "steps": last.get("step", self._start_step),
            "tokens": tokens,
            "final_loss": last.get("loss"),
            "best_val_loss": self.best_val_loss,
            "tokens_per_sec": tokens_per_sec,
            "mfu": self._mfu(tokens_per_sec),
            "skipped_steps": last.get("skipped", 0),
            "wall_time_s": self._elapsed_before + session,
        }
        if "sources" in last:
            out["sources"] = last["sources"]
        return out

    def close(self, exit_code: int = 0) -> dict[str, Any]:
        """Stop the display, print the summary table (rank 0), finish wandb; returns the summary."""
        result = self.summary()
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self.enabled:
            self.console.print(_summary_table(result))
            if self._wandb_run is not None:
                for key, value in result.items():
                    if value is not None:
                        self._wandb_run.summary[key] = value
                self._wandb_run.finish(exit_code=exit_code)
                self._wandb_run = None
            if self._file is not None:
                self._file.close()
                self._file = None
        return result

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close(exit_code=0 if exc_type is None else 1)


def _summary_table(summary: dict[str, Any]) -> Table:
    table = Table(title="training summary", show_header=False)
    table.add_column("metric")
    table.add_column("value", justify="right")

    def number(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    table.add_row("steps", str(summary["steps"]))
    table.add_row("tokens", f"{summary['tokens']:,}")
    table.add_row("final loss", number(summary["final_loss"], ".4f"))
    table.add_row("best val loss", number(summary["best_val_loss"], ".4f"))
    table.add_row("tokens/s", number(summary["tokens_per_sec"], ",.0f"))
    table.add_row("MFU", "-" if summary["mfu"] is None else f"{100 * summary['mfu']:.1f}%")
    table.add_row("skipped steps", str(summary["skipped_steps"]))
    table.add_row("wall time", _fmt_duration(summary["wall_time_s"]))
    total = sum(s["tokens"] for s in summary.get("sources", {}).values()) or 1
    for name, seen in summary.get("sources", {}).items():
        share = f"{seen['tokens']:,} ({100 * seen['tokens'] / total:.1f}%), epoch {seen['epoch']}"
        table.add_row(f"tokens {name}", share)
    return table
