"""kerasdist: fast synchronous data-parallel training for Keras 3 on TensorFlow."""
