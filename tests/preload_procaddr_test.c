/* The preload library's driver-lookup interposition
 * (preload/preload_procaddr.c) without a GPU, against a stand-in driver
 * (preload_procaddr_fake_cuda.c, as libcuda.so.1) and a stand-in shared
 * runtime (preload_procaddr_fake_cudart.c, as libcudart.so.13). The program
 * does what a statically linked CUDA runtime does: dlopen libcuda.so.1,
 * dlsym cuGetProcAddress_v2 from it, look driver functions up by base
 * name, ABI version and stream flags.
 *
 * preload_procaddr_test.sh runs it twice: "plain" (every answer is the
 * driver's) and "preload" (under LD_PRELOAD=libmagpie_preload.so, with
 * MAGPIE_BACKEND=cuda: the variants the library defines come back as its
 * functions and everything else as the driver's; dlsym of other names and
 * handles is unchanged and RTLD_NEXT still relative to its caller; the
 * shared runtime's lookups, magpie's own driver loader and that of
 * libmagpie.so loaded beside get the driver's functions). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <dlfcn.h>
#include <link.h>
#include <stdio.h>
#include <string.h>

typedef int (*gpa2_fn)(const char *, void **, int, uint64_t, int *);
typedef int (*gpa1_fn)(const char *, void **, int, uint64_t);

#define FAKE_CUDA_DPTR 0xfa4e0000ull /* what the stand-in's cuMemAlloc_v2 hands out */

static int preloaded;         /* run under LD_PRELOAD */
static const char *libmagpie; /* the path of libmagpie.so */
static void *drv, *preload;   /* the stand-in driver, the preload library (NULL in the plain run) */
static void *(*fake_function)(const char *);
static int (*fake_lookups)(const char *, int, long long);
static int (*fake_calls)(int);

/* The stand-in driver's function exported as name. */
static void *theirs(const char *name) {
  void *f = fake_function(name);
  assert_non_null(f);
  return f;
}

/* The preload library's function exported as name. */
static void *mine(const char *name) {
  void *f = dlsym(preload, name);
  assert_non_null(f);
  return f;
}

/* What a lookup answers: the preload library's function of that name
 * where it defines the variant and runs, else the driver's. */
static void *expected(const char *name, int served) { return served && preloaded ? mine(name) : theirs(name); }

/* A lookup as a static runtime makes it, and the driver's variant it must
 * find (served: the preload library defines that variant). */
static const struct lookup_case {
  const char *symbol;
  int version;
  uint64_t flags;
  const char *variant;
  int served;
} cases[] = {
    {"cuMemAlloc", 3020, 0, "cuMemAlloc_v2", 1},
    {"cuMemAlloc", 13000, 0, "cuMemAlloc_v2", 1},
    {"cuMemAlloc", 2000, 0, "cuMemAlloc", 0}, /* the 32-bit ABI */
    {"cuMemFree", 3020, 0, "cuMemFree_v2", 1},
    {"cuMemFree", 99000, 0, "cuMemFree_v3", 0}, /* a newer ABI than the library's */
    {"cuMemAllocAsync", 11020, 0, "cuMemAllocAsync", 1},
    {"cuMemAllocAsync", 11020, 1, "cuMemAllocAsync", 1},
    {"cuMemAllocAsync", 11020, 2, "cuMemAllocAsync_ptsz", 1},
    {"cuMemFreeAsync", 13000, 0, "cuMemFreeAsync", 1},
    {"cuMemFreeAsync", 11020, 2, "cuMemFreeAsync_ptsz", 1},
    {"cuStreamDestroy", 4000, 0, "cuStreamDestroy_v2", 1},
    {"cuStreamDestroy", 4000, 2, "cuStreamDestroy_v2", 1}, /* no per-thread form */
    {"cuStreamDestroy", 2000, 0, "cuStreamDestroy", 0},
    {"cuStreamBeginCapture", 10010, 0, "cuStreamBeginCapture_v2", 1},
    {"cuStreamBeginCapture", 10010, 2, "cuStreamBeginCapture_v2_ptsz", 1},
    {"cuStreamBeginCapture", 10000, 2, "cuStreamBeginCapture_ptsz", 0}, /* the ABI without a mode */
    {"cuStreamEndCapture", 10000, 0, "cuStreamEndCapture", 1},
    {"cuStreamEndCapture", 10000, 2, "cuStreamEndCapture_ptsz", 1},
    {"cuMemPoolGetAttribute", 11020, 0, "cuMemPoolGetAttribute", 1},
    {"cuMemPoolSetAttribute", 11020, 0, "cuMemPoolSetAttribute", 1},
    {"cuMemPoolTrimTo", 11020, 0, "cuMemPoolTrimTo", 1},
    {"cuMemPoolSetAccess", 11020, 0, "cuMemPoolSetAccess", 1},
    {"cuCtxEnablePeerAccess", 4000, 0, "cuCtxEnablePeerAccess", 1},
    {"cuGetProcAddress", 12000, 0, "cuGetProcAddress_v2", 1},
    {"cuGetProcAddress", 11030, 0, "cuGetProcAddress", 1},
    {"cuInit", 2000, 0, "cuInit", 0},
    {"cuMemGetInfo", 3020, 0, "cuMemGetInfo_v2", 0},
    {"cuMemAllocManaged", 6000, 0, "cuMemAllocManaged", 0},
};

