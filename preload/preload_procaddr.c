/* The driver's entry-point lookup, for CUDA runtimes linked into the
 * program (nvcc's default, -cudart static) or into a library (cuBLAS,
 * cuSPARSE, cuRAND, NCCL carry one): such a runtime's cudaMalloc is not a
 * symbol LD_PRELOAD can replace. The runtime opens libcuda.so.1 itself,
 * takes cuGetProcAddress_v2 from it with dlsym and asks that for every
 * driver function by base name, ABI version and stream flags (CUDA 13.0's
 * static runtime: "cuMemAlloc" at 3020, "cuMemAllocAsync" at 11020 with
 * flags 0 and again with CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM,
 * "cuGetProcAddress" itself at 11030 and 12000, ...). Interposed here:
 *
 *   dlsym                dlsym(handle, "cuGetProcAddress_v2") or
 *                        (handle, "cuGetProcAddress") whose answer is the
 *                        loaded driver's function (handle: libcuda.so.1 or
 *                        a library depending on it) answers this library's
 *                        wrapper instead. Every other call is the real
 *                        dlsym's, entered as if called directly: its answer
 *                        for RTLD_NEXT and RTLD_DEFAULT depends on the
 *                        caller's address, which a C wrapper would change
 *                        (x86-64 only: the trampoline at the end).
 *   cuGetProcAddress_v2, cuGetProcAddress
 *                        the driver's answer, except that a variant this
 *                        library defines (preload_entries) is answered with
 *                        its function. Programs that link libcuda and call
 *                        them directly get the same.
 *
 * Which variant the driver chose is not inferred from version and flags:
 * the driver is asked again for each variant this library defines, at that
 * variant's ABI version, legacy and per-thread, and the pointers compared.
 * An answer that is none of them (an older or a newer ABI, another
 * signature) stays the driver's.
 *
 * Lookups that stay the driver's: those made by this library (magpie's
 * driver loader, magpie_preload.c's real functions: serving them would
 * recurse into magpie) or by another copy of magpie (libmagpie.so: its
 * slabs must not come from this one), by the shared runtime libcudart.so
 * (its cudaMalloc & co. are replaced by name already; its driver calls must
 * not be served a second time) and by libcuda itself.
 *
 * This file is built without sanitizers (BUILD): the sanitizer runtimes
 * look up the functions they wrap with dlsym while they start, before
 * instrumented code may run, so the path every dlsym takes here calls no
 * function a sanitizer wraps (only dlvsym, once). */
#include <dlfcn.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define PRELOAD_API __attribute__((visibility("default")))

typedef int CUresult;
/* cuda.h: PFN_cuGetProcAddress_v12000 (exported as cuGetProcAddress_v2)
 * and PFN_cuGetProcAddress_v11030 (exported as cuGetProcAddress). */
typedef CUresult (*preload_gpa2)(const char *, void **, int, uint64_t, int *);
typedef CUresult (*preload_gpa1)(const char *, void **, int, uint64_t);
typedef void *(*preload_dlsym_fn)(void *, const char *);

enum {
  PRELOAD_GPA_LEGACY = 1,   /* CU_GET_PROC_ADDRESS_LEGACY_STREAM */
  PRELOAD_GPA_PTDS = 2,     /* CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM */
  PRELOAD_GPA_FOUND = 0,    /* CU_GET_PROC_ADDRESS_SUCCESS */
  PRELOAD_GPA_UNKNOWN = 999 /* CUDA_ERROR_UNKNOWN: no driver in the process */
};

PRELOAD_API CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, uint64_t flags,
                                         int *symbolStatus);
PRELOAD_API CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, uint64_t flags);

/* The driver functions this library defines, as cuGetProcAddress is asked
 * for them: base name, the ABI version of the variant defined here
 * (cudaTypedefs.h: PFN_<symbol>_v<version>), and the exported names of its
 * legacy and per-thread-default-stream forms (NULL: it takes no stream). A
 * name this library does not export stays the driver's. */
