"""The training loop's state as components, registered once: what a checkpoint saves and a resume restores.

Every part of the loop that holds state (progress counters, data loader, stability guard, RNG) has
`state_dict()` / `load_state_dict()` and is registered in the Trainer's `StateRegistry` under a name.
`StateRegistry.state_dict()` gathers them all into a checkpoint's client state; `load_state_dict()`
restores them all, in registration order, and names a component the checkpoint lacks.

The on-disk layout stays flat and stable: a component is saved under its name (`loader`, `guard`), or,
registered with `top_level=True`, with its keys merged at the top (the counters' `step` and `tokens`).
A component registered with `saved_by_checkpoint=True` (the RNG) is left out of `state_dict()`:
`checkpoint.save` writes it itself, and `checkpoint.load` returns it under the component's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from llmtrain import checkpoint
from llmtrain.errors import BadInput


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class MissingState(BadInput):
    """A checkpoint's client state lacks a registered component (exit code 2)."""


@dataclass(frozen=True)
class _Entry:
    component: Stateful
    top_level: bool
    saved_by_checkpoint: bool


class StateRegistry:
    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def register(
        self, name: str, component: Stateful, *, top_level: bool = False, saved_by_checkpoint: bool = False
    ) -> None:
        if name in self._entries:
            raise ValueError(f"state component {name!r} registered twice")
        self._entries[name] = _Entry(component, top_level, saved_by_checkpoint)

    def names(self) -> list[str]:
        return list(self._entries)

    def state_dict(self) -> dict[str, Any]:
        """Every component's state (except those the checkpoint saves itself), in registration order."""
        out: dict[str, Any] = {}
        for name, entry in self._entries.items():
            if entry.saved_by_checkpoint:
                continue
            state = entry.component.state_dict()
            parts = state if entry.top_level else {name: state}
            clash = sorted(set(parts) & set(out))
            if clash:
                raise ValueError(f"state component {name!r}: key(s) {clash} already saved by another one")
            out.update(parts)
        return out

    def load_state_dict(self, state: dict[str, Any], where: str = "checkpoint") -> None:
        """Restore every component from `state` (as `state_dict()` wrote it, plus what the checkpoint
        saved itself), in registration order."""
        for name, entry in self._entries.items():
            keys = list(entry.component.state_dict()) if entry.top_level else [name]
            missing = [k for k in keys if k not in state]
            if missing:
                raise MissingState(
                    f"{where}: the saved training state has no {', '.join(map(repr, missing))} "
                    f"(state of {name!r}); it was not written by this llmtrain: start a new run"
                )
            entry.component.load_state_dict({k: state[k] for k in keys} if entry.top_level else state[name])


# ---------------------------------------------------------------- the loop's own components


@dataclass
class Counters:
    """Plain-data progress, saved in every checkpoint (at the top level: `step`, `tokens`)."""

    step: int = 0  # optimizer steps completed (skipped ones included: the data moved on)
    tokens: int = 0  # tokens consumed

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "tokens": self.tokens}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.tokens = int(state["step"]), int(state["tokens"])


class RngState:
    """This rank's python, numpy, torch (and CUDA) RNG streams. `checkpoint.save` records them itself
    (register with `saved_by_checkpoint=True`); `checkpoint.load` returns None for a rank that did not
    exist in the saved run (another world size), and then the streams are left as seeded."""

    def state_dict(self) -> dict[str, Any]:
        return checkpoint.rng_state()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state is not None:
            checkpoint.restore_rng(state)
