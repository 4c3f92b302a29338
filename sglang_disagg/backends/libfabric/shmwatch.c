/* Spinlocks in libfabric shm regions whose owner died holding them: released.
 *
 * The shim looks at a peer's region lock before each fi_writedata and waits outside the provider
 * while it is held (shim.c), but that look and the provider's pthread_spin_lock are two steps:
 * a peer that takes its own lock in between and is killed holding it leaves our writer spinning
 * inside fi_writedata for good, holding the endpoint (seen in CI, and in about one of seven
 * receiver kills of the conformance suite run in a loop). Nothing takes that thread out but the
 * word turning free. So a watched lock is released here once the region's owner has exited (its
 * pidfd) and the word was held at every look for min_held_ns: a live process holds it for
 * microseconds, and our senders stop posting to a dead peer within the shim's pid check
 * interval, so what holds it by then is the dead process. The release stores what
 * pthread_spin_unlock stores. The region is nobody's any more: the thread let in queues a
 * command nobody reads, comes back out, and the shim fails the peer as for any dead one.
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
#include <unistd.h>
#include "shmwatch.h"

struct watched {
    uint64_t key;
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

static void del_locked(shmwatch *w, uint64_t key) {
    for (size_t i = 0; i < w->n; i++)
        if (w->v[i].key == key) { drop(&w->v[i]); w->v[i] = w->v[--w->n]; return; }
}

int shmwatch_add(shmwatch *w, uint64_t key, int pidfd, const char *region, int64_t lock_off) {
    long pg = sysconf(_SC_PAGESIZE);
    if (!w || pidfd < 0 || lock_off < 0 || lock_off % (int64_t)sizeof(int) || lock_off + (int64_t)sizeof(int) > pg)
        return -EINVAL;
    int fd = shm_open(region, O_RDWR, 0);
    if (fd < 0) return -errno;
    void *m = mmap(NULL, (size_t)pg, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int ret = m == MAP_FAILED ? -errno : 0;
    close(fd);
    if (ret) return ret;
    int dup_fd = fcntl(pidfd, F_DUPFD_CLOEXEC, 0);
    if (dup_fd < 0) { ret = -errno; munmap(m, (size_t)pg); return ret; }
    pthread_mutex_lock(&w->mu);
    del_locked(w, key);
    if (w->n == w->cap) {
        size_t cap = w->cap ? 2 * w->cap : 16;
        struct watched *v = realloc(w->v, cap * sizeof *v);
        if (!v) { pthread_mutex_unlock(&w->mu); close(dup_fd); munmap(m, (size_t)pg); return -ENOMEM; }
        w->v = v; w->cap = cap;
    }
    struct watched *x = &w->v[w->n++];
    *x = (struct watched){ .key = key, .pidfd = dup_fd, .lock = (int *)((char *)m + lock_off),
                           .map = m, .maplen = (size_t)pg };
    snprintf(x->region, sizeof x->region, "%s", region);
    pthread_mutex_unlock(&w->mu);
    return 0;
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

int shmwatch_release_dead(shmwatch *w, int64_t now, int64_t min_held_ns, char *msg, size_t msglen) {
    if (!w || pthread_mutex_trylock(&w->mu)) return 0;  /* busy adding or dropping one: next look */
    int released = 0;
    for (size_t i = 0; i < w->n; i++) {
        struct watched *x = &w->v[i];
        int word = __atomic_load_n(x->lock, __ATOMIC_ACQUIRE);
        if (word == w->free_value) { x->held_since = 0; continue; }
        if (!x->held_since) { x->held_since = now; continue; }
        if (now - x->held_since < min_held_ns) continue;
        if (!x->exited) {
            struct pollfd q = { .fd = x->pidfd, .events = POLLIN };
            x->exited = poll(&q, 1, 0) > 0;
        }
        if (!x->exited) continue;  /* a live owner (stopped, say): the endpoint's stuck bound applies */
        __atomic_store_n(x->lock, w->free_value, __ATOMIC_RELEASE);
        if (msg && msglen)
            snprintf(msg, msglen, "released the spinlock of /dev/shm/%s: held at every look for %.2f s, and its "
                     "process has exited (a thread waiting for it inside the provider comes back out)",
                     x->region, (now - x->held_since) / 1e9);
        x->held_since = 0;
        released++;
    }
    pthread_mutex_unlock(&w->mu);
    return released;
}
