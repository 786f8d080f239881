"""The N-D parallel building blocks of `dream_trainer.parallel` (dims, data/tensor/pipeline parallel,
activation checkpointing, float8, context parallel, meta-device init).

Single-process tests check validation, messages, splitting, checkpoint wrapping and initialization.
The multi-process ones share ONE `torchrun --nproc_per_node 4` run of `parallel_blocks_worker.py`
(gloo, CPU; see its docstring for the checks; a part of `four_rank_worker.py`'s launch, shared with two
other test files), made once per test run for all xdist workers, and assert
on the JSON each rank writes. Distributed results must match one process within 1e-5 (the same
gradients, reduced in another order).
"""

from __future__ import annotations

import json
import math
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import four_rank_launch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils._python_dispatch import TorchDispatchMode

from dream_trainer.errors import ConfigError, MisconfigurationError
from dream_trainer.parallel.activation_checkpoint import apply_activation_checkpointing, find_block_container
from dream_trainer.parallel.context_parallel import context_parallel_context
from dream_trainer.parallel.data_parallel import apply_fsdp, iter_blocks
from dream_trainer.parallel.dims import ParallelDims
from dream_trainer.parallel.float8 import apply_float8
from dream_trainer.parallel.meta_init import check_finite_weights, check_materialized, materialize
from dream_trainer.parallel.pipeline_parallel import build_pipeline_schedule, split_sequential
from dream_trainer.parallel.tensor_parallel import check_tp_applied, grad_total_norm, tensor_parallel_plan_error

TOL = 1e-5
NPROC = 4


# --- ParallelDims -----------------------------------------------------------------------------------
def test_dims_resolve_dp_shard_to_the_rest_of_the_world() -> None:
    dims = ParallelDims(tensor_parallel=2, world_size=8)
    assert dims.dp_shard == 4 and dims.dp_degree == 4
    assert dims.tp_enabled and dims.dp_shard_enabled and dims.dp_enabled and dims.is_nd
    assert not (dims.pp_enabled or dims.cp_enabled or dims.dp_replicate_enabled)
    assert dims.mesh_shape() == ((4, 2), ("dp_shard", "tp"))

    one = ParallelDims(world_size=1)
    assert one.dp_shard == 1 and not one.dp_enabled and not one.is_nd
    assert one.mesh_shape() == ((1,), ("dp_shard",))  # a mesh always has a dimension

    fsdp = ParallelDims(world_size=8)
    assert fsdp.dp_shard == 8 and not fsdp.is_nd  # plain FSDP is 1-D
    hsdp = ParallelDims(dp_replicate=2, world_size=8)
    assert hsdp.dp_degree == 8 and hsdp.is_nd
    full = ParallelDims(
        dp_replicate=2, dp_shard=2, tensor_parallel=2, pipeline_parallel=2, context_parallel=2, world_size=32
    )
    assert full.mesh_shape() == ((2, 2, 2, 2, 2), ("pp", "dp_replicate", "dp_shard", "cp", "tp"))
    assert full.dp_degree == 4


def test_dims_product_mismatch_names_every_degree_the_product_and_world_size() -> None:
    with pytest.raises(ConfigError) as info:
        ParallelDims(dp_replicate=2, dp_shard=2, tensor_parallel=2, world_size=4)
    msg = str(info.value)
    for part in ("dp_replicate=2", "dp_shard=2", "tensor_parallel=2", "pipeline_parallel=1", "context_parallel=1"):
        assert part in msg
    assert "= 8" in msg and "WORLD_SIZE=4" in msg and "dp_shard=-1" in msg and "launch 8 processes" in msg


