"""Pipeline parallelism: model.py's Llama as DeepSpeed pipeline stages, and the engine that runs them.

The stages are the model's own modules, not a second model: `EmbedStage` holds the embedding,
`BlockStage` is model.Block, `NormStage` the final RMSNorm and `HeadStage` the output layer; the loss
is llmtrain.loss's fused output layer and cross-entropy. Parameter names inside each stage
are model.py's, so stages.layer_prefix maps a stage's state dict to the one-process model's, which is
how weights are initialised (`init_stage_weights`: the same values a one-process build draws) and
how checkpoints are exported.

Between stages travels a tuple: the hidden states, the RoPE positions, the labels and, with document
masking, the document ids (integer tensors get no gradient; DeepSpeed sends only the floating one
back). Each block recomputes its cos/sin (and mask) from them: a few thousand multiplies, against
sending two float tables through every stage boundary. The output layer computes the loss in its own
forward rather than in DeepSpeed's `loss_fn`: measured with DeepSpeed 0.19.8 in bf16, a weight used
only by `loss_fn` received its gradient and then had it zeroed before the bf16 optimizer collected it
(the output layer never trained), while every weight used inside the engine's forward keeps its own.

Tied embeddings use DeepSpeed's TiedLayerSpec: the last stage holds a copy of the embedding, whose
gradient DeepSpeed sums with the first stage's every step, so both copies stay equal.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.schedule import BackwardPass, ForwardPass
from torch import Tensor, nn

from llmtrain import checkpoint
from llmtrain.config import ModelConfig, TrainConfig
from llmtrain.engine import pretrained
from llmtrain.engine.base import Batch, BeforeUpdate, JudgeNorm, never_skip
from llmtrain.engine.ds_engine import DeepSpeedEngine, param_groups, use_deepspeed_checkpointing
from llmtrain.engine.pipe_schedules import SCHEDULES, AgreeOnUpdate
from llmtrain.loss import OutputLayer, output_layer
from llmtrain.model import (
    Block,
    Recompute,
    RMSNorm,
    TokenEmbedding,
    build_model,
    checkpointed_blocks,
    document_positions_and_mask,
    init_parameter,
    rope_cos_sin,
    rope_inv_freq,
    torch_recompute,
)
from llmtrain.parallel import tensor as tensor_parallel
from llmtrain.parallel.mesh import process_groups
from llmtrain.planning import stages
from llmtrain.planning.layout import Layout
from llmtrain.planning.partition import kv_replicas
from llmtrain.quiet import held_stdout

TIED_KEY = "embed"


class _Stage:
    """A pipeline layer whose parameters, prefixed with `prefix`, are the one-process model's."""

    prefix = ""


def _allocated(module: nn.Module, device: torch.device) -> None:
    """Storage for a module built on the meta device, left uninitialised: init_stage_weights or a
    checkpoint fills it (no throwaway default initialisation, no draw from torch's global RNG)."""
    module.to_empty(device=device)


