"""Keras callbacks for data-parallel training with kerasdist.

Put them in `model.fit(callbacks=[...])` on every rank, in this order:

    callbacks = [
        kerasdist.callbacks.BroadcastGlobalVariablesCallback(0),
        kerasdist.callbacks.MetricAverageCallback(),
        kerasdist.callbacks.LearningRateWarmupCallback(initial_lr=0.1),
        # ... then callbacks that read the logs: ModelCheckpoint,
        # EarlyStopping, ReduceLROnPlateau, TensorBoard.
    ]

`MetricAverageCallback` averages the logs in place, so only the callbacks
placed after it see averaged values.
"""

from kerasdist.callbacks.broadcast import BroadcastGlobalVariablesCallback
from kerasdist.callbacks.learning_rate import LearningRateScheduleCallback
from kerasdist.callbacks.learning_rate import LearningRateWarmupCallback
from kerasdist.callbacks.metric_average import MetricAverageCallback
from kerasdist.callbacks.model_average import ModelAverageCallback
from kerasdist.callbacks.model_checkpoint import ModelCheckpoint
from kerasdist.callbacks.model_checkpoint import latest_checkpoint
from kerasdist.callbacks.model_checkpoint import load_checkpoint
from kerasdist.callbacks.steps import EqualizeStepsCallback

__all__ = [
    "BroadcastGlobalVariablesCallback",
    "EqualizeStepsCallback",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "MetricAverageCallback",
    "ModelAverageCallback",
    "ModelCheckpoint",
    "latest_checkpoint",
    "load_checkpoint",
]
