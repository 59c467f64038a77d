// Model checking of magpie's lock-free core with Relacy (Debian relacy-dev):
// every interleaving (full search) or many random ones, under the C++11 /
// C11 memory model, with data-race detection on plain data.
//
// What is checked (each model mirrors the code named, operation for
// operation and memory order for memory order):
//   stack_tagged   src/base/stack.c: push and pop of a tagged Treiber stack of
//                  type-stable nodes (src/base/registry.h: a stale index still
//                  names readable memory). Three threads each pop a node,
//                  write its payload (plain data: a race is an error), and
//                  push it back, twice, while a node is popped and pushed
//                  back under a stalled popper: the ABA case. Invariants: a
//                  node is never held by two threads, nothing is lost or
//                  duplicated (all nodes back at the end), no data race.
//   stack_untagged The same stack without the tag (negative control): the
//                  checker must find the ABA corruption.
//   epoch          src/pool/epoch.c: a stream completes work (plain writes to
//                  two blocks) then its events 1 and 2 in order (release);
//                  host threads decide "ready" as epoch_ready does (acquire
//                  load of done; else an acquire event query that, on
//                  success, raises done with a release CAS-max) and then
//                  reuse the block (plain write). One host reuses block 2
//                  through ticket 2, another block 1 through ticket 1 (in
//                  some interleavings vouched for by done = 2 alone, with no
//                  query of event 1). Invariant: no data race between the
//                  stream's use and a reuse, i.e. every "ready" is a
//                  happens-before edge.
//   epoch_relaxed  The same with the event query relaxed (negative
//                  control): the checker must report the race.
// Bounds: 3 threads, at most 2 operations each, 3 nodes. The epoch models
// are searched exhaustively (every interleaving and every value the memory
// model allows a load to read). The tagged stack is searched exhaustively
// up to Relacy's default context bound (preemptions per execution), then
// with 10^6 random schedules; its unbounded state space is too large for CI.
// A run takes a few seconds.
//
// Usage: lockfree_model            run all; exit 0 iff the correct models
//                                  pass and both negative controls fail.
#include <relacy/relacy.hpp>

#include <cstdio>
#include <cstring>

// ---------------------------------------------------------------- stack

static const unsigned NODES = 3; // indices 1..3 (0 = none)

template <bool Tagged>
struct stack_model : rl::test_suite<stack_model<Tagged>, 3> {
  rl::atomic<unsigned long long> head;  // (tag << 32) | index
  rl::atomic<unsigned> next[NODES + 1]; // registry_link.next
  rl::var<int> payload[NODES + 1];      // the node's contents
  rl::atomic<int> owner[NODES + 1];     // checking only: who holds it

  static unsigned long long make(unsigned long long tag, unsigned idx) { return Tagged ? ((tag << 32) | idx) : idx; }

  void before() {
    // Stack 1 -> 2 -> 3.
    for (unsigned i = 1; i <= NODES; i++) {
      next[i]($).store(i < NODES ? i + 1 : 0, rl::mo_relaxed);
      payload[i]($) = 0;
      owner[i]($).store(0, rl::mo_relaxed);
    }
    head($).store(make(0, 1), rl::mo_relaxed);
  }

  void push(unsigned idx) {
    unsigned long long old = head($).load(rl::mo_relaxed), neu;
    do {
      next[idx]($).store((unsigned)old, rl::mo_relaxed);
      neu = make((old >> 32) + 1, idx);
    } while (!head($).compare_exchange_weak(old, neu, rl::mo_acq_rel, rl::mo_acquire));
  }

  unsigned pop() {
    unsigned long long old = head($).load(rl::mo_acquire);
    for (;;) {
      unsigned top = (unsigned)old;
      if (top == 0) return 0;
      unsigned nx = next[top]($).load(rl::mo_relaxed);
      if (head($).compare_exchange_weak(old, make((old >> 32) + 1, nx), rl::mo_acq_rel, rl::mo_acquire)) return top;
    }
  }

