"""world = pp x dp x sp x tp: which rank holds which part of the model and which samples.

Rank r = ((p * dp + d) * sp + s) * tp + t for pipeline stage p, data-parallel index d, sequence-parallel
index s and tensor-parallel index t: tensor parallelism innermost, as Megatron and DeepSpeed place it
(its all-reduces run in every layer, so its ranks should be the closest ones: one node, NVLink), and
pipeline stages outermost, as DeepSpeed's pipeline topology numbers them (a stage boundary carries one
activation per micro-batch, the cheapest traffic to put across nodes). At most one of tp, sp and pp is
above 1 (rules.RULES), so a rank's tp or sp group is `tp * sp` consecutive ranks.

- Data: the ranks of one model-parallel group read the same samples. The loader's rank is d and its
  world dp; tp ranks compute on identical inputs (DeepSpeed checks it on the first batch), sp ranks
  each keep their slice of the same sequences (the model cuts it: `Llama.set_sequence_parallel`).
- DeepSpeed: the groups reach `deepspeed.initialize` as its `mpu` argument. For tp that is DeepSpeed's
  own (dp, tp) mesh (`deepspeed.utils.groups`, which AutoTP partitions over in any case); for sp,
  DeepSpeed's Ulysses groups (`parallel_state_sp`): ZeRO then shards and reduces over the dp x sp
  ranks and divides by dp only, so the sp ranks' partial gradients add up. Without an mpu, DeepSpeed
  skips the gradient synchronisation of sp ranks and counts tp ranks as data-parallel ones.
- Pipeline: the first and last stages of each pipeline read the samples of data rank d (the first
  the inputs, the last the labels); DeepSpeed's PipelineModule builds the (pipe, data) grid itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmtrain.errors import ConfigError
from llmtrain.flags import flag_for


@dataclass(frozen=True)
class Layout:
    world_size: int
    tp: int = 1
    sp: int = 1
    pp: int = 1

    @property
    def model_parallel(self) -> int:
        """Ranks that hold parts of one model replica."""
        return self.tp * self.sp * self.pp

    @property
    def dp(self) -> int:
        return self.world_size // self.model_parallel

    def data_rank(self, rank: int) -> int:
        return (rank % (self.dp * self.tp * self.sp)) // (self.tp * self.sp)

    def stage(self, rank: int) -> int:
        """The pipeline stage of `rank` (0 without pipeline parallelism)."""
        return rank // (self.dp * self.tp * self.sp)

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def sp_rank(self, rank: int) -> int:
        return (rank // self.tp) % self.sp

    def describe(self) -> str:
        """`dp 2 x tp 2`: the degrees above 1 (dp always)."""
        axes = (("pp", self.pp), ("tp", self.tp), ("sp", self.sp))
        parts = [f"dp {self.dp}"] + [f"{n} {d}" for n, d in axes if d > 1]
        return " x ".join(parts)

    def groups(self) -> str:
        """The model-parallel groups by rank, as DeepSpeed is given them: `tp groups [0, 1] [2, 3]`,
        or a pipeline's stages: `pp groups [0, 2] [1, 3]`."""
        if self.pp > 1:
            pipes = [list(range(d, self.world_size, self.dp)) for d in range(self.dp)]
            return "pp groups " + " ".join(str(r) for r in pipes)
        axis = "tp" if self.tp > 1 else "sp"
        size = self.model_parallel
        ranks = [list(range(start, start + size)) for start in range(0, self.world_size, size)]
        return f"{axis} groups " + " ".join(str(r) for r in ranks)


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{flag_for(key)}: {message}")


