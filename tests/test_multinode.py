"""Two nodes through DeepSpeed's multi-node runners, pdsh over ssh and OpenMPI's mpirun, on a loopback
cluster (tests/cluster.py: sshd on 127.0.0.2 and 127.0.0.3, named node-a and node-b).

One module fixture starts three jobs at once, each of two processes (fp32, ZeRO 1, bitwise comparable):
- `one_node`: `train --gpus 2` on this machine, the reference;
- `openmpi`: `train --hostfile H --nodes 2 --gpus 1 --launcher openmpi`;
- `pdsh`: the same through pdsh (the default runner), with LLMTRAIN_FAULTS making rank 1 (on node-b)
  hang in step 4, right after the checkpoint at step 3; the test SIGKILLs that worker, checks how the
  job ended and resumes it through pdsh to the end.
The hang itself shows that llmtrain's settings reached the remote worker: without them it would not
hang and the first attempt would finish.
"""

from __future__ import annotations

import json
import re
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from cluster import NODES, Cluster, cluster, remote_worker, running_or_skip
from dist import free_port
from runkit import BASE_FLAGS, Run, kill_tree, latest, run_env, start, wait_for

from llmtrain.train.metrics import METRICS_FILE, read_metrics

pytestmark = pytest.mark.slow

STEPS, SAVE_EVERY = 6, 3
HANG_STEP = 3  # 0-based: rank 1 hangs while computing step 4, after the checkpoint at step 3
STOP_AFTER = 3  # steps logged before the `stopped` run gets SIGTERM
JOB_TIMEOUT = 300.0
FAKE_SECRET = "llmtrainfake" + "0123456789abcdef" * 2


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from running_or_skip(cluster(tmp_path_factory.mktemp("cluster")), "cluster")


def _train(run_dir: Path, *launch: str, steps: int = STEPS) -> list[str]:
    return [
        "train", *BASE_FLAGS, "--steps", str(steps), "--save-every", str(SAVE_EVERY),
        "--run-dir", str(run_dir), "--master-port", str(free_port()), *launch,
    ]  # fmt: skip


def _two_nodes(hostfile: Path, launcher: str) -> list[str]:
    return ["--hostfile", str(hostfile), "--nodes", "2", "--gpus", "1", "--launcher", launcher]


@dataclass
class Jobs:
    runs: dict[str, Run]
    dirs: dict[str, Path]
    codes: dict[str, int]
    outputs: dict[str, str]
    killed: psutil.Process
    killed_env: dict[str, str]
    handed_over: dict  # RUN_DIR/launch/env.json as the pdsh workers found it
    handed_over_mode: int
    job_ended_in_s: float


def _last_step(run_dir: Path) -> int:
    path = run_dir / METRICS_FILE
    records = read_metrics(path) if path.is_file() else []
    return max((r["step"] for r in records if "loss" in r), default=0)


def _venv_behind_a_symlink(tmp: Path) -> Path:
    link = tmp / "venv-link"
    link.symlink_to(Path(sys.executable).parent.parent)
    return link


