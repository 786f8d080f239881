"""BackboneFinetuning / BaseFinetuning: frozen until the epoch (no optimizer state), the param groups and
learning rates per epoch, and resume across the unfreeze epoch equal to an uninterrupted run."""

from __future__ import annotations

import pytest
import torch
from conftest import TinyTrainer, quiet_config
from torch import nn

from dream_trainer import ConfigError, MisconfigurationError, ModelCheckpoint
from dream_trainer.callbacks import BackboneFinetuning, BaseFinetuning


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.backbone(x))


class FTTrainer(TinyTrainer):
    """SGD with momentum (so a parameter that steps gets optimizer state) over every parameter; records,
    at each epoch start (its hook fires after the callbacks'), the groups' learning rates, the backbone's
    weights and whether the backbone has optimizer state."""

    def __init__(self, config, **kwargs):
        super().__init__(config, lr=0.02, **kwargs)
        torch.manual_seed(0)
        self.model = Net()
        self.epochs: dict[int, dict] = {}

    def configure_optimizers(self):
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=self.lr, momentum=0.5)

    def on_train_epoch_start(self):
        backbone = list(self.model.backbone.parameters())
        self.epochs[self.current_epoch] = {
            "lrs": [g["lr"] for g in self.optimizer.param_groups],
            "sizes": [len(g["params"]) for g in self.optimizer.param_groups],
            "backbone": [p.detach().clone() for p in backbone],
            "backbone_state": any(p in self.optimizer.state for p in backbone),
            "requires_grad": [p.requires_grad for p in backbone],
        }


def fit(tmp_path, cb, n_epochs=5, callbacks=(), ckpt_path=None, **cfg):
    trainer = FTTrainer(quiet_config(tmp_path, n_epochs=n_epochs, callbacks=[*callbacks, cb], **cfg))
    trainer.fit(ckpt_path=ckpt_path)
    return trainer


def make_cb():
    return BackboneFinetuning(unfreeze_backbone_at_epoch=2, lambda_func=lambda epoch: 4.0)


EXPECTED_LRS = {0: [0.02], 1: [0.02], 2: [0.02, 0.002], 3: [0.02, 0.008], 4: [0.02, 0.02]}  # 0.032 aligned to 0.02


def test_backbone_frozen_until_the_epoch_then_its_own_group_and_lr_sequence(tmp_path):
    torch.manual_seed(0)
    initial = [p.detach().clone() for p in Net().backbone.parameters()]
    trainer = fit(tmp_path, make_cb())
    ep = trainer.epochs
    assert {e: pytest.approx(v["lrs"]) for e, v in ep.items()} == EXPECTED_LRS
    assert [ep[e]["sizes"] for e in range(5)] == [[2], [2], [2, 4], [2, 4], [2, 4]]  # head: 2, backbone: 4
    for e in (0, 1, 2):  # untouched by two epochs of training; no optimizer state, not trainable before 2
        assert all(torch.equal(a, b) for a, b in zip(ep[e]["backbone"], initial, strict=True))
        assert not ep[e]["backbone_state"]
    assert ep[1]["requires_grad"] == [False] * 4 and ep[2]["requires_grad"] == [True] * 4
    assert ep[3]["backbone_state"]
    assert not torch.equal(ep[3]["backbone"][0], initial[0])  # trained in epoch 2


def test_default_lambda_and_ratio_follow_lightning(tmp_path):
    cb = BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.2, should_align=False)
    trainer = fit(tmp_path, cb, n_epochs=4)
    expected = [[0.02], [0.02, 0.004], [0.02, 0.006], [0.02, 0.009]]  # x1.5 per epoch
    assert [trainer.epochs[e]["lrs"] for e in range(4)] == [pytest.approx(v) for v in expected]


