// The one doctest main linked into every test executable (test_main OBJECT library).
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
