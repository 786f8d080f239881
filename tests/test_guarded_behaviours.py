"""Behaviours no other test guarded (issue 42): each test here fails when its behaviour breaks.

- the hang verdict prefers, among the ranks furthest behind, the ones not waiting in a collective;
- the spike statistic covers exactly `spike_window` losses;
- `spike_policy="rollback"` reads the detector before a queued save, so no checkpoint holds spiked weights;
- `trainer.restore()` puts back every submodule's train/eval mode;
- SIGUSR1 is left alone outside a Slurm job;
- `non_finite_grads="skip"` drops a step whose gradient norm is infinite (not only NaN);
- `spike_policy="skip"` with accumulation lists every batch of the dropped window;
- under fp16 a spike-skipped batch leaves the loss scaler as a run without that batch would;
- `hang_timeout` above `process_group_timeout` is refused when the config is built.

DDP's `no_sync` on an epoch's short last accumulation window is checked in tests/test_distributed.py's
`main` launch (`accum-short`). The runs: an MLP, SGD with momentum, 12 batches of 4 samples in a fixed
order; batch 5 is bad (inputs x1e4). The reference is the run whose loader never yields the dropped batches.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyTrainer, quiet_config
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import Callback, DreamTrainer, DreamTrainerConfig, TrainingInterrupted
from dream_trainer.callbacks import ModelCheckpoint
from dream_trainer.errors import ConfigError
from dream_trainer.utils.spikes import SpikeDetector
from dream_trainer.utils.watchdog import judge

BAD = 5


def _data(bad: bool, without: tuple[int, ...] = ()) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.5
    if bad:
        x[BAD * 4 : BAD * 4 + 4] *= 1e4
    keep = [i for i in range(48) if i // 4 not in without]
    return TensorDataset(x[keep], y[keep])


class MLP(DreamTrainer):
    """12 batches of 4 (`bad`: batch 5's inputs x1e4; `without`: the batches the loader never yields)."""

    def __init__(self, config: DreamTrainerConfig, bad: bool = False, without: tuple[int, ...] = ()) -> None:
        super().__init__(config)
        self.bad, self.without = bad, without
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)

    def configure_dataloaders(self) -> tuple[Any, Any]:
        return DataLoader(_data(self.bad, self.without), batch_size=4), None

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return F.mse_loss(self.model(x), y)


def _config(tmp_path: Path, **kw: Any) -> DreamTrainerConfig:
    return quiet_config(tmp_path, **{"n_epochs": 1, **kw})


def _weights(trainer: DreamTrainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.model.parameters()]


def _assert_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    diff = [float((x - y).abs().max()) for x, y in zip(a, b, strict=True)]
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), f"max abs difference per tensor: {diff}"


# --- 1. the hang verdict --------------------------------------------------------------------------------
def _report(position: tuple[int, int], waiting: bool) -> dict[str, Any]:
    return {"position": list(position), "waiting": waiting, "where": "training_step", "step": 3, "idle": 9.0}


def test_the_hang_verdict_names_the_rank_not_waiting_in_a_collective_among_those_equally_behind() -> None:
    # Ranks 0 and 1 equally far (batch 4, 2 marks into it); rank 0 waits in a collective for rank 1, which
    # is stuck in the user's code: rank 1 is the stuck one, whichever rank number it has.
    reports = {0: _report((4, 2), waiting=True), 1: _report((4, 2), waiting=False), 2: _report((5, 0), False)}
    assert judge(reports, []) == [1]
    reports = {0: _report((4, 2), waiting=False), 1: _report((4, 2), waiting=True), 2: _report((5, 0), False)}
    assert judge(reports, []) == [0]
    # Equally far and all waiting, or none: all of them; a rank further on is never named.
    for waiting in (True, False):
        reports = {0: _report((4, 2), waiting), 1: _report((4, 2), waiting), 2: _report((5, 0), False)}
        assert judge(reports, []) == [0, 1]


