/* The device layer's error detail: the reason for the last failed device
 * operation on this thread, which error messages above quote. */
#include <stdarg.h>
#include <stdio.h>

#include "device/backend.h"

static _Thread_local char tls_backend_detail[256];

const char *backend_error_detail(void) { return tls_backend_detail; }

void backend_set_error_detail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(tls_backend_detail, sizeof tls_backend_detail, fmt, ap);
  va_end(ap);
}
