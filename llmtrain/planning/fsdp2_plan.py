"""TrainConfig -> what the FSDP2 engine does, as a plain dict: the one place FSDP2's settings are
decided. `fsdp2.build_engine` applies it, `llmtrain config --engine fsdp2` prints it, and a run keeps
it as RUN_DIR/fsdp2_plan.json, as DeepSpeed runs keep ds_config.json. No torch import."""

from __future__ import annotations

from typing import Any

from llmtrain import precision
from llmtrain.config import TrainConfig
from llmtrain.planning import rules
from llmtrain.planning.layout import fsdp_mesh


def build(cfg: TrainConfig, world_size: int, ranks_per_node: int | None = None) -> dict[str, Any]:
    """`ranks_per_node`: the processes of each node (default --gpus), as the running job finds them:
    on several nodes FSDP2 shards within them by default (HSDP)."""
    layout = cfg.layout(world_size)
    global_batch, micro, accumulation = rules.batch_triple(
        cfg.train.micro_batch, cfg.train.global_batch, layout.dp
    )
    mesh = fsdp_mesh(layout, cfg.parallel.dp_shard, ranks_per_node or cfg.launch.gpus)
    # auto is decided by now in a run's config; elsewhere (`llmtrain config`) as a run here would decide it.
    bf16 = precision.concrete(cfg.train.precision) == "bf16"
    o = cfg.optim
    return {
        "engine": "fsdp2",
        "train_batch_size": global_batch,
        "micro_batch_per_rank": micro,
        "gradient_accumulation_steps": accumulation,
        # HSDP when replicate > 1: each parameter sharded over `shard` data-parallel ranks (a node's),
        # the shards' gradients all-reduced across the `replicate` groups; tp: split by
        # parallel.dtensor_tp within each data-parallel rank's tp group.
        "mesh": mesh,
        "fully_shard": {
            "units": [f"layers.{i}" for i in range(cfg.model.num_hidden_layers)] + ["root"],
            "reshard_after_forward": cfg.zero.stage == 3,
            "mp_policy": {
                "param_dtype": "bfloat16" if bf16 else None,
                "reduce_dtype": "float32" if bf16 else None,
            },
            "offload_policy": cfg.zero.offload,
        },
        "gradient_sync": "last micro-batch of each step",
        "gradient_clipping": o.grad_clip,
        "optimizer": {
            "type": "torch.optim.AdamW",
            "lr": o.lr,
            "betas": [o.beta1, o.beta2],
            "eps": o.eps,
            "weight_decay": o.weight_decay,
            "weight_decay_on": "weight matrices (not norms, not the embedding)",
            "foreach": False,
        },
        "activation_checkpointing": cfg.train.activation_checkpointing,
        "compile_blocks": cfg.compiles,
    }
