"""The training stream: packed sequences, a world-size-independent sampler, background prefetch.

Packing: the split's tokens are one stream; sequence i is tokens [i*L, i*L + L + 1) (L = seq_len), so
consecutive sequences share one token and every token after the first is a label exactly once.
inputs = window[:-1], labels = window[1:]. No padding exists anywhere; the last (stream_len - 1) % L
tokens of a split are never a label.

Sampling, in GLOBAL units: epoch e visits the sequences in a pseudo-random order perm_e (from seed and
e). Optimizer step k of the epoch uses global batch perm_e[k*G : (k+1)*G] (G = global_batch). That
batch is cut into world_size equal contiguous parts; rank r takes part r and cuts it into grad_accum
micro-batches of micro_batch. The union over ranks and micro-steps is the global batch whatever the
world size, so a run saved at 2 processes resumes at 1 (or 4) on exactly the same samples. Each
epoch's incomplete last global batch (num_sequences % G sequences) is skipped; the next epoch's
permutation differs, so no sequence is skipped every epoch.

Document masking: `doc_ids` [B, L] numbers the documents inside each input window (0, 1, ...; the
end-of-text token belongs to the document it ends), so attention can be restricted to equal ids.
Labels are not masked at boundaries: the end-of-text position learns to predict the next document's
first token, as in unmasked packing.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from llmtrain.config import ConfigError
from llmtrain.data.shards import PreparedData, TokenStream, splitmix64
from llmtrain.planning import rules

Batch = dict[str, torch.Tensor]
_FEISTEL_ROUNDS = 4


class EpochPermutation:
    """A pseudo-random bijection of range(n) from (seed, epoch), evaluated per index in O(1) memory.

    A 4-round balanced Feistel network on the smallest even number of bits covering n, with
    cycle-walking for values >= n: no n-sized array per epoch, however large the dataset.
    """

    def __init__(self, n: int, seed: int, epoch: int) -> None:
        self.n = n
        bits = max(2, (n - 1).bit_length())
        bits += bits % 2
        self.half = np.uint64(bits // 2)
        self.mask = np.uint64((1 << (bits // 2)) - 1)
        base = [seed & 0xFFFFFFFFFFFFFFFF, epoch, 0x5EED]
        self.keys = [
            splitmix64(np.array([base[0] ^ int(splitmix64(np.array([base[1] * 8 + r + base[2]]))[0])]))[0]
            for r in range(_FEISTEL_ROUNDS)
        ]

    def _round_trip(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (splitmix64(right ^ key) & self.mask)
        return (left << self.half) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        x = self._round_trip(np.asarray(positions, dtype=np.uint64))
        outside = x >= self.n
        while outside.any():  # cycle-walk back into [0, n); at most a few rounds since 2**bits < 4n
            x[outside] = self._round_trip(x[outside])
            outside = x >= self.n
        return x.astype(np.int64)


def _window_batch(stream: TokenStream, seqs: np.ndarray, seq_len: int, eot: int, masking: bool) -> Batch:
    windows = np.stack([stream.read(int(i) * seq_len, seq_len + 1) for i in seqs])
    return pack_windows(windows, eot, masking)


def pack_windows(windows: np.ndarray, eot: int, masking: bool) -> Batch:
    """A batch from token windows [B, seq_len + 1] (each sequence and the token after it)."""
    windows = windows.astype(np.int64)
    batch = {
        "input_ids": torch.from_numpy(np.ascontiguousarray(windows[:, :-1])),
        "labels": torch.from_numpy(np.ascontiguousarray(windows[:, 1:])),
    }
    if masking:
        inputs = windows[:, :-1]
        doc_ids = np.zeros_like(inputs)
        doc_ids[:, 1:] = np.cumsum(inputs[:, :-1] == eot, axis=1)  # a new document starts after each eot
        batch["doc_ids"] = torch.from_numpy(doc_ids)
    return batch


def num_sequences(stream: TokenStream, seq_len: int) -> int:
    return max(0, (len(stream) - 1) // seq_len)


def consecutive_batches(
    stream: TokenStream, firsts: Iterable[int], seq_len: int, micro_batch: int, eot: int, masking: bool
) -> list[Batch]:
    """One batch per entry of `firsts`: the sequences [first, first + micro_batch), packed as in training."""
    return [_window_batch(stream, np.arange(f, f + micro_batch), seq_len, eot, masking) for f in firsts]


THREAD_NAME = "llmtrain-prefetch"


class Prefetcher:
    """A loader's steps, built in order `depth` ahead by a background thread.

    `produce(loader, position) -> (payload, next position)` runs in the thread on a weakly referenced
    loader, so a loader dropped without close() is still collected (its __del__ stops the thread)
    instead of being kept alive by its own prefetcher. An error is handed over in the payload's place
    and raised by `get` in the training thread.
    """

    def __init__(
        self, loader: Any, produce: Callable[[Any, Any], tuple[Any, Any]], position: Any, depth: int
    ):
        self._stop = threading.Event()
        self._queue: queue.Queue[tuple[Any, Any]] = queue.Queue(maxsize=max(1, depth))
        args = (weakref.ref(loader), produce, position, self._queue, self._stop)
        self._thread = threading.Thread(target=_prefetch, args=args, name=THREAD_NAME, daemon=True)
        self._thread.start()

    def get(self) -> tuple[Any, Any]:
        """(position, payload) of the next step."""
        position, payload = self._queue.get()
        if isinstance(payload, BaseException):
            raise payload
        return position, payload

    def signal_stop(self) -> None:
        self._stop.set()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _prefetch(
    ref: weakref.ReferenceType[Any],
    produce: Callable[[Any, Any], tuple[Any, Any]],
    position: Any,
    out: queue.Queue[tuple[Any, Any]],
    stop: threading.Event,
) -> None:
    """Prefetch thread: produce steps in order from `position` until stopped or the loader is gone."""
    while not stop.is_set():
        loader = ref()
        if loader is None:
            return
        try:
            payload, after = produce(loader, position)
            item: tuple[Any, Any] = (position, payload)
        except BaseException as exc:  # surfaced in the training thread by get()
            item, after = (position, exc), position
        position = after
        del loader
        while not stop.is_set():
            try:
                out.put(item, timeout=0.1)
                break
            except queue.Full:
                continue


class PrefetchedSteps:
    """What both loaders share: their steps come from a Prefetcher over `_produce(position)`, `close`
    stops it, and collecting the loader stops it too."""

    prefetch: int
    _prefetcher: Prefetcher | None = None

    def _produce(self, position: Any) -> tuple[Any, Any]:
        """(the step at `position`, the position after it); runs in the prefetch thread."""
        raise NotImplementedError

    def _prefetched(self, position: Any) -> Any:
        """The step at `position`, which must be the next one the thread built."""
        if self._prefetcher is None:
            self._prefetcher = Prefetcher(self, type(self)._produce, position, self.prefetch)
        built_at, payload = self._prefetcher.get()
        assert built_at == position, "prefetch out of order"
        return payload

    def close(self) -> None:
        """Stop the prefetch thread (it restarts on the next `next_step`)."""
        if self._prefetcher is not None:
            self._prefetcher.stop()
            self._prefetcher = None

    def __del__(self) -> None:
        prefetcher = getattr(self, "_prefetcher", None)
        if prefetcher is not None:
            prefetcher.signal_stop()


class TrainLoader(PrefetchedSteps):
    """This rank's micro-batches, one optimizer step at a time, prefetched in a background thread."""

    def __init__(
        self,
        prepared: PreparedData,
        seq_len: int,
        micro_batch: int,
        global_batch: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        document_masking: bool = False,
        split: str = "train",
        prefetch: int = 2,
        pin_memory: bool = False,
    ) -> None:
        _, _, self.grad_accum = rules.batch_triple(micro_batch, global_batch, world_size)
        self.stream = prepared.stream(split)
        self.eot = prepared.eot_id
        self.seq_len, self.micro_batch, self.global_batch = seq_len, micro_batch, global_batch
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.document_masking, self.prefetch, self.pin_memory = document_masking, prefetch, pin_memory
        self.num_sequences = num_sequences(self.stream, seq_len)
        self.steps_per_epoch = self.num_sequences // global_batch
        if self.steps_per_epoch == 0:
            raise ConfigError(
                f"--data: the {split} split holds {len(self.stream)} tokens = {self.num_sequences} sequences "
                f"of --seq-len {seq_len} (+1), fewer than one global batch of {global_batch}; "
                "use more data or a smaller --global-batch / --seq-len"
            )
        self.epoch, self.step_in_epoch = 0, 0

    # ---- what one step holds

    def rank_sequences(self, epoch: int, step: int) -> np.ndarray:
        """Sequence indices of this rank for (epoch, step), in micro-batch order."""
        part = self.global_batch // self.world_size
        start = step * self.global_batch + self.rank * part
        return EpochPermutation(self.num_sequences, self.seed, epoch)(np.arange(start, start + part))

    def build_step(self, epoch: int, step: int) -> list[Batch]:
        seqs = self.rank_sequences(epoch, step)
        micro = [seqs[i : i + self.micro_batch] for i in range(0, len(seqs), self.micro_batch)]
        batches = [
            _window_batch(self.stream, m, self.seq_len, self.eot, self.document_masking) for m in micro
        ]
        if self.pin_memory:
            batches = [{k: v.pin_memory() for k, v in b.items()} for b in batches]
        return batches

    def _after(self, epoch: int, step: int) -> tuple[int, int]:
        return (epoch + 1, 0) if step + 1 >= self.steps_per_epoch else (epoch, step + 1)

    # ---- iteration

    def next_step(self) -> list[Batch]:
        """The grad_accum micro-batches ({input_ids, labels[, doc_ids]}: int64 [micro_batch, seq_len])."""
        payload: list[Batch] = self._prefetched((self.epoch, self.step_in_epoch))
        self.epoch, self.step_in_epoch = self._after(self.epoch, self.step_in_epoch)
        return payload

    def _produce(self, position: tuple[int, int]) -> tuple[list[Batch], tuple[int, int]]:
        return self.build_step(*position), self._after(*position)

    # ---- what the trainer reports (a mixture's loader has more to say: data.blend.MixtureLoader)

    def take_notices(self) -> list[str]:
        """Warnings about the data since the last call (none for one source: its epochs are silent)."""
        return []

    def source_stats(self) -> dict[str, dict[str, int]] | None:
        """Tokens and epoch per source of a mixture; None for one source."""
        return None

    # ---- resumable state: plain data, independent of rank and world size

    @property
    def consumed_samples(self) -> int:
        return (self.epoch * self.steps_per_epoch + self.step_in_epoch) * self.global_batch

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "seed": self.seed,
            "global_batch": self.global_batch,
            "seq_len": self.seq_len,
            "num_sequences": self.num_sequences,
            "consumed_samples": self.consumed_samples,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue with the batch after the saved one (any world size; same data, seed and seq_len)."""
        for key in ("seed", "seq_len", "num_sequences"):
            if int(state[key]) != getattr(self, key):
                raise ConfigError(
                    f"resume: the checkpoint's data stream has {key}={state[key]}, this run has "
                    f"{getattr(self, key)}; resume with the same data, --seed and --seq-len"
                )
        samples_in_epoch = int(state["step_in_epoch"]) * int(state["global_batch"])
        if samples_in_epoch % self.global_batch:
            raise ConfigError(
                f"resume: {samples_in_epoch} samples into the epoch is not a whole number of global batches "
                f"of {self.global_batch}; resume with --global-batch {state['global_batch']}"
            )
        self.close()
        self.epoch, self.step_in_epoch = int(state["epoch"]), samples_in_epoch // self.global_batch
        if self.step_in_epoch >= self.steps_per_epoch:
            self.epoch, self.step_in_epoch = self.epoch + 1, 0


def val_batches(
    prepared: PreparedData,
    seq_len: int,
    micro_batch: int,
    *,
    rank: int = 0,
    world_size: int = 1,
    n_batches: int,
    document_masking: bool = False,
) -> list[Batch]:
    """The first `n_batches` validation batches, in order: rank r's part of batch b is sequences
    [(b*W + r)*micro_batch, ... + micro_batch). Fewer when the split is short (equal on every rank)."""
    if "val" not in prepared.manifest.splits or prepared.manifest.splits["val"].tokens == 0:
        raise ConfigError(
            "--eval-every: the data has no validation split; set --set data.val_fraction above 0"
        )
    stream = prepared.stream("val")
    available = num_sequences(stream, seq_len) // (micro_batch * world_size)
    if available == 0:
        raise ConfigError(
            f"--eval-every: the validation split holds {len(stream)} tokens, fewer than one batch of "
            f"{micro_batch * world_size} sequences of --seq-len {seq_len}; raise --set data.val_fraction"
        )
    firsts = [(b * world_size + rank) * micro_batch for b in range(min(n_batches, available))]
    return consecutive_batches(stream, firsts, seq_len, micro_batch, prepared.eot_id, document_masking)
