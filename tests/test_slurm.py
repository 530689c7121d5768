"""Slurm: `srun llmtrain train` and the job script of `train --sbatch`, on a real slurmctld and two
slurmd (tests/slurmcluster.py: nodes slurm-a and slurm-b on this machine).

One module fixture runs four trainings at once, each of two processes (fp32, ZeRO 1, bitwise
comparable), about a minute in all on two cores, mostly waiting for Slurm:
- `one_node`: `train --gpus 2` on this machine, the reference of the two-node run;
- `srun`: `srun -N2 -n2 llmtrain train ...`, one task per node, uninterrupted: the reference of the
  requeued job;
- `requeued`: the script `train --sbatch` writes, submitted as written, requeued with `scontrol requeue`
  mid-run (LLMTRAIN_FAULTS slows every step by 0.15 s, which changes no number, so the requeue surely
  lands mid-run), then let start at once instead of after Slurm's two-minute hold;
- `time_limit`: the same kind of script, submitted with a one-minute limit and the save signal 40 s
  before it: it saves (through two more SIGTERMs the test sends its tasks meanwhile), exits 0 and
  requeues itself; the test cancels the requeued job.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cluster import running_or_skip
from runkit import (
    BASE_FLAGS,
    assert_resumed_bitwise,
    error_lines,
    kill_tree,
    last_logged_step,
    latest,
    losses,
    run_env,
    start,
    wait_for,
)
from slurmcluster import NODES, SlurmCluster, slurm_cluster

from llmtrain.checkpoint.reading import verify
from llmtrain.run import slurm

STEPS = 40
REQUEUE_AFTER = 5  # steps logged before `scontrol requeue`
SLOW = "slow@0:0"  # 0.15 s more per step: the requeued run takes 6 s at least
JOB_TIMEOUT = 240.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    yield from running_or_skip(slurm_cluster(tmp_path_factory.mktemp("slurm")), "Slurm cluster")


def _train(run_dir: Path, steps: int, *extra: str) -> list[str]:
    return [
        "train",
        *BASE_FLAGS,
        "--steps",
        str(steps),
        "--save-every",
        "1000",
        "--run-dir",
        str(run_dir),
        *extra,
    ]


def _slurm(cluster: SlurmCluster, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(args), env=cluster.env(run_env()), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 or not check, f"{' '.join(args)}: {done.stdout}{done.stderr}"
    return done


def _job(cluster: SlurmCluster, job: str) -> dict[str, str]:
    """`scontrol show job` as fields: JobState, Restarts, Reason, ..."""
    out = _slurm(cluster, "scontrol", "show", "job", "-o", job).stdout
    return dict(item.split("=", 1) for item in out.split() if "=" in item)


def _until(cluster: SlurmCluster, action: list[str], what: str) -> None:
    """Run a Slurm command until it succeeds (`scontrol requeue` fails while the job is still starting)."""
    wait_for(lambda: _slurm(cluster, *action, check=False).returncode == 0, 60, what, poll=1.0)


def _submit(cluster: SlurmCluster, script: Path, run_dir: Path, steps: int, *sbatch: str) -> str:
    """Write the job script with `train --sbatch` (two nodes, one task each) and submit it as written."""
    env = cluster.env(run_env(faults=SLOW))
    args = [*_train(run_dir, steps, "--no-compile"), "--nodes", "2", "--gpus", "1", "--sbatch", str(script)]
    done = subprocess.run([sys.executable, "-m", "llmtrain", *args], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith(f"wrote {script}: 2 nodes x 1 task per node, requeued on preemption")
    submitted = subprocess.run(
        ["sbatch", "--parsable", *sbatch, str(script)], env=env, capture_output=True, text=True, timeout=60
    )
    assert submitted.returncode == 0, submitted.stderr
    return submitted.stdout.strip()


@dataclass
class Jobs:
    dirs: dict[str, Path]
    outputs: dict[str, str]
    codes: dict[str, int]
    states: dict[str, dict[str, str]]  # the sbatch jobs as Slurm last showed them
    script: str


def _job_output(script: Path, job: str) -> str:
    path = script.with_name(f"{script.stem}-{job}.out")
    return path.read_text(errors="replace") if path.exists() else ""


def _signal_while_saving(cluster: SlurmCluster, job: str, script: Path) -> None:
    wait_for(lambda: "nears its time limit" in _job_output(script, job), JOB_TIMEOUT, "the time limit")
    for _ in range(2):
        time.sleep(0.2)
        _slurm(cluster, "scancel", "--signal=TERM", job, check=False)


@pytest.fixture(scope="module")
def jobs(cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Jobs:
    tmp = tmp_path_factory.mktemp("jobs")
    dirs = {name: tmp / name for name in ("one_node", "srun", "requeued", "time_limit")}
    scripts = {name: tmp / f"{name}.sh" for name in ("requeued", "time_limit")}
    ids = {
        "requeued": _submit(cluster, scripts["requeued"], dirs["requeued"], STEPS),
        # Saved and requeued 40 s before a one-minute limit (Slurm looks every 30 s): far from done.
        "time_limit": _submit(
            cluster, scripts["time_limit"], dirs["time_limit"], 100_000, "--time=1", "--signal=B:USR1@40"
        ),
    }
    # Two more SIGTERMs to the tasks while they save at the time limit: nothing may break.
    more_signals = threading.Thread(
        target=_signal_while_saving, args=(cluster, ids["time_limit"], scripts["time_limit"]), daemon=True
    )
    more_signals.start()
    env = cluster.env(run_env())
    srun = ["srun", "-N2", "-n2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", sys.executable, "-u"]
    runs = {
        "one_node": start([*_train(dirs["one_node"], STEPS), "--gpus", "2"], tmp / "one_node.log", env),
        "srun": start(_train(dirs["srun"], STEPS), tmp / "srun.log", env, launcher=srun),
    }
    try:
        job = ids["requeued"]
        wait_for(lambda: last_logged_step(dirs["requeued"]) >= REQUEUE_AFTER, JOB_TIMEOUT, "the job's steps")
        _until(cluster, ["scontrol", "requeue", job], "scontrol requeue")
        wait_for(lambda: _job(cluster, job)["JobState"] == "PENDING", JOB_TIMEOUT, "the job to be requeued")
        wait_for(
            lambda: (
                _slurm(cluster, "scontrol", "update", f"JobId={job}", "StartTime=now", check=False)
                and _job(cluster, job)["JobState"] != "PENDING"
            ),
            JOB_TIMEOUT,
            "the requeued job to start",
            poll=2.0,
        )
        wait_for(
            lambda: _job(cluster, job)["JobState"] == "COMPLETED", JOB_TIMEOUT, "the requeued job to end"
        )

        limited = ids["time_limit"]
        wait_for(lambda: _job(cluster, limited)["Restarts"] == "1", JOB_TIMEOUT, "the time limit's requeue")
        states = {name: _job(cluster, ids[name]) for name in ids}
        _slurm(cluster, "scancel", limited)
        codes, outputs = {}, {}
        for name, run in runs.items():
            codes[name], outputs[name] = run.wait(JOB_TIMEOUT)
        outputs.update({name: _job_output(scripts[name], ids[name]) for name in ids})
    finally:
        for run in runs.values():
            kill_tree(run.proc.pid)
        for job in ids.values():
            _slurm(cluster, "scancel", job, check=False)
    return Jobs(dirs, outputs, codes, states, scripts["requeued"].read_text())


@pytest.mark.slow
def test_an_srun_job_of_one_task_per_node_trains_as_one_node_with_two_processes(jobs: Jobs) -> None:
    assert jobs.codes["one_node"] == 0, jobs.outputs["one_node"][-3000:]
    assert jobs.codes["srun"] == 0, jobs.outputs["srun"][-3000:]
    got, want = losses(jobs.dirs["srun"]), losses(jobs.dirs["one_node"])
    assert sorted(got) == list(range(1, STEPS + 1))
    assert list(got.values()) == pytest.approx(list(want.values()), rel=1e-6)
    output = jobs.outputs["srun"]
    # One run of world size 2 (rank 0 prints), not two runs of world size 1 on one run directory.
    assert re.findall(r"^step (\d+)/", output, re.M) == [str(s) for s in range(1, STEPS + 1)]
    assert output.count("training summary") == 1 and "error: " not in output


@pytest.mark.slow
def test_a_job_requeued_mid_run_resumes_bitwise_where_it_stopped(jobs: Jobs) -> None:
    output = jobs.outputs["requeued"]
    assert jobs.states["requeued"]["JobState"] == "COMPLETED" and jobs.states["requeued"]["Restarts"] == "1"
    first, second = output.split("attempt 2, on ")
    # Every task of the first attempt saved and exited 0 (srun names a task that did not: `srun: error:
    # slurm-b: task 1: Exited with exit code 1`); Slurm ends the batch script itself on a requeue.
    assert "attempt 1, on " in first and first.count("training summary") == 1 and "srun: error" not in first
    assert second.count("llmtrain: srun exited 0") == 1 and "Traceback" not in output
    stopped = [int(s) for s in re.findall(r"^step (\d+)/", first, re.M)][-1]
    assert REQUEUE_AFTER <= stopped < STEPS
    # The second attempt continued from the checkpoint saved at the step the first stopped at.
    assert re.findall(r"^step (\d+)/", second, re.M)[0] == str(stopped + 1)
    assert_resumed_bitwise(jobs.dirs["srun"], jobs.dirs["requeued"], STEPS)


@pytest.mark.slow
def test_the_time_limit_signal_saves_exits_0_and_requeues_through_more_signals(jobs: Jobs) -> None:
    output = jobs.outputs["time_limit"]
    assert "nears its time limit: saving, then requeueing" in output, output[-3000:]
    assert "llmtrain: srun exited 0" in output and "Traceback" not in output
    last = last_logged_step(jobs.dirs["time_limit"])
    assert 0 < last < 100_000 and latest(jobs.dirs["time_limit"]) == f"step_{last:08d}"
    assert verify(jobs.dirs["time_limit"] / "checkpoints" / f"step_{last:08d}") == []
    assert jobs.states["time_limit"]["Restarts"] == "1"  # requeued by the script, then cancelled here


@pytest.mark.slow
def test_the_job_script_runs_exactly_this_training_under_srun(jobs: Jobs) -> None:
    script = jobs.script
    assert script.startswith(f"#!/bin/bash\n{slurm.SCRIPT_MARK}")
    for line in (
        "--nodes=2",
        "--ntasks-per-node=1",
        "--requeue",
        f"--signal=B:USR1@{slurm.SIGNAL_BEFORE_LIMIT_S}",
    ):
        assert f"#SBATCH {line}\n" in script
    assert "--gpus-per-node" not in script  # DS_ACCELERATOR=cpu: no GPUs asked for
    srun_line = next(line for line in script.splitlines() if line.startswith("srun "))
    for part in (
        *BASE_FLAGS,
        "--steps 40",
        "--no-compile",
        f"--run-dir {jobs.dirs['requeued']} --resume auto",
    ):
        assert part in srun_line
    assert "--gpus" not in srun_line and "--nodes" not in srun_line  # the tasks are the ranks
    assert f"export LLMTRAIN_FAULTS={SLOW}\n" in script and "export DS_ACCELERATOR=cpu\n" in script


# ---------------------------------------------------------------- refused in one line, no cluster needed


def _llmtrain(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "llmtrain", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def _step_env(**variables: str) -> dict[str, str]:
    """The environment of one task of a two-task srun step on slurm-a, with `variables` changed."""
    step = {
        "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        "SLURM_STEP_NODELIST": "slurm-[a-b]", "SLURMD_NODENAME": "slurm-a", "MASTER_ADDR": "127.0.0.1",
    }  # fmt: skip
    step.update(variables)
    return run_env(**{k: v for k, v in step.items() if v})


def _one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count("\n") == 1 and error_lines(done.stderr) == [done.stderr.strip()], done.stderr
    return done.stderr


@pytest.mark.parametrize(
    ("variables", "said"),
    [
        ({"SLURM_PROCID": ""}, "error: SLURM_PROCID: not set inside an srun step (SLURM_STEP_ID is)"),
        ({"SLURM_STEP_NUM_TASKS": ""}, "error: SLURM_STEP_NUM_TASKS: not set inside an srun step"),
        ({"SLURM_PROCID": "2"}, "error: SLURM_PROCID: 2 is not a rank of a step of 2 tasks"),
        ({"SLURM_STEP_TASKS_PER_NODE": "1(x)"}, "error: SLURM_STEP_TASKS_PER_NODE: '1(x)' is not a list"),
        ({"SLURMD_NODENAME": ""}, "error: SLURMD_NODENAME: not set inside an srun step"),
    ],
)
def test_a_step_environment_that_is_not_whole_is_refused(
    variables: dict[str, str], said: str, tmp_path: Path
) -> None:
    if "SLURM_STEP_NUM_TASKS" in variables:
        variables = {**variables, "SLURM_NTASKS": ""}
    run_dir = tmp_path / "run"
    assert _one_line_error(_llmtrain(_train(run_dir, 2), _step_env(**variables))).startswith(said)
    assert not run_dir.exists()


def test_a_launch_of_its_own_under_srun_is_refused(tmp_path: Path) -> None:
    said = _one_line_error(_llmtrain([*_train(tmp_path / "run", 2), "--gpus", "2"], _step_env()))
    assert said.startswith("error: --gpus: under srun every task is one rank (this step has 2 tasks)")


def test_runner_settings_and_foreign_files_are_refused_by_sbatch(tmp_path: Path) -> None:
    script = tmp_path / "job.sh"
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\n")
    said = _one_line_error(
        _llmtrain(
            [*_train(tmp_path / "run", 2), "--hostfile", str(hostfile), "--sbatch", str(script)], run_env()
        )
    )
    assert said.startswith("error: --hostfile: not for a Slurm job") and not script.exists()
    script.write_text("#!/bin/bash\necho mine\n")
    said = _one_line_error(_llmtrain([*_train(tmp_path / "run", 2), "--sbatch", str(script)], run_env()))
    assert "exists and was not written by llmtrain; nothing was changed" in said
    assert script.read_text() == "#!/bin/bash\necho mine\n"


def test_the_slurm_launcher_of_deepspeed_is_refused_with_the_way_that_works(tmp_path: Path) -> None:
    said = _one_line_error(_llmtrain([*_train(tmp_path / "run", 2), "--launcher", "slurm"], run_env()))
    assert said.startswith("error: --launcher: slurm: DeepSpeed's Slurm runner drops `-m llmtrain`")
    assert "srun llmtrain train" in said and "--sbatch" in said


def test_slurm_task_lists_and_rank_variables() -> None:
    assert slurm.tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    env = dict(
        _step_env(
            SLURM_PROCID="3",
            SLURM_LOCALID="1",
            SLURM_NODEID="1",
            SLURM_STEP_NUM_TASKS="4",
            SLURM_STEP_TASKS_PER_NODE="2(x2)",
            SLURMD_NODENAME="slurm-b",
            SLURM_JOB_ID="12345",
        )
    )
    del env["MASTER_ADDR"]
    got = slurm.rank_environment(env, lambda nodelist: {"slurm-[a-b]": list(NODES)}[nodelist])
    assert got == {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "slurm-a",
        "MASTER_PORT": str(slurm.PORT_BASE + 12345 % slurm.PORT_SPAN), "LLMTRAIN_NODE": "slurm-b",
    }  # fmt: skip
