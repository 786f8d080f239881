"""Loggers end to end: what TensorBoard event files, metrics.csv, metrics.jsonl, hparams.json and PNG
files hold after a real `fit()`, where each run's directory is, and that only global rank zero writes."""

from __future__ import annotations

import csv
import io
import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from conftest import TinyTrainer, quiet_config
from helpers import LossRecorder
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from dream_trainer import Callback, Logger, MemoryLogger
from dream_trainer.callbacks import LearningRateMonitor
from dream_trainer.loggers import CSVLogger, ImageFileLogger, JSONLinesLogger, TensorBoardLogger

N_TRAIN, N_VAL, BATCH = 16, 8, 4  # 4 training steps per epoch, 2 validation batches
LR, GAMMA = 0.1, 0.5


class ValRecorder(Callback):
    """`(global_step, callback_metrics)` after every real (non-sanity) validation."""

    def __init__(self) -> None:
        self.runs: list[tuple[int, dict[str, float]]] = []

    def on_validation_end(self, trainer):
        if not trainer.sanity_checking:
            self.runs.append((trainer.global_step, dict(trainer.callback_metrics)))


class RichTrainer(TinyTrainer):
    """TinyTrainer plus a torchmetrics metric, a per-epoch LR schedule, the LR logged every step, and
    images/histograms logged at the first batch of every epoch."""

    def __init__(self, config, **kwargs):
        super().__init__(config, n_train=N_TRAIN, n_val=N_VAL, batch_size=BATCH, lr=LR, **kwargs)
        self.val_mae = torchmetrics.MeanAbsoluteError()
        self.val_abs_errors: list[list[torch.Tensor]] = []  # one list per validation run
        self.logged_images: list[tuple[int, torch.Tensor]] = []
        self.logged_weights: list[tuple[int, torch.Tensor]] = []

    def configure_optimizers(self):
        super().configure_optimizers()
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=GAMMA)

    def training_step(self, batch, batch_idx):
        self.log_metrics({"lr": self.optimizer.param_groups[0]["lr"]})
        if batch_idx == 0:
            g = torch.Generator().manual_seed(self.global_step)
            single = torch.rand(3, 5, 7, generator=g)  # (C, H, W): one image
            pair = torch.rand(2, 1, 6, 9, generator=g)  # (N, C, H, W): two grey images
            self.log_images("single", single)
            self.log_images("pair", pair)
            self.logged_images.append((self.global_step, single))
            self.log_histogram("weights", self.model.weight)
            self.logged_weights.append((self.global_step, self.model.weight.detach().clone()))
        return super().training_step(batch, batch_idx)

    def on_validation_epoch_start(self):
        if not self.sanity_checking:
            self.val_abs_errors.append([])

    def validation_step(self, batch, batch_idx):
        x, y = batch
        pred = self.model(x)
        self.val_mae(pred, y)
        if not self.sanity_checking:
            self.val_abs_errors[-1].append((pred - y).abs().flatten())
        return {"val_loss": F.mse_loss(pred, y)}


def _accumulator(log_dir: Path) -> EventAccumulator:
    ea = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "images": 0, "histograms": 0, "tensors": 0})
    ea.Reload()
    return ea


def _scalars(ea: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in ea.Scalars(tag)]


def _event_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("events.out.tfevents.*"))


