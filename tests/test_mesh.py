"""The layout's rank order and the mesh's groups (torch-free maths, no process group): every group of
every axis, and agreement with the topology DeepSpeed's pipeline engine builds its grid from."""

from __future__ import annotations

import pytest
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from llmtrain.errors import ConfigError
from llmtrain.parallel.mesh import describe
from llmtrain.planning.layout import Layout, check_resume


def test_rank_order_is_tp_innermost_and_pp_outermost() -> None:
    layout = Layout(16, tp=2, sp=2, pp=2)  # dp 2
    assert [tuple(layout.coordinates(r).values()) for r in (0, 1, 2, 4, 8, 15)] == [
        (0, 0, 0, 0),
        (0, 0, 0, 1),
        (0, 0, 1, 0),
        (0, 1, 0, 0),
        (1, 0, 0, 0),
        (1, 1, 1, 1),
    ]
    assert list(layout.coordinates(0)) == ["pp", "dp", "sp", "tp"]


def test_every_group_of_dp2_tp2_pp2() -> None:
    groups = describe(Layout(8, tp=2, pp=2))
    assert groups["tensor"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["data"] == groups["zero"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["pipeline"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["model"] == [[0, 1, 4, 5], [2, 3, 6, 7]]  # one replica's stages and tp ranks
    assert groups["sequence"] == [[r] for r in range(8)]


def test_zero_shards_over_data_and_sequence_ranks() -> None:
    groups = describe(Layout(8, tp=2, sp=2))  # dp 2
    assert groups["sequence"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["zero"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert groups["data"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize(("world", "tp", "pp"), [(8, 2, 2), (4, 2, 2), (8, 4, 2), (4, 1, 2)])
def test_the_pipeline_grid_deepspeed_builds_has_the_mesh_groups(world: int, tp: int, pp: int) -> None:
    layout = Layout(world, tp=tp, pp=pp)
    groups = describe(layout)
    topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=layout.dp)

    def ds(axis: str) -> list[list[int]]:
        return sorted(topology.get_axis_comm_lists(axis)) or [[r] for r in range(world)]

    assert ds("model") == sorted(groups["tensor"])
    assert ds("data") == sorted(groups["data"])
    assert ds("pipe") == sorted(groups["pipeline"])
    for rank in range(world):
        coordinates = topology.get_coord(rank)
        assert (coordinates.pipe, coordinates.data, coordinates.model) == tuple(
            layout.coordinates(rank)[axis] for axis in ("pp", "dp", "tp")
        )


@pytest.mark.parametrize(
    "flags", [{"preset": "debug"}, {"preset": "tiny", "model.tie_word_embeddings": True}]
)
def test_the_partition_spec_lists_the_models_parameters(flags: dict[str, object]) -> None:
    """planning.partition's spec is model.py's parameters, name by name and shape by shape, and its
    per-rank counts are the shards parallel.tensor keeps."""
    from llmtrain.config import resolve
    from llmtrain.model import build_model
    from llmtrain.planning import partition
    from llmtrain.presets import count_parameters

    cfg = resolve(flags=flags).model
    model = build_model(cfg, "meta")
    specs = partition.tensors(cfg)
    assert [(s.name, s.shape) for s in specs] == [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert sum(s.numel for s in specs) == count_parameters(**vars(cfg))
    for spec in specs:
        if spec.tp_dim is not None:
            assert spec.per_rank(2) * 2 == spec.numel and spec.shape[spec.tp_dim] % 2 == 0
    assert partition.block_parameters(cfg) == sum(s.numel for s in specs if s.block == 0)


@pytest.mark.parametrize(
    ("tp", "sp", "pp", "stage"), [(2, 1, 1, 1), (2, 1, 2, 1), (1, 2, 1, 3), (1, 1, 2, 1)]
)
def test_another_data_parallel_size_resumes_through_the_universal_format(
    tp: int, sp: int, pp: int, stage: int
) -> None:
    """Another world size changes dp, which the universal conversion re-partitions (tested end to end
    for dp 2 x tp 2 x pp 2 -> tp 2 x pp 2 in test_pipeline)."""
    check_resume(
        Layout(tp * sp * pp, tp, sp, pp),
        Layout(2 * tp * sp * pp, tp, sp, pp),
        stage,
        True,
        4,
        engine="deepspeed",
    )


@pytest.mark.parametrize(("saved", "now"), [(Layout(8, 2, 1, 2), Layout(4)), (Layout(4), Layout(4, pp=2))])
def test_other_tp_and_pp_degrees_resume_from_sharded_optimizer_state(saved: Layout, now: Layout) -> None:
    """(dp 2 x tp 2 x pp 2 -> dp 4 is run end to end in test_pipeline.)"""
    check_resume(now, saved, 1, partitioned=True, kv_heads=4, engine="deepspeed")
    with pytest.raises(ConfigError, match=r"^--tp/--pp: this run was saved on .* \(--tp \d --pp \d\)$"):
        check_resume(now, saved, 0, partitioned=False, kv_heads=4, engine="deepspeed")


def test_a_tp_run_at_zero_3_resumes_on_its_own_layout_only() -> None:
    with pytest.raises(ConfigError, match=r"--gpus: this run was saved on 4 processes \(dp 2 x tp 2\); "):
        check_resume(Layout(2, tp=2), Layout(4, tp=2), 3, True, 4, engine="deepspeed")
    with pytest.raises(ConfigError, match=r"with --tp 2 --pp 1$"):
        check_resume(Layout(4), Layout(4, tp=2), 3, True, 4, engine="deepspeed")
    check_resume(Layout(4, tp=2), Layout(4, tp=2), 3, True, 4, engine="deepspeed")
    check_resume(
        Layout(2), Layout(4), 3, True, 4, engine="deepspeed"
    )  # without tp ZeRO 3 re-partitions like the others


def test_an_fsdp2_run_resumes_on_any_world_size_and_tp() -> None:
    """DCP holds every tensor whole: what DeepSpeed's checkpoints refuse, FSDP2's load (tp 2 -> 1 run
    end to end in test_train_dist)."""
    check_resume(Layout(2), Layout(4, tp=2), 3, False, 4, engine="fsdp2")
    check_resume(Layout(4, tp=4), Layout(2, tp=2), 3, False, 4, engine="fsdp2")


def test_key_value_head_copies_resume_on_their_own_tp_only() -> None:
    """At tp 4 with 2 key/value heads each head is held twice; another world size at the same tp
    re-partitions (the copies are merged and cut again alike), another tp does not."""
    check_resume(Layout(4, tp=4), Layout(8, tp=4), 1, True, 2, engine="deepspeed")
    with pytest.raises(ConfigError, match=r"^--tp: .* resume with --tp 4$"):
        check_resume(Layout(4, tp=2), Layout(4, tp=4), 1, True, 2, engine="deepspeed")
    with pytest.raises(ConfigError, match=r"^--tp: .* resume with --tp 2$"):
        check_resume(Layout(4, tp=4), Layout(4, tp=2), 1, True, 2, engine="deepspeed")
