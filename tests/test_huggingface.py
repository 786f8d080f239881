"""A Hugging Face user's training script ports bit for bit (issue 47; docs/huggingface.md).

`huggingface_worker.py` holds the script as the `transformers` docs write it (a `GPT2LMHeadModel` built
from a config, AdamW, `get_linear_schedule_with_warmup` sized by hand, accumulation 4, clipping at 1.0,
dropout on, a shuffling loader) and its port (`GPT2Port`: the scheduler sized by
`estimated_stepping_batches`, `return self.model(**batch)` from both steps). The port ends with the
script's weights `torch.equal`, also with gradient checkpointing, and also when the run is SIGKILLed
inside an accumulation window and resumed from its last checkpoint. The `ModelOutput` each step returns
is used as a dict is: its loss trains and is logged (`loss`, `val_loss`), its other scalar fields are
logged, its logits and cache are not.

`transformers` is in the `dev` extra; where it is not installed the module is skipped, saying so.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[dev]' installs it)")

import huggingface_worker as hf
import torch
import torch.nn.functional as F
from conftest import TinyTrainer, quiet_config
from helpers import ckpt_dir, run_python_forked
from torch import nn
from transformers.utils import ModelOutput

from dream_trainer.loggers import MemoryLogger

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # bitwise comparisons: the same kernels

WORKER = Path(__file__).with_name("huggingface_worker.py")


def weights_equal(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture(scope="module")
def plain() -> tuple[nn.Module, list[float], float]:
    """The user's script, run once: its model, every micro-batch's loss, its final validation loss."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return hf.plain_loop()
    finally:
        torch.set_num_threads(threads)


def test_the_port_of_a_gpt2_script_ends_bit_identical(
    tmp_path: Path, plain: tuple[nn.Module, list[float], float]
) -> None:
    model, losses, val_loss = plain
    memory = MemoryLogger()
    trainer = hf.GPT2Port(hf.port_config(str(tmp_path), loggers=[memory]))
    trainer.fit()
    # The scheduler's length, counted by the trainer: 3 epochs of 8 batches in windows of 4.
    assert trainer.stepping_batches == trainer.global_step == hf.EPOCHS * hf.BATCHES_PER_EPOCH // hf.ACCUM == 6
    assert weights_equal(trainer.model, model)
    assert trainer.optimizer.param_groups[0]["lr"] == 0.0  # the linear decay ran to its end, as the script's
    # The ModelOutput: its loss logged as training's and (from validation_step) as val_loss; logits and the
    # cache are not metrics.
    assert memory.series("val_loss")[-1] == (6, pytest.approx(val_loss, rel=1e-6))
    last_epoch = losses[-hf.BATCHES_PER_EPOCH :]
    assert trainer.callback_metrics["loss"] == pytest.approx(sum(last_epoch) / len(last_epoch), rel=1e-6)
    assert {name for _, metrics in memory.history for name in metrics} == {"loss", "loss_epoch", "val_loss"}


@pytest.mark.slow  # a new process that imports transformers (~4 s of CPU) and is killed
def test_killed_inside_an_accumulation_window_then_resumed_ends_bit_identical(
    tmp_path: Path, plain: tuple[nn.Module, list[float], float]
) -> None:
    model, _, val_loss = plain
    root = str(tmp_path / "run")
    # Killed at the end of micro-batch 13 (epoch 1, batch 5: the second of its window); the last checkpoint
    # is step 3's, written after batch 11.
    killed = run_python_forked(WORKER, "--root-dir", root, "--kill-at-batch", "13", timeout=120)
    assert killed.returncode == -9, f"not SIGKILLed: {killed.returncode}\n{killed.stderr[-3000:]}"
    assert (ckpt_dir(tmp_path / "run") / "epoch=1-step=3.ckpt").exists()

    memory = MemoryLogger()
    resumed = hf.GPT2Port(hf.checkpointed_config(root, loggers=[memory]))
    resumed.fit(ckpt_path="last")
    assert resumed.trained[0] == (1, 4)  # it resumed in the middle of epoch 1, not from scratch
    assert resumed.stepping_batches == resumed.global_step == 6  # the whole run's length, not what was left
    assert weights_equal(resumed.model, model)
    assert memory.series("val_loss")[-1] == (6, pytest.approx(val_loss, rel=1e-6))


def test_with_gradient_checkpointing_the_port_ends_bit_identical(tmp_path: Path) -> None:
    model, _, _ = hf.plain_loop(gradient_checkpointing=True)
    trainer = hf.GPT2Port(hf.port_config(str(tmp_path), gradient_checkpointing=True))
    trainer.fit()
    assert hf.is_checkpointing(trainer.model)
    assert weights_equal(trainer.model, model)


# --- a ModelOutput, or any mapping with a loss, is taken as a dict is ----------------------------------
@dataclasses.dataclass
class RegressionOutput(ModelOutput):
    """A model's output with a second scalar, as MoE models return `aux_loss`."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    aux: torch.Tensor | None = None


def model_output(**fields: torch.Tensor) -> Any:
    return RegressionOutput(**fields)


def read_only_mapping(**fields: torch.Tensor) -> Any:
    return types.MappingProxyType(fields)


class Returns(TinyTrainer):
    """TinyTrainer whose steps return `self.wrap(loss=..., logits=..., aux=...)`."""

    wrap: Callable[..., Any] = staticmethod(dict)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        prediction = self.model(x)
        return self.wrap(loss=F.mse_loss(prediction, y), logits=prediction, aux=prediction.abs().mean())

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        return self.training_step(batch, batch_idx)


@pytest.mark.parametrize("wrap", [model_output, read_only_mapping])
def test_a_model_output_or_any_mapping_is_used_as_the_same_dict(tmp_path: Path, wrap: Callable[..., Any]) -> None:
    def run(wrapping: Callable[..., Any], where: Path) -> tuple[Returns, list[tuple[int, dict[str, float]]]]:
        memory = MemoryLogger()
        trainer = type("Trainer", (Returns,), {"wrap": staticmethod(wrapping)})(
            quiet_config(where, n_epochs=2, log_every_n_steps=2, loggers=[memory])
        )
        trainer.fit()
        return trainer, memory.history

    reference, reference_logged = run(dict, tmp_path / "dict")
    trainer, logged = run(wrap, tmp_path / "wrapped")
    assert weights_equal(trainer.model, reference.model)
    assert logged == reference_logged
    names = {name for _, metrics in logged for name in metrics}
    # training's loss and aux; validation's as val_loss and val_aux (training logs those names); no logits
    assert {"loss", "aux", "val_loss", "val_aux"} <= names and not any("logits" in n for n in names)
