/* One-time set-up (init.c) and its configuration parser (options.c). */
#ifndef MAGPIE_INIT_H
#define MAGPIE_INIT_H

#include "front/global.h"

/* Parse MAGPIE_CONF / MAGPIE_BACKEND over cfg (options.c). */
int options_from_env(magpie_config *cfg);
/* Parse one "key=value,key=value" string over cfg (options.c). */
int options_parse(magpie_config *cfg, const char *conf);

/* Accepted ranges (options.c, docs/configuration.md). */
#define OPTIONS_MAGAZINE_MIN ((size_t)256)
#define OPTIONS_MAGAZINE_MAX ((size_t)64 << 20)
#define OPTIONS_SLOW_CALL_MS_MAX 3600000u

/* Check cfg whatever it came from (origin: "MAGPIE_CONF" or
 * "magpie_init", for the message); unit: the device's mapping unit.
 * MAGPIE_OK, or MAGPIE_ERR_CONFIG naming the key and its accepted range. */
int options_check(const magpie_config *cfg, size_t unit, const char *origin);

#endif /* MAGPIE_INIT_H */
