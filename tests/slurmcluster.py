"""A two-node Slurm cluster on this machine, for the `srun llmtrain train` tests.

Debian's slurmctld, two slurmd (`slurm-a` and `slurm-b`, at 127.0.0.4 and 127.0.0.5 in /etc/hosts while
it runs: names of its own, as the sshd cluster of tests/cluster.py may run beside it) and munged, all in the foreground as this test's children,
with a private slurm.conf (SLURM_CONF), free ports, state and spool directories and munge socket under a
fresh directory: nothing of the machine's own Slurm or munge is read or written. Both "nodes" share
this machine's filesystem, as cluster nodes share a network filesystem. The packages are installed
when missing; without root or apt the tests that need the cluster are skipped with the reason.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from cluster import Unavailable, free_port, host_names, install_packages, wait_for_apt

NODES = {"slurm-a": "127.0.0.4", "slurm-b": "127.0.0.5"}

PACKAGES = {"slurmctld": "slurmctld", "slurmd": "slurmd", "srun": "slurm-client", "munged": "munge"}
SBIN = ("/usr/sbin", "/usr/bin")
# More CPUs than the machine has (slurmd takes the configured count: config_overrides), so that the
# tests' jobs of one task per node run side by side instead of queueing for a core.
CPUS_PER_NODE = 4


@dataclass
class SlurmCluster:
    conf: Path

    def env(self, base: dict[str, str]) -> dict[str, str]:
        return dict(base, SLURM_CONF=str(self.conf))


def _which(name: str) -> str | None:
    return shutil.which(name) or next((f"{d}/{name}" for d in SBIN if Path(f"{d}/{name}").exists()), None)


def _conf(root: Path, ports: dict[str, int]) -> Path:
    host = socket.gethostname()
    nodes = "".join(
        f"NodeName={name} NodeHostname={host} NodeAddr={address} Port={ports[name]} CPUs={CPUS_PER_NODE} State=UNKNOWN\n"
        for name, address in NODES.items()
    )
    conf = root / "slurm.conf"
    conf.write_text(
        f"ClusterName=llmtrain-test\nSlurmctldHost={host}(127.0.0.1)\nSlurmctldPort={ports['ctld']}\n"
        f"AuthType=auth/munge\nCryptoType=crypto/munge\nAuthInfo=socket={root / 'munge.socket'}\n"
        f"SlurmUser=root\nSlurmdUser=root\nStateSaveLocation={root / 'state'}\n"
        f"SlurmdSpoolDir={root / 'spool'}/%n\nSlurmctldPidFile={root / 'slurmctld.pid'}\n"
        f"SlurmdPidFile={root / 'slurmd-%n.pid'}\nProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
        "SlurmdParameters=config_overrides\nMpiDefault=none\nSchedulerType=sched/builtin\nSelectType=select/cons_tres\n"
        "SelectTypeParameters=CR_Core\nJobRequeue=1\nReturnToService=2\n"
        f"{nodes}PartitionName=test Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP "
        "OverSubscribe=YES\n"
    )
    return conf


def _start(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:  # the daemon keeps its own copy of the descriptor
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _wait_for_nodes(env: dict[str, str], daemons: list[subprocess.Popen[bytes]], root: Path) -> None:
    deadline = time.monotonic() + 30
    while True:
        done = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N %t"], env=env, capture_output=True, text=True, timeout=30
        )
        states = dict(line.split() for line in done.stdout.splitlines() if line.strip())
        if set(states) == set(NODES) and all(s == "idle" for s in states.values()):
            return
        dead = [d.args[0] for d in daemons if d.poll() is not None]
        if dead or time.monotonic() > deadline:
            logs = " | ".join(p.read_text()[-300:] for p in sorted(root.glob("*.log")))
            raise Unavailable(f"the loopback Slurm cluster did not come up ({states or done.stderr}): {logs}")
        time.sleep(0.3)


@contextlib.contextmanager
def slurm_cluster(root: Path) -> Iterator[SlurmCluster]:
    """Start munged, slurmctld and two slurmd under ROOT (a fresh directory); stop them after."""
    if os.geteuid() != 0:
        raise Unavailable("needs root (to run slurmd and add host names to /etc/hosts)")
    wait_for_apt()
    missing = [PACKAGES[name] for name in PACKAGES if _which(name) is None]
    if missing:
        install_packages(missing)
    for sub in ("state", "spool"):
        (root / sub).mkdir()
    ports = {"ctld": free_port("127.0.0.1"), **{name: free_port(address) for name, address in NODES.items()}}
    conf = _conf(root, ports)
    env = dict(os.environ, SLURM_CONF=str(conf))
    daemons: list[subprocess.Popen[bytes]] = []
    try:
        with host_names(NODES, "# llmtrain test Slurm cluster"):
            munged = [
                str(_which("munged")), "-F", "--force", f"--socket={root / 'munge.socket'}",
                f"--pid-file={root / 'munged.pid'}", f"--seed-file={root / 'munge.seed'}",
                f"--log-file={root / 'munged.log'}",
            ]  # fmt: skip
            daemons.append(_start(munged, root / "munged.out", env))
            daemons.append(_start([str(_which("slurmctld")), "-D"], root / "slurmctld.log", env))
            for name in NODES:
                daemons.append(
                    _start([str(_which("slurmd")), "-D", "-N", name], root / f"slurmd-{name}.log", env)
                )
            _wait_for_nodes(env, daemons, root)
            yield SlurmCluster(conf)
    finally:
        for daemon in reversed(daemons):
            daemon.terminate()
        for daemon in daemons:
            try:
                daemon.wait(timeout=10)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()


if __name__ == "__main__":
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp, slurm_cluster(Path(tmp)) as c:
        subprocess.run(["sinfo"], env=c.env(dict(os.environ)))
        if len(sys.argv) > 1:
            subprocess.run(sys.argv[1:], env=c.env(dict(os.environ)))
