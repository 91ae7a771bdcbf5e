/* ssd.c — the SSD tier (ssd.h): O_DIRECT block files through io_uring. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <liburing.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>
#include <xxhash.h>

#include "common/log.h"
#include "kvstore/ssd.h"
#include "kvstore/tier.h"

#define ALIGN 4096u
#define HDR_BYTES 4096u
#define HDR_MAGIC "TDKVBLK1"
#define MAN_MAGIC "TDKVMAN1"

typedef struct hdr {
    char magic[8];
    uint64_t lo, hi, digest, block_bytes;
    uint64_t check; /* XXH3-64 of the fields above */
} hdr_t;

typedef struct found {
    uint32_t slot;
    td_block_name_t name;
    uint64_t digest;
} found_t;

struct kv_ssd {
    char dir[256];
    uint64_t capacity, bytes;
    int fd;
    bool direct;
    struct io_uring ring;
    bool ring_up;
    size_t block_bytes, slot_bytes;
    uint32_t n_slots, *free_stack, n_free;
    uint8_t *hdr_buf, *stage; /* aligned */
    td_kv_layout_t files_contract;
    bool have;
    found_t *found;
    uint32_t n_found;
    uint64_t checksum_errors;
    bool stuck; /* an I/O passed its deadline: no more I/O */
};

static size_t round_up(size_t n) { return (n + ALIGN - 1) / ALIGN * ALIGN; }

static uint64_t hdr_check(const hdr_t *h) { return XXH3_64bits(h, offsetof(hdr_t, check)); }

#define IO_DEADLINE_S 10 /* one block's I/O; past it the I/O is cancelled and the tier stops */

/* One I/O, waited for at most IO_DEADLINE_S: a disk that does not answer is
 * cancelled and the tier is marked stuck (every later I/O fails at once,
 * saying so) rather than holding the node's lock forever. A late completion
 * of an abandoned read or write can only change bytes that every reader
 * checks against their digest. */
static td_status_t io(kv_ssd_t *s, bool write, struct iovec *iov, unsigned n, off_t off, size_t want)
{
    if (s->stuck)
        return td_error(TD_ERR_IO, "kvstore ssd: %s/blocks stopped answering earlier: the SSD tier is off", s->dir);
    struct io_uring_sqe *sqe = io_uring_get_sqe(&s->ring);
    if (!sqe)
        return td_error(TD_ERR_IO, "kvstore ssd: no io_uring submission entry");
    if (write)
        io_uring_prep_writev(sqe, s->fd, iov, n, off);
    else
        io_uring_prep_readv(sqe, s->fd, iov, n, off);
    io_uring_sqe_set_data64(sqe, 1);
    int rc = io_uring_submit(&s->ring);
    struct io_uring_cqe *cqe = NULL;
    struct __kernel_timespec ts = {.tv_sec = IO_DEADLINE_S};
    if (rc >= 0)
        rc = io_uring_wait_cqe_timeout(&s->ring, &cqe, &ts);
    if (rc == -ETIME) {
        struct io_uring_sqe *c = io_uring_get_sqe(&s->ring);
        if (c) {
            io_uring_prep_cancel64(c, 1, 0);
            io_uring_sqe_set_data64(c, 2);
            io_uring_submit(&s->ring);
        }
        s->stuck = true; /* whatever the cancel does: this disk is not answering in time */
        return td_error(TD_ERR_IO, "kvstore ssd: %s %s/blocks at %lld did not complete in %d s: cancelled, the SSD tier "
                        "is off", write ? "writing" : "reading", s->dir, (long long)off, IO_DEADLINE_S);
    }
    if (rc < 0)
        return td_error(TD_ERR_IO, "kvstore ssd: io_uring: %s", strerror(-rc));
    int res = cqe->res;
    io_uring_cqe_seen(&s->ring, cqe);
    if (res < 0)
        return td_error(TD_ERR_IO, "kvstore ssd: %s %s/blocks at %lld: %s", write ? "writing" : "reading", s->dir,
                        (long long)off, strerror(-res));
    if ((size_t)res != want)
        return td_error(TD_ERR_IO, "kvstore ssd: %s %s/blocks at %lld: %d of %zu bytes", write ? "writing" : "reading",
                        s->dir, (long long)off, res, want);
    return TD_OK;
}

static void path_of(const kv_ssd_t *s, const char *name, char *out, size_t cap)
{
    snprintf(out, cap, "%s/%s", s->dir, name);
}

