"""Integration: a real `tensorboard` server serves what the default TensorBoardLogger wrote.

Trains a short run with `loggers=None` (the default TensorBoardLogger), starts
`python -m tensorboard.main --logdir <root>` on 127.0.0.1 with a port it picks itself, and reads
the scalars back over its HTTP API. The server is always terminated.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import helpers
import pytest
from conftest import TinyTrainer, quiet_config

STARTUP_TIMEOUT_S = 60.0
PORT_LINE = re.compile(r"http://127\.0\.0\.1:(\d+)/")


class LossRecorder(helpers.LossRecorder):
    """Also `(global_step, val_loss)` after every real (non-sanity) validation."""

    def __init__(self) -> None:
        super().__init__()
        self.val_losses: list[tuple[int, float]] = []

    def on_validation_end(self, trainer):
        if not trainer.sanity_checking:
            self.val_losses.append((trainer.global_step, trainer.callback_metrics["val_loss"]))


def _get_json(port: int, path: str, **params: str):
    url = f"http://127.0.0.1:{port}{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        return json.loads(response.read().decode())


def _wait_for_port(proc: subprocess.Popen, log_path, deadline: float) -> int:
    """TensorBoard prints `TensorBoard <version> at http://127.0.0.1:<port>/` once it listens."""
    while time.monotonic() < deadline:
        match = PORT_LINE.search(log_path.read_text(errors="replace"))
        if match:
            return int(match.group(1))
        if proc.poll() is not None:
            pytest.fail(f"tensorboard exited with {proc.returncode}:\n{log_path.read_text(errors='replace')}")
        time.sleep(0.1)
    pytest.fail(f"tensorboard did not report its port within {STARTUP_TIMEOUT_S} s:\n{log_path.read_text()}")


def _wait_for_tag(port: int, run: str, tag: str, deadline: float) -> dict:
    """Poll the tags endpoint until the server has loaded `tag` of `run` (loading is asynchronous)."""
    last: object = None
    while time.monotonic() < deadline:
        try:
            tags = _get_json(port, "/data/plugin/scalars/tags")
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            last = exc
        else:
            last = tags
            if tag in tags.get(run, {}):
                return tags
        time.sleep(0.2)
    pytest.fail(f"tensorboard did not serve {run}/{tag} within {STARTUP_TIMEOUT_S} s; last answer: {last!r}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def test_tensorboard_server_serves_the_logged_scalars(tmp_path):
    root = tmp_path / "root"
    rec = LossRecorder()
    trainer = TinyTrainer(quiet_config(root, n_epochs=2, log_every_n_steps=1, loggers=None, callbacks=[rec]))
    trainer.fit()
    assert trainer.log_dir == root / "version_0"
    assert len(rec.losses) == 8

    log_path = tmp_path / "tensorboard.log"
    cmd = [
        sys.executable,
        "-m",
        "tensorboard.main",
        "--logdir",
        str(root),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--load_fast=false",
    ]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=tmp_path)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        port = _wait_for_port(proc, log_path, deadline)
        tags = _wait_for_tag(port, "version_0", "val_loss", deadline)
        assert {"loss", "val_loss"} <= set(tags["version_0"])
        assert _get_json(port, "/data/runs") == ["version_0"]

        # Each point is [wall_time, step, value]. The server loads event files in the background, so
        # poll (bounded) until both series are complete before comparing them.
        while True:
            loss = _get_json(port, "/data/plugin/scalars/scalars", run="version_0", tag="loss")
            val_loss = _get_json(port, "/data/plugin/scalars/scalars", run="version_0", tag="val_loss")
            if (len(loss), len(val_loss)) == (8, 2) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert [step for _, step, _ in loss] == list(range(1, 9))
        assert [value for _, _, value in loss] == pytest.approx(rec.losses, rel=1e-5)

        assert [step for _, step, _ in val_loss] == [step for step, _ in rec.val_losses] == [4, 8]
        assert [value for _, _, value in val_loss] == pytest.approx([v for _, v in rec.val_losses], rel=1e-5)
    finally:
        _stop(proc)
    assert proc.returncode is not None
