/* See observe.h. */
#include "front/observe.h"

#include "front/global.h"

/* The attached observer and the switch are observe_hooks (this file's) and
 * front_st.slow_paths' observer bit (front/global.h): stored (release) at
 * set-up before the switch can follow the observer; loaded (acquire) by the
 * hooks. */
static _Atomic(backend_observer *) observe_hooks;

void observe_install(const backend_ops *ops, int on) {
  backend_observer *o = ops->observer;
  if (o == NULL) return;
  atomic_store_explicit(&observe_hooks, o, memory_order_release);
  backend_observer_attach(o, &front_st.slow_paths);
  if (on) backend_observer_set(o, 1);
}

void observe_handout(void *p, size_t size, cudaStream_t stream) {
  backend_observer *o = atomic_load_explicit(&observe_hooks, memory_order_acquire);
  if (o != NULL) o->on_handout(p, size, stream);
}

void observe_free(void *p, cudaStream_t stream) {
  backend_observer *o = atomic_load_explicit(&observe_hooks, memory_order_acquire);
  if (o != NULL) o->on_free(p, stream);
}

void observe_record(void *p, cudaStream_t stream) {
  backend_observer *o = atomic_load_explicit(&observe_hooks, memory_order_acquire);
  if (o != NULL && o->on_record != NULL) o->on_record(p, stream);
}
