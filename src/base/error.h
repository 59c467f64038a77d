/* Error reporting: a thread-local code and message for the caller.
 * Every failing public entry point sets both before returning, so
 * magpie_last_error()/magpie_last_error_message() describe the failure in
 * words a user can act on. */
#ifndef MAGPIE_ERROR_H
#define MAGPIE_ERROR_H

#include "magpie.h"

/* Record code with a printf-style message; returns code for tail calls. */
int error_set(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Record code with magpie_error_string(code) as the message. */
int error_code(int code);
void error_clear(void);

#endif /* MAGPIE_ERROR_H */
