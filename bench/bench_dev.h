/* The device under the benchmark suite: streams, events, a small kernel,
 * and the CUDA entry points of the reference allocators.
 *
 * On a GPU it drives the CUDA driver, through magpie's one driver loader
 * (src/device/cuda_driver.h), and the CUDA runtime (libcudart, loaded here:
 * it is not the driver), both with dlopen (no toolkit needed at build
 * time); otherwise magpie's simulated device, where only magpie and the
 * no-op reference can run. Which one follows magpie's
 * own choice of backend (MAGPIE_BACKEND=sim forces the simulated device).
 *
 * Every call that can fail returns 0 on success; a failure is printed once
 * with the call's name and the driver's error name, and counted in
 * bench_dev_errors(), so a run that saw any failing CUDA call says so. */
#ifndef MAGPIE_BENCH_DEV_H
#define MAGPIE_BENCH_DEV_H

#include <stddef.h>
#include <stdint.h>

#include "magpie.h"

typedef struct bench_event_st *bench_event;

/* 0 on success; initialises magpie too. */
int bench_dev_init(void);
int bench_dev_is_cuda(void);
const char *bench_dev_name(void);
/* Make the device's context current in this thread (CUDA). */
int bench_dev_thread_init(void);
cudaStream_t bench_stream_create(void);
int bench_stream_destroy(cudaStream_t s);
int bench_stream_sync(cudaStream_t s);
int bench_device_sync(void);
bench_event bench_event_create(void);
int bench_event_destroy(bench_event e);
int bench_event_record(bench_event e, cudaStream_t s);
int bench_event_sync(bench_event e);
int bench_stream_wait_event(cudaStream_t s, bench_event e);

/* Whether bench_touch runs a real kernel (CUDA with the embedded PTX) or a
 * host function on a simulated stream. */
int bench_have_kernel(void);
/* Enqueue on s one small kernel (one block of 128 threads) writing tag into
 * the first words of each of the n (<= 4) blocks p[i] of bytes[i] bytes. */
int bench_touch(cudaStream_t s, void *const *p, const size_t *bytes, int n, uint32_t tag);

/* CUDA only: cuStreamGetId, the one driver call magpie makes on every
 * allocation, for timing it alone (workload 1). Nonzero without CUDA. */
int bench_stream_get_id(cudaStream_t s, unsigned long long *id);

/* CUDA only, for workload 3's completion probe: cuEventQuery (0 done,
 * else the driver's code); a 64-bit word of pinned host memory the device
 * can write, and a write of value to it ordered after s's work so far
 * (cuStreamWriteValue64). -1 without CUDA or those entry points. */
int bench_event_query(bench_event e);
int bench_host_word(volatile uint64_t **host, uint64_t *devaddr);
/* Give the word back; its writes must have completed (the device was
 * synchronised after the last one). */
int bench_host_word_free(volatile uint64_t *host);
int bench_stream_write_value(cudaStream_t s, uint64_t devaddr, uint64_t value);

/* Failed CUDA calls so far (all threads). */
uint64_t bench_dev_errors(void);
/* Record a failure of a named call (for callers outside this file). */
void bench_dev_fail(const char *what, int code);

/* --- CUDA runtime (cudart), for the reference allocators --- */
/* Whether libcudart was found. */
int bench_cudart_ok(void);
const char *bench_cudart_path(void);
int bench_cuda_malloc(void **p, size_t size);
int bench_cuda_free(void *p);
/* The device's default pool with its release threshold at the maximum. */
int bench_pool_prepare(void);
int bench_cuda_malloc_async(void **p, size_t size, cudaStream_t s);
int bench_cuda_free_async(void *p, cudaStream_t s);
/* Give back what the pool caches (between measurements). */
int bench_pool_trim(void);
/* cudaMemPoolAttrReservedMemHigh, and resetting it to the current value. */
int bench_pool_reserved_high(uint64_t *out);
int bench_pool_reset_high(void);

/* The driver's cuMemAlloc/cuMemFree (the no-op reference's arena). */
int bench_mem_alloc(void **p, size_t size);
int bench_mem_free(void *p);

#endif
