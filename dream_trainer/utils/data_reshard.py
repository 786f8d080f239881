"""Continuing an epoch on another number of data-parallel ranks: a checkpoint written mid-epoch by N
processes, resumed by M (or with another batch size).

Each rank's place in the data belongs to the part of it that rank read, and another number of ranks
splits the data otherwise. Where the order of the samples over all ranks together does not depend on
their number (`global_order`: an unshuffled loader, a `DistributedSampler`, `GlobalOrderSampler`, a
`ShardedIterable` such as `TokenDataset` or `ShardList` read in each rank's process or one worker; a stream
whose shards hold several samples is read as the parts of the run's start, `dream_trainer.data.parts`), a
rank of a step reads positions
`r, r + size, ...` of one sequence, so the ranks together consume that sequence from its start: the position
is a *global sample cursor*, the samples of the epoch's order done (batches done x per-rank batch x ranks).
Any number of ranks continues from it: each skips `cursor / (batch x ranks)` batches of its own part (a
stream's part starts there: `ShardedIterable.continue_part_at`), which then begins at the cursor. Where only
the number of ranks would change the samples per optimizer step, the resume is refused
(`global_batch_refusal`). Everything else is refused, with the reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from dream_trainer.errors import CheckpointError
from dream_trainer.utils.data_resume import global_order, order_source, samples_per_step

__all__ = [
    "as_order", "changed_step_size", "global_batch_refusal", "resharded_position", "samples_done", "saved_accumulation",
]  # fmt: skip

_DETAILS = (
    "Each rank's place in the data belongs to the part of the data it read, and another number of ranks "
    "splits the data otherwise. The trainer continues an epoch on another data-parallel size where the order "
    "of the samples over all ranks does not depend on their number (an unshuffled loader, the DistributedSampler "
    "the trainer gives a shuffling loader, dream_trainer.data.GlobalOrderSampler, a TokenDataset or ShardList "
    "read with num_workers 0 or 1): the ranks skip the samples the "
    "checkpoint's ranks had done together and read on from there. A checkpoint written at an epoch end resumes on "
    "any number of processes. See docs/checkpointing.md, 'Another number of processes'."
)


def as_order(value: Any) -> tuple[Any, ...] | None:
    """A saved `global_order` (a list after some serialisations) as the tuple `global_order` returns."""
    return tuple(value) if isinstance(value, (list, tuple)) else None


def saved_accumulation(state: Mapping[str, Any]) -> int:
    """The `gradient_accumulation_steps` of the run that wrote the checkpoint `state` (1 where it says none)."""
    return int(state.get("dream_trainer", {}).get("config", {}).get("gradient_accumulation_steps", 1))


def samples_done(data: Mapping[str, Any]) -> int | None:
    """The global sample cursor of a data position (None: unknown)."""
    if data.get("samples_done") is not None:
        return int(data["samples_done"])
    per_step = data.get("samples_per_step")  # checkpoints written before the cursor was saved
    return int(data.get("batches_done", 0)) * int(per_step) if per_step else None


def _describe(order: tuple[Any, ...]) -> str:
    if order[0] == "stream":
        shuffled = "in file order" if order[2] is None else f"in a shuffle of seed {order[2]}"
        if len(order) > 4:  # shards of several samples, read as parts
            return f"as {order[1]} of {order[3]} shards {shuffled}, read as {order[4]} part(s)"
        return f"as {order[1]} of {order[3]} samples {shuffled}"
    return "in sequence (unshuffled)" if order[0] == "sequential" else f"in a shuffle of seed {order[1]}"


def _stream_refusal(loader: DataLoader, back: str, same_run: str) -> tuple[str, str]:
    """Why a stream's place cannot move to other ranks: its shards hold several samples (or it never ends),
    or each rank reads it with several loader workers, which deal the rank's part out among them."""
    from dream_trainer.data.streaming import ShardedIterable

    dataset = loader.dataset
    name = type(dataset).__name__
    if isinstance(dataset, ShardedIterable) and dataset.global_order() is not None:  # only the workers
        return (
            f"each rank reads the stream ({name}) with {loader.num_workers} loader workers, so a step's samples "
            "depend on workers x ranks",
            f"read it with num_workers=0 or 1, or {back}",
        )
    return (
        f"the training data is a stream ({name}, an IterableDataset): each rank's loader carries its own place "
        "in its part of the stream",
        same_run,
    )


