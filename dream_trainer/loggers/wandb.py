"""WandbLogger: the config, per-step metrics, images, histograms and checkpoints in a W&B run.

`wandb` is imported when the logger is built, never by `import dream_trainer`; install it with
`pip install 'dream-trainer[wandb]'`. Offline mode (`mode="offline"` or `WANDB_MODE=offline`) writes the
run under `<save_dir>/wandb/offline-run-*` and contacts nothing; `wandb sync` uploads it later.
"""

from __future__ import annotations

import json
import os
import struct
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from dream_trainer.loggers.resume import AlreadyLogged, TrackerContinuation, record_run_id, recorded_run_id
from dream_trainer.loggers.tracker import TrackerLogger

STEP_METRIC = "trainer/global_step"  # the x-axis of every chart: W&B's own `_step` counts log calls
# How often W&B's service writes the run's `.wandb` file (its own default: every 15 s, so a process that is
# killed loses up to 15 s of rows); `flush()` waits until the file holds every row logged before it.
FILE_FLUSH_SECS = 0.1
FLUSH_TIMEOUT = 30.0  # the longest `flush()` waits for W&B's file


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

    A resumed run (`fit(ckpt_path="last")`) continues the same W&B run (`resume="allow"`; its id is
    kept in `<run_dir>/trackers.json`). W&B keeps every row it was given, and the stopped process may
    have logged steps after its checkpoint, which the resumed run logs again: a row is not logged when
    the run holds a row of the same step and metric names already, read from the run's `.wandb` files
    under `<save_dir>/wandb/` (W&B's record of every row, online or offline). The run's history then
    has each row once, those of the steps after the checkpoint from the stopped process. A later `fit()`
    of the same trainer that trains steps again does the same; a logger used by another run starts another
    W&B run. `flush()` (before every checkpoint) waits until W&B's file holds the rows logged so far.

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
        self.save_dir = Path(save_dir) if save_dir is not None else None
        self.log_dir = self.save_dir
        self.project = project
        self.name = name
        self.mode = mode
        self.tags = list(tags) if tags is not None else None
        self.entity = entity
        self.init_kwargs = init_kwargs
        self._run: Any = None
        self._given_id: str | None = init_kwargs.pop("id", None)
        self._run_id = self._given_id
        # Continuing a run (set on the training thread while no write runs, read by the worker):
        self._continued = TrackerContinuation()  # resume(step), or a later fit() after finalize
        self._held: AlreadyLogged[tuple[int, frozenset[str]]] | None = None  # (step, names): rows not to log again
        self._logged = 0  # rows handed to W&B by this process's W&B run (the worker counts)
        self._file: RunFile | None = None  # that run's `.wandb` file, when W&B is asked to write it often

    def attach(self, log_dir: Path) -> None:
        run_dir = Path(log_dir)
        if self.run_dir is not None and run_dir != self.run_dir and self._run is None:
            # another dream_trainer run with this logger: its own W&B run (or the one given)
            self._run_id, self._held = self._given_id, None
            self._continued.reset()
        super().attach(log_dir)
        self.log_dir = self.save_dir or self.run_dir

    def resume(self, step: int) -> None:
        """Continue the run's W&B run (kept in `<run_dir>/trackers.json`): rows it holds from `step` on
        are not logged again."""
        self._continued.resume_step = step

    def flush(self) -> None:
        """Wait until every row logged so far is handed to W&B and written to the run's `.wandb` file
        (W&B's record of the run, which `wandb sync` uploads): a checkpoint written after a flush never
        comes before rows logged before it, even when the process is then killed."""
        super().flush()
        run_file = self._file
        if run_file is None or self._run is None:
            return
        deadline = time.monotonic() + FLUSH_TIMEOUT
        try:
            run_file.read()
            while run_file.count < self._logged:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"W&B has not written them in {FLUSH_TIMEOUT:.0f} s")
                time.sleep(FILE_FLUSH_SECS / 2)
                run_file.read()
        except (OSError, ValueError) as exc:  # this run's flushes do not wait for the file any more
            self._file = None
            warnings.warn(
                f"WandbLogger: cannot tell whether the rows logged so far are in {run_file.path} ({exc}); "
                "a process killed now may lose them",
                stacklevel=2,
            )

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
                if not self._already_logged(run, step, values):
                    run.log({**values, STEP_METRIC: step})
                    self._logged += 1
            elif kind == "params":
                run.config.update(_jsonable(item[1]), allow_val_change=True)
            elif kind == "images":
                _, tag, step, images = item
                if not self._already_logged(run, step, (tag,)):
                    run.log({tag: [wandb.Image(image.numpy()) for image in images], STEP_METRIC: step})
                    self._logged += 1
            elif kind == "histogram":
                _, tag, step, values = item
                if not self._already_logged(run, step, (tag,)):
                    histogram = wandb.Histogram(values.reshape(-1).double().numpy())
                    run.log({tag: histogram, STEP_METRIC: step})
                    self._logged += 1
            elif kind == "end":
                self._end(run, item[1], item[2])

    def _ensure_run(self) -> Any:
        if self._run is not None:
            return self._run
        wandb = self.module
        directory = self.save_dir or self.run_dir
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
        resuming = self._continued.resume_step is not None
        if self._run_id is None and resuming and self.run_dir is not None:
            self._run_id = recorded_run_id(self.run_dir, "wandb", self._record_key())
        name = self.name or (self.run_dir.name if self.run_dir is not None else None)
        kwargs: dict[str, Any] = {"reinit": "create_new"}  # never finish or reuse a run the user started
        existing = self._run_id is not None
        if existing:  # a resumed run's W&B run, id=..., or a second fit() with this logger: the same W&B run
            kwargs.update(id=self._run_id, resume="allow")
        kwargs.update(self.init_kwargs)
        settings = kwargs.get("settings")
        often = "x_transaction_log_flush_interval" in getattr(wandb.Settings, "model_fields", {})
        if often and settings is None:
            kwargs["settings"] = wandb.Settings(x_transaction_log_flush_interval=FILE_FLUSH_SECS)
        elif often and isinstance(settings, Mapping) and "x_transaction_log_flush_interval" not in settings:
            kwargs["settings"] = {**settings, "x_transaction_log_flush_interval": FILE_FLUSH_SECS}
        else:  # the user's own W&B settings: flush() does not wait for W&B's file
            often = False
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
        self._held = None
        self._continued.opened(existing)
        self._logged = 0
        sync_file = None if getattr(run, "disabled", False) else getattr(run.settings, "sync_file", None)
        self._file = RunFile(Path(sync_file)) if often and sync_file else None  # mode="disabled" writes none
        if self.run_dir is not None:
            record_run_id(self.run_dir, "wandb", self._record_key(), run.id)
        return run

    def _record_key(self) -> str:
        return f"{self.entity or ''}/{self.project or ''}"

    def _already_logged(self, run: Any, step: int, names: Iterable[str]) -> bool:
        """True when the run holds this row (logged by the process that stopped): it is not logged again."""
        start = self._continued.count_from(step)
        if start is not None:  # the first row after the run was continued
            self._held = self._held_rows(run, start)
        return self._held is not None and self._held.skip((step, frozenset(names)))

    def _held_rows(self, run: Any, start: int) -> AlreadyLogged[tuple[int, frozenset[str]]] | None:
        """The rows at step `start` or later in the run's earlier `.wandb` files (one per process)."""
        if getattr(run, "disabled", False) or not getattr(run.settings, "sync_file", None):  # mode="disabled"
            return None
        own = Path(run.settings.sync_file)  # <dir>/wandb/<this process's run>-<id>/run-<id>.wandb
        rows = []
        for path in sorted(own.parent.parent.glob(f"*-{run.id}/run-{run.id}.wandb")):
            if path == own:
                continue
            try:
                rows += RunFile(path, start).settled_rows()
            except ValueError as exc:
                warnings.warn(
                    f"WandbLogger: cannot read {path} ({exc}); rows of the steps the resumed run trains again may "
                    "appear twice in the W&B run",
                    stacklevel=2,
                )
        return AlreadyLogged(rows) if rows else None

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
            self._run, self._continued.ended = None, True
            run.finish(exit_code=0 if status == "success" else 1)


