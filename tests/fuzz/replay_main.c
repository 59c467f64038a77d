/* Runs every file named on the command line (or in the directories named)
 * through the fuzz target once: the seed corpus as a regression test in
 * builds without libFuzzer. */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t n);

static int run_file(const char *path) {
  FILE *f = fopen(path, "rb");
  if (f == NULL) return -1;
  static uint8_t buf[1 << 20];
  size_t n = fread(buf, 1, sizeof buf, f);
  fclose(f);
  LLVMFuzzerTestOneInput(buf, n);
  return 0;
}

int main(int argc, char **argv) {
  int files = 0;
  for (int a = 1; a < argc; a++) {
    struct stat st;
    if (stat(argv[a], &st) != 0) {
      fprintf(stderr, "%s: not found\n", argv[a]);
      return 1;
    }
    if (!S_ISDIR(st.st_mode)) {
      if (run_file(argv[a]) != 0) return 1;
      files++;
      continue;
    }
    DIR *d = opendir(argv[a]);
    struct dirent *e;
    while (d != NULL && (e = readdir(d)) != NULL) {
      if (e->d_name[0] == '.') continue;
      char path[4096];
      snprintf(path, sizeof path, "%s/%s", argv[a], e->d_name);
      if (run_file(path) != 0) return 1;
      files++;
    }
    if (d) closedir(d);
  }
  printf("[==========] corpus replay\n[  PASSED  ] %d test(s).\n", files);
  return files > 0 ? 0 : 1;
}