static const struct preload_entry {
  const char *symbol;
  int version;
  const char *legacy, *ptsz;
} preload_entries[] = {
    {"cuMemAlloc", 3020, "cuMemAlloc_v2", NULL},
    {"cuMemFree", 3020, "cuMemFree_v2", NULL},
    {"cuMemAllocAsync", 11020, "cuMemAllocAsync", "cuMemAllocAsync_ptsz"},
    {"cuMemFreeAsync", 11020, "cuMemFreeAsync", "cuMemFreeAsync_ptsz"},
    {"cuStreamDestroy", 4000, "cuStreamDestroy_v2", NULL},
    {"cuStreamBeginCapture", 10010, "cuStreamBeginCapture_v2", "cuStreamBeginCapture_v2_ptsz"},
    {"cuStreamEndCapture", 10000, "cuStreamEndCapture", "cuStreamEndCapture_ptsz"},
    {"cuMemPoolGetAttribute", 11020, "cuMemPoolGetAttribute", NULL},
    {"cuMemPoolSetAttribute", 11020, "cuMemPoolSetAttribute", NULL},
    {"cuMemPoolTrimTo", 11020, "cuMemPoolTrimTo", NULL},
    {"cuMemPoolSetAccess", 11020, "cuMemPoolSetAccess", NULL},
    {"cuCtxEnablePeerAccess", 4000, "cuCtxEnablePeerAccess", NULL},
    {"cuCtxDisablePeerAccess", 4000, "cuCtxDisablePeerAccess", NULL},
    {"cuIpcGetMemHandle", 4010, "cuIpcGetMemHandle", NULL},
    {"cuIpcOpenMemHandle", 11000, "cuIpcOpenMemHandle_v2", NULL},
    {"cuIpcOpenMemHandle", 4010, "cuIpcOpenMemHandle", NULL},
    {"cuIpcCloseMemHandle", 4010, "cuIpcCloseMemHandle", NULL},
    {"cuMemPoolExportPointer", 11020, "cuMemPoolExportPointer", NULL},
    /* The static runtime looks cuGetProcAddress itself up and makes every
     * later lookup (cudaGetDriverEntryPoint's too) through the answer. */
    {"cuGetProcAddress", 12000, "cuGetProcAddress_v2", NULL},
    {"cuGetProcAddress", 11030, "cuGetProcAddress", NULL},
};

/* The real dlsym (the next definition after this library), set once by
 * preload_dlsym_next; the trampoline jumps through it. */
__attribute__((visibility("hidden"))) _Atomic(preload_dlsym_fn) preload_real_dlsym;

/* Where no dlsym follows this library: every name is missing, rather than
 * a jump to address 0. */
static void *preload_no_dlsym(void *handle, const char *name) {
  (void)handle;
  (void)name;
  return NULL;
}

/* The real dlsym: glibc 2.34 and later define it in libc as dlsym@GLIBC_2.34,
 * earlier ones in libdl at the base version. */
static preload_dlsym_fn preload_dlsym_next(void) {
  preload_dlsym_fn f = atomic_load_explicit(&preload_real_dlsym, memory_order_acquire);
  if (f != NULL) return f;
  f = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
  if (f == NULL) f = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
  if (f == NULL) f = preload_no_dlsym;
  atomic_store_explicit(&preload_real_dlsym, f, memory_order_release);
  return f;
}

/* name in the CUDA driver the process has loaded (libcuda.so.1, whoever
 * opened it), or NULL. */
static void *preload_loaded_driver_sym(const char *name) {
  void *drv = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
  if (drv == NULL) return NULL;
  void *f = preload_dlsym_next()(drv, name);
  dlclose(drv);
  return f;
}

/* The driver's cuGetProcAddress_v2 / cuGetProcAddress: the next definition
 * after this library, else the loaded driver's (a runtime opens it with
 * RTLD_LOCAL, out of RTLD_NEXT's reach). Cached once found. */
