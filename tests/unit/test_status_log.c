#include <criterion/criterion.h>
Test(status_log, placeholder) { cr_assert(1); }
