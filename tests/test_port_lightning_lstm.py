"""Proof on code nobody here wrote: Lightning's own demo LSTM language model (`LightningLSTM`, which
carries its hidden state from step to step and resets it at each epoch's end), trained by Lightning's
Trainer and ported to a DreamTrainer (benchmarks/port_lightning_lstm.py), ends with bit-identical
weights (fp32, one thread, same seed and data), across an epoch boundary."""

from __future__ import annotations

import sys

import pytest
from helpers import REPO

pytest.importorskip("lightning", reason="the port is compared with Lightning itself: pip install lightning")
sys.path.insert(0, str(REPO / "benchmarks"))

import port_lightning_lstm

pytestmark = pytest.mark.slow  # imports Lightning (~2 s), 2 x 6 steps of a 4-layer LSTM (~0.3 s each)


def test_lightning_lstm_port_trains_to_the_same_weights_across_an_epoch_end(tmp_path):
    steps = port_lightning_lstm.EPOCH_BATCHES + 1
    # The last step starts from the zero state again (`on_train_epoch_end` set `self.hidden = None`);
    # a port that missed the reset, or a trainer that did not call the hook, ends with other weights.
    equal, _, _ = port_lightning_lstm.compare(steps=steps, root=str(tmp_path))
    assert equal
