"""world = pp x dp x sp x tp: which rank holds which part of the model and which samples.

Rank r = ((p * dp + d) * sp + s) * tp + t for pipeline stage p, data-parallel index d, sequence-parallel
index s and tensor-parallel index t: tensor parallelism innermost, as Megatron and DeepSpeed place it
(its all-reduces run in every layer, so its ranks should be the closest ones: one node, NVLink), and
pipeline stages outermost, as DeepSpeed's pipeline topology numbers them (a stage boundary carries one
activation per micro-batch, the cheapest traffic to put across nodes). `groups_along` lists the groups of
any set of axes; parallel.mesh builds the process groups from it.

- Data: the ranks of one model-parallel group read the same samples. The loader's rank is d and its
  world dp; tp ranks compute on identical inputs, sp ranks each keep their slice of the same sequences
  (the model cuts it: `Llama.set_sequence_parallel`).
- DeepSpeed: the groups reach `deepspeed.initialize` as its `mpu` argument (parallel.mesh): ZeRO shards
  and reduces over the dp x sp ranks and divides by dp only, so the sp ranks' partial gradients add up;
  the gradient norm sums over the model group. Without an mpu, DeepSpeed skips the gradient
  synchronisation of sp ranks and counts tp ranks as data-parallel ones.
- Pipeline: the first and last stages of each pipeline read the samples of data rank d (the first
  the inputs, the last the labels); DeepSpeed's PipelineModule builds the (pipe, data) grid itself.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    def sizes(self) -> dict[str, int]:
        """Each axis's degree, outermost first (the rank order)."""
        return {"pp": self.pp, "dp": self.dp, "sp": self.sp, "tp": self.tp}

    def coordinates(self, rank: int) -> dict[str, int]:
        """`rank`'s index along each axis: {"pp": p, "dp": d, "sp": s, "tp": t}."""
        out: dict[str, int] = {}
        for axis, size in reversed(self.sizes().items()):  # innermost first
            rank, out[axis] = divmod(rank, size)
        return {axis: out[axis] for axis in self.sizes()}

    def groups_along(self, axes: tuple[str, ...]) -> list[list[int]]:
        """Every group of ranks that differ only along `axes` (each group in rank order): ("tp",) gives the
        tensor-parallel groups, ("dp", "sp") ZeRO's."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            fixed = tuple(i for axis, i in self.coordinates(rank).items() if axis not in axes)
            groups.setdefault(fixed, []).append(rank)
        return list(groups.values())

    def data_rank(self, rank: int) -> int:
        return self.coordinates(rank)["dp"]

    def describe(self) -> str:
        """`dp 2 x tp 2`: the degrees above 1 (dp always)."""
        axes = (("pp", self.pp), ("tp", self.tp), ("sp", self.sp))
        parts = [f"dp {self.dp}"] + [f"{n} {d}" for n, d in axes if d > 1]
        return " x ".join(parts)

    def groups(self) -> str:
        """The groups of each axis above 1 by rank, model-parallel axes first, as the mesh builds them:
        `tp groups [0, 1] [2, 3]; dp groups [0, 2] [1, 3]`."""
        sizes = self.sizes()
        return "; ".join(
            f"{axis} groups " + " ".join(str(group) for group in self.groups_along((axis,)))
            for axis in ("tp", "sp", "pp", "dp")
            if sizes[axis] > 1
        )


def _fsdp_shard_ranks(dp: int, dp_shard: int | None, ranks_per_node: int) -> int:
    """The data-parallel ranks FSDP2 shards each parameter over (HSDP replicates across dp / that many
    groups): `--dp-shard` when given, else one node's ranks when the ranks span several nodes of equal
    size (the gathers and reduce-scatters stay inside the node; only an all-reduce of the gradient shard
    crosses), else all of them."""
    if dp_shard is not None:
        _require(dp_shard >= 1, "parallel.dp_shard", f"must be at least 1, got {dp_shard}")
        _require(
            dp % dp_shard == 0,
            "parallel.dp_shard",
            f"{dp_shard} does not divide the {dp} data-parallel ranks (--gpus x --nodes / --tp); use a divisor "
            "of it (--dp-shard with the ranks of one node shards inside each node)",
        )
        return dp_shard
    if 1 < ranks_per_node < dp and dp % ranks_per_node == 0:
        return ranks_per_node
    return dp


def fsdp_mesh(layout: Layout, dp_shard: int | None, ranks_per_node: int) -> dict[str, int]:
    """FSDP2's device mesh, outermost dimension first: {"replicate": R, "shard": S, "tp": T}, R x S = dp
    (HSDP when R > 1). tp is innermost (a node of N ranks holds N / tp data-parallel ones)."""
    node_dp = ranks_per_node // layout.tp if ranks_per_node % layout.tp == 0 else 1
    shard = _fsdp_shard_ranks(layout.dp, dp_shard, node_dp)
    return {"replicate": layout.dp // shard, "shard": shard, "tp": layout.tp}


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{flag_for(key)}: {message}")


def check_shape(
    layout: Layout, *, heads: int, kv_heads: int, mlp_width: int, vocab: int, seq_len: int, layers: int
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
    # Heads are split whole, and each rank's query heads must share its key/value heads: tp splits
    # them first, then Ulysses' all-to-all splits each tp rank's heads over sp. With more tp ranks than
    # key/value heads, each is replicated over tp / kv_heads ranks (planning.partition's rule).
    splits = [("parallel.tp", layout.tp, f"tp {layout.tp}"), ("parallel.sp", layout.sp, f"sp {layout.sp}")]
    if layout.tp > 1 and layout.sp > 1:
        splits.append(("parallel.sp", layout.tp * layout.sp, f"tp {layout.tp} x sp {layout.sp}"))
    for key, degree, what in splits:
        if degree == 1:
            continue
        _require(heads % degree == 0, key, f"{heads} attention heads are not divisible by {what}")
        if key == "parallel.tp" and degree > kv_heads:
            _require(
                degree % kv_heads == 0,
                key,
                f"tp {degree} is more than the {kv_heads} key/value heads and not a multiple of them "
                f"(each would be replicated over tp / {kv_heads} ranks); use a divisor or a multiple of {kv_heads}",
            )
            continue
        _require(kv_heads % degree == 0, key, f"{kv_heads} key/value heads are not divisible by {what}")
    if layout.tp > 1:
        _require(
            mlp_width % layout.tp == 0,
            "parallel.tp",
            f"MLP width {mlp_width} is not divisible by tp {layout.tp}",
        )
        # The embedding and the output layer are split by vocabulary, in equal blocks of token rows.
        _require(
            vocab % layout.tp == 0,
            "parallel.tp",
            f"vocabulary size {vocab} is not divisible by tp {layout.tp}; pad it (--set "
            f"model.vocab_size=...) to a multiple of {layout.tp}",
        )
    if layout.sp > 1:
        _require(
            seq_len % layout.sp == 0,
            "parallel.sp",
            f"--seq-len {seq_len} is not divisible by sp {layout.sp}; each rank holds an equal slice",
        )


def check_resume(
    layout: Layout, saved: Layout, zero_stage: int, partitioned: bool, kv_heads: int, *, engine: str
) -> None:
    """A resume may change the world size and the tp degree of an FSDP2 run (`engine`): its distributed
    checkpoint holds every tensor as one global tensor, which DCP slices for any layout on load.
    On DeepSpeed it keeps the run's sp degree and may change its world size and its tp and pp degrees:
    DeepSpeed's universal conversion re-partitions the ZeRO shards over the new data-parallel ranks,
    merging each tensor's tp slices by the split the checkpoint records and slicing them again on load
    (checkpoint.universal). Three cases it cannot carry: a checkpoint without sharded optimizer state
    (ZeRO 0 in fp32, nothing to convert) on other tp / pp degrees; another tp degree where either layout
    holds copies of key/value heads (tp > kv_heads: the conversion would concatenate the copies as if
    they were distinct heads); and tensor parallelism at ZeRO 3 on any other layout (DeepSpeed 0.19.8's
    ZeRO 3 conversion does not merge tp slices; measured: the load fails on a slice's bounds)."""
    if saved == layout or engine == "fsdp2":
        return
    was = f"this run was saved on {saved.world_size} processes ({saved.describe()})"
    if not partitioned and (saved.tp, saved.pp) != (layout.tp, layout.pp):
        raise ConfigError(
            f"{flag_for('parallel.tp')}/{flag_for('parallel.pp')}: {was}; a checkpoint without sharded "
            f"optimizer state (ZeRO 0 in fp32) resumes with the tp and pp it was saved with "
            f"(--tp {saved.tp} --pp {saved.pp})"
        )
    if saved.tp != layout.tp and max(saved.tp, layout.tp) > kv_heads:
        raise ConfigError(
            f"{flag_for('parallel.tp')}: {was}; with more tp ranks than the {kv_heads} key/value heads each "
            f"head is held in copies, which the universal conversion cannot re-partition: resume with --tp {saved.tp}"
        )
    if zero_stage == 3 and max(saved.tp, layout.tp) > 1:
        raise ConfigError(
            f"{flag_for('launch.gpus')}: {was}; a tensor-parallel run at ZeRO 3 resumes on the same layout "
            f"(DeepSpeed's ZeRO-3 universal conversion does not merge tp slices): launch {saved.world_size} "
            f"processes (--gpus x --nodes) with --tp {saved.tp} --pp {saved.pp}"
        )