def test_dims_rest_of_world_that_does_not_divide() -> None:
    with pytest.raises(ConfigError) as info:
        ParallelDims(tensor_parallel=3, world_size=4)
    msg = str(info.value)
    assert "dp_shard=-1" in msg and "tensor_parallel=3" in msg and "WORLD_SIZE=4" in msg and "= 3" in msg


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"tensor_parallel": 0}, "tensor_parallel=0"),
        ({"pipeline_parallel": -1}, "pipeline_parallel=-1"),  # -1 means "the rest" for dp_shard only
        ({"dp_replicate": 1.5}, "dp_replicate=1.5"),
        ({"context_parallel": True}, "context_parallel=True"),
        ({"dp_shard": -2}, "dp_shard=-2"),
        ({"world_size": 0}, "world_size=0"),
    ],
)
def test_dims_reject_invalid_degrees(kwargs: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        ParallelDims(**{"world_size": 4, **kwargs})


def test_build_mesh_on_eight_fake_ranks() -> None:
    """Mesh layouts on 8 ranks, seen from rank 5 (a fake process group: no processes needed)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from dream_trainer.parallel.dims import dp_rank_and_size, fsdp_mesh, submesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("fake", rank=5, world_size=8, store=FakeStore())
    try:
        mesh = ParallelDims(pipeline_parallel=2, dp_shard=2, tensor_parallel=2, world_size=8).build_mesh("cpu")
        assert mesh.mesh_dim_names == ("pp", "dp_shard", "tp")
        # Rank 5 = pp 1, dp_shard 0, tp 1.
        assert submesh(mesh, "tp").mesh.tolist() == [4, 5]
        assert submesh(mesh, "pp").mesh.tolist() == [1, 5]
        assert submesh(mesh, "dp").mesh.tolist() == [5, 7]
        assert submesh(mesh, "dp_shard_cp").mesh.tolist() == [5, 7]
        assert submesh(mesh, "cp") is None and submesh(mesh, "dp_replicate") is None
        assert dp_rank_and_size(mesh) == (0, 2)
        assert fsdp_mesh(mesh).mesh.tolist() == [5, 7]
        with pytest.raises(ValueError, match="valid choices"):
            submesh(mesh, "data")

        # HSDP with context parallel: FSDP shards over dp_shard x cp and replicates over dp_replicate.
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "slicing a flattened dim" deprecation escapes
            mesh = ParallelDims(dp_replicate=2, dp_shard=2, context_parallel=2, world_size=8).build_mesh("cpu")
            hsdp = fsdp_mesh(mesh)
        assert hsdp.mesh.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]] and hsdp.mesh_dim_names[1] == "dp_shard_cp"
        assert submesh(mesh, "dp").mesh.tolist() == [1, 3, 5, 7] and dp_rank_and_size(mesh) == (2, 4)
        assert submesh(mesh, "dp_cp").mesh.tolist() == list(range(8))
    finally:
        dist.destroy_process_group()


# --- pipeline splitting and schedules --------------------------------------------------------------
def chain(stages: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for stage in stages:
        x = stage(x)
    return x


def test_split_sequential_balances_parameters_and_keeps_names() -> None:
    torch.manual_seed(0)
    # Parameter counts 8*64+64=576, 0, 64*64+64=4160, 0, 4160, 0, 65: balanced cut = [0..1], [2..3], [4..6].
    model = nn.Sequential(
        nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)
    )
    all_stages = [split_sequential(model, r, 3)[0][0] for r in range(3)]
    assert [list(s._modules) for s in all_stages] == [["0", "1"], ["2", "3"], ["4", "5", "6"]]
    assert split_sequential(model, 1, 3)[1] == [1]
    assert all_stages[1][0] is model[2]  # shared, not copied
    x = torch.randn(4, 8)
    torch.testing.assert_close(chain(all_stages, x), model(x), rtol=0, atol=0)
    keys = [k for s in all_stages for k in s.state_dict()]
    assert sorted(keys) == sorted(model.state_dict())  # checkpoints of the stages load into the model

    # Interleaved placement: pp rank r holds stages r and r + pp_size.
    stages, indices = split_sequential(model, 1, 2, stages_per_rank=2)
    assert indices == [1, 3] and len(stages) == 2


def test_split_sequential_errors() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="2 blocks into 4 pipeline stages"):
        split_sequential(model, 0, 4)
    with pytest.raises(ConfigError, match="pp_rank=2"):
        split_sequential(model, 2, 2)
    with pytest.raises(ConfigError, match=r"neither an nn\.Sequential"):
        split_sequential(nn.Linear(2, 2), 0, 2)


class TinyTransformer(nn.Module):
    """torchtitan's contract for pipeline splitting: the forward skips children that are None."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(5))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x) if self.embed is not None else x
        for layer in self.layers:
            x = torch.tanh(layer(x))
        x = self.norm(x) if self.norm is not None else x
        return self.head(x) if self.head is not None else x


def test_split_model_owning_a_module_list() -> None:
    torch.manual_seed(0)
    model = TinyTransformer()
    stages = [split_sequential(model, r, 2)[0][0] for r in range(2)]
    assert stages[0].head is None and stages[0].norm is None and stages[1].embed is None
    assert [list(s.layers._modules) for s in stages] == [["0", "1", "2"], ["3", "4"]]
    x = torch.randn(3, 4)
    torch.testing.assert_close(chain(stages, x), model(x))
    keys = [k for s in stages for k in s.state_dict()]
    assert sorted(keys) == sorted(model.state_dict())


def test_build_pipeline_schedule_validates_before_building() -> None:
    pp_mesh: Any = SimpleNamespace(size=lambda: 2)
    stage = [nn.Linear(2, 2)]
    kwargs = {"device": torch.device("cpu"), "loss_fn": F.mse_loss}
    with pytest.raises(ConfigError) as info:
        build_pipeline_schedule(stage, [0], 2, pp_mesh, n_microbatches=4, schedule="zero_bubble", **kwargs)
    assert "'gpipe', '1f1b', 'interleaved_1f1b'" in str(info.value)
    with pytest.raises(ConfigError, match="stages_per_rank >= 2"):
        build_pipeline_schedule(stage, [0], 2, pp_mesh, n_microbatches=4, schedule="interleaved_1f1b", **kwargs)
    with pytest.raises(ConfigError, match="one stage per rank"):
        build_pipeline_schedule(stage * 2, [0, 2], 4, pp_mesh, n_microbatches=4, schedule="1f1b", **kwargs)
    with pytest.raises(ConfigError, match="num_stages must be 2"):
        build_pipeline_schedule(stage, [0], 3, pp_mesh, n_microbatches=4, schedule="1f1b", **kwargs)
    with pytest.raises(ConfigError, match="n_microbatches=1 is below pipeline_parallel=2"):
        build_pipeline_schedule(stage, [0], 2, pp_mesh, n_microbatches=1, schedule="gpipe", **kwargs)


# --- activation checkpointing ------------------------------------------------------------------------
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(6, 6))  # a smaller container: not the stack of blocks
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Dropout(0.2), nn.Linear(12, 6)) for _ in range(3)
        )
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def grads_of(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)  # dropout masks: checkpointing replays the RNG state in recompute
    model(x).pow(2).mean().backward()
    return {k.replace("_checkpoint_wrapped_module.", ""): p.grad.clone() for k, p in model.named_parameters()}


class CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_wraps_blocks_and_keeps_gradients(mode: str) -> None:
    torch.manual_seed(0)
    plain = Net()
    wrapped = Net()
    wrapped.load_state_dict(plain.state_dict())
    assert find_block_container(wrapped) is wrapped.blocks
    apply_activation_checkpointing(wrapped, mode=mode)
    assert all(isinstance(b, CheckpointWrapper) for b in wrapped.blocks)
    assert not isinstance(wrapped.stem[0], CheckpointWrapper)
    first = list(wrapped.blocks)
    apply_activation_checkpointing(wrapped, mode=mode)  # idempotent
    assert list(wrapped.blocks) == first and not isinstance(first[0]._checkpoint_wrapped_module, CheckpointWrapper)
    assert sorted(wrapped.state_dict()) == sorted(plain.state_dict())  # checkpoints unchanged

    x = torch.randn(5, 6)
    want, got = grads_of(plain, x), grads_of(wrapped, x)
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-7, msg=name)


def test_selective_checkpointing_recomputes_no_matmul() -> None:
    x = torch.randn(5, 6)
    counts = {}
    for mode in ("none", "full", "selective"):
        torch.manual_seed(0)
        model = Net().eval()  # no dropout: the counts are the point here
        if mode != "none":
            apply_activation_checkpointing(model, mode=mode)
        loss = model(x).sum()
        with CountMatmuls() as counter:
            loss.backward()
        counts[mode] = counter.count
    # Full recomputes each block's first matmul in backward (non-reentrant recompute stops once it has
    # every tensor backward needs: the second matmul's output is not one); selective keeps them.
    assert counts["full"] == counts["none"] + 3
    assert counts["selective"] == counts["none"]


