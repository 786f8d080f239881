"""ThroughputMonitor: which keys are logged when, consistent values, and data wait that shows up."""

from __future__ import annotations

import time

import pytest
from conftest import TinyTrainer, make_regression_data, quiet_config
from torch.utils.data import DataLoader, Dataset

from dream_trainer import ConfigError, MemoryLogger
from dream_trainer.callbacks.throughput import ThroughputMonitor

KEYS = ("throughput/samples_per_sec", "throughput/step_time", "throughput/data_wait_time")


def run(tmp_path, cb, cls=TinyTrainer, n_epochs=1, **cfg):
    logger = MemoryLogger()
    trainer = cls(quiet_config(tmp_path, n_epochs=n_epochs, callbacks=[cb], loggers=[logger], **cfg))
    trainer.fit()
    return trainer, logger


def test_logs_every_n_steps_with_consistent_values(tmp_path):
    _, logger = run(tmp_path, ThroughputMonitor(log_every_n_steps=2), n_epochs=2)  # 8 steps of 4 samples
    for key in KEYS:
        assert [s for s, _ in logger.series(key)] == [2, 4, 6, 8]
    assert not logger.series("throughput/tokens_per_sec") and not logger.series("throughput/flops_per_sec")
    for (_, sps), (_, step), (_, wait) in zip(*(logger.series(k) for k in KEYS), strict=True):
        assert sps > 0 and step > 0 and wait >= 0
        assert sps == pytest.approx(4 / (step + wait), rel=1e-6)


def test_default_cadence_is_config_log_every_n_steps(tmp_path):
    _, logger = run(tmp_path, ThroughputMonitor(), n_epochs=2, log_every_n_steps=3)
    assert [s for s, _ in logger.series("throughput/step_time")] == [3, 6]


def test_accumulation_logs_per_training_step_and_counts_every_batch(tmp_path):
    cb = ThroughputMonitor(log_every_n_steps=1, window=2)
    _, logger = run(tmp_path, cb, gradient_accumulation_steps=2)  # 4 batches -> 2 steps
    assert [s for s, _ in logger.series("throughput/samples_per_sec")] == [1, 2]
    (_, sps), (_, step), (_, wait) = (logger.series(k)[-1] for k in KEYS)
    assert sps == pytest.approx(4 / (step + wait), rel=1e-6)  # both batches of the window, 4 samples each


class SlowDataset(Dataset):
    def __init__(self, n: int, delay: float):
        self.x, self.y = make_regression_data(n)
        self.delay = delay

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        time.sleep(self.delay)
        return self.x[i], self.y[i]


class SlowDataTrainer(TinyTrainer):
    delay = 0.02

    def configure_dataloaders(self):
        return DataLoader(SlowDataset(8, self.delay), batch_size=2), None  # 4 batches, 40 ms of loading each


def test_slow_data_shows_up_as_data_wait(tmp_path):
    _, logger = run(tmp_path, ThroughputMonitor(log_every_n_steps=4), cls=SlowDataTrainer)
    [(_, sps)], [(_, step)], [(_, wait)] = (logger.series(k) for k in KEYS)
    assert wait >= 0.035  # at least 2 x 20 ms of sleep per batch
    assert step < wait
    assert sps == pytest.approx(2 / (step + wait), rel=1e-6)
    assert sps < 2 / 0.035


def test_validation_time_is_not_data_wait(tmp_path):
    class SlowValidation(TinyTrainer):
        def validation_step(self, batch, batch_idx):
            time.sleep(0.05)
            return super().validation_step(batch, batch_idx)

    _, logger = run(tmp_path, ThroughputMonitor(log_every_n_steps=4), cls=SlowValidation, val_every_n_steps=1)
    [(_, wait)] = logger.series("throughput/data_wait_time")
    assert wait < 0.02  # 4 validations of 2 x 50 ms ran between the batches


def test_tokens_and_flops(tmp_path):
    cb = ThroughputMonitor(
        tokens_per_batch_fn=lambda batch: (batch[0] != 0).sum(),  # a tensor: summed on the device
        flops_per_batch=1e6,
        log_every_n_steps=4,
    )
    _, logger = run(tmp_path, cb)
    [(_, sps)] = logger.series("throughput/samples_per_sec")
    [(_, tps)] = logger.series("throughput/tokens_per_sec")
    [(_, fps)] = logger.series("throughput/flops_per_sec")
    assert isinstance(tps, float) and tps == pytest.approx(sps * 4, rel=1e-6)  # 4 features per sample
    assert fps == pytest.approx(1e6 * sps / 4, rel=1e-6)  # one batch is 4 samples


def test_custom_batch_size_and_bad_arguments(tmp_path):
    _, logger = run(tmp_path, ThroughputMonitor(batch_size_fn=lambda b: 10, log_every_n_steps=4))
    [(_, sps)], [(_, step)], [(_, wait)] = (logger.series(k) for k in KEYS)
    assert sps == pytest.approx(10 / (step + wait), rel=1e-6)
    for kwargs, arg in [
        ({"window": 0}, "window"),
        ({"log_every_n_steps": 0}, "log_every_n_steps"),
        ({"flops_per_batch": -1}, "flops_per_batch"),
        ({"batch_size_fn": 3}, "batch_size_fn"),
    ]:
        with pytest.raises(ConfigError, match=rf"ThroughputMonitor\({arg}="):
            ThroughputMonitor(**kwargs)
    assert ThroughputMonitor().compute() == {}
