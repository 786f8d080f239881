"""`init_device="meta"` with `dp_shard=4`: a ~300 MB model is never materialized whole.

One `torchrun --nproc_per_node 4` run of `meta_memory_worker.py` (gloo, CPU; the first part of
`four_rank_worker.py`'s launch, shared with two other test files): 8 `nn.Linear(3072, 3072)`
(302 MB of fp32 parameters) built on the meta device and sharded by the trainer's setup. Each rank must
hold a quarter of the parameter bytes (within 1%), and its peak resident memory must grow by less than
half the model's size during setup (a rank that built the model whole, even for a moment, would grow by
the whole size). One SGD step follows; it must change the weights and keep the shards a quarter each.

Run with `pytest -s tests/test_meta_memory.py` to see each rank's figures.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from helpers import four_rank_launch

MIB = 2**20


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out_dir, log = four_rank_launch(tmp_path_factory, "meta_memory")
    errors = sorted(out_dir.glob("meta_memory.error.*"))
    assert not errors, errors[0].read_text()
    path = out_dir / "meta_memory.json"
    assert path.exists(), "the worker wrote no result:\n" + log.read_text()
    result: list[dict[str, Any]] = json.loads(path.read_text())
    for r in result:
        print(
            f"rank {r['rank']}: {r['local_param_bytes_setup'] / MIB:.1f} of {r['total_param_bytes'] / MIB:.1f} MiB "
            f"of parameters; peak RSS +{(r['rss_after_setup'] - r['rss_before']) / MIB:.1f} MiB in setup "
            f"({r['setup_s']:.1f} s), +{(r['rss_after_step'] - r['rss_before']) / MIB:.1f} MiB after one SGD step"
        )
    return result


@pytest.mark.slow
def test_each_rank_holds_a_quarter_of_the_parameters(ranks: list[dict[str, Any]]) -> None:
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    for r in ranks:
        assert r["mesh"] == {"dp_shard": 4}, r
        assert r["total_param_bytes"] == r["full_model_bytes"] > 290e6, r
        quarter = r["total_param_bytes"] / 4
        for when in ("setup", "step"):
            local = r[f"local_param_bytes_{when}"]
            assert abs(local - quarter) <= 0.01 * quarter, (when, local, quarter)
        assert r["finite"] and r["stepped"], r


@pytest.mark.slow
def test_setup_never_materializes_the_whole_model(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        full = r["full_model_bytes"]
        growth = r["rss_after_setup"] - r["rss_before"]
        assert growth < 0.5 * full, (
            f"rank {r['rank']}: peak RSS grew {growth / MIB:.1f} MiB in setup, model {full / MIB:.1f} MiB"
        )
        # One step adds this rank's gradient shards and one or two unsharded blocks at a time (FSDP2
        # all-gathers per Linear); a rank with the whole model and its gradients would need twice its size.
        step = r["rss_after_step"] - r["rss_before"]
        assert step < 1.5 * full, f"rank {r['rank']}: peak RSS grew {step / MIB:.1f} MiB by the end of one step"
