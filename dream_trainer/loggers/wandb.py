"""WandbLogger: the config, per-step metrics, images, histograms and checkpoints in a W&B run.

`wandb` is imported when the logger is built, never by `import dream_trainer`; install it with
`pip install 'dream-trainer[wandb]'`. Offline mode (`mode="offline"` or `WANDB_MODE=offline`) writes the
run under `<save_dir>/wandb/offline-run-*` and contacts nothing; `wandb sync` uploads it later.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from dream_trainer.loggers.tracker import TrackerLogger

STEP_METRIC = "trainer/global_step"  # the x-axis of every chart: W&B's own `_step` counts log calls


def _jsonable(params: Mapping[str, Any]) -> dict[str, Any]:
    # W&B config values must be JSON; anything else (paths, dtypes, objects) is shown as its str().
    result: dict[str, Any] = json.loads(json.dumps(dict(params), default=str))
    return result


class WandbLogger(TrackerLogger):
    """Logs a run to Weights & Biases: the config as W&B config, metrics, images, histograms, checkpoints.

    Every call only queues (see `TrackerLogger`); a worker thread calls `wandb.init` with the first
    value and `run.log` for each logging call. Each row carries `trainer/global_step`, the step metric of
    every chart (so values logged at the same or an earlier step are never dropped, as W&B drops rows
    whose `step=` goes backwards). When `fit()` ends the checkpoints are logged as a `model` artifact
    (`model-<run id>`, alias `latest`) and the run finishes with exit code 0 (success) or 1 (failure).

    Args:
        project: the W&B project (default: `WANDB_PROJECT`, else W&B's default).
        name: the run's display name (default: the dream_trainer run directory's name).
        save_dir: where W&B writes its files, in `<save_dir>/wandb/` (default: the run's directory).
        mode: `"online"`, `"offline"` or `"disabled"` (default: `WANDB_MODE`, else online).
        tags: run tags.
        entity: the W&B team or user (default: W&B's).
        log_checkpoints: `"last"` (default), `"all"` or `False`; see `TrackerLogger`.
        checkpoint_dir: where the checkpoints are, when `ModelCheckpoint(dirpath=...)` moved them.
        flush_secs: the longest a value waits before it is handed to W&B.
        max_pending: queued values before logging waits for W&B.
        **init_kwargs: passed to `wandb.init` as they are (`group`, `notes`, `settings`, `id`, `resume`, ...).
    """

    backend: ClassVar[str] = "wandb"
    extra: ClassVar[str] = "wandb"

    def __init__(
        self,
        project: str | None = None,
        name: str | None = None,
        save_dir: str | os.PathLike[str] | None = None,
        mode: str | None = None,
        tags: Sequence[str] | None = None,
        entity: str | None = None,
        log_checkpoints: str | bool = "last",
        checkpoint_dir: str | os.PathLike[str] | None = None,
        flush_secs: float = 1.0,
        max_pending: int = 10_000,
        **init_kwargs: Any,
    ) -> None:
        super().__init__(
            log_checkpoints=log_checkpoints,
            checkpoint_dir=checkpoint_dir,
            flush_secs=flush_secs,
            max_pending=max_pending,
        )
        self.log_dir = Path(save_dir) if save_dir is not None else None
        self.project = project
        self.name = name
        self.mode = mode
        self.tags = list(tags) if tags is not None else None
        self.entity = entity
        self.init_kwargs = init_kwargs
        self._run: Any = None
        self._run_id: str | None = init_kwargs.pop("id", None)

    @property
    def experiment(self) -> Any:
        """The `wandb` run (waits until it is started), for the rest of W&B's API."""
        self.flush()
        if self._run is None:
            self._writer.submit(("open",))
            self.flush()
        return self._run

    # --- the worker thread --------------------------------------------------------------------------
    def write(self, items: list[Any]) -> None:
        run = self._ensure_run()
        wandb = self.module
        for item in items:
            kind = item[0]
            if kind == "metrics":
                _, step, values, _wall_time = item
                run.log({**values, STEP_METRIC: step})
            elif kind == "params":
                run.config.update(_jsonable(item[1]), allow_val_change=True)
            elif kind == "images":
                _, tag, step, images = item
                run.log({tag: [wandb.Image(image.numpy()) for image in images], STEP_METRIC: step})
            elif kind == "histogram":
                _, tag, step, values = item
                histogram = wandb.Histogram(values.reshape(-1).double().numpy())
                run.log({tag: histogram, STEP_METRIC: step})
            elif kind == "end":
                self._end(run, item[1], item[2])

    def _ensure_run(self) -> Any:
        if self._run is not None:
            return self._run
        wandb = self.module
        directory = self.log_dir or self.run_dir
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
        name = self.name or (self.run_dir.name if self.run_dir is not None else None)
        kwargs: dict[str, Any] = {"reinit": "create_new"}  # never finish or reuse a run the user started
        if self._run_id is not None:  # a second fit() with this logger: the same W&B run
            kwargs.update(id=self._run_id, resume="allow")
        kwargs.update(self.init_kwargs)
        run = wandb.init(
            project=self.project,
            entity=self.entity,
            name=name,
            dir=str(directory) if directory is not None else None,
            mode=self.mode,
            tags=self.tags,
            **kwargs,
        )
        run.define_metric(STEP_METRIC)
        run.define_metric("*", step_metric=STEP_METRIC, step_sync=True)
        self._run, self._run_id = run, run.id
        return run

    def _end(self, run: Any, status: str, checkpoints: list[Path]) -> None:
        try:
            if checkpoints:
                artifact = self.module.Artifact(f"model-{run.id}", type="model")
                for path in checkpoints:
                    if path.is_dir():  # a sharded checkpoint
                        artifact.add_dir(str(path), name=path.name)
                    else:
                        artifact.add_file(str(path), name=path.name)
                run.log_artifact(artifact, aliases=["latest"])
        finally:  # the run is finished even when the upload failed
            self._run = None
            run.finish(exit_code=0 if status == "success" else 1)