def _png_header(png: bytes) -> tuple[int, int, int, int]:
    """(width, height, bit depth, colour type) from the IHDR chunk; checks the signature."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n", png[:8]
    assert png[12:16] == b"IHDR"
    width, height, depth, colour = struct.unpack(">IIBB", png[16:26])
    return width, height, depth, colour


def _png_pixels(png: bytes) -> torch.Tensor:
    """Decode a PNG with Pillow, as any image viewer would, to (H, W, C) uint8."""
    image = Image.open(io.BytesIO(png))
    image.load()
    pixels = torch.from_numpy(np.asarray(image).copy())
    return pixels if pixels.dim() == 3 else pixels[..., None]  # grey: (H, W) -> (H, W, 1)


def _as_uint8_hwc(image_chw: torch.Tensor) -> torch.Tensor:
    return (image_chw.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0)


# --- TensorBoard event files ------------------------------------------------------------------------------
@pytest.fixture
def tb_run(tmp_path):
    """A 2-epoch run with the default TensorBoardLogger, log_every_n_steps=1."""
    losses, vals = LossRecorder(), ValRecorder()
    callbacks = [losses, vals, LearningRateMonitor()]
    cfg = quiet_config(tmp_path / "root", n_epochs=2, log_every_n_steps=1, loggers=None, callbacks=callbacks)
    trainer = RichTrainer(cfg)
    trainer.fit()
    return trainer, losses, vals, _accumulator(tmp_path / "root" / "version_0")


def test_tensorboard_train_loss_at_every_step(tb_run):
    _, losses, _, ea = tb_run
    assert len(losses.losses) == 8
    assert "loss" in ea.Tags()["scalars"]
    steps, values = zip(*_scalars(ea, "loss"), strict=True)
    assert list(steps) == list(range(1, 9))
    assert list(values) == pytest.approx(losses.losses, rel=1e-5)


def test_tensorboard_val_loss_and_torchmetric_once_per_epoch(tb_run):
    trainer, _, vals, ea = tb_run
    assert [step for step, _ in vals.runs] == [4, 8]
    val_loss = _scalars(ea, "val_loss")
    assert [s for s, _ in val_loss] == [4, 8]
    assert [v for _, v in val_loss] == pytest.approx([m["val_loss"] for _, m in vals.runs], rel=1e-5)

    # The per-epoch MAE, computed by hand from that validation's own errors only.
    expected_mae = [torch.cat(errs).mean().item() for errs in trainer.val_abs_errors]
    assert len(expected_mae) == 2 and expected_mae[0] != pytest.approx(expected_mae[1])
    val_mae = _scalars(ea, "val_mae")
    assert [s for s, _ in val_mae] == [4, 8]
    assert [v for _, v in val_mae] == pytest.approx(expected_mae, rel=1e-5)


def test_tensorboard_learning_rate(tb_run):
    _, _, _, ea = tb_run
    # logged by the user with log_metrics at global_step before each step
    lr = _scalars(ea, "lr")
    assert [s for s, _ in lr] == list(range(8))
    assert [v for _, v in lr] == pytest.approx([LR * GAMMA ** (s // 4) for s in range(8)], rel=1e-6)
    # logged by LearningRateMonitor: an epoch-scheduled optimizer is logged at each epoch start
    monitored = _scalars(ea, "lr-optimizer")
    assert [s for s, _ in monitored] == [0, 4]
    assert [v for _, v in monitored] == pytest.approx([LR, LR * GAMMA], rel=1e-6)


def test_tensorboard_config_text_and_hparams(tb_run):
    trainer, _, _, ea = tb_run
    assert "config/text_summary" in ea.Tags()["tensors"]
    (event,) = ea.Tensors("config/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    for field in ("n_epochs", "log_every_n_steps", "root_dir", "seed"):
        assert f"| {field} |" in text
    assert "| n_epochs | 2 |" in text
    assert "| log_every_n_steps | 1 |" in text

    hp = ea.PluginTagToContent("hparams")
    info = plugin_data_pb2.HParamsPluginData.FromString(hp["_hparams_/session_start_info"]).session_start_info
    assert info.hparams["n_epochs"].number_value == 2
    assert info.hparams["device"].string_value == "cpu"
    assert json.loads((trainer.log_dir / "hparams.json").read_text())["n_epochs"] == 2


def test_tensorboard_images(tb_run):
    trainer, _, _, ea = tb_run
    tags = ea.Tags()["images"]
    assert "single" in tags  # one image: the tag itself
    assert {"pair/0", "pair/1"} <= set(tags)  # several: tag/i
    single = ea.Images("single")
    assert [im.step for im in single] == [step for step, _ in trainer.logged_images] == [0, 4]
    for im, (_, chw) in zip(single, trainer.logged_images, strict=True):
        assert (im.width, im.height) == (7, 5)
        assert _png_header(im.encoded_image_string)[:2] == (7, 5)
        assert torch.equal(_png_pixels(im.encoded_image_string), _as_uint8_hwc(chw))
    for im in ea.Images("pair/1"):
        assert (im.width, im.height) == (9, 6)
        assert _png_header(im.encoded_image_string) == (9, 6, 8, 0)  # grey


def test_tensorboard_histogram(tb_run):
    trainer, _, _, ea = tb_run
    assert "weights" in ea.Tags()["histograms"]
    hists = ea.Histograms("weights")
    assert [h.step for h in hists] == [step for step, _ in trainer.logged_weights] == [0, 4]
    for h, (_, w) in zip(hists, trainer.logged_weights, strict=True):
        assert h.histogram_value.num == w.numel() == 4
        assert h.histogram_value.min == pytest.approx(w.min().item(), rel=1e-6)
        assert h.histogram_value.max == pytest.approx(w.max().item(), rel=1e-6)
        assert h.histogram_value.sum == pytest.approx(w.sum().item(), rel=1e-5, abs=1e-6)


# --- run directory layout ---------------------------------------------------------------------------------
# The log directory is the run directory, <root_dir>/<run name> (it used to be <root_dir>/logs/<run name>,
# beside a <root_dir>/checkpoints that every run shared).
def test_default_runs_get_version_0_then_version_1(tmp_path):
    root = tmp_path / "root"
    first = TinyTrainer(quiet_config(root, loggers=None))
    first.fit()
    assert first.log_dir == first.run_dir == root / "version_0"
    assert _event_files(root / "version_0")

    second = TinyTrainer(quiet_config(root, loggers=None))
    second.fit()
    assert second.log_dir == root / "version_1"
    assert _event_files(root / "version_1")
    assert sorted(p.name for p in root.iterdir()) == ["version_0", "version_1"]
    # the second run did not write into the first run's directory
    assert len(_event_files(root / "version_0")) == 1


def test_next_version_follows_the_highest_existing_one(tmp_path):
    root = tmp_path / "root"
    for name in ("version_0", "version_3", "version_x", "other"):
        (root / name).mkdir(parents=True)
    trainer = TinyTrainer(quiet_config(root, loggers=None))
    assert trainer.log_dir == root / "version_4"


def test_run_name_sets_the_log_directory(tmp_path):
    root = tmp_path / "root"
    trainer = TinyTrainer(quiet_config(root, loggers=None, run_name="exp"))
    trainer.fit()
    assert trainer.log_dir == root / "exp"
    assert _event_files(root / "exp")
    assert [p.name for p in root.iterdir()] == ["exp"]


def test_several_loggers_share_one_run_directory(tmp_path):
    root = tmp_path / "root"
    loggers = [TensorBoardLogger(), CSVLogger(), JSONLinesLogger()]
    trainer = TinyTrainer(quiet_config(root, n_epochs=1, log_every_n_steps=1, loggers=loggers))
    trainer.fit()
    run = root / "version_0"
    assert trainer.log_dir == run
    assert [lg.log_dir for lg in trainer.loggers] == [run, run, run]
    assert [p.name for p in root.iterdir()] == ["version_0"]
    names = {p.name for p in run.iterdir()}
    assert {"metrics.csv", "metrics.jsonl", "hparams.json"} <= names
    assert _event_files(run)


def test_a_logger_with_its_own_save_dir_keeps_it(tmp_path):
    own = tmp_path / "elsewhere"
    csv_logger = CSVLogger(save_dir=own)
    trainer = TinyTrainer(quiet_config(tmp_path / "root", n_epochs=1, loggers=[csv_logger, JSONLinesLogger()]))
    trainer.fit()
    assert (own / "metrics.csv").is_file()
    assert not (trainer.log_dir / "metrics.csv").exists()
    assert (trainer.log_dir / "metrics.jsonl").is_file()


def test_no_loggers_write_nothing(tmp_path):
    root = tmp_path / "root"
    trainer = RichTrainer(quiet_config(root, n_epochs=1, log_every_n_steps=1, loggers=[]))
    trainer.fit()
    assert trainer.loggers == []
    assert trainer.global_step == 4
    # Only the run's own record: run.json, config.yaml and its lock file (no logger wrote anything).
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == [
        "version_0",
        "version_0/.lock",
        "version_0/config.yaml",
        "version_0/run.json",
    ]


def test_default_loggers_create_tensorboard_event_files(tmp_path):
    root = tmp_path / "root"
    trainer = TinyTrainer(quiet_config(root, n_epochs=1, loggers=None))
    assert [type(lg) for lg in trainer.loggers] == [TensorBoardLogger]
    trainer.fit()
    files = _event_files(root / "version_0")
    assert len(files) == 1 and files[0].stat().st_size > 0
    assert "loss" in _accumulator(root / "version_0").Tags()["scalars"]


# --- CSVLogger ----------------------------------------------------------------------------------------------
class LateMetricTrainer(TinyTrainer):
    """Logs `late` only from the third batch of the first epoch on."""

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        if self.global_step >= 2:
            self.log("late", torch.tensor(10.0 + self.global_step))
        return out


def test_csv_logger_columns_are_the_union_of_keys_and_rows_match(tmp_path):
    memory, losses = MemoryLogger(), LossRecorder()
    csv_logger = CSVLogger(flush_every=2)  # rewritten mid-run, before `late` and `val_loss` exist
    cfg = quiet_config(tmp_path, n_epochs=2, log_every_n_steps=1, loggers=[csv_logger, memory], callbacks=[losses])
    trainer = LateMetricTrainer(cfg)
    trainer.fit()

    with open(trainer.log_dir / "metrics.csv", newline="") as f:
        reader = csv.reader(f)
        header = next(reader)
        rows = [dict(zip(header, line, strict=True)) for line in reader]
    keys = {k for _, metrics in memory.history for k in metrics}
    assert keys >= {"loss", "late", "val_loss"}
    assert header[0] == "step"
    assert len(header) == len(set(header))
    assert set(header[1:]) == keys

    assert len(rows) == len(memory.history)
    for row, (step, metrics) in zip(rows, memory.history, strict=True):
        assert int(row["step"]) == step
        for key in keys:
            if key in metrics:
                assert float(row[key]) == pytest.approx(metrics[key], rel=1e-12)
            else:
                assert row[key] == "", (step, key)

    loss_rows = [(int(r["step"]), float(r["loss"])) for r in rows if r["loss"]]
    assert [s for s, _ in loss_rows] == list(range(1, 9))
    assert [v for _, v in loss_rows] == pytest.approx(losses.losses, rel=1e-6)
    late_steps = [int(r["step"]) for r in rows if r["late"]]
    assert late_steps == list(range(3, 9))  # earlier rows have the column, empty
    assert [float(r["late"]) for r in rows if r["late"]] == [10.0 + s - 1 for s in late_steps]
    assert [int(r["step"]) for r in rows if r["val_loss"]] == [4, 8]


def test_csv_logger_writes_hparams(tmp_path):
    trainer = TinyTrainer(quiet_config(tmp_path, n_epochs=1, loggers=[CSVLogger()]))
    trainer.fit()
    hparams = json.loads((trainer.log_dir / "hparams.json").read_text())
    assert set(hparams) == set(trainer.config.to_dict())
    assert hparams["loggers"] == ["CSVLogger"]


# --- JSONLinesLogger -------------------------------------------------------------------------------------------
class NonFiniteTrainer(TinyTrainer):
    def training_step(self, batch, batch_idx):
        if self.global_step == 1:
            self.log_metrics({"weird": float("nan"), "neg": float("-inf"), "fine": 1.5})
        return super().training_step(batch, batch_idx)


def _strict_json(line: str):
    def reject(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(line, parse_constant=reject)


def test_jsonl_logger_lines_parse_with_steps_values_and_nan(tmp_path):
    memory, losses = MemoryLogger(), LossRecorder()
    cfg = quiet_config(
        tmp_path, n_epochs=2, log_every_n_steps=1, loggers=[JSONLinesLogger(), memory], callbacks=[losses]
    )
    trainer = NonFiniteTrainer(cfg)
    trainer.fit()

    lines = (trainer.log_dir / "metrics.jsonl").read_text().splitlines()
    records = [_strict_json(line) for line in lines]  # every line is standard JSON
    assert len(records) == len(memory.history)
    for record, (step, metrics) in zip(records, memory.history, strict=True):
        assert record["step"] == step
        assert set(record) == {"step", *metrics}
        for key, value in metrics.items():
            if math.isfinite(value):
                assert record[key] == pytest.approx(value, rel=1e-12)

    (odd,) = [r for r in records if "weird" in r]
    assert odd == {"step": 1, "weird": "nan", "neg": "-inf", "fine": 1.5}
    loss = [(r["step"], r["loss"]) for r in records if "loss" in r]
    assert [s for s, _ in loss] == list(range(1, 9))
    assert [v for _, v in loss] == pytest.approx(losses.losses, rel=1e-6)
    assert [r["step"] for r in records if "val_loss" in r] == [4, 8]


def test_jsonl_logger_hparams_hold_the_config_fields(tmp_path):
    cfg = quiet_config(tmp_path, n_epochs=2, log_every_n_steps=3, run_name="cfg_run", loggers=[JSONLinesLogger()])
    trainer = TinyTrainer(cfg)
    trainer.fit()
    hparams = json.loads((tmp_path / "cfg_run" / "hparams.json").read_text())
    assert set(hparams) == set(cfg.to_dict())
    assert hparams["n_epochs"] == 2
    assert hparams["log_every_n_steps"] == 3
    assert hparams["run_name"] == "cfg_run"
    assert hparams["device"] == "cpu"
    assert hparams["loggers"] == ["JSONLinesLogger"]


# --- ImageFileLogger -------------------------------------------------------------------------------------------
class ImageTrainer(TinyTrainer):
    def __init__(self, config):
        super().__init__(config, n_val=0)
        self.logged: dict[int, torch.Tensor] = {}

    def training_step(self, batch, batch_idx):
        if batch_idx in (0, 2):
            images = torch.rand(5, 3, 6, 10, generator=torch.Generator().manual_seed(batch_idx))
            self.log_images("samples", images)
            self.logged[self.global_step] = images
        return super().training_step(batch, batch_idx)


def test_image_file_logger_writes_valid_pngs(tmp_path):
    trainer = ImageTrainer(quiet_config(tmp_path, n_epochs=1, loggers=[ImageFileLogger(max_images=3)]))
    trainer.fit()
    folder = trainer.log_dir / "images" / "samples"
    assert sorted(trainer.logged) == [0, 2]
    expected = {f"step={s}-{i}.png" for s in (0, 2) for i in range(3)}  # at most max_images per call
    assert {p.name for p in folder.iterdir()} == expected
    assert sorted(p.relative_to(trainer.log_dir) for p in trainer.log_dir.rglob("*.png")) == sorted(
        Path("images", "samples", name) for name in expected
    )
    for step, images in trainer.logged.items():
        for i in range(3):
            png = (folder / f"step={step}-{i}.png").read_bytes()
            assert _png_header(png) == (10, 6, 8, 2)  # width, height, 8-bit, RGB
            assert torch.equal(_png_pixels(png), _as_uint8_hwc(images[i]))


def test_image_file_logger_grey_and_rgba_and_own_dir(tmp_path):
    logger = ImageFileLogger(save_dir=tmp_path / "pngs", max_images=8)
    grey = torch.arange(2 * 4 * 3, dtype=torch.uint8).reshape(2, 4, 3, 1)  # (N, H, W, C) as loggers receive
    rgba = torch.full((1, 2, 5, 4), 200, dtype=torch.uint8)
    logger.log_images("grey", grey, step=7)
    logger.log_images("rgba", rgba, step=9)
    assert sorted(p.name for p in (tmp_path / "pngs" / "grey").iterdir()) == ["step=7-0.png", "step=7-1.png"]
    png = (tmp_path / "pngs" / "grey" / "step=7-1.png").read_bytes()
    assert _png_header(png) == (3, 4, 8, 0)
    assert torch.equal(_png_pixels(png), grey[1])
    png = (tmp_path / "pngs" / "rgba" / "step=9-0.png").read_bytes()
    assert _png_header(png) == (5, 2, 8, 6)
    assert torch.equal(_png_pixels(png), rgba[0])


# --- only rank zero writes ------------------------------------------------------------------------------------
class CallLogger(Logger):
    """Records every call it receives."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def log_hyperparams(self, params):
        self.calls.append("log_hyperparams")

    def log_metrics(self, metrics, step):
        self.calls.append("log_metrics")

    def log_images(self, tag, images, step):
        self.calls.append("log_images")

    def log_histogram(self, tag, values, step):
        self.calls.append("log_histogram")

    def finalize(self, status):
        self.calls.append("finalize")


