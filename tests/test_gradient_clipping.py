"""`GradientClipping` (`dream_trainer/gradient_clipping.py`): the clipping state is one object the trainer holds.

- `clip_gradients` checks its arguments and its clip is for one step of one optimizer: `take` and `clip_`
  remove it, a retried batch drops it, and a step with nothing to clip or measure does nothing.
- The trainer holds the object and none of the attributes that used to carry its state.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import TinyTrainer, quiet_config

from dream_trainer.gradient_clipping import GradientClipping
from dream_trainer.parallel.strategy import Strategy


def _clipping(trainer: Any, max_norm: float | None = None, measure: bool = False) -> GradientClipping:
    parallel: Strategy = trainer.parallel
    return GradientClipping(max_norm, "norm", measure, parallel, trainer.named_models)


def _with_grads(trainer: Any, value: float) -> None:
    for p in trainer.model.parameters():
        p.grad = torch.full_like(p, value)


def test_the_trainer_holds_one_clipping_object(tmp_path: Any) -> None:
    trainer = TinyTrainer(quiet_config(tmp_path, gradient_clip_val=0.5))
    assert isinstance(trainer._clipping, GradientClipping) and trainer._clipping.every_step
    old = {"_clip_val", "_clip_algorithm", "_clip_orders", "_pending_clip"}
    assert old.isdisjoint(vars(trainer)), sorted(old & set(vars(trainer)))
    assert not TinyTrainer(quiet_config(tmp_path / "plain"))._clipping.every_step  # no clip, no policy: no call


def test_clip_gradients_checks_its_arguments_and_holds_one_step(tmp_path: Any) -> None:
    trainer = TinyTrainer(quiet_config(tmp_path, n_epochs=1))
    trainer.fit()
    opt = trainer.optimizer
    with pytest.raises(ValueError, match="valid choices are 'norm', 'value'"):
        trainer.clip_gradients(opt, 1.0, algorithm="l2")
    with pytest.raises(ValueError, match="expected a positive number"):
        trainer.clip_gradients(opt, 0.0)
    clipping = trainer._clipping
    trainer.clip_gradients(opt, 2, algorithm="value")
    assert clipping.pending == {opt: (2.0, "value")}
    saved = clipping.snapshot()
    assert clipping.take(opt) == (2.0, "value") and not clipping.pending  # one step's
    assert clipping.take(opt) == (None, "norm")  # then the configured clip (none)
    clipping.restore(saved)
    assert clipping.pending == {opt: (2.0, "value")}
    clipping.drop_pending()
    assert not clipping.pending


def test_clip_takes_the_pending_clip_and_does_nothing_without_one(tmp_path: Any) -> None:
    trainer = TinyTrainer(quiet_config(tmp_path, n_epochs=1))
    trainer.fit()
    opt, other = trainer.optimizer, torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    clipping = _clipping(trainer)
    _with_grads(trainer, 3.0)
    clipping.request(other, 1.0)
    assert clipping.clip_(opt) is None  # another optimizer's clip, no norm wanted: nothing measured
    assert all(p.grad is not None and torch.equal(p.grad, torch.full_like(p, 3.0)) for p in trainer.model.parameters())
    clipping.request(opt, 1.0)
    norm = clipping.clip_(opt)
    assert norm is not None and float(norm) == pytest.approx(3 * 5**0.5)  # 4 weights and a bias, each 3
    clipped = torch.nn.utils.get_total_norm([p.grad for p in trainer.model.parameters() if p.grad is not None])
    assert float(clipped) == pytest.approx(1.0, rel=1e-5)
    assert clipping.pending == {other: (1.0, "norm")}  # only this optimizer's was taken
    assert _clipping(trainer, measure=True).clip_(opt) is not None  # a non-finite policy: measured


def test_param_order_is_the_models(tmp_path: Any) -> None:
    trainer = TinyTrainer(quiet_config(tmp_path, n_epochs=1))
    trainer.fit()
    clipping = trainer._clipping
    assert [id(p) for p in clipping.params(trainer.optimizer)] == [id(p) for p in trainer.model.parameters()]
