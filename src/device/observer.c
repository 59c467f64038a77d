/* A device's watcher of hand-outs and frees (backend_observer, backend.h)
 * and the allocator's flag word that follows it. The device switches its
 * observer on and off; the allocator attaches its own word once, at set-up,
 * so that its fast paths read one word of their own (relaxed: it only
 * decides whether the slow paths are taken). Only bit
 * BACKEND_OBSERVER_BIT follows the observer; the allocator's other bits
 * (captures in progress) are left as they are. Both sides may live in
 * different shared objects, each with a copy of this file. */
#include "device/backend.h"

/* Sets or clears the observer's bit of the allocator's word. */
static void backend_observer_copy(_Atomic int *flag, int on) {
  if (on) atomic_fetch_or_explicit(flag, BACKEND_OBSERVER_BIT, memory_order_seq_cst);
  else atomic_fetch_and_explicit(flag, ~BACKEND_OBSERVER_BIT, memory_order_seq_cst);
}

void backend_observer_set(backend_observer *o, int on) {
  atomic_store_explicit(&o->enabled, on != 0, memory_order_seq_cst);
  _Atomic int *flag = atomic_load_explicit(&o->mirror, memory_order_seq_cst);
  if (flag != NULL) backend_observer_copy(flag, on);
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
    backend_observer_copy(flag, on);
  } while (atomic_load_explicit(&o->enabled, memory_order_seq_cst) != on);
}