class EmbedStage(_Stage, nn.Module):
    """(input_ids, labels[, doc_ids]) -> (hidden states, RoPE positions, labels[, doc_ids])."""

    def __init__(self, cfg: ModelConfig, device: torch.device) -> None:
        super().__init__()
        with torch.device("meta"):
            self.embed_tokens = TokenEmbedding(cfg.vocab_size, cfg.hidden_size)
        _allocated(self, device)

    def forward(self, inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        input_ids, labels, *doc_ids = inputs
        B, T = input_ids.shape
        if doc_ids:
            positions, _ = document_positions_and_mask(doc_ids[0])
        else:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        return (self.embed_tokens(input_ids), positions.contiguous(), labels, *doc_ids)


class BlockStage(_Stage, Block):
    """model.Block on the pipeline's tuple; activation checkpointing per block, as in model.Llama."""

    def __init__(self, cfg: ModelConfig, device: torch.device, index: int, checkpointed: bool) -> None:
        with torch.device("meta"):
            super().__init__(cfg)
        _allocated(self, device)
        self.prefix = stages.layer_prefix(index + 1, cfg.num_hidden_layers)
        self.model_cfg = cfg
        self.checkpointed = checkpointed
        self.recompute: Recompute = torch_recompute  # as model.Llama's

    def forward(self, inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:  # type: ignore[override]
        x, positions, labels, *doc_ids = inputs
        cos, sin = rope_cos_sin(positions, rope_inv_freq(self.model_cfg, x.device), x.dtype)
        mask = document_positions_and_mask(doc_ids[0])[1] if doc_ids else None
        block = super().forward
        if self.checkpointed and torch.is_grad_enabled():
            x = self.recompute(block, x, cos, sin, mask)
        else:
            x = block(x, cos, sin, mask)
        return (x, positions, labels, *doc_ids)


class NormStage(_Stage, nn.Module):
    """The final RMSNorm: the pipeline's tuple -> (normed hidden states [B, T, D], labels)."""

    def __init__(self, cfg: ModelConfig, device: torch.device) -> None:
        super().__init__()
        with torch.device("meta"):
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        _allocated(self, device)

    def forward(self, inputs: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
        return self.norm(inputs[0]), inputs[2]


class HeadStage(_Stage, nn.Module):
    """The untied output layer: (hidden states, labels) -> the mean cross-entropy, fused with the
    projection (llmtrain.loss), so the whole logits tensor is never built."""

    def __init__(self, cfg: ModelConfig, device: torch.device) -> None:
        super().__init__()
        with torch.device("meta"):
            self.lm_head = OutputLayer(cfg.hidden_size, cfg.vocab_size)
        _allocated(self, device)

    def forward(self, inputs: tuple[Tensor, Tensor]) -> Tensor:
        h, labels = inputs
        loss: Tensor = self.lm_head(h, labels)
        return loss


def _tied_head(embedding: EmbedStage, inputs: tuple[Tensor, Tensor]) -> Tensor:
    """The tied output layer: the loss projected with the last stage's copy of the embedding."""
    h, labels = inputs
    embed_tokens = embedding.embed_tokens
    return output_layer(h, embed_tokens.weight, labels, group=embed_tokens.tp_group)


class LlamaPipeline(PipelineModule):
    """PipelineModule whose stage boundaries come from llmtrain.planning.stages (the estimator's)."""

    def __init__(self, model: ModelConfig, method: str, *args: Any, **kwargs: Any) -> None:
        self._stage_layers = stages.pipeline_layers(model)  # read by _partition_layers, inside __init__
        self._stage_method = method
        super().__init__(*args, **kwargs)

    def _partition_layers(self, method: str = "parameters") -> None:
        self.parts = stages.stage_bounds(self._stage_layers, self.num_stages, self._stage_method)
        stage_id = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])


def layer_specs(cfg: TrainConfig, device: torch.device) -> list[Any]:
    m = cfg.model
    recomputed = set(
        checkpointed_blocks(
            m.num_hidden_layers, cfg.train.activation_checkpointing, cfg.train.checkpoint_every_k
        )
    )
    blocks = [LayerSpec(BlockStage, m, device, i, i in recomputed) for i in range(m.num_hidden_layers)]
    if m.tie_word_embeddings:
        embed = TiedLayerSpec(TIED_KEY, EmbedStage, m, device, tied_weight_attr="embed_tokens.weight")
        head = TiedLayerSpec(
            TIED_KEY, EmbedStage, m, device, forward_fn=_tied_head, tied_weight_attr="embed_tokens.weight"
        )
    else:
        embed, head = LayerSpec(EmbedStage, m, device), LayerSpec(HeadStage, m, device)
    return [embed, *blocks, LayerSpec(NormStage, m, device), head]


def build_pipeline(cfg: TrainConfig, device: torch.device, layout: Layout) -> LlamaPipeline:
    """This rank's stage of the model, initialised as a one-process build from the run's seed."""
    # DeepSpeed prints its seeds and topology (held back: stdout is the run's progress), and broadcasts
    # a tied embedding in place (outside autograd: the weights are initialised below).
    with held_stdout(), torch.no_grad():
        pipe = LlamaPipeline(
            cfg.model,
            cfg.parallel.pp_partition,
            layer_specs(cfg, device),
            topology=pipeline_topology(layout),
            partition_method="parameters",  # not read: LlamaPipeline partitions
        )
    if cfg.train.init_from is None:
        init_stage_weights(pipe, cfg.model, cfg.train.seed)
    else:
        pretrained.stage_fill(stage_parameters(pipe), pretrained.open_weights(cfg.train.init_from))
    if cfg.compiles:
        for module in pipe.modules():
            if isinstance(module, BlockStage):
                module.compile()
    return pipe


def pipeline_topology(layout: Layout) -> Any:
    """DeepSpeed's topology of the layout, whose rank order (pipe outermost, model = tp innermost) is the
    mesh's (rules refuse sp beside pp). Without tp, the (pipe, data) one: its layer files then keep the
    names they have without tensor parallelism (`layer_NN-model_states.pt`)."""
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology, PipeModelDataParallelTopology

    if layout.tp == 1:
        return PipeDataParallelTopology(num_pp=layout.pp, num_dp=layout.dp)
    return PipeModelDataParallelTopology(num_pp=layout.pp, num_mp=layout.tp, num_dp=layout.dp)


def named_parameters(pipe: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """This rank's parameters, each once, by the one-process model's names."""
    return [(name, params[0]) for name, params in stage_parameters(pipe).items()]


def stage_parameters(pipe: nn.Module) -> dict[str, list[nn.Parameter]]:
    """This rank's parameters by the one-process model's names (a tied embedding may appear twice on a
    one-stage pipe: as the embedding and as the output layer's copy, which are one module then)."""
    found: dict[str, list[nn.Parameter]] = {}
    for module in pipe.modules():
        if isinstance(module, _Stage):
            for name, param in module.named_parameters():
                params = found.setdefault(module.prefix + name, [])
                if all(p is not param for p in params):
                    params.append(param)
    return found


@torch.no_grad()
def init_stage_weights(pipe: nn.Module, model: ModelConfig, seed: int) -> None:
    """The weights a one-process `build_model(model, seed=seed)` draws, for this stage's parameters.

    The generator walks the whole model's parameters in model.py's order; another stage's are drawn
    into a scratch buffer and dropped, so every stage holds exactly the one-process values while no
    rank ever allocates the whole model.
    """
    local = stage_parameters(pipe)
    device = next(iter(local.values()))[0].device
    generator = torch.Generator(device=device).manual_seed(seed)
    scratch = torch.empty(0, device=device)
    for name, meta in build_model(model, device="meta").named_parameters():
        targets = local.get(name)
        if targets is None:
            if scratch.numel() < meta.numel():
                scratch = torch.empty(meta.numel(), device=device)
            init_parameter(name, scratch[: meta.numel()].view(meta.shape), model, generator)
            continue
        init_parameter(name, targets[0], model, generator)
        for copy in targets[1:]:
            copy.copy_(targets[0])


# ---------------------------------------------------------------- the engine's pipeline step


def install_schedule(engine: Any, schedule: str) -> None:
    """Run `schedule` in engine.train_batch, with llmtrain's agreement before the update.

    `engine.before_update(loss_sum, count) -> skip` is set by the trainer before each step.
    """
    cls = SCHEDULES[schedule]
    engine._train_schedule = lambda: cls(
        micro_batches=engine.micro_batches, stages=engine.num_stages, stage_id=engine.stage_id
    )
    engine._INSTRUCTION_MAP = {
        **type(engine)._INSTRUCTION_MAP,
        ForwardPass: _forward_pass,
        BackwardPass: _backward_pass,
        AgreeOnUpdate: agree_on_update,
    }
    engine.before_update = None
    engine.losses_in_flight = {}


def _forward_pass(engine: Any, buffer_id: int) -> None:
    """DeepSpeed's forward, keeping the last stage's loss per buffer: its backward reads `engine.loss`,
    the latest forward's, which is the right one under 1F1B only (GPipe runs all forwards first)."""
    type(engine)._exec_forward_pass(engine, buffer_id)
    if engine.is_last_stage():
        engine.losses_in_flight[buffer_id] = engine.loss


def _backward_pass(engine: Any, buffer_id: int) -> None:
    if engine.is_last_stage():
        engine.loss = engine.losses_in_flight.pop(buffer_id)
    type(engine)._exec_backward_pass(engine, buffer_id)


def agree_on_update(engine: Any) -> None:
    """The AgreeOnUpdate instruction: the last stage's summed micro-batch losses (nothing elsewhere)
    go to the trainer's agreement; a skip poisons this rank's gradients with NaN, and DeepSpeed's
    overflow check in the optimizer step then drops the update on every rank."""
    if engine.is_last_stage():
        loss_sum, count = engine.total_loss.detach().float(), engine.micro_batches
    else:
        loss_sum, count = torch.zeros((), device=engine.device), 0
    if engine.before_update(loss_sum, count):
        for grad in _accumulated_gradients(engine):
            grad.fill_(float("nan"))


def _accumulated_gradients(engine: Any) -> Iterator[Tensor]:
    """Where this step's gradients are accumulated: the bf16 optimizer's fp32 buffers, or p.grad."""
    if engine.using_bf16_optimizer:
        yield from engine.optimizer.fp32_groups_gradients_flat
        return
    for param in engine.module.parameters():
        if param.grad is not None:
            yield param.grad


def build_engine(
    cfg: TrainConfig, ds_config: dict[str, Any], device: torch.device, world_size: int
) -> PipelineEngine:
    """This rank's pipeline stage in DeepSpeed's PipelineEngine, running the configured schedule. The
    module builds its own process groups (its grid, from the mesh's topology) over DeepSpeed's
    communication layer, into which process_groups adopts torch's group; under tp the stage's blocks
    are split over the mesh's tensor group, the same ranks as the grid's model axis."""
    import deepspeed

    layout = cfg.layout(world_size)
    mesh = process_groups(layout)
    pipe = build_pipeline(cfg, device, layout)
    if mesh is not None and layout.tp > 1:  # tensor parallelism inside each stage, over its tensor group
        tensor_parallel.shard_over(pipe, mesh, cfg.model.num_key_value_heads)
    use_deepspeed_checkpointing(pipe, ds_config, mesh, device)
    groups = param_groups(named_parameters(pipe), cfg.optim.weight_decay)
    with held_stdout():  # the bf16 optimizer prints memory reports
        engine, *_ = deepspeed.initialize(model=pipe, model_parameters=groups, config=ds_config)
    install_schedule(engine, cfg.parallel.pp_schedule)
    copies = kv_replicas(cfg.model.num_key_value_heads, layout.tp)
    return PipelineEngine(engine, device, layout, kv_replicas=copies)


class PipelineEngine(DeepSpeedEngine):
    """DeepSpeed's PipelineEngine behind the engine interface: a step is one `train_batch` (the
    schedule runs every forward, backward and the update); the agreement runs inside it, as the
    AgreeOnUpdate instruction. Its forward and backward are not callable on their own (DeepSpeed
    refuses them in pipeline mode)."""

    def run_step(
        self,
        micro_batches: list[Batch],
        on_loss: Callable[[Tensor], Tensor],
        before_update: BeforeUpdate,
        judge_norm: JudgeNorm = never_skip,
    ) -> float | None:
        """The loss exists on the last stage only, so `on_loss` sees each rank's share of the step's sum."""
        self.ds.before_update = lambda loss_sum, count: before_update(on_loss(loss_sum), count)
        self.ds.train_batch(feed(micro_batches))
        return self._engine_grad_norm()

    def load(self, ckpt_root: Path, tag: str) -> None:
        """A universal checkpoint (another layout's, checkpoint.universal) names each parameter as the
        one-process model does; DeepSpeed's optimizer looks it up by the pipeline's layer-indexed names, so
        for this load it is given the model's names of the same parameters."""
        if not tag.endswith(checkpoint.UNIVERSAL_SUFFIX):
            super().load(ckpt_root, tag)
            return
        model_names = {
            id(p): name for name, params in stage_parameters(self.ds.module).items() for p in params
        }
        pipeline_names = self.optimizer.param_names
        self.optimizer.param_names = {p: model_names[id(p)] for p in pipeline_names}
        try:
            super().load(ckpt_root, tag)
        finally:
            self.optimizer.param_names = pipeline_names

    def evaluate(self, batches: list[Batch]) -> float:
        """Mean loss over `batches` (this data rank's), averaged over data-parallel ranks, on every rank
        (0 for no batches, as without a pipeline)."""
        if not batches:
            return 0.0
        return float(self.ds.eval_batch(feed(batches), num_micro_batches=len(batches)))


def feed(micro_batches: list[dict[str, Tensor]]) -> Iterator[tuple[tuple[Tensor, ...], Tensor]]:
    """The step's micro-batches as the pipeline engine reads them: (first stage's inputs, labels).
    The labels travel with the inputs (the output layer computes the loss); DeepSpeed's own copy for
    the last stage's `loss_fn` goes unused."""
    for batch in micro_batches:
        doc_ids = (batch["doc_ids"],) if "doc_ids" in batch else ()
        yield (batch["input_ids"], batch["labels"], *doc_ids), batch["labels"]
