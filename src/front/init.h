/* One-time set-up (init.c) and its configuration parser (options.c). */
#ifndef MAGPIE_INIT_H
#define MAGPIE_INIT_H

#include "front/global.h"

/* Parse MAGPIE_CONF / MAGPIE_BACKEND over cfg (options.c). */
int options_from_env(magpie_config *cfg);
/* Parse one "key=value,key=value" string over cfg (options.c). */
int options_parse(magpie_config *cfg, const char *conf);

#endif /* MAGPIE_INIT_H */
