/* The best-fit reference for memory (bestfit.c). Thread-safe. */
#ifndef MAGPIE_BENCH_BESTFIT_H
#define MAGPIE_BENCH_BESTFIT_H

#include <stddef.h>
#include <stdint.h>

/* An address for size bytes (it names no memory), or NULL. */
void *bestfit_alloc(size_t size);
/* Free what bestfit_alloc gave; anything else is ignored. */
void bestfit_free(void *p);
/* Restart the peak of reserved bytes at what is reserved now. */
void bestfit_reset_peak(void);
/* Peak reserved bytes: granules holding a live block, at their most. */
uint64_t bestfit_peak_reserved(void);

#endif
