"""Proof on a GAN in Lightning's manual-optimization style (generator stepped first, `toggle_optimizer`
around each loss, as Lightning's GAN example): trained by Lightning's Trainer and ported to a DreamTrainer
with `with self.toggle_optimizer(...)` or with `self.backward(loss, optimizer=...)`
(benchmarks/port_gan.py), both models end with bit-identical weights (fp32, one thread, same seed and
data). Without scoping, the port trains the discriminator differently: issue 15's failure."""

from __future__ import annotations

import sys

import pytest
from helpers import REPO

pytest.importorskip("lightning", reason="the port is compared with Lightning itself: pip install lightning")
sys.path.insert(0, str(REPO / "benchmarks"))

import port_gan

pytestmark = pytest.mark.slow  # imports Lightning (~2 s)


def test_gan_ports_toggle_and_optimizer_scoped_train_to_lightnings_weights(tmp_path):
    equal, _, _ = port_gan.compare(steps=12, root=str(tmp_path))
    assert equal


def test_an_unscoped_generator_first_port_moves_the_discriminator_differently(tmp_path):
    # `self.backward(g_loss)` without scoping also puts the generator loss's gradients on the
    # discriminator (the loss flows back through it); in Lightning, `toggle_optimizer(opt_g)` had frozen
    # the discriminator, so it gets none. Nothing clears them before the discriminator steps later in the
    # same batch (the trainer zeroes every optimizer at the start of a batch; Lightning's
    # `opt_g.zero_grad()` would only clear the generator's), so the discriminator steps with its own
    # loss's gradients plus the generator loss's. After one batch the generator is still identical (its
    # gradients do not depend on the scoping) and only the discriminator differs. Before scoping existed
    # (`toggle_optimizer`, `backward(optimizer=)`), this was the only way to write the port, and the
    # proof above could not have passed. The trainer says so at the first step.
    with port_gan.one_thread():
        theirs, _ = port_gan.run_lightning(steps=1)
        with pytest.warns(UserWarning, match="also put gradients on the parameters of d_optimizer"):
            leaked, _ = port_gan.run_ours(steps=1, root=str(tmp_path), scope="none")
    assert port_gan.same(theirs, leaked, "generator.")
    assert not port_gan.same(theirs, leaked, "discriminator.")
