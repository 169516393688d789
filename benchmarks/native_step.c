/* One W2 step through the runtime's C API, with no Python or TensorFlow per
 * tensor: enqueue COUNT float32 Sum allreduces, then wait for all of them.
 * fusion.py compiles this file with the system C compiler and calls it once
 * per timed step through ctypes, so the row it prints is the runtime's own
 * cost (negotiation, fusion, the reduction, completion). */
#include <stdint.h>
#include <string.h>

#include "c_api.h"

/* Returns 0, or -1 with kerasdist_last_error() / the handle's message. */
int kd_native_step(int count, const char* const* names, void* const* in,
                   void* const* out, int64_t elems, int64_t* handles) {
  const int64_t shape[1] = {elems};
  for (int i = 0; i < count; ++i) {
    kerasdist_request q;
    memset(&q, 0, sizeof(q));
    q.name = names[i];
    q.op = 0;        /* allreduce */
    q.reduce_op = 1; /* sum */
    q.dtype = 2;     /* float32 */
    q.ndim = 1;
    q.shape = shape;
    q.prescale = 1.0;
    q.postscale = 1.0;
    q.device = -1;
    handles[i] = kerasdist_enqueue(&q, in[i], out[i]);
    if (handles[i] == 0) {
      for (int j = 0; j < i; ++j) {
        kerasdist_wait(handles[j], 120.0);
        kerasdist_release(handles[j]);
      }
      return -1;
    }
  }
  int rc = 0;
  for (int i = 0; i < count; ++i) {
    if (kerasdist_wait(handles[i], 120.0) != 1 ||
        kerasdist_handle_status(handles[i]) != 0) {
      rc = -1;
    }
    kerasdist_release(handles[i]);
  }
  return rc;
}