static void check_case(const struct lookup_case *c, void *got) {
  if (got != expected(c->variant, c->served))
    fail_msg("%s at %d, flags %llu: %p, not %s's %s", c->symbol, c->version, (unsigned long long)c->flags, got,
             c->served && preloaded ? "the preload library" : "the driver", c->variant);
}

/* First, before anything asks the preload library's wrapper: magpie's own
 * driver loader, in the preload library, takes cuGetProcAddress_v2 from
 * libcuda.so.1 with dlsym too; it must get the driver's, else its table
 * would hold the library's functions, which call back into magpie. It asks
 * at version 12000 (cuda_driver.h: CUDRV_REQUEST_VERSION); the wrapper
 * would have asked the driver again at the variant's own version (3020,
 * 11020, 4000), which must never happen. */
static void test_magpie_loader_gets_the_driver(void **state) {
  (void)state;
  if (!preloaded) skip();
  int (*backend)(void) = (int (*)(void))mine("magpie_active_backend");
  assert_int_not_equal(backend(), 1); /* MAGPIE_BACKEND_CUDA: the stand-in has no device */
  static const struct {
    const char *symbol;
    int version;
  } asked[] = {{"cuMemAlloc", 3020},      {"cuMemFree", 3020},       {"cuMemAllocAsync", 11020},
               {"cuMemFreeAsync", 11020}, {"cuStreamDestroy", 4000}, {"cuCtxEnablePeerAccess", 4000}};
  for (size_t i = 0; i < sizeof asked / sizeof *asked; i++) {
    assert_int_equal(fake_lookups(asked[i].symbol, -1, 1), 1); /* magpie's lookup, legacy stream */
    assert_int_equal(fake_lookups(asked[i].symbol, asked[i].version, -1), 0);
  }
}

/* Another copy of magpie in the process (libmagpie.so, as Python's magpie
 * package loads it) gets the driver's lookup as well. */
static void test_libmagpie_gets_the_driver(void **state) {
  (void)state;
  void *lib = dlopen(libmagpie, RTLD_NOW | RTLD_LOCAL);
  assert_non_null(lib);
  int (*backend)(void) = (int (*)(void))dlsym(lib, "magpie_active_backend");
  assert_non_null(backend);
  int asked = fake_lookups("cuMemAlloc", -1, 1), again = fake_lookups("cuMemAlloc", 3020, -1);
  assert_int_not_equal(backend(), 1);
  assert_int_equal(fake_lookups("cuMemAlloc", -1, 1), asked + 1);
  assert_int_equal(fake_lookups("cuMemAlloc", 3020, -1), again);
}

