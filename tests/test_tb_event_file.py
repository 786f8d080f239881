"""The batched TensorBoard event writer: its framing is tensorboard's, values wait in memory at most
`flush_secs`, a checkpoint flushes them, and the hparams session records the run's status."""

from __future__ import annotations

import csv
import io
import os
import random
import subprocess

import numpy as np
import pytest
import torch
from conftest import TinyTrainer, quiet_config
from helpers import python
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.compat.proto import event_pb2
from tensorboard.compat.tensorflow_stub import errors
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import PyRecordReader_New
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as tensorboard_crc
from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2

from dream_trainer import Callback
from dream_trainer.callbacks import ModelCheckpoint
from dream_trainer.loggers import CSVLogger, TensorBoardLogger
from dream_trainer.loggers.event_file import EventFile, masked_crc32c
from dream_trainer.loggers.tb_summaries import images


def _scalars(log_dir, tag: str) -> list[tuple[int, float]]:
    ea = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    if tag not in ea.Tags()["scalars"]:
        return []
    return [(e.step, e.value) for e in ea.Scalars(tag)]


def test_checksum_matches_tensorboards_own():
    rng = random.Random(0)
    for n in (0, 1, 3, 8, 12, 31, 64, 257, 4096):
        data = bytes(rng.randrange(256) for _ in range(n))
        assert masked_crc32c(data) == tensorboard_crc(data), n


def test_values_wait_in_memory_until_flush(tmp_path):
    events = EventFile(tmp_path, flush_secs=3600)
    for step in range(1, 6):
        events.add_scalars({"loss": 1.0 / step, "acc": step / 10}, step)
    assert _scalars(tmp_path, "loss") == []  # only the file-version record is on disk
    events.flush()
    assert [s for s, _ in _scalars(tmp_path, "loss")] == [1, 2, 3, 4, 5]
    assert [v for _, v in _scalars(tmp_path, "acc")] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])
    events.add_scalars({"loss": 0.1}, 6)
    events.close()
    assert [s for s, _ in _scalars(tmp_path, "loss")] == [1, 2, 3, 4, 5, 6]


def test_a_full_buffer_or_an_elapsed_interval_writes(tmp_path):
    events = EventFile(tmp_path / "count", flush_secs=3600, max_pending=3)
    for step in range(3):
        events.add_scalars({"x": float(step)}, step)
    assert [s for s, _ in _scalars(tmp_path / "count", "x")] == [0, 1, 2]

    timed = EventFile(tmp_path / "timed", flush_secs=0)  # every add is past the interval
    timed.add_scalars({"x": 1.0}, 7)
    assert _scalars(tmp_path / "timed", "x") == [(7, 1.0)]


def test_values_still_in_memory_are_written_at_interpreter_exit(tmp_path):
    code = (
        "import sys; from pathlib import Path; from dream_trainer.loggers.event_file import EventFile; "
        "e = EventFile(Path(sys.argv[1]), flush_secs=3600); [e.add_scalars({'x': float(s)}, s) for s in range(3)]"
    )
    subprocess.run([python(), "-c", code, str(tmp_path)], check=True, timeout=60)
    assert [s for s, _ in _scalars(tmp_path, "x")] == [0, 1, 2]


class ReadBack(Callback):
    """At each batch's start, by global step done, the steps of `loss` already on disk (a step's checkpoint
    is written at the batch boundary, after its `on_train_batch_end`: it is on disk when the next batch starts)."""

    def __init__(self) -> None:
        self.on_disk: dict[int, list[int]] = {}

    def on_train_batch_start(self, trainer, batch, batch_idx):
        self.on_disk[trainer.global_step] = [s for s, _ in _scalars(trainer.log_dir, "loss")]


def test_a_checkpoint_writes_every_value_logged_before_it(tmp_path):
    # flush_secs is an hour: only the checkpoints (every 2 steps) and the end of fit write values, so
    # a run killed after a checkpoint and resumed from it has no hole in its curves.
    probe = ReadBack()
    cfg = quiet_config(
        tmp_path, n_epochs=1, log_every_n_steps=1, loggers=[TensorBoardLogger(flush_secs=3600)],
        callbacks=[ModelCheckpoint(every_n_train_steps=2, save_top_k=-1), probe],
    )  # fmt: skip
    trainer = TinyTrainer(cfg, n_train=24)  # 6 steps
    trainer.fit()
    assert probe.on_disk == {0: [], 1: [], 2: [1, 2], 3: [1, 2], 4: [1, 2, 3, 4], 5: [1, 2, 3, 4]}
    assert [s for s, _ in _scalars(trainer.log_dir, "loss")] == [1, 2, 3, 4, 5, 6]


