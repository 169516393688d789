"""Keras' backend as Keras will choose it, read without importing Keras
(standard library only): for `kd.init()` and `kerasdist doctor`."""

import json
import os


def active_backend(environ):
    """(backend, where it comes from) as Keras will choose it:
    KERAS_BACKEND, else keras.json's "backend", else TensorFlow."""
    name = environ.get("KERAS_BACKEND")
    if name:
        return name, "KERAS_BACKEND"
    home = environ.get("KERAS_HOME") or os.path.join(
        os.path.expanduser("~"), ".keras")
    path = os.path.join(home, "keras.json")
    try:
        with open(path) as f:
            name = json.load(f).get("backend")
    except (OSError, ValueError, AttributeError):
        name = None
    if name:
        return name, path
    return "tensorflow", "Keras' default"
