"""The one 4-process launch (gloo, CPU) shared by tests/test_meta_memory.py, tests/test_parallel_blocks.py,
tests/test_model_parallel.py and tests/test_world_sizes.py: each of their workers in turn, in the same
processes.

    torchrun --standalone --nproc_per_node 4 tests/four_rank_worker.py --out-dir DIR

One launch instead of four saves three torchrun starts of 4 processes (each ~12 s of CPU for the imports
and the rendezvous). The process group is created here, once, and every part runs in it (the trainers
keep a group they find); it is destroyed at the end. In order, each part writing to its own folder
what its worker writes when launched alone:

1. `meta_memory_worker.run(DIR/meta_memory)`: first, before anything else has allocated, so that its
   peak-RSS figures (`ru_maxrss` is a high-water mark) are this model's and nothing else's;
2. `parallel_blocks_worker.run(DIR/parallel_blocks)`;
3. `model_parallel_worker.run(DIR/model_parallel)`;
4. `world_size_worker.run(DIR/world_sizes)`: last, as it takes the processes through groups of 1, 2, 3
   and 4 (it leaves a group of 4 again).

A part that raises writes its traceback where its worker does and ends the launch: the other ranks
would wait in collectives that never come. Rank 0 prints `part: <name> (<seconds> s)` after each part.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

PARTS = ("meta_memory", "parallel_blocks", "model_parallel", "world_sizes")


def run_part(name: str, out_dir: Path) -> None:
    # Imported here, in turn: the first part runs before the others' modules are loaded.
    if name == "meta_memory":
        import meta_memory_worker

        try:
            meta_memory_worker.run(out_dir)
        except Exception:
            (out_dir / f"meta_memory.error.{os.environ.get('RANK', '0')}").write_text(traceback.format_exc())
            raise
    elif name == "parallel_blocks":
        import parallel_blocks_worker

        parallel_blocks_worker.run(out_dir)  # writes each rank's errors into its rank<R>.json
    elif name == "model_parallel":
        import model_parallel_worker

        model_parallel_worker.run(out_dir)  # writes <case>.error.<rank>
    else:
        import world_size_worker

        try:
            world_size_worker.run(out_dir)
        except Exception:
            (out_dir / f"world_sizes.error.{os.environ.get('RANK', '0')}").write_text(traceback.format_exc())
            raise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated, in this order")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    try:
        for name in args.parts.split(","):
            start = time.perf_counter()
            part_dir = args.out_dir / name
            part_dir.mkdir(parents=True, exist_ok=True)
            run_part(name, part_dir)
            dist.barrier()
            if dist.get_rank() == 0:
                print(f"part: {name} ({time.perf_counter() - start:.1f} s)", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
