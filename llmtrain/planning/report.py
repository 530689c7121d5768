"""`llmtrain plan`'s output: the --json document and its table, and each row as the `llmtrain train`
command line that runs it."""

from __future__ import annotations

import shlex
from typing import Any

from llmtrain import config
from llmtrain.flags import flag_for
from llmtrain.planning.hardware import Cluster
from llmtrain.planning.plan import LAYOUT_KEYS, PlanRow
from llmtrain.units import human

# What the command line of a row states beside the layout: the request the rows share.
REQUEST_KEYS = ("train.global_batch", "train.seq_len", "train.precision", "launch.gpus", "launch.nodes")


def train_command(row: PlanRow, cfg_args: dict[str, Any]) -> str:
    """`llmtrain train ...` for this row: the user's own model and data arguments, then the row's
    layout and the request (global batch, sequence length, precision, GPUs and nodes)."""
    chosen = set(LAYOUT_KEYS) | set(REQUEST_KEYS)
    words = ["llmtrain", "train"]
    if cfg_args["config_file"] is not None:
        words += ["--config", str(cfg_args["config_file"])]
    for item in cfg_args["sets"]:
        if item.split("=", 1)[0].strip() not in chosen:
            words += ["--set", item]
    for key, value in cfg_args["flags"].items():
        if value is not None and key not in chosen:
            words += _flag(key, value)
    values = {key: config.get(row.setup.cfg, key) for key in (*LAYOUT_KEYS, *REQUEST_KEYS)}
    for key, value in values.items():
        if not (key.startswith("parallel.") and value == 1) and value not in (False, None):
            words += _flag(key, value)
    return shlex.join(words)


def _flag(key: str, value: Any) -> list[str]:
    flag = flag_for(key)
    if isinstance(value, bool):
        return [flag if value else f"--no-{flag[2:]}"]
    if isinstance(value, list):
        return [word for item in value for word in (flag, str(item))]
    if flag.startswith("--set "):
        return ["--set", f"{key}={value}"]
    return [flag, str(value)]


def document(rows: list[PlanRow], cluster: Cluster, top: int, cfg_args: dict[str, Any]) -> dict[str, Any]:
    """The --json document: the cluster, how many layouts fit, and the top rows term by term."""
    device = cluster.device
    return {
        "cluster": {
            "device": device.name,
            "devices_per_node": cluster.devices_per_node,
            "nodes": cluster.nodes,
            "memory_bytes": device.memory_bytes,
            "sources": {**device.sources, **cluster.sources},
        },
        "layouts_that_fit": len(rows),
        "rows": [_row(row, device.memory_bytes, cfg_args) for row in rows[:top]],
    }


def _row(row: PlanRow, memory: int, cfg_args: dict[str, Any]) -> dict[str, Any]:
    c, time = row.setup.cfg, row.time
    dominant = time.dominant
    return {
        "layout": row.setup.layout.describe(),
        "engine": c.train.engine,
        "zero_stage": c.zero.stage,
        "shard_within_node": c.zero.shard_within_node,
        "fsdp_mesh": row.setup.fsdp_mesh if c.train.engine == "fsdp2" else None,
        "offload": c.zero.offload,
        "tp": c.parallel.tp,
        "sp": c.parallel.sp,
        "pp": c.parallel.pp,
        "micro_batch": c.train.micro_batch,
        "accumulation_steps": row.setup.accumulation_steps,
        "activation_checkpointing": c.train.activation_checkpointing,
        "gpu_peak_bytes": row.estimate.gpu_peak,
        "gpu_headroom_bytes": memory - row.estimate.gpu_peak,
        "step_seconds": time.seconds,
        "tokens_per_second": time.tokens_per_second,
        "tokens_per_second_per_device": time.tokens_per_second_per_device,
        "mfu": time.mfu,
        "why": f"{dominant.name} {dominant.seconds / time.seconds:.0%}",
        "terms": [{"term": t.name, "seconds": t.seconds, "note": t.note} for t in time.terms],
        "command": train_command(row, cfg_args),
    }


