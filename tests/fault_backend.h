/* Fault injection: a backend table that forwards every operation to
 * another backend (the simulated device in the tests) and makes the Nth
 * call of one chosen operation fail, once, as the driver would: an error
 * code and a reason in backend_error_detail(), nothing done. Test-only:
 * it lives under tests/ and wraps the table through the same entry point
 * as any backend (global_init_slow), so the library carries no fault
 * machinery. */
#ifndef MAGPIE_TESTS_FAULT_BACKEND_H
#define MAGPIE_TESTS_FAULT_BACKEND_H

#include <stdint.h>

#include "device/backend.h"

/* The operations that can be made to fail. */
enum fault_op {
  FAULT_RESERVE,
  FAULT_MAP,
  FAULT_UNMAP,
  FAULT_MEM_ALLOC,
  FAULT_MEM_FREE,
  FAULT_EVENT_CREATE,
  FAULT_EVENT_RECORD,
  FAULT_EVENT_QUERY,
  FAULT_EVENT_SYNCHRONIZE,
  FAULT_STREAM_WAIT_EVENT,
  FAULT_STREAM_ID,
  FAULT_STREAM_DEVICE,
  FAULT_DEVICE_SYNCHRONIZE,
  FAULT_OP_COUNT
};

const char *fault_op_name(int op);
/* -1 if name is not an operation. */
int fault_op_from_name(const char *name);

/* A table over `inner`. */
const backend_ops *fault_backend(const backend_ops *inner);
/* Make call number n (1-based, counted from the start of the process) of op
 * fail once; op -1 or n 0: no fault. */
void fault_arm(int op, uint64_t n);
/* Stop injecting (the armed fault, if not yet reached, never fires). */
void fault_disarm(void);
/* Calls of op so far, and whether the armed fault fired. */
uint64_t fault_calls(int op);
int fault_fired(void);

#endif
