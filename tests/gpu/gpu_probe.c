/* The probe of gpu_backend_test: facts about the CUDA driver that magpie's
 * allocator relies on, printed as "probe: ..." lines. It runs in a child
 * process (gpu_backend_test --probe) because its last steps query destroyed
 * streams, which the driver documents as undefined behaviour: a crash there
 * is a fact to report, not a test failure. Each line is flushed before the
 * next step so the output shows how far it got.
 */
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>

#include <cuda.h>

#include "device/backend.h"
#include "tests/gpu/gpu_util.h"

static const gpu_env *penv;
static const backend_ops *pbe;

__attribute__((format(printf, 1, 2))) static void say(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("probe: ", stdout);
  vprintf(fmt, ap);
  fputc('\n', stdout);
  va_end(ap);
  fflush(stdout);
}

static const char *ctx_name(CUcontext c) {
  return c == NULL ? "none" : c == penv->ctx ? "device 0's primary context" : "another one";
}

static unsigned long long raw_id(CUstream s, CUresult *r) {
  unsigned long long id = 0;
  *r = cudrv.stream_get_id(s, &id);
  return id;
}

/* A thread that never touched CUDA: no current context. */
static void *bare_thread(void *arg) {
  (void)arg;
  CUcontext cur = NULL;
  CUresult r = cudrv.ctx_get_current(&cur);
  say("thread with no current context: cuCtxGetCurrent -> %s, context: %s", gpu_err(r), ctx_name(cur));
  struct {
    CUstream s;
    const char *name;
  } specials[] = {{NULL, "0 (legacy default)"},
                  {CU_STREAM_LEGACY, "CU_STREAM_LEGACY"},
                  {CU_STREAM_PER_THREAD, "CU_STREAM_PER_THREAD"}};
  for (int i = 0; i < 3; i++) {
    unsigned long long id = raw_id(specials[i].s, &r);
    say("thread with no current context: cuStreamGetId(%s) -> %s, id %llu", specials[i].name, gpu_err(r), id);
  }
  uint64_t bid = 0;
  int rc = pbe->stream_id(NULL, &bid);
  cudrv.ctx_get_current(&cur);
  say("thread with no current context: backend stream_id(0) -> %d, id %llu; current context "
      "afterwards: %s",
      rc, (unsigned long long)bid, ctx_name(cur));
  unsigned long long again = raw_id(NULL, &r);
  say("same thread, now bound: cuStreamGetId(0) -> %s, id %llu", gpu_err(r), again);
  return NULL;
}

static double ns_per_call(uint64_t t0, long n) { return (double)(gpu_now_ns() - t0) / n; }