def _refusal(
    data: Mapping[str, Any], loader: Any, back: str, dp_size: int, in_window: bool, cursor: bool = True
) -> tuple[str, str] | int:
    """The batches this run's ranks skip, or (why not, what to do); `back`: how to resume as the checkpoint's
    run was set up. `cursor=False`: not whether the cursor is a whole number of this run's batches (0 then)."""
    same_run = f"{back}, or from a checkpoint written at an epoch end"
    if in_window:
        return (
            "it was written inside an accumulation window, whose gradients so far belong to the ranks that "
            "computed them",
            f"{back}, or from a checkpoint written at a step end",
        )
    stream = isinstance(loader, DataLoader) and isinstance(loader.dataset, IterableDataset)
    if stream and global_order(loader) is None:
        return _stream_refusal(loader, back, same_run)
    saved = as_order(data.get("global_order"))
    if saved is None:
        source = data.get("order_source") or "its sampler"
        if stream:
            why = (
                f"the checkpoint's run read its stream ({source}) with several loader workers per rank, whose "
                "steps' samples depend on its workers x ranks"
            )
        elif source == "RandomSampler":
            why = (
                "the checkpoint's loader shuffled with a RandomSampler, whose order comes from one process's RNG "
                "and cannot be split over other ranks"
            )
        else:
            why = f"the checkpoint's loader ordered its samples with {source}, which keeps each rank's place its own"
        return why, same_run
    now = global_order(loader)
    if now != saved:
        if now is not None and now[0] == saved[0] == "distributed":
            return f"this run shuffles with seed {now[1]} (config.seed), the checkpoint's run with {saved[1]}", (
                f"set config.seed = {saved[1]}"
            )
        got = _describe(now) if now is not None else f"with {order_source(loader)}"
        return f"this run's loader reads the data {got}, the checkpoint's {_describe(saved)}", (
            "build the training loader as the checkpoint's run did"
        )
    if not cursor:  # the caller refuses the batch size itself
        return 0
    done, per_step = samples_done(data), samples_per_step(loader, dp_size)
    if done is None or not per_step:
        return "the checkpoint does not record how many samples its ranks had done", same_run
    if done % per_step:
        return (
            f"its ranks had done {done} samples, not a whole number of this run's batches of {per_step} "
            f"(batch_size {per_step // dp_size} x {dp_size} rank(s))",
            f"choose batch_size x ranks dividing {done} (the checkpoint's run read {data.get('samples_per_step')} "
            "per batch)",
        )
    return done // per_step


def resharded_position(
    data: Mapping[str, Any],
    loader: Any,
    saved: tuple[Any, Any],
    now: tuple[int, int],
    in_window: bool,
    check_cursor: bool = True,
) -> dict[str, Any]:
    """`data` (the checkpoint's data position, of its rank 0) as each rank of this run resumes it:
    `batches_done` of this run's loader to skip, from the global sample cursor. Raises `CheckpointError`
    naming the reason where that cannot be exact.

    `saved` and `now`: (world size, data-parallel size) of the checkpoint's run and of this one.
    `check_cursor=False` where the caller refuses this run's batch size anyway (`global_batch_refusal`):
    the data's own reasons first, then that one, not whether the cursor fits batches it will not use."""
    (saved_world, saved_dp), (world, dp_size) = saved, now
    if saved_world != world or saved_dp != dp_size:
        back = f"resume on {saved_world} process(es)"
    else:
        back = f"resume with {data.get('samples_per_step')} samples per batch over all ranks"
    skip = _refusal(data, loader, back, dp_size, in_window, check_cursor)
    if isinstance(skip, int):
        # The saved RNG is rank 0's (the order needs none) and its loader state is rank 0's own place.
        return {**data, "batches_done": skip, "loader_state": None}
    why, fix = skip
    if saved_world != world:
        where = f"by {saved_world} process(es), cannot continue its epoch on {world}"
    elif saved_dp != dp_size:
        where = f"with data-parallel size {saved_dp}, cannot continue its epoch with {dp_size}"
    else:
        where = f"with {data.get('samples_per_step')} samples per batch over all ranks, cannot continue its epoch "
        where += f"with {samples_per_step(loader, dp_size)}"
    raise CheckpointError(f"this checkpoint, written mid-epoch {where}: {why}; {fix}.\n{_DETAILS}")