def _session_end_status(log_dir) -> int:
    ea = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    ea.Reload()
    content = ea.PluginTagToContent("hparams")["_hparams_/session_end_info"]
    return plugin_data_pb2.HParamsPluginData.FromString(content).session_end_info.status


def test_hparams_session_records_success_and_failure(tmp_path):
    ok = TinyTrainer(quiet_config(tmp_path / "ok", loggers=None))
    ok.fit()
    assert _session_end_status(ok.log_dir) == api_pb2.STATUS_SUCCESS

    class Boom(TinyTrainer):
        def training_step(self, batch, batch_idx):
            if self.global_step == 2:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    failed = Boom(quiet_config(tmp_path / "failed", loggers=None, log_every_n_steps=1))
    with pytest.raises(RuntimeError, match="boom"):
        failed.fit()
    assert _session_end_status(failed.log_dir) == api_pb2.STATUS_FAILURE
    assert [s for s, _ in _scalars(failed.log_dir, "loss")] == [1, 2]  # written although the run failed


def test_experiment_is_a_summary_writer_on_the_run_directory(tmp_path):
    logger = TensorBoardLogger()

    class Custom(TinyTrainer):
        def on_train_epoch_end(self) -> None:
            logger.experiment.add_scalar("custom", 42.0, self.global_step)

    trainer = Custom(quiet_config(tmp_path, n_epochs=1, log_every_n_steps=1, loggers=[logger]))
    trainer.fit()
    assert _scalars(trainer.log_dir, "custom") == [(4, 42.0)]
    assert [s for s, _ in _scalars(trainer.log_dir, "loss")] == [1, 2, 3, 4]
    assert TensorBoardLogger.writer is TensorBoardLogger.experiment  # the 0.1.0 name still works


def test_csv_appends_rows_and_rewrites_only_for_a_new_column(tmp_path):
    logger = CSVLogger(tmp_path, flush_every=10)
    for step in range(1, 96):
        logger.log_metrics({"loss": step / 100}, step)
    inode = os.stat(logger.path).st_ino
    for step in range(96, 201):
        logger.log_metrics({"loss": step / 100}, step)
    assert os.stat(logger.path).st_ino == inode  # appended in place, not rewritten
    logger.log_metrics({"loss": 2.01, "acc": 0.5}, 201)
    logger.finalize("success")
    assert os.stat(logger.path).st_ino != inode  # the new column: rewritten once
    with open(logger.path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, 202))
    assert [float(r["loss"]) for r in rows] == pytest.approx([s / 100 for s in range(1, 202)])
    assert [r["acc"] for r in rows[:-1]] == [""] * 200 and rows[-1]["acc"] == "0.5"


def _records(path) -> list[bytes]:
    """Every record of an event file through tensorboard's own reader, which checks both CRCs of each."""
    reader, out = PyRecordReader_New(str(path)), []
    while True:
        try:
            reader.GetNext()
        except errors.OutOfRangeError:
            return out
        out.append(reader.record())


def test_tensorboards_reader_verifies_every_crc_of_a_large_image_record(tmp_path):
    pixels = torch.randint(0, 256, (1, 512, 512, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    events = EventFile(tmp_path, flush_secs=3600)
    events.add_scalars({"loss": 0.5}, 1)
    events.add_summary(images("noise", pixels), 1)  # a PNG of about 0.8 MB: one large record
    events.close()
    records = _records(events.path)
    assert len(records) == 3  # the file version, the scalars, the image
    image = event_pb2.Event.FromString(records[2]).summary.value[0].image
    assert len(image.encoded_image_string) > 700_000
    decoded = np.asarray(Image.open(io.BytesIO(image.encoded_image_string)))
    assert torch.equal(torch.from_numpy(decoded.copy()), pixels[0])

    data = bytearray(events.path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte of the image record flipped: its CRC no longer matches
    events.path.write_bytes(bytes(data))
    with pytest.raises(errors.DataLossError, match="crc32"):
        _records(events.path)