/* cuGetProcAddress_v2 from the driver's handle, and every case through it. */
static void test_lookup_through_v2(void **state) {
  (void)state;
  gpa2_fn gpa = (gpa2_fn)dlsym(drv, "cuGetProcAddress_v2");
  assert_ptr_equal(gpa, expected("cuGetProcAddress_v2", 1));
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    void *f = NULL;
    int status = -1;
    assert_int_equal(gpa(cases[i].symbol, &f, cases[i].version, cases[i].flags, &status), 0);
    assert_int_equal(status, 0);
    check_case(&cases[i], f);
  }
}

/* The same through the older cuGetProcAddress (no status argument). */
static void test_lookup_through_v1(void **state) {
  (void)state;
  gpa1_fn gpa = (gpa1_fn)dlsym(drv, "cuGetProcAddress");
  assert_ptr_equal(gpa, expected("cuGetProcAddress", 1));
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    void *f = NULL;
    assert_int_equal(gpa(cases[i].symbol, &f, cases[i].version, cases[i].flags), 0);
    check_case(&cases[i], f);
  }
}

/* What the driver does not find stays as it says, status or error. */
static void test_misses_unchanged(void **state) {
  (void)state;
  gpa2_fn gpa = (gpa2_fn)dlsym(drv, "cuGetProcAddress_v2");
  gpa1_fn gpa1 = (gpa1_fn)dlsym(drv, "cuGetProcAddress");
  void *f = &f;
  int status = -1;
  assert_int_equal(gpa("cuNoSuchFunction", &f, 13000, 0, &status), 0);
  assert_null(f);
  assert_int_equal(status, 1);
  f = &f;
  assert_int_equal(gpa("cuMemAllocAsync", &f, 11000, 0, &status), 0);
  assert_null(f);
  assert_int_equal(status, 2);
  assert_int_equal(gpa("cuMemAllocAsync", &f, 11020, 2, NULL), 0); /* the status is optional */
  assert_ptr_equal(f, expected("cuMemAllocAsync_ptsz", 1));
  assert_int_equal(gpa1("cuNoSuchFunction", &f, 13000, 0), 500);
  assert_int_not_equal(gpa("cuMemAlloc", NULL, 3020, 0, &status), 0);
}

/* A static runtime looks cuGetProcAddress itself up (for
 * cudaGetDriverEntryPoint): that one serves too. */
static void test_lookup_of_the_lookup(void **state) {
  (void)state;
  gpa2_fn gpa = (gpa2_fn)dlsym(drv, "cuGetProcAddress_v2"), again = NULL;
  assert_int_equal(gpa("cuGetProcAddress", (void **)&again, 12000, 0, NULL), 0);
  assert_ptr_equal(again, expected("cuGetProcAddress_v2", 1));
  void *f = NULL;
  assert_int_equal(again("cuMemFreeAsync", &f, 11020, 2, NULL), 0);
  assert_ptr_equal(f, expected("cuMemFreeAsync_ptsz", 1));
}

/* A served variant is the preload library's working function: with no
 * device for magpie it hands the call to the driver's. */
static void test_served_function_reaches_the_driver(void **state) {
  (void)state;
  gpa2_fn gpa = (gpa2_fn)dlsym(drv, "cuGetProcAddress_v2");
  int (*alloc)(unsigned long long *, size_t) = NULL;
  int (*release)(unsigned long long) = NULL;
  assert_int_equal(gpa("cuMemAlloc", (void **)&alloc, 3020, 0, NULL), 0);
  assert_int_equal(gpa("cuMemFree", (void **)&release, 3020, 0, NULL), 0);
  unsigned long long d = 0;
  int allocs = fake_calls(1), frees = fake_calls(0);
  assert_int_equal(alloc(&d, 4096), 0);
  assert_true(d == FAKE_CUDA_DPTR);
  assert_int_equal(release(d), 0);
  assert_int_equal(fake_calls(1), allocs + 1);
  assert_int_equal(fake_calls(0), frees + 1);
}

/* dlsym of other names, of other handles, and RTLD_NEXT: as without the
 * library. RTLD_NEXT from this program finds the first definition after
 * it, the preload library's own dlsym when it is loaded; a dlsym that lost
 * its caller would have answered from after the library (libc's). */