  void thread(unsigned t) {
    for (int round = 0; round < 2; round++) {
      unsigned n = pop();
      if (n == 0) continue;
      int prev = owner[n]($).exchange((int)t + 1, rl::mo_relaxed);
      RL_ASSERT(prev == 0);   // never held twice
      payload[n]($) = (int)t; // plain write: a race here is a bug
      owner[n]($).store(0, rl::mo_relaxed);
      push(n);
    }
  }

  void after() {
    // Every node is back exactly once.
    unsigned seen = 0, count = 0;
    unsigned i = (unsigned)head($).load(rl::mo_relaxed);
    while (i != 0 && count <= NODES) {
      RL_ASSERT(i <= NODES);
      RL_ASSERT((seen & (1u << i)) == 0);
      seen |= 1u << i;
      count++;
      i = next[i]($).load(rl::mo_relaxed);
    }
    RL_ASSERT(count == NODES);
  }
};

// ---------------------------------------------------------------- epoch

template <bool AcquireQuery>
struct epoch_model : rl::test_suite<epoch_model<AcquireQuery>, 3> {
  rl::atomic<int> ev[3];               // event seq -> completed (cuEventQuery)
  rl::atomic<unsigned long long> done; // stream_rec.done
  rl::var<int> block[3];               // device memory of two blocks

  void before() {
    ev[1]($).store(0, rl::mo_relaxed);
    ev[2]($).store(0, rl::mo_relaxed);
    done($).store(0, rl::mo_relaxed);
    block[1]($) = 0;
    block[2]($) = 0;
  }

  // atomic_max_u64_release (src/base/atomic.h)
  void max_release(unsigned long long v) {
    unsigned long long cur = done($).load(rl::mo_relaxed);
    while (cur < v && !done($).compare_exchange_weak(cur, v, rl::mo_release, rl::mo_relaxed)) {
    }
  }

  // epoch_ready for a ticket of another stream
  bool ready(unsigned long long seq) {
    if (done($).load(rl::mo_acquire) >= seq) return true;
    rl::memory_order q = AcquireQuery ? rl::mo_acquire : rl::mo_relaxed;
    if (ev[seq]($).load(q) == 1) {
      max_release(seq);
      return true;
    }
    return false;
  }

  void thread(unsigned t) {
    switch (t) {
    case 0: // the stream: uses of blocks 1 and 2, each sealed by an event
      block[1]($) = 1;
      ev[1]($).store(1, rl::mo_release);
      block[2]($) = 2;
      ev[2]($).store(1, rl::mo_release);
      break;
    case 1: // reuses block 2 through ticket 2 (raising done to 2)
      if (ready(2)) block[2]($) = 20;
      break;
    case 2: // reuses block 1 through ticket 1 (maybe vouched by done = 2)
      if (ready(1)) block[1]($) = 10;
      break;
    }
  }
};

// ---------------------------------------------------------------- driver

template <typename Model>
static bool run(const char *name, bool expect_pass, rl::scheduler_type_e sched, unsigned iterations) {
  rl::test_params p;
  p.search_type = sched;
  p.iteration_count = iterations;
  p.output_history = false;
  std::printf("=== %s (%s, %s)\n", name,
              sched == rl::sched_full    ? "full search"
              : sched == rl::sched_bound ? "every schedule within the context bound"
                                         : "random schedules",
              expect_pass ? "must pass" : "negative control: must fail");
  std::fflush(stdout);
  bool ok = rl::simulate<Model>(p);
  bool good = ok == expect_pass;
  std::printf("--- %s: %s (%s)\n", name, ok ? "no error found" : "error found", good ? "as expected" : "UNEXPECTED");
  std::fflush(stdout);
  return good;
}

int main() {
  bool good = true;
  good &= run<stack_model<true> >("stack_tagged", true, rl::sched_bound, 0);
  good &= run<stack_model<true> >("stack_tagged", true, rl::sched_random, 1000000);
  good &= run<stack_model<false> >("stack_untagged", false, rl::sched_random, 200000);
  good &= run<epoch_model<true> >("epoch", true, rl::sched_full, 0);
  good &= run<epoch_model<false> >("epoch_relaxed", false, rl::sched_full, 0);
  std::printf(good ? "[  PASSED  ] 5 test(s).\n" : "[  FAILED  ] 1 test(s).\n");
  return good ? 0 : 1;
}
