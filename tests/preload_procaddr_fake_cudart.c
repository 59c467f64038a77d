/* A stand-in for the shared CUDA runtime, installed as libcudart.so.13 by
 * preload_procaddr_test.sh: it takes the driver's entry-point lookup with
 * dlsym, as libcudart.so does. Built with -fno-optimize-sibling-calls: the
 * call to dlsym must come from this library, not from its caller's
 * return address. */
#include <dlfcn.h>

void *fake_cudart_driver_lookup(void *driver, const char *name) { return dlsym(driver, name); }
