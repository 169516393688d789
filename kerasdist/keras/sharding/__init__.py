"""The sharded optimizer (`DistributedOptimizer(opt, shard=...)`, ZeRO-1/2),
split by job: `layout` (the pure partition: which elements of each
variable each rank owns), `step` (one step's reduce-scatter into the
shards and allgather back), `optimizer` (the optimizer class, and what
other modules ask of a sharded optimizer), `files` (the shards in
checkpoint files, read back at any size); and the sharded weights
(`shard_weights`, ZeRO-3): `weights` (sharding a model's weights),
`views` (the whole views the layers read), `loading` (loading by
slices). Each is imported directly."""