# --- 2. the spike statistic's window -------------------------------------------------------------------
def test_the_spike_statistic_covers_exactly_spike_window_losses() -> None:
    # window 3: when the last loss is judged, the statistic holds the three 1.0s (mean 1, std floored at 1%
    # of it), so 2.0 is a spike. One loss more (window + 1) brings the 100.0 back in: mean 25.75, std ~43,
    # and 2.0 is no spike.
    detector = SpikeDetector(threshold=6.0, window=3, warmup=3)
    for i, value in enumerate([100.0, 1.0, 1.0, 1.0, 2.0]):
        detector.check(torch.tensor(value), (0, i, i))
    assert detector.read() == (0, 4, 4)
    assert len(detector.state_dict()["losses"]) == 3
    # and the statistic then holds the last 3 (the spike replaced by the mean so far)
    assert detector.state_dict()["losses"] == [1.0, 1.0, 1.0]


# --- 3. the rollback before a queued save ---------------------------------------------------------------
class SavedWeights(Callback):
    """The model's weights in every checkpoint the trainer builds, by global step, in order."""

    def __init__(self) -> None:
        self.saved: list[tuple[int, list[torch.Tensor]]] = []

    def on_save_checkpoint(self, trainer: Any, checkpoint: dict[str, Any]) -> None:
        self.saved.append((trainer.global_step, _weights(trainer)))


def _saving_run(tmp_path: Path, bad: bool, without: tuple[int, ...], **kw: Any) -> SavedWeights:
    saved = SavedWeights()
    every_3 = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    trainer = MLP(_config(tmp_path, callbacks=[every_3, saved], non_finite_loss="ignore", **kw), bad, without)
    trainer.fit()
    return saved


def test_rollback_reads_the_detector_before_a_queued_save(tmp_path: Path) -> None:
    # Snapshots only at the epoch's start and before saves (spike_snapshot_every > the epoch): the save
    # queued at step 6 (batch 5's, the spike) must first roll back, so every checkpoint written holds the
    # weights of the run whose loader never yielded batch 5, at the same step (and the final one at step 11).
    clean = _saving_run(tmp_path / "clean", bad=False, without=(BAD,))
    with pytest.warns(UserWarning, match="loss spike at epoch 0, batch 5"):
        rolled = _saving_run(tmp_path / "rolled", bad=True, without=(), spike_policy="rollback",
                             spike_snapshot_every=100)  # fmt: skip
    clean_at = dict(clean.saved)
    assert sorted(clean_at) == [3, 6, 9, 11]
    for step, got in rolled.saved:
        want = clean_at[step]
        same = all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        assert same, f"the checkpoint saved at step {step} holds weights batch {BAD} reached"
    assert [step for step, _ in rolled.saved] == [3, 6, 9, 11]


# --- 4. restore() puts back the train/eval modes --------------------------------------------------------
def test_restore_puts_back_every_submodules_train_or_eval_mode(tmp_path: Path) -> None:
    trainer = MLP(_config(tmp_path))
    trainer.model.train()
    trainer.model[1].eval()  # one submodule in eval mode inside a model in train mode
    snap = trainer.snapshot()
    modes = [m.training for m in trainer.model.modules()]
    assert modes == [True, True, False, True]
    trainer.model.eval()
    trainer.restore(snap)
    assert [m.training for m in trainer.model.modules()] == modes
    trainer.model.train()  # the submodule back in train mode: restore() puts it in eval again
    trainer.restore(snap)
    assert [m.training for m in trainer.model.modules()] == modes


