"""The rendezvous: one MPI job formed from processes that someone else
started, and the rank's side of every start.

A platform (torchrun, Kubernetes, Keras' distribution variables) starts N
processes and tells each its rank, N and a coordinator's host:port
(`conventions`, which `kd.init()` reads first). MPI cannot join such
processes by itself: started without a launcher, each would be a job of
one. What a launcher gives MPICH is a PMI server; here rank 0 starts one
(`server`, with its hello barrier in `hello` and MPICH's PMI-1 commands in
`pmi`) and every rank says hello to it before `MPI_Init` (`client.join`),
which returns the variables MPI_Init reads. Each hello's connection then
stays open while the job starts (`watch`), so that a rank lost before
every `kd.init()` finished ends the others with one line instead of a
hang. `protocol` holds what server and clients share: the job's identity
and key, the proofs, the line format.

Used by `kd.init()` (kerasdist/basics.py) and by the launcher
(`kerasdist run --nnodes`, kerasdist/run/). Standard library only, no
other kerasdist module (tests/unit/test_import_direction.py): the server
runs as a script of its own (server.py's note).
"""
