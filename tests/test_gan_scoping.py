"""A generator-first GAN keeps each loss to its optimizer under DDP and FSDP2 (2 processes, gloo):
`toggle_optimizer` and `backward(optimizer=...)` train to the weights of one process with the combined
batch, and FSDP2 refuses `optimizer=` with the fix (toggle_optimizer) named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gan_scoping_worker import CASES, N_SAMPLES, build_gan
from helpers import torchrun_once

WORKER = Path(__file__).with_name("gan_scoping_worker.py")
pytestmark = pytest.mark.slow  # one torchrun launch of 2 processes, shared by the tests here

# DDP averages the ranks' gradients of their mean losses: the mean loss of the combined batch, summed
# in another order. Everything else (data, seeds, optimizer) is identical, so fp32 agrees to ~1e-8.
ATOL = 1e-6


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out_dir, log = torchrun_once(tmp_path_factory, "gan-scoping", WORKER, 2, timeout=300)
    errors = sorted(out_dir.glob("error.*"))
    assert not errors, errors[0].read_text()
    return out_dir, log


def one_process(tmp_path: Path, scope: str, accumulate: int) -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)
    trainer = build_gan(tmp_path / f"{scope}-{accumulate}", "auto", scope, accumulate, batch_size=N_SAMPLES // 4)
    trainer.fit()
    assert trainer.global_step == 8 // accumulate
    return {
        f"{p}.{k}": v.detach().clone()
        for p, m in (("g", trainer.generator), ("d", trainer.discriminator))
        for k, v in m.state_dict().items()
    }


def close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    assert a.keys() == b.keys()
    return all(torch.allclose(a[k], b[k], rtol=0, atol=ATOL) for k in a)


@pytest.mark.parametrize("case", [c for c in CASES if c != "fsdp-optimizer"])
def test_two_processes_train_like_one_with_the_loss_kept_to_its_optimizer(launched, tmp_path, case):
    out_dir, log = launched
    assert (out_dir / f"{case}.pt").exists(), log.read_text()
    _, scope, accumulate = CASES[case]
    got = torch.load(out_dir / f"{case}.pt", weights_only=True)
    assert close(got, one_process(tmp_path, scope, accumulate))
    # and the scoping mattered: the unscoped run moves the discriminator by the generator's loss (and
    # its first step says so)
    with pytest.warns(UserWarning, match="also put gradients on the parameters of d_optimizer"):
        leaked = one_process(tmp_path, "none", accumulate)
    assert not close(got, leaked)


def test_fsdp2_refuses_optimizer_scoped_backward_naming_toggle_optimizer(launched):
    out_dir, _ = launched
    error = (out_dir / "fsdp-optimizer.error").read_text()
    assert error.startswith("MisconfigurationError: self.backward(loss, optimizer=self.g_optimizer) cannot keep")
    assert "FSDP2 shards them" in error and "with self.toggle_optimizer(self.g_optimizer):" in error