# --- reading a `.wandb` file --------------------------------------------------------------------------
# W&B writes every record of a run (history rows included) to `run-<id>.wandb`, the file `wandb sync`
# uploads. Its framing is LevelDB's log format after a 7-byte header (`:W&B`, a magic number, a
# version): 32 KiB blocks, each record cut into FULL / FIRST / MIDDLE / LAST chunks behind a 7-byte
# header (CRC, length, type). The records are W&B's `wandb_internal_pb2.Record` protobufs.
_BLOCK, _FILE_HEADER, _CHUNK_HEADER = 32768, 7, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


class RunFile:
    """Reads a `.wandb` file as W&B's service writes it: each call reads what was added since the last.

    `rows` keeps `(trainer step, metric names)` of each row a `WandbLogger` logged at step `start` or
    later (none when `start` is None); `count` is the number of such rows at any step. Raises ValueError
    when the file is not in the format this reads (another W&B version).
    """

    def __init__(self, path: Path, start: int | None = None) -> None:
        self.path = path
        self.start = start
        self.rows: list[tuple[int, frozenset[str]]] = []
        self.count = 0
        self.complete = False  # the run's exit record was read: the file is whole
        self._pos = 0  # where the next record starts

    def read(self) -> None:
        """Read the records added since the last call."""
        from google.protobuf.message import DecodeError
        from wandb.proto import wandb_internal_pb2

        try:
            with open(self.path, "rb") as f:
                if self._pos == 0:
                    header = f.read(_FILE_HEADER)
                    if len(header) < _FILE_HEADER:  # not written yet
                        return
                    if header[:4] != b":W&B":
                        raise ValueError("not a W&B transaction log")
                    self._pos = _FILE_HEADER
                f.seek(self._pos)
                data = f.read()
        except FileNotFoundError:  # not created yet
            return
        for record_bytes, end in _records(data, self._pos):
            try:
                record = wandb_internal_pb2.Record.FromString(record_bytes)  # type: ignore[attr-defined]
            except DecodeError:  # not written whole yet: read again next time
                return
            self._pos = end
            kind = record.WhichOneof("record_type")
            if kind == "exit":
                self.complete = True
            elif kind == "history":
                names, step = set(), None
                for item in record.history.item:
                    key = "/".join(item.nested_key) if item.nested_key else item.key
                    if key == STEP_METRIC:
                        step = json.loads(item.value_json)
                    elif not key.startswith("_"):
                        names.add(key)
                if isinstance(step, int):
                    self.count += 1
                    if self.start is not None and step >= self.start:
                        self.rows.append((step, frozenset(names)))

    def settled_rows(self, timeout: float = FLUSH_TIMEOUT) -> list[tuple[int, frozenset[str]]]:
        """`rows` once the file is written: W&B's service writes it after `run.finish()` returned, and a
        killed process's service a moment after. Waits for the exit record, or until the file stopped
        growing for a second (a killed process never writes one), at most `timeout` seconds."""
        deadline = time.monotonic() + timeout
        size, since = -1, time.monotonic()
        while True:
            self.read()
            now = time.monotonic()
            if self.complete or now > deadline:
                return self.rows
            current = self.path.stat().st_size
            if current != size:
                size, since = current, now
            elif now - since >= 1.0:
                return self.rows
            time.sleep(0.1)


def _records(data: bytes, start: int) -> Iterator[tuple[bytes, int]]:
    """Each whole record in `data` (the file's bytes from offset `start`, where a record starts) and the
    offset after it; a record not written whole yet ends the iteration."""
    pending, pos = b"", start
    while True:
        left = _BLOCK - pos % _BLOCK
        if left < _CHUNK_HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        i = pos - start
        if i + _CHUNK_HEADER > len(data):
            return
        _crc, length, kind = struct.unpack("<IHB", data[i : i + _CHUNK_HEADER])
        chunk = data[i + _CHUNK_HEADER : i + _CHUNK_HEADER + length]
        if kind not in (_FULL, _FIRST, _MIDDLE, _LAST) or len(chunk) < length:  # zeros, or a partial write
            return
        pos += _CHUNK_HEADER + length
        if kind == _FULL:
            yield chunk, pos
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        else:
            yield pending + chunk, pos
