"""`DreamTrainer` on N-D device meshes (issue: large models): configuration, and real 4-process runs.

The multi-process tests share ONE `torchrun --nproc_per_node 4` run of `model_parallel_worker.py`
(gloo, CPU; the last part of `four_rank_worker.py`'s launch, shared with two other test files), made once
per test run for all xdist workers. Each case's final weights must equal one
process training the same model on the same global batches within 1e-5 (AdamW, clipping and
accumulation on); a resumed 2-D run must equal its uninterrupted twin exactly. Callbacks over DTensor
parameters (EMA, GradientNormMonitor) must give one process's averages and norms within 1e-6. fp16 over
two meshes must skip an overflow seen by one rank on every rank. Dropout: the ranks of a TP group draw
the same masks, a resumed run draws the uninterrupted run's masks; meta-device init on the CPU gives
every shard its own values and every replica the same ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import four_rank_launch
from model_parallel_common import CASES, InfGradAt, Trainer, case_config, ema_callbacks

from dream_trainer import DreamTrainerConfig
from dream_trainer.errors import ConfigError, MisconfigurationError

TOL = 1e-5
NPROC = 4


# --- configuration ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("field", "value"),
    [("tensor_parallel", 0), ("dp_replicate", -1), ("dp_shard", 0), ("pipeline_parallel", 1.5), ("float8", 1)],
)
def test_degrees_are_validated_when_the_config_is_built(field: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=field):
        DreamTrainerConfig(**{field: value})


def test_a_mesh_degree_with_ddp_is_refused_naming_the_fix() -> None:
    with pytest.raises(ConfigError, match="tensor_parallel=2 needs a device mesh: use strategy='auto'"):
        DreamTrainerConfig(strategy="ddp", tensor_parallel=2)


def test_degrees_are_checked_against_world_size_when_the_trainer_is_built(tmp_path: Path) -> None:
    # One process, tensor_parallel=2 x dp_replicate=2: the product (4) is not WORLD_SIZE (1).
    cfg = case_config(tmp_path, tensor_parallel=2, dp_replicate=2, dp_shard=1)
    with pytest.raises(ConfigError) as err:
        Trainer(cfg)
    msg = str(err.value)
    for part in ("dp_replicate=2", "dp_shard=1", "tensor_parallel=2", "pipeline_parallel=1", "WORLD_SIZE=1"):
        assert part in msg, msg


def test_context_parallel_and_float8_are_refused_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")  # construction only: nothing joins a group
    with pytest.raises(MisconfigurationError, match="context_parallel=2 needs CUDA"):
        Trainer(case_config(tmp_path, context_parallel=2, dp_shard=1))
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(MisconfigurationError, match="float8"):
        Trainer(case_config(tmp_path, strategy="model_parallel", float8=True))


def test_strategy_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert Trainer(case_config(tmp_path, tensor_parallel=2)).strategy == "model_parallel"
    assert Trainer(case_config(tmp_path, strategy="fsdp", dp_replicate=2)).strategy == "model_parallel"
    assert Trainer(case_config(tmp_path, strategy="fsdp")).strategy == "fsdp"
    assert Trainer(case_config(tmp_path)).strategy == "ddp"


def test_meta_init_on_one_process_matches_eager_shapes_and_is_finite(tmp_path: Path) -> None:
    trainer = Trainer(case_config(tmp_path, init_device="meta", n_epochs=1, strategy="single"))
    trainer.fit()
    params = dict(trainer.model.named_parameters())
    assert all(p.device.type == "cpu" and bool(torch.isfinite(p).all()) for p in params.values())
    assert len(params) == 8 and trainer.global_step == 4


def test_meta_init_without_reset_parameters_names_the_module(tmp_path: Path) -> None:
    class Scale(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = torch.nn.Parameter(torch.ones(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.gain

    class ScaledTrainer(Trainer):
        def configure_models(self) -> None:
            super().configure_models()
            self.model.append(Scale())

    with pytest.raises(MisconfigurationError, match=r"7 \(Scale: gain\).*init_weights"):
        ScaledTrainer(case_config(tmp_path, init_device="meta", n_epochs=1, strategy="single")).fit()


def test_activation_checkpointing_from_the_config_keeps_training_identical(tmp_path: Path) -> None:
    plain = Trainer(case_config(tmp_path / "a", n_epochs=1, strategy="single"))
    plain.fit()
    ac = Trainer(case_config(tmp_path / "b", n_epochs=1, strategy="single", activation_checkpointing="full"))
    ac.fit()
    assert "_checkpoint_wrapped_module" in "".join(n for n, _ in ac.model.named_modules())
    for (name, a), b in zip(plain.model.state_dict().items(), ac.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_pipeline_forward_without_a_pipeline_is_the_plain_loss(tmp_path: Path) -> None:
    trainer = Trainer(case_config(tmp_path, n_epochs=1, strategy="single"))
    trainer.fit()
    assert not trainer.pipelined and len(trainer.recorded_losses) == 8


# --- 4 processes -----------------------------------------------------------------------------------------
def reference(root: Path) -> tuple[dict[str, torch.Tensor], float]:
    """One process, the whole global batch: the weights (and last validation loss) every mesh must reach."""
    trainer = Trainer(case_config(root, strategy="single", callbacks=[]))
    trainer.fit()
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, trainer.callback_metrics["val_loss"]


@pytest.fixture(scope="module")
def mp_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The worker's results per case, shared by this run's xdist workers (the first one launches)."""
    out_dir, log = four_rank_launch(tmp_path_factory, "model_parallel")
    weights, val_loss = reference(out_dir.parent / "reference")
    return {"dir": out_dir, "log": log, "reference": weights, "val_loss": val_loss}


