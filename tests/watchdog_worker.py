"""A rank that freezes, for tests/test_watchdog.py: tests/dist_worker.py's run under torchrun, whose rank
`--freeze-rank` stops itself with SIGSTOP at the end of global step `--freeze-at-step` (a process stopped by
a debugger or by job control; one stuck in uninterruptible I/O runs no Python either). Just before, it writes
the time (`time.time()`) to `--info-dir`/rank<R>.failed_at, as dist_worker's failures do.

    torchrun --standalone --nproc_per_node 2 tests/watchdog_worker.py --freeze-rank 1 --freeze-at-step 5 \\
        --root-dir D --info-dir D/info --batch-size 4 --strategy ddp --hang-timeout 2

Every other argument is dist_worker's (see its docstring).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any

import dist_worker


class FreezingTrainer(dist_worker.DistTrainer):
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(outputs, batch, batch_idx)
        a = self.args
        if self.global_rank == a.freeze_rank and self.global_step == a.freeze_at_step:
            self.note_failure()
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGSTOP)  # every thread stops: the watchdog's and faulthandler's too


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--freeze-rank", type=int, required=True)
    p.add_argument("--freeze-at-step", type=int, required=True)
    ours, rest = p.parse_known_args(argv)
    args = dist_worker.parse_args(rest)
    args.freeze_rank, args.freeze_at_step = ours.freeze_rank, ours.freeze_at_step
    dist_worker.DistTrainer = FreezingTrainer  # type: ignore[misc]  # what dist_worker.build makes
    dist_worker.run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