/* tier.json: the contract and slot size the files were cut for. */
static bool read_tier(kv_ssd_t *s, char *why, size_t cap)
{
    char p[600];
    path_of(s, "tier.json", p, sizeof p);
    json_error_t err;
    json_t *j = json_load_file(p, 0, &err);
    if (!j) {
        snprintf(why, cap, "%s: %s", p, err.text);
        return false;
    }
    bool ok = td_kv_layout_from_json(json_object_get(j, "contract"), &s->files_contract) == TD_OK;
    json_int_t sb = json_integer_value(json_object_get(j, "slot_bytes"));
    if (!ok || sb <= 0) {
        snprintf(why, cap, "%s: %s", p, ok ? "no slot_bytes" : td_last_error());
        json_decref(j);
        return false;
    }
    s->slot_bytes = (size_t)sb;
    s->block_bytes = td_kv_block_bytes(&s->files_contract);
    json_decref(j);
    return s->slot_bytes == HDR_BYTES + round_up(s->block_bytes);
}

/* The manifest: magic, count, then (slot, lo, hi, digest) each, then the
 * XXH3-64 of everything before it. */
static bool read_manifest(kv_ssd_t *s, char *why, size_t cap)
{
    char p[600];
    path_of(s, "manifest", p, sizeof p);
    FILE *f = fopen(p, "rb");
    if (!f) {
        snprintf(why, cap, "no manifest (%s: %s)", p, strerror(errno));
        return false;
    }
    struct stat st;
    uint8_t *b = NULL;
    bool ok = false;
    if (fstat(fileno(f), &st) == 0 && st.st_size >= 24 && (b = malloc((size_t)st.st_size)) &&
        fread(b, 1, (size_t)st.st_size, f) == (size_t)st.st_size) {
        size_t len = (size_t)st.st_size;
        uint64_t n, sum;
        memcpy(&n, b + 8, 8);
        memcpy(&sum, b + len - 8, 8);
        if (memcmp(b, MAN_MAGIC, 8))
            snprintf(why, cap, "%s: not a manifest (bad magic)", p);
        else if (n > (len - 24) / 28 || 16 + n * 28 + 8 != len)
            snprintf(why, cap, "%s: torn (%zu bytes for %llu blocks)", p, len, (unsigned long long)n);
        else if (XXH3_64bits(b, len - 8) != sum)
            snprintf(why, cap, "%s: corrupt (checksum mismatch)", p);
        else if ((s->found = calloc(n + 1, sizeof *s->found))) {
            for (uint64_t i = 0; i < n; i++) {
                const uint8_t *e = b + 16 + i * 28;
                found_t *fo = &s->found[s->n_found++];
                memcpy(&fo->slot, e, 4);
                memcpy(&fo->name.lo, e + 4, 8);
                memcpy(&fo->name.hi, e + 12, 8);
                memcpy(&fo->digest, e + 20, 8);
            }
            ok = true;
        }
    } else {
        snprintf(why, cap, "%s: unreadable", p);
    }
    free(b);
    fclose(f);
    return ok;
}

/* Without a manifest: every slot's header says what it holds. */
static void scan_headers(kv_ssd_t *s, uint32_t n_slots)
{
    free(s->found);
    s->n_found = 0;
    if (!(s->found = calloc(n_slots + 1, sizeof *s->found)))
        return;
    for (uint32_t i = 0; i < n_slots; i++) {
        struct iovec iov = {s->hdr_buf, HDR_BYTES};
        if (io(s, false, &iov, 1, (off_t)i * s->slot_bytes, HDR_BYTES))
            break;
        hdr_t h;
        memcpy(&h, s->hdr_buf, sizeof h);
        if (memcmp(h.magic, HDR_MAGIC, 8) || h.check != hdr_check(&h) || h.block_bytes != s->block_bytes)
            continue;
        s->found[s->n_found++] = (found_t){i, {h.lo, h.hi}, h.digest};
    }
}

static td_status_t open_blocks(kv_ssd_t *s, bool create)
{
    char p[600];
    path_of(s, "blocks", p, sizeof p);
    int flags = O_RDWR | (create ? O_CREAT : 0);
    s->fd = open(p, flags | O_DIRECT, 0600);
    s->direct = s->fd >= 0;
    if (s->fd < 0 && errno == EINVAL) { /* a file system without O_DIRECT (tmpfs before Linux 6.6) */
        s->fd = open(p, flags, 0600);
        if (s->fd >= 0)
            TD_WARN("kvstore ssd: %s does not take O_DIRECT; the tier goes through the page cache", s->dir);
    }
    if (s->fd < 0)
        return td_error(TD_ERR_IO, "kvstore ssd: cannot open %s: %s", p, strerror(errno));
    return TD_OK;
}

