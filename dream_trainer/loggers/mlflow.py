"""MLFlowLogger: params, per-step metrics, tags, images and the run's checkpoints in an MLflow run.

`mlflow` is imported when the logger is built, never by `import dream_trainer`; install it with
`pip install 'dream-trainer[mlflow]'`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
import urllib.parse
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

from dream_trainer.errors import ConfigError
from dream_trainer.loggers.resume import AlreadyLogged, TrackerContinuation, record_run_id, recorded_run_id
from dream_trainer.loggers.tracker import TrackerLogger

# MLflow's limits (mlflow.utils.validation), fixed here so the values are known before it is imported.
MAX_PARAM_VALUE = 6000  # characters of a param value (longer ones are truncated)
MAX_KEY = 250  # characters of a param or metric name
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_PER_BATCH = 100
_BAD_NAME_CHARS = re.compile(r"[^/\w.\- :]")  # what MLflow rejects in param and metric names
# `MlflowClient.log_image(key=..., step=...)` names its files `images/<key, / as ~>+step+<step>+timestamp+...`
# (`%` instead of `+` before MLflow 3.x); the compressed copy ends in `+compressed.webp`.
_IMAGE_FILE = re.compile(r"^images/(?P<key>.+?)[+%]step[+%](?P<step>\d+)[+%]timestamp[+%].*(?<!compressed)\.png$")
RESUMED_TAG = "dream_trainer.resumed_at_step"  # the steps a run was continued from, comma-separated

STATUS = {"success": "FINISHED", "failed": "FAILED"}
LOCAL_STORE = "sqlite:///mlflow.db"  # a local store MLflow 3.x takes: SQLite, no server
ALLOW_FILE_STORE = "MLFLOW_ALLOW_FILE_STORE"  # MLflow >= 3.13 refuses file stores unless this is true


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


def file_store_refusal(mlflow: ModuleType, tracking_uri: str | None) -> str | None:
    """The error for a tracking store this MLflow refuses, or None when it takes it.

    MLflow 3.13 and later refuse a file store (`file:./mlruns`, a bare path) unless
    `MLFLOW_ALLOW_FILE_STORE=true`; with `tracking_uri=None` that is the store `MLFLOW_TRACKING_URI` names,
    or MLflow's default where `./mlruns` holds runs of an older MLflow (elsewhere the default is
    `sqlite:///mlflow.db`). The first line says what to pass or set (under 300 characters), the store below it.
    Nothing is contacted or written: the URI is resolved as MLflow resolves it, and read.
    """
    setting = getattr(getattr(mlflow, "environment_variables", None), ALLOW_FILE_STORE, None)
    if setting is None:  # an MLflow before 3.13 takes file stores
        return None
    uri = tracking_uri or mlflow.get_tracking_uri()  # as MlflowClient(tracking_uri=...) resolves it
    scheme = urllib.parse.urlparse(uri).scheme
    if scheme not in ("", "file") and not (len(scheme) == 1 and scheme.isalpha()):  # C:\... is a path
        return None
    if setting.get():  # MLflow's own reading of MLFLOW_ALLOW_FILE_STORE
        return None
    head = f"MLFlowLogger(tracking_uri={tracking_uri!r}): MLflow {mlflow.__version__} refuses file stores"
    if not tracking_uri and os.environ.get("MLFLOW_TRACKING_URI"):
        head += f", and MLFLOW_TRACKING_URI={uri!r} is one"
    elif not tracking_uri:
        head += ", and its default store here is one (./mlruns holds runs of an older MLflow)"
    return (
        f"{head}; use tracking_uri={LOCAL_STORE!r} or set {ALLOW_FILE_STORE}=true\n"
        f"The store: {uri}. A SQLite file needs no server (`sqlite:////abs/path/mlflow.db` for an absolute "
        "path); `mlflow migrate-filestore` moves the runs of a file store into one."
    )


class MLFlowLogger(TrackerLogger):
    """Logs a run to MLflow: the config as params, metrics per step, tags, images, checkpoints, status.

    Every call only queues (see `TrackerLogger`); a worker thread sends the values with
    `MlflowClient.log_batch`, many steps per request. The MLflow run is created by the first value,
    named after the dream_trainer run (`version_N` or `run_name`) unless `run_name` is given, and
    tagged with `dream_trainer.run_dir`. When `fit()` ends, the checkpoints are uploaded as
    artifacts under `checkpoints/` and the run is set to `FINISHED` (or `FAILED`).

    A resumed run (`fit(ckpt_path="last")`) logs into the same MLflow run: its id is kept in
    `<run_dir>/trackers.json`. MLflow cannot remove a logged value, and the stopped process may have
    logged steps after its checkpoint, which the resumed run logs again: a value is not sent when the
    run holds one for the same metric and step already (the run then has one value per metric and step,
    those of the steps after the checkpoint from the stopped process; images likewise). The run is
    tagged `dream_trainer.resumed_at_step`. A later `fit()` of the same trainer that trains steps again (from
    a checkpoint) does the same; a logger used by another run (a new trainer) starts another MLflow run.
    Params are never changed: a resumed run's config value that differs from the run's param is not
    logged, with a warning.

    Args:
        experiment_name: the MLflow experiment, created if missing.
        run_name: the MLflow run's name (default: the dream_trainer run directory's name).
        tracking_uri: the tracking server (`http://host:5000`), or a local store, no server needed:
            `sqlite:///mlflow.db` (a SQLite file in the working directory; `sqlite:////abs/path/mlflow.db`).
            MLflow 3.13+ refuses a file store (`file:./mlruns`) unless `MLFLOW_ALLOW_FILE_STORE=true`:
            the logger raises `ConfigError` when built. None: MLflow's default (`MLFLOW_TRACKING_URI`,
            else, on MLflow 3.7+, `sqlite:///mlflow.db` in the working directory).
        tags: extra run tags.
        run_id: log into this existing run instead of creating one (e.g. to continue a run from another
            run directory; a resumed run finds its own).
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
        refused = file_store_refusal(self.module, tracking_uri)  # before training, not at the first write
        if refused is not None:
            raise ConfigError(refused)
        self.experiment_name = experiment_name
        self.run_name = run_name
        self.tracking_uri = tracking_uri
        self.tags = {str(k): str(v) for k, v in (tags or {}).items()}
        self._given_run_id = run_id
        self._run_id = run_id
        self._client: Any = None
        self._open = False  # the MLflow run is RUNNING (created or reopened by this logger)
        self._names: dict[str, str] = {}  # metric name -> the name MLflow accepts
        # Continuing a run (set on the training thread while no write runs, read by the worker):
        self._continued = TrackerContinuation()  # resume(step), or a later fit() after finalize
        self._held: AlreadyLogged[tuple[str, int]] | None = None  # (metric, step): values not to send again
        self._held_images: AlreadyLogged[tuple[str, int]] | None = None  # (image key, step)
        self._params: dict[str, str] | None = None  # the params of a run this logger did not create

    @property
    def run_id(self) -> str:
        """The MLflow run's id (waits until the run is created)."""
        self.flush()
        if self._run_id is None:
            self._writer.submit(("open",))
            self.flush()
        assert self._run_id is not None
        return self._run_id

    def attach(self, log_dir: Path) -> None:
        run_dir = Path(log_dir)
        if self.run_dir is not None and run_dir != self.run_dir and not self._open:
            # another dream_trainer run with this logger: its own MLflow run (or the one given)
            self._run_id, self._held, self._held_images = self._given_run_id, None, None
            self._continued.reset()
        super().attach(log_dir)

    def resume(self, step: int) -> None:
        """Continue the run's MLflow run (kept in `<run_dir>/trackers.json`): values it holds from
        `step` on are not sent again."""
        self._continued.resume_step = step

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
                self._count_held_values(step)
                for name, value in values.items():
                    key = self._name(name)
                    if self._held is None or not self._held.skip((key, step)):
                        metrics.append(self.module.entities.Metric(key, float(value), ms, step))
                continue
            self._send_metrics(metrics)
            metrics = []
            if kind == "params":
                self._send_params(item[1])
            elif kind == "images":
                _, tag, step, images = item
                self._count_held_values(step)
                for i, image in enumerate(images):
                    key = self._name(tag if len(images) == 1 else f"{tag}/{i}")
                    if self._held_images is None or not self._held_images.skip((key, step)):
                        self.client.log_image(self._run_id, image.numpy(), key=key, step=step)
            elif kind == "end":
                self._end(item[1], item[2])
            # "open" (run_id) needs nothing more than _ensure_run; MLflow has no histograms
        self._send_metrics(metrics)

    def _ensure_run(self) -> None:
        if self._open:
            return
        try:
            self._open_run()
        except self.module.exceptions.MlflowException as exc:  # the first use of the store: is it refused?
            refused = file_store_refusal(self.module, self.tracking_uri)
            if refused is None:
                raise
            raise ConfigError(f"{refused}\nMLflow: {exc}") from exc

    def _open_run(self) -> None:
        client = self.client
        resuming = self._continued.resume_step is not None
        self._held = self._held_images = None
        if self._run_id is None and resuming and self.run_dir is not None:
            self._run_id = self._recorded_run()
        if self._run_id is None:
            self._run_id = self._create_run()
            self._continued.opened(existing=False)
        else:  # an existing run (a resumed run's, run_id=..., or a second fit() after finalize): running again
            run = client.get_run(self._run_id)
            self._params = dict(run.data.params)
            client.update_run(self._run_id, status="RUNNING")
            tags = dict(self.tags)
            step = self._continued.opened(existing=True)
            if step is not None:
                steps = run.data.tags.get(RESUMED_TAG)
                tags[RESUMED_TAG] = f"{steps},{step}" if steps else str(step)
            if tags:
                client.log_batch(self._run_id, tags=self._tags(tags))
        if self.run_dir is not None:
            record_run_id(self.run_dir, "mlflow", self._record_key(), self._run_id)
        self._open = True

    def _create_run(self) -> str:
        client = self.client
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
        self._params = None
        run_id: str = client.create_run(experiment_id, tags=tags, run_name=name).info.run_id
        return run_id

    def _record_key(self) -> str:
        return f"{self.client.tracking_uri} {self.experiment_name}"

    def _recorded_run(self) -> str | None:
        """The MLflow run the stopped process logged this run to (None: a new one is created)."""
        assert self.run_dir is not None
        run_id = recorded_run_id(self.run_dir, "mlflow", self._record_key())
        if run_id is None:
            return None
        try:
            run = self.client.get_run(run_id)
        except self.module.exceptions.MlflowException as exc:
            problem = f"cannot be read ({exc})"
        else:
            if run.info.lifecycle_stage == "active":
                return run_id
            problem = "was deleted"
        warnings.warn(
            f"MLFlowLogger: the MLflow run {run_id} of {self.run_dir} {problem}; the resumed run logs to a new one",
            stacklevel=2,
        )
        return None

    def _count_held_values(self, step: int) -> None:
        """Before a value at `step` is sent: when the run was continued, what it holds from the resume step
        (or from this step, when a later fit() logs steps again) on, which is not sent again."""
        start = self._continued.count_from(step)
        if start is None:
            return
        client = self.client
        held = []
        for name in client.get_run(self._run_id).data.metrics:
            held += [(name, m.step) for m in client.get_metric_history(self._run_id, name) if m.step >= start]
        self._held = AlreadyLogged(held) if held else None
        images = []
        for info in client.list_artifacts(self._run_id, "images"):
            match = _IMAGE_FILE.match(info.path)
            if match is not None and int(match["step"]) >= start:
                images.append((match["key"].replace("~", "/"), int(match["step"])))
        self._held_images = AlreadyLogged(images) if images else None

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

    def _send_metrics(self, metrics: list[Any]) -> None:
        for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            self.client.log_batch(self._run_id, metrics=metrics[i : i + MAX_METRICS_PER_BATCH])

    def _send_params(self, params: Mapping[str, Any]) -> None:
        Param = self.module.entities.Param
        flat = dict((k[:MAX_KEY], v) for k, v in flatten_params(params))
        if self._params is not None:  # a run this logger did not create: MLflow refuses to change a param
            changed = sorted(k for k, v in flat.items() if self._params.get(k, v) != v)
            if changed:
                shown = ", ".join(f"{k}={flat[k]!r} (run: {self._params[k]!r})" for k in changed[:10])
                more = f" and {len(changed) - 10} more" if len(changed) > 10 else ""
                warnings.warn(
                    f"MLFlowLogger: the config changes params of the MLflow run {self._run_id}, which MLflow keeps "
                    f"as first logged: {shown}{more}; the run keeps its values",
                    stacklevel=2,
                )
            flat = {k: v for k, v in flat.items() if k not in self._params}
            self._params.update(flat)
        items = [Param(k, v) for k, v in flat.items()]
        for i in range(0, len(items), MAX_PARAMS_PER_BATCH):
            self.client.log_batch(self._run_id, params=items[i : i + MAX_PARAMS_PER_BATCH])

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
            self._open, self._continued.ended = False, True
