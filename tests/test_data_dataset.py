"""The training stream: packing without padding, global-unit sampler, resumable state, validation."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from llmtrain.config import ConfigError
from llmtrain.data import prepare as prep
from llmtrain.data import shards
from llmtrain.data import tokenizer as toks
from llmtrain.data.dataset import EpochPermutation, TrainLoader, val_batches

SEQ = 16
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> shards.PreparedData:
    tmp = tmp_path_factory.mktemp("stream")
    rng = random.Random(0)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60))) for _ in range(120)]
    (tmp / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    toks.train_tokenizer(docs, 300, tmp / "tok.json")
    prep.prepare_data(str(tmp / "d.jsonl"), tmp / "tok.json", tmp / "out", val_fraction=0.1, split_seed=0)
    return shards.open_prepared(tmp / "out")


def loader(prepared: shards.PreparedData, **kw) -> TrainLoader:
    args = {"seq_len": SEQ, "micro_batch": 2, "global_batch": 8, "seed": 3, **kw}
    return TrainLoader(prepared, **args)


def global_batch_tokens(loaders: list[TrainLoader]) -> torch.Tensor:
    """One optimizer step of every rank, micro-batches in order, ranks in order: [G, SEQ]."""
    return torch.cat([b["input_ids"] for ld in loaders for b in ld.next_step()])


def test_permutation_is_a_bijection_that_changes_with_seed_and_epoch() -> None:
    for n in (1, 2, 3, 7, 64, 1000, 4099):
        assert sorted(EpochPermutation(n, 5, 0)(np.arange(n)).tolist()) == list(range(n))
    orders = {tuple(EpochPermutation(50, s, e)(np.arange(50))) for s in (0, 1) for e in (0, 1)}
    assert len(orders) == 4


def test_sequences_are_packed_windows_with_shifted_labels_and_no_padding(
    prepared: shards.PreparedData,
) -> None:
    ld = loader(prepared)
    stream = prepared.stream("train")
    tokens = stream.read(0, len(stream)).astype(np.int64)
    seqs = ld.rank_sequences(0, 0)
    batches = ld.build_step(0, 0)
    assert len(batches) == ld.grad_accum == 4
    got_inputs = torch.cat([b["input_ids"] for b in batches])
    got_labels = torch.cat([b["labels"] for b in batches])
    for row, i in enumerate(seqs):
        window = tokens[i * SEQ : i * SEQ + SEQ + 1]
        assert got_inputs[row].tolist() == window[:-1].tolist()
        assert got_labels[row].tolist() == window[1:].tolist()
    assert got_inputs.dtype == torch.int64 and got_inputs.shape == (8, SEQ)
    pad = toks.load_tokenizer(prepared.tokenizer_path).token_to_id(toks.PAD)
    assert not (got_inputs == pad).any()
    # Every token after the first is the label of exactly one sequence: packing loses nothing but the tail.
    all_labels = np.concatenate([tokens[i * SEQ + 1 : i * SEQ + SEQ + 1] for i in range(ld.num_sequences)])
    np.testing.assert_array_equal(all_labels, tokens[1 : 1 + ld.num_sequences * SEQ])
    assert len(tokens) - 1 - ld.num_sequences * SEQ < SEQ


def test_an_epoch_visits_each_sequence_once_then_reshuffles(prepared: shards.PreparedData) -> None:
    ld = loader(prepared)
    epoch0 = np.concatenate([ld.rank_sequences(0, k) for k in range(ld.steps_per_epoch)])
    epoch1 = np.concatenate([ld.rank_sequences(1, k) for k in range(ld.steps_per_epoch)])
    assert len(set(epoch0.tolist())) == len(epoch0) == ld.steps_per_epoch * 8
    assert not np.array_equal(epoch0, epoch1)


def test_two_ranks_split_each_global_batch_disjointly_and_completely(prepared: shards.PreparedData) -> None:
    single = loader(prepared, micro_batch=2)
    ranks = [loader(prepared, micro_batch=2, rank=r, world_size=2) for r in range(2)]
    assert ranks[0].grad_accum == 2 and single.grad_accum == 4
    for step in range(3):
        parts = [set(ld.rank_sequences(0, step).tolist()) for ld in ranks]
        assert not parts[0] & parts[1]
        assert parts[0] | parts[1] == set(single.rank_sequences(0, step).tolist())
        torch.testing.assert_close(global_batch_tokens(ranks), global_batch_tokens([single]), rtol=0, atol=0)


@pytest.mark.parametrize("steps_before_save", [2, "epoch_end"])
def test_state_round_trip_continues_with_the_identical_next_batches(
    prepared: shards.PreparedData, steps_before_save: int | str
) -> None:
    ld = loader(prepared)
    n = ld.steps_per_epoch if steps_before_save == "epoch_end" else steps_before_save
    for _ in range(n):
        ld.next_step()
    state = json.loads(json.dumps(ld.state_dict()))  # plain data, as a checkpoint stores it
    if steps_before_save == "epoch_end":
        assert state["epoch"] == 1 and state["step_in_epoch"] == 0
    resumed = loader(prepared)
    resumed.load_state_dict(state)
    for _ in range(ld.steps_per_epoch + 1):  # across the next epoch boundary too
        torch.testing.assert_close(global_batch_tokens([resumed]), global_batch_tokens([ld]), rtol=0, atol=0)
    assert resumed.state_dict() == ld.state_dict()
    ld.close()
    resumed.close()


def test_a_run_saved_at_two_ranks_resumes_at_one_on_the_same_samples(prepared: shards.PreparedData) -> None:
    ranks = [loader(prepared, rank=r, world_size=2) for r in range(2)]
    for _ in range(ranks[0].steps_per_epoch - 1):  # stop just before an epoch boundary
        global_batch_tokens(ranks)
    assert ranks[0].state_dict() == ranks[1].state_dict()
    single = loader(prepared)
    single.load_state_dict(ranks[0].state_dict())
    for _ in range(3):
        torch.testing.assert_close(global_batch_tokens([single]), global_batch_tokens(ranks), rtol=0, atol=0)


def test_resume_refuses_a_different_stream(prepared: shards.PreparedData) -> None:
    state = loader(prepared).state_dict()
    with pytest.raises(ConfigError, match="seq_len=16"):
        loader(prepared, seq_len=8).load_state_dict(state)


def test_document_ids_restart_after_every_end_of_text(prepared: shards.PreparedData) -> None:
    batch = loader(prepared, seq_len=64, document_masking=True).build_step(0, 0)[0]
    inputs, doc_ids = batch["input_ids"].numpy(), batch["doc_ids"].numpy()
    for row, ids in zip(inputs, doc_ids, strict=True):
        expected, current = [], 0
        for tok in row:
            expected.append(current)
            current += int(tok == prepared.eot_id)
        assert ids.tolist() == expected
    assert doc_ids.max() > 0  # the fixture's documents are short enough to share windows


def test_validation_batches_are_ordered_and_disjoint_between_ranks(prepared: shards.PreparedData) -> None:
    stream = prepared.stream("val")
    tokens = stream.read(0, len(stream)).astype(np.int64)
    r0, r1 = (val_batches(prepared, SEQ, 2, rank=r, world_size=2, n_batches=2) for r in range(2))
    assert len(r0) == len(r1) == 2
    assert r0[0]["input_ids"][0].tolist() == tokens[0:SEQ].tolist()
    assert r1[0]["input_ids"][0].tolist() == tokens[2 * SEQ : 3 * SEQ].tolist()  # batch 0, rank 1's first
    again = val_batches(prepared, SEQ, 2, rank=0, world_size=2, n_batches=2)
    torch.testing.assert_close(again[1]["labels"], r0[1]["labels"], rtol=0, atol=0)
    with pytest.raises(ConfigError, match="validation split holds"):
        val_batches(prepared, 4096, 2, n_batches=1)


def test_a_split_smaller_than_one_global_batch_is_refused(prepared: shards.PreparedData) -> None:
    with pytest.raises(ConfigError, match="fewer than one global batch of 4096"):
        loader(prepared, global_batch=4096)
    with pytest.raises(ConfigError, match="not divisible"):
        loader(prepared, micro_batch=3, global_batch=8)


def test_a_dropped_loader_stops_its_prefetch_thread(prepared: shards.PreparedData) -> None:
    import gc

    ld = loader(prepared, prefetch=1)
    ld.next_step()
    assert ld._prefetcher is not None
    thread = ld._prefetcher._thread
    assert thread.is_alive()
    del ld
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_prefetch_restarts_after_close_without_skipping(prepared: shards.PreparedData) -> None:
    ld, ref = loader(prepared), loader(prepared)
    first = global_batch_tokens([ld])
    ld.close()  # the thread had built steps ahead; they are discarded, not skipped
    torch.testing.assert_close(first, global_batch_tokens([ref]), rtol=0, atol=0)
    torch.testing.assert_close(global_batch_tokens([ld]), global_batch_tokens([ref]), rtol=0, atol=0)
