/* Configuration from the environment: the one place MAGPIE_CONF and
 * MAGPIE_BACKEND are parsed.
 *
 *   MAGPIE_BACKEND = auto | cuda | sim
 *   MAGPIE_CONF    = key=value[,key=value...]
 *
 * | key            | default | meaning                                        |
 * |----------------|---------|------------------------------------------------|
 * | backend        | auto    | auto, cuda or sim (same as MAGPIE_BACKEND)     |
 * | check          | 0       | 1: detect double frees (an atomic per op)      |
 * | verbose        | 0       | 1: print statistics to stderr at exit          |
 * | magazine_bytes | 1m      | most bytes per magazine (2..64 blocks; they     |
 * |                |         | start smaller and grow where blocks flow out)  |
 * | limit          | none    | cap on reserved bytes per device, or N%        |
 * | release_threshold | keep all | cached bytes above this go back in the background |
 * | check_streams  | 0       | 1: simulated device checks stream order        |
 * | reuse_wait     | 1       | 0: reuse other streams' large blocks through a |
 * |                |         | stream wait only under memory pressure         |
 * | slow_call_ms   | 0       | N: report device calls taking N ms or more     |
 * | ipc            | 1       | 0: device memory not exportable to other       |
 * |                |         | processes (magpie_ipc_export refuses)          |
 *
 * Sizes take k, m, g suffixes (powers of 1024). */
#include <ctype.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "front/init.h"

static int options_size(const char *v, size_t *out) {
  /* Digits first: strtoull would take "-1" as 2^64 - 1. */
  if (!isdigit((unsigned char)*v)) return 0;
  char *end = NULL;
  errno = 0;
  unsigned long long n = strtoull(v, &end, 10);
  if (end == v || errno != 0) return 0;
  unsigned shift = 0;
  switch (tolower((unsigned char)*end)) {
  case 'k':
    shift = 10;
    end++;
    break;
  case 'm':
    shift = 20;
    end++;
    break;
  case 'g':
    shift = 30;
    end++;
    break;
  default: break;
  }
  if (*end != '\0') return 0;
  if (shift && n > (~0ull >> shift)) return 0;
  *out = (size_t)(n << shift);
  return 1;
}

static int options_bool(const char *v, int *out) {
  if (strcmp(v, "1") == 0 || strcmp(v, "true") == 0 || strcmp(v, "yes") == 0) *out = 1;
  else if (strcmp(v, "0") == 0 || strcmp(v, "false") == 0 || strcmp(v, "no") == 0) *out = 0;
  else return 0;
  return 1;
}

static int options_backend(const char *v, int *out) {
  if (strcmp(v, "auto") == 0) *out = MAGPIE_BACKEND_AUTO;
  else if (strcmp(v, "cuda") == 0) *out = MAGPIE_BACKEND_CUDA;
  else if (strcmp(v, "sim") == 0) *out = MAGPIE_BACKEND_SIM;
  else return 0;
  return 1;
}

/* bytes (with suffix) or N% of the device (1..100). */
static int options_limit(const char *v, size_t *bytes, unsigned *percent) {
  size_t n = strlen(v);
  if (n > 1 && v[n - 1] == '%') {
    char num[32];
    if (n - 1 >= sizeof num) return 0;
    memcpy(num, v, n - 1);
    num[n - 1] = '\0';
    size_t pct = 0;
    if (!options_size(num, &pct) || pct == 0 || pct > 100) return 0;
    *percent = (unsigned)pct;
    *bytes = 0;
    return 1;
  }
  if (!options_size(v, bytes)) return 0;
  *percent = 0;
  return 1;
}

static int options_set(magpie_config *cfg, const char *key, const char *val) {
  int ok;
  if (strcmp(key, "backend") == 0) ok = options_backend(val, &cfg->backend);
  else if (strcmp(key, "check") == 0) ok = options_bool(val, &cfg->check);
  else if (strcmp(key, "verbose") == 0) ok = options_bool(val, &cfg->verbose);
  else if (strcmp(key, "magazine_bytes") == 0) ok = options_size(val, &cfg->magazine_bytes);
  else if (strcmp(key, "limit") == 0) ok = options_limit(val, &cfg->limit, &cfg->limit_percent);
  else if (strcmp(key, "release_threshold") == 0) ok = options_size(val, &cfg->release_threshold);
  else if (strcmp(key, "check_streams") == 0) ok = options_bool(val, &cfg->check_streams);
  else if (strcmp(key, "reuse_wait") == 0) ok = options_bool(val, &cfg->reuse_wait);
  else if (strcmp(key, "ipc") == 0) ok = options_bool(val, &cfg->ipc);
  else if (strcmp(key, "slow_call_ms") == 0) {
    size_t ms = 0;
    ok = options_size(val, &ms) && ms <= OPTIONS_SLOW_CALL_MS_MAX;
    cfg->slow_call_ms = (unsigned)ms;
  } else
    return error_set(MAGPIE_ERR_CONFIG,
                     "MAGPIE_CONF: unknown key '%s' (known: backend, check, verbose, magazine_bytes, limit, "
                     "release_threshold, check_streams, reuse_wait, slow_call_ms, ipc)",
                     key);
  if (!ok) return error_set(MAGPIE_ERR_CONFIG, "MAGPIE_CONF: bad value '%s' for key '%s'", val, key);
  return MAGPIE_OK;
}

