"""The Trainer: a base class for data-parallel Keras training with step
checkpoints and exact resume.

`trainer.Trainer` is the class users subclass; the rest is its machinery:
`checkpoints` (the atomic, verified, rotated checkpoint store), `snapshot`
(step checkpoints written in the background), `resume` (which checkpoint a
run continues from), `data` (input pipelines), `callbacks` (the callbacks it
adds on its own) and `state` (process setup).
"""

from kerasdist.trainer.trainer import Trainer

__all__ = ["Trainer"]
