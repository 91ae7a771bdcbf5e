/* test_sched.c — the prompt orders (engine/sched.h) on hand-made queues:
 * skip-join levels and demotion, longest cached prefix first, priority and
 * the age bound over both, stability, and the names. The engine's use of
 * them (fewer prompt tokens computed, short before long, the cold tokens in
 * every order) is test_generate's. */
#include "tests/unit/helpers.h"

#include "engine/sched.h"

static eng_sched_config_t cfg(eng_order_t o)
{
    eng_sched_config_t c = eng_sched_config_default();
    c.order = o;
    return c;
}

/* the order of n items, as a string of their indices ("2 0 1") */
static const char *order(const eng_sched_config_t *c, const eng_sched_item_t *it, uint32_t n, double now)
{
    static char out[256];
    uint32_t idx[32], scratch[32];
    eng_sched_order(c, it, n, now, idx, scratch);
    size_t k = 0;
    out[0] = '\0';
    for (uint32_t i = 0; i < n; i++)
        k += (size_t)snprintf(out + k, sizeof out - k, i ? " %u" : "%u", idx[i]);
    return out;
}

TestSuite(sched);

Test(sched, names_parse_and_the_default_is_fcfs)
{
    eng_order_t o;
    cr_assert_eq(eng_sched_config_default().order, ENG_ORDER_FCFS);
    for (int i = 0; i < ENG_ORDER_COUNT; i++) {
        cr_assert(eng_order_parse(eng_order_name((eng_order_t)i), &o));
        cr_assert_eq(o, (eng_order_t)i);
    }
    cr_assert_str_eq(eng_order_name(ENG_ORDER_MLQ), "mlq");
    cr_assert(!eng_order_parse("lifo", &o));
    cr_assert(!eng_order_parse(NULL, &o));
}

/* quantum 256, 4 levels: level i holds quantum << i tokens */
Test(sched, skip_join_enters_the_level_whose_quantum_holds_the_prompt)
{
    eng_sched_config_t c = cfg(ENG_ORDER_MLQ);
    const struct { uint32_t entry, level; } want[] = {{1, 0},    {256, 0},  {257, 1},   {512, 1},
                                                      {513, 2},  {1024, 2}, {1025, 3},  {100000, 3}};
    for (size_t i = 0; i < sizeof want / sizeof *want; i++)
        cr_assert_eq(eng_sched_level(&c, want[i].entry, 0), want[i].level, "entry %u: level %u, not %u",
                     want[i].entry, eng_sched_level(&c, want[i].entry, 0), want[i].level);
}

Test(sched, a_prompt_drops_a_level_for_each_quantum_it_uses)
{
    eng_sched_config_t c = cfg(ENG_ORDER_MLQ);
    /* entered at 0: 256 served drops it to 1, 256 + 512 to 2, 256 + 512 + 1024 to 3, and there it stays */
    cr_assert_eq(eng_sched_level(&c, 100, 255), 0);
    cr_assert_eq(eng_sched_level(&c, 100, 256), 1);
    cr_assert_eq(eng_sched_level(&c, 100, 767), 1);
    cr_assert_eq(eng_sched_level(&c, 100, 768), 2);
    cr_assert_eq(eng_sched_level(&c, 100, 1792), 3);
    cr_assert_eq(eng_sched_level(&c, 100, 1u << 30), 3);
    /* entered at 2: its quantum there is 1024 */
    cr_assert_eq(eng_sched_level(&c, 900, 1023), 2);
    cr_assert_eq(eng_sched_level(&c, 900, 1024), 3);
    c.levels = 1; /* one level: fcfs */
    cr_assert_eq(eng_sched_level(&c, 100000, 100000), 0);
}

Test(sched, mlq_puts_short_prompts_before_a_long_one_under_way)
{
    eng_sched_config_t c = cfg(ENG_ORDER_MLQ);
    const eng_sched_item_t it[] = {
        {.arrived = 0, .started = true, .entry = 2000, .served = 512}, /* the long prompt, under way: level 3 */
        {.arrived = 1, .entry = 600},                                  /* level 2 */
        {.arrived = 2, .entry = 40},                                   /* level 0 */
        {.arrived = 3, .entry = 300},                                  /* level 1 */
        {.arrived = 4, .entry = 30},                                   /* level 0, after the first */
        {.arrived = 5, .entry = 100, .served = 300},                   /* entered at 0, used its quantum: 1 */
    };
    cr_assert_str_eq(order(&c, it, 6, 5), "2 4 3 5 1 0");
    c.order = ENG_ORDER_FCFS;
    cr_assert_str_eq(order(&c, it, 6, 5), "0 1 2 3 4 5");
}

