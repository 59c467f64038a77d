/* magpie's RMM memory resource (include/magpie_rmm.hpp) on the simulated
 * device, against RMM 26.10's headers and librmm.so from its PyPI wheel
 * (fetched by tools/install_deps.sh; the test exists where they are, see
 * tests/BUILD). RMM's own test suite runs the resource on a GPU
 * (integrations/rmm/); this test checks, without one, what the resource
 * adds to magpie: streams passed through, alignments above 256 bytes,
 * errors turned into RMM's exceptions, misuse reported without harm, and
 * RMM's adaptors over it. The synchronous calls use the CUDA runtime and
 * are left to the GPU. */
#include <magpie_rmm.hpp>
#include <rmm/mr/aligned_resource_adaptor.hpp>
#include <rmm/mr/limiting_resource_adaptor.hpp>
#include <rmm/mr/statistics_resource_adaptor.hpp>
#include <rmm/mr/tracking_resource_adaptor.hpp>
#include <rmm/resource_ref.hpp>

#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <setjmp.h>
#include <string>

extern "C" {
#include <cmocka.h>

#include "magpie_sim.h"
}

namespace {

cudaStream_t stream_a, stream_b;

size_t in_use() {
  magpie_stats s;
  assert_int_equal(magpie_stats_get(0, &s), MAGPIE_OK);
  return s.in_use_bytes;
}

int setup(void **) {
  stream_a = magpie_sim_stream_create();
  stream_b = magpie_sim_stream_create();
  return stream_a != nullptr && stream_b != nullptr ? 0 : -1;
}

int teardown(void **) {
  magpie_sim_device_synchronize();
  magpie_sim_stream_destroy(stream_a);
  magpie_sim_stream_destroy(stream_b);
  return 0;
}

/* Allocations reach magpie on the stream RMM passes: a block freed on a
 * stream serves that stream's next request of its size at once. */
void test_stream_passed_through(void **) {
  magpie::rmm_memory_resource mr;
  rmm::device_async_resource_ref ref{mr};
  size_t before = in_use();
  void *p = ref.allocate(cuda::stream_ref{stream_a}, 1000, rmm::CUDA_ALLOCATION_ALIGNMENT);
  assert_non_null(p);
  assert_int_equal(reinterpret_cast<uintptr_t>(p) % 256, 0);
  size_t size = 0;
  int device = -1;
  assert_int_equal(magpie_block_info(p, &size, &device), MAGPIE_OK);
  assert_true(size >= 1000);
  assert_int_equal(device, 0);
  assert_true(in_use() >= before + 1000);
  ref.deallocate(cuda::stream_ref{stream_a}, p, 1000, rmm::CUDA_ALLOCATION_ALIGNMENT);
  assert_int_equal(in_use(), before);
  /* Another stream does not get it (its slot is another stream's), the
   * same stream does. With the streams lost on the way (every call on
   * stream 0, say) both would. */
  void *other = ref.allocate(cuda::stream_ref{stream_b}, 1000, rmm::CUDA_ALLOCATION_ALIGNMENT);
  assert_ptr_not_equal(other, p);
  void *q = ref.allocate(cuda::stream_ref{stream_a}, 1000, rmm::CUDA_ALLOCATION_ALIGNMENT);
  assert_ptr_equal(q, p);
  ref.deallocate(cuda::stream_ref{stream_a}, q, 1000, rmm::CUDA_ALLOCATION_ALIGNMENT);
  ref.deallocate(cuda::stream_ref{stream_b}, other, 1000, rmm::CUDA_ALLOCATION_ALIGNMENT);
  /* Zero bytes: a unique, freeable block, as RMM's tests expect. */
  void *z = ref.allocate(cuda::stream_ref{stream_b}, 0, rmm::CUDA_ALLOCATION_ALIGNMENT);
  assert_non_null(z);
  ref.deallocate(cuda::stream_ref{stream_b}, z, 0, rmm::CUDA_ALLOCATION_ALIGNMENT);
  assert_int_equal(in_use(), before);
}

/* Alignments above 256 bytes: aligned addresses inside blocks large
 * enough, distinct, and given back whole. */
void test_alignment(void **) {
  magpie::rmm_memory_resource mr;
  size_t before = in_use();
  const size_t aligns[] = {512, 4096, 65536, size_t(2) << 20};
  const size_t sizes[] = {1, 3000, 100000, size_t(3) << 20};
  for (size_t a : aligns) {
    for (size_t n : sizes) {
      void *p = mr.allocate(cuda::stream_ref{stream_a}, n, a);
      void *q = mr.allocate(cuda::stream_ref{stream_a}, n, a);
      assert_int_equal(reinterpret_cast<uintptr_t>(p) % a, 0);
      assert_int_equal(reinterpret_cast<uintptr_t>(q) % a, 0);
      assert_ptr_not_equal(p, q);
      uintptr_t lo = reinterpret_cast<uintptr_t>(p) < reinterpret_cast<uintptr_t>(q) ? reinterpret_cast<uintptr_t>(p)
                                                                                     : reinterpret_cast<uintptr_t>(q);
      uintptr_t hi =
          lo == reinterpret_cast<uintptr_t>(p) ? reinterpret_cast<uintptr_t>(q) : reinterpret_cast<uintptr_t>(p);
      assert_true(lo + n <= hi); /* the two ranges do not overlap */
      mr.deallocate(cuda::stream_ref{stream_a}, q, n, a);
      mr.deallocate(cuda::stream_ref{stream_a}, p, n, a);
      assert_int_equal(in_use(), before);
    }
  }
  /* Not a power of two: RMM's logic_error, nothing allocated. */
  for (size_t a : {size_t(384), size_t(3000), size_t(0)}) {
    bool threw = false;
    try {
      (void)mr.allocate(cuda::stream_ref{stream_a}, 4096, a);
    } catch (rmm::logic_error const &e) {
      threw = std::strstr(e.what(), "power of two") != nullptr;
    }
    assert_true(threw);
  }
  assert_int_equal(in_use(), before);
}

/* More than the device: rmm::out_of_memory with RMM's marker and magpie's
 * account of where the memory is. */
void test_out_of_memory(void **) {
  magpie::rmm_memory_resource mr;
  rmm::device_async_resource_ref ref{mr};
  const size_t sizes[] = {size_t(1) << 30, size_t(1) << 50, SIZE_MAX - 100};
  for (size_t n : sizes) {
    bool threw = false;
    void *p = nullptr;
    try {
      p = ref.allocate(cuda::stream_ref{stream_a}, n, rmm::CUDA_ALLOCATION_ALIGNMENT);
    } catch (rmm::out_of_memory const &e) {
      std::string what = e.what();
      threw = what.find("out_of_memory") != std::string::npos && what.find("magpie: allocating") != std::string::npos;
      if (!threw) print_error("unexpected message: %s\n", e.what());
    }
    assert_null(p);
    assert_true(threw);
  }
  /* The same through the aligned path. */
  bool threw = false;
  try {
    (void)mr.allocate(cuda::stream_ref{stream_a}, size_t(1) << 30, 4096);
  } catch (rmm::out_of_memory const &) {
    threw = true;
  }
  assert_true(threw);
}

/* Misuse RMM's noexcept deallocate cannot report by throwing: the block
 * stays where it is and magpie's message goes to stderr. */
void test_bad_deallocate(void **) {
  magpie::rmm_memory_resource mr;
  size_t before = in_use();
  void *p = mr.allocate(cuda::stream_ref{stream_a}, 8192, 4096);
  size_t held = in_use();
  /* An aligned address no allocation at that alignment returned. */
  mr.deallocate(cuda::stream_ref{stream_a}, static_cast<char *>(p) + 4096, 100, 4096);
  /* An interior address at magpie's own alignment. */
  mr.deallocate(cuda::stream_ref{stream_a}, static_cast<char *>(p) + 256, 100, 256);
  /* Memory magpie never handed out. */
  static char host[512];
  mr.deallocate(cuda::stream_ref{stream_a}, host, sizeof host, 256);
  assert_int_equal(in_use(), held);
  mr.deallocate(cuda::stream_ref{stream_a}, p, 8192, 4096);
  assert_int_equal(in_use(), before);
  /* The same block twice at its alignment: the second finds no entry. */
  mr.deallocate(cuda::stream_ref{stream_a}, p, 8192, 4096);
  assert_int_equal(in_use(), before);
}

/* RMM's adaptors over magpie: statistics, tracking, a limit, alignment. */
void test_adaptors(void **) {
  magpie::rmm_memory_resource mr;
  size_t before = in_use();
  {
    rmm::mr::statistics_resource_adaptor stats{mr};
    void *p = stats.allocate(cuda::stream_ref{stream_a}, 5000, rmm::CUDA_ALLOCATION_ALIGNMENT);
    void *q = stats.allocate(cuda::stream_ref{stream_b}, 70000, rmm::CUDA_ALLOCATION_ALIGNMENT);
    auto bytes = stats.get_bytes_counter();
    assert_int_equal(bytes.value, 75000);
    assert_int_equal(stats.get_allocations_counter().value, 2);
    stats.deallocate(cuda::stream_ref{stream_a}, p, 5000, rmm::CUDA_ALLOCATION_ALIGNMENT);
    stats.deallocate(cuda::stream_ref{stream_b}, q, 70000, rmm::CUDA_ALLOCATION_ALIGNMENT);
    assert_int_equal(stats.get_bytes_counter().value, 0);
    assert_int_equal(stats.get_bytes_counter().peak, 75000);
  }
  {
    rmm::mr::tracking_resource_adaptor track{mr};
    void *p = track.allocate(cuda::stream_ref{stream_a}, 1 << 20, rmm::CUDA_ALLOCATION_ALIGNMENT);
    assert_int_equal(track.get_outstanding_allocations().size(), 1);
    assert_int_equal(track.get_allocated_bytes(), 1 << 20);
    track.deallocate(cuda::stream_ref{stream_a}, p, 1 << 20, rmm::CUDA_ALLOCATION_ALIGNMENT);
    assert_int_equal(track.get_outstanding_allocations().size(), 0);
  }
  {
    rmm::mr::limiting_resource_adaptor limit{mr, 1 << 20};
    void *p = limit.allocate(cuda::stream_ref{stream_a}, 768 << 10, rmm::CUDA_ALLOCATION_ALIGNMENT);
    bool threw = false;
    try {
      (void)limit.allocate(cuda::stream_ref{stream_a}, 512 << 10, rmm::CUDA_ALLOCATION_ALIGNMENT);
    } catch (rmm::out_of_memory const &) {
      threw = true;
    }
    assert_true(threw);
    limit.deallocate(cuda::stream_ref{stream_a}, p, 768 << 10, rmm::CUDA_ALLOCATION_ALIGNMENT);
  }
  {
    rmm::mr::aligned_resource_adaptor aligned{mr, 4096};
    void *p = aligned.allocate(cuda::stream_ref{stream_a}, 10000, rmm::CUDA_ALLOCATION_ALIGNMENT);
    assert_int_equal(reinterpret_cast<uintptr_t>(p) % 4096, 0);
    aligned.deallocate(cuda::stream_ref{stream_a}, p, 10000, rmm::CUDA_ALLOCATION_ALIGNMENT);
  }
  assert_int_equal(in_use(), before);
}

/* Every magpie resource frees what another handed out: all compare equal,
 * and so do references to them. */
void test_equality(void **) {
  magpie::rmm_memory_resource a, b;
  assert_true(a == b);
  assert_false(a != b);
  rmm::device_async_resource_ref ra{a}, rb{b};
  assert_true(ra == rb);
  void *p = ra.allocate(cuda::stream_ref{stream_a}, 4096, 256);
  rb.deallocate(cuda::stream_ref{stream_a}, p, 4096, 256);
}

} // namespace

int main(void) {
  /* A small device so that the out-of-memory case is quick. */
  setenv("MAGPIE_BACKEND", "sim", 1);
  setenv("MAGPIE_SIM_MEMORY", "256m", 1);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_stream_passed_through),
      cmocka_unit_test(test_alignment),
      cmocka_unit_test(test_out_of_memory),
      cmocka_unit_test(test_bad_deallocate),
      cmocka_unit_test(test_adaptors),
      cmocka_unit_test(test_equality),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