def test_activation_checkpointing_mode_is_validated() -> None:
    with pytest.raises(ConfigError, match=r"mode='partial' is invalid: valid choices are 'full', 'selective'"):
        apply_activation_checkpointing(Net(), mode="partial")
    with pytest.raises(ConfigError, match=r"no nn\.ModuleList or nn\.Sequential"):
        apply_activation_checkpointing(nn.Linear(2, 2))


# --- data parallel (single-process parts) -------------------------------------------------------------
def test_iter_blocks_is_bottom_up_and_skips_frozen_and_empty_blocks() -> None:
    inner = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    frozen = nn.Linear(2, 2).requires_grad_(False)
    model = nn.Sequential(nn.ModuleList([inner, frozen]), nn.Linear(2, 2))
    blocks = list(iter_blocks(model))
    assert blocks.index(inner[0]) < blocks.index(inner) < blocks.index(model[0])
    assert frozen not in blocks and inner[1] not in blocks and model not in blocks


def test_apply_fsdp_refuses_a_three_dimensional_mesh() -> None:
    mesh: Any = SimpleNamespace(ndim=3, mesh_dim_names=("pp", "dp_shard", "tp"))
    with pytest.raises(ConfigError, match="3-D mesh"):
        apply_fsdp(nn.Linear(2, 2), mesh)


# --- tensor parallel ---------------------------------------------------------------------------------
def test_tensor_parallel_plan_error_shows_the_hook_to_override() -> None:
    with pytest.raises(MisconfigurationError) as info:
        tensor_parallel_plan_error(4)
    msg = str(info.value)
    assert "tensor_parallel=4" in msg and "def apply_tensor_parallel(self, tp_mesh):" in msg
    assert "parallelize_module(self.model, tp_mesh" in msg and "tensor_parallel=1" in msg


def test_check_tp_applied_names_the_degree() -> None:
    tp_mesh: Any = SimpleNamespace(mesh_dim_names=("tp",), size=lambda: 2)
    with pytest.raises(MisconfigurationError, match="tensor_parallel=2 but no parameter of Linear is sharded"):
        check_tp_applied(nn.Linear(2, 2), tp_mesh)


def test_grad_total_norm_of_plain_tensors() -> None:
    model = nn.Linear(3, 2)
    model(torch.randn(4, 3)).sum().backward()
    grads = [p.grad for p in model.parameters()]
    torch.testing.assert_close(grad_total_norm(model.parameters()), torch.nn.utils.get_total_norm(grads))
    torch.testing.assert_close(grad_total_norm(model.parameters(), math.inf), max(g.abs().max() for g in grads))


# --- float8 and context parallel refuse the CPU --------------------------------------------------------
def test_float8_refuses_cpu_naming_the_setting_and_the_requirements() -> None:
    with pytest.raises(MisconfigurationError) as info:
        apply_float8(nn.Linear(16, 16), "cpu")
    msg = str(info.value)
    assert "config.float8" in msg and "'cpu'" in msg and "8.9" in msg and "pip install torchao" in msg
    with pytest.raises(MisconfigurationError, match="recipe='fp4' is invalid"):
        apply_float8(nn.Linear(16, 16), "cpu", recipe="fp4")


def test_float8_refuses_an_old_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "A100")
    with pytest.raises(MisconfigurationError, match=r"A100 \(cuda\) has 8\.0"):
        apply_float8(nn.Linear(16, 16), "cuda")


