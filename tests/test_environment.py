"""The environment a run (and every results file) records: versions, commit, and the machine facts a speed
figure depends on (CPU model, its bf16/AMX flags, the kernel caps in force, cores, memory)."""

from __future__ import annotations

import pytest

from llmtrain import rundir


def test_the_machine_facts_are_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    env = rundir.environment(1)
    assert env["cpu_model"]  # /proc/cpuinfo's model name
    assert set(env["cpu_flags"]) <= set(rundir.MATMUL_FLAGS)
    assert env["cpu_capability"] in {"DEFAULT", "AVX2", "AVX512", "ZVECTOR", "VSX", "SVE256"}
    assert env["cpu_count"] >= 1 and env["memory_bytes"] > 2**30
    assert (
        env["kernel_caps"]["ONEDNN_MAX_CPU_ISA"] == "AVX2" and "ATEN_CPU_CAPABILITY" not in env["kernel_caps"]
    )
    assert len(env["git_sha"]) == 40 and isinstance(env["git_clean"], bool)  # tests run in a checkout
