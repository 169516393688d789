"""kerasdist for JAX: the collectives on JAX arrays, eagerly and inside
`jax.jit`, plus the process API. Imports no TensorFlow.

    import kerasdist.jax as kd
    kd.init()
    grads = kd.grouped_allreduce(grads)          # inside a jitted step too
"""

from kerasdist import collectives as _collectives
from kerasdist._core import process_api as _process_api

# The process API, and the public collectives on JAX arrays (each name of
# `kerasdist.collectives.__all__`, bound to this framework).
# ---- names written by tools/api_names.py from the one list
from kerasdist.basics import Adasum as Adasum
from kerasdist.basics import Average as Average
from kerasdist.basics import Max as Max
from kerasdist.basics import Min as Min
from kerasdist.basics import Product as Product
from kerasdist.basics import Sum as Sum
from kerasdist.basics import cross_rank as cross_rank
from kerasdist.basics import cross_size as cross_size
from kerasdist.basics import gloo_enabled as gloo_enabled
from kerasdist.basics import init as init
from kerasdist.basics import is_homogeneous as is_homogeneous
from kerasdist.basics import is_initialized as is_initialized
from kerasdist.basics import local_rank as local_rank
from kerasdist.basics import local_size as local_size
from kerasdist.basics import mpi_enabled as mpi_enabled
from kerasdist.basics import mpi_threads_supported as mpi_threads_supported
from kerasdist.basics import rank as rank
from kerasdist.basics import shutdown as shutdown
from kerasdist.basics import size as size
from kerasdist.build_probes import ccl_built as ccl_built
from kerasdist.build_probes import cuda_built as cuda_built
from kerasdist.build_probes import ddl_built as ddl_built
from kerasdist.build_probes import gloo_built as gloo_built
from kerasdist.build_probes import mpi_built as mpi_built
from kerasdist.build_probes import nccl_built as nccl_built
from kerasdist.build_probes import rocm_built as rocm_built
from kerasdist.objects import allgather_object as allgather_object
from kerasdist.objects import broadcast_object as broadcast_object
from kerasdist.objects import broadcast_object_fn as broadcast_object_fn
from kerasdist.process_sets import ProcessSet as ProcessSet
from kerasdist.process_sets import add_process_set as add_process_set
from kerasdist.process_sets import global_process_set as global_process_set
from kerasdist.process_sets import remove_process_set as remove_process_set

_api = _collectives.bound("jax")
allgather = _api.allgather
allreduce = _api.allreduce
alltoall = _api.alltoall
barrier = _api.barrier
broadcast = _api.broadcast
broadcast_ = _api.broadcast_
broadcast_global_variables = _api.broadcast_global_variables
broadcast_variables = _api.broadcast_variables
grouped_allgather = _api.grouped_allgather
grouped_allreduce = _api.grouped_allreduce
grouped_reducescatter = _api.grouped_reducescatter
join = _api.join
local_rank_op = _api.local_rank_op
local_size_op = _api.local_size_op
process_set_included_op = _api.process_set_included_op
rank_op = _api.rank_op
reducescatter = _api.reducescatter
size_op = _api.size_op
# ---- end of the names written by tools/api_names.py

__all__ = _process_api.__all__ + _collectives.__all__