Test(sched, mlq_keeps_a_higher_level_out_of_a_lower_levels_step)
{
    eng_sched_config_t c = cfg(ENG_ORDER_MLQ);
    const eng_sched_item_t chat = {.arrived = 9, .entry = 40}, doc = {.arrived = 9, .entry = 2000},
                           old_doc = {.arrived = 0, .entry = 2000}, chat2 = {.arrived = 9, .entry = 30};
    cr_assert(!eng_sched_joins(&c, &chat, &doc, 10));
    cr_assert(eng_sched_joins(&c, &chat, &chat2, 10));
    cr_assert(eng_sched_joins(&c, &doc, &chat, 10)); /* a lower level beside a higher one (a higher priority) */
    cr_assert(eng_sched_joins(&c, &chat, &old_doc, 11)); /* past the 10 s age bound */
    cr_assert(!eng_sched_waits_for_shared(&c));
    c.order = ENG_ORDER_CACHE; /* the other orders fill the step */
    cr_assert(eng_sched_joins(&c, &chat, &doc, 10) && eng_sched_waits_for_shared(&c));
    c.order = ENG_ORDER_FCFS;
    cr_assert(eng_sched_joins(&c, &chat, &doc, 10) && !eng_sched_waits_for_shared(&c));
}

Test(sched, cache_takes_the_prompt_under_way_then_the_longest_cached_prefix)
{
    eng_sched_config_t c = cfg(ENG_ORDER_CACHE);
    const eng_sched_item_t it[] = {
        {.arrived = 0, .cached = 0}, {.arrived = 1, .cached = 5}, {.arrived = 2, .started = true},
        {.arrived = 3, .cached = 9}, {.arrived = 4, .cached = 5}, {.arrived = 5, .cached = 0},
    };
    cr_assert_str_eq(order(&c, it, 6, 5), "2 3 1 4 0 5");
}

Test(sched, priority_first_then_the_age_bound_then_the_order)
{
    eng_sched_config_t c = cfg(ENG_ORDER_MLQ);
    c.age_s = 10;
    const eng_sched_item_t it[] = {
        {.arrived = 0, .entry = 5000},                /* long, waited 20 s: past the bound */
        {.arrived = 15, .entry = 10},                 /* short, 5 s */
        {.arrived = 16, .entry = 5000, .priority = 2}, /* long, but a higher priority */
        {.arrived = 5, .entry = 5000},                /* long, waited 15 s: past the bound, after the first */
        {.arrived = 17, .entry = 20},                 /* short */
    };
    cr_assert_str_eq(order(&c, it, 5, 20), "2 0 3 1 4");
    c.age_s = 0; /* no bound: the order alone */
    cr_assert_str_eq(order(&c, it, 5, 20), "2 1 4 0 3");
    c.order = ENG_ORDER_CACHE; /* nothing cached: priority, then arrival */
    cr_assert_str_eq(order(&c, it, 5, 20), "2 0 1 3 4");
}

/* a stable sort: 25 equals and a few that pass them, at sizes across the merge's widths */
Test(sched, equals_keep_arrival_order_at_every_size)
{
    eng_sched_config_t c = cfg(ENG_ORDER_CACHE);
    eng_sched_item_t it[32];
    for (uint32_t n = 1; n <= 32; n++) {
        for (uint32_t i = 0; i < n; i++)
            it[i] = (eng_sched_item_t){.arrived = 0.1 * i, .cached = i % 7 == 3 ? 4 : 1};
        uint32_t idx[32], scratch[32], k = 0;
        eng_sched_order(&c, it, n, 5, idx, scratch); /* none past the 10 s bound */
        uint32_t want[32];
        for (uint32_t i = 0; i < n; i++) /* first those with 4 cached blocks, in arrival order, then the rest */
            if (i % 7 == 3)
                want[k++] = i;
        for (uint32_t i = 0; i < n; i++)
            if (i % 7 != 3)
                want[k++] = i;
        for (uint32_t i = 0; i < n; i++)
            cr_assert_eq(idx[i], want[i], "n %u: place %u holds %u, not %u", n, i, idx[i], want[i]);
    }
}
