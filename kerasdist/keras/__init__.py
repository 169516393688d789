"""The Keras layer: what kerasdist does inside a Keras program, written
once for every Keras backend.

- `optimizer`: DistributedOptimizer (`kerasdist.DistributedOptimizer`),
  which reduces the gradients in `apply`;
- `reduction`: the gradient reduction, written once (arguments, buckets
  and groups, names, scales, local variables, accumulation);
- `buckets`: the bucket assignment, a pure function; `reduced`: the
  gradients a DistributedGradientTape reduced already, by identity;
- `framework`: the seam, the running backend's `KerasFramework` (from
  `kerasdist/<framework>/_keras_layer.py`), chosen once;
- `sharding/`: the sharded optimizer (`shard=`): layout, step, optimizer
  class, shard files;
- `compression`, `sync_batch_norm`, `saving`: `kerasdist.Compression`,
  `kerasdist.SyncBatchNormalization`, `kerasdist.save_model` and
  `load_model`.

The public names live in `kerasdist` (and `kerasdist.tensorflow`...);
nothing here is imported until one of them is used.
"""
