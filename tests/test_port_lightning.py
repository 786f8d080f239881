"""Proof on code nobody here wrote: Lightning's own demo LightningModule (`LightningTransformer`),
trained by Lightning's Trainer and ported to a DreamTrainer (benchmarks/port_lightning.py), ends with
bit-identical weights (fp32, one thread, same seed and data)."""

from __future__ import annotations

import sys

import pytest
from helpers import REPO

pytest.importorskip("lightning", reason="the port is compared with Lightning itself: pip install lightning")
sys.path.insert(0, str(REPO / "benchmarks"))

import port_lightning

pytestmark = pytest.mark.slow  # imports Lightning (~2 s)


def test_lightning_transformer_port_trains_to_the_same_weights(tmp_path):
    equal, _, _ = port_lightning.compare(steps=12, root=str(tmp_path))
    assert equal
