"""Context parallelism: long sequences split along the sequence dimension over the "cp" mesh.

Inside `context_parallel_context(...)`, `torch.nn.functional.scaled_dot_product_attention` runs as ring
attention (each rank attends its query shard to every rank's key/value shards, passed around the ring),
and the given buffers (the batch's inputs and labels, positional buffers) are replaced in place by this
rank's shard of the sequence. It is PyTorch's prototype (`torch.distributed.tensor.experimental`),
written for CUDA's flash / memory-efficient / cuDNN attention kernels; it is refused elsewhere.

FSDP shards over dp_shard x cp ("dp_shard_cp"), and losses are averaged over "dp_cp": CP ranks see the
same samples but different tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

from dream_trainer.errors import MisconfigurationError

__all__ = ["ROTATE_METHODS", "context_parallel_context"]

ROTATE_METHODS: tuple[str, ...] = ("allgather", "alltoall")


@contextlib.contextmanager
def context_parallel_context(
    cp_mesh: DeviceMesh,
    buffers: Sequence[torch.Tensor],
    seq_dims: Sequence[int],
    *,
    no_restore_buffers: set[torch.Tensor] | None = None,
    rotate_method: str = "allgather",
) -> Iterator[None]:
    """Run the forward and backward of one step inside this context to train with context parallelism.

    `buffers[i]` is cut along dimension `seq_dims[i]`, in place; on exit they are restored unless listed
    in `no_restore_buffers`. Make sequence lengths a multiple of 2 x the cp degree: then each rank gets a
    head and a tail chunk (torch's load balancer), so causal attention costs the same on every rank;
    otherwise the chunks are contiguous and the last rank does the most work. `rotate_method` is how
    key/value shards travel: "allgather" (default) or "alltoall".

    Raises `MisconfigurationError` on a non-CUDA mesh (the ring-attention kernels are CUDA's) and for an
    unknown `rotate_method`; `ValueError` when `buffers` and `seq_dims` differ in length.
    """
    if cp_mesh.device_type != "cuda":
        raise MisconfigurationError(
            f"context_parallel={cp_mesh.size()} needs CUDA (PyTorch's context parallelism patches the CUDA "
            f"flash / memory-efficient / cuDNN attention kernels), but the mesh is on device "
            f"{cp_mesh.device_type!r}: set context_parallel=1, or run on CUDA GPUs"
        )
    if rotate_method not in ROTATE_METHODS:
        valid = ", ".join(repr(m) for m in ROTATE_METHODS)
        raise MisconfigurationError(f"context parallel rotate_method={rotate_method!r} is invalid: choices are {valid}")
    if len(buffers) != len(seq_dims):
        raise ValueError(f"context_parallel_context got {len(buffers)} buffers but {len(seq_dims)} seq_dims: one each")
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method
    from torch.nn.attention import SDPBackend, sdpa_kernel

    set_rotate_method(rotate_method)
    with (
        # The math backend has no context-parallel implementation: never let SDPA fall back to it.
        sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]),
        context_parallel(
            cp_mesh,
            buffers=list(buffers),
            buffer_seq_dims=list(seq_dims),
            no_restore_buffers=set(no_restore_buffers or ()),
        ),
    ):
        yield
