/* A minimal device layer for magpie's demo and benchmarks: streams, work
 * that writes a block, stream-to-stream ordering, and the CUDA pool
 * allocator for comparisons. On the GPU it drives the CUDA driver through
 * magpie's one driver loader (src/device/cuda_driver.h: loaded with dlopen,
 * no toolkit needed); otherwise the simulated device. Which one follows
 * magpie's own choice of backend. */
#ifndef MAGPIE_TOOLS_DEVSHIM_H
#define MAGPIE_TOOLS_DEVSHIM_H

#include <stddef.h>
#include <stdint.h>

#include "magpie.h"

/* 0 on success; initialises magpie too. */
int devshim_init(void);
int devshim_is_cuda(void);
/* Make the device's context current in this thread (CUDA). */
void devshim_thread_init(void);
cudaStream_t devshim_stream_create(void);
void devshim_stream_destroy(cudaStream_t s);
/* Enqueue on s work that writes `bytes` of p with value. 0 on success. */
int devshim_fill(void *p, size_t bytes, uint32_t value, cudaStream_t s);
/* Later work on `to` waits for all work enqueued on `from` so far. */
int devshim_order(cudaStream_t to, cudaStream_t from);
void devshim_stream_synchronize(cudaStream_t s);
void devshim_synchronize(void);

/* CUDA only: the stream-ordered pool allocator (cudaMallocAsync's driver
 * entry points) on the default pool, its release threshold set to the
 * maximum so it caches. NULL / nonzero on failure or without CUDA. */
int devshim_pool_prepare(void);
void *devshim_pool_alloc(size_t size, cudaStream_t s);
int devshim_pool_free(void *p, cudaStream_t s);

#endif
