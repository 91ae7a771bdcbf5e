#include <criterion/criterion.h>
Test(chat, placeholder) { cr_assert(1); }
