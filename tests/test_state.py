"""The loop's state registry and hook points, with plain objects (no engine, no processes)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from llmtrain.config import StabilityConfig
from llmtrain.errors import BadInput
from llmtrain.train.hooks import Hooks, TrainHook
from llmtrain.train.stability import StabilityGuard
from llmtrain.train.state import Counters, MissingState, RngState, StateRegistry


class Box:
    def __init__(self, value: Any = None) -> None:
        self.value = value

    def state_dict(self) -> Any:
        return self.value

    def load_state_dict(self, state: Any) -> None:
        self.value = state


def registry(counters: Counters, box: Box, guard: StabilityGuard) -> StateRegistry:
    state = StateRegistry()
    state.register("rng", RngState(), saved_by_checkpoint=True)
    state.register("counters", counters, top_level=True)
    state.register("loader", box)
    state.register("guard", guard)
    return state


def test_the_saved_layout_is_flat_and_leaves_the_rng_to_the_checkpoint() -> None:
    guard = StabilityGuard(StabilityConfig())
    guard.record(2.5, 1.0, guard.judge(2.5, 1.0))
    state = registry(Counters(step=3, tokens=384), Box({"epoch": 1}), guard).state_dict()
    assert list(state) == ["step", "tokens", "loader", "guard"]  # the client-state keys checkpoints hold
    assert (state["step"], state["tokens"], state["loader"]) == (3, 384, {"epoch": 1})
    assert state["guard"] == guard.state_dict()


def test_restore_brings_every_component_back_in_place() -> None:
    counters, box, guard = Counters(), Box(), StabilityGuard(StabilityConfig())
    state = registry(counters, box, guard)
    saved_guard = StabilityGuard(StabilityConfig())
    saved_guard.record(4.0, 2.0, saved_guard.judge(4.0, 2.0))
    random.seed(7)
    rng = RngState().state_dict()
    expected = random.random()
    state.load_state_dict(
        {"step": 5, "tokens": 640, "loader": {"epoch": 2}, "guard": saved_guard.state_dict(), "rng": rng}
    )
    assert (counters.step, counters.tokens, box.value) == (5, 640, {"epoch": 2})
    assert guard.state_dict() == saved_guard.state_dict()
    assert random.random() == expected


def test_a_none_rng_after_a_world_size_change_leaves_the_streams_as_they_are() -> None:
    torch.manual_seed(3)
    before = torch.get_rng_state()
    RngState().load_state_dict(None)
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("missing", ["tokens", "loader", "rng"])
def test_a_missing_component_is_one_line_bad_input_naming_it(missing: str) -> None:
    state = registry(Counters(), Box(), StabilityGuard(StabilityConfig()))
    saved = {**state.state_dict(), "rng": None}
    del saved[missing]
    with pytest.raises(MissingState) as info:
        state.load_state_dict(saved, where="ckpt/step_00000004")
    assert isinstance(info.value, BadInput)
    assert str(info.value).startswith(f"ckpt/step_00000004: the saved training state has no {missing!r}")


def test_a_component_registers_once_and_keys_never_clash() -> None:
    state = StateRegistry()
    state.register("counters", Counters(), top_level=True)
    with pytest.raises(ValueError, match="registered twice"):
        state.register("counters", Counters())
    state.register("step", Box(1))
    with pytest.raises(ValueError, match="already saved"):
        state.state_dict()


def test_hooks_run_in_order_at_each_point() -> None:
    calls: list[str] = []

    class Double(TrainHook):
        def on_forward(self, loss: torch.Tensor, step: int) -> torch.Tensor:
            return loss * 2

        def after_step(self, step: int) -> None:
            calls.append(f"double after {step}")

    class Note(TrainHook):
        def after_step(self, step: int) -> None:
            calls.append(f"note after {step}")

        def after_save(self) -> None:
            calls.append("saved")

    loss = torch.tensor(1.5)
    assert Hooks().on_forward(loss, 0) is loss  # no hooks: the very same tensor
    hooks = Hooks([Double()])
    hooks.add(Note())
    hooks.add(Double())
    assert float(hooks.on_forward(loss, 0)) == 6.0
    hooks.after_step(4)
    hooks.after_save()
    assert calls == ["double after 4", "note after 4", "double after 4", "saved"]
