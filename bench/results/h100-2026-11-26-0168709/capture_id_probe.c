/* Does cuStreamGetId answer on a capturing stream, by capture mode? */
#include <dlfcn.h>
#include <stdio.h>
typedef int CUresult;
typedef void *CUstream;
typedef void *CUcontext;
typedef void *CUgraph;
static CUresult (*cuInit)(unsigned);
static CUresult (*cuDeviceGet)(int *, int);
static CUresult (*retain)(CUcontext *, int);
static CUresult (*setc)(CUcontext);
static CUresult (*screate)(CUstream *, unsigned);
static CUresult (*begin)(CUstream, int);
static CUresult (*getid)(CUstream, unsigned long long *);
static CUresult (*endc)(CUstream, CUgraph *);
static CUresult (*xmode)(int *);
static CUresult (*isc)(CUstream, int *);
int main(void) {
  void *h = dlopen("libcuda.so.1", RTLD_NOW);
  if (!h) {
    printf("no libcuda\n");
    return 1;
  }
  *(void **)&cuInit = dlsym(h, "cuInit");
  *(void **)&cuDeviceGet = dlsym(h, "cuDeviceGet");
  *(void **)&retain = dlsym(h, "cuDevicePrimaryCtxRetain");
  *(void **)&setc = dlsym(h, "cuCtxSetCurrent");
  *(void **)&screate = dlsym(h, "cuStreamCreate");
  *(void **)&begin = dlsym(h, "cuStreamBeginCapture_v2");
  *(void **)&getid = dlsym(h, "cuStreamGetId");
  *(void **)&endc = dlsym(h, "cuStreamEndCapture");
  *(void **)&xmode = dlsym(h, "cuThreadExchangeStreamCaptureMode");
  *(void **)&isc = dlsym(h, "cuStreamIsCapturing");
  int d;
  CUcontext ctx;
  cuInit(0);
  cuDeviceGet(&d, 0);
  retain(&ctx, d);
  setc(ctx);
  const char *names[] = {"global", "thread_local", "relaxed"};
  for (int variant = 0; variant < 5; variant++) {
    int mode = variant < 3 ? variant : 0;
    CUstream s;
    screate(&s, 1);
    CUresult rb = begin(s, mode);
    int old = 2, restore = 0;
    if (variant == 3) {
      old = 2;
      xmode(&old);
      restore = 1;
    } /* this thread relaxed, capture global */
    if (variant == 4) {
      old = 1;
      xmode(&old);
      restore = 1;
    } /* this thread thread_local, capture global */
    int st = -1;
    isc(s, &st);
    unsigned long long id = 0;
    CUresult rg = getid(s, &id);
    if (restore) xmode(&old);
    CUgraph g = 0;
    CUresult re = endc(s, &g);
    printf("capture %s%s: begin %d, capturing %d, cuStreamGetId %d (id %llu), end %d\n", names[mode],
           variant == 3   ? " (thread relaxed)"
           : variant == 4 ? " (thread thread_local)"
                          : "",
           rb, st, rg, id, re);
  }
  return 0;
}