@pytest.fixture(scope="module")
def jobs(nodes: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Jobs:
    tmp = tmp_path_factory.mktemp("multinode")
    hostfile = nodes.hostfile(tmp / "hostfile", {"node-a": 1, "node-b": 1})
    dirs = {name: tmp / name for name in ("one_node", "openmpi", "pdsh", "stopped")}
    env = nodes.env(run_env(WANDB_API_KEY=FAKE_SECRET))
    runs = {
        "one_node": start(_train(dirs["one_node"], "--gpus", "2"), tmp / "one_node.log", env),
        "openmpi": start(_train(dirs["openmpi"], *_two_nodes(hostfile, "openmpi")), tmp / "openmpi.log", env),
        "pdsh": start(
            _train(dirs["pdsh"], *_two_nodes(hostfile, "pdsh"), "--master-addr", "node-a"),
            tmp / "pdsh.log",
            nodes.env(run_env(faults=f"hang@1:{HANG_STEP}", WANDB_API_KEY=FAKE_SECRET)),
        ),
        # Far too long to finish: stopped with SIGTERM to the command the user started, as a preemption.
        # Eager, as the other jobs: a run this long would compile its blocks by default. Its venv is
        # reached through a symlink, which gives the workers another command line than the launcher's.
        "stopped": start(
            _train(dirs["stopped"], *_two_nodes(hostfile, "pdsh"), "--no-compile", steps=100_000),
            tmp / "stopped.log",
            env,
            launcher=[str(_venv_behind_a_symlink(tmp) / "bin" / "python")],
        ),
    }
    pdsh_dir = dirs["pdsh"]
    try:
        wait_for(
            lambda: latest(pdsh_dir) is not None, JOB_TIMEOUT, "the pdsh run's checkpoint before its hang"
        )
        handoff_file = pdsh_dir / "launch" / "env.json"
        handed_over, mode = json.loads(handoff_file.read_text()), handoff_file.stat().st_mode
        victim = remote_worker(pdsh_dir, rank=1)
        assert victim is not None, runs["pdsh"].output()[-3000:]
        victim_env = victim.environ()
        victim.kill()
        killed_at = time.monotonic()
        pdsh_code, pdsh_output = runs["pdsh"].wait(JOB_TIMEOUT)
        ended_in = time.monotonic() - killed_at
        codes, outputs = {"pdsh": pdsh_code}, {"pdsh": pdsh_output}
        wait_for(lambda: _last_step(dirs["stopped"]) >= STOP_AFTER, JOB_TIMEOUT, "the run to stop")
        runs["stopped"].proc.send_signal(signal.SIGTERM)
        for name in ("one_node", "openmpi", "stopped"):
            codes[name], outputs[name] = runs[name].wait(JOB_TIMEOUT)
    finally:
        for run in runs.values():
            kill_tree(run.proc.pid)
    return Jobs(runs, dirs, codes, outputs, victim, victim_env, handed_over, stat.S_IMODE(mode), ended_in)


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir / METRICS_FILE) if "loss" in r]


def _assert_same_losses(run_dir: Path, reference: Path) -> None:
    got, want = _losses(run_dir), _losses(reference)
    assert len(got) == len(want) == STEPS
    assert got == pytest.approx(want, rel=1e-6)


def test_openmpi_two_nodes_train_as_one_node_with_two_processes(jobs: Jobs) -> None:
    assert jobs.codes["one_node"] == 0, jobs.outputs["one_node"][-3000:]
    assert jobs.codes["openmpi"] == 0, jobs.outputs["openmpi"][-3000:]
    _assert_same_losses(jobs.dirs["openmpi"], jobs.dirs["one_node"])
    output = jobs.outputs["openmpi"]
    assert "\x1b[" not in output  # mpirun gives the workers a terminal of its own: still plain lines
    assert re.findall(r"^step (\d+)/", output, re.M) == [str(s) for s in range(1, STEPS + 1)]
    used = (jobs.dirs["openmpi"] / "launch" / "hostfile").read_text()
    assert used == "node-a slots=1\nnode-b slots=1\n"
    assert not (jobs.dirs["openmpi"] / "launch" / "env.json").exists()  # removed when the launch ended


def test_the_remote_workers_get_llmtrains_settings_and_no_secrets(jobs: Jobs) -> None:
    env = jobs.handed_over["env"]
    assert env["LLMTRAIN_FAULTS"] == f"hang@1:{HANG_STEP}"
    assert env["DS_ACCELERATOR"] == "cpu" and env["OMP_NUM_THREADS"] == "1" and env["WANDB_MODE"] == "offline"
    assert "WANDB_API_KEY" not in env and FAKE_SECRET not in json.dumps(jobs.handed_over)
    assert jobs.handed_over["nodes"] == ["node-a", "node-b"] and jobs.handed_over["master_addr"] == "node-a"
    assert jobs.handed_over["path"] == str(Path(sys.executable).parent)
    assert jobs.handed_over_mode == 0o600
    # The worker that hung (as LLMTRAIN_FAULTS told rank 1 to) was started over ssh on node-b.
    assert jobs.killed_env["SSH_CONNECTION"].split()[2] == NODES["node-b"]


