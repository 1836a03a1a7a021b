/* The version rule (MINIKV_VERSION_COMPATIBLE): a library serves a program compiled with this
 * header when it has the same major version and is not older. Checked on numbers around this
 * header's version, and on the library this test is linked with (the same tree's). Compiled
 * as C99 with -Wall -Wextra -pedantic -Werror: the macro must stay warning-free on the
 * uint32_t that minikv_version_number() returns. */
#include "minikv.h"

#include <stdint.h>
#include <stdio.h>

static int failures = 0;

static void expect(uint32_t loaded, int compatible) {
  if (!MINIKV_VERSION_COMPATIBLE(loaded) != !compatible) {
    fprintf(stderr, "MINIKV_VERSION_COMPATIBLE(%lu) should be %d (header %d)\n",
            (unsigned long)loaded, compatible, MINIKV_VERSION_NUMBER);
    ++failures;
  }
}

int main(void) {
  const uint32_t header = MINIKV_VERSION_NUMBER;
  const uint32_t major = MINIKV_VERSION_MAJOR;
  expect(header, 1);                      /* the same version */
  expect(header + 1, 1);                  /* a later patch */
  expect(header + 100, 1);                /* a later minor */
  expect(major * 10000 + 9999, 1);        /* the last version of this major */
  expect((major + 1) * 10000, 0);         /* the next major */
  expect((major + 1) * 10000 + header % 10000, 0);
  if (header % 10000 != 0) expect(header - 1, 0); /* older, same major */
  if (major > 0) expect(major * 10000 - 1, 0);    /* the previous major */
  if (!MINIKV_VERSION_COMPATIBLE(minikv_version_number())) {
    fprintf(stderr, "the library (%s) does not serve its own header (%d.%d.%d)\n",
            minikv_version_string(), MINIKV_VERSION_MAJOR, MINIKV_VERSION_MINOR,
            MINIKV_VERSION_PATCH);
    ++failures;
  }
  if (failures == 0) printf("version rule ok (header %d, library %s)\n", MINIKV_VERSION_NUMBER,
                            minikv_version_string());
  return failures == 0 ? 0 : 1;
}
