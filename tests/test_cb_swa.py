"""StochasticWeightAveraging: the same weights as a hand-written torch.optim.swa_utils loop, BatchNorm
statistics recomputed, argument checks, and a resumed run equal to an uninterrupted one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyTrainer, make_regression_data, quiet_config
from torch import nn
from torch.optim.swa_utils import SWALR, AveragedModel, update_bn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import ConfigError, MisconfigurationError, ModelCheckpoint
from dream_trainer.callbacks import StochasticWeightAveraging


def make_model(bn: bool) -> nn.Module:
    torch.manual_seed(0)
    if bn:
        return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


class SWATrainer(TinyTrainer):
    """TinyTrainer with a small MLP (optionally with BatchNorm) and a StepLR scheduler per epoch."""

    def __init__(self, config, bn: bool = True, **kwargs):
        super().__init__(config, **kwargs)
        self.model = make_model(bn)
        self.lrs_seen: list[float] = []

    def configure_optimizers(self):
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=self.lr)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.5)

    def on_train_batch_start(self, batch, batch_idx):  # fires after the callbacks' hook
        self.lrs_seen.append(self.optimizer.param_groups[0]["lr"])


def train_loader() -> DataLoader:
    x, y = make_regression_data(16 + 8, seed=0)
    return DataLoader(TensorDataset(x[:16], y[:16]), batch_size=4)


def reference(n_epochs, start, swa_lr, anneal_epochs, strategy, bn=True):
    """The canonical swa_utils loop: StepLR before `start`, SWALR from it, average after each SWA epoch,
    then update_bn. Returns (final state_dict, lrs per batch)."""
    model = make_model(bn)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    swa_model = AveragedModel(model)
    loader = train_loader()
    swa_sched = None
    lrs = []
    for epoch in range(n_epochs):
        if epoch == start:
            swa_sched = SWALR(opt, swa_lr=swa_lr, anneal_epochs=anneal_epochs, anneal_strategy=strategy)
        elif epoch > start:
            swa_sched.step()
        for x, y in loader:
            lrs.append(opt.param_groups[0]["lr"])
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
        if epoch >= start:
            swa_model.update_parameters(model)
        else:
            sched.step()
    update_bn(loader, swa_model)
    return swa_model.module.state_dict(), lrs


def fit(tmp_path, cb, n_epochs, bn=True, callbacks=(), **cfg):
    trainer = SWATrainer(quiet_config(tmp_path, n_epochs=n_epochs, callbacks=[*callbacks, cb], **cfg), bn=bn)
    trainer.fit()
    return trainer


@pytest.mark.parametrize("strategy", ["cos", "linear"])
def test_final_weights_equal_a_hand_written_swa_utils_loop(tmp_path, strategy):
    cb = StochasticWeightAveraging(swa_lrs=0.02, swa_epoch_start=2, annealing_epochs=2, annealing_strategy=strategy)
    trainer = fit(tmp_path, cb, n_epochs=5)
    expected, lrs = reference(5, 2, 0.02, 2, strategy)
    assert cb.n_averaged == 3 and cb.swa_start == 2
    assert trainer.lrs_seen == pytest.approx(lrs, abs=1e-12)
    assert lrs[8] != lrs[4] and lrs[-1] == pytest.approx(0.02)  # annealed to swa_lrs
    final = trainer.model.state_dict()
    assert set(final) == set(expected)
    for k, v in expected.items():
        torch.testing.assert_close(final[k], v, rtol=0, atol=1e-6, msg=k)


def test_batchnorm_statistics_are_recomputed_for_the_average(tmp_path):
    cb = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=0.5, annealing_epochs=1)
    trainer = fit(tmp_path, cb, n_epochs=4)  # start: int(4 * 0.5) = 2
    assert cb.swa_start == 2 and cb.n_averaged == 2
    bn = trainer.model[1]
    # the statistics of the averaged weights over the whole training set (update_bn: cumulative average)
    x, _ = make_regression_data(24, seed=0)
    with torch.no_grad():
        h = trainer.model[0](x[:16])
    batch_means = torch.stack([h[i : i + 4].mean(0) for i in range(0, 16, 4)])
    torch.testing.assert_close(bn.running_mean, batch_means.mean(0), rtol=0, atol=1e-6)
    assert int(bn.num_batches_tracked) == 4
    # the model holds the average, not the last weights
    avg = cb.average_model("model").module
    for p, q in zip(avg.parameters(), trainer.model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_model_without_batchnorm_gets_the_average_and_keeps_training_flag(tmp_path):
    cb = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1, annealing_epochs=0, device=None)
    trainer = fit(tmp_path, cb, n_epochs=3, bn=False)
    expected, _ = reference(3, 1, 0.05, 0, "cos", bn=False)
    for k, v in expected.items():
        torch.testing.assert_close(trainer.model.state_dict()[k], v, rtol=0, atol=1e-6)
    assert trainer.model.training


def test_no_swa_before_start_leaves_the_model_alone(tmp_path):
    cb = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=5)
    straight = SWATrainer(quiet_config(tmp_path / "a", n_epochs=2))
    straight.fit()
    with pytest.warns(UserWarning, match="no weights will be averaged"):
        trainer = fit(tmp_path / "b", cb, n_epochs=2)
    assert cb.n_averaged == 0
    for k, v in straight.model.state_dict().items():
        assert torch.equal(trainer.model.state_dict()[k], v)


@pytest.mark.parametrize("every", ["epoch", "step"])
def test_resume_mid_run_equals_uninterrupted(tmp_path, every):
    kw = {"swa_lrs": 0.02, "swa_epoch_start": 1, "annealing_epochs": 2}
    straight_cb = StochasticWeightAveraging(**kw)
    straight = fit(tmp_path / "straight", straight_cb, n_epochs=4)

    # ModelCheckpoint listed first: its epoch-end save comes before this epoch's SWA update
    if every == "epoch":
        ckpt = ModelCheckpoint(every_n_epochs=1, save_top_k=-1, save_last=False)
    else:
        ckpt = ModelCheckpoint(every_n_train_steps=10, save_top_k=-1, save_last=False)  # mid epoch 2
    fit(tmp_path / "run", StochasticWeightAveraging(**kw), n_epochs=4, callbacks=[ckpt], enable_checkpointing=True)
    files = sorted((tmp_path / "run").rglob("*.ckpt"), key=lambda p: p.stat().st_mtime)
    path = files[1] if every == "epoch" else files[0]  # after epoch 1 / after step 10
    saved = torch.load(path, weights_only=True)
    state = saved["callbacks"]["StochasticWeightAveraging"]
    assert state["last_update_epoch"] == 1 and not state["finalized"]

    resumed_cb = StochasticWeightAveraging(**kw)
    resumed = SWATrainer(quiet_config(tmp_path / "resumed", n_epochs=4, callbacks=[resumed_cb]))
    resumed.fit(ckpt_path=path)
    assert resumed_cb.n_averaged == straight_cb.n_averaged == 3
    n_before = len(straight.lrs_seen) - len(resumed.lrs_seen)
    assert resumed.lrs_seen == straight.lrs_seen[n_before:]
    for k, v in straight.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[k], v), k


def test_arguments_are_checked_at_construction():
    with pytest.raises(ConfigError, match=r"swa_lrs=-1"):
        StochasticWeightAveraging(swa_lrs=-1)
    with pytest.raises(ConfigError, match=r"swa_lrs=\[\]"):
        StochasticWeightAveraging(swa_lrs=[])
    with pytest.raises(ConfigError, match=r"swa_epoch_start=1.5.*int >= 0.*\(0, 1\]"):
        StochasticWeightAveraging(swa_lrs=0.1, swa_epoch_start=1.5)
    with pytest.raises(ConfigError, match=r"swa_epoch_start=-1"):
        StochasticWeightAveraging(swa_lrs=0.1, swa_epoch_start=-1)
    with pytest.raises(ConfigError, match=r"annealing_epochs=-2"):
        StochasticWeightAveraging(swa_lrs=0.1, annealing_epochs=-2)
    with pytest.raises(ConfigError, match=r"annealing_strategy='exp'.*\['cos', 'linear'\]"):
        StochasticWeightAveraging(swa_lrs=0.1, annealing_strategy="exp")
    with pytest.raises(ConfigError, match=r"models=\[\]"):
        StochasticWeightAveraging(swa_lrs=0.1, models=[])
    with pytest.raises(ConfigError, match=r"device='gpu7'.*None.*'cpu'"):
        StochasticWeightAveraging(swa_lrs=0.1, device="gpu7")
    assert StochasticWeightAveraging(swa_lrs=0.1).device == torch.device("cpu")  # Lightning's default
    assert StochasticWeightAveraging(swa_lrs=0.1, device=None).device is None


def test_bad_model_name_and_lr_count_fail_with_the_names(tmp_path):
    with pytest.raises(MisconfigurationError, match=r"no model named \['nope'\]"):
        fit(tmp_path / "a", StochasticWeightAveraging(swa_lrs=0.1, models="nope"), n_epochs=1)
    with pytest.raises(MisconfigurationError, match=r"gives 2 learning rates.*1 parameter groups"):
        fit(tmp_path / "b", StochasticWeightAveraging(swa_lrs=[0.1, 0.2], swa_epoch_start=0), n_epochs=1)


def test_a_callback_reused_by_a_second_trainer_averages_that_run_only(tmp_path):
    cb = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1, annealing_epochs=0, device=None)
    fit(tmp_path / "a", cb, n_epochs=3, bn=False)
    assert cb.n_averaged == 2
    trainer = fit(tmp_path / "b", cb, n_epochs=3, bn=False)
    assert cb.n_averaged == 2 and cb.names == ["model"]  # not 4: the second run's own average
    expected, _ = reference(3, 1, 0.05, 0, "cos", bn=False)
    for k, v in expected.items():
        torch.testing.assert_close(trainer.model.state_dict()[k], v, rtol=0, atol=1e-6)
    with pytest.raises(KeyError, match=r"average_model\('nope'\).*averaged: \['model'\]"):
        cb.average_model("nope")