int options_parse(magpie_config *cfg, const char *conf) {
  char buf[1024];
  if (strlen(conf) >= sizeof buf)
    return error_set(MAGPIE_ERR_CONFIG, "MAGPIE_CONF: longer than %zu characters", sizeof buf - 1);
  strcpy(buf, conf);
  char *save = NULL;
  for (char *item = strtok_r(buf, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
    while (isspace((unsigned char)*item)) item++;
    if (*item == '\0') continue;
    char *eq = strchr(item, '=');
    if (eq == NULL) return error_set(MAGPIE_ERR_CONFIG, "MAGPIE_CONF: '%s' is not key=value", item);
    *eq = '\0';
    char *val = eq + 1;
    /* Spaces around keys and values are ignored, before and after alike. */
    for (char *e = eq - 1; e >= item && isspace((unsigned char)*e); e--) *e = '\0';
    while (isspace((unsigned char)*val)) val++;
    for (char *e = val + strlen(val); e > val && isspace((unsigned char)e[-1]); e--) e[-1] = '\0';
    int rc = options_set(cfg, item, val);
    if (rc != MAGPIE_OK) return rc;
  }
  return MAGPIE_OK;
}

int options_from_env(magpie_config *cfg) {
  const char *conf = getenv("MAGPIE_CONF");
  if (conf != NULL) {
    int rc = options_parse(cfg, conf);
    if (rc != MAGPIE_OK) return rc;
  }
  const char *b = getenv("MAGPIE_BACKEND");
  if (b != NULL && *b != '\0' && !options_backend(b, &cfg->backend))
    return error_set(MAGPIE_ERR_CONFIG, "MAGPIE_BACKEND='%s': expected auto, cuda or sim", b);
  return MAGPIE_OK;
}

/* The one check of a configuration, from MAGPIE_CONF or from magpie_init
 * (origin names which in the message); unit is the device's mapping unit,
 * known once the backend is up. */
int options_check(const magpie_config *c, size_t unit, const char *origin) {
  const int *flags[] = {&c->check, &c->verbose, &c->check_streams, &c->reuse_wait, &c->ipc};
  const char *names[] = {"check", "verbose", "check_streams", "reuse_wait", "ipc"};
  for (unsigned i = 0; i < sizeof flags / sizeof flags[0]; i++)
    if (*flags[i] != 0 && *flags[i] != 1)
      return error_set(MAGPIE_ERR_CONFIG, "%s: %s=%d: expected 0 or 1", origin, names[i], *flags[i]);
  if (c->backend < MAGPIE_BACKEND_AUTO || c->backend > MAGPIE_BACKEND_SIM)
    return error_set(MAGPIE_ERR_CONFIG, "%s: backend=%d: expected auto (0), cuda (1) or sim (2)", origin, c->backend);
  if (c->magazine_bytes < OPTIONS_MAGAZINE_MIN || c->magazine_bytes > OPTIONS_MAGAZINE_MAX)
    return error_set(MAGPIE_ERR_CONFIG, "%s: magazine_bytes=%zu: expected %zu (256 bytes) to %zu (64 MiB)", origin,
                     c->magazine_bytes, OPTIONS_MAGAZINE_MIN, OPTIONS_MAGAZINE_MAX);
  if (c->limit_percent > 100)
    return error_set(MAGPIE_ERR_CONFIG, "%s: limit_percent=%u: expected 1 to 100 (0: no limit)", origin,
                     c->limit_percent);
  if (c->limit != 0 && c->limit_percent != 0)
    return error_set(MAGPIE_ERR_CONFIG, "%s: limit=%zu and limit_percent=%u: set one of them", origin, c->limit,
                     c->limit_percent);
  if (c->limit != 0 && c->limit < unit)
    return error_set(MAGPIE_ERR_CONFIG,
                     "%s: limit=%zu is below the %zu bytes (%zu MiB) in which magpie maps device memory; "
                     "give at least that much (0: no limit)",
                     origin, c->limit, unit, unit >> 20);
  if (c->slow_call_ms > OPTIONS_SLOW_CALL_MS_MAX)
    return error_set(MAGPIE_ERR_CONFIG, "%s: slow_call_ms=%u: expected 0 to %u", origin, c->slow_call_ms,
                     OPTIONS_SLOW_CALL_MS_MAX);
  return MAGPIE_OK;
}