# --- 6. SIGUSR1 outside a Slurm job ----------------------------------------------------------------------
class SendsSigusr1(Callback):
    """At step 2 (inside fit): SIGUSR1's handler then, and SIGUSR1 sent to this process."""

    def __init__(self) -> None:
        self.handler_in_fit: Any = None

    def on_train_batch_end(self, trainer: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == 2:
            self.handler_in_fit = signal.getsignal(signal.SIGUSR1)
            signal.raise_signal(signal.SIGUSR1)


def test_sigusr1_is_left_to_its_own_handler_outside_a_slurm_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOBID", raising=False)
    received: list[int] = []

    def users_handler(signum: int, frame: Any) -> None:
        received.append(signum)

    previous = signal.signal(signal.SIGUSR1, users_handler)
    try:
        sender = SendsSigusr1()
        trainer = TinyTrainer(quiet_config(tmp_path, n_epochs=2, callbacks=[sender]))  # requeue_signal: SIGUSR1
        try:
            trainer.fit()
        except TrainingInterrupted as stop:
            pytest.fail(f"SIGUSR1 outside a Slurm job stopped the run: {stop}")
        assert sender.handler_in_fit is users_handler
        assert received == [signal.SIGUSR1]
        assert trainer.global_step == 8
        assert signal.getsignal(signal.SIGUSR1) is users_handler
    finally:
        signal.signal(signal.SIGUSR1, previous)


# --- 7. non_finite_grads="skip" with an infinite gradient norm ------------------------------------------
class _InfGrad(torch.autograd.Function):
    """Identity forward; backward: an infinite gradient (+inf everywhere, no NaN)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return torch.full_like(grad, float("inf"))


class InfGradAtBad(MLP):
    """Batch 5's loss is finite, and its first layer's weight gets an infinite gradient."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        first, act, last = self.model
        weight = _InfGrad.apply(first.weight) if batch_idx == BAD else first.weight
        return F.mse_loss(last(act(F.linear(x, weight, first.bias))), y)


class GradNormAt(Callback):
    def __init__(self) -> None:
        self.norms: dict[int, float] = {}

    def on_train_batch_end(self, trainer: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.norms[batch_idx] = float(trainer.grad_norms["optimizer"])


def test_non_finite_skip_drops_a_step_whose_gradient_norm_is_infinite(tmp_path: Path) -> None:
    clean = MLP(_config(tmp_path / "clean"), without=(BAD,))
    clean.fit()
    norms = GradNormAt()
    trainer = InfGradAtBad(_config(tmp_path / "inf", non_finite_grads="skip", callbacks=[norms]))
    trainer.fit()
    assert norms.norms[BAD] == float("inf")  # infinite, not NaN
    assert trainer.non_finite_counts["skipped"] == 1
    assert [(e["batch_idx"], e["reason"]) for e in trainer.skipped_batches] == [(BAD, "non_finite")]
    _assert_equal(_weights(trainer), _weights(clean))


# --- 8. spike_policy="skip" with accumulation lists the whole window -------------------------------------
def test_a_spike_skip_with_accumulation_lists_every_batch_of_the_dropped_window(tmp_path: Path) -> None:
    # 2 micro-batches a step: batch 5 spikes, so the step of window (4, 5) is dropped, batch 4 with it.
    trainer = MLP(_config(tmp_path / "skip", spike_policy="skip", gradient_accumulation_steps=2), bad=True)
    with pytest.warns(UserWarning, match="loss spike at epoch 0, batch 5"):
        trainer.fit()
    entries = [(e["epoch"], e["batch_idx"], e["global_step"], e["reason"]) for e in trainer.skipped_batches]
    assert entries == [(0, 4, 2, "spike"), (0, 5, 2, "spike")]
    assert [e["sample_indices"] for e in trainer.skipped_batches] == [[16, 17, 18, 19], [20, 21, 22, 23]]
    assert [(s["batch_idx"], s["action"]) for s in trainer.spikes] == [(5, "skipped")]  # the spike itself
    record = json.loads((trainer.run_dir / "run.json").read_text())
    assert [(e["epoch"], e["batch_idx"]) for e in record["skipped_batches"]] == [(0, 4), (0, 5)]
    # The list means what it says: a run whose loader never yields the listed batches ends with the same
    # weights (the window's step was dropped whole).
    listed = MLP(_config(tmp_path / "listed", gradient_accumulation_steps=2, skip_batches=trainer.skipped_batches),
                 bad=True)  # fmt: skip
    listed.fit()
    _assert_equal(_weights(listed), _weights(trainer))


# --- 9. fp16: a spike-skipped batch leaves the loss scaler alone -----------------------------------------
def test_fp16_a_spike_skipped_batch_leaves_the_loss_scaler_as_a_run_without_it(tmp_path: Path) -> None:
    # fp16 autocast and torch.amp.GradScaler("cpu") run on the CPU (tests/test_amp.py).
    clean = MLP(_config(tmp_path / "clean", mixed_precision="fp16"), without=(BAD,))
    clean.fit()
    skipped = MLP(_config(tmp_path / "skip", mixed_precision="fp16", spike_policy="skip"), bad=True)
    with pytest.warns(UserWarning, match="loss spike at epoch 0, batch 5"):
        skipped.fit()
    assert clean.grad_scaler is not None and skipped.grad_scaler is not None
    # The bad batch's gradients overflow fp16: had the scaler seen them, it would have halved its scale.
    assert skipped.grad_scaler.get_scale() == clean.grad_scaler.get_scale()
    assert skipped.grad_scaler.state_dict() == clean.grad_scaler.state_dict()  # the growth tracker too
    _assert_equal(_weights(skipped), _weights(clean))


# --- 10. hang_timeout above process_group_timeout --------------------------------------------------------
def test_a_hang_timeout_above_the_process_group_timeout_is_refused_naming_both() -> None:
    with pytest.raises(ConfigError) as info:
        quiet_config(hang_timeout=900.0, process_group_timeout=300.0)
    line = str(info.value)
    assert "\n" not in line
    assert "hang_timeout = 900.0" in line and "process_group_timeout = 300.0" in line
    assert "Set hang_timeout at most 300 (None: not watched), or process_group_timeout at least 900" in line
    # The default hang_timeout (600 s) with a process group timeout below it: refused too.
    with pytest.raises(ConfigError, match=r"hang_timeout = 600\.0 is longer than process_group_timeout = 120\.0"):
        quiet_config(process_group_timeout=120.0)
    # Accepted: no watchdog (None), equal, below, and the defaults (600 s against 1800 s).
    assert quiet_config(hang_timeout=None, process_group_timeout=5.0).hang_timeout is None
    assert quiet_config(hang_timeout=300.0, process_group_timeout=300.0).hang_timeout == 300.0
    assert quiet_config(hang_timeout=2.0, process_group_timeout=60.0).hang_timeout == 2.0
    assert quiet_config().hang_timeout == 600.0


def test_a_first_step_hang_timeout_above_the_process_group_timeout_is_refused_and_the_default_is_capped(
    tmp_path,
) -> None:
    with pytest.raises(ConfigError) as info:
        quiet_config(hang_timeout=60.0, hang_timeout_first_step=900.0, process_group_timeout=300.0)
    line = str(info.value)
    assert "\n" not in line
    assert "hang_timeout_first_step = 900.0 is longer than process_group_timeout = 300.0" in line
    assert "Set hang_timeout_first_step at most 300 (None: 3 x hang_timeout, capped there)" in line

    # Unset, it is 3 x hang_timeout, capped at the process group's timeout (the default: 1800 s, exactly 3 x 600).
    def first_step(**kw) -> float | None:
        return TinyTrainer(quiet_config(tmp_path, **kw))._run_watch.timeouts()[1]

    assert first_step() == 1800.0
    assert first_step(hang_timeout=200.0, process_group_timeout=400.0) == 400.0
    assert first_step(hang_timeout=100.0, process_group_timeout=400.0) == 300.0
    assert first_step(hang_timeout=100.0, hang_timeout_first_step=350.0, process_group_timeout=400.0) == 350.0