td_status_t kv_ssd_open(const char *dir, uint64_t capacity, kv_ssd_t **out, td_kv_layout_t *l, bool *have)
{
    *have = false;
    kv_ssd_t *s = calloc(1, sizeof *s);
    if (!s)
        return td_error(TD_ERR_NO_MEMORY, "kvstore ssd: no memory");
    s->fd = -1;
    snprintf(s->dir, sizeof s->dir, "%s", dir);
    s->capacity = capacity;
    if (mkdir(dir, 0700) && errno != EEXIST) {
        free(s);
        return td_error(TD_ERR_IO, "kvstore ssd: cannot make %s: %s", dir, strerror(errno));
    }
    int rc = io_uring_queue_init(8, &s->ring, 0);
    if (rc < 0) {
        free(s);
        return td_error(TD_ERR_IO, "kvstore ssd: io_uring_queue_init: %s", strerror(-rc));
    }
    s->ring_up = true;
    if (posix_memalign((void **)&s->hdr_buf, ALIGN, HDR_BYTES)) {
        kv_ssd_close(s);
        return td_error(TD_ERR_NO_MEMORY, "kvstore ssd: no memory");
    }
    char why[1400];
    struct stat st;
    char p[600];
    path_of(s, "blocks", p, sizeof p);
    if (stat(p, &st) == 0 && read_tier(s, why, sizeof why)) {
        if (open_blocks(s, false)) {
            kv_ssd_close(s);
            return TD_ERR_IO;
        }
        uint32_t n = (uint32_t)((uint64_t)st.st_size / s->slot_bytes);
        if (!read_manifest(s, why, sizeof why)) {
            TD_WARN("kvstore ssd: %s; rebuilding the block list from the %u slots' headers", why, n);
            scan_headers(s, n);
        }
        *l = s->files_contract;
        *have = s->have = true;
    } else if (stat(p, &st) == 0) {
        TD_WARN("kvstore ssd: %s holds block files this node cannot read (%s): it starts cold", dir, why);
    }
    char m[600];
    path_of(s, "manifest", m, sizeof m);
    unlink(m); /* valid only for the clean stop that wrote it */
    *out = s;
    return TD_OK;
}

td_status_t kv_ssd_set_block_bytes(kv_ssd_t *s, const td_kv_layout_t *l, uint32_t *slots)
{
    size_t bb = td_kv_block_bytes(l);
    if (s->have && td_kv_contract_check(&s->files_contract, l, "the writer")) {
        TD_WARN("kvstore ssd: the files in %s hold another contract's blocks (%s): forgotten", s->dir, td_last_error());
        s->n_found = 0;
        s->have = false;
    }
    s->block_bytes = bb;
    s->slot_bytes = HDR_BYTES + round_up(bb);
    if (s->fd < 0 && open_blocks(s, true))
        return TD_ERR_IO;
    uint64_t n = s->capacity / s->slot_bytes;
    if (!n)
        return td_error(TD_ERR_CONFIG, "kvstore ssd: %llu bytes hold no block of %zu bytes",
                        (unsigned long long)s->capacity, s->slot_bytes);
    while (n && posix_fallocate(s->fd, 0, (off_t)(n * s->slot_bytes)) == ENOSPC)
        n /= 2;
    if (!n)
        return td_error(TD_ERR_IO, "kvstore ssd: the file system of %s has no room for one %zu-byte block", s->dir,
                        s->slot_bytes);
    if (n * s->slot_bytes < s->capacity / s->slot_bytes * s->slot_bytes)
        TD_WARN("kvstore ssd: %s has room for %llu blocks (%llu MiB), not the %llu MiB asked for: the tier is that "
                "size", s->dir, (unsigned long long)n, (unsigned long long)(n * s->slot_bytes >> 20),
                (unsigned long long)(s->capacity >> 20));
    s->n_slots = (uint32_t)n;
    s->bytes = n * s->slot_bytes;
    free(s->stage);
    s->stage = NULL;
    if (posix_memalign((void **)&s->stage, ALIGN, round_up(bb)) || !(s->free_stack = calloc(n, sizeof *s->free_stack)))
        return td_error(TD_ERR_NO_MEMORY, "kvstore ssd: no memory");
    uint8_t *used = calloc(n, 1);
    if (!used)
        return td_error(TD_ERR_NO_MEMORY, "kvstore ssd: no memory");
    uint32_t k = 0;
    for (uint32_t i = 0; i < s->n_found; i++)
        if (s->found[i].slot < n && !used[s->found[i].slot]) {
            used[s->found[i].slot] = 1;
            s->found[k++] = s->found[i];
        }
    s->n_found = k;
    for (uint32_t i = (uint32_t)n; i-- > 0;)
        if (!used[i])
            s->free_stack[s->n_free++] = i;
    free(used);
    json_t *j = json_pack("{s:o, s:I}", "contract", td_kv_layout_to_json(l), "slot_bytes", (json_int_t)s->slot_bytes);
    char p[600];
    path_of(s, "tier.json", p, sizeof p);
    int rc = j ? json_dump_file(j, p, JSON_COMPACT) : -1;
    json_decref(j);
    if (rc)
        return td_error(TD_ERR_IO, "kvstore ssd: cannot write %s", p);
    s->files_contract = *l;
    *slots = s->n_slots;
    return TD_OK;
}

