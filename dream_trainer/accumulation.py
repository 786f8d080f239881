"""`AccumulationWindow`: the gradient accumulation window, one object with one owner.

A training step (one `global_step`) is a window of `gradient_accumulation_steps` micro-batches, fewer
for the last window of an epoch whose length is known. At its first micro-batch every optimizer's
gradients are zeroed, `backward` divides each loss by the window's size, a DDP model skips its gradient
all-reduce on every micro-batch but the last (`no_sync`; FSDP2 reduce-scatters every micro-batch into the
sharded `p.grad`: `Strategy.defers_gradient_sync` says why), and the optimizers step after the last one.
Everything the trainer knows about the window is here: its position and size, the flags the optimization
verbs set while it runs, its transitions (`advance`, `finish`, `close`, `restart`, `discard`), the
`no_sync` decision, and its checkpoint entry (`state_dict` / `load_state_dict`: the gradients accumulated
so far as each rank holds them, a DDP rank's own or an FSDP2 rank's shard) and exact copy (`snapshot` /
`restore`, for a tuning run or a rollback).

The trainer holds one (`TrainerCore._window`); `OptimizationMixin` registers it among the run's state
owners ("accumulation", see `dream_trainer.run_state`), so its entry reaches checkpoints by itself. The
full training step calls `advance` once per micro-batch and reads `end` and `no_sync`; `backward`, `step`
and the optimizer step note what they did (`note_backward`, `note_manual_step`, `note_unscaled`,
`note_step`). Callbacks read it through `trainer.loop` (`loop.window_pos`, `loop.step_ended`, ...). Its
fields are plain attributes, read on the hot path; only its own methods write them (`tests/test_ownership.py`
checks that no other file assigns one).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from torch import nn

from dream_trainer.errors import CheckpointError
from dream_trainer.utils.modules import unwrap
from dream_trainer.utils.warn import warn_user

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

Models = Iterable[tuple[str, nn.Module]]
"""`(attribute name, model)` pairs, as `trainer.named_models()` returns them."""

_COPIED = (
    "pos",
    "size",
    "end",
    "divisor",
    "no_sync",
    "manual_step",
    "backward",
    "backward_in_step",
    "stepped",
    "scaler_unscaled",
)


def _dtensor() -> type[DTensor]:
    # Imported when a checkpoint is written or read, not with the package (torch.distributed.tensor is slow
    # to import, and a run without it never needs it).
    from torch.distributed.tensor import DTensor

    return DTensor


def _local(grad: Any) -> Any:
    """A CPU copy of `grad`; of a DTensor's, this rank's part (FSDP2's sharded gradient, the only one
    it accumulates into: `Strategy.defers_gradient_sync`)."""
    local = grad.to_local() if isinstance(grad, _dtensor()) else grad
    return local.detach().to("cpu", copy=True)


def _sharded(models: Models) -> bool:
    """True when some model's parameters are DTensors (FSDP2, tensor parallel): their gradients are too,
    and a window's entry keeps each rank's part of them."""
    dtensor = _dtensor()
    return any(isinstance(p, dtensor) for _, m in models for p in unwrap(m).parameters())


def _on_param(saved: Any, param: Any, name: str) -> Any:
    """The gradient `saved` (an entry's CPU copy) as `param`'s `.grad`: on its device, a DTensor laid out
    as `param` where `param` is one (`saved` is this rank's part; on one process, the whole tensor)."""
    dtensor = _dtensor()
    if not isinstance(param, dtensor):
        return saved.to(param.device)
    local = param.to_local()
    if saved.shape != local.shape:  # the checkpoint's run split the parameters otherwise
        raise CheckpointError(
            f"this checkpoint's gradient of {name!r} inside an accumulation window has shape {tuple(saved.shape)}, "
            f"this rank's part of the parameter {tuple(local.shape)}: resume it with the parallel layout that "
            "wrote it, or from a checkpoint written at a step end"
        )
    mesh, placements = param.device_mesh, param.placements
    return dtensor.from_local(
        saved.to(local.device), mesh, placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def _lost_gradients(grads: Mapping[str, Any], models: list[tuple[str, nn.Module]]) -> bool:
    """An entry of an earlier version with no gradient at all for a model that trains: what FSDP2 left
    (its sync off inside the window, it kept them out of `p.grad`)."""
    return any(not grads.get(name) and any(p.requires_grad for p in unwrap(m).parameters()) for name, m in models)


def _mismatch(saved_sharded: bool) -> CheckpointError:
    kind, now = ("sharded (FSDP2 or tensor parallel)", "whole") if saved_sharded else ("whole", "sharded")
    return CheckpointError(
        f"this checkpoint was written inside an accumulation window with {kind} gradients, and this run's "
        f"parameters are {now}: resume it with the strategy that wrote it, or from a checkpoint written at a "
        "step end\n"
        "Inside a window the gradients accumulated so far are saved as each rank holds them (each rank's own "
        "under DDP, each rank's shard of the synchronised gradient under FSDP2); another layout cannot continue "
        "the window exactly."
    )


def written_in_window(checkpoint: Mapping[str, Any]) -> bool:
    """True when `checkpoint` was written inside an accumulation window (its `window` entry holds one)."""
    return checkpoint.get("window") is not None


class AccumulationWindow:
    """The accumulation window (see the module docstring). Read its fields anywhere; they change through
    its methods only.

    Attributes:
        steps: `gradient_accumulation_steps`, micro-batches in a full window.
        pos: micro-batches of the current window begun so far (1-based while one runs); 0 between steps.
        size: micro-batches in the current window (`steps`, fewer for an epoch's last window).
        end: the running micro-batch completes its window: the optimizers step after it (True outside
            any window, so that `trainer.step()` there acts at once).
        divisor: what `backward` divides a loss by (the window's size), so the window's gradient is the
            mean over its micro-batches.
        no_sync: the running micro-batch (forward and backward) skips gradient synchronisation: inside a
            window, when some model defers its synchronisation to the window's last micro-batch (DDP).
        manual_step: the user's step called `trainer.step()`: the trainer steps no optimizer itself.
        backward: some backward ran in this window (else there is nothing to step).
        backward_in_step: the running micro-batch called `backward` (else the trainer backpropagates the
            loss its step returned).
        stepped: an optimizer already stepped in this window (a retry of the batch would step it twice).
        scaler_unscaled: the fp16 loss scaler unscaled gradients in this window: its `update()` is due.
    """

    __slots__ = ("_syncs", *_COPIED, "steps")

    def __init__(self, steps: int = 1) -> None:
        self.steps = steps
        self.pos = 0
        self.size = 1
        self.end = True
        self.divisor = 1
        self.no_sync = False
        self.manual_step = False
        self.backward = False
        self.backward_in_step = False
        self.stepped = False
        self.scaler_unscaled = False
        self._syncs = False  # some model defers its gradient sync to a window's end (set at setup)

    # --- setup ------------------------------------------------------------------------------------
    def sync_gradients(self, syncs: bool) -> None:
        """Whether some model defers its gradient synchronisation to a window's end (DDP; the strategy's
        `defers_gradient_sync`): then every micro-batch of a window but its last runs under the strategy's
        `no_sync`. Set when the models are wrapped."""
        self._syncs = syncs

    # --- the hot path: one call per micro-batch ------------------------------------------------------
    def advance(self, batch_idx: int, epoch_length: int | None) -> bool:
        """Micro-batch `batch_idx` (of an epoch of `epoch_length` batches, None: unknown) starts. True when
        it opens a window: the caller zeroes every optimizer's gradients before it runs."""
        opens = self.pos == 0
        if opens:
            size = self.steps
            if size > 1 and epoch_length is not None and 0 <= batch_idx < epoch_length < batch_idx + size:
                size = epoch_length - batch_idx  # the epoch's last window: the mean over what it has
            self.size = self.divisor = size
            self.manual_step = self.backward = self.stepped = self.scaler_unscaled = False
        self.backward_in_step = False
        pos = self.pos = self.pos + 1
        end = self.end = pos >= self.size
        self.no_sync = self._syncs and not end
        return opens

    def note_backward(self) -> None:
        """A backward ran in the running micro-batch (`trainer.backward`, or a pipeline schedule's)."""
        self.backward_in_step = self.backward = True

    def note_manual_step(self) -> None:
        """The user's step called `trainer.step()`: no automatic step for this window."""
        self.manual_step = True

    def note_unscaled(self) -> None:
        """The fp16 loss scaler unscaled an optimizer's gradients: its `update()` is due at the window's end."""
        self.scaler_unscaled = True

    def note_step(self) -> None:
        """An optimizer stepped in this window."""
        self.stepped = True

    def finish(self) -> None:
        """The window's optimizer step is done (the loop counts one more training step): between steps now."""
        self.pos = 0

    # --- the other transitions --------------------------------------------------------------------
    def close(self) -> bool:
        """The loader ended inside a window (a loader without a length): the micro-batch run last
        completes it. True when a window was open (the caller steps the optimizers and finishes it)."""
        if self.pos == 0:
            return False
        self.end = True
        self.no_sync = False
        return True

    def restart(self) -> None:
        """The running micro-batch runs again from the window's start (non_finite_grads="retry"): the
        caller zeroed the gradients; what the window noted is forgotten (its position stays)."""
        self.manual_step = self.backward = self.backward_in_step = self.stepped = self.scaler_unscaled = False

    def discard(self) -> None:
        """No window is open any more: a step raised inside one (a tuner goes on with a new one), or an
        epoch starts that does not continue the one this window belongs to. The next micro-batch opens one."""
        self.pos = 0

    # --- checkpoints --------------------------------------------------------------------------------
    def entry(self, models: Models) -> dict[str, Any] | None:
        """This process's checkpoint entry: None between steps; inside a window its position, what it
        noted, and the gradients accumulated so far (CPU copies, by model and parameter name). A sharded
        parameter's (a DTensor's: FSDP2, tensor parallel) is this rank's part of it (`sharded`: True)."""
        if self.pos == 0:
            return None
        models = list(models)  # read twice
        grads = {
            name: {pn: _local(p.grad) for pn, p in unwrap(m).named_parameters() if p.grad is not None}
            for name, m in models
        }
        return {
            "pos": self.pos,
            "size": self.size,
            "manual_step": self.manual_step,
            "backward": self.backward,
            "sharded": _sharded(models),
            "grads": grads,
        }

    def state_dict(
        self, models: Models, gather: Callable[[Any], list[Any] | None] | None = None, rank: int = 0
    ) -> dict[str, Any]:
        """The checkpoint's entries: `window`, this rank's entry (None between steps; the format of every
        earlier version), and with several processes `window_per_rank`, every rank's on the rank that
        writes the file (`gather`: a gather of an object to that rank, called on every rank; it returns None
        on the others, whose `window_per_rank` is then None). Inside a window each rank's gradients are its
        own (under DDP not yet synchronised; under FSDP2 its shard of the synchronised ones): a resume
        gives every rank back its own."""
        own = self.entry(models)
        per_rank = gather(own) if gather is not None else None
        if per_rank is not None:
            per_rank[rank] = own  # the same tensors as `window`: a checkpoint file stores them once
        return {"window": own, "window_per_rank": per_rank}

    def load_state_dict(
        self, checkpoint: Mapping[str, Any], models: Models, rank: int = 0, world_size: int = 1
    ) -> None:
        """Continue the window `checkpoint` was written in (this rank's own entry when as many ranks wrote
        it; `window` otherwise, and in checkpoints of earlier versions), its gradients put back on the
        models' parameters; written between steps, none is open. With several processes, raises
        `CheckpointError` when the window's gradients were sharded and this run's parameters are not, or the
        other way round (another strategy: the parts cannot be put together or split exactly)."""
        per_rank = checkpoint.get("window_per_rank")
        saved = per_rank[rank] if per_rank and len(per_rank) == world_size else checkpoint.get("window")
        if saved is None:
            self.discard()
            return
        models = list(models)  # read twice
        # On one process a shard is the whole tensor; on several, whole gradients (each DDP rank's own) and
        # shards (of the synchronised ones) do not convert. Entries of earlier versions hold whole tensors.
        if world_size > 1 and saved.get("sharded", False) != _sharded(models):
            raise _mismatch(saved.get("sharded", False))
        self.pos = saved["pos"]
        self.size = self.divisor = saved["size"]
        self.end = self.pos >= self.size
        self.no_sync = self._syncs and not self.end
        self.manual_step = saved["manual_step"]
        self.backward = saved["backward"]
        self.backward_in_step = self.stepped = self.scaler_unscaled = False
        grads = saved["grads"]
        for name, model in models:
            own = grads.get(name, {})
            for pn, p in unwrap(model).named_parameters():
                p.grad = _on_param(own[pn], p, pn) if pn in own else None
        if "sharded" not in saved and self.backward and _lost_gradients(grads, models):
            warn_user(
                "this checkpoint was written inside an accumulation window by an earlier version of "
                "dream_trainer under FSDP, which saved none of the window's gradients: the resumed step holds "
                "only the micro-batches after it and differs from an uninterrupted run; resume from a "
                "checkpoint written at a step end for an exact continuation"
            )

    # --- an exact copy (a tuning run, a rollback; the gradients are copied with the models) ----------
    def snapshot(self) -> tuple[Any, ...]:
        """Every field as it is now."""
        return tuple(getattr(self, name) for name in _COPIED)

    def restore(self, saved: tuple[Any, ...]) -> None:
        """Put back what `snapshot()` returned."""
        for name, value in zip(_COPIED, saved, strict=True):
            setattr(self, name, value)

    def __repr__(self) -> str:
        return f"AccumulationWindow({self.pos}/{self.size}, steps={self.steps}, end={self.end})"
