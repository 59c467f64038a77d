// The benchmark's small kernel. Compiled to PTX (compute_90) by the
// ptx_header rule (tests/gpu/defs.bzl), embedded in the suite and loaded
// with cuModuleLoadData.

typedef unsigned long long u64;

// Writes tag into the first words (at most one per thread) of each of four
// blocks: enough work to order the blocks' uses on the stream, small
// enough that the launch, not the kernel, costs the time.
extern "C" __global__ void bench_touch(unsigned int *p0, u64 n0, unsigned int *p1, u64 n1, unsigned int *p2, u64 n2,
                                       unsigned int *p3, u64 n3, unsigned int tag) {
  u64 i = threadIdx.x;
  if (i < n0) p0[i] = tag;
  if (i < n1) p1[i] = tag + 1;
  if (i < n2) p2[i] = tag + 2;
  if (i < n3) p3[i] = tag + 3;
}