def check_shape(
    layout: Layout, *, heads: int, kv_heads: int, mlp_width: int, seq_len: int, layers: int
) -> None:
    """What DeepSpeed cannot split of this model and sequence length: a one-line error naming the flag,
    before any process starts (config.check_layout passes the config's numbers)."""
    for key, degree in (("parallel.tp", layout.tp), ("parallel.sp", layout.sp), ("parallel.pp", layout.pp)):
        _require(degree >= 1, key, f"must be at least 1, got {degree}")
    axis = "parallel.pp" if layout.pp > 1 else "parallel.tp" if layout.tp > 1 else "parallel.sp"
    _require(
        layout.world_size % layout.model_parallel == 0,
        axis,
        f"tp {layout.tp} x sp {layout.sp} x pp {layout.pp} = {layout.model_parallel} does not divide the "
        f"world size {layout.world_size} (--gpus x --nodes); use a divisor of it",
    )
    # Every stage runs at least one block: the embedding and the output layer ride with the first and last.
    _require(
        layout.pp <= layers,
        "parallel.pp",
        f"{layout.pp} stages for {layers} transformer blocks; use at most {layers} stages",
    )
    for key, degree, what in (("parallel.tp", layout.tp, "tp"), ("parallel.sp", layout.sp, "sp")):
        if degree == 1:
            continue
        # Heads are split whole, and each rank's query heads must share its key/value heads.
        for count, name in ((heads, "attention heads"), (kv_heads, "key/value heads")):
            _require(count % degree == 0, key, f"{count} {name} are not divisible by {what} {degree}")
    if layout.tp > 1:
        _require(
            mlp_width % layout.tp == 0,
            "parallel.tp",
            f"MLP width {mlp_width} is not divisible by tp {layout.tp}",
        )
    if layout.sp > 1:
        _require(
            seq_len % layout.sp == 0,
            "parallel.sp",
            f"--seq-len {seq_len} is not divisible by sp {layout.sp}; each rank holds an equal slice",
        )


def process_groups(layout: Layout) -> Any:
    """The `mpu` object `deepspeed.initialize` takes for this layout (None for data parallelism alone).

    Built once per process: DeepSpeed keeps these groups in module globals.
    """
    if layout.model_parallel > 1:
        _adopt_process_group()
    if layout.tp > 1:
        from deepspeed.utils import groups

        groups._init_tp_mesh_device(tensor_model_parallel_size=layout.tp)  # no-op when already built
        _check_same_size(groups.get_tensor_model_parallel_world_size(), layout.tp, "tensor")
        return groups
    if layout.sp > 1:
        from deepspeed.runtime.sequence_parallel import parallel_state_sp as sp_state

        if sp_state._SEQUENCE_PARALLEL_GROUP is None:
            sp_state.initialize_sequence_parallel(layout.sp)
        _check_same_size(sp_state.get_sequence_parallel_world_size(), layout.sp, "sequence")
        return sp_state
    return None


def _adopt_process_group() -> None:
    """DeepSpeed's communication layer over torch's process group, when it was made without
    `deepspeed.init_distributed` (its group builders below go through that layer)."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed import comm

    if not comm.is_initialized():
        deepspeed.init_distributed(dist_backend=dist.get_backend())


def _check_same_size(built: int, wanted: int, axis: str) -> None:
    if built != wanted:  # one process runs one layout: DeepSpeed's groups cannot be rebuilt
        raise RuntimeError(f"this process already has {axis}-parallel groups of {built} ranks, not {wanted}")


def check_resume(layout: Layout, saved_world_size: int) -> None:
    """A tp, sp or pp checkpoint holds per-rank model slices (or stages) and ZeRO shards of its own
    layout; DeepSpeed's universal conversion re-partitions data-parallel shards only, so such a run
    resumes as it was saved. (The degrees themselves are part of the run's config, which a resume keeps.)"""
    if layout.model_parallel == 1 or saved_world_size == layout.world_size:
        return
    saved = Layout(saved_world_size, layout.tp, layout.sp, layout.pp)
    raise ConfigError(
        f"{flag_for('launch.gpus')}: this run was saved on {saved_world_size} processes ({saved.describe()}); "
        f"a tensor-, sequence- or pipeline-parallel checkpoint resumes on the same layout: launch "
        f"{saved_world_size} processes (--gpus x --nodes)"
    )
