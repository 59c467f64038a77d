/* A minimal JSON reader for tests that parse magpie_snapshot_json's output
 * back: objects, arrays, strings without escapes beyond \" and \\, integers
 * and literals. Strict enough to reject malformed output (any syntax error
 * fails the parse). */
#ifndef MAGPIE_TESTS_JSON_MINI_H
#define MAGPIE_TESTS_JSON_MINI_H

#include <ctype.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { JM_NULL, JM_BOOL, JM_NUM, JM_STR, JM_ARR, JM_OBJ };

typedef struct jm {
  int type;
  unsigned long long num; /* JM_NUM (non-negative integers) / JM_BOOL */
  char *str;              /* JM_STR */
  size_t n;               /* JM_ARR / JM_OBJ: children */
  struct jm **kids;
  char **keys; /* JM_OBJ */
} jm;

typedef struct jm_parser {
  const char *p;
  int err;
} jm_parser;

static void jm_ws(jm_parser *ps) {
  while (isspace((unsigned char)*ps->p)) ps->p++;
}

static jm *jm_value(jm_parser *ps);

static char *jm_string(jm_parser *ps) {
  if (*ps->p != '"') {
    ps->err = 1;
    return NULL;
  }
  const char *s = ++ps->p;
  size_t len = 0;
  char *out = malloc(strlen(s) + 1);
  while (*ps->p && *ps->p != '"') {
    if (*ps->p == '\\') ps->p++;
    if (!*ps->p) break;
    out[len++] = *ps->p++;
  }
  if (*ps->p != '"') {
    ps->err = 1;
    free(out);
    return NULL;
  }
  ps->p++;
  out[len] = '\0';
  return out;
}

static void jm_add(jm *v, jm *kid, char *key) {
  v->kids = realloc(v->kids, (v->n + 1) * sizeof *v->kids);
  if (v->type == JM_OBJ) v->keys = realloc(v->keys, (v->n + 1) * sizeof *v->keys);
  v->kids[v->n] = kid;
  if (v->type == JM_OBJ) v->keys[v->n] = key;
  v->n++;
}

static jm *jm_value(jm_parser *ps) {
  jm_ws(ps);
  jm *v = calloc(1, sizeof *v);
  char c = *ps->p;
  if (c == '{' || c == '[') {
    v->type = c == '{' ? JM_OBJ : JM_ARR;
    char close = c == '{' ? '}' : ']';
    ps->p++;
    jm_ws(ps);
    if (*ps->p == close) {
      ps->p++;
      return v;
    }
    for (;;) {
      char *key = NULL;
      if (v->type == JM_OBJ) {
        jm_ws(ps);
        key = jm_string(ps);
        jm_ws(ps);
        if (ps->err || *ps->p != ':') {
          ps->err = 1;
          free(key);
          return v;
        }
        ps->p++;
      }
      jm *kid = jm_value(ps);
      jm_add(v, kid, key);
      if (ps->err) return v;
      jm_ws(ps);
      if (*ps->p == ',') {
        ps->p++;
        continue;
      }
      if (*ps->p == close) {
        ps->p++;
        return v;
      }
      ps->err = 1;
      return v;
    }
  }
  if (c == '"') {
    v->type = JM_STR;
    v->str = jm_string(ps);
    return v;
  }
  if (isdigit((unsigned char)c)) {
    v->type = JM_NUM;
    char *end = NULL;
    v->num = strtoull(ps->p, &end, 10);
    ps->p = end;
    return v;
  }
  if (strncmp(ps->p, "true", 4) == 0 || strncmp(ps->p, "false", 5) == 0) {
    v->type = JM_BOOL;
    v->num = c == 't';
    ps->p += c == 't' ? 4 : 5;
    return v;
  }
  if (strncmp(ps->p, "null", 4) == 0) {
    ps->p += 4;
    return v;
  }
  ps->err = 1;
  return v;
}

/* The parsed document, or NULL if text is not one well-formed value. */
static inline jm *jm_parse(const char *text) {
  jm_parser ps = {text, 0};
  jm *v = jm_value(&ps);
  jm_ws(&ps);
  if (ps.err || *ps.p != '\0') return NULL; /* leaked on failure: tests stop */
  return v;
}

static inline jm *jm_get(const jm *obj, const char *key) {
  if (obj == NULL || obj->type != JM_OBJ) return NULL;
  for (size_t i = 0; i < obj->n; i++)
    if (strcmp(obj->keys[i], key) == 0) return obj->kids[i];
  return NULL;
}

static inline unsigned long long jm_num(const jm *obj, const char *key) {
  const jm *v = jm_get(obj, key);
  return v && v->type == JM_NUM ? v->num : ~0ull;
}

static inline const char *jm_str(const jm *obj, const char *key) {
  const jm *v = jm_get(obj, key);
  return v && v->type == JM_STR ? v->str : "";
}

#endif
