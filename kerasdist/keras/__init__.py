"""The Keras layer: what kerasdist does inside a Keras program, written
once for every Keras backend.

- `distributed_optimizer`: `kerasdist.DistributedOptimizer()` and
  `PartialDistributedOptimizer()`, which check the arguments and combine
  a step with the user's optimizer class;
- `optimizer`: the classes: what both modes share (`DistributedBase`) and
  the replicated step, which reduces the gradients in `apply`;
- `reduction`: the gradient reduction, written once (arguments, the plan
  of buckets or groups, names and scales, its execution, local
  variables, accumulation);
- `buckets`: the bucket assignment, a pure function; `reduced`: the
  gradients a DistributedGradientTape reduced already, by identity;
- `framework`: the seam, the running backend's `KerasFramework` (from
  `kerasdist/<framework>/_keras_layer.py`), chosen once;
- `sharding/`: the sharded optimizer (`shard=`): layout, step, the
  sharded step's class (the replicated step's sibling), shard files;
- `elastic_fit`: `kerasdist.elastic.ElasticBatches` and `CommitCallback`
  (`model.fit` recovering in place), with `elastic_schedule`, the order
  of the examples at any size, a pure function;
- `compression`, `sync_batch_norm`, `saving`: `kerasdist.Compression`,
  `kerasdist.SyncBatchNormalization`, `kerasdist.save_model` and
  `load_model`.

The public names live in `kerasdist` (and `kerasdist.tensorflow`...);
nothing here is imported until one of them is used.
"""
