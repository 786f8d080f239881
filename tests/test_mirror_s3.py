"""Runs mirrored to a real S3-compatible server (moto in server mode on 127.0.0.1) through a fault-injecting proxy
(tests/s3_faults.py): a kill campaign as docs/object-store.md promises it.

One run (tests/mirror_worker.py, 96 steps, a checkpoint every 4, the 2 newest kept) is killed with SIGKILL 12
times at random moments, at least 4 of them while a checkpoint's bytes are on the wire (uploads slowed by the
proxy), and stopped once by SIGTERM; 503 bursts and connection resets are injected along the way. Every start
after the first is on a fresh, empty `root_dir` (another machine) with `fit(ckpt_path="last")`. Each start
continues from the newest checkpoint committed in the store when the previous process died (never from an
uncommitted one: no start skips a damaged one either), the checkpoint a signal wrote is committed before its
process exits, and so is the final one. At the end the weights and AdamW state equal an uninterrupted run's bit
for bit, the run's metrics.csv in the store equals that run's, run.json in the store counts the retries, and the
files of another run sharing the prefix are untouched."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import REPO, launcher_free_env, start_python_forked

pytestmark = pytest.mark.slow
pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from s3_faults import S3Server  # noqa: E402

WORKER = REPO / "tests" / "mirror_worker.py"
BUCKET, PREFIX = "runs", "team"
URL = f"s3://{BUCKET}/{PREFIX}"
STEPS = 96  # 4 epochs of 24 steps
PART_IN_FLIGHT = re.compile(r"^PUT /runs/team/campaign[^/]*/checkpoints/[^?]*\.ckpt(\?|$)")


def _committed(s3: S3Server) -> dict[str, dict[str, Any]]:
    """The campaign's committed checkpoints: marker key -> the marker. A start killed after its run's first files
    reached the store and before its first commit leaves a run with nothing to continue: the next start, finding
    no checkpoint in it, starts a new run, `campaign-v1` (as on one machine), so the campaign is a family."""
    return {k: json.loads(v) for k, v in s3.objects(BUCKET, f"{PREFIX}/campaign").items() if k.endswith(".commit")}


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _newest(s3: S3Server) -> tuple[str, int]:
    """(run, global step) "last" continues: the run whose newest committed checkpoint is the newest (the time in
    its marker), its highest step; ("", 0) when nothing is committed."""
    markers = _committed(s3)
    if not markers:
        return "", 0
    runs: dict[str, float] = {}
    for key, marker in markers.items():
        run = key.split("/")[1]
        runs[run] = max(runs.get(run, 0.0), marker["mtime"])
    run = max(runs, key=lambda r: runs[r])
    steps = [int(m.group(1)) for k in markers if k.split("/")[1] == run and (m := re.search(r"step=(\d+)", k))]
    return run, max(steps)


def _settled(s3: S3Server) -> None:
    """No request of a process that died is still on its way to the store."""
    deadline = time.monotonic() + 30
    while s3.in_flight():
        assert time.monotonic() < deadline, s3.describe()
        time.sleep(0.02)


def _start(tmp_path: Path, i: int, env: dict[str, str], run_name: str = "campaign", epochs: int = 4) -> Any:
    root = tmp_path / f"machine{i}"  # a fresh, empty directory: another machine
    args = ["--root", str(root), "--url", URL, "--run-name", run_name, "--out", str(tmp_path / f"final{i}.pt"),
            "--epochs", str(epochs), "--pace", "0.04"]  # fmt: skip
    return start_python_forked(str(WORKER), *args, out=tmp_path / f"out{i}.log", err=tmp_path / f"err{i}.log", env=env)


def _check_resumed_from(tmp_path: Path, i: int, newest: tuple[str, int], may_not_start: bool = False) -> None:
    """Start `i` continued run `newest[0]` from global step `newest[1]` (0: started afresh); `may_not_start`: a kill
    at a random moment may come before the start chose its run (then it said nothing of it)."""
    run, step = newest
    err = _text(tmp_path / f"err{i}.log")
    assert "skipping" not in err and "ignoring" not in err, err
    if may_not_start and "run directory" not in err and "continuing run" not in err:
        return
    if step == 0:
        assert "continuing run" not in err, err
    else:
        expected = f"/{run} from "
        assert "continuing run" in err and expected in err and f"(global step {step})" in err, (
            f"expected run {run}, step {step}:\n{err[-3000:]}"
        )


def test_kill_campaign_against_a_real_s3_server(tmp_path: Path) -> None:
    seed = int(os.environ.get("MIRROR_TEST_SEED", random.randrange(1_000_000)))
    rng = random.Random(seed)
    # "early": at a random moment of the start (the store read, setup); "kill": a random moment of its training;
    # "upload": while a checkpoint's bytes are on the wire. Each start trains a few steps at most, so the run is
    # still training at the last kill.
    plan = ["upload"] * 4 + ["kill"] * 6 + ["early"] * 2
    rng.shuffle(plan)
    plan.insert(rng.randrange(2, len(plan)), "sigterm")
    print(f"MIRROR_TEST_SEED={seed}: {plan}")
    with S3Server(tmp_path) as s3:
        s3.create_bucket(BUCKET)
        env = {**launcher_free_env(), **s3.env(), "OMP_NUM_THREADS": "1"}
        # Another run under the same prefix, first: nothing of the campaign may touch its files.
        other = _start(tmp_path, 100, env, run_name="other", epochs=1)
        other.join(120)
        assert other.exitcode == 0, (tmp_path / "err100.log").read_text()
        others = s3.objects(BUCKET, f"{PREFIX}/other/")
        assert any(k.endswith(".commit") for k in others)

        before: tuple[str, int] = ("", 0)
        killed_uploads = []
        for i, kind in enumerate(plan):
            proc = _start(tmp_path, i, env)
            if rng.random() < 0.5:
                s3.fail_next(rng.randint(1, 3), 503)
            if rng.random() < 0.3:
                s3.reset_next(1)
            if kind == "upload":
                s3.slow_uploads(0.3, match=".ckpt")
                deadline = time.monotonic() + 60
                while not (parts := [r for r in s3.in_flight() if PART_IN_FLIGHT.match(r)]):
                    assert proc.exitcode is None and time.monotonic() < deadline, s3.describe()
                    time.sleep(0.005)
                proc.kill()
                killed_uploads.append(parts[0].split()[1].split("?")[0])
            elif kind == "early":
                proc.join(rng.uniform(0.05, 1.2))
                proc.kill()
            elif kind == "kill":
                deadline = time.monotonic() + 60
                while "dream_trainer: " not in _text(tmp_path / f"err{i}.log"):
                    assert proc.exitcode is None and time.monotonic() < deadline
                    time.sleep(0.01)
                proc.join(rng.uniform(0.0, 0.6))
                proc.kill()
            else:  # SIGTERM once it committed a checkpoint: its signal's checkpoint is committed before it exits
                deadline = time.monotonic() + 60
                earlier = set(_committed(s3))
                while not set(_committed(s3)) - earlier:
                    assert proc.exitcode is None and time.monotonic() < deadline, s3.describe()
                    time.sleep(0.02)
                os.kill(proc.pid, signal.SIGTERM)
            proc.join(60)
            s3.clear_faults()
            _settled(s3)
            _check_resumed_from(tmp_path, i, before, may_not_start=kind == "early")
            if kind == "sigterm":
                assert proc.exitcode == 128 + signal.SIGTERM, (tmp_path / f"err{i}.log").read_text()
                assert "/signal-" in max(_committed(s3).items(), key=lambda km: km[1]["mtime"])[0], _committed(s3)
            else:
                assert proc.exitcode in (-signal.SIGKILL, 0), (tmp_path / f"err{i}.log").read_text()
            before = _newest(s3)
            print(f"start {i} ({kind}): exit {proc.exitcode}, newest committed {before}")

        # The last start: faults, no kill; it continues from the newest committed step and ends with all 96.
        last = len(plan)
        s3.fail_next(2, 503)
        s3.reset_next(1)
        proc = _start(tmp_path, last, env)
        proc.join(180)
        assert proc.exitcode == 0, (tmp_path / f"err{last}.log").read_text()
        _check_resumed_from(tmp_path, last, before)
        final_run, final_step = _newest(s3)
        assert final_step == STEPS  # the final checkpoint is in the store when the process has exited

        # At least 4 kills cut an upload of a checkpoint's bytes, and none of those became a committed checkpoint
        # by the bytes it was sending (a later save of the same name may have).
        assert len(killed_uploads) >= 4
        counts = s3.counts
        print(f"killed uploads: {killed_uploads}; proxy: {counts}")
        assert counts["abandoned"] >= 1 and counts["failed"] >= 2 and counts["reset"] >= 1
        assert s3.objects(BUCKET, f"{PREFIX}/other/") == others  # the other run's files, byte for byte
        stored = s3.objects(BUCKET, f"{PREFIX}/{final_run}/")

    from mirror_worker import Mirrored, config, final_state

    reference = Mirrored(config(str(tmp_path / "reference"), None, "campaign", epochs=4))
    reference.fit()
    expected, got = final_state(reference), torch.load(tmp_path / f"final{last}.pt", weights_only=True)
    assert got["global_step"] == expected["global_step"] == STEPS
    for a, b in zip(_tensors(got), _tensors(expected), strict=True):
        assert torch.equal(a, b)
    # The run's history and record in the store: every step's row once, as the uninterrupted run wrote them;
    # run.json counts the last start's retries and says how the run ended.
    assert stored[f"{PREFIX}/{final_run}/metrics.csv"] == (reference.run_dir / "metrics.csv").read_bytes()
    record = json.loads(stored[f"{PREFIX}/{final_run}/run.json"])
    assert record["status"] == "success" and record["global_step"] == STEPS
    # (The 2 x 503 reach the mirror's retry loop, the client's own retries being off; the reset of a pooled
    # connection the HTTP client may retry by itself.)
    assert record["mirror"]["retries"] >= 2 and record["mirror"]["failures"] == 0, record["mirror"]
    assert "testing" not in json.dumps(record)  # the credentials are never written


def _tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for k in sorted(state, key=str) for t in _tensors(state[k])]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _tensors(v)]
    return []


def test_the_docs_example_continues_on_another_machine_as_the_page_shows(tmp_path: Path) -> None:
    """docs/object-store.md's train.py, as written: stopped by SIGTERM in one empty directory once it committed a
    checkpoint (the signal's checkpoint is committed before it exits), then continued in another from the store,
    saying the lines the page shows."""
    page = (REPO / "docs" / "object-store.md").read_text()
    script = re.search(r"`train.py`:\n\n<!--[^>]*-->\n```python\n(.*?)```", page, re.S)
    assert script is not None
    with S3Server(tmp_path) as s3:
        s3.create_bucket("my-bucket")
        env = {**launcher_free_env(), **s3.env(), "OMP_NUM_THREADS": "1"}
        outputs = []
        for machine in ("first", "second"):
            cwd = tmp_path / machine
            cwd.mkdir()
            (cwd / "train.py").write_text(script.group(1))
            err = cwd / "err.log"
            proc = start_python_forked("train.py", out=cwd / "out.log", err=err, env=env, cwd=cwd)
            if machine == "first":
                deadline = time.monotonic() + 120
                client = s3.client()
                while not client.list_objects_v2(Bucket="my-bucket", Prefix="runs/version_0/checkpoints/").get(
                    "KeyCount"
                ):
                    assert proc.exitcode is None and time.monotonic() < deadline, _text(err)
                    time.sleep(0.02)
                os.kill(proc.pid, signal.SIGTERM)
            proc.join(180)
            outputs.append(_text(err))
            assert proc.exitcode == (128 + signal.SIGTERM if machine == "first" else 0), outputs[-1]
    stopped = re.search(
        r"stopped by SIGTERM at global step (\d+); checkpoint runs/version_0/checkpoints/(\S+);", outputs[0]
    )
    assert stopped is not None, outputs[0]
    step, name = stopped.groups()
    assert (
        f"dream_trainer: downloaded version_0/checkpoints/{name} from s3://my-bucket/runs: its newest committed "
        "checkpoint" in outputs[1]
    ), outputs[1]
    assert f"dream_trainer: continuing run runs/version_0 from {name} (global step {step})" in outputs[1], outputs[1]