static void test_dlsym_otherwise_unchanged(void **state) {
  (void)state;
  assert_ptr_equal(dlsym(drv, "cuInit"), theirs("cuInit"));
  assert_ptr_equal(dlsym(drv, "cuMemAlloc_v2"), theirs("cuMemAlloc_v2")); /* by exported name: the driver's */
  dlerror();
  assert_null(dlsym(drv, "cuNoSuchFunction"));
  assert_non_null(dlerror());
  void *libc = dlopen("libc.so.6", RTLD_LAZY | RTLD_NOLOAD);
  assert_non_null(libc);
  assert_null(dlsym(libc, "cuGetProcAddress_v2"));
  assert_non_null(dlsym(libc, "getpid"));
  void *next = dlsym(RTLD_NEXT, "dlsym");
  assert_ptr_equal(next, preloaded ? mine("dlsym") : dlsym(libc, "dlsym"));
  if (preloaded) assert_ptr_not_equal(next, dlsym(libc, "dlsym"));
  assert_ptr_equal(dlsym(RTLD_DEFAULT, "cuGetProcAddress_v2"), preloaded ? mine("cuGetProcAddress_v2") : NULL);
  dlclose(libc);
}

/* The shared runtime's lookup stays the driver's (its cudaMalloc & co. are
 * interposed by name), under its own name and under the one auditwheel
 * gives the copy a wheel carries. */
static void test_shared_runtime_gets_the_driver(void **state) {
  (void)state;
  static const char *const names[] = {"libcudart.so.13", "libcudart-0a1b2c3d.so.12"};
  for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
    void *rt = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    assert_non_null(rt);
    void *(*lookup)(void *, const char *) = (void *(*)(void *, const char *))dlsym(rt, "fake_cudart_driver_lookup");
    assert_non_null(lookup);
    assert_ptr_equal(lookup(drv, "cuGetProcAddress_v2"), theirs("cuGetProcAddress_v2"));
    assert_ptr_equal(lookup(drv, "cuGetProcAddress"), theirs("cuGetProcAddress"));
  }
}

static int preload_module(struct dl_phdr_info *info, size_t size, void *out) {
  (void)size;
  if (info->dlpi_name == NULL || strstr(info->dlpi_name, "libmagpie_preload.so") == NULL) return 0;
  *(void **)out = dlopen(info->dlpi_name, RTLD_LAZY | RTLD_NOLOAD);
  return 1;
}

int main(int argc, char **argv) {
  if (argc != 3 || (strcmp(argv[1], "plain") != 0 && strcmp(argv[1], "preload") != 0)) {
    fprintf(stderr, "usage: %s plain|preload LIBMAGPIE_SO\n", argv[0]);
    return 2;
  }
  preloaded = strcmp(argv[1], "preload") == 0;
  libmagpie = argv[2];
  dl_iterate_phdr(preload_module, &preload);
  if (preloaded != (preload != NULL)) {
    fprintf(stderr, "libmagpie_preload.so is %sloaded in the %s run\n", preload ? "" : "not ", argv[1]);
    return 2;
  }
  drv = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (drv == NULL) {
    fprintf(stderr, "the stand-in libcuda.so.1: %s\n", dlerror());
    return 2;
  }
  fake_function = (void *(*)(const char *))dlsym(drv, "fake_cuda_function");
  fake_lookups = (int (*)(const char *, int, long long))dlsym(drv, "fake_cuda_lookups");
  fake_calls = (int (*)(int))dlsym(drv, "fake_cuda_calls");
  if (fake_function == NULL || fake_lookups == NULL || fake_calls == NULL) {
    fprintf(stderr, "libcuda.so.1 is not the stand-in driver\n");
    return 2;
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_magpie_loader_gets_the_driver),
      cmocka_unit_test(test_libmagpie_gets_the_driver),
      cmocka_unit_test(test_lookup_through_v2),
      cmocka_unit_test(test_lookup_through_v1),
      cmocka_unit_test(test_misses_unchanged),
      cmocka_unit_test(test_lookup_of_the_lookup),
      cmocka_unit_test(test_served_function_reaches_the_driver),
      cmocka_unit_test(test_dlsym_otherwise_unchanged),
      cmocka_unit_test(test_shared_runtime_gets_the_driver),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
