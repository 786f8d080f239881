"""What the tracker loggers share, without a backend: `import dream_trainer` never imports mlflow or
wandb, the registry names both loggers, a missing package names its extra, and the background
writer's contract (order, batching, flush, bounded queue, errors raised once on the caller's thread)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from dream_trainer.loggers.background import BackgroundWriter, LoggerWriteError
from dream_trainer.loggers.tracker import checkpoints_to_upload


def test_import_dream_trainer_does_not_import_mlflow_or_wandb() -> None:
    code = (
        "import sys, dream_trainer, dream_trainer.loggers, dream_trainer.registry as r\n"
        "assert 'MLFlowLogger' in r.LOGGERS and 'WandbLogger' in r.LOGGERS\n"
        "r.LOGGERS.get('MLFlowLogger'); r.LOGGERS.get('WandbLogger')  # the classes, not the packages\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('mlflow', 'wandb'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_builtins_list_the_trackers() -> None:
    import dream_trainer.loggers as loggers
    from dream_trainer.loggers.mlflow import MLFlowLogger
    from dream_trainer.loggers.wandb import WandbLogger

    assert {"MLFlowLogger", "WandbLogger"} <= set(loggers.BUILTINS)
    assert loggers.MLFlowLogger is MLFlowLogger and loggers.WandbLogger is WandbLogger
    with pytest.raises(AttributeError, match="no attribute 'NoSuchLogger'"):
        loggers.NoSuchLogger  # noqa: B018


@pytest.mark.parametrize(("name", "package"), [("MLFlowLogger", "mlflow"), ("WandbLogger", "wandb")])
def test_a_missing_package_names_its_extra(monkeypatch: pytest.MonkeyPatch, name: str, package: str) -> None:
    from dream_trainer.registry import LOGGERS

    monkeypatch.setitem(sys.modules, package, None)  # how Python sees a package that is not installed
    with pytest.raises(ModuleNotFoundError, match=rf"{name} needs {package}: pip install 'dream-trainer\[{package}\]'"):
        LOGGERS.build({"type": name})


def test_log_checkpoints_is_checked() -> None:
    from dream_trainer.errors import ConfigError
    from dream_trainer.loggers.mlflow import MLFlowLogger

    with pytest.raises(ConfigError, match=r"MLFlowLogger\(log_checkpoints='best'\) is invalid"):
        MLFlowLogger(log_checkpoints="best")


def test_checkpoints_to_upload(tmp_path) -> None:
    (tmp_path / "epoch=0-step=4.ckpt").write_bytes(b"a")
    time.sleep(0.01)
    (tmp_path / "epoch=1-step=8.ckpt").write_bytes(b"b")
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert checkpoints_to_upload(tmp_path, "last") == [tmp_path / "epoch=1-step=8.ckpt"]  # the newest
    (tmp_path / "last.ckpt").hardlink_to(tmp_path / "epoch=0-step=4.ckpt")
    assert checkpoints_to_upload(tmp_path, "last") == [tmp_path / "last.ckpt"]
    assert [p.name for p in checkpoints_to_upload(tmp_path, "all")] == [
        "epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt",
    ]  # fmt: skip
    assert checkpoints_to_upload(tmp_path, False) == [] and checkpoints_to_upload(tmp_path / "none", "all") == []


# --- BackgroundWriter -------------------------------------------------------------------------------
def test_items_are_written_in_order_in_batches_off_the_calling_thread() -> None:
    batches: list[list[int]] = []
    threads: set[str] = set()

    def write(items: list[int]) -> None:
        threads.add(threading.current_thread().name)
        batches.append(items)

    writer = BackgroundWriter("Demo", write, interval=60)
    for i in range(100):
        writer.submit(i)
    assert batches == [] and writer.pending == 100  # nothing written until the interval or a flush
    writer.flush()
    assert batches == [list(range(100))] and writer.pending == 0  # one batch: one backend call
    writer.submit(100)
    writer.close()
    assert [i for b in batches for i in b] == list(range(101))
    assert threads == {"dream_trainer-Demo"}


def test_a_half_full_queue_wakes_the_worker_and_a_full_one_waits() -> None:
    in_write, release = threading.Event(), threading.Event()
    written: list[int] = []

    def write(items: list[int]) -> None:
        in_write.set()
        release.wait(10)
        written.extend(items)

    writer = BackgroundWriter("Slow", write, interval=60, max_pending=4)
    writer.submit(0)
    writer.submit(1)  # half full: wakes the worker long before its 60 s interval
    assert in_write.wait(10)  # the worker holds 0 and 1, stuck in the backend
    for i in range(2, 6):
        writer.submit(i)  # the queue fills up: 4 items
    blocked = threading.Thread(target=writer.submit, args=(6,))
    blocked.start()
    blocked.join(0.3)
    assert blocked.is_alive()  # a full queue: submit waits instead of dropping values
    release.set()
    blocked.join(10)
    writer.close()
    assert written == list(range(7))


def test_a_write_error_is_raised_once_on_the_next_call() -> None:
    calls: list[list[int]] = []

    def write(items: list[int]) -> None:
        calls.append(items)
        if 3 in items:
            raise ConnectionError("server went away")

    writer = BackgroundWriter("Flaky", write, interval=0.02)
    writer.submit(3)
    with pytest.raises(
        LoggerWriteError, match=r"^Flaky: a background write failed: ConnectionError: server went away"
    ) as e:
        writer.flush()
    assert isinstance(e.value.__cause__, ConnectionError)
    writer.submit(4)  # raised once: the next calls go on
    writer.flush()
    writer.submit(3)
    deadline = time.monotonic() + 10
    while writer.pending and time.monotonic() < deadline:  # the worker fails on its own ...
        time.sleep(0.01)
    with pytest.raises(LoggerWriteError, match="server went away"):
        writer.submit(5)  # ... and the next call on this thread, whichever it is, says so
    writer.close()
    assert calls == [[3], [4], [3]]  # 5 was refused with the error


def test_close_on_the_failure_path_prints_instead_of_raising(capsys: pytest.CaptureFixture[str]) -> None:
    def write(items: list[int]) -> None:
        raise OSError("disk full")

    writer = BackgroundWriter("Failing", write, interval=60)
    writer.submit(1)
    writer.close(raise_errors=False)
    assert "Failing: a background write failed: OSError: disk full" in capsys.readouterr().err
    writer.close()  # nothing left to raise