def global_batch_refusal(
    data: Mapping[str, Any], saved_accumulation: int, loader: Any, dp_size: int, accumulation: int
) -> str | None:
    """Why this run may not resume the checkpoint whose data position is `data`, where only the number of
    data-parallel ranks changed the samples per optimizer step (`batch_size` and `gradient_accumulation_steps`
    as the checkpoint's run had them): the same script started on another number of processes would otherwise
    train on with another global batch, a change nobody chose. Names the `batch_size` and
    `gradient_accumulation_steps` that keep the checkpoint's. None: nothing to refuse (see `changed_step_size`)."""
    saved_per_step, per_step = data.get("samples_per_step"), samples_per_step(loader, dp_size)
    saved_dp = data.get("data_parallel_size")
    if not saved_per_step or not per_step or saved_dp is None or int(saved_dp) == dp_size:
        return None
    before, batch = int(saved_per_step) * saved_accumulation, per_step // dp_size
    as_saved = (int(saved_per_step) // int(saved_dp), saved_accumulation) == (batch, accumulation)
    if before == per_step * accumulation or not as_saved:
        return None
    return _keep_global_batch(before, int(saved_dp), batch, dp_size, accumulation)


def changed_step_size(
    data: Mapping[str, Any], saved_accumulation: int, loader: Any, dp_size: int, accumulation: int
) -> str | None:
    """A warning when this run takes another number of samples per optimizer step than the checkpoint's
    run (per-rank batch x data-parallel ranks x accumulation), as you set it: the same samples, but other
    steps. (Where only the number of ranks changed it, `global_batch_refusal` refuses the resume first.)"""
    saved_per_step, per_step = data.get("samples_per_step"), samples_per_step(loader, dp_size)
    if not saved_per_step or not per_step:
        return None
    before, after = int(saved_per_step) * saved_accumulation, per_step * accumulation
    if before == after:
        return None
    return (
        f"this run takes {after} samples per optimizer step ({_product(per_step // dp_size, dp_size, accumulation)}) "
        f"where the checkpoint's run took {before}: set batch_size or gradient_accumulation_steps so the product "
        f"is {before} to continue it exactly.\nThe samples follow the checkpoint's order, but each optimizer step "
        "averages over another number of them, so training no longer matches the original run's."
    )


def _product(batch: int, dp_size: int, accumulation: int) -> str:
    return f"batch_size {batch} x {dp_size} data-parallel rank(s) x gradient_accumulation_steps {accumulation}"


def _keep_global_batch(before: int, saved_dp: int, batch: int, dp_size: int, accumulation: int) -> str:
    """The refusal of a resume whose global batch only the number of data-parallel ranks changed: what to set
    (per-rank batch, accumulation or both) so this run takes the checkpoint's `before` samples per step."""
    fixes = []
    if before % (dp_size * accumulation) == 0:
        fixes.append(f"batch_size = {before // (dp_size * accumulation)}")
    if before % (dp_size * batch) == 0:
        fixes.append(f"gradient_accumulation_steps = {before // (dp_size * batch)}")
    if not fixes and before % dp_size == 0:
        fixes.append(f"batch_size = {before // dp_size} and gradient_accumulation_steps = 1")
    if fixes:
        what = f"set {' or '.join(fixes)} to keep {before}"
    else:
        what = f"resume on a number of data-parallel ranks that divides {before}"
    return (
        f"this checkpoint's run took {before} samples per optimizer step on {saved_dp} data-parallel rank(s); "
        f"on {dp_size} the same settings take {batch * dp_size * accumulation} "
        f"({_product(batch, dp_size, accumulation)}): {what}.\n"
        "A resume on another number of processes keeps the samples of each optimizer step, so the run continues "
        "as it began: compute the per-rank batch from the world size (global batch // world size) in "
        "configure_dataloaders, or set batch_size or gradient_accumulation_steps yourself; a resume where you "
        "changed either of them continues with a warning naming both numbers. See docs/distributed.md, "
        "'Resuming on another number of processes'."
    )
