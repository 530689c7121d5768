"""What a step sends across nodes, measured against planning.traffic's formula: flat ZeRO 3, ZeRO++ hpZ,
FSDP2 sharded over all ranks and HSDP (FSDP2 sharded within each node), all --zero 3, on the loopback two-node cluster of the tests (tests/cluster.py: sshd on 127.0.0.2 and
127.0.0.3 as node-a and node-b; needs root, and Debian's openssh-server and pdsh, which it installs).

`python -m bench traffic` (about 90 s on a 2-core CPU): for each layout, `llmtrain train
--hostfile H --nodes 2 --gpus 2 --zero 3` through pdsh (the debug model, fp32, two micro-batches a
step), then from its metrics.jsonl every step's `comm_bytes` (rank 0's collective bytes by whether
their group spans nodes) after the first (which records DeepSpeed's module order), beside the formula
for the run's own config, and tokens/s. The jobs run one after the other, each alone on the cores.

bench/results/traffic.json keeps the settings, each layout's measured and predicted bytes and the
ratios hpZ over flat ZeRO 3 and HSDP over FSDP2; tests/test_bench_traffic.py holds the measured bytes to the formula (within 10%)
and the recorded predictions to what the formula says today.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.ranks import REPO, free_port, write_result
from llmtrain import rundir
from llmtrain.config import to_dict

OUT = REPO / "bench" / "results" / "traffic.json"
NODES, PER_NODE = 2, 2
STEPS = 8
FLAGS = ["--preset", "debug", "--precision", "fp32", "--seq-len", "32", "--micro-batch", "2",
         "--global-batch", "16", "--zero", "3", "--steps", str(STEPS), "--log-every", "1",
         "--no-compile"]  # fmt: skip
LAYOUTS: dict[str, list[str]] = {
    "flat zero3": [],
    "hpz": ["--shard-within-node"],
    "fsdp2 zero3": ["--engine", "fsdp2", "--dp-shard", str(NODES * PER_NODE)],  # sharded over all ranks
    "hsdp": ["--engine", "fsdp2"],  # FSDP2's default on several nodes: a node's ranks shard
}
SPANS = ("inside_node", "across_nodes")


def predicted(config: dict[str, Any]) -> dict[str, int]:
    """planning.traffic's bytes per step for a run's resolved config (config.yaml as a dict)."""
    from llmtrain.config import from_dict
    from llmtrain.planning import memory, traffic

    setup = memory.setup_from_config(from_dict(config, where="bench/results/traffic.json"))
    return traffic.bytes_by_span(setup, ranks_per_node=PER_NODE)


def _measured(run_dir: Path) -> dict[str, Any]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r and r["step"] > 1]
    return {
        "comm_bytes_per_step": {span: [r["comm_bytes"][span] for r in steps] for span in SPANS},
        "median_tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in steps),
    }


def _run(name: str, flags: list[str], root: Path, env: dict[str, str], hostfile: Path) -> dict[str, Any]:
    run_dir = root / name.replace(" ", "_")
    launch = ["--hostfile", str(hostfile), "--nodes", str(NODES), "--gpus", str(PER_NODE)]
    command = ["train", *FLAGS, *flags, *launch, "--run-dir", str(run_dir), "--master-port", str(free_port())]
    done = subprocess.run(
        [sys.executable, "-m", "llmtrain", *command], env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"bench traffic: `llmtrain {' '.join(command)}` failed:\n{done.stderr[-3000:]}")
    config = to_dict(rundir.load_saved_config(run_dir))
    # This machine's paths and port say nothing of the run: the formula reads the rest.
    config["run_dir"] = None
    config["launch"].update(hostfile="HOSTFILE", master_port=None)
    shown = ["llmtrain", "train", *FLAGS, *flags, "--hostfile", "HOSTFILE", *launch[2:]]
    return {
        "command": " ".join(shown),
        "config": config,
        "predicted": predicted(config),
        **_measured(run_dir),
    }


def main() -> None:
    sys.path.insert(0, str(REPO / "tests"))
    from cluster import cluster

    with tempfile.TemporaryDirectory() as tmp, cluster(Path(tmp), mark="# llmtrain bench traffic") as nodes:
        root = Path(tmp)
        hostfile = nodes.hostfile(root / "hostfile", {"node-a": PER_NODE, "node-b": PER_NODE})
        env = nodes.env(dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", WANDB_MODE="offline"))
        rows = {name: _run(name, flags, root, env, hostfile) for name, flags in LAYOUTS.items()}
    result = {
        "machine": rundir.environment(NODES * PER_NODE),
        "cluster": f"{NODES} loopback nodes x {PER_NODE} processes, pdsh",
        "rows": rows,
        "hpz_over_flat": _ratios(rows["hpz"], rows["flat zero3"]),
        "hsdp_over_fsdp2": _ratios(rows["hsdp"], rows["fsdp2 zero3"]),
    }
    write_result(result, OUT)


def _ratios(row: dict[str, Any], baseline: dict[str, Any]) -> dict[str, float]:
    """`row` over `baseline`: measured and predicted bytes across nodes, and tokens/s."""

    def across(measured: dict[str, Any]) -> float:
        return statistics.median(measured["comm_bytes_per_step"]["across_nodes"])

    return {
        "across_nodes_bytes": across(row) / across(baseline),
        "predicted_across_nodes_bytes": row["predicted"]["across_nodes"]
        / baseline["predicted"]["across_nodes"],
        "tokens_per_sec": row["median_tokens_per_sec"] / baseline["median_tokens_per_sec"],
    }


if __name__ == "__main__":
    main()