def case(results: dict[str, Any], name: str) -> dict[str, Any]:
    out_dir: Path = results["dir"]
    errors = sorted(out_dir.glob(f"{name}.error.*"))
    assert not errors, errors[0].read_text()
    path = out_dir / f"{name}.pt"
    assert path.exists(), f"case {name!r} wrote no result:\n" + results["log"].read_text()
    return torch.load(path, weights_only=True)


def assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float = TOL) -> None:
    assert sorted(got) == sorted(want)
    worst = max(float((got[k].float() - want[k].float()).abs().max()) for k in want)
    assert worst <= tol, f"max |difference| {worst:.3g} > {tol}"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tp_fsdp", "hsdp", "pp_dp", "tp_pp"])
def test_mesh_run_matches_one_process(mp_results: dict[str, Any], name: str) -> None:
    got = case(mp_results, name)
    assert_close(got["weights"], mp_results["reference"])
    # Validation (forward only through the pipeline stages under PP) sees the same loss too.
    assert abs(got["val_loss"] - mp_results["val_loss"]) < TOL, (got["val_loss"], mp_results["val_loss"])
    dims = CASES[name]
    dp = dims.get("dp_replicate", 1) * dims.get("dp_shard", 1)
    assert {size for _, size in got["dp"]} == {dp}


@pytest.mark.slow
def test_ranks_of_one_tensor_parallel_group_read_the_same_batch(mp_results: dict[str, Any]) -> None:
    # Mesh (dp_shard=2, tp=2): global ranks 0,1 form one TP group, 2,3 the other.
    assert [rank for rank, _ in case(mp_results, "tp_fsdp")["dp"]] == [0, 0, 1, 1]


@pytest.mark.slow
def test_resume_on_a_2d_mesh_is_exact(mp_results: dict[str, Any]) -> None:
    resumed = case(mp_results, "resume_2d")["weights"]
    uninterrupted = case(mp_results, "tp_fsdp")["weights"]
    for k, v in uninterrupted.items():
        assert torch.equal(resumed[k], v), k


@pytest.mark.slow
def test_checkpoint_of_a_2d_mesh_loads_at_another_mesh_and_in_one_process(
    mp_results: dict[str, Any], tmp_path: Path
) -> None:
    # tp_fsdp's last checkpoint (step 8, where the run ended: a sharded DCP directory written by
    # dp_shard=2 x tp=2), loaded by dp_shard=4 (in the worker) and by one process (here): the same
    # weights, exactly.
    ckpt = case(mp_results, "tp_fsdp")["last_ckpt"]
    single = Trainer(case_config(tmp_path, strategy="single", callbacks=[]))
    single.load_checkpoint(ckpt)
    assert single.global_step == 8
    assert_close(case(mp_results, "reshard")["weights"], single.model.state_dict(), tol=0.0)
    initial = Trainer(case_config(tmp_path / "fresh", strategy="single", callbacks=[]))
    initial._setup_fit()
    assert not torch.equal(single.model[0].weight, initial.model[0].weight)


@pytest.mark.slow
def test_meta_init_with_dp_shard_4_holds_a_quarter_of_the_parameters(mp_results: dict[str, Any]) -> None:
    per_rank = case(mp_results, "meta_fsdp")["param_bytes"]
    for local, total in per_rank:
        assert abs(local / total - 0.25) < 0.05, per_rank


