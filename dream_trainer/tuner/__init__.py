"""Tuning before training: the learning-rate range test and the batch-size finder.

```python
from dream_trainer.tuner import Tuner

tuner = Tuner(trainer)
result = tuner.lr_find()               # LRFinderResult: lrs, losses, suggestion(), plot(path)
batch_size = tuner.scale_batch_size()  # sets trainer.batch_size (or config.batch_size)
```

Nothing here is imported by the trainer: importing `dream_trainer` costs nothing for it. `Tuner`, Lightning's
spelling over the two finders, lives in `dream_trainer.tuner.tuning`.
"""

from dream_trainer.tuner.batch_size_finder import is_oom_error, scale_batch_size
from dream_trainer.tuner.lr_finder import LRFinderResult, lr_find
from dream_trainer.tuner.tuning import Tuner

__all__ = ["LRFinderResult", "Tuner", "is_oom_error", "lr_find", "scale_batch_size"]