@pytest.mark.parametrize("resume_at", ["epoch1", "epoch2", "mid_epoch3"])
def test_resume_across_the_unfreeze_epoch_equals_uninterrupted(tmp_path, resume_at):
    straight = fit(tmp_path / "straight", make_cb())
    ckpt = ModelCheckpoint(every_n_train_steps=1, save_top_k=-1, save_last=False, filename="{step}")
    fit(tmp_path / "run", make_cb(), callbacks=[ckpt], enable_checkpointing=True)
    step = {"epoch1": 8, "epoch2": 12, "mid_epoch3": 14}[resume_at]  # 4 steps per epoch
    (path,) = [p for p in (tmp_path / "run").rglob("*.ckpt") if p.stem == f"step={step}"]
    saved = torch.load(path, weights_only=True)["callbacks"]["BackboneFinetuning"]
    n_groups = 1 if resume_at == "epoch1" else 2
    assert len(saved["optimizers"]["optimizer"]) == n_groups
    resumed = fit(tmp_path / "resumed", make_cb(), ckpt_path=path)
    for e, v in resumed.epochs.items():
        assert v["lrs"] == pytest.approx(EXPECTED_LRS[e]) and v["sizes"] == straight.epochs[e]["sizes"]
    for k, v in straight.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[k], v), k
    for a, b in zip(straight.optimizer.param_groups, resumed.optimizer.param_groups, strict=True):
        assert a["lr"] == b["lr"] and [p.shape for p in a["params"]] == [p.shape for p in b["params"]]


def test_freeze_helpers_and_batchnorm():
    m = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    BaseFinetuning.freeze(m, train_bn=True)
    assert not m[0].weight.requires_grad and m[1].weight.requires_grad and m[1].track_running_stats
    BaseFinetuning.freeze(m, train_bn=False)
    assert not m[1].weight.requires_grad and not m[1].track_running_stats
    opt = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=1.0)
    BaseFinetuning.unfreeze_and_add_param_group(m, opt, initial_denom_lr=4.0)
    assert len(opt.param_groups) == 2 and opt.param_groups[1]["lr"] == 0.25 and len(opt.param_groups[1]["params"]) == 4
    assert m[1].track_running_stats
    with pytest.warns(UserWarning, match="already in the optimizer"):
        BaseFinetuning.unfreeze_and_add_param_group(m, opt, lr=0.5)
    assert len(opt.param_groups) == 2


def test_arguments_and_missing_backbone_fail_with_the_names(tmp_path):
    with pytest.raises(ConfigError, match=r"unfreeze_backbone_at_epoch=-1"):
        BackboneFinetuning(unfreeze_backbone_at_epoch=-1)
    with pytest.raises(ConfigError, match=r"lambda_func=3"):
        BackboneFinetuning(lambda_func=3)
    with pytest.raises(ConfigError, match=r"backbone_initial_ratio_lr=0"):
        BackboneFinetuning(backbone_initial_ratio_lr=0)
    with pytest.raises(ConfigError, match=r"backbone_attr=''"):
        BackboneFinetuning(backbone_attr="")
    with pytest.raises(MisconfigurationError, match=r"backbone_attr='encoder'.*\['backbone', 'head'\]"):
        fit(tmp_path / "a", BackboneFinetuning(backbone_attr="encoder"), n_epochs=1)
    with pytest.raises(MisconfigurationError, match=r"model='net'.*\['model'\]"):
        fit(tmp_path / "b", BackboneFinetuning(model="net"), n_epochs=1)


class _DDPTrainer:
    """The part of the trainer the callback reads, holding a DDP-wrapped model (a 1-process gloo group)."""

    def __init__(self, model):
        self.model = model
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def named_models(self):
        return [("model", self.model)]

    def named_optimizers(self):
        return [("optimizer", self.optimizer)]

    def optimizer_name(self, optimizer):
        return "optimizer"


@pytest.mark.parametrize("find_unused", [False, True])
def test_ddp_without_find_unused_parameters_is_refused(tmp_path, find_unused):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if dist.is_initialized():  # pragma: no cover - another test left a group
        pytest.skip("a process group exists already")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        trainer = _DDPTrainer(DistributedDataParallel(Net(), find_unused_parameters=find_unused))
        cb = make_cb()
        if not find_unused:
            with pytest.raises(MisconfigurationError, match=r"trainer.model .*find_unused_parameters=True"):
                cb.on_fit_start(trainer)  # type: ignore[arg-type]
        else:
            cb.on_fit_start(trainer)  # type: ignore[arg-type]
            assert [len(g["params"]) for g in trainer.optimizer.param_groups] == [2]  # the head only
    finally:
        dist.destroy_process_group()
