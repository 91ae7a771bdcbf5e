/* test_swap.c — the engine's swap space (engine/swap.h): taken once, regions
 * handed out first fit and given back, the swap-or-recompute choice. */
#include <criterion/criterion.h>

#include "engine/swap.h"
#include "kernels/backend.h"
#include "tests/unit/helpers.h"

Test(swap, regions_first_fit_and_given_back)
{
    kern_backend_t *be;
    cr_assert_eq(kern_cpu_backend_create(1, &be), TD_OK);
    eng_swap_t sw;
    eng_swap_init(&sw, be, 1000);
    cr_assert_null(sw.arena, "the space is taken at the first region, not before");
    uint8_t *a = eng_swap_take(&sw, 300), *b = eng_swap_take(&sw, 300), *c = eng_swap_take(&sw, 300);
    cr_assert(a && b && c);
    cr_assert_eq(a, sw.arena);
    cr_assert_eq(b, a + 300);
    cr_assert_eq(c, a + 600);
    cr_assert_null(eng_swap_take(&sw, 200), "100 bytes left: 200 does not fit");
    cr_assert_eq(sw.used, 900);
    eng_swap_give(&sw, b); /* a gap of 300 between a and c */
    cr_assert_eq(sw.used, 600);
    cr_assert_null(eng_swap_take(&sw, 400), "no gap of 400");
    uint8_t *d = eng_swap_take(&sw, 200), *e = eng_swap_take(&sw, 100), *f = eng_swap_take(&sw, 100);
    cr_assert_eq(d, a + 300, "the first gap that holds it");
    cr_assert_eq(e, a + 500, "the rest of that gap");
    cr_assert_eq(f, a + 900, "after the last region");
    cr_assert_null(eng_swap_take(&sw, 1), "full");
    eng_swap_give(&sw, a);
    eng_swap_give(&sw, c);
    eng_swap_give(&sw, d);
    eng_swap_give(&sw, e);
    eng_swap_give(&sw, f);
    cr_assert_eq(sw.used, 0);
    cr_assert_eq(sw.n_held, 0);
    cr_assert_eq(eng_swap_take(&sw, 1000), sw.arena, "all of it again once every region is back");
    eng_swap_destroy(&sw);
    kern_backend_destroy(be);
}

Test(swap, worth_it_only_with_room_and_when_the_copy_is_faster)
{
    kern_backend_t *be;
    cr_assert_eq(kern_cpu_backend_create(1, &be), TD_OK);
    eng_swap_t sw;
    eng_swap_init(&sw, be, 1 << 20);
    cr_assert(eng_swap_worth(&sw, 1000, 0), "no measure of recomputing yet: swap");
    cr_assert_not(eng_swap_worth(&sw, (1 << 20) + 1, 0), "past the space");
    sw.s_per_byte = 1e-6; /* a 1,000-byte round trip: 1 ms */
    cr_assert(eng_swap_worth(&sw, 1000, 2e-3));
    cr_assert_not(eng_swap_worth(&sw, 1000, 0.5e-3), "recomputing is faster");
    eng_swap_timed(&sw, 1000, 1e-3); /* measured: 2e-6 s a byte's round trip, smoothed in at 0.2 */
    cr_assert_float_eq(sw.s_per_byte, 0.8e-6 + 0.2 * 2e-6, 1e-12);
    eng_swap_t off;
    eng_swap_init(&off, be, 0);
    cr_assert_not(eng_swap_worth(&off, 1000, 1.0), "no space: never");
    cr_assert_null(eng_swap_take(&off, 1000));
    eng_swap_destroy(&off);
    eng_swap_destroy(&sw);
    kern_backend_destroy(be);
}