static void timings(void) {
  CUstream s;
  CUevent ev;
  if (cudrv.stream_create(&s, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS ||
      cudrv.event_create(&ev, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS) {
    say("timings: could not create a stream and an event");
    return;
  }
  enum { N = 1000000, M = 100000 };
  uint64_t id = 0, sink = 0;
  unsigned long long raw = 0;
  uint64_t t0 = gpu_now_ns();
  for (long i = 0; i < N; i++) {
    pbe->stream_id(s, &id);
    sink += id;
  }
  double be_stream = ns_per_call(t0, N);
  t0 = gpu_now_ns();
  for (long i = 0; i < N; i++) {
    pbe->stream_id(NULL, &id);
    sink += id;
  }
  double be_null = ns_per_call(t0, N);
  t0 = gpu_now_ns();
  for (long i = 0; i < N; i++) {
    cudrv.stream_get_id(s, &raw);
    sink += raw;
  }
  double direct = ns_per_call(t0, N);
  t0 = gpu_now_ns();
  for (long i = 0; i < M; i++) pbe->event_record(ev, s);
  double record = ns_per_call(t0, M);
  cudrv.stream_synchronize(s);
  t0 = gpu_now_ns();
  for (long i = 0; i < M; i++) sink += (uint64_t)pbe->event_query(ev);
  double query = ns_per_call(t0, M);
  say("host ns per call: backend stream_id(stream) %.1f, stream_id(0) %.1f, cuStreamGetId "
      "direct %.1f, event_record (idle stream) %.1f, event_query (completed) %.1f [%llu]",
      be_stream, be_null, direct, record, query, (unsigned long long)(sink & 1));
  cudrv.event_destroy(ev);
  cudrv.stream_destroy(s);
}

int gpu_probe_main(const gpu_env *e) {
  penv = e;
  pbe = backend_cuda();
  if (pbe->init() != MAGPIE_OK) {
    say("backend init failed: %s", backend_error_detail());
    return 1;
  }
  /* The loader asked the driver for it (an optional entry of its table). */
  say("driver %d, device %s; cuStreamGetDevice available: %s", e->driver_version, e->name,
      cudrv.stream_get_device != NULL ? "yes" : "no");
  CUresult r;

  /* A. Special handles in a thread with no current context. */
  pthread_t t;
  if (pthread_create(&t, NULL, bare_thread, NULL) == 0) pthread_join(t, NULL);

  /* B. Special handles with the primary context current. */
  unsigned long long n0 = raw_id(NULL, &r), nl = raw_id(CU_STREAM_LEGACY, &r), np = raw_id(CU_STREAM_PER_THREAD, &r);
  say("main thread, primary context current: id(0) %llu, id(CU_STREAM_LEGACY) %llu, "
      "id(CU_STREAM_PER_THREAD) %llu; 0 and legacy %s",
      n0, nl, np, n0 == nl ? "are the same stream" : "differ");

  /* C. Handle reuse after destroying an idle stream. */
  CUstream s1, extra[64];
  if (cudrv.stream_create(&s1, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) return 1;
  unsigned long long id1 = raw_id(s1, &r);
  r = cudrv.stream_destroy(s1);
  say("idle stream %p (id %llu) destroyed -> %s", (void *)s1, id1, gpu_err(r));
  int k, reused = 0;
  for (k = 0; k < 64 && !reused; k++) {
    if (cudrv.stream_create(&extra[k], CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) break;
    reused = extra[k] == s1;
  }
  if (reused) {
    unsigned long long idn = raw_id(s1, &r);
    say("new stream number %d got the same handle value %p: cuStreamGetId -> %s, id %llu "
        "(old id %llu: %s)",
        k, (void *)s1, gpu_err(r), idn, id1, idn == id1 ? "SAME id" : "new id");
  } else {
    say("handle value %p not reused by %d new streams", (void *)s1, k);
  }
  for (int i = 0; i < k; i++) cudrv.stream_destroy(extra[i]);

  /* D. Destroying a stream with work pending; a stream reusing its handle. */
  CUstream s2, s3;
  CUevent ev2, ev3;
  if (cudrv.stream_create(&s2, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS ||
      cudrv.event_create(&ev2, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS ||
      cudrv.event_create(&ev3, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS)
    return 1;
  unsigned long long id2 = raw_id(s2, &r);
  gpu_delay(e, s2, 300u * 1000 * 1000);
  cudrv.event_record(ev2, s2);
  r = cudrv.stream_destroy(s2);
  CUresult q2 = cudrv.event_query(ev2);
  say("stream %p (id %llu) destroyed with 300 ms of work pending -> %s; its event then "
      "queries %s",
      (void *)s2, id2, gpu_err(r), gpu_err(q2));
  if (cudrv.stream_create(&s3, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) return 1;
  unsigned long long id3 = raw_id(s3, &r);
  cudrv.event_record(ev3, s3);
  CUresult q3 = cudrv.event_query(ev3);
  say("next new stream %p (%s handle), id %llu; an event recorded on it at once queries %s "
      "while the destroyed stream's work is %s",
      (void *)s3, s3 == s2 ? "SAME" : "different", id3, gpu_err(q3),
      cudrv.event_query(ev2) == CUDA_ERROR_NOT_READY ? "still pending" : "done");
  r = cudrv.event_synchronize(ev2);
  say("the destroyed stream's event: cuEventSynchronize -> %s, then query %s", gpu_err(r),
      gpu_err(cudrv.event_query(ev2)));
  cudrv.stream_destroy(s3);

  /* E. Costs. */
  timings();

  /* F. Undefined behaviour last: querying destroyed streams. */
  CUstream s4, s5;
  if (cudrv.stream_create(&s4, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS ||
      cudrv.stream_create(&s5, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS)
    return 1;
  unsigned long long id4 = raw_id(s4, &r), id5 = raw_id(s5, &r);
  cudrv.stream_destroy(s4);
  say("querying destroyed idle stream %p (id %llu), not reused, with cuStreamGetId...", (void *)s4, id4);
  unsigned long long got = raw_id(s4, &r);
  say("  -> %s, id %llu (%s)", gpu_err(r), got, r != CUDA_SUCCESS ? "error" : got == id4 ? "SAME id" : "other id");
  uint64_t bid = 0;
  int rc = pbe->stream_id(s4, &bid);
  say("  backend stream_id on it -> %d (%s)", rc, rc == MAGPIE_OK ? "ok" : backend_error_detail());
  gpu_delay(e, s5, 300u * 1000 * 1000);
  cudrv.stream_destroy(s5);
  say("querying stream %p (id %llu) destroyed with work pending, with cuStreamGetId...", (void *)s5, id5);
  got = raw_id(s5, &r);
  say("  -> %s, id %llu (%s)", gpu_err(r), got, r != CUDA_SUCCESS ? "error" : got == id5 ? "SAME id" : "other id");
  CUresult rs = cudrv.ctx_synchronize();
  got = raw_id(s5, &r);
  say("  after cuCtxSynchronize (%s): -> %s, id %llu", gpu_err(rs), gpu_err(r), got);
  cudrv.event_destroy(ev2);
  cudrv.event_destroy(ev3);
  say("done");
  return 0;
}
