/* The part of CUDA's runtime API that python/magpie/torch_pools.h calls,
 * for torch_pools_test.cpp, which defines the functions as fakes: the test
 * builds where no CUDA toolkit is. Types as CUDA declares them. */
#ifndef MAGPIE_TEST_TORCH_STUB_CUDA_RUNTIME_API_H
#define MAGPIE_TEST_TORCH_STUB_CUDA_RUNTIME_API_H

typedef struct CUstream_st *cudaStream_t;
typedef struct CUevent_st *cudaEvent_t;
enum cudaError { cudaSuccess = 0, cudaErrorNotReady = 600 };
typedef enum cudaError cudaError_t;
enum cudaStreamCaptureStatus {
  cudaStreamCaptureStatusNone = 0,
  cudaStreamCaptureStatusActive = 1,
  cudaStreamCaptureStatusInvalidated = 2
};
#define cudaEventDisableTiming 0x02

cudaError_t cudaStreamIsCapturing(cudaStream_t stream, enum cudaStreamCaptureStatus *status);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream);
cudaError_t cudaEventQuery(cudaEvent_t event);
cudaError_t cudaEventSynchronize(cudaEvent_t event);
cudaError_t cudaEventDestroy(cudaEvent_t event);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaGetLastError(void);

#endif
