/* Spinlocks in libfabric shm regions whose owner died holding them: released.
 *
 * The shim looks at a peer's region lock before each fi_writedata and waits outside the provider
 * while it is held (shim.c), but that look and the provider's pthread_spin_lock are two steps:
 * a peer that takes its own lock in between and is killed holding it leaves our writer spinning
 * inside fi_writedata for good, holding the endpoint (seen in CI, and in about one of seven
 * receiver kills of the conformance suite run in a loop). Nothing takes that thread out but the
 * word turning free. So a watched lock is released here once the region's owner has exited (its
 * pidfd) and the word was held at every look for peer_held_ns: a live process holds it for
 * microseconds, and our senders stop posting to a dead peer within the shim's pid check
 * interval, so what holds it by then is the dead process. The release stores what
 * pthread_spin_unlock stores. The region is nobody's any more: the thread let in queues a
 * command nobody reads, comes back out, and the shim fails the peer as for any dead one.
 *
 * Our own region's lock is the mirror case: a peer writing to us holds it, and our poller may be
 * waiting for it inside fi_cq_read when that peer is killed. Who holds it the word does not say,
 * so it is released only when it was already held at the look that first saw a peer of ours
 * dead (or the next), and at every look since, for own_held_ns: held from about the moment a
 * peer died and for far longer than any live holder keeps a spinlock. Every look polls each
 * peer's pidfd, so a death is seen within a look; a dead peer's entry outlives its removal by
 * GONE_KEEP_NS (the shim removes a peer as soon as its control connection drops, i.e. at once).
 *
 * Its own mutex, never the endpoint's: that is what the spinning thread holds. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include "shmwatch.h"

#define GONE_KEEP_NS (10LL * 1000000000LL)

struct watched {
    uint64_t key;
    int own;                         /* our own region's lock: no pidfd, released for dead peers */
    int64_t removed;                 /* its peer was removed, its process dead: kept until then + GONE_KEEP_NS */
    int64_t exited_at;               /* the look that first saw its process gone */
    int pidfd, exited;
    int *lock; void *map; size_t maplen;
    int64_t held_since;              /* first look that found it held (since the last free one), or 0 */
    char region[64];
};

struct shmwatch {
    pthread_mutex_t mu;
    struct watched *v; size_t n, cap;
    int free_value;                  /* an unlocked pthread_spinlock_t (glibc x86-64: 1) */
};

shmwatch *shmwatch_new(int free_value) {
    shmwatch *w = calloc(1, sizeof *w);
    if (!w) return NULL;
    pthread_mutex_init(&w->mu, NULL);
    w->free_value = free_value;
    return w;
}

static void drop(struct watched *x) {
    if (x->pidfd >= 0) close(x->pidfd);
    if (x->map) munmap(x->map, x->maplen);
}

static int exited(struct watched *x) {
    if (!x->exited && x->pidfd >= 0) {
        struct pollfd q = { .fd = x->pidfd, .events = POLLIN };
        x->exited = poll(&q, 1, 0) > 0;
    }
    return x->exited;
}

