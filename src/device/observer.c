/* A device's watcher of hand-outs and frees (backend_observer, backend.h)
 * and the allocator's flag that follows it. The device switches its
 * observer on and off; the allocator attaches its own flag once, at set-up,
 * so that its fast paths read one flag of their own (relaxed: it only
 * decides whether the observer is called). Both sides may live in
 * different shared objects, each with a copy of this file. */
#include "device/backend.h"

void backend_observer_set(backend_observer *o, int on) {
  atomic_store_explicit(&o->enabled, on != 0, memory_order_seq_cst);
  _Atomic int *flag = atomic_load_explicit(&o->mirror, memory_order_seq_cst);
  if (flag != NULL) atomic_store_explicit(flag, on != 0, memory_order_seq_cst);
}

void backend_observer_attach(backend_observer *o, _Atomic int *flag) {
  atomic_store_explicit(&o->mirror, flag, memory_order_seq_cst);
  /* A switch racing with the attach may have stored into *flag before
   * this copy: copy until the state read is still the state. All seq_cst,
   * so that a switch either sees the mirror or has its state seen here, and
   * the last store into *flag carries the last state. */
  int on;
  do {
    on = atomic_load_explicit(&o->enabled, memory_order_seq_cst);
    atomic_store_explicit(flag, on, memory_order_seq_cst);
  } while (atomic_load_explicit(&o->enabled, memory_order_seq_cst) != on);
}