@pytest.mark.slow
def test_ema_and_grad_norm_over_dtensor_parameters_match_one_process(
    mp_results: dict[str, Any], tmp_path: Path
) -> None:
    # dp_shard=2 x tensor_parallel=2 (parameters on two meshes), 8 steps, no clipping. The EMA keeps
    # DTensor shards (FSDP2 modules cannot be deep-copied), swaps them in for validation and back; the
    # logged norm is the strategy's (per mesh), the per-parameter norms are whole tensors' norms.
    got = case(mp_results, "ema_grad_norm")
    callbacks = ema_callbacks()
    single = Trainer(case_config(tmp_path, strategy="single", callbacks=callbacks, gradient_clip_val=None))
    single.fit()
    assert_close(got["weights"], single.model.state_dict())
    ema = callbacks[0].ema_state_dict()["model"]
    assert_close(got["ema"], ema, tol=1e-6)
    assert not torch.allclose(ema["0.weight"], single.model.state_dict()["0.weight"], atol=1e-3)  # a real average
    # Validation ran with the EMA weights swapped in, on both.
    assert abs(got["val_loss"] - single.callback_metrics["val_loss"]) < 1e-6
    want = single.recorded_grad_norms
    assert [(step, key) for step, key, _ in got["grad_norms"]] == [(step, key) for step, key, _ in want]
    assert [step for step, _, _ in want] == list(range(1, 9))
    worst = max(abs(a[2] - b[2]) for a, b in zip(got["grad_norms"], want, strict=True))
    assert worst <= 1e-6, worst
    layers, want_layers = got["layer_norms"], callbacks[2].norms
    assert len(layers) == len(want_layers) == 8 and sorted(layers[0]) == sorted(want_layers[0])
    worst = max(abs(a[k] - b[k]) for a, b in zip(layers, want_layers, strict=True) for k in b)
    assert worst <= 1e-6, worst


@pytest.mark.slow
def test_fp16_over_two_meshes_skips_one_ranks_overflow_everywhere(mp_results: dict[str, Any], tmp_path: Path) -> None:
    # Layers 2 and 4 TP-sharded, so the first gradient the scaler unscales is on "dp_shard" alone, whose
    # group torch's GradScaler reduced the inf verdict over: rank 1's inf at step 2 made ranks 1 and 3
    # skip and halve the scale while ranks 0 and 2 stepped. Now every rank skips, as one process does.
    got = case(mp_results, "fp16_2d")
    single = Trainer(case_config(tmp_path, strategy="single", mixed_precision="fp16", callbacks=[InfGradAt(rank=0)]))
    single.fit()
    assert single.grad_scaler is not None
    assert got["scales"] == [single.grad_scaler.get_scale()] * NPROC
    # fp16 rounding differs (FSDP2 casts the parameters, one process autocasts): 1e-4 measured; one
    # AdamW step more or less moves the weights by about 1e-2.
    assert_close(got["weights"], single.model.state_dict(), tol=5e-4)
    shards = got["shards"]
    for name in ("0.weight", "4.bias", "6.weight"):  # replicated over the TP group: equal within one
        assert shards[0][name] == shards[1][name] and shards[2][name] == shards[3][name], name


@pytest.mark.slow
def test_dropout_streams_on_a_2d_mesh_and_after_resume(mp_results: dict[str, Any]) -> None:
    got = case(mp_results, "dropout_2d")
    masks = got["masks"]  # per rank: (global_step, layer, mask checksum) of every training forward
    assert [len(m) for m in masks] == [8 * 2 * 2] * NPROC  # 8 steps x 2 micro-batches x 2 dropouts
    # Ranks 0, 1 (and 2, 3) form a TP group: after the row-wise layer 2 they hold the same activation,
    # and must drop the same units, forward after forward.
    for a, b in ((0, 1), (2, 3)):
        assert [m for m in masks[a] if m[1] == 3] == [m for m in masks[b] if m[1] == 3]
    assert len({c for _, _, c in masks[0]}) == len(masks[0])  # a fresh mask every forward
    # After 8 steps the replicas still agree: the TP-replicated parameters of a TP group are equal.
    for name in ("2.bias", "4.weight", "4.bias"):
        assert got["shards"][0][name] == got["shards"][1][name], name
    # Meta-device init (DTensor random ops on the CPU): every shard its own draws, replicas the same.
    init = got["initial_shards"]
    for name in ("0.weight", "0.bias", "2.weight"):  # split over dp_shard x tp: 4 different shards
        assert len({r[name] for r in init}) == NPROC, name
    for name in ("2.bias", "4.weight", "4.bias"):  # split over dp_shard, replicated over tp
        assert init[0][name] == init[1][name] != init[2][name] == init[3][name], name

    # Killed at step 5, resumed from step 3 by a fresh trainer: each rank's RNG continues exactly.
    resumed = case(mp_results, "dropout_resume")
    for rank in range(NPROC):
        assert resumed["masks"][rank] == [m for m in masks[rank] if m[0] >= 3], rank
    for k, v in got["weights"].items():
        assert torch.equal(resumed["weights"][k], v), k
