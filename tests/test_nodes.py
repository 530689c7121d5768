"""What a hostfile launch hands its workers (run.nodes), without starting any: the environment chosen,
the runner's arguments, the files written, and a worker adopting them under each MPI's variables.
The launches themselves run in tests/test_multinode.py."""

from __future__ import annotations

import json
import os
import socket
import stat
from pathlib import Path

import pytest

from llmtrain.config import ConfigError, LaunchConfig
from llmtrain.parallel.node import NODE_ENV, node_name, output_relayed
from llmtrain.run import nodes


def test_llmtrains_settings_are_forwarded_and_secrets_only_when_named() -> None:
    environ = {
        "LLMTRAIN_FAULTS": "exit@1:5",
        "DS_ACCELERATOR": "cpu",
        "WANDB_MODE": "offline",
        "WANDB_API_KEY": "k",
        "HF_TOKEN": "t",
        "HF_HOME": "/cache/hf",
        "TOKENIZERS_PARALLELISM": "false",  # TOKENIZERS is not TOKEN
        "NCCL_SOCKET_IFNAME": "ib0",
        "OMP_NUM_THREADS": "4",
        "AWS_SECRET_ACCESS_KEY": "s",
        "HOME": "/root",
        "CUDA_VISIBLE_DEVICES": "0,1",  # each node's own
        "MY_SETTING": "x",
    }
    chosen = nodes.forwarded_environment(environ, [])
    assert chosen == {
        "DS_ACCELERATOR": "cpu",
        "HF_HOME": "/cache/hf",
        "LLMTRAIN_FAULTS": "exit@1:5",
        "NCCL_SOCKET_IFNAME": "ib0",
        "OMP_NUM_THREADS": "4",
        "TOKENIZERS_PARALLELISM": "false",
        "WANDB_MODE": "offline",
    }
    named = nodes.forwarded_environment(environ, ["WANDB_API_KEY", "MY_SETTING", "NOT_SET"])
    assert named["WANDB_API_KEY"] == "k" and named["MY_SETTING"] == "x"
    assert "HF_TOKEN" not in named and "NOT_SET" not in named


def test_openmpi_as_root_is_allowed_and_the_users_runner_args_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    mpi = LaunchConfig(launcher="openmpi", launcher_args="--mca btl_tcp_if_include ib0")
    assert nodes.runner_args(mpi) == ["--launcher_args=--mca btl_tcp_if_include ib0 --allow-run-as-root"]
    assert nodes.runner_args(LaunchConfig(launcher="pdsh")) == []
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert nodes.runner_args(LaunchConfig(launcher="openmpi")) == []


def test_the_launch_files_hold_the_nodes_used_and_the_environment_owner_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLMTRAIN_FAULTS", "hang@0:1")
    monkeypatch.setenv("WANDB_API_KEY", "secret")
    launch = LaunchConfig(gpus=2, nodes=2, hostfile="h", master_port=29555)
    hosts = {"a": 8, "b": 8, "c": 8}
    with nodes.launch_files(launch, hosts, tmp_path) as files:
        assert files.hostfile.read_text() == "a slots=2\nb slots=2\n"
        assert files.master_addr == "a"
        assert stat.S_IMODE(files.env_file.stat().st_mode) == 0o600
        handoff = json.loads(files.env_file.read_text())
    assert not files.env_file.exists()  # removed when the launch ends
    assert handoff["env"]["LLMTRAIN_FAULTS"] == "hang@0:1" and "WANDB_API_KEY" not in handoff["env"]
    assert handoff["nodes"] == ["a", "b"] and handoff["processes_per_node"] == 2
    assert (handoff["master_addr"], handoff["master_port"]) == ("a", 29555)
    with nodes.launch_files(LaunchConfig(gpus=2, nodes=2, hostfile="h"), hosts, tmp_path) as files:
        assert files.master_port == nodes.DEFAULT_MASTER_PORT == 29500  # the first node's: not probed


@pytest.mark.parametrize(
    "mpi_variables",
    [
        {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1"},
        {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1"},
        {"MV2_COMM_WORLD_RANK": "3", "MV2_COMM_WORLD_SIZE": "4", "MV2_COMM_WORLD_LOCAL_RANK": "1"},
    ],
    ids=["openmpi", "mpich-impi", "mvapich"],
)
def test_a_worker_under_mpirun_takes_its_rank_from_the_mpi_and_its_node_from_the_hostfile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mpi_variables: dict[str, str]
) -> None:
    # adopt_launch_environment writes os.environ as a worker's first act; here it writes a copy, so
    # no RANK or MASTER_ADDR leaks into the processes later tests start (monkeypatch.delenv of an
    # unset name records nothing to undo).
    monkeypatch.setattr(os, "environ", dict(os.environ))
    for name in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        NODE_ENV,
    ):
        os.environ.pop(name, None)
    for name, value in mpi_variables.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PATH", "/usr/bin")
    monkeypatch.setenv("WANDB_MODE", "online")
    handoff = {
        "env": {"WANDB_MODE": "offline"},
        "path": "/venv/bin",
        "nodes": ["node-a", "node-b"],
        "processes_per_node": 2,
        "master_addr": "node-a",
        "master_port": 29555,
    }
    (tmp_path / "env.json").write_text(json.dumps(handoff))
    nodes.adopt_launch_environment(tmp_path / "env.json")
    got = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    assert got == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("node-a", "29555")
    assert os.environ["WANDB_MODE"] == "offline" and os.environ["PATH"] == "/venv/bin:/usr/bin"
    assert node_name() == "node-b" and output_relayed()  # rank 3 of 2 per node


def test_a_missing_launch_environment_is_bad_input(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the launch's environment"):
        nodes.adopt_launch_environment(tmp_path / "gone.json")


def test_outside_a_hostfile_launch_a_worker_is_on_its_host_and_prints_to_the_terminal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(NODE_ENV, raising=False)
    assert node_name() == socket.gethostname() and not output_relayed()
