"""A two-node cluster on this machine, for the multi-node launcher tests.

Two host names, `node-a` and `node-b`, point at 127.0.0.2 and 127.0.0.3 (lines added to /etc/hosts
and removed again), where a private sshd listens on a free port with a throwaway host key and a
throwaway client key. Both "nodes" share this machine's filesystem, as cluster nodes share a network
filesystem: the same venv, the same run directory. Traffic never leaves the machine.

The launchers (DeepSpeed's ssh check, pdsh, mpirun) call a plain `ssh`; the fixture's settings reach
them through a wrapper named `ssh` put first on PATH, which adds `-F <fixture config>`, so the user's
own `~/.ssh` is neither read nor written. Everything it needs (sshd, pdsh, mpirun) comes from Debian's
packages, installed here when missing; without root or apt the tests that need it are skipped with the
reason.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import psutil

from llmtrain.parallel.ports import free_port

T = TypeVar("T")

NODES = {"node-a": "127.0.0.2", "node-b": "127.0.0.3"}
PACKAGES = {"sshd": "openssh-server", "ssh": "openssh-client", "pdsh": "pdsh", "mpirun": "openmpi-bin"}
_HOSTS_FILE = Path("/etc/hosts")
_HOSTS_MARK = "# llmtrain test cluster"
SSHD = "/usr/sbin/sshd"


class Unavailable(Exception):
    """The cluster cannot be had on this machine; the message says why (a skip reason)."""


def running_or_skip(started: AbstractContextManager[T], what: str) -> Iterator[T]:
    """A module fixture's body (`yield from`): the cluster `started` brings up while the tests use it,
    or the tests skipped with the reason it cannot run here."""
    import pytest

    try:
        with started as found:
            yield found
    except Unavailable as why:
        pytest.skip(f"no loopback {what} here: {why}")


@dataclass
class Cluster:
    bin_dir: Path  # holds the `ssh` wrapper: put it first on PATH
    ssh_config: Path
    port: int

    def env(self, base: dict[str, str]) -> dict[str, str]:
        return dict(base, PATH=f"{self.bin_dir}:{base.get('PATH', os.defpath)}")

    def hostfile(self, path: Path, slots: dict[str, int]) -> Path:
        path.write_text("".join(f"{host} slots={n}\n" for host, n in slots.items()))
        return path


def _missing_commands() -> list[str]:
    found = {
        name: shutil.which(name) or (SSHD if name == "sshd" and Path(SSHD).exists() else None)
        for name in PACKAGES
    }
    return [name for name, path in found.items() if path is None]


def wait_for_apt(timeout: float = 600.0) -> None:
    """Let an apt-get already running finish first (CI installs these packages in the background while
    the venv is built): a second apt-get would fail on dpkg's lock, and the first may bring what we need."""
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(
        p.info["name"] in ("apt-get", "dpkg") for p in psutil.process_iter(["name"])
    ):
        time.sleep(2)


