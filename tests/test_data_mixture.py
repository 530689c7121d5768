"""Data mixtures, in process: the deficit rule, the mixture loader (world-size independence, exact
resume, exhaustion, new weights), the shared tokenizer, the config key and the refusals of bad input.

The training runs (per-source counts in metrics.jsonl, SIGKILL and resume, a fork with new weights)
are in tests/test_data_mixture_run.py.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from llmtrain import cli
from llmtrain import config as config_mod
from llmtrain.config import ConfigError, DataConfig, MixtureSource
from llmtrain.data import prepare as prep
from llmtrain.data import tokenizer as toks
from llmtrain.data.blend import MixtureLoader, pick_sources
from llmtrain.data.mixture import MixturePart, prepare_mixture, source_names

SEQ = 16


def _jsonl(path: Path, words: list[str], docs: int, seed: int) -> Path:
    rng = random.Random(seed)
    lines = [
        json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(10, 40)))})
        for _ in range(docs)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("mixture")
    return {
        "big": _jsonl(tmp / "big.jsonl", [f"w{i}" for i in range(40)], 120, 0),
        "small": _jsonl(tmp / "small" / "part.jsonl", ["red", "green", "blue", "cyan"], 8, 1).parent,
        "cache": tmp / "cache",
    }


@pytest.fixture(scope="module")
def parts(sources: dict[str, Path]) -> list[MixturePart]:
    data = DataConfig(
        mixture=[MixtureSource(str(sources["big"]), 3.0), MixtureSource(str(sources["small"]), 1.0)],
        cache_dir=str(sources["cache"]),
        val_fraction=0.1,
        num_proc=1,
    )
    return prepare_mixture(data, 512)


def _loader(parts: list[MixturePart], **kw: object) -> MixtureLoader:
    args: dict = {"seq_len": SEQ, "micro_batch": 2, "global_batch": 8, "seed": 5, **kw}
    return MixtureLoader(parts, **args)


def _global_batch(loaders: list[MixtureLoader]) -> torch.Tensor:
    """One optimizer step of every rank, micro-batches in order, ranks in order: [G, SEQ]."""
    return torch.cat([b["input_ids"] for ld in loaders for b in ld.next_step()])


# ---------------------------------------------------------------- the deficit rule


@pytest.mark.parametrize("weights", [[0.8, 0.2], [0.5, 0.3, 0.2], [0.97, 0.02, 0.01], [1 / 3] * 3])
def test_every_source_stays_within_one_sequence_of_its_weight(weights: list[float]) -> None:
    picks = pick_sources(weights, [0] * len(weights), 2000)
    counts = np.zeros(len(weights))
    for n, pick in enumerate(picks, 1):
        counts[pick] += 1
        assert np.all(np.abs(counts - np.array(weights) * n) <= 1.0), (n, counts)


def test_ties_go_to_the_lower_index_and_the_rule_continues_from_counts() -> None:
    assert pick_sources([0.5, 0.5], [0, 0], 6) == [0, 1, 0, 1, 0, 1]
    assert pick_sources([1 / 3] * 3, [0, 0, 0], 6) == [0, 1, 2, 0, 1, 2]
    assert pick_sources([0.8, 0.2], [0, 0], 10) == [0, 0, 1, 0, 0, 0, 0, 1, 0, 0]  # by hand from the rule
    whole = pick_sources([0.6, 0.4], [0, 0], 50)
    first = whole[:17]
    assert first + pick_sources([0.6, 0.4], [first.count(0), first.count(1)], 33) == whole


# ---------------------------------------------------------------- the loader


def test_the_union_of_ranks_is_the_one_rank_global_batch(parts: list[MixturePart]) -> None:
    one = _loader(parts, micro_batch=8)
    accumulating = _loader(parts, micro_batch=2)
    two = [_loader(parts, rank=r, world_size=2) for r in range(2)]
    four = [_loader(parts, micro_batch=1, rank=r, world_size=4) for r in range(4)]
    for _ in range(12):  # past the small source's first epoch
        reference = _global_batch([one])
        for ranks in ([accumulating], two, four):
            assert torch.equal(_global_batch(ranks), reference)
    assert one.source_stats()["small"]["epoch"] >= 2


def test_counts_follow_the_weights_and_the_state_resumes_exactly(parts: list[MixturePart]) -> None:
    run = _loader(parts)
    for _ in range(6):
        run.next_step()
    state = json.loads(json.dumps(run.state_dict()))  # plain data
    expected = [_global_batch([run]) for _ in range(5)]
    resumed = [_loader(parts, rank=r, world_size=2) for r in range(2)]  # another world size
    for loader in resumed:
        loader.load_state_dict(state)
    for reference in [*expected, _global_batch([run])]:
        assert torch.equal(_global_batch(resumed), reference)
    stats = run.source_stats()
    assert {name: s["tokens"] for name, s in stats.items()} == {
        "big": 12 * 8 * SEQ * 3 // 4,
        "small": 12 * 8 * SEQ // 4,
    }


def test_a_small_source_is_repeated_with_a_new_permutation_and_reported(parts: list[MixturePart]) -> None:
    loader = _loader(parts, global_batch=4, micro_batch=4)
    small = loader.sizes[1]
    seen: list[int] = []
    notices: list[str] = []
    while len(seen) < 2 * small:
        slots, _, _ = loader.plan_step(loader.cursors)
        seen += [seq for source, seq in slots if source == 1]
        loader.next_step()
        notices += loader.take_notices()
    assert sorted(seen[:small]) == list(range(small)), "the first epoch visits every sequence once"
    assert sorted(seen[small : 2 * small]) == list(range(small))
    assert seen[:small] != seen[small : 2 * small], "the second epoch has its own order"
    assert len(notices) == 1 + (len(seen) > 2 * small)
    assert notices[0].startswith(f"data source small exhausted after {small * SEQ:,} tokens at step ")
    assert notices[0].endswith("; repeating it (epoch 2)")


def test_new_weights_restart_the_deficit_rule_and_are_reported(parts: list[MixturePart]) -> None:
    run = _loader(parts)
    for _ in range(5):
        run.next_step()
    state = run.state_dict()
    even = [MixturePart(p.name, p.source, 0.5, p.prepared) for p in parts]
    forked = _loader(even)
    forked.load_state_dict(state)
    assert forked.take_notices() == [
        "data mixture weights changed (big 0.75 -> 0.5, small 0.25 -> 0.5); drawn by the new weights from step 6"
    ]
    slots, _, _ = forked.plan_step(forked.cursors)
    assert [source for source, _ in slots] == [0, 1] * 4, "no catch-up burst: the new weights hold at once"
    before = forked.source_stats()
    forked.next_step()
    after = forked.source_stats()
    assert {n: after[n]["tokens"] - before[n]["tokens"] for n in after} == {"big": 4 * SEQ, "small": 4 * SEQ}


def test_a_checkpoint_of_other_sources_is_refused(parts: list[MixturePart]) -> None:
    state = _loader(parts).state_dict()
    state["sources"] = state["sources"][::-1]
    with pytest.raises(ConfigError, match="resume with the same sources"):
        _loader(parts).load_state_dict(state)
    with pytest.raises(ConfigError, match="reading one source"):
        _loader(parts).load_state_dict({"epoch": 0, "step_in_epoch": 0})


# ---------------------------------------------------------------- sources: names, one tokenizer


def test_names_are_short_and_unique() -> None:
    entries = [
        MixtureSource(s, 1.0) for s in ("data/a.jsonl", "docs/", "other/a.jsonl", "corpus/*.txt", "owner/web")
    ]
    assert source_names(entries) == ["a", "docs", "a-2", "corpus", "web"]


def test_all_sources_share_one_tokenizer_trained_on_all_of_them(
    parts: list[MixturePart], sources: dict[str, Path]
) -> None:
    hashes = {p.prepared.manifest.tokenizer_hash for p in parts}
    assert len(hashes) == 1
    tokenizers = list((sources["cache"] / "tokenizers").iterdir())
    assert [t.name.startswith("mixture-") for t in tokenizers] == [True]
    vocab = toks.load_tokenizer(tokenizers[0]).get_vocab()
    assert {"Ġred", "Ġw"} <= set(vocab), "learned from both sources"
    data = DataConfig(
        mixture=[MixtureSource(str(sources["big"]), 1.0), MixtureSource(str(sources["small"]), 1.0)],
        cache_dir=str(sources["cache"]),
        val_fraction=0.1,
        num_proc=1,
    )
    assert all(p.prepared.reused for p in prepare_mixture(data, 512)), "other weights, the same shards"


def test_a_prepared_directory_with_another_tokenizer_is_refused(
    parts: list[MixturePart], sources: dict[str, Path], tmp_path: Path
) -> None:
    # `parts` trains the mixture's tokenizer into the cache: the --tokenizer this refusal is measured against.
    toks.train_tokenizer(["alpha beta gamma"] * 20, 300, tmp_path / "other.json")
    prep.prepare_data(str(sources["small"]), tmp_path / "other.json", tmp_path / "prepared", val_fraction=0.0)
    data = DataConfig(
        mixture=[MixtureSource(str(sources["big"]), 1.0), MixtureSource(str(tmp_path / "prepared"), 1.0)],
        cache_dir=str(sources["cache"]),
        tokenizer=str(
            Path(sources["cache"]) / "tokenizers" / next((sources["cache"] / "tokenizers").iterdir()).name
        ),
    )
    with pytest.raises(
        ConfigError, match=r"^--data .*prepared: prepared with another tokenizer than --tokenizer"
    ):
        prepare_mixture(data, 512)


# ---------------------------------------------------------------- the config key and the flag


def test_the_flag_and_the_yaml_key_give_the_same_config(tmp_path: Path) -> None:
    from_flag = config_mod.resolve(flags={"data.source": ["a.jsonl:0.7", "docs/:0.3"]})
    path = tmp_path / "mix.yaml"
    path.write_text(
        "data:\n  mixture:\n    - {source: a.jsonl, weight: 0.7}\n    - {source: docs/, weight: 0.3}\n"
    )
    from_file = config_mod.resolve(path)
    assert (
        from_flag.data.mixture
        == from_file.data.mixture
        == [MixtureSource("a.jsonl", 0.7), MixtureSource("docs/", 0.3)]
    )
    reloaded = config_mod.from_dict(yaml.safe_load(config_mod.dump_yaml(from_file)))
    assert reloaded.data.mixture == from_file.data.mixture and reloaded.data.source is None
    one = config_mod.resolve(flags={"data.source": ["a.jsonl"]})
    assert (one.data.source, one.data.mixture) == ("a.jsonl", None), "one --data is a source, as before"


def test_list_keys_documents_the_mixture(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["config", "--list-keys"]) == 0
    out = capsys.readouterr().out
    assert "data.mixture: a list of {source, weight} or none = None\n" in out
    assert "--data SOURCE:WEIGHT repeated" in out


def _refusal(capsys: pytest.CaptureFixture[str], args: list[str]) -> str:
    capsys.readouterr()
    code = cli.main(args)
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in out + err, (code, out, err)
    return errors[0]


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (["a.jsonl:0"], "error: --data a.jsonl:0: a weight must be a positive number"),
        (["a.jsonl:-0.5"], "error: --data a.jsonl:-0.5: a weight must be a positive number"),
        (["a.jsonl:heavy"], "error: --data a.jsonl:heavy: 'heavy' is not a weight"),
        (["a.jsonl", "b.jsonl:0.5"], "error: --data a.jsonl: every source of a mixture needs a weight"),
        (["{w}/missing.jsonl:0.5", "{w}/big.jsonl:0.5"], "error: --data {w}/missing.jsonl: file not found"),
    ],
)
def test_bad_mixtures_are_refused_in_one_line(
    capsys: pytest.CaptureFixture[str], sources: dict[str, Path], tmp_path: Path, data: list[str], needle: str
) -> None:
    workdir = str(sources["big"].parent)
    run_dir = tmp_path / "run"
    flags = [item for value in data for item in ("--data", value.replace("{w}", workdir))]
    line = _refusal(capsys, ["train", "--preset", "debug", "--steps", "2", "--run-dir", str(run_dir), *flags])
    assert line.startswith(needle.replace("{w}", workdir)), line
    assert not run_dir.exists(), "nothing left on disk"


def test_a_source_and_a_mixture_together_are_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "mix.yaml"
    path.write_text("data:\n  mixture:\n    - {source: a.jsonl, weight: 1}\n")
    line = _refusal(capsys, ["config", "--config", str(path), "--data", "b.jsonl"])
    assert line.startswith("error: --data b.jsonl: a run reads one source (--data SOURCE) or a mixture"), line
    line = _refusal(capsys, ["config", "--set", "data.mixture=a.jsonl:1"])
    assert line.startswith("error: --set: data.mixture is a list: write it in the --config YAML"), line
    path.write_text("data:\n  mixture:\n    - {source: a.jsonl, weight: heavy}\n")
    line = _refusal(capsys, ["config", "--config", str(path)])
    assert line.startswith(f"error: --config {path}: data.mixture must be a list of {{source, weight}}"), line