def _all_loggers():
    return [TensorBoardLogger(), CSVLogger(), JSONLinesLogger(), ImageFileLogger(), CallLogger(), MemoryLogger()]


def test_rank_zero_reference_run_writes_and_calls_loggers(tmp_path):
    """The control for the non-zero-rank tests below: the same run on rank 0 writes files and calls."""
    root = tmp_path / "root"
    loggers = _all_loggers()
    trainer = RichTrainer(quiet_config(root, n_epochs=1, log_every_n_steps=1, loggers=loggers))
    trainer.fit()
    assert {p.name for p in trainer.log_dir.iterdir()} >= {"metrics.csv", "metrics.jsonl", "hparams.json", "images"}
    assert {"log_hyperparams", "log_metrics", "log_images", "log_histogram", "finalize"} <= set(loggers[4].calls)


@pytest.mark.parametrize("how", ["attribute", "env"])
def test_only_rank_zero_writes(tmp_path, monkeypatch, how):
    root = tmp_path / "root"
    loggers = _all_loggers()
    if how == "env":
        monkeypatch.setenv("RANK", "1")
    trainer = RichTrainer(quiet_config(root, n_epochs=1, log_every_n_steps=1, loggers=loggers))
    if how == "attribute":
        trainer.global_rank = 1
    assert not trainer.is_global_zero
    trainer.fit()

    assert trainer.global_step == 4  # it did train
    assert "loss" in trainer.callback_metrics  # and reduced its metrics
    assert not root.exists() or [p for p in root.rglob("*") if p.is_file()] == []
    assert loggers[4].calls == []
    memory = loggers[5]
    assert memory.history == [] and memory.hyperparams == {} and memory.images == [] and memory.status is None


