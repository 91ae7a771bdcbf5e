#include <criterion/criterion.h>
Test(tokenizer, placeholder) { cr_assert(1); }
