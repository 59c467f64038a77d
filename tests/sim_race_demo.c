/* The simulator's honesty under ThreadSanitizer: it must report a data race
 * exactly where CUDA would not order two accesses to device memory.
 *
 * sim_race_demo_test runs every mode and checks the outcomes below in the
 * ThreadSanitizer build (`bazel test --config=tsan //tests:sim_race_demo_test`;
 * in other builds it has nothing to check and says so). By hand:
 *
 *   clang -fsanitize=thread -g -O1 -std=c11 -D_GNU_SOURCE -Iinclude -Isrc -I. \
 *     sim/*.c src/device/detail.c src/device/observer.c \
 *     tests/sim_race_demo.c -o /tmp/sim_race_demo -lpthread
 *   for m in nowait wait event rerecord host-nosync host-record host-sync destroyed devsync; do
 *     /tmp/sim_race_demo $m; echo "$m: exit $?"; done
 *
 * Mode "tsan" exits 0 in a ThreadSanitizer build, 3 otherwise.
 *
 * (the simulator alone, on the device interface: no allocator.)
 *
 * ThreadSanitizer exits with 66 when it reported a race. Expected:
 *   nowait       race  (A and B write the buffer, nothing orders them)
 *   wait         clean (magpie_sim_stream_wait(B, A) between them)
 *   event        clean (event recorded on A, waited on by B)
 *   rerecord     race  (B waits for the event's first record; A's work after
 *                       it, captured by a second record of the same event
 *                       that completes before B's wait runs, stays unordered
 *                       with B)
 *   host-nosync  race  (the host reads what A wrote without synchronizing;
 *                       later launches, stream creation and destruction must
 *                       not order A's work before the host)
 *   host-record  race  (the host records an event on A once A's work is done
 *                       and reads without querying it: a record orders
 *                       nothing before the host)
 *   host-sync    clean (magpie_sim_stream_synchronize(A) before the read)
 *   destroyed    race  (A destroyed after its write; the handle recycled)
 *   devsync      clean (A destroyed, then magpie_sim_device_synchronize)
 */
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "magpie_sim.h"

/* Word-sized volatile writes: volatile so that the compiler keeps stores
 * nothing reads, words because ThreadSanitizer keeps only four accesses per
 * 8 bytes of memory (eight byte writes into one word can push the first
 * thread's accesses out of its history before the second thread's arrive). */
static volatile uint64_t buffer[32];

static void fill(volatile uint64_t *p, uint64_t v) {
  for (size_t i = 0; i < 32; i++) p[i] = v;
}

/* Set (relaxed: no ordering) once A's write is done, so that the host's read
 * happens after it in time without any happens-before edge. */
static atomic_int written;

static void write_a(void *arg) {
  (void)arg;
  fill(buffer, 'a');
  atomic_store_explicit(&written, 1, memory_order_relaxed);
}

static void write_b(void *arg) {
  (void)arg;
  fill(buffer, 'b');
}

static void nothing(void *arg) { (void)arg; }

static volatile uint64_t buffer2[32];
static atomic_int written2; /* relaxed, like written */

static void write2_a(void *arg) {
  (void)arg;
  fill(buffer2, 'a');
  atomic_store_explicit(&written2, 1, memory_order_relaxed);
}

static void write2_b(void *arg) {
  (void)arg;
  fill(buffer2, 'b');
}

/* Holds B back until A's second write is done (no ordering). */
static void until_written2(void *arg) {
  (void)arg;
  while (!atomic_load_explicit(&written2, memory_order_relaxed)) {
  }
}

static void wait_written(void) {
  while (!atomic_load_explicit(&written, memory_order_relaxed)) {
  }
}

#if defined(__SANITIZE_THREAD__)
#define DEMO_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define DEMO_TSAN 1
#endif
#endif
#ifndef DEMO_TSAN
#define DEMO_TSAN 0
#endif

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "nowait";
  if (strcmp(mode, "tsan") == 0) return DEMO_TSAN ? 0 : 3;
  cudaStream_t a = magpie_sim_stream_create(), b = magpie_sim_stream_create();
  if (a == NULL || b == NULL) {
    fprintf(stderr, "%s\n", magpie_sim_last_error_message());
    return 1;
  }
  magpie_sim_launch(a, write_a, NULL);
  uint64_t seen = 0;
  if (strcmp(mode, "nowait") == 0) {
    magpie_sim_launch(b, write_b, NULL);
  } else if (strcmp(mode, "wait") == 0) {
    magpie_sim_stream_wait(b, a);
    magpie_sim_launch(b, write_b, NULL);
  } else if (strcmp(mode, "event") == 0) {
    magpie_sim_event e = magpie_sim_event_create();
    magpie_sim_event_record(e, a);
    magpie_sim_stream_wait_event(b, e);
    magpie_sim_event_destroy(e);
    magpie_sim_launch(b, write_b, NULL);
  } else if (strcmp(mode, "rerecord") == 0) {
    magpie_sim_event e = magpie_sim_event_create();
    magpie_sim_event_record(e, a);
    magpie_sim_launch(b, until_written2, NULL);
    magpie_sim_stream_wait_event(b, e);
    magpie_sim_launch(a, write2_a, NULL);
    magpie_sim_event_record(e, a);
    magpie_sim_launch(b, write2_b, NULL);
    magpie_sim_event_synchronize(e);
    magpie_sim_event_destroy(e);
  } else if (strcmp(mode, "host-nosync") == 0) {
    wait_written();
    magpie_sim_launch(a, nothing, NULL);
    magpie_sim_stream_synchronize(b);
    cudaStream_t c = magpie_sim_stream_create();
    magpie_sim_stream_destroy(c);
    seen = buffer[0];
  } else if (strcmp(mode, "host-record") == 0) {
    wait_written();
    struct timespec pause = {0, 20 * 1000 * 1000}; /* A's worker finishes its node */
    nanosleep(&pause, NULL);
    magpie_sim_event e = magpie_sim_event_create();
    magpie_sim_event_record(e, a);
    seen = buffer[0];
    magpie_sim_event_synchronize(e);
    magpie_sim_event_destroy(e);
  } else if (strcmp(mode, "host-sync") == 0) {
    magpie_sim_stream_synchronize(a);
    seen = buffer[0];
  } else if (strcmp(mode, "destroyed") == 0) {
    magpie_sim_stream_destroy(a);
    wait_written();
    cudaStream_t c = magpie_sim_stream_create(); /* gets a's handle back */
    magpie_sim_launch(c, nothing, NULL);
    magpie_sim_stream_synchronize(c);
    magpie_sim_stream_destroy(c);
    seen = buffer[0];
    a = NULL;
  } else if (strcmp(mode, "devsync") == 0) {
    magpie_sim_stream_destroy(a);
    magpie_sim_device_synchronize();
    seen = buffer[0];
    a = NULL;
  } else {
    fprintf(stderr, "unknown mode %s\n", mode);
    return 2;
  }
  magpie_sim_device_synchronize();
  printf("%s: done (host saw '%c')\n", mode, seen ? (char)seen : '-');
  if (a != NULL) magpie_sim_stream_destroy(a);
  magpie_sim_stream_destroy(b);
  return 0;
}
