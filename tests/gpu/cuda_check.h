// CHECK(call): a CUDA runtime call that must succeed, else the program
// prints where and why and exits 2. Shared by the standalone CUDA programs
// run under LD_PRELOAD (preload_*.cu, preload_kernels.cuh).
#ifndef MAGPIE_TESTS_GPU_CUDA_CHECK_H
#define MAGPIE_TESTS_GPU_CUDA_CHECK_H

#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#define CHECK(call)                                                                          \
  do {                                                                                       \
    cudaError_t e_ = (call);                                                                 \
    if (e_ != cudaSuccess) {                                                                 \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      exit(2);                                                                               \
    }                                                                                        \
  } while (0)

#endif // MAGPIE_TESTS_GPU_CUDA_CHECK_H
