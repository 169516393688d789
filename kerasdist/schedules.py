"""Learning-rate schedules for data-parallel training."""

import keras

from kerasdist import basics

_Schedule = keras.optimizers.schedules.LearningRateSchedule


@keras.saving.register_keras_serializable(package="kerasdist")
class WarmupSchedule(_Schedule):
    """Linear warmup in front of a learning rate or another schedule.

    `lr(step) = base(step) * (scale + (1 - scale) * min(step / warmup_steps,
    1))`: the learning rate starts at `scale * base(0)` and reaches
    `base(step)` after `warmup_steps` optimizer steps, then follows `base`.
    `scale` defaults to `1 / kerasdist.size()` (Goyal et al.: warm up from
    the single-process rate to the rate scaled by the number of ranks).

    The optimizer calls it with its iteration count, which checkpoints
    save and restore, so a resumed job continues the schedule where it
    stopped. It is serialisable (`get_config`/`from_config`, registered as
    `kerasdist>WarmupSchedule`), so `model.save` and
    `keras.models.load_model` keep it.

    Args:
        base: a float (the learning rate after warmup) or a
            `keras.optimizers.schedules.LearningRateSchedule`.
        warmup_steps: number of optimizer steps of warmup (>= 0).
        initial_scale: the factor at step 0. None means `1 / size()` of the
            running job (1.0 when kerasdist is not initialised), evaluated
            when the schedule is first traced.
        name: name of the schedule.

    Raises:
        ValueError: for a negative `warmup_steps` or a scale outside (0, 1].

    Example:

    ```python
    lr = kerasdist.schedules.WarmupSchedule(
        0.01 * kerasdist.size(), warmup_steps=3 * steps_per_epoch)
    optimizer = kerasdist.DistributedOptimizer(keras.optimizers.SGD(lr))
    ```
    """

    def __init__(self, base, warmup_steps, initial_scale=None,
                 name="WarmupSchedule"):
        super().__init__()
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}.")
        if initial_scale is not None and not 0 < initial_scale <= 1:
            raise ValueError("initial_scale must be in (0, 1], got "
                             f"{initial_scale}.")
        if isinstance(base, dict):
            base = keras.optimizers.schedules.deserialize(base)
        self.base = base
        self.warmup_steps = int(warmup_steps)
        self.initial_scale = initial_scale
        self.name = name

    def _scale(self):
        if self.initial_scale is not None:
            return float(self.initial_scale)
        return 1.0 / basics.size() if basics.is_initialized() else 1.0

    def __call__(self, step):
        step = keras.ops.cast(step, "float32")
        if isinstance(self.base, _Schedule):
            base = keras.ops.cast(self.base(step), "float32")
        else:
            base = keras.ops.convert_to_tensor(float(self.base), "float32")
        if self.warmup_steps == 0:
            return base
        scale = self._scale()
        progress = keras.ops.minimum(step / float(self.warmup_steps), 1.0)
        return base * (scale + (1.0 - scale) * progress)

    def get_config(self):
        base = self.base
        if isinstance(base, _Schedule):
            base = keras.optimizers.schedules.serialize(base)
        else:
            base = float(base)
        return {"base": base, "warmup_steps": self.warmup_steps,
                "initial_scale": self.initial_scale, "name": self.name}
