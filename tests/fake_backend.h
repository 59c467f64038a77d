/* A small, deterministic fake of the device layer for unit tests.
 *
 * Nothing runs asynchronously: an event recorded on a stream stays pending
 * until the test completes that stream's work (fake_stream_complete), so
 * tests decide exactly when an epoch ends and can assert what the allocator
 * does before and after. Memory is host memory; capacity is settable. */
#ifndef MAGPIE_TESTS_FAKE_BACKEND_H
#define MAGPIE_TESTS_FAKE_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "device/backend.h"

const backend_ops *fake_backend(void);

/* Streams: handles are recycled most-recently-destroyed first; ids never. */
cudaStream_t fake_stream_create(int device);
void fake_stream_destroy(cudaStream_t s);
/* Complete all work enqueued on s so far (its recorded events). */
void fake_stream_complete(cudaStream_t s);
void fake_set_devices(int n);
void fake_set_capacity(int device, size_t bytes);
void fake_set_current_device(int device);
/* Every map takes this long (0: none): a slow driver call that threads
 * arriving meanwhile must not each repeat. */
void fake_set_map_delay_us(unsigned us);
/* While closed, device_synchronize blocks (the work is still running). */
void fake_gate_device_sync(int closed);
/* While closed, unmap blocks (a slow driver call in flight); how many
 * unmaps are inside the gate now. */
void fake_gate_unmap(int closed);
int fake_unmaps_held(void);
/* The next n stream waits (stream_wait_event) fail, as the driver would. */
void fake_fail_stream_waits(unsigned n);

typedef struct fake_counters {
  uint64_t maps, unmaps, event_records, event_queries, event_syncs, device_syncs, stream_waits;
  size_t mapped_bytes[4];
} fake_counters;
void fake_get_counters(fake_counters *out);

/* Start magpie on the fake device with its default configuration (checked
 * mode if `check`), after fake_set_devices and fake_set_capacity. */
int fake_magpie_init(int check);

#endif