def test_tensorboard_hparams_plugin_reads_every_config_key(tb_run):
    # Read back the way TensorBoard's HPARAMS tab does: the hparams plugin's own parsers on the
    # plugin data of the run's one event file. The experiment declares every config key, the session
    # start gives each its value, the session end the run's status.
    from tensorboard.plugins.hparams import api_pb2, metadata

    trainer, _, _, ea = tb_run
    content = ea.PluginTagToContent(metadata.PLUGIN_NAME)
    assert set(content) == {metadata.EXPERIMENT_TAG, metadata.SESSION_START_INFO_TAG, metadata.SESSION_END_INFO_TAG}
    experiment = metadata.parse_experiment_plugin_data(content[metadata.EXPERIMENT_TAG])
    config = trainer.config.to_dict()
    assert [info.name for info in experiment.hparam_infos] == list(config)
    kinds = {info.name: info.type for info in experiment.hparam_infos}
    assert kinds["n_epochs"] == api_pb2.DATA_TYPE_FLOAT64 and kinds["device"] == api_pb2.DATA_TYPE_STRING
    assert kinds["compile_model"] == api_pb2.DATA_TYPE_BOOL
    start = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG])
    assert set(start.hparams) == set(config)
    assert start.hparams["log_every_n_steps"].number_value == 1
    assert start.hparams["compile_model"].bool_value is False
    assert start.hparams["loggers"].string_value == "None"
    end = metadata.parse_session_end_info_plugin_data(content[metadata.SESSION_END_INFO_TAG])
    assert end.status == api_pb2.STATUS_SUCCESS


def test_encode_png_decodes_to_the_same_pixels():
    from dream_trainer.utils.images import encode_png, to_uint8_images

    g = torch.Generator().manual_seed(0)
    for channels, colour in ((1, 0), (3, 2), (4, 6)):  # grey, RGB, RGBA
        batch = to_uint8_images(torch.rand(3, channels, 13, 17, generator=g))  # odd sizes; images are views
        for image in batch:
            png = encode_png(image)
            assert _png_header(png) == (17, 13, 8, colour)
            assert torch.equal(_png_pixels(png), image)
    with pytest.raises(ValueError, match="uint8"):
        encode_png(torch.rand(4, 4, 3))