def test_float8_converts_eligible_linears(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where torchao is installed: which layers become float8 (the conversion itself runs on the CPU)."""
    pytest.importorskip("torchao.float8")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    model = nn.ModuleDict({"fc": nn.Linear(32, 64), "odd": nn.Linear(64, 30), "output": nn.Linear(64, 32)})
    apply_float8(model, "cuda", fsdp_float8_all_gather=True)
    kinds = {name: type(m).__name__ for name, m in model.items()}
    assert kinds == {"fc": "Float8Linear", "odd": "Linear", "output": "Linear"}  # dims % 16; skip_fqns


def test_context_parallel_refuses_cpu() -> None:
    cp_mesh: Any = SimpleNamespace(device_type="cpu", size=lambda: 2)
    tokens = torch.zeros(2, 8)
    with pytest.raises(MisconfigurationError) as info, context_parallel_context(cp_mesh, [tokens], [1]):
        pass
    assert "context_parallel=2" in str(info.value) and "'cpu'" in str(info.value)
    assert tokens.shape == (2, 8)  # untouched


# --- meta-device init ------------------------------------------------------------------------------------
def test_materialize_builds_a_meta_model_on_the_cpu() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    with pytest.raises(MisconfigurationError) as info:
        check_materialized(model)
    msg = str(info.value)
    assert "parameter 0.weight" in msg and "buffer 1.running_mean" in msg and "materialize" in msg
    materialize(model, "cpu")
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert torch.equal(model[1].running_var, torch.ones(8))  # BatchNorm's reset_parameters ran
    assert model[0].weight.abs().sum() > 0
    check_materialized(model)


def test_materialize_with_init_fn_and_parent_reset_order() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def reset_parameters(self) -> None:  # runs after the child's own reset: it has the last word
            nn.init.constant_(self.fc.weight, 3.0)

    with torch.device("meta"):
        model = Scaled()
    materialize(model, "cpu")
    assert torch.equal(model.fc.weight, torch.full((2, 2), 3.0))

    with torch.device("meta"):
        model2 = nn.Linear(2, 2)

    def init(m: nn.Module) -> None:
        nn.init.zeros_(m.weight)
        nn.init.ones_(m.bias)

    materialize(model2, "cpu", init_fn=init)
    assert torch.equal(model2.weight, torch.zeros(2, 2)) and torch.equal(model2.bias, torch.ones(2))


def test_materialize_refuses_modules_without_reset_parameters() -> None:
    class Raw(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3))
            self.fc = nn.Linear(3, 3)

    with torch.device("meta"):
        model = Raw()
    with pytest.raises(MisconfigurationError) as info:
        materialize(model, "cpu")
    assert "<root> (Raw: scale)" in str(info.value) and "init_fn" in str(info.value)
    assert model.scale.is_meta  # refused before allocating anything


def test_check_finite_weights_names_every_bad_parameter() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    with torch.no_grad():
        model[0].bias[1] = float("nan")
        model[2].weight[0, 0] = float("inf")
    with pytest.raises(MisconfigurationError, match=r"2 parameter\(s\) .*: 0\.bias, 2\.weight\."):
        check_finite_weights(model)
    check_finite_weights(nn.Linear(2, 2))


# --- the 4-process launch ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dist_results(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    """Each rank's results of one launch, shared by this run's xdist workers (the first one launches)."""
    out_dir, log = four_rank_launch(tmp_path_factory, "parallel_blocks")
    results = {int(p.stem[4:]): json.loads(p.read_text()) for p in out_dir.glob("rank*.json")}
    assert sorted(results) == list(range(NPROC)), "ranks wrote no results:\n" + log.read_text()
    return results


def check(results: dict[int, dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """Every rank's figures for check `name`, failing with the worker's traceback if it raised."""
    per_rank = []
    for rank in range(NPROC):
        got = results[rank].get(name)
        assert got is not None, f"rank {rank} did not reach check {name!r}: {results[rank]}"
        assert "error" not in got, f"rank {rank}, check {name!r}:\n{got['error']}"
        per_rank.append(got)
    return per_rank


@pytest.mark.slow
def test_tp_and_fsdp_match_one_process(dist_results: dict[int, dict[str, Any]]) -> None:
    ranks = check(dist_results, "tp_fsdp")
    assert all(r["max_diff"] <= TOL for r in ranks), [r["max_diff"] for r in ranks]
    # Mesh (dp_shard=2, tp=2): ranks 0,1 form a TP group and read the same data slice, as do 2,3.
    assert [(r["dp_rank"], r["dp_size"], r["tp_rank"]) for r in ranks] == [(0, 2, 0), (0, 2, 1), (1, 2, 0), (1, 2, 1)]


@pytest.mark.slow
def test_grad_norms_over_sharded_parameters(dist_results: dict[int, dict[str, Any]]) -> None:
    for r in check(dist_results, "tp_fsdp"):
        # get_total_norm over TP-sharded grads, then full_tensor(): the unsharded norm.
        assert math.isclose(r["tp_norm"], r["ref_tp_norm"], rel_tol=TOL)
        # After FSDP the grads live on two meshes; get_total_norm alone refuses to mix them.
        assert r["grad_meshes"] == ["('dp_shard', 'tp')", "('dp_shard',)"]
        assert "same mesh" in r["get_total_norm_mixed_meshes"]
        assert math.isclose(r["all_norm"], r["ref_all_norm"], rel_tol=TOL)


@pytest.mark.slow
def test_hsdp_matches_one_process(dist_results: dict[int, dict[str, Any]]) -> None:
    ranks = check(dist_results, "hsdp")
    assert all(r["max_diff"] <= TOL for r in ranks)
    assert [r["dp_rank"] for r in ranks] == [0, 1, 2, 3] and ranks[0]["dp_size"] == 4
    assert ranks[0]["placements"] == ["(Replicate(), Shard(dim=0))"]


@pytest.mark.slow
def test_tp_and_replicate_match_one_process(dist_results: dict[int, dict[str, Any]]) -> None:
    ranks = check(dist_results, "tp_ddp")
    assert all(r["max_diff"] <= TOL for r in ranks)
    assert "blocks.0.fc1.weight" in ranks[0]["state_dict_keys"] and len(ranks[0]["state_dict_keys"]) == 10


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pp_1f1b", "pp_interleaved"])
def test_pipeline_and_fsdp_match_one_process(dist_results: dict[int, dict[str, Any]], name: str) -> None:
    ranks = check(dist_results, name)
    assert all(r["max_diff"] <= TOL for r in ranks), [r["max_diff"] for r in ranks]
    # Mesh (pp=2, dp_shard=2): ranks 0,1 hold the first stage(s), 2,3 the last.
    assert [r["pp_rank"] for r in ranks] == [0, 0, 1, 1]
    keys = sorted({k for r in ranks for k in r["stage_keys"]})
    assert keys == sorted(f"{i}.{p}" for i in (0, 2, 4, 6, 8) for p in ("weight", "bias"))
    for r in ranks:
        if r["pp_rank"] == 0:
            assert r["losses"] is None and r["val_loss"] is None and r["loss_after_eval"] is None
        else:
            for got, want in zip(r["losses"], r["ref_losses"], strict=True):
                assert math.isclose(got, want, rel_tol=TOL)
            assert math.isclose(r["val_loss"], r["ref_val_loss"], rel_tol=TOL)
            assert math.isfinite(r["loss_after_eval"])
        assert not r["eval_changed_weights"]


@pytest.mark.slow
def test_meta_init_then_fsdp_holds_a_quarter_per_rank(dist_results: dict[int, dict[str, Any]]) -> None:
    ranks = check(dist_results, "meta_fsdp")
    for r in ranks:
        assert abs(r["fraction"] - 0.25) <= 0.025, f"{r['local_bytes']} of {r['full_bytes']} bytes on one rank"
        assert "2.weight" in r["nan_error"]  # every rank raises for rank 1's NaN
    print(f"meta_fsdp: {ranks[0]['local_bytes']} of {ranks[0]['full_bytes']} parameter bytes per rank")