static _Atomic(void *) preload_driver_gpa[2];

static void *preload_driver_lookup(int v2) {
  void *f = atomic_load_explicit(&preload_driver_gpa[v2], memory_order_acquire);
  if (f != NULL) return f;
  const char *name = v2 ? "cuGetProcAddress_v2" : "cuGetProcAddress";
  f = preload_dlsym_next()(RTLD_NEXT, name);
  if (f == NULL) f = preload_loaded_driver_sym(name);
  if (f != NULL) atomic_store_explicit(&preload_driver_gpa[v2], f, memory_order_release);
  return f;
}

/* What the driver answers for symbol at version with flags, or NULL. */
static void *preload_driver_variant(const char *symbol, int version, uint64_t flags) {
  void *fn = NULL;
  int status = PRELOAD_GPA_FOUND;
  preload_gpa2 gpa2 = preload_driver_lookup(1);
  if (gpa2 != NULL) return gpa2(symbol, &fn, version, flags, &status) == 0 && status == PRELOAD_GPA_FOUND ? fn : NULL;
  preload_gpa1 gpa1 = preload_driver_lookup(0);
  return gpa1 != NULL && gpa1(symbol, &fn, version, flags) == 0 ? fn : NULL;
}

/* The function this library exports as name, or NULL. */
static void *preload_own(const char *name) {
  Dl_info self, where;
  if (dladdr((void *)preload_own, &self) == 0 || self.dli_fname == NULL) return NULL;
  void *lib = dlopen(self.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
  if (lib == NULL) return NULL;
  void *f = preload_dlsym_next()(lib, name);
  dlclose(lib);
  if (f == NULL || dladdr(f, &where) == 0 || where.dli_fbase != self.dli_fbase) return NULL;
  return f;
}

/* fn: the driver's answer to a lookup of symbol. This library's function
 * if fn is a variant it defines (see the top), else fn. */
static void *preload_serve(const char *symbol, void *fn) {
  if (symbol == NULL) return fn;
  for (size_t i = 0; i < sizeof preload_entries / sizeof *preload_entries; i++) {
    const struct preload_entry *e = &preload_entries[i];
    if (strcmp(e->symbol, symbol) != 0) continue;
    const char *name = NULL;
    if (preload_driver_variant(e->symbol, e->version, PRELOAD_GPA_LEGACY) == fn) name = e->legacy;
    else if (e->ptsz != NULL && preload_driver_variant(e->symbol, e->version, PRELOAD_GPA_PTDS) == fn) name = e->ptsz;
    void *mine = name != NULL ? preload_own(name) : NULL;
    if (mine != NULL) return mine;
  }
  return fn;
}

PRELOAD_API CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, uint64_t flags,
                                         int *symbolStatus) {
  preload_gpa2 real = preload_driver_lookup(1);
  if (real == NULL) return PRELOAD_GPA_UNKNOWN;
  int local = PRELOAD_GPA_FOUND, *status = symbolStatus != NULL ? symbolStatus : &local;
  CUresult rc = real(symbol, pfn, cudaVersion, flags, status);
  if (rc == 0 && *status == PRELOAD_GPA_FOUND && pfn != NULL && *pfn != NULL) *pfn = preload_serve(symbol, *pfn);
  return rc;
}

PRELOAD_API CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, uint64_t flags) {
  preload_gpa1 real = preload_driver_lookup(0);
  if (real == NULL) return PRELOAD_GPA_UNKNOWN;
  CUresult rc = real(symbol, pfn, cudaVersion, flags);
  if (rc == 0 && pfn != NULL && *pfn != NULL) *pfn = preload_serve(symbol, *pfn);
  return rc;
}

