/* Read-only views of the large layer: where its bytes are (statistics)
 * and every segment and block (snapshots).
 *
 * Lock order: large_cache.lock alone; nothing is written to the caller's
 * stream while it is held. */
#include <stdlib.h>
#include <string.h>

#include "pool/large.h"

/* Free blocks hold the mapped bytes less those in use: every mapped byte
 * lies in one block and a handed-out block is wholly mapped (large.h), so
 * only the few blocks still waiting on a stream are walked. Walking every
 * free block's granules instead was slow where one free block spans most
 * of a segment's reserved range (bench/DECISIONS.md, "Statistics walk only
 * blocks waiting on a stream"). While a map or an unmap is in flight the
 * figures may be off by its granules. */
void large_account_get(large_cache *c, large_account *out) {
  memset(out, 0, sizeof *out);
  size_t pending = 0;
  pthread_mutex_lock(&c->lock);
  for (lblock *b = large_free_first(c); b; b = large_free_next(c, b))
    if (b->ticket != NULL && !lticket_done(b->ticket))
      pending += lseg_mapped_in(b->seg, c->region->gran, b->base, b->size);
  for (lseg *sg = c->segs; sg; sg = sg->next)
    if (!sg->vmm) out->overhead += sg->raw_size - sg->size;
  size_t mapped = atomic_load_relaxed(&c->mapped_bytes), used = atomic_load_relaxed(&c->in_use_bytes);
  pthread_mutex_unlock(&c->lock);
  size_t taken = used + out->overhead;
  size_t free_all = mapped > taken ? mapped - taken : 0;
  out->free_pending = pending < free_all ? pending : free_all;
  out->free_ready = free_all - out->free_pending;
}

static void large_snapshot_seg(large_cache *c, lseg *sg, FILE *f, large_state_fn state_of, void *ctx) {
  size_t g = c->region->gran;
  fprintf(f, "{\"kind\":\"large_segment\",\"base\":%llu,\"size\":%zu,\"vmm\":%d,\"granule\":%zu,\"mapped\":[",
          (unsigned long long)sg->base, sg->size, sg->vmm, g);
  /* Mapped granules as [first, count] runs. */
  int firstrun = 1;
  for (size_t i = 0; i < sg->ngran;) {
    int m = !sg->vmm || sg->gran[i] == GRAN_MAPPED;
    size_t j = i + 1;
    while (j < sg->ngran && (!sg->vmm || sg->gran[j] == GRAN_MAPPED) == m) j++;
    if (m) {
      fprintf(f, "%s[%zu,%zu]", firstrun ? "" : ",", i, j - i);
      firstrun = 0;
    }
    i = j;
  }
  fputs("],\"blocks\":[", f);
  for (lblock *b = sg->first; b; b = b->next) {
    fprintf(f, "%s{\"base\":%llu,\"size\":%zu,\"mapped\":%zu,", b == sg->first ? "" : ",", (unsigned long long)b->base,
            b->size, lseg_mapped_in(sg, c->region->gran, b->base, b->size));
    if (b->state == LBLOCK_USED) {
      /* A class block is where its magazine is; a large block kept by a
       * thread is the thread's; any other handed-out block may be parked
       * by record_stream: state_of knows. */
      unsigned k = b->klass != 0 ? 0 : large_kept_state(b);
      uint64_t stream = 0;
      const char *st = b->klass == LARGE_KLASS_LENT ? "span"
                       : k == LARGE_KEPT            ? "thread"
                       : k == LARGE_KEPT_LIMBO      ? "limbo"
                       : state_of                   ? state_of(ctx, b->base, &stream)
                                                    : "in_use";
      fprintf(f, "\"state\":\"%s\"", st);
      if (b->klass != 0 && b->klass != LARGE_KLASS_LENT) fprintf(f, ",\"class\":%u", b->klass - 1);
      if (strcmp(st, "pending") == 0) fprintf(f, ",\"stream\":%llu", (unsigned long long)stream);
      fputc('}', f);
    } else if (b->ticket == NULL || lticket_done(b->ticket)) fputs("\"state\":\"free\"}", f);
    else
      fprintf(f, "\"state\":\"pending\",\"stream\":%llu,\"seq\":%llu}", (unsigned long long)b->ticket->t.rec->id,
              (unsigned long long)b->ticket->t.seq);
  }
  fputs("]}", f);
}

void large_snapshot(large_cache *c, FILE *out, int *first, large_state_fn state_of, void *ctx) {
  char *buf = NULL;
  size_t len = 0;
  FILE *mem = open_memstream(&buf, &len);
  if (mem == NULL) return;
  /* Written to memory under the lock; to the caller's stream after. */
  pthread_mutex_lock(&c->lock);
  for (lseg *sg = c->segs; sg; sg = sg->next) {
    if (!*first) fputc(',', mem);
    *first = 0;
    large_snapshot_seg(c, sg, mem, state_of, ctx);
  }
  pthread_mutex_unlock(&c->lock);
  fclose(mem);
  fwrite(buf, 1, len, out);
  free(buf);
}