static int64_t mono_ns(void) {
    struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void del_locked(shmwatch *w, uint64_t key) {
    for (size_t i = 0; i < w->n; i++) {
        struct watched *x = &w->v[i];
        if (x->key != key || x->removed) continue;
        if (!x->own && exited(x)) {  /* a tombstone: its lock is nobody's to release any more */
            x->removed = mono_ns();
            if (!x->exited_at) x->exited_at = x->removed;
            if (x->map) munmap(x->map, x->maplen);
            x->map = NULL; x->lock = NULL;
            return;
        }
        drop(x); w->v[i] = w->v[--w->n]; return;
    }
}

static int append_locked(shmwatch *w, struct watched x) {
    if (w->n == w->cap) {
        size_t cap = w->cap ? 2 * w->cap : 16;
        struct watched *v = realloc(w->v, cap * sizeof *v);
        if (!v) return -ENOMEM;
        w->v = v; w->cap = cap;
    }
    w->v[w->n++] = x;
    return 0;
}

int shm_map_page(const char *region, int64_t off, int writable, void **map, size_t *len) {
    long pg = sysconf(_SC_PAGESIZE);
    if (off < 0 || off % (int64_t)sizeof(int) || off + (int64_t)sizeof(int) > pg) return -EINVAL;
    int fd = shm_open(region, writable ? O_RDWR : O_RDONLY, 0);
    if (fd < 0) return -errno;
    struct stat st;
    int ret = fstat(fd, &st) ? -errno : st.st_size < off + (off_t)sizeof(int) ? -EINVAL : 0;
    void *m = ret ? MAP_FAILED : mmap(NULL, (size_t)pg, PROT_READ | (writable ? PROT_WRITE : 0), MAP_SHARED, fd, 0);
    if (!ret && m == MAP_FAILED) ret = -errno;
    close(fd);
    if (!ret) { *map = m; *len = (size_t)pg; }
    return ret;
}

static int add(shmwatch *w, uint64_t key, int own, int pidfd, const char *region, int64_t lock_off) {
    void *m = NULL; size_t len = 0;
    if (!w || (!own && pidfd < 0)) return -EINVAL;
    int ret = shm_map_page(region, lock_off, 1, &m, &len);
    if (ret) return ret;
    int dup_fd = own ? -1 : fcntl(pidfd, F_DUPFD_CLOEXEC, 0);
    if (!own && dup_fd < 0) { ret = -errno; munmap(m, len); return ret; }
    struct watched x = { .key = key, .own = own, .pidfd = dup_fd, .lock = (int *)((char *)m + lock_off),
                         .map = m, .maplen = len };
    snprintf(x.region, sizeof x.region, "%s", region);
    pthread_mutex_lock(&w->mu);
    del_locked(w, key);
    ret = append_locked(w, x);
    pthread_mutex_unlock(&w->mu);
    if (ret) drop(&x);
    return ret;
}

int shmwatch_add(shmwatch *w, uint64_t key, int pidfd, const char *region, int64_t lock_off) {
    return add(w, key, 0, pidfd, region, lock_off);
}

int shmwatch_add_own(shmwatch *w, const char *region, int64_t lock_off) {
    return add(w, SHMWATCH_OWN, 1, -1, region, lock_off);
}

void shmwatch_del(shmwatch *w, uint64_t key) {
    if (!w) return;
    pthread_mutex_lock(&w->mu);
    del_locked(w, key);
    pthread_mutex_unlock(&w->mu);
}

void shmwatch_clear(shmwatch *w) {
    if (!w) return;
    pthread_mutex_lock(&w->mu);
    for (size_t i = 0; i < w->n; i++) drop(&w->v[i]);
    w->n = 0;
    pthread_mutex_unlock(&w->mu);
}

void shmwatch_free(shmwatch *w) {
    if (!w) return;
    shmwatch_clear(w);
    free(w->v);
    pthread_mutex_destroy(&w->mu);
    free(w);
}

/* A peer that died while our lock was (about) already held since `held_since`, or NULL: one
 * first seen dead at a look no earlier than look_ns before the lock was first seen held. */
static struct watched *died_holding(shmwatch *w, int64_t held_since, int64_t look_ns) {
    for (size_t i = 0; i < w->n; i++) {
        struct watched *x = &w->v[i];
        if (!x->own && x->exited && x->exited_at + look_ns >= held_since) return x;
    }
    return NULL;
}

int shmwatch_release_dead(shmwatch *w, int64_t now, int64_t peer_held_ns, int64_t own_held_ns, int64_t look_ns,
                          char *msg, size_t msglen) {
    if (!w || pthread_mutex_trylock(&w->mu)) return 0;  /* busy adding or dropping one: next look */
    int released = 0;
    for (size_t i = 0; i < w->n;) {  /* tombstones past their time go first */
        if (w->v[i].removed && now - w->v[i].removed > GONE_KEEP_NS) { drop(&w->v[i]); w->v[i] = w->v[--w->n]; }
        else i++;
    }
    for (size_t i = 0; i < w->n; i++)  /* when each peer died, to a look */
        if (!w->v[i].own && !w->v[i].exited && exited(&w->v[i])) w->v[i].exited_at = now;
    for (size_t i = 0; i < w->n; i++) {
        struct watched *x = &w->v[i], *dead = NULL;
        if (!x->lock) continue;
        int word = __atomic_load_n(x->lock, __ATOMIC_ACQUIRE);
        if (word == w->free_value) { x->held_since = 0; continue; }
        if (!x->held_since) { x->held_since = now; continue; }
        if (now - x->held_since < (x->own ? own_held_ns : peer_held_ns)) continue;
        /* a live holder (stopped, say): not ours to release; the endpoint's stuck bound applies */
        if (x->own ? !(dead = died_holding(w, x->held_since, look_ns)) : !x->exited) continue;
        __atomic_store_n(x->lock, w->free_value, __ATOMIC_RELEASE);
        if (msg && msglen && x->own)
            snprintf(msg, msglen, "released this endpoint's own region lock (/dev/shm/%s): held at every look for "
                     "%.2f s while peer /dev/shm/%s has exited (our poller, waiting for it, comes back out)",
                     x->region, (now - x->held_since) / 1e9, dead->region);
        else if (msg && msglen)
            snprintf(msg, msglen, "released the spinlock of /dev/shm/%s: held at every look for %.2f s, and its "
                     "process has exited (a thread waiting for it inside the provider comes back out)",
                     x->region, (now - x->held_since) / 1e9);
        x->held_since = 0;
        released++;
    }
    pthread_mutex_unlock(&w->mu);
    return released;
}
