"""Support code for the tests: launch helpers, the worker check harness,
the test-host cluster, host collectives. Never imports TensorFlow."""
