"""The training stream of a data mixture: sources drawn by weight, sample by sample, resumable.

Choosing the source, for each sample slot of the run in order (Megatron's BlendedDataset rule): take
the source with the largest deficit `weight_i * (n + 1) - drawn_i` (n samples drawn so far, drawn_i of
them from source i; ties go to the lower index). Per-source counts then stay within one sequence of
`weight_i * n` at every step, and the choice is a pure function of the counts: no random numbers,
nothing to store but the counts.

Choosing the sequence: each source walks its own pseudo-random epoch permutation
(`dataset.EpochPermutation`, seeded from the run's seed and the source's index) with its own cursor
(epoch, position). A source whose cursor passes the end of its epoch starts the next one (a new
permutation) and the loader says so once per new epoch: a small source is repeated, never silently.

The global batch (G sample slots per optimizer step) is then split exactly as `dataset.TrainLoader`
splits its own: rank r of W takes slots [r*G/W, (r+1)*G/W), cut into micro-batches, so the union over
ranks is the same global batch at any world size. The state is plain data: per source its cursor and
counts, independent of the world size.

Changing the weights (a fork may): the counts the deficit rule compares restart at the change
(`window` below), so the sources follow the new weights from that step on, with no catch-up burst for
what the old weights under-drew; the run-long counts (`drawn`, the tokens in metrics) continue.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from llmtrain.config import ConfigError
from llmtrain.data.dataset import (
    Batch,
    EpochPermutation,
    PrefetchedSteps,
    num_sequences,
    pack_windows,
    val_batches,
)
from llmtrain.data.mixture import MixturePart
from llmtrain.data.shards import splitmix64
from llmtrain.planning import rules

_MASK64 = (1 << 64) - 1


def pick_sources(weights: Sequence[float], counts: Sequence[int], n: int) -> list[int]:
    """The sources of the next `n` samples by the deficit rule, from per-source counts `counts`."""
    counts = list(counts)
    total = sum(counts)
    picks = []
    for _ in range(n):
        best, best_deficit = 0, -float("inf")
        for i, weight in enumerate(weights):
            deficit = weight * (total + 1) - counts[i]
            if deficit > best_deficit:  # strictly greater: a tie stays with the lower index
                best, best_deficit = i, deficit
        counts[best] += 1
        total += 1
        picks.append(best)
    return picks


def source_seed(seed: int, index: int) -> int:
    """The seed of source `index`'s epoch permutations: distinct per source, fixed by the run's seed."""
    mixed = (seed & _MASK64) ^ (((index + 1) * 0x9E3779B97F4A7C15) & _MASK64)
    return int(splitmix64(np.array([mixed], dtype=np.uint64))[0])


@dataclass(frozen=True)
class Cursor:
    """Where one source stands. `position` may equal the epoch's length: the epoch is used up and the
    next draw starts the next one (so a repeat is reported when it happens, not before)."""

    epoch: int = 0
    position: int = 0
    drawn: int = 0  # sequences drawn from this source in the whole run
    window: int = 0  # sequences drawn since the weights last changed: what the deficit rule compares


@dataclass(frozen=True)
class Exhausted:
    """A source ran out during a step and starts its `epoch` (0-based) again."""

    name: str
    tokens: int  # tokens drawn from the source before it ran out
    step: int  # the optimizer step (1-based, as printed) whose batch ran it out
    epoch: int

    def message(self) -> str:
        return (
            f"data source {self.name} exhausted after {self.tokens:,} tokens at step {self.step}; "
            f"repeating it (epoch {self.epoch + 1})"
        )


Cursors = tuple[Cursor, ...]


class MixtureLoader(PrefetchedSteps):
    """This rank's micro-batches of a mixture, one optimizer step at a time, prefetched in a thread.

    The same interface as `dataset.TrainLoader` (next_step, close, state_dict, load_state_dict,
    take_notices, source_stats).
    """

    def __init__(
        self,
        parts: list[MixturePart],
        seq_len: int,
        micro_batch: int,
        global_batch: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        document_masking: bool = False,
        prefetch: int = 2,
        pin_memory: bool = False,
    ) -> None:
        _, _, self.grad_accum = rules.batch_triple(micro_batch, global_batch, world_size)
        self.parts = parts
        self.names = [p.name for p in parts]
        self.weights = [p.weight for p in parts]
        self.streams = [p.prepared.stream("train") for p in parts]
        self.eot = parts[0].prepared.eot_id
        self.sizes = [num_sequences(stream, seq_len) for stream in self.streams]
        for part, size, stream in zip(parts, self.sizes, self.streams, strict=True):
            if size == 0:
                raise ConfigError(
                    f"--data {part.source}: its train split holds {len(stream)} tokens, not one sequence of "
                    f"--seq-len {seq_len} (+1); use more data or a smaller --seq-len"
                )
        self.seq_len, self.micro_batch, self.global_batch = seq_len, micro_batch, global_batch
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.document_masking, self.prefetch, self.pin_memory = document_masking, prefetch, pin_memory
        self.seeds = [source_seed(seed, i) for i in range(len(parts))]
        self.cursors: Cursors = tuple(Cursor() for _ in parts)
        self._notices: list[str] = []

    # ---- what one step holds

    def plan_step(self, cursors: Cursors) -> tuple[list[tuple[int, int]], Cursors, list[Exhausted]]:
        """The global batch after `cursors`: (source, sequence) per slot in order; the cursors after it;
        the sources that ran out on the way."""
        picks = pick_sources(self.weights, [c.window for c in cursors], self.global_batch)
        step = sum(c.drawn for c in cursors) // self.global_batch + 1
        drawn: list[np.ndarray] = []
        after: list[Cursor] = []
        events: list[Exhausted] = []
        for index, cursor in enumerate(cursors):
            seqs, moved, ran_out = self._advance(index, cursor, picks.count(index), step)
            drawn.append(seqs)
            after.append(moved)
            events += ran_out
        taken = [0] * len(cursors)
        slots = []
        for index in picks:
            slots.append((index, int(drawn[index][taken[index]])))
            taken[index] += 1
        return slots, tuple(after), events

    def _advance(
        self, index: int, cursor: Cursor, count: int, step: int
    ) -> tuple[np.ndarray, Cursor, list[Exhausted]]:
        """`count` sequences of source `index` from `cursor`, starting new epochs as needed."""
        size, epoch, position = self.sizes[index], cursor.epoch, cursor.position
        pieces, events, remaining = [np.zeros(0, dtype=np.int64)], [], count
        while remaining:
            if position == size:
                epoch, position = epoch + 1, 0
                used = cursor.drawn + count - remaining
                events.append(Exhausted(self.names[index], used * self.seq_len, step, epoch))
            take = min(remaining, size - position)
            permutation = EpochPermutation(size, self.seeds[index], epoch)
            pieces.append(permutation(np.arange(position, position + take)))
            position, remaining = position + take, remaining - take
        moved = Cursor(epoch, position, cursor.drawn + count, cursor.window + count)
        return np.concatenate(pieces), moved, events

    def build_step(self, slots: list[tuple[int, int]]) -> list[Batch]:
        """This rank's micro-batches of a global batch's slots."""
        part = self.global_batch // self.world_size
        mine = slots[self.rank * part : (self.rank + 1) * part]
        batches = []
        for start in range(0, len(mine), self.micro_batch):
            windows = np.stack(
                [
                    self.streams[source].read(seq * self.seq_len, self.seq_len + 1)
                    for source, seq in mine[start : start + self.micro_batch]
                ]
            )
            batches.append(pack_windows(windows, self.eot, self.document_masking))
        if self.pin_memory:
            batches = [{k: v.pin_memory() for k, v in b.items()} for b in batches]
        return batches

    # ---- iteration

    def next_step(self) -> list[Batch]:
        """The grad_accum micro-batches ({input_ids, labels[, doc_ids]}: int64 [micro_batch, seq_len])."""
        batches, self.cursors, events = self._prefetched(self.cursors)
        self._notices += [event.message() for event in events]
        return batches

    def _produce(self, cursors: Cursors) -> tuple[tuple[list[Batch], Cursors, list[Exhausted]], Cursors]:
        slots, after, events = self.plan_step(cursors)
        return (self.build_step(slots), after, events), after

    # ---- what the trainer reports

    def take_notices(self) -> list[str]:
        """The warnings of the steps taken since the last call (a source exhausted, the weights changed)."""
        notices, self._notices = self._notices, []
        return notices

    def source_stats(self) -> dict[str, dict[str, int]]:
        """Per source: tokens trained on (the whole run) and the epoch under way (1 = the first pass)."""
        return {
            name: {"tokens": c.drawn * self.seq_len, "epoch": c.epoch + 1}
            for name, c in zip(self.names, self.cursors, strict=True)
        }

    # ---- resumable state: plain data, independent of rank and world size

    @property
    def consumed_samples(self) -> int:
        return sum(c.drawn for c in self.cursors)

    def state_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "consumed_samples": self.consumed_samples,
            "sources": [
                {
                    "name": name,
                    "source": part.source,
                    "num_sequences": size,
                    "weight": weight,
                    **dataclasses.asdict(c),
                }
                for name, part, size, weight, c in zip(
                    self.names, self.parts, self.sizes, self.weights, self.cursors, strict=True
                )
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after the saved step (any world size; the same sources, seed and seq_len). Saved with
        other weights (a fork), the deficit rule's counts restart, so the new weights hold from here."""
        saved = state.get("sources")
        if not isinstance(saved, list):
            raise ConfigError(
                "resume: the checkpoint was saved by a run reading one source, this run reads a mixture; "
                "resume with the run's own --data"
            )
        self._check_same_stream(state, saved)
        self.close()
        old_weights = [float(s["weight"]) for s in saved]
        restart = old_weights != self.weights
        self.cursors = tuple(
            Cursor(int(s["epoch"]), int(s["position"]), int(s["drawn"]), 0 if restart else int(s["window"]))
            for s in saved
        )
        if restart:
            changes = ", ".join(
                f"{name} {old:.3g} -> {new:.3g}"
                for name, old, new in zip(self.names, old_weights, self.weights, strict=True)
            )
            step = self.consumed_samples // self.global_batch + 1
            self._notices.append(
                f"data mixture weights changed ({changes}); drawn by the new weights from step {step}"
            )

    def _check_same_stream(self, state: dict[str, Any], saved: list[dict[str, Any]]) -> None:
        for key in ("seed", "seq_len", "global_batch"):
            if int(state[key]) != getattr(self, key):
                raise ConfigError(
                    f"resume: the checkpoint's data stream has {key}={state[key]}, this run has "
                    f"{getattr(self, key)}; resume with the same data, --seed, --seq-len and --global-batch"
                )
        mine = [(p.source, size) for p, size in zip(self.parts, self.sizes, strict=True)]
        theirs = [(s["source"], int(s["num_sequences"])) for s in saved]
        if mine != theirs:
            raise ConfigError(
                f"resume: the checkpoint's mixture is {theirs} (source, sequences), this run's is {mine}; "
                "resume with the same sources (prepared as before)"
            )


def mixture_val_batches(
    parts: list[MixturePart],
    seq_len: int,
    micro_batch: int,
    *,
    rank: int = 0,
    world_size: int = 1,
    n_batches: int,
    document_masking: bool = False,
) -> dict[str, list[Batch]]:
    """Each source's first `n_batches` validation batches (as `dataset.val_batches`), by name."""
    out = {}
    for part in parts:
        try:
            out[part.name] = val_batches(
                part.prepared,
                seq_len,
                micro_batch,
                rank=rank,
                world_size=world_size,
                n_batches=n_batches,
                document_masking=document_masking,
            )
        except ConfigError as exc:
            raise ConfigError(f"--data {part.source}: {exc}") from None
    return out


def weighted_loss(losses: dict[str, float], parts: list[MixturePart]) -> float:
    """The mixture's validation loss: the sources' losses weighted as they are drawn."""
    return sum(part.weight * losses[part.name] for part in parts)
