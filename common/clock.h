/* clock.h — time as the rest of the code wants it: seconds since an arbitrary
 * start on the monotonic clock (intervals, deadlines), sleeping for seconds,
 * "s seconds from now" as the CLOCK_REALTIME timespec that
 * pthread_cond_timedwait takes, and wall-clock instants that cross processes
 * and hosts (Unix ms) turned into td_now_s()'s clock. Header-only. */
#ifndef TD_CLOCK_H
#define TD_CLOCK_H

#include <stdint.h>
#include <time.h>

static inline double td_now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static inline void td_sleep_s(double s)
{
    if (s <= 0)
        return;
    struct timespec t = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    while (nanosleep(&t, &t) != 0) /* resumes after a signal */
        ;
}

/* The instant s seconds (>= 0) from now on clock c, as a timespec. */
static inline struct timespec td_deadline_on(clockid_t c, double s)
{
    struct timespec t;
    clock_gettime(c, &t);
    if (!(s >= 0))
        s = 0;
    if (s > 1e8)
        s = 1e8;
    t.tv_sec += (time_t)s;
    t.tv_nsec += (long)((s - (double)(time_t)s) * 1e9);
    if (t.tv_nsec >= 1000000000L) {
        t.tv_sec++;
        t.tv_nsec -= 1000000000L;
    }
    return t;
}

/* The CLOCK_REALTIME instant s seconds (>= 0) from now, for pthread_cond_timedwait. */
static inline struct timespec td_wall_deadline(double s) { return td_deadline_on(CLOCK_REALTIME, s); }

/* Now on the wall clock, in ms since the Unix epoch: for instants another
 * process (or host, its clock kept in step) must read. */
static inline uint64_t td_unix_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (uint64_t)t.tv_sec * 1000u + (uint64_t)t.tv_nsec / 1000000u;
}

/* The td_now_s() instant of the wall-clock instant unix_ms (in the past or
 * the future). */
static inline double td_local_of_unix_ms(uint64_t unix_ms)
{
    return td_now_s() + ((double)unix_ms - (double)td_unix_ms()) / 1e3;
}

#endif
