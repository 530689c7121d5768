"""The estimate for people and programs: report()'s --json document (breakdown, verdict, what fits)
and render()'s rich tables of the same numbers."""

from __future__ import annotations

from typing import Any

from llmtrain.planning.memory.fit import fitting
from llmtrain.planning.memory.formulas import Estimate
from llmtrain.units import human

_BREAKDOWNS = (
    ("per_gpu", "Per GPU", "per_gpu_peak_bytes"),
    ("per_node_cpu", "Per node: CPU memory", "per_node_cpu_bytes"),
    ("per_node_nvme", "Per node: NVMe", "per_node_nvme_bytes"),
)


def report(est: Estimate, gpu_memory: int | None, cpu_memory: int | None) -> dict[str, Any]:
    """The --json document: the breakdown, and with --gpu-memory a verdict and the fitting configurations."""
    out = est.to_dict()
    if gpu_memory is None:
        return out
    gpu_ok = est.gpu_peak <= gpu_memory
    cpu_ok = cpu_memory is None or est.cpu_per_node <= cpu_memory
    out["verdict"] = {
        "fits": gpu_ok and cpu_ok,
        "gpu_memory_bytes": gpu_memory,
        "gpu_headroom_bytes": gpu_memory - est.gpu_peak,
        "cpu_memory_bytes": cpu_memory,
        "cpu_headroom_bytes": None if cpu_memory is None else cpu_memory - est.cpu_per_node,
    }
    out["fitting_configurations"] = [vars(c) for c in fitting(est.setup, gpu_memory, cpu_memory)]
    return out


def render(doc: dict[str, Any]) -> None:
    """Print a report() document as rich tables (the numbers are the JSON's, formatted)."""
    from llmtrain.terminal import console as make_console

    console = make_console()
    s = doc["setup"]
    title = (
        f"{s['preset'] or format(s['params'], ',') + ' params'}: {_engine_stage(s)}, offload {s['offload']}, "
        f"{s['precision']}, {s['gpus_per_node']} GPU(s) x {s['nodes']} node(s), {s['layout']}"
    )
    for key, heading, total_key in _BREAKDOWNS:
        if doc[key]:
            console.print(
                _breakdown_table(doc, key, f"{heading} — {title}" if key == "per_gpu" else heading, total_key)
            )
    if doc["pipeline"] is not None:
        _render_pipeline(console, doc["pipeline"])
    verdict = doc.get("verdict")
    if verdict is None:
        return
    word = "fits" if verdict["fits"] else "does NOT fit"
    line = f"Verdict: {word} in {human(verdict['gpu_memory_bytes'])} per GPU (headroom {human(verdict['gpu_headroom_bytes'])})"
    if verdict["cpu_memory_bytes"] is not None:
        line += f", CPU headroom per node {human(verdict['cpu_headroom_bytes'])}"
    console.print(line, style="green" if verdict["fits"] else "red")
    console.print(_fitting_table(doc["fitting_configurations"]))


def _engine_stage(setup: dict[str, Any]) -> str:
    """`ZeRO 2` on DeepSpeed; on FSDP2, what --zero 2 or 3 means there."""
    if setup["engine"] == "deepspeed":
        return f"ZeRO {setup['zero_stage']}"
    kept = "reshard after forward" if setup["zero_stage"] == 3 else "parameters gathered until backward"
    mesh = setup["fsdp_mesh"]
    hsdp = f", HSDP {mesh['replicate']} replicas x {mesh['shard']} shards" if mesh["replicate"] > 1 else ""
    return f"FSDP2 --zero {setup['zero_stage']} ({kept}){hsdp}"


def _render_pipeline(console: Any, pipe: dict[str, Any]) -> None:
    """The bubble, which stages the per-GPU terms come from, and every stage's numbers."""
    pp, m = pipe["stages"], pipe["micro_batches"]
    console.print(
        f"Pipeline: {pp} stages, {pipe['schedule']}, partitioned by {pipe['partition']}, {m} micro-batches "
        f"per step; bubble (pp - 1) / (m + pp - 1) = {pp - 1}/{m + pp - 1} = {pipe['bubble_fraction']:.1%} "
        "of each step idle"
    )
    console.print(
        f"Per GPU above: model states of stage {pipe['heaviest_stage']} (the heaviest) + activations of "
        f"stage {pipe['activation_peak_stage']} (the peak), a bound on every stage's peak"
    )
    console.print(_stage_table(pipe["per_stage"]))


def _stage_table(stages: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    table = Table(title="Pipeline stages")
    for column in ("stage", "layers", "params", "model states", "in flight", "activations"):
        table.add_column(column, justify="left" if column == "layers" else "right")
    for st in stages:
        table.add_row(
            str(st["stage"]),
            st["layers"],
            f"{st['params']:,}",
            human(st["model_states_bytes"]),
            str(st["in_flight_micro_batches"]),
            human(st["activations_bytes"]),
        )
    return table


def _breakdown_table(doc: dict[str, Any], key: str, title: str, total_key: str) -> Any:
    from rich.table import Table

    table = Table(title=title)
    for column in ("term", "bytes", "phase", "notes"):
        table.add_column(column, justify="right" if column == "bytes" else "left")
    for row in doc[key]:
        table.add_row(row["term"], human(row["bytes"]), row["phase"], row["note"])
    label = "peak (always + max(activations + largest transient, step))" if key == "per_gpu" else ""
    table.add_row("total", human(doc[total_key]), "", label, style="bold")
    return table


def _fitting_table(candidates: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    table = Table(title="Configurations that fit, fastest first")
    for column in ("layout", "stage", "offload", "micro-batch", "checkpointing", "per GPU", "CPU per node"):
        table.add_column(column)
    for c in candidates:
        table.add_row(
            c["layout"] + (f" (bubble {c['bubble']:.0%})" if c["pp"] > 1 else ""),
            str(c["stage"]),
            c["offload"],
            str(c["micro_batch"]),
            c["checkpointing"],
            human(c["gpu_bytes"]),
            human(c["cpu_bytes"]),
        )
    if not candidates:
        table.add_row("none", "", "", "", "", "", "")
    return table
