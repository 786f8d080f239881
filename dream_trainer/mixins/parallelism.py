"""ParallelismMixin: the override points of large-model setup, and the mesh as the user sees it.

Setup calls them in a fixed order (see `dream_trainer.parallel.model_parallel`):
`apply_tensor_parallel(tp_mesh)` -> `apply_pipeline_parallel(pp_mesh)` -> `apply_activation_checkpointing()`
-> `apply_compile()` -> `apply_fully_shard(model)` per model -> `init_weights()` (meta-device init).
Each has a default that does the simple thing, or an error naming the setting that needs it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dream_trainer.mixins.optimization import OptimizationMixin
from dream_trainer.parallel.pipeline import Pipeline
from dream_trainer.utils.modules import has_trainable_parameters


class ParallelismMixin(OptimizationMixin):
    """`device_mesh`, `dp_rank`/`dp_world_size`, and the parallelism override points."""

    def _init_parallelism(self) -> None:
        self._pipeline: Pipeline | None = None
        """This rank's pipeline stages and their schedule (pipeline_parallel > 1)."""
        self._meta_models: list[str] = []
        """Names of the models built on the meta device: what `init_weights()` initializes."""

    # --- the mesh -----------------------------------------------------------------------------------
    @property
    def device_mesh(self) -> Any:
        """The world `DeviceMesh` of `strategy="model_parallel"` (None for other strategies). Named
        sub-meshes: `self.parallel.submesh("tp")`, `"dp"`, `"pp"`, `"dp_shard_cp"`, ..."""
        return self.parallel.mesh

    @property
    def dp_rank(self) -> int:
        """This process's data-parallel rank: which slice of the data it reads. Ranks of one
        tensor-/context-/pipeline-parallel group share it (they work on the same batch)."""
        return int(self.parallel.data_parallel_rank)

    @property
    def dp_world_size(self) -> int:
        """How many different batches one step sees (dp_replicate x dp_shard)."""
        return int(self.parallel.data_parallel_size)

    # --- override points, in the order setup calls them ---------------------------------------------
    def apply_tensor_parallel(self, tp_mesh: Any) -> None:
        """Shard the models over `tp_mesh` with `torch.distributed.tensor.parallel.parallelize_module`
        (called when `tensor_parallel > 1`). There is no generic plan: override it."""
        from dream_trainer.parallel.tensor_parallel import tensor_parallel_plan_error

        tensor_parallel_plan_error(tp_mesh.size())

    def apply_pipeline_parallel(self, pp_mesh: Any) -> None:
        """Split the model into pipeline stages (called when `pipeline_parallel > 1`). The default
        splits `self.model`, an `nn.Sequential`, into stages balanced by parameter count. Override it
        to split your way, then call `self.set_pipeline(stage_modules, stage_indices)`."""
        from dream_trainer.parallel.pipeline import default_split

        self.set_pipeline(*default_split(self, pp_mesh))

    def set_pipeline(self, stage_modules: list[nn.Module], stage_indices: list[int]) -> None:
        """Make `stage_modules` (stage numbers `stage_indices`) this rank's part of the pipeline:
        `self.model` becomes one container of their blocks under their original names (so checkpoints
        hold the whole model's keys), and `pipeline_forward` runs them through the schedule."""
        from dream_trainer.parallel.pipeline import stage_container

        pp_mesh = self.parallel.submesh("pp")
        self._pipeline = Pipeline(stage_modules, stage_indices, pp_mesh, self.config)
        self.model = stage_container(stage_modules)

    @property
    def pipelined(self) -> bool:
        """True when this run splits the model into pipeline stages (`pipeline_parallel > 1`)."""
        return self._pipeline is not None

    def pipeline_loss(self, outputs: Any, targets: Any) -> torch.Tensor:
        """The loss of a batch (or micro-batch) from the model's outputs; used by `pipeline_forward`.
        Override it; it must return the mean over the batch."""
        raise NotImplementedError(
            f"{type(self).__name__}.pipeline_forward needs `def pipeline_loss(self, outputs, targets)` returning "
            "the mean loss, e.g. `return F.cross_entropy(outputs, targets)`"
        )

    def pipeline_forward(self, inputs: Any, targets: Any) -> torch.Tensor:
        """`pipeline_loss(self.model(inputs), targets)`, written once for every mesh.

        Without pipeline parallelism it is exactly that (the trainer backpropagates the returned loss
        as usual). Under `pipeline_parallel > 1` the schedule splits the batch into micro-batches and runs
        forward (and, when training, backward) through the stages; every rank gets the mean loss (the
        last stage's, broadcast), and the trainer does not backpropagate again. `on_before_backward` /
        `on_after_backward` do not fire under pipeline parallelism: the schedule runs the backward.
        """
        pipeline = self._pipeline
        if pipeline is None:
            return self.pipeline_loss(self.model(inputs), targets)
        scale = 1.0 / self._window.divisor  # the mean over the accumulation window's micro-batches
        loss = pipeline.run(inputs, targets, self.device, self.pipeline_loss, scale)
        if torch.is_grad_enabled():
            self._note_backward()  # the schedule ran the backward
        return loss

    def apply_activation_checkpointing(self) -> None:
        """Recompute activations in backward, per top-level block, when `config.activation_checkpointing`
        is "full" or "selective" (every model with trainable parameters). Override to choose blocks."""
        mode = self.config.activation_checkpointing
        if mode is None:
            return
        from dream_trainer.parallel.activation_checkpoint import apply_activation_checkpointing

        for _, model in self.named_models():
            if has_trainable_parameters(model):
                apply_activation_checkpointing(model, mode)

    def apply_compile(self) -> None:
        """`torch.compile` each block of every model in place (called by mesh strategies when
        `config.compile_model`; block by block, so FSDP2 can shard around compiled blocks)."""
        from dream_trainer.parallel.data_parallel import iter_blocks

        for _, model in self.named_models():
            blocks = [b for b in iter_blocks(model) if not any(True for _ in iter_blocks(b))]
            for block in blocks or [model]:
                block.compile()

    def init_weights(self) -> None:
        """Initialize the parameters of models built on the meta device (`config.init_device="meta"`),
        after they were allocated on the device: by default every module's own `reset_parameters()`.
        Runs under `torch.no_grad()`. Override to initialize your way (a module that owns parameters
        and has no `reset_parameters` is an error with the default)."""
        from dream_trainer.parallel.meta_init import reset_all_parameters

        for name, model in self.named_models():
            if name in self._meta_models:  # models built eagerly keep their weights
                reset_all_parameters(model)

    # --- meta-device construction --------------------------------------------------------------------
    def _materialize_models(self) -> None:
        """Allocate meta parameters on the device, run `init_weights()`, then check every model: no
        parameter left on meta, none non-finite (an error names them)."""
        from dream_trainer.parallel.meta_init import check_finite_weights, check_materialized

        device: torch.device = self.device
        named = [(n, m) for n, m in self.named_models() if any(t.is_meta for t in (*m.parameters(), *m.buffers()))]
        self._meta_models = [n for n, _ in named]
        models = [m for _, m in named]
        for model in models:
            model.to_empty(device=device)
        with torch.no_grad():
            self.init_weights()
        # One group for every rank's verdict: a NaN in one rank's shard stops all of them together.
        group = torch.distributed.group.WORLD if torch.distributed.is_initialized() else None
        for model in models:
            check_materialized(model)
            check_finite_weights(model, group=group)
