"""WarmupSchedule: values, config round trip, saving inside a model.

One process, kerasdist not initialised (the default scale is then 1).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from kerasdist import schedules  # noqa: E402


def _values(schedule, steps):
    return np.array([float(schedule(s)) for s in steps])


def test_warmup_schedule_linear_values():
    s = schedules.WarmupSchedule(0.8, warmup_steps=4, initial_scale=0.25)
    # base * (scale + (1 - scale) * step / warmup), computed by hand.
    expected = [0.2, 0.35, 0.5, 0.65, 0.8, 0.8, 0.8]
    np.testing.assert_allclose(_values(s, range(7)), expected, rtol=1e-6)


def test_follows_base_schedule():
    base = keras.optimizers.schedules.ExponentialDecay(
        1.0, decay_steps=1, decay_rate=0.5)
    s = schedules.WarmupSchedule(base, warmup_steps=2, initial_scale=0.5)
    expected = [1.0 * 0.5, 0.5 * 0.75, 0.25, 0.125, 0.0625]
    np.testing.assert_allclose(_values(s, range(5)), expected, rtol=1e-6)


def test_default_scale_without_init_is_one_and_zero_warmup_is_base():
    assert _values(schedules.WarmupSchedule(0.3, 5), [0])[0] == \
        pytest.approx(0.3)
    assert _values(schedules.WarmupSchedule(0.3, 0, 0.1), [0])[0] == \
        pytest.approx(0.3)


def test_invalid_arguments():
    with pytest.raises(ValueError, match="warmup_steps"):
        schedules.WarmupSchedule(0.1, -1)
    with pytest.raises(ValueError, match="initial_scale"):
        schedules.WarmupSchedule(0.1, 3, initial_scale=0.0)


def test_config_round_trip_with_nested_schedule():
    base = keras.optimizers.schedules.CosineDecay(0.4, decay_steps=10)
    s = schedules.WarmupSchedule(base, 3, initial_scale=0.5, name="w")
    config = keras.optimizers.schedules.serialize(s)
    assert config["registered_name"] == "kerasdist>WarmupSchedule"
    t = keras.optimizers.schedules.deserialize(config)
    assert isinstance(t, schedules.WarmupSchedule)
    assert isinstance(t.base, keras.optimizers.schedules.CosineDecay)
    assert t.get_config() == s.get_config()
    np.testing.assert_allclose(_values(t, range(12)), _values(s, range(12)))


def test_saved_model_keeps_schedule_and_resumes_from_iterations(tmp_path):
    lr = schedules.WarmupSchedule(0.1, warmup_steps=10, initial_scale=0.1)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(lr), "mse")
    x = np.ones((8, 2), np.float32)
    model.fit(x, x[:, :1], batch_size=2, epochs=1, verbose=0)  # 4 steps
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    schedule = loaded.optimizer._learning_rate
    assert isinstance(schedule, schedules.WarmupSchedule)
    assert schedule.get_config() == lr.get_config()
    assert int(loaded.optimizer.iterations) == 4
    # 0.1 * (0.1 + 0.9 * 4 / 10): the rate at the restored step count.
    assert float(loaded.optimizer.learning_rate) == pytest.approx(0.0460)
