"""The training loop. `run()` is a list of build calls; `Trainer.train()` fits on one screen. The loop
drives an `engine.base.Engine` (DeepSpeed or FSDP2) and never branches on which.

Every rank runs the same code. The few decisions that must agree across ranks (skip this update, save
now, stop now) are taken from one small all-reduce per step, so no rank can go its own way and hang
the others in a collective.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmtrain import checkpoint, init_source, rundir
from llmtrain.config import TrainConfig, from_dict, to_dict
from llmtrain.data.blend import MixtureLoader, mixture_val_batches, weighted_loss
from llmtrain.data.cache import ensure_prepared
from llmtrain.data.dataset import TrainLoader, val_batches
from llmtrain.data.mixture import MixturePart, prepare_mixture
from llmtrain.data.shards import PreparedData
from llmtrain.engine.base import Engine
from llmtrain.engine.build import build_engine, engine_config
from llmtrain.errors import RunFailure
from llmtrain.parallel import distributed, traffic
from llmtrain.parallel.distributed import World
from llmtrain.planning.layout import check_resume
from llmtrain.planning.memory.setup import setup_from_config
from llmtrain.planning.memory.states import checkpoint_bytes
from llmtrain.train import faults, plot, profile, schedule, stopping
from llmtrain.train.hooks import Hooks
from llmtrain.train.metrics import MetricsLogger
from llmtrain.train.stability import StabilityGuard, Verdict
from llmtrain.train.state import Counters, RngState, StateRegistry


@dataclass
class StepResult:
    loss: float
    grad_norm: float | None
    lr: float
    verdict: Verdict
    save_due: bool
    stop_requested: bool


@dataclass
class Agreement:
    """What every rank agreed on before the update: the global mean loss, the guard's verdict on it,
    and whether any rank wants to save or stop."""

    loss: float
    verdict: Verdict
    save_due: bool
    stop: bool


class SaveFailed(RunFailure):
    """A checkpoint could not be written and checkpoint.on_save_failure is `stop` (exit code 1)."""

    on_every_rank = True  # the save's outcome is all-gathered: every rank stops together


def run(cfg: TrainConfig, run_dir: Path, resume: bool) -> dict[str, Any]:
    """Train (or continue) the run in `run_dir`; returns the end-of-run summary."""
    world = distributed.init(cfg.launch.collective_timeout_s)
    peers_may_be_gone = True
    trainer: Trainer | None = None
    try:
        cfg, resume = rank_zeros_start(cfg, resume, world)
        trainer = build_trainer(cfg, world, run_dir, resume)
        summary = trainer.train()
        peers_may_be_gone = False
        return summary
    except RuntimeError as exc:
        if isinstance(exc, RunFailure):
            # A stop every rank reaches together still ends with the barrier: measured, a gloo run
            # that skips it aborts at exit now and then (SIGABRT) after its clean stop.
            peers_may_be_gone = not exc.on_every_rank
            raise
        # A peer died or is stuck: say which one, instead of gloo's rank-less error.
        step = trainer.counters.step + 1 if trainer is not None else None
        named = distributed.collective_failure(exc, world.rank, step, cfg.launch.collective_timeout_s)
        if named is None:
            raise
        raise named from exc
    finally:
        # After a failure another rank may be waiting in a collective for us: no barrier, the launcher
        # ends it.
        distributed.shutdown(barrier=not peers_may_be_gone)


def rank_zeros_start(cfg: TrainConfig, resume: bool, world: World) -> tuple[TrainConfig, bool]:
    """Every rank starts as rank 0 decided: under an outside launcher (torchrun, srun) each rank prepared
    the run itself, and with `--resume auto` only rank 0 waited for the run directory's lock, so another
    rank may have found no checkpoint yet (and a fresh config) where rank 0 found one to resume."""
    if world.world_size == 1:
        return cfg, resume
    import torch.distributed as dist

    decision: list[Any] = [to_dict(cfg), resume]
    dist.broadcast_object_list(decision, src=0)
    if world.rank == 0:
        return cfg, resume
    return from_dict(decision[0], where="rank 0's config"), bool(decision[1])


def build_trainer(cfg: TrainConfig, world: World, run_dir: Path, resume: bool) -> Trainer:
    _seed_everything(cfg.train.seed)
    root = rundir.checkpoint_root(run_dir)
    choice = checkpoint.choose_checkpoint(root, cfg.checkpoint.strict) if resume else None
    layout = cfg.layout(world.world_size)
    if choice is not None:
        saved = checkpoint.saved_layout(choice.info, layout)
        info = choice.info
        check_resume(
            layout, saved, cfg.zero.stage, info.partitioned, cfg.model.num_key_value_heads, engine=info.engine
        )
    universal = choice is not None and checkpoint.needs_universal(choice.info, layout)
    settings = engine_config(cfg, world, load_universal=universal)
    if world.is_main:
        rundir.write_run_files(run_dir, cfg.train.engine, settings, layout)
    prepared: PreparedData | list[MixturePart]
    if cfg.data.mixture:
        prepared = prepare_mixture(cfg.data, cfg.model.vocab_size, local_rank=world.local_rank)
    else:
        prepared = ensure_prepared(cfg.data, cfg.model.vocab_size, local_rank=world.local_rank)
    if world.is_main:
        first = prepared[0].prepared if isinstance(prepared, list) else prepared  # one tokenizer for all
        rundir.copy_tokenizer(run_dir, first.tokenizer_path, cfg.data.tokenizer)
    engine = build_engine(cfg, world, settings)
    if world.is_main and cfg.compiles:
        print("compiling the model with torch.compile: the first step takes longer; --no-compile skips it",
              flush=True)  # fmt: skip
    if world.is_main and choice is None and cfg.train.init_from is not None:
        source = init_source.parse(cfg.train.init_from).describe()
        print(f"weights from {source}; optimizer and schedule start fresh", flush=True)
    trainer = Trainer(cfg, world, run_dir, engine, prepared)
    if choice is not None:
        # Saved on another layout: DeepSpeed's universal format re-partitions the states.
        tag = checkpoint.convert_to_universal(root, choice.tag).name if universal else choice.tag
        trainer.restore(tag, choice.warnings)
    trainer.open_metrics()
    return trainer


def space_rule(cfg: TrainConfig) -> checkpoint.SpaceRule:
    """What a save must find free: checkpoint.min_free plus the checkpoint's size, which before the
    run's first checkpoint is estimated from the parameter count and precision."""
    setup = setup_from_config(cfg)
    basis = f"the model's {setup.params:,} parameters in {cfg.train.precision}, no checkpoint yet"
    estimate = checkpoint.SizeEstimate(checkpoint_bytes(setup), basis)
    return checkpoint.SpaceRule(cfg.checkpoint.min_free, estimate)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Trainer:
    def __init__(
        self,
        cfg: TrainConfig,
        world: World,
        run_dir: Path,
        engine: Engine,
        prepared: PreparedData | list[MixturePart],
    ):
        self.cfg, self.world, self.run_dir, self.engine = cfg, world, run_dir, engine
        # Fault injection when LLMTRAIN_FAULTS is set, the profiler with --profile.
        hooks = [*faults.hooks_from_env(world.rank), *profile.hooks_from_config(cfg, world, run_dir)]
        self.hooks = Hooks(hooks)
        self.ckpt_root = rundir.checkpoint_root(run_dir)
        # The ranks of one tp or sp group, and the stages of one pipeline, read the same samples: the
        # loader sees data-parallel ranks.
        self.layout = cfg.layout(world.world_size)
        self.mixture = prepared if isinstance(prepared, list) else None
        loader_class = MixtureLoader if isinstance(prepared, list) else TrainLoader
        self.loader: TrainLoader | MixtureLoader = loader_class(
            prepared,  # type: ignore[arg-type]  # each class takes its own kind
            cfg.train.seq_len,
            cfg.train.micro_batch,
            cfg.global_batch,
            rank=self.layout.data_rank(world.rank),
            world_size=self.layout.dp,
            seed=cfg.train.seed,
            document_masking=cfg.data.document_masking,
            pin_memory=world.accelerator == "cuda",
        )
        self.val, self.val_sources = self._val_batches(prepared)
        self.guard = StabilityGuard(cfg.stability)
        self.counters = Counters()
        self.total_steps = cfg.total_steps
        self.tokens_per_step = cfg.tokens_per_step
        self.signal = stopping.listen()  # a request made while the run was starting is kept
        self.last_save_time = time.monotonic()
        self.last_saved_step = -1
        self.curves_step = -1  # the step RUN_DIR/curves.png was last drawn at
        self.space = space_rule(cfg)
        self.state = self._register_state()
        self.metrics: MetricsLogger | None = None

    def _register_state(self) -> StateRegistry:
        """Everything a checkpoint brings back, registered once; restored in this order."""
        state = StateRegistry()
        state.register(checkpoint.RNG_KEY, RngState(), saved_by_checkpoint=True)
        state.register("counters", self.counters, top_level=True)  # `step`, `tokens` at the top level
        state.register("loader", self.loader)
        state.register("guard", self.guard)
        return state

    def _val_batches(
        self, prepared: PreparedData | list[MixturePart]
    ) -> tuple[list[dict[str, torch.Tensor]], dict[str, list[dict[str, torch.Tensor]]]]:
        """The validation batches: of the one source, or of each source of a mixture (by name)."""
        if not self.cfg.train.eval_every:
            return [], {}
        read = mixture_val_batches if isinstance(prepared, list) else val_batches
        batches = read(
            prepared,  # type: ignore[arg-type]  # each function takes its own kind
            self.cfg.train.seq_len,
            self.cfg.train.micro_batch,
            rank=self.layout.data_rank(self.world.rank),
            world_size=self.layout.dp,
            n_batches=self.cfg.train.eval_batches,
            document_masking=self.cfg.data.document_masking,
        )
        return ([], batches) if isinstance(batches, dict) else (batches, {})

    def open_metrics(self) -> None:
        self.metrics = MetricsLogger.from_config(
            self.cfg,
            self.run_dir,
            rank=self.world.rank,
            resume_step=self.counters.step,
            device=self.world.device,
            world_size=self.world.world_size,  # the process group's, whatever --gpus said
        )

    # ------------------------------------------------------------ the loop

    def train(self) -> dict[str, Any]:
        # The prefetch thread is stopped however the loop ends: left running into interpreter exit after
        # a failure (a stopping save failure, a diverged run), it is killed inside torch's C++ code, and
        # the process aborts (SIGABRT, "terminate called without an active exception") instead of
        # exiting with the failure's code.
        try:
            stopped_by = self._loop()
        finally:
            self.loader.close()
        self.refresh_curves()
        assert self.metrics is not None
        summary = self.metrics.close()
        summary["stopped_by"] = stopped_by or None
        return summary

    def _loop(self) -> str:
        """Steps until the last one or a stop signal (its name, else ""), with the saves that fall due."""
        assert self.metrics is not None
        self.metrics.start(self.counters.step, self.counters.tokens)
        stopped_by = ""
        while self.counters.step < self.total_steps:
            self.hooks.before_step(self.counters.step)
            result = self.train_step(self.loader.next_step())
            self.counters.step += 1
            self.counters.tokens += self.tokens_per_step
            self.guard.record(result.loss, result.grad_norm, result.verdict)  # raises after K skips in a row
            self.log(result)
            self.maybe_evaluate()
            if result.save_due or result.stop_requested:
                self.save()
            if result.stop_requested:
                stopped_by = self.signal.name or "signal"
                break
        if not stopped_by and self.last_saved_step != self.counters.step:
            self.save()
        return stopped_by

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> StepResult:
        self._step_traffic()  # from here on, this step's collectives
        lr = schedule.lr_for(self.cfg, self.counters.step)
        self.engine.set_lr(lr)
        agreed: list[Agreement] = []
        judged_before_update: list[Verdict] = []

        def before_update(loss_sum: torch.Tensor, count: int) -> bool:
            agreed.append(self._agreement(loss_sum, count))
            return agreed[0].verdict.skip

        def judge_norm(grad_norm: float) -> bool:
            """The guard on the global grad norm, before the update (engines that know it then)."""
            judged_before_update.append(self.guard.judge(agreed[0].loss, grad_norm))
            return judged_before_update[0].skip

        grad_norm = self.engine.run_step(micro_batches, self._on_loss, before_update, judge_norm)
        verdict = agreed[0].verdict
        if judged_before_update:
            verdict = judged_before_update[0]
        elif not verdict.skip:
            verdict = self._judge_after_update(agreed[0].loss, grad_norm)
        self.hooks.after_step(self.counters.step)
        return StepResult(agreed[0].loss, grad_norm, lr, verdict, agreed[0].save_due, agreed[0].stop)

    # ------------------------------------------------------------ step helpers

    def _on_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.hooks.on_forward(loss, self.counters.step)

    def _agreement(self, loss_sum: torch.Tensor, count: int) -> Agreement:
        """The step's agreed loss, flags and the guard's verdict on the loss (before the update)."""
        distributed.note_progress(self.world.rank, self.counters.step + 1)  # names a stuck rank later
        mean_loss, save_due, stop = self._agree(loss_sum, count)
        return Agreement(mean_loss, self.guard.judge(mean_loss, None), save_due, stop)

    def _agree(self, loss_sum: torch.Tensor, count: int) -> tuple[float, bool, bool]:
        """One all-reduce and one host read: the global mean loss, and whether any rank wants to save or stop.

        The guard must see the global loss before the last micro-batch's backward (to skip an update), so
        one device-to-host synchronisation per optimizer step is inherent; all that the ranks agree on
        rides in it. The losses stay on the device until then (no read per micro-batch), and the flags
        are filled in by kernels, not copied from pageable host memory (which can synchronise too).
        """
        minutes = self.cfg.checkpoint.save_every_minutes
        time_due = minutes is not None and time.monotonic() - self.last_save_time >= minutes * 60
        flags = (float(count), float(time_due), float(self.signal.requested))
        device = loss_sum.device
        vector = torch.stack(
            [loss_sum.double()] + [torch.full((), flag, dtype=torch.float64, device=device) for flag in flags]
        )
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(vector, op=torch.distributed.ReduceOp.SUM)
        total, count, save, stop = vector.tolist()  # the step's one synchronisation
        every = self.cfg.checkpoint.save_every
        step_due = every is not None and (self.counters.step + 1) % every == 0
        return total / count, step_due or save > 0, stop > 0

    def _judge_after_update(self, loss: float, grad_norm: float | None) -> Verdict:
        verdict = self.guard.judge(loss, grad_norm)
        if grad_norm is not None and not math.isfinite(grad_norm):
            return verdict  # the engine already dropped this update
        if verdict.skip:
            # A finite grad-norm spike is known only once the engine has computed the norm inside its update:
            # the update is applied and the spike is reported, never silently ignored.
            return Verdict(skip=False, reason=f"{verdict.reason}; update already applied", spike=True)
        return verdict

    # ------------------------------------------------------------ logging and evaluation

    def log(self, result: StepResult) -> None:
        assert self.metrics is not None
        for notice in self.loader.take_notices():  # a mixture's source exhausted and repeated, ...
            self.metrics.warn(notice)
        if result.verdict.reason:
            action = "skipped" if result.verdict.skip else "warning"
            self.metrics.warn(f"step {self.counters.step}: {result.verdict.reason} ({action})")
        step = self.counters.step
        if step % self.cfg.logging.log_every == 0 or step == self.total_steps or step == 1:
            comm = self._step_traffic()  # before the peak's own collective
            peak = distributed.device_peak_bytes(self.world)  # every rank: a collective on a GPU
            self.metrics.log_step(
                step,
                loss=result.loss,
                lr=result.lr,
                grad_norm=result.grad_norm,
                tokens=self.counters.tokens,
                skipped=self.guard.skipped_total,
                spikes=self.guard.spikes_total,
                sources=self.loader.source_stats(),
                comm_bytes=comm,
                **({} if peak is None else {"peak_memory_bytes": peak}),
            )

    def _step_traffic(self) -> dict[str, int] | None:
        """This rank's collective bytes since the last call, inside a node and across nodes (None alone)."""
        counter = traffic.installed()
        return counter.take() if counter is not None and self.world.world_size > 1 else None

    def maybe_evaluate(self) -> None:
        every = self.cfg.train.eval_every
        if every and (self.counters.step % every == 0 or self.counters.step == self.total_steps):
            assert self.metrics is not None
            val_loss, by_source = self.evaluate()
            self.metrics.log_eval(self.counters.step, val_loss, sources=by_source or None)
            self.refresh_curves()

    def evaluate(self) -> tuple[float, dict[str, float]]:
        """The validation loss; for a mixture also each source's, the overall one their weighted mean."""
        if self.mixture is None:
            return self.engine.evaluate(self.val), {}
        losses = {name: self.engine.evaluate(batches) for name, batches in self.val_sources.items()}
        return weighted_loss(losses, self.mixture), losses

    def refresh_curves(self) -> None:
        """Rank 0 redraws RUN_DIR/curves.png (once per step); a plotting error is a warning, never a
        failed run."""
        if not self.world.is_main or self.curves_step == self.counters.step:
            return
        self.curves_step = self.counters.step
        try:
            plot.refresh(self.run_dir)
        except Exception as exc:
            assert self.metrics is not None
            reason = str(exc).splitlines()[0] if str(exc) else ""
            self.metrics.warn(f"{rundir.CURVES_FILE} not redrawn: {type(exc).__name__}: {reason}")

    # ------------------------------------------------------------ checkpoints

    def client_state(self) -> dict[str, Any]:
        """The registered state (RNG aside: checkpoint.save adds it), and what the run was saved with."""
        return {**self.state.state_dict(), "config": to_dict(self.cfg), "world_size": self.world.world_size}

    def save(self) -> None:
        assert self.metrics is not None
        result = checkpoint.save(
            self.engine,
            self.ckpt_root,
            self.counters.step,
            self.client_state(),
            rank=self.world.rank,
            world_size=self.world.world_size,
            keep=self.cfg.checkpoint.keep,
            keep_every=self.cfg.checkpoint.keep_every,
            space=self.space,
        )
        self.hooks.after_save()
        self.last_save_time = time.monotonic()
        if result.ok:
            self.last_saved_step = self.counters.step
            return
        message = f"checkpoint at step {self.counters.step} failed: {result.error}"
        if self.cfg.checkpoint.on_save_failure == "stop":
            raise SaveFailed(message)
        self.metrics.warn(message + "; retrying at the next interval")

    def restore(self, tag: str, warnings: list[str]) -> None:
        state = checkpoint.load(self.engine, self.ckpt_root, tag)
        self.state.load_state_dict(state, where=str(checkpoint.checkpoint_dir(self.ckpt_root, tag)))
        self.last_saved_step = self.counters.step
        if self.world.is_main:
            for warning in warnings:
                print(f"warning: {warning}", flush=True)
