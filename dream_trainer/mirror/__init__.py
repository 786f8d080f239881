"""A run directory's copy in an object store (`DreamTrainerConfig.mirror`; docs/object-store.md).

- `setting.py`: `MirrorConfig` (the URL, retries, backoff, sync interval, flush timeout) and its checks.
- `store.py`: `Store`, the store through fsspec, each operation retried with backoff and counted.
- `commit.py`: the commit marker written after a checkpoint's parts: what makes it visible, and verifiable.
- `uploader.py`: `RunMirror`, the object the trainer holds: one background thread that uploads each checkpoint
  and then its marker, copies the run's other files, and deletes what rotation deleted (this run's own keys).
- `restore.py`: `pull`, what a fresh machine downloads before `fit()` chooses its run (`"last"`).
"""

from dream_trainer.mirror.commit import Commit, Part
from dream_trainer.mirror.restore import pull
from dream_trainer.mirror.setting import MirrorConfig, as_mirror, check_store
from dream_trainer.mirror.store import Store, StoreError
from dream_trainer.mirror.uploader import RunMirror

__all__ = ["Commit", "MirrorConfig", "Part", "RunMirror", "Store", "StoreError", "as_mirror", "check_store", "pull"]
