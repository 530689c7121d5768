"""How DeepSpeed's ops are built and loaded by every process: with the venv's ninja whatever PATH the
process started with (two ninja versions rebuild each other's ops), and DeepSpeed's Muon module imported
without pulling in TorchInductor, while llmtrain's own torch.compile still compiles. Each check runs in a
fresh interpreter (about 5 s), since both concern what a process does at start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

VENV_BIN = Path(sys.executable).parent


def _run(code: str, env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


@pytest.mark.skipif(not (VENV_BIN / "ninja").exists(), reason="no ninja beside this interpreter")
def test_a_process_started_without_the_venv_on_path_builds_with_the_venvs_ninja() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    env["PATH"] = "/usr/bin:/bin"  # where Debian's ninja would be found first
    found = _run("import llmtrain, shutil; print(shutil.which('ninja'))", env)
    assert Path(found) == VENV_BIN / "ninja"


def test_deepspeeds_muon_is_imported_without_inductor_and_compile_still_works() -> None:
    code = (
        "import os, sys, torch\n"
        "from llmtrain.engine.ds_engine import _import_deepspeed_muon_uncompiled\n"
        "_import_deepspeed_muon_uncompiled()\n"
        "assert 'deepspeed.runtime.zero.muon.muon_optimizer' in sys.modules\n"
        "assert 'torch._inductor.compile_fx' not in sys.modules, 'TorchInductor was imported'\n"
        "assert 'TORCHDYNAMO_DISABLE' not in os.environ\n"
        "compiled = torch.compile(lambda x: x * 2)\n"
        "assert hasattr(compiled, '_torchdynamo_orig_callable'), 'torch.compile became a no-op'\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCHDYNAMO_DISABLE"}
    env["DS_ACCELERATOR"] = "cpu"
    assert _run(code, env) == "ok"


def test_an_architecture_specific_cuda_arch_list_is_read_by_deepspeeds_jit_builder() -> None:
    """TORCH_CUDA_ARCH_LIST="9.0a" (set by CUDA images for Hopper) stopped DeepSpeed's FusedAdam build with
    a ValueError. After `import llmtrain` its JIT builder reads the list (and hands torch the archs to build)."""
    code = (
        "import os, llmtrain\n"
        "from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder\n"
        "print(os.environ['TORCH_CUDA_ARCH_LIST'])\n"
        "builder = FusedAdamBuilder()\n"
        "builder.jit_mode = True\n"
        "builder.compute_capability_args()\n"
        "print(os.environ['TORCH_CUDA_ARCH_LIST'])\n"
    )
    env = {**os.environ, "TORCH_CUDA_ARCH_LIST": "8.0 9.0a;9.0;10.0f+PTX", "DS_ACCELERATOR": "cuda"}
    assert _run(code, env).split() == ["8.0;9.0;10.0+PTX", "8.0;9.0;10.0+PTX"]
