/* Which locks a program's operations take, and how often: an LD_PRELOAD
 * library counting pthread_mutex_lock / pthread_mutex_trylock calls and
 * sem_post calls (the simulated device's stream wake-ups, one per event
 * recorded on an idle stream) by call site. At exit it prints the busiest
 * sites to stderr: count, the calling function where the dynamic symbol
 * table names it, and module + offset for addr2line otherwise.
 *
 *   LD_PRELOAD=bazel-bin/bench/liblockcount.so PROGRAM ...
 *   addr2line -f -e MODULE OFFSET     (a site's function and line)
 *
 * LOCKCOUNT_TOP (default 30) sets how many sites are printed. The counts
 * are of calls, contended or not; of a mutex lock's calls, those that
 * found it held (a try first) and the time they waited for it are counted
 * too. A site is the return address, so a helper that wraps the lock
 * shows as one site. */

#include <dlfcn.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define LC_SLOTS 8192 /* power of two; sites past this many are counted as "other" */

typedef struct lc_site {
  _Atomic uintptr_t addr; /* 0: free; set once by compare-and-swap */
  _Atomic uint64_t count;
  _Atomic int kind;           /* 0 mutex lock, 1 trylock, 2 sem_post */
  _Atomic uint64_t contended; /* mutex locks that found it held */
  _Atomic uint64_t waited_ns; /* their time in the blocking lock */
} lc_site;

static lc_site lc_sites[LC_SLOTS];
static _Atomic uint64_t lc_other;
static int (*real_lock)(pthread_mutex_t *);
static int (*real_trylock)(pthread_mutex_t *);
static int (*real_sem_post)(sem_t *);

static lc_site *lc_count(uintptr_t addr, int kind) {
  uintptr_t h = (addr * 0x9E3779B97F4A7C15ull) >> 51; /* 13 bits */
  for (unsigned i = 0; i < 64; i++) {
    lc_site *s = &lc_sites[(h + i) & (LC_SLOTS - 1)];
    uintptr_t a = atomic_load_explicit(&s->addr, memory_order_acquire);
    if (a == 0) {
      uintptr_t zero = 0;
      if (atomic_compare_exchange_strong_explicit(&s->addr, &zero, addr, memory_order_acq_rel, memory_order_acquire)) {
        atomic_store_explicit(&s->kind, kind, memory_order_relaxed);
        a = addr;
      } else {
        a = zero;
      }
    }
    if (a == addr) {
      atomic_fetch_add_explicit(&s->count, 1, memory_order_relaxed);
      return s;
    }
  }
  atomic_fetch_add_explicit(&lc_other, 1, memory_order_relaxed);
  return NULL;
}

static uint64_t lc_now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

int pthread_mutex_lock(pthread_mutex_t *m) {
  if (real_lock == NULL) real_lock = (int (*)(pthread_mutex_t *))dlsym(RTLD_NEXT, "pthread_mutex_lock");
  if (real_trylock == NULL) real_trylock = (int (*)(pthread_mutex_t *))dlsym(RTLD_NEXT, "pthread_mutex_trylock");
  lc_site *s = lc_count((uintptr_t)__builtin_return_address(0), 0);
  if (real_trylock(m) == 0) return 0;
  uint64_t t0 = lc_now_ns();
  int rc = real_lock(m);
  if (s != NULL) {
    atomic_fetch_add_explicit(&s->contended, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&s->waited_ns, lc_now_ns() - t0, memory_order_relaxed);
  }
  return rc;
}

int pthread_mutex_trylock(pthread_mutex_t *m) {
  if (real_trylock == NULL) real_trylock = (int (*)(pthread_mutex_t *))dlsym(RTLD_NEXT, "pthread_mutex_trylock");
  lc_count((uintptr_t)__builtin_return_address(0), 1);
  return real_trylock(m);
}

int sem_post(sem_t *s) {
  if (real_sem_post == NULL) real_sem_post = (int (*)(sem_t *))dlsym(RTLD_NEXT, "sem_post");
  lc_count((uintptr_t)__builtin_return_address(0), 2);
  return real_sem_post(s);
}

static int lc_cmp(const void *a, const void *b) {
  uint64_t x = atomic_load_explicit(&((const lc_site *)a)->count, memory_order_relaxed);
  uint64_t y = atomic_load_explicit(&((const lc_site *)b)->count, memory_order_relaxed);
  return x < y ? 1 : x > y ? -1 : 0;
}

__attribute__((destructor)) static void lc_report(void) {
  static lc_site copy[LC_SLOTS];
  uint64_t total = 0;
  for (unsigned i = 0; i < LC_SLOTS; i++) {
    atomic_store_explicit(&copy[i].addr, atomic_load_explicit(&lc_sites[i].addr, memory_order_acquire),
                          memory_order_relaxed);
    atomic_store_explicit(&copy[i].count, atomic_load_explicit(&lc_sites[i].count, memory_order_relaxed),
                          memory_order_relaxed);
    atomic_store_explicit(&copy[i].kind, atomic_load_explicit(&lc_sites[i].kind, memory_order_relaxed),
                          memory_order_relaxed);
    atomic_store_explicit(&copy[i].contended, atomic_load_explicit(&lc_sites[i].contended, memory_order_relaxed),
                          memory_order_relaxed);
    atomic_store_explicit(&copy[i].waited_ns, atomic_load_explicit(&lc_sites[i].waited_ns, memory_order_relaxed),
                          memory_order_relaxed);
    total += atomic_load_explicit(&copy[i].count, memory_order_relaxed);
  }
  qsort(copy, LC_SLOTS, sizeof copy[0], lc_cmp);
  const char *env = getenv("LOCKCOUNT_TOP");
  int top = env != NULL ? atoi(env) : 30;
  static const char *kinds[] = {"lock", "trylock", "sem_post"};
  fprintf(stderr, "lockcount: %llu calls in all (%llu at sites past the table)\n", (unsigned long long)total,
          (unsigned long long)atomic_load_explicit(&lc_other, memory_order_relaxed));
  for (int i = 0; i < top && i < LC_SLOTS; i++) {
    uint64_t n = atomic_load_explicit(&copy[i].count, memory_order_relaxed);
    if (n == 0) break;
    uintptr_t a = atomic_load_explicit(&copy[i].addr, memory_order_relaxed);
    Dl_info info = {0};
    int found = dladdr((void *)a, &info);
    fprintf(stderr, "lockcount: %12llu %10llu %10.1f  %-8s %s  %s+0x%lx\n", (unsigned long long)n,
            (unsigned long long)atomic_load_explicit(&copy[i].contended, memory_order_relaxed),
            (double)atomic_load_explicit(&copy[i].waited_ns, memory_order_relaxed) / 1e6,
            kinds[atomic_load_explicit(&copy[i].kind, memory_order_relaxed)],
            found && info.dli_sname != NULL ? info.dli_sname : "?", found && info.dli_fname ? info.dli_fname : "?",
            found ? (unsigned long)(a - (uintptr_t)info.dli_fbase) : (unsigned long)a);
  }
}
