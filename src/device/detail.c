/* The device layer's error detail: the reason for the last failed device
 * operation on this thread, which error messages above quote. A device
 * implemented in another shared object (libmagpie_sim.so) has its own copy
 * of this file; adopting its table (backend_use_error_detail) makes both
 * copies read and write that device's buffer, so a message quotes the
 * latest failure whichever side set it. */
#include <stdarg.h>
#include <stdio.h>

#include "device/backend.h"

static _Thread_local char tls_backend_detail[BACKEND_DETAIL_LEN];

/* Written at set-up, under the allocator's init lock, before any failure
 * it should cover; read relaxed (a function pointer, no data behind it). */
static char *(*_Atomic backend_detail_source)(void);

char *backend_local_error_detail(void) { return tls_backend_detail; }

static char *backend_detail_buffer(void) {
  char *(*source)(void) = atomic_load_explicit(&backend_detail_source, memory_order_relaxed);
  return source != NULL ? source() : tls_backend_detail;
}

const char *backend_error_detail(void) { return backend_detail_buffer(); }

void backend_use_error_detail(char *(*source)(void)) {
  atomic_store_explicit(&backend_detail_source, source, memory_order_relaxed);
}

void backend_set_error_detail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(backend_detail_buffer(), BACKEND_DETAIL_LEN, fmt, ap);
  va_end(ap);
}