def test_a_killed_worker_on_node_b_ends_the_job_naming_it_and_resume_is_exact(
    jobs: Jobs, nodes: Cluster, tmp_path: Path
) -> None:
    output = jobs.outputs["pdsh"]
    assert jobs.codes["pdsh"] != 0
    assert jobs.job_ended_in_s < 60, output[-3000:]  # at once, not after the collective timeout
    named = f"rank 1 on node-b (pid {jobs.killed.pid}) has died (crashed or killed)"
    errors = [line for line in output.splitlines() if "error: " in line]
    assert any(line.startswith("node-a: error: rank 0: lost contact") and named in line for line in errors), (
        output[-3000:]
    )
    assert "Traceback" not in output
    assert _last_step(jobs.dirs["pdsh"]) == HANG_STEP
    resumed = start(
        ["resume", str(jobs.dirs["pdsh"]), "--master-port", str(free_port())],
        tmp_path / "resume.log",
        nodes.env(run_env()),
    )
    code, resumed_output = resumed.wait(JOB_TIMEOUT)
    assert code == 0, resumed_output[-3000:]
    assert re.findall(r"^node-a: step (\d+)/", resumed_output, re.M) == ["4", "5", "6"]
    _assert_same_losses(jobs.dirs["pdsh"], jobs.dirs["one_node"])


def test_sigterm_to_the_launching_command_stops_the_workers_on_every_node_after_a_save(jobs: Jobs) -> None:
    """A preemption of the process the user started, whose venv is behind a symlink: the workers on both
    nodes are told over ssh (by the pids they registered), finish their step, save together and exit 0
    (the runner's own ssh sessions, and output, stay up)."""
    output = jobs.outputs["stopped"]
    assert jobs.codes["stopped"] == 0, output[-3000:]
    last = _last_step(jobs.dirs["stopped"])
    assert STOP_AFTER <= last < 100_000
    assert latest(jobs.dirs["stopped"]) == f"step_{last:08d}"  # saved at the step it stopped at
    assert output.count("training summary") == 1 and "Traceback" not in output
    assert (
        remote_worker(jobs.dirs["stopped"], rank=0) is None
        and remote_worker(jobs.dirs["stopped"], rank=1) is None
    )
    assert not (jobs.dirs["stopped"] / "launch" / "workers").exists()  # removed when the launch ended


# ---------------------------------------------------------------- refused before any worker starts


def _refused(nodes: Cluster, tmp_path: Path, hosts: dict[str, int], *flags: str) -> str:
    hostfile = nodes.hostfile(tmp_path / "hostfile", hosts)
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "llmtrain", *_train(run_dir, "--hostfile", str(hostfile), *flags)]
    done = subprocess.run(cmd, env=nodes.env(run_env()), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: "), done.stderr
    assert not run_dir.exists()
    return done.stderr


def test_a_node_that_does_not_answer_ssh_is_refused(nodes: Cluster, tmp_path: Path) -> None:
    said = _refused(nodes, tmp_path, {"node-a": 1, "node-c": 1}, "--nodes", "2", "--gpus", "1")
    assert "node-c does not answer ssh (" in said and "make `ssh node-c true` work" in said


def test_a_master_addr_other_than_the_first_node_is_refused(nodes: Cluster, tmp_path: Path) -> None:
    hosts = {"node-a": 1, "node-b": 1}
    said = _refused(nodes, tmp_path, hosts, "--nodes", "2", "--gpus", "1", "--master-addr", "node-b")
    assert "--master-addr node-b: rank 0 runs on node-a, the first node in" in said
