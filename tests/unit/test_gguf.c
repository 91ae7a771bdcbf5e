#include <criterion/criterion.h>
Test(gguf, placeholder) { cr_assert(1); }