uint32_t kv_ssd_restore(kv_ssd_t *s, void (*fn)(void *ctx, uint32_t slot, td_block_name_t name, uint64_t digest),
                        void *ctx)
{
    for (uint32_t i = 0; i < s->n_found; i++)
        fn(ctx, s->found[i].slot, s->found[i].name, s->found[i].digest);
    uint32_t n = s->n_found;
    free(s->found);
    s->found = NULL;
    s->n_found = 0;
    return n;
}

bool kv_ssd_take(kv_ssd_t *s, uint32_t *slot)
{
    if (!s->n_free)
        return false;
    *slot = s->free_stack[--s->n_free];
    return true;
}

void kv_ssd_free(kv_ssd_t *s, uint32_t slot) { s->free_stack[s->n_free++] = slot; }

/* The data's iovec: the caller's memory when O_DIRECT can take it as is,
 * else the aligned staging buffer. */
static bool direct_ok(const kv_ssd_t *s, const void *p)
{
    return s->block_bytes % ALIGN == 0 && (uintptr_t)p % ALIGN == 0;
}

td_status_t kv_ssd_write(kv_ssd_t *s, uint32_t slot, td_block_name_t name, uint64_t digest, const void *src)
{
    hdr_t h = {.lo = name.lo, .hi = name.hi, .digest = digest, .block_bytes = s->block_bytes};
    memcpy(h.magic, HDR_MAGIC, 8);
    h.check = hdr_check(&h);
    memset(s->hdr_buf, 0, HDR_BYTES);
    memcpy(s->hdr_buf, &h, sizeof h);
    struct iovec iov[2] = {{s->hdr_buf, HDR_BYTES}, {(void *)src, s->block_bytes}};
    if (!direct_ok(s, src)) {
        memcpy(s->stage, src, s->block_bytes);
        memset(s->stage + s->block_bytes, 0, round_up(s->block_bytes) - s->block_bytes);
        iov[1] = (struct iovec){s->stage, round_up(s->block_bytes)};
    }
    return io(s, true, iov, 2, (off_t)slot * s->slot_bytes, HDR_BYTES + iov[1].iov_len);
}

td_status_t kv_ssd_read(kv_ssd_t *s, uint32_t slot, td_block_name_t name, uint64_t digest, void *dst)
{
    struct iovec iov[2] = {{s->hdr_buf, HDR_BYTES}, {dst, s->block_bytes}};
    bool direct = direct_ok(s, dst);
    if (!direct)
        iov[1] = (struct iovec){s->stage, round_up(s->block_bytes)};
    td_status_t rc = io(s, false, iov, 2, (off_t)slot * s->slot_bytes, HDR_BYTES + iov[1].iov_len);
    if (rc)
        return rc;
    char hex[33];
    td_block_name_hex(name, hex);
    hdr_t h;
    memcpy(&h, s->hdr_buf, sizeof h);
    if (memcmp(h.magic, HDR_MAGIC, 8) || h.check != hdr_check(&h) || h.lo != name.lo || h.hi != name.hi) {
        s->checksum_errors++;
        return td_error(TD_ERR_FORMAT, "kvstore ssd: block %s: slot %u's header in %s/blocks does not name it", hex,
                        slot, s->dir);
    }
    const void *data = direct ? dst : s->stage;
    uint64_t d = td_kv_block_digest(data, s->block_bytes);
    if (d != digest || h.digest != digest) {
        s->checksum_errors++;
        return td_error(TD_ERR_FORMAT,
                        "kvstore ssd: block %s in slot %u of %s/blocks fails its checksum (digest %016llx, stored "
                        "%016llx)", hex, slot, s->dir, (unsigned long long)d, (unsigned long long)digest);
    }
    if (!direct)
        memcpy(dst, s->stage, s->block_bytes);
    return TD_OK;
}

