/* Error codes, their messages, and the thread-local last error. */
#include "base/error.h"

#include <stdarg.h>
#include <stdio.h>

static _Thread_local int tls_code;
static _Thread_local char tls_msg[512];

static const char *const error_names[MAGPIE_ERR_COUNT_] = {
    [MAGPIE_OK] = "success",
    [MAGPIE_ERR_INVALID_POINTER] = "pointer was not returned by magpie, or points inside a block",
    [MAGPIE_ERR_DOUBLE_FREE] = "block freed twice",
    [MAGPIE_ERR_SIZE_OVERFLOW] = "requested size overflows when rounded to a block size",
    [MAGPIE_ERR_OUT_OF_MEMORY] = "device out of memory",
    [MAGPIE_ERR_TOO_LARGE] = "requested size exceeds the device's total memory",
    [MAGPIE_ERR_INVALID_STREAM] = "invalid stream handle (destroyed, or of no device)",
    [MAGPIE_ERR_INVALID_ARGUMENT] = "invalid argument",
    [MAGPIE_ERR_BACKEND] = "the device driver reported an error",
    [MAGPIE_ERR_NO_DEVICE] = "no device available for the selected backend",
    [MAGPIE_ERR_CONFIG] = "invalid configuration",
    [MAGPIE_ERR_ALREADY_INITIALIZED] = "magpie is already initialised",
    [MAGPIE_ERR_CAPTURE] = "not permitted while a stream captures a CUDA graph",
    [MAGPIE_ERR_IPC] = "the shared block cannot be served or opened",
    [MAGPIE_ERR_NO_PEER_ACCESS] = "the devices cannot access each other's memory",
};

MAGPIE_API const char *magpie_error_string(int code) {
  if (code < 0 || code >= MAGPIE_ERR_COUNT_ || error_names[code] == NULL) return "unknown magpie error code";
  return error_names[code];
}

int error_set(int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(tls_msg, sizeof tls_msg, fmt, ap);
  va_end(ap);
  tls_code = code;
  return code;
}

int error_code(int code) { return error_set(code, "%s", magpie_error_string(code)); }

void error_clear(void) {
  tls_code = MAGPIE_OK;
  tls_msg[0] = '\0';
}

MAGPIE_API int magpie_last_error(void) { return tls_code; }

MAGPIE_API const char *magpie_last_error_message(void) { return tls_code == MAGPIE_OK ? "success" : tls_msg; }