def render(doc: dict[str, Any], title: str) -> None:
    """The top rows as a table, then the first row's command line."""
    from rich.table import Table

    from llmtrain.terminal import console as make_console

    console = make_console()
    table = Table(title=title)
    columns = ("#", "layout", "engine", "offload", "micro x accum", "checkpointing", "per GPU (headroom)",
               "step", "tokens/s/GPU", "MFU", "why")  # fmt: skip
    for column in columns:
        table.add_column(
            column, justify="right" if column in ("#", "step", "tokens/s/GPU", "MFU") else "left"
        )
    for i, r in enumerate(doc["rows"], 1):
        engine = (
            f"ZeRO {r['zero_stage']}" + (" hpZ" if r["shard_within_node"] else "")
            if r["engine"] == "deepspeed"
            else f"FSDP2 --zero {r['zero_stage']}" + (" HSDP" if r["fsdp_mesh"]["replicate"] > 1 else "")
        )
        table.add_row(
            str(i),
            r["layout"],
            engine,
            r["offload"],
            f"{r['micro_batch']} x {r['accumulation_steps']}",
            r["activation_checkpointing"],
            f"{human(r['gpu_peak_bytes'])} ({human(r['gpu_headroom_bytes'])})",
            f"{r['step_seconds']:.3g} s",
            f"{r['tokens_per_second_per_device']:,.0f}",
            f"{r['mfu']:.0%}",
            r["why"],
        )
    console.print(table)
    console.print(f"{doc['layouts_that_fit']} layouts fit; run the first with:")
    console.print(f"  {doc['rows'][0]['command']}", soft_wrap=True, highlight=False, markup=False)


def add_measured(doc: dict[str, Any], measured: list[float], peaks: list[int | None]) -> None:
    """The confirmed rows' measured step seconds (and, where a GPU measured it, peak memory), and how
    the predictions ranked and erred over them."""
    for row, seconds, peak in zip(doc["rows"], measured, peaks, strict=False):
        row["measured_step_seconds"] = seconds
        row["measured_over_predicted"] = seconds / row["step_seconds"]
        if peak is not None:
            row["measured_peak_bytes"] = peak
    predicted = [row["step_seconds"] for row in doc["rows"][: len(measured)]]
    errors = sorted(abs(m / p - 1) for m, p in zip(measured, predicted, strict=True))
    doc["confirmed"] = {
        "layouts": len(measured),
        "spearman": spearman(predicted, measured) if len(measured) >= 3 else None,
        "median_relative_error": errors[len(errors) // 2] if errors else None,
    }


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (ties take their mean rank)."""

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    ra, rb = ranks(a), ranks(b)
    mean_a, mean_b = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - mean_a) * (y - mean_b) for x, y in zip(ra, rb, strict=True))
    spread = (sum((x - mean_a) ** 2 for x in ra) * sum((y - mean_b) ** 2 for y in rb)) ** 0.5
    return cov / spread if spread else 0.0


def render_confirmed(doc: dict[str, Any]) -> None:
    """Predicted beside measured step time for the confirmed rows, and the summary line."""
    from rich.table import Table

    from llmtrain.terminal import console as make_console

    console = make_console()
    table = Table(title="Predicted against measured on this machine")
    rows = [r for r in doc["rows"] if "measured_step_seconds" in r]
    peaks = any("measured_peak_bytes" in r for r in rows)
    columns = [
        "#",
        "layout",
        "engine",
        "micro x accum",
        "predicted step",
        "measured step",
        "measured / predicted",
    ]
    columns += ["predicted peak", "measured peak"] if peaks else []
    for column in columns:
        table.add_column(column, justify="left" if column in ("layout", "engine") else "right")
    for i, r in enumerate(rows, 1):
        cells = [str(i), r["layout"], _engine(r), f"{r['micro_batch']} x {r['accumulation_steps']}",
                 f"{r['step_seconds']:.3g} s", f"{r['measured_step_seconds']:.3g} s",
                 f"{r['measured_over_predicted']:.2f}"]  # fmt: skip
        if peaks:
            measured_peak = r.get("measured_peak_bytes")
            cells += [human(r["gpu_peak_bytes"]), human(measured_peak) if measured_peak is not None else "-"]
        table.add_row(*cells)
    console.print(table)
    c = doc["confirmed"]
    ranked = f"rank correlation {c['spearman']:.2f}, " if c["spearman"] is not None else ""
    console.print(f"{c['layouts']} layouts run: {ranked}median error {c['median_relative_error']:.0%}")


def _engine(row: dict[str, Any]) -> str:
    return (
        f"ZeRO {row['zero_stage']}" if row["engine"] == "deepspeed" else f"FSDP2 --zero {row['zero_stage']}"
    )