typedef struct man_ctx {
    uint8_t *b;
    size_t n, cap;
} man_ctx_t;

static bool man_add(void *ctx, uint32_t id, kv_entry_t *e)
{
    (void)id;
    man_ctx_t *m = ctx;
    if (e->tier != KV_TIER_SSD || e->state != KV_READY || m->n + 28 > m->cap)
        return true;
    memcpy(m->b + m->n, &e->slot, 4);
    memcpy(m->b + m->n + 4, &e->name.lo, 8);
    memcpy(m->b + m->n + 12, &e->name.hi, 8);
    memcpy(m->b + m->n + 20, &e->digest, 8);
    m->n += 28;
    return true;
}

td_status_t kv_ssd_save_manifest(kv_ssd_t *s, kv_index_t *ix)
{
    if (s->fd >= 0 && fsync(s->fd))
        return td_error(TD_ERR_IO, "kvstore ssd: fsync %s/blocks: %s", s->dir, strerror(errno));
    man_ctx_t m = {.cap = 16 + (size_t)kv_index_tier_count(ix, KV_TIER_SSD) * 28 + 8};
    if (!(m.b = malloc(m.cap)))
        return td_error(TD_ERR_NO_MEMORY, "kvstore ssd: no memory for the manifest");
    memcpy(m.b, MAN_MAGIC, 8);
    m.n = 16;
    m.cap -= 8;
    kv_index_each(ix, 0, man_add, &m);
    uint64_t count = (m.n - 16) / 28, sum;
    memcpy(m.b + 8, &count, 8);
    sum = XXH3_64bits(m.b, m.n);
    memcpy(m.b + m.n, &sum, 8);
    m.n += 8;
    char p[600], tmp[620];
    path_of(s, "manifest", p, sizeof p);
    snprintf(tmp, sizeof tmp, "%s.tmp", p);
    FILE *f = fopen(tmp, "wb");
    bool ok = f && fwrite(m.b, 1, m.n, f) == m.n && fflush(f) == 0 && fsync(fileno(f)) == 0;
    if (f)
        ok = fclose(f) == 0 && ok;
    free(m.b);
    if (!ok || rename(tmp, p))
        return td_error(TD_ERR_IO, "kvstore ssd: cannot write %s: %s", p, strerror(errno));
    return TD_OK;
}

uint64_t kv_ssd_capacity(const kv_ssd_t *s) { return s->bytes ? s->bytes : s->capacity; }
uint64_t kv_ssd_checksum_errors(const kv_ssd_t *s) { return s->checksum_errors; }

void kv_ssd_close(kv_ssd_t *s)
{
    if (!s)
        return;
    if (s->fd >= 0)
        close(s->fd);
    if (s->ring_up)
        io_uring_queue_exit(&s->ring);
    free(s->hdr_buf);
    free(s->stage);
    free(s->free_stack);
    free(s->found);
    free(s);
}

/* ---- the SSD tier in the node's table (kvstore/tier.h) ---- */

static bool tier_take(void *t, uint32_t *slot) { return kv_ssd_take(t, slot); }
static void tier_give(void *t, uint32_t slot) { kv_ssd_free(t, slot); }

static td_status_t tier_write(void *t, uint32_t slot, td_block_name_t name, uint64_t digest, const void *src)
{
    return kv_ssd_write(t, slot, name, digest, src);
}

static td_status_t tier_read(void *t, uint32_t slot, td_block_name_t name, uint64_t digest, void *dst)
{
    return kv_ssd_read(t, slot, name, digest, dst);
}

static uint64_t tier_capacity(const void *t) { return kv_ssd_capacity(t); }
static uint64_t tier_bad_reads(const void *t) { return kv_ssd_checksum_errors(t); }

const kv_tier_ops_t kv_tier_ssd = {.name = "ssd", .take = tier_take, .give = tier_give, .write = tier_write,
                                   .read = tier_read, .capacity = tier_capacity, .bad_reads = tier_bad_reads,
                                   .read_gbps = 0.65 /* O_DIRECT reads through io_uring, then the get */};