def install_packages(wanted: list[str]) -> None:
    """Debian's packages `wanted`, with apt-get as root; Unavailable (the reason) where that cannot run."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise Unavailable(f"needs {', '.join(wanted)} (apt-get as root to install)")
    packages = sorted(set(wanted))
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *packages]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise Unavailable(f"`{' '.join(cmd)}` failed: {done.stderr.strip()[-300:]}")


@contextlib.contextmanager
def host_names(nodes: dict[str, str] = NODES, mark: str = _HOSTS_MARK) -> Iterator[None]:
    """`nodes`' names in /etc/hosts while the context lasts, on lines carrying `mark`. The loopback
    clusters of two test files may run side by side (pytest-xdist): each edits only its own lines,
    under a lock."""
    with _hosts_locked():
        original = _HOSTS_FILE.read_text()
        kept = "".join(line for line in original.splitlines(keepends=True) if mark not in line)
        _HOSTS_FILE.write_text(
            kept + "".join(f"{address} {name} {mark}\n" for name, address in nodes.items())
        )
    try:
        yield
    finally:
        with _hosts_locked():
            current = _HOSTS_FILE.read_text()
            _HOSTS_FILE.write_text("".join(ln for ln in current.splitlines(keepends=True) if mark not in ln))


@contextlib.contextmanager
def _hosts_locked() -> Iterator[None]:
    import fcntl

    with open("/tmp/llmtrain-test-hosts.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _keygen(path: Path, kind: str = "ed25519") -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", kind, "-N", "", "-f", str(path)], check=True)


def _sshd_config(root: Path, port: int) -> Path:
    config = root / "sshd_config"
    listen = "".join(f"ListenAddress {address}:{port}\n" for address in NODES.values())
    config.write_text(
        f"{listen}HostKey {root / 'host_key'}\nAuthorizedKeysFile {root / 'client_key.pub'}\n"
        f"PidFile {root / 'sshd.pid'}\nPermitRootLogin prohibit-password\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nPermitUserEnvironment no\n"
        "LogLevel ERROR\nMaxStartups 100\nMaxSessions 100\n"
    )
    return config


def _ssh_client(root: Path, port: int) -> tuple[Path, Path]:
    config = root / "ssh_config"
    config.write_text(
        f"Host {' '.join(NODES)} {' '.join(NODES.values())}\n  Port {port}\n  IdentityFile {root / 'client_key'}\n"
        "  IdentitiesOnly yes\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n"
        "  BatchMode yes\n  ConnectTimeout 10\n"
    )
    bin_dir = root / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "ssh"
    wrapper.write_text(f'#!/bin/sh\nexec {shutil.which("ssh")} -F {config} "$@"\n')
    wrapper.chmod(0o755)
    return config, bin_dir


def _wait_for_ssh(cluster: Cluster, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    env = cluster.env(dict(os.environ))
    while True:
        answers = [
            subprocess.run(["ssh", host, "true"], env=env, capture_output=True, text=True, timeout=30)
            for host in NODES
        ]
        if all(done.returncode == 0 for done in answers):
            return
        if time.monotonic() > deadline:
            raise Unavailable(f"sshd on loopback does not answer: {answers[-1].stderr.strip()[-300:]}")
        time.sleep(0.3)


@contextlib.contextmanager
def cluster(root: Path, mark: str = _HOSTS_MARK) -> Iterator[Cluster]:
    """Start the cluster under ROOT (a fresh directory); stops sshd and removes the host names after.
    Test files that run side by side each give their own `mark` (their own /etc/hosts lines)."""
    if os.geteuid() != 0:
        raise Unavailable("needs root (to add host names to /etc/hosts and start sshd)")
    wait_for_apt()
    missing = _missing_commands()
    if missing:
        install_packages([PACKAGES[m] for m in missing])
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
    _keygen(root / "host_key")
    _keygen(root / "client_key")
    port = free_port(NODES["node-a"])
    sshd = subprocess.Popen(
        [SSHD, "-D", "-e", "-f", str(_sshd_config(root, port))],
        stdout=subprocess.DEVNULL,
        stderr=open(root / "sshd.log", "wb"),  # noqa: SIM115 (sshd owns it)
        start_new_session=True,
    )
    try:
        with host_names(mark=mark):
            config, bin_dir = _ssh_client(root, port)
            found = Cluster(bin_dir=bin_dir, ssh_config=config, port=port)
            _wait_for_ssh(found)
            yield found
    finally:
        sshd.terminate()
        sshd.wait(timeout=10)


def remote_worker(run_dir: Path, rank: int) -> psutil.Process | None:
    """The worker of `run_dir` with that rank, wherever on this machine ssh started it."""
    for proc in psutil.process_iter():
        try:
            cmdline, env = proc.cmdline(), proc.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        ours = "worker" in cmdline and str(run_dir) in cmdline and "deepspeed.launcher.launch" not in cmdline
        if ours and env.get("RANK") == str(rank):
            return proc
    return None


def predicted_traffic(run_dir: Path, ranks_per_node: int) -> dict[str, int]:
    """planning.traffic's bytes per step inside and across nodes for the run's saved config."""
    from llmtrain import rundir
    from llmtrain.planning import memory, traffic

    setup = memory.setup_from_config(rundir.load_saved_config(run_dir))
    return traffic.bytes_by_span(setup, ranks_per_node)


if __name__ == "__main__":
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp, cluster(Path(tmp)) as c:
        print("PATH prefix:", c.bin_dir, "port", c.port)
        subprocess.run(["ssh", "node-b", "hostname; echo $SSH_CONNECTION"], env=c.env(dict(os.environ)))
        if len(sys.argv) > 1:
            subprocess.run(sys.argv[1:], env=c.env(dict(os.environ)))
