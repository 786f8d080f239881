"""MLFlowLogger: params, per-step metrics, tags, images and the run's checkpoints in an MLflow run.

`mlflow` is imported when the logger is built, never by `import dream_trainer`; install it with
`pip install 'dream-trainer[mlflow]'`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
import warnings
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

from dream_trainer.loggers.tracker import TrackerLogger

# MLflow's limits (mlflow.utils.validation), fixed here so the values are known before it is imported.
MAX_PARAM_VALUE = 6000  # characters of a param value (longer ones are truncated)
MAX_KEY = 250  # characters of a param or metric name
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_PER_BATCH = 100
_BAD_NAME_CHARS = re.compile(r"[^/\w.\- :]")  # what MLflow rejects in param and metric names

STATUS = {"success": "FINISHED", "failed": "FAILED"}


def flatten_params(params: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, str]]:
    """`(dotted key, string value)` pairs of a nested config: MLflow params are flat strings.

    Mappings and dataclass instances are walked (`{"optim": {"lr": 0.1}}` -> `("optim.lr", "0.1")`);
    every other value is `str(value)`, cut to MLflow's 6000 characters.
    """
    for key, value in params.items():
        name = f"{prefix}{key}"
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        if isinstance(value, Mapping) and value:
            yield from flatten_params(value, prefix=f"{name}.")
        else:
            yield name, str(value)[:MAX_PARAM_VALUE]


class MLFlowLogger(TrackerLogger):
    """Logs a run to MLflow: the config as params, metrics per step, tags, images, checkpoints, status.

    Every call only queues (see `TrackerLogger`); a worker thread sends the values with
    `MlflowClient.log_batch`, many steps per request. The MLflow run is created by the first value,
    named after the dream_trainer run (`version_N` or `run_name`) unless `run_name` is given, and
    tagged with `dream_trainer.run_dir`. When `fit()` ends, the checkpoints are uploaded as
    artifacts under `checkpoints/` and the run is set to `FINISHED` (or `FAILED`).

    Args:
        experiment_name: the MLflow experiment, created if missing.
        run_name: the MLflow run's name (default: the dream_trainer run directory's name).
        tracking_uri: the tracking server (`http://host:5000`), or a local store (`sqlite:///mlflow.db`,
            `file:./mlruns`). None: MLflow's default (`MLFLOW_TRACKING_URI`, else its local store).
        tags: extra run tags.
        run_id: log into this existing run instead of creating one (e.g. to continue a run).
        log_checkpoints: `"last"` (default), `"all"` or `False`; see `TrackerLogger`.
        checkpoint_dir: where the checkpoints are, when `ModelCheckpoint(dirpath=...)` moved them.
        flush_secs: the longest a value waits before it is sent.
        max_pending: queued values before logging waits for the server.

    Metric names MLflow rejects (characters other than letters, digits, `_ - . / :` and spaces) are
    logged with those characters replaced by `_`, with a warning per name.
    """

    backend: ClassVar[str] = "mlflow"
    extra: ClassVar[str] = "mlflow"

    def __init__(
        self,
        experiment_name: str = "dream_trainer",
        run_name: str | None = None,
        tracking_uri: str | None = None,
        tags: Mapping[str, Any] | None = None,
        run_id: str | None = None,
        log_checkpoints: str | bool = "last",
        checkpoint_dir: str | os.PathLike[str] | None = None,
        flush_secs: float = 1.0,
        max_pending: int = 10_000,
    ) -> None:
        super().__init__(
            log_checkpoints=log_checkpoints,
            checkpoint_dir=checkpoint_dir,
            flush_secs=flush_secs,
            max_pending=max_pending,
        )
        self.experiment_name = experiment_name
        self.run_name = run_name
        self.tracking_uri = tracking_uri
        self.tags = {str(k): str(v) for k, v in (tags or {}).items()}
        self._run_id = run_id
        self._client: Any = None
        self._open = False  # the MLflow run is RUNNING (created or reopened by this logger)
        self._names: dict[str, str] = {}  # metric name -> the name MLflow accepts

    @property
    def run_id(self) -> str:
        """The MLflow run's id (waits until the run is created)."""
        self.flush()
        if self._run_id is None:
            self._writer.submit(("open",))
            self.flush()
        assert self._run_id is not None
        return self._run_id

    @property
    def client(self) -> Any:
        """The `mlflow.MlflowClient` this logger writes with (for anything else MLflow offers)."""
        if self._client is None:
            self._client = self.module.MlflowClient(tracking_uri=self.tracking_uri)
        return self._client

    # --- the worker thread --------------------------------------------------------------------------
    def write(self, items: list[Any]) -> None:
        self._ensure_run()
        metrics: list[Any] = []
        for item in items:
            kind = item[0]
            if kind == "metrics":  # consecutive steps go out in one request
                _, step, values, wall_time = item
                ms = int(wall_time * 1000)
                metrics += [self._metric(name, value, ms, step) for name, value in values.items()]
                continue
            self._send_metrics(metrics)
            metrics = []
            if kind == "params":
                self._send_params(item[1])
            elif kind == "images":
                _, tag, step, images = item
                for i, image in enumerate(images):
                    key = tag if len(images) == 1 else f"{tag}/{i}"
                    self.client.log_image(self._run_id, image.numpy(), key=self._name(key), step=step)
            elif kind == "end":
                self._end(item[1], item[2])
            # "open" (run_id) needs nothing more than _ensure_run; MLflow has no histograms
        self._send_metrics(metrics)

    def _ensure_run(self) -> None:
        if self._open:
            return
        client = self.client
        if self._run_id is None:
            experiment = client.get_experiment_by_name(self.experiment_name)
            if experiment is not None:
                experiment_id = experiment.experiment_id
            else:
                try:
                    experiment_id = client.create_experiment(self.experiment_name)
                except self.module.exceptions.MlflowException:  # another process created it meanwhile
                    experiment_id = client.get_experiment_by_name(self.experiment_name).experiment_id
            tags = dict(self.tags)
            if self.run_dir is not None:
                tags.setdefault("dream_trainer.run_dir", str(self.run_dir))
            name = self.run_name or (self.run_dir.name if self.run_dir is not None else None)
            self._run_id = client.create_run(experiment_id, tags=tags, run_name=name).info.run_id
        else:  # an existing run (run_id=..., or a second fit() after finalize): running again
            client.update_run(self._run_id, status="RUNNING")
            if self.tags:
                client.log_batch(self._run_id, tags=self._tags(self.tags))
        self._open = True

    def _tags(self, tags: Mapping[str, str]) -> list[Any]:
        RunTag = self.module.entities.RunTag
        return [RunTag(k, v) for k, v in tags.items()]

    def _name(self, name: str) -> str:
        fixed = self._names.get(name)
        if fixed is None:
            fixed = _BAD_NAME_CHARS.sub("_", name)[:MAX_KEY]
            if fixed != name:
                warnings.warn(
                    f"MLFlowLogger: the metric name {name!r} is not valid in MLflow; logged as {fixed!r}", stacklevel=2
                )
            self._names[name] = fixed
        return fixed

    def _metric(self, name: str, value: float, timestamp_ms: int, step: int) -> Any:
        return self.module.entities.Metric(self._name(name), float(value), timestamp_ms, step)

    def _send_metrics(self, metrics: list[Any]) -> None:
        for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            self.client.log_batch(self._run_id, metrics=metrics[i : i + MAX_METRICS_PER_BATCH])

    def _send_params(self, params: Mapping[str, Any]) -> None:
        Param = self.module.entities.Param
        flat = [Param(k[:MAX_KEY], v) for k, v in flatten_params(params)]
        for i in range(0, len(flat), MAX_PARAMS_PER_BATCH):
            self.client.log_batch(self._run_id, params=flat[i : i + MAX_PARAMS_PER_BATCH])

    def _end(self, status: str, checkpoints: list[Any]) -> None:
        try:
            for path in checkpoints:
                if path.is_dir():  # a sharded checkpoint
                    self.client.log_artifacts(self._run_id, str(path), artifact_path=f"checkpoints/{path.name}")
                else:
                    self.client.log_artifact(self._run_id, str(path), artifact_path="checkpoints")
        finally:  # the status is set even when an upload failed
            self.client.set_terminated(
                self._run_id, status=STATUS.get(status, "FAILED"), end_time=int(time.time() * 1000)
            )
            self._open = False