#if defined(__x86_64__)
/* Does the module from is in define magpie's API itself (libmagpie.so)? */
static int preload_is_magpie(const Dl_info *from) {
  Dl_info where;
  void *lib = dlopen(from->dli_fname, RTLD_LAZY | RTLD_NOLOAD);
  if (lib == NULL) return 0;
  void *f = preload_dlsym_next()(lib, "magpie_malloc_async");
  dlclose(lib);
  return f != NULL && dladdr(f, &where) != 0 && where.dli_fbase == from->dli_fbase;
}

/* Callers whose lookups stay the driver's (see the top): this library,
 * another copy of magpie, the shared runtime, the driver. */
static int preload_caller_keeps_driver(const void *caller) {
  Dl_info self, from;
  if (caller == NULL || dladdr(caller, &from) == 0 || from.dli_fname == NULL) return 0;
  if (dladdr((void *)preload_caller_keeps_driver, &self) != 0 && self.dli_fbase == from.dli_fbase) return 1;
  const char *file = strrchr(from.dli_fname, '/');
  file = file != NULL ? file + 1 : from.dli_fname;
  /* libcudart.so.13, or libcudart-<hash>.so.12 as auditwheel renames it. */
  int runtime = strncmp(file, "libcudart", 9) == 0 && (file[9] == '.' || file[9] == '-');
  return runtime || strncmp(file, "libcuda.so", 10) == 0 || preload_is_magpie(&from);
}

static void *preload_lookup_redirect(void *handle, const char *name, const void *caller) {
  int v2 = strcmp(name, "cuGetProcAddress_v2") == 0;
  if (!v2 && strcmp(name, "cuGetProcAddress") != 0) return NULL;
  if (handle == RTLD_DEFAULT || handle == RTLD_NEXT || preload_caller_keeps_driver(caller)) return NULL;
  void *f = preload_dlsym_next()(handle, name);
  if (f == NULL || f != preload_loaded_driver_sym(name)) return NULL;
  return v2 ? (void *)cuGetProcAddress_v2 : (void *)cuGetProcAddress;
}

/* dlsym(handle, name) called from caller (its return address): the answer
 * that replaces the real dlsym's, or NULL to enter the real dlsym. Names
 * that cannot be the lookup's are told apart with no library call. */
__attribute__((visibility("hidden"))) void *preload_dlsym_hook(void *handle, const char *name, const void *caller) {
  preload_dlsym_next();
  if (name == NULL || name[0] != 'c' || name[1] != 'u' || name[2] != 'G') return NULL;
  return preload_lookup_redirect(handle, name, caller);
}

/* dlsym: asks preload_dlsym_hook with the caller's return address, then
 * returns its answer, or restores the arguments and jumps to the real dlsym
 * with the caller's return address still on the stack. */
__asm__(
    "  .text\n"
    "  .globl dlsym\n"
    "  .type dlsym, @function\n"
    "  .p2align 4\n"
    "dlsym:\n"
    "  .cfi_startproc\n"
#if defined(__CET__)
    "  endbr64\n"
#endif
    "  pushq %rdi\n"
    "  .cfi_adjust_cfa_offset 8\n"
    "  pushq %rsi\n"
    "  .cfi_adjust_cfa_offset 8\n"
    "  movq 16(%rsp), %rdx\n"
    "  subq $8, %rsp\n"
    "  .cfi_adjust_cfa_offset 8\n"
    "  call preload_dlsym_hook\n"
    "  addq $8, %rsp\n"
    "  .cfi_adjust_cfa_offset -8\n"
    "  popq %rsi\n"
    "  .cfi_adjust_cfa_offset -8\n"
    "  popq %rdi\n"
    "  .cfi_adjust_cfa_offset -8\n"
    "  testq %rax, %rax\n"
    "  jz 1f\n"
    "  ret\n"
    "1:\n"
    "  jmp *preload_real_dlsym(%rip)\n"
    "  .cfi_endproc\n"
    "  .size dlsym, .-dlsym\n");
#endif
