/* libfabric RDM shim: one endpoint, one CQ, one AV per shim_ep.
 * Locking: one mutex serialises every libfabric call on the endpoint, so we can
 * ask for FI_THREAD_DOMAIN (cheapest) while Python posts and polls from two threads.
 * Progress: manual-progress providers (tcp;ofi_rxm, verbs;ofi_rxm) only move data when the
 * CQ is read, so posting drains the CQ on -FI_EAGAIN, and idle polling yields:
 * on 2 vCPUs a spinning poller starves the peer's progress.
 * Lifetime: every entry point enters/leaves under the lock and counts itself in `users`;
 * shim_close marks the endpoint closing, waits until no caller is inside (a writer parked in
 * shim_post's back-off, the poller), then closes the fids. The struct itself (and its mutex)
 * stays valid until shim_free, so a Python thread that calls in after close gets a clean
 * -FI_ESHUTDOWN instead of touching freed memory.
 * Idle: once nothing has moved for IDLE_BLOCK_NS and no write of ours is in flight, the poller
 * blocks in poll(2) on the CQ's wait fd (fi_trywait first, as libfabric requires) and on an
 * eventfd that a post or close signals, so an idle endpoint costs no wake-ups and its Python
 * thread no GIL hand-offs; a provider without a wait fd keeps the back-off below.
 * Stuck: a thread that never comes back out of the provider keeps the mutex for good. Only the
 * poller waits for the mutex without bound; every other caller gives up with -SHIM_ESTUCK once the
 * holder has made no progress for SHIM_STUCK_MS, and so does shim_close, which then leaves the
 * endpoint to leak. Everything here goes through libfabric's public API (rdma/fi_*.h) only. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <pthread.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <unistd.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include "shim.h"

#define N_RECV 256
#define CQ_BATCH 64
#define POST_STALL_NS (10LL * 1000000000LL)
/* Traffic this recent keeps the poller in its back-off (a stream of layer writes has gaps of
 * a layer's compute); longer quiet and it blocks in the kernel until something arrives. */
#define IDLE_BLOCK_NS (20LL * 1000000LL)
#define STUCK_NS ((int64_t)SHIM_STUCK_MS * 1000000LL)
/* A bounded caller waits for the mutex in slices, and gives up once the holder has made no
 * progress for STUCK_NS (or, if holders keep changing without ever letting it in, after
 * ENTER_MAX_NS: starved that long is as good as stuck). */
#define LOCK_SLICE_NS (50LL * 1000000LL)
#define ENTER_MAX_NS (4 * STUCK_NS)
/* MR handles handed to Python: slot | generation << 32, so a handle kept past its
 * deregistration never resolves to a later registration that reused the slot. */
#define MR_SLOT(h) ((size_t)((h) & 0xffffffffu))
#define MR_GEN(h) ((uint32_t)((h) >> 32))

enum { OP_WRITE = 1, OP_RECV = 2 };

struct shim_batch;
struct shim_op { struct fi_context2 ctx; struct shim_batch *b; int kind; int unposted; };

struct shim_batch {
    struct shim_batch *next, *prev;
    uint64_t id, peer;
    size_t remaining, failed;
    int internal, abandoned, status;
    char msg[192];
    struct shim_op ops[];
};

struct imm_count { uint32_t tag; uint64_t count; };
/* A target-side error completion that carries our immediate: the request it belongs to
 * can be failed at once instead of at its deadline. */
struct tag_err { uint32_t tag; int status; char msg[192]; };
struct mr_slot { struct fid_mr *mr; void *buf; size_t len; void *desc; uint32_t gen; };

/* The peers in our AV that we may post to. */
struct peer_tab { uint64_t *v; size_t n, cap; };

struct shim_ep {
    pthread_mutex_t lock;
    pthread_cond_t idle;             /* signalled when `users` drops to 0 while closing */
    int users, closed;
    int closing;                     /* atomic: set by shim_close before it takes the lock */
    int stuck, stuck_claim;          /* atomic, sticky: see SHIM_ESTUCK; stuck_msg says why */
    char stuck_msg[160];
    int64_t held_since;              /* atomic: when the mutex's holder took it or last made progress */
    int slow;                        /* atomic: the holder is registering memory (pinning many GB on
                                      * verbs/efa takes seconds): long, not stuck */
    char name[256]; size_t namelen;  /* our address, fixed at open */
    size_t addrlen;                  /* length of our own address */
    uint32_t addr_format;            /* FI_ADDR_STR, FI_SOCKADDR_IN, ...: what a peer's must be */
    char scheme[32];                 /* FI_ADDR_STR: our "fi_xxx://" prefix */
    int n_unposted;                  /* receives whose re-post failed; retried on every drain */
    struct fi_info *info;
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    struct fid_av *av;
    struct fid_cq *cq;
    struct fid_ep *ep;
    shim_info si;
    struct mr_slot *mrs; size_t n_mrs;
    uint64_t forged;  /* completions with data that no remote write carried: dropped */
    struct shim_batch live;          /* sentinel of the list of batches in flight */
    struct shim_batch *done_head;    /* finished, not yet reported */
    struct imm_count *imms; size_t n_imms, cap_imms;
    struct shim_op recv_ops[N_RECV];
    char async_msg[192]; int async_status;
    int64_t last_activity;           /* ns; last post or completion, drives idle back-off */
    int wait_fd;                     /* the CQ's FI_WAIT_FD, or -1: the provider has none */
    int wake_fd;                     /* eventfd: a post or close wakes a blocked poller */
    int blocked;                     /* atomic: the poller is (about to be) in poll(2) */
    struct peer_tab postable;        /* in this endpoint's AV and not abandoned: posts to any other
                                      * address (a lost peer's, another endpoint's) are refused */
    struct tag_err *tag_errs; size_t n_tag_errs, cap_tag_errs;  /* failed remote writes, by tag */
};

static uint64_t *peer_find(struct peer_tab *t, uint64_t a) {
    for (size_t i = 0; i < t->n; i++) if (t->v[i] == a) return &t->v[i];
    return NULL;
}

static void peer_add(struct peer_tab *t, uint64_t a) {
    if (peer_find(t, a)) return;
    if (t->n == t->cap) {
        size_t cap = t->cap ? 2 * t->cap : 16;
        uint64_t *p = realloc(t->v, cap * sizeof *p);
        if (!p) return;  /* not postable: posts to it are refused */
        t->v = p; t->cap = cap;
    }
    t->v[t->n++] = a;
}

static void peer_del(struct peer_tab *t, uint64_t a) {
    uint64_t *p = peer_find(t, a);
    if (p) *p = t->v[--t->n];
}

static void set_err(char *err, size_t len, const char *what, int ret) {
    if (err && len) snprintf(err, len, "%s: %s (%d)", what, fi_strerror(ret < 0 ? -ret : ret), ret);
}

static int64_t now_ns(void) {
    struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int closing(shim_ep *e) { return __atomic_load_n(&e->closing, __ATOMIC_ACQUIRE); }

static void mark_held(shim_ep *e, int64_t t) { __atomic_store_n(&e->held_since, t, __ATOMIC_RELAXED); }

/* Progress (a post, a completion): also proof that the mutex's holder is not stuck. */
static void touch(shim_ep *e) {
    int64_t t = now_ns();
    __atomic_store_n(&e->last_activity, t, __ATOMIC_RELAXED);
    mark_held(e, t);
}

/* The first to find the endpoint stuck says why (`why`: a format taking the bound in seconds);
 * it stays stuck. */
static void declare_stuck(shim_ep *e, const char *why) {
    if (__atomic_exchange_n(&e->stuck_claim, 1, __ATOMIC_ACQ_REL)) return;
    snprintf(e->stuck_msg, sizeof e->stuck_msg, why, SHIM_STUCK_MS / 1000.0);
    __atomic_store_n(&e->stuck, 1, __ATOMIC_RELEASE);
}

static int stuck_err(shim_ep *e, char *err, size_t errlen) {
    if (err && errlen)
        snprintf(err, errlen, "endpoint stuck: %s", e->stuck_msg);
    return -SHIM_ESTUCK;
}

#define STUCK_INSIDE "a thread has been inside the provider for %g s, holding the endpoint"

/* Take the mutex for a caller other than the poller: 0, or -SHIM_ESTUCK once its holder has made
 * no progress for STUCK_NS (or this caller waited max_ns). */
static int lock_bounded(shim_ep *e, int64_t max_ns) {
    int64_t start = now_ns();
    for (;;) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        int64_t ns = ts.tv_nsec + LOCK_SLICE_NS;
        ts.tv_sec += ns / 1000000000LL; ts.tv_nsec = ns % 1000000000LL;
        int r = pthread_mutex_clocklock(&e->lock, CLOCK_MONOTONIC, &ts);
        int64_t now = now_ns();
        if (r == 0) { mark_held(e, now); return 0; }
        if (r != ETIMEDOUT) return -r;
        if (__atomic_load_n(&e->slow, __ATOMIC_RELAXED)) { start = now; continue; }
        if (now - __atomic_load_n(&e->held_since, __ATOMIC_RELAXED) >= STUCK_NS || now - start >= max_ns) {
            declare_stuck(e, STUCK_INSIDE);
            return -SHIM_ESTUCK;
        }
    }
}

/* Lock and count the caller in, unless the endpoint is closing or stuck: then nothing is locked.
 * Every entry point but shim_poll (the poller may wait: it is the one that would be stuck). */
static int enter(shim_ep *e, char *err, size_t errlen) {
    if (__atomic_load_n(&e->stuck, __ATOMIC_ACQUIRE)) return stuck_err(e, err, errlen);
    int ret = closing(e) ? -FI_ESHUTDOWN : lock_bounded(e, ENTER_MAX_NS);
    if (ret == -SHIM_ESTUCK) return stuck_err(e, err, errlen);
    if (ret) { set_err(err, errlen, ret == -FI_ESHUTDOWN ? "endpoint closed" : "pthread_mutex_clocklock", ret); return ret; }
    if (closing(e)) {
        pthread_mutex_unlock(&e->lock);
        set_err(err, errlen, "endpoint closed", -FI_ESHUTDOWN);
        return -FI_ESHUTDOWN;
    }
    e->users++;
    return 0;
}

static int enter_poller(shim_ep *e) {
    if (closing(e)) return -FI_ESHUTDOWN;
    pthread_mutex_lock(&e->lock);
    mark_held(e, now_ns());
    if (closing(e)) { pthread_mutex_unlock(&e->lock); return -FI_ESHUTDOWN; }
    e->users++;
    return 0;
}

static void leave(shim_ep *e) {
    if (--e->users == 0 && closing(e)) pthread_cond_broadcast(&e->idle);
    pthread_mutex_unlock(&e->lock);
}

static void list_del(struct shim_batch *b) { b->prev->next = b->next; b->next->prev = b->prev; }

static void batch_finished(shim_ep *e, struct shim_batch *b) {
    list_del(b);
    if (b->internal) return;           /* shim_bench owns it and is watching remaining */
    if (b->abandoned) { free(b); return; }
    b->next = e->done_head; e->done_head = b;
}

static void count_imm(shim_ep *e, uint32_t tag) {
    for (size_t i = e->n_imms; i-- > 0;)
        if (e->imms[i].tag == tag) { e->imms[i].count++; return; }
    if (e->n_imms == e->cap_imms) {
        size_t cap = e->cap_imms ? 2 * e->cap_imms : 64;
        struct imm_count *p = realloc(e->imms, cap * sizeof *p);
        if (!p) return;  /* counted as missing: the receiver's deadline reports it */
        e->imms = p; e->cap_imms = cap;
    }
    e->imms[e->n_imms].tag = tag; e->imms[e->n_imms].count = 1; e->n_imms++;
}

static void set_async(shim_ep *e, int status, const char *fmt, const char *a, const char *b) {
    if (e->async_status) return;  /* the first one explains; later ones are usually its echo */
    e->async_status = status ? status : FI_EOTHER;
    snprintf(e->async_msg, sizeof e->async_msg, fmt, a, b);
}

static void tag_failed(shim_ep *e, uint32_t tag, int status, const char *prov) {
    if (e->n_tag_errs == e->cap_tag_errs) {
        size_t cap = e->cap_tag_errs ? 2 * e->cap_tag_errs : 16;
        struct tag_err *p = realloc(e->tag_errs, cap * sizeof *p);
        if (!p) {  /* still surfaced, without the tag: its expectation fails at the deadline */
            set_async(e, status, "remote write failed: %s (%s)", fi_strerror(status), prov);
            return;
        }
        e->tag_errs = p; e->cap_tag_errs = cap;
    }
    struct tag_err *t = &e->tag_errs[e->n_tag_errs++];
    t->tag = tag; t->status = status ? status : FI_EOTHER;
    snprintf(t->msg, sizeof t->msg, "remote write failed: %s (%s)", fi_strerror(t->status), prov);
}

/* Returns libfabric's status. -FI_EAGAIN (receive queue momentarily full) leaves the
 * receive to be re-posted by the next drain; anything else is reported to Python. */
static int post_recv(shim_ep *e, struct shim_op *op) {
    op->kind = OP_RECV; op->b = NULL;
    ssize_t ret = fi_recv(e->ep, NULL, 0, NULL, FI_ADDR_UNSPEC, &op->ctx);
    if (ret == 0) {
        if (op->unposted) { op->unposted = 0; e->n_unposted--; }
        return 0;
    }
    if (!op->unposted) { op->unposted = 1; e->n_unposted++; }
    if (ret != -FI_EAGAIN)
        set_async(e, (int)-ret, "fi_recv (re-posting a receive for remote CQ data): %s%s",
                  fi_strerror((int)-ret), "");
    return (int)ret;
}

static void repost_recvs(shim_ep *e) {
    for (int i = 0; i < N_RECV && e->n_unposted; i++)
        if (e->recv_ops[i].unposted && post_recv(e, &e->recv_ops[i]) == -FI_EAGAIN) return;
}

static int is_recv_op(shim_ep *e, const struct shim_op *op) {
    return op >= e->recv_ops && op < e->recv_ops + N_RECV;
}

/* Caller holds the lock. Returns entries consumed. */
static int drain(shim_ep *e) {
    struct fi_cq_data_entry ent[CQ_BATCH];
    int total = 0;
    if (e->n_unposted) repost_recvs(e);
    for (;;) {
        ssize_t n = fi_cq_read(e->cq, ent, CQ_BATCH);
        if (n == -FI_EAGAIN) return total;
        if (n == -FI_EAVAIL) {
            struct fi_cq_err_entry ee; memset(&ee, 0, sizeof ee);
            ssize_t r = fi_cq_readerr(e->cq, &ee, 0);
            if (r <= 0) {  /* EAVAIL but no entry to read: surface it rather than spin on it */
                if (r < 0 && r != -FI_EAGAIN)
                    set_async(e, (int)-r, "fi_cq_readerr: %s%s", fi_strerror((int)-r), "");
                return total;
            }
            /* Target-side events (remote write, CQ data) carry no context of ours unless it
             * consumed one of our posted receives: never dereference theirs. */
            struct shim_op *op = ee.op_context;
            int remote = (ee.flags & (FI_REMOTE_WRITE | FI_REMOTE_CQ_DATA | FI_RECV)) != 0;
            if (!is_recv_op(e, op) && remote) op = NULL;
            char prov[128]; prov[0] = 0;
            fi_cq_strerror(e->cq, ee.prov_errno, ee.err_data, prov, sizeof prov);
            int status = ee.err ? ee.err : FI_EOTHER;
            if (op && op->kind == OP_WRITE) {
                struct shim_batch *b = op->b;
                if (!b->status) {
                    b->status = status;
                    snprintf(b->msg, sizeof b->msg, "fi_writedata completion: %s (%s)",
                             fi_strerror(b->status), prov);
                }
                b->failed++;
                if (--b->remaining == 0) batch_finished(e, b);
            } else {
                if (op && op->kind == OP_RECV && ee.err != FI_ECANCELED) post_recv(e, op);
                if ((ee.flags & FI_REMOTE_CQ_DATA) && (ee.flags & FI_REMOTE_WRITE))  /* the immediate names it */
                    tag_failed(e, (uint32_t)ee.data, status, prov);
                else if (ee.flags & FI_REMOTE_CQ_DATA)
                    e->forged++;  /* a failed message with data: not ours to count (see above) */
                else if (!(op && ee.err == FI_ECANCELED))
                    set_async(e, status, "cq error: %s (%s)", fi_strerror(status), prov);
            }
            total++;
            continue;
        }
        if (n < 0) {
            set_async(e, (int)-n, "fi_cq_read: %s%s", fi_strerror((int)-n), "");
            return total;
        }
        for (ssize_t i = 0; i < n; i++) {
            struct shim_op *op = ent[i].op_context;
            if ((ent[i].flags & FI_REMOTE_CQ_DATA) && !(ent[i].flags & FI_REMOTE_WRITE)) {
                /* A message carrying data (fi_senddata) needs no key: anyone reaching the
                 * endpoint can send one. Only a remote write, which proved a key, counts. */
                e->forged++;
                if (is_recv_op(e, op)) post_recv(e, op);
                continue;
            }
            if (ent[i].flags & FI_REMOTE_CQ_DATA) {
                count_imm(e, (uint32_t)ent[i].data);
                if (is_recv_op(e, op)) post_recv(e, op);
                continue;
            }
            if (ent[i].flags & (FI_REMOTE_WRITE | FI_RECV)) {
                if (is_recv_op(e, op)) post_recv(e, op);
                continue;
            }
            if (op && op->kind == OP_WRITE) {
                struct shim_batch *b = op->b;
                if (--b->remaining == 0) batch_finished(e, b);
            } else if (op && op->kind == OP_RECV) {
                post_recv(e, op);
            }
        }
        total += (int)n;
        touch(e);
        if (n < CQ_BATCH) return total;
    }
}

/* Nothing to do: yield while traffic is recent (latency), then sleep, longer the longer
 * we have been idle: even a yielding loop burns a core that the model needs. */
static void idle_wait(shim_ep *e) {
    int64_t idle = now_ns() - __atomic_load_n(&e->last_activity, __ATOMIC_RELAXED);
    if (idle < 1000000) { sched_yield(); return; }
    struct timespec ts = {0, idle < 20000000 ? 50000 : 500000};
    nanosleep(&ts, NULL);
}

static void close_fids(shim_ep *e);
static void wake_poller(shim_ep *e);

/* Frees the struct; only for an endpoint nobody else can reach (failed open, shim_free). */
static void destroy(shim_ep *e) {
    free(e->mrs); free(e->imms); free(e->postable.v); free(e->tag_errs);
    if (e->wake_fd >= 0) close(e->wake_fd);
    pthread_cond_destroy(&e->idle);
    pthread_mutex_destroy(&e->lock);
    free(e);
}

/* hmem: ask for FI_HMEM (and FI_MR_HMEM), i.e. an endpoint that may register device
 * memory. Only on request: a provider may answer FI_HMEM with other attributes, and a
 * listed FI_HMEM says nothing about a CUDA registration succeeding (Debian's 1.17 lists it
 * without CUDA support): shim_mr_reg is what tells. */
int shim_open(const char *prov, const char *node, int hmem, shim_ep **out, char *err, size_t errlen) {
    shim_ep *e = calloc(1, sizeof *e);
    struct fi_info *hints = fi_allocinfo();
    int ret;
    if (!e || !hints) { set_err(err, errlen, "alloc", -FI_ENOMEM); free(e); fi_freeinfo(hints); return -FI_ENOMEM; }
    pthread_mutex_init(&e->lock, NULL);
    pthread_cond_init(&e->idle, NULL);
    e->wait_fd = -1;
    e->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    e->live.next = e->live.prev = &e->live;
    hints->caps = FI_RMA | FI_WRITE | FI_REMOTE_WRITE | FI_MSG;
    hints->mode = FI_CONTEXT | FI_CONTEXT2 | FI_RX_CQ_DATA;
    hints->ep_attr->type = FI_EP_RDM;
    hints->domain_attr->threading = FI_THREAD_DOMAIN;
    hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED |
                                  FI_MR_PROV_KEY | FI_MR_ENDPOINT;
    if (hmem) {
        hints->caps |= FI_HMEM;
        hints->domain_attr->mr_mode |= FI_MR_HMEM;
    }
    hints->fabric_attr->prov_name = strdup(prov);
    ret = fi_getinfo(FI_VERSION(1, 17), node, NULL, node ? FI_SOURCE : 0, hints, &e->info);
    fi_freeinfo(hints);
    if (ret) { set_err(err, errlen, hmem ? "fi_getinfo(FI_HMEM)" : "fi_getinfo", ret); destroy(e); return ret; }
    struct fi_info *fi = e->info;
    if (fi->domain_attr->cq_data_size < 4) {  /* the tag must travel whole */
        ret = -FI_ENOSYS;
        snprintf(err, errlen, "provider %s carries %zu bytes of remote CQ data, need 4",
                 fi->fabric_attr->prov_name, fi->domain_attr->cq_data_size);
        goto fail;
    }
    if ((ret = fi_fabric(fi->fabric_attr, &e->fabric, NULL))) { set_err(err, errlen, "fi_fabric", ret); goto fail; }
    if ((ret = fi_domain(e->fabric, fi, &e->domain, NULL))) { set_err(err, errlen, "fi_domain", ret); goto fail; }
    struct fi_av_attr av_attr = { .type = FI_AV_UNSPEC };
    if ((ret = fi_av_open(e->domain, &av_attr, &e->av, NULL))) { set_err(err, errlen, "fi_av_open", ret); goto fail; }
    /* A wait fd lets the idle poller sleep in the kernel; a provider that has none (or an
     * eventfd we could not make) falls back to a CQ without one and the timed back-off. */
    struct fi_cq_attr cq_attr = { .format = FI_CQ_FORMAT_DATA, .wait_obj = FI_WAIT_FD };
    if (e->wake_fd < 0 || fi_cq_open(e->domain, &cq_attr, &e->cq, NULL) ||
        fi_control(&e->cq->fid, FI_GETWAIT, &e->wait_fd)) {
        if (e->cq) { fi_close(&e->cq->fid); e->cq = NULL; }
        e->wait_fd = -1;
        cq_attr.wait_obj = FI_WAIT_NONE;
        if ((ret = fi_cq_open(e->domain, &cq_attr, &e->cq, NULL))) { set_err(err, errlen, "fi_cq_open", ret); goto fail; }
    }
    if ((ret = fi_endpoint(e->domain, fi, &e->ep, NULL))) { set_err(err, errlen, "fi_endpoint", ret); goto fail; }
    if ((ret = fi_ep_bind(e->ep, &e->av->fid, 0))) { set_err(err, errlen, "fi_ep_bind(av)", ret); goto fail; }
    if ((ret = fi_ep_bind(e->ep, &e->cq->fid, FI_TRANSMIT | FI_RECV))) { set_err(err, errlen, "fi_ep_bind(cq)", ret); goto fail; }
    if ((ret = fi_enable(e->ep))) { set_err(err, errlen, "fi_enable", ret); goto fail; }
    /* Our own address length is the only length a peer of the same provider can have:
     * fi_av_insert reads exactly that many bytes from whatever a peer sent. */
    {
        char *name = e->name; size_t len = sizeof e->name;
        if ((ret = fi_getname(&e->ep->fid, name, &len))) { set_err(err, errlen, "fi_getname", ret); goto fail; }
        e->addrlen = e->namelen = len;
        e->addr_format = fi->addr_format;
        if (fi->addr_format == FI_ADDR_STR) {
            const char *sep = memchr(name, ':', len < sizeof e->scheme ? len : sizeof e->scheme - 1);
            if (sep) memcpy(e->scheme, name, (size_t)(sep - name));
        }
    }
    shim_info *si = &e->si;
    snprintf(si->prov, sizeof si->prov, "%s", fi->fabric_attr->prov_name);
    snprintf(si->fabric, sizeof si->fabric, "%s", fi->fabric_attr->name ? fi->fabric_attr->name : "");
    snprintf(si->domain, sizeof si->domain, "%s", fi->domain_attr->name ? fi->domain_attr->name : "");
    si->mr_mode = (uint64_t)fi->domain_attr->mr_mode;
    si->mode = fi->mode;
    si->max_msg_size = fi->ep_attr->max_msg_size;
    si->tx_size = fi->tx_attr->size;
    si->key_size = fi->domain_attr->mr_key_size;
    si->virt_addr = !!(fi->domain_attr->mr_mode & FI_MR_VIRT_ADDR);
    si->prov_key = !!(fi->domain_attr->mr_mode & FI_MR_PROV_KEY);
    si->mr_local = !!(fi->domain_attr->mr_mode & FI_MR_LOCAL);
    si->rx_cq_data = !!(fi->mode & FI_RX_CQ_DATA);
    si->hmem = !!(fi->caps & FI_HMEM);
    if (si->rx_cq_data)
        for (int i = 0; i < N_RECV; i++)
            if ((ret = post_recv(e, &e->recv_ops[i]))) {
                /* a receive queue smaller than N_RECV: run with what it took */
                if (ret == -FI_EAGAIN && i > 0) { e->recv_ops[i].unposted = 0; e->n_unposted = 0; break; }
                set_err(err, errlen, "fi_recv", ret); goto fail;
            }
    *out = e;
    return 0;
fail:
    close_fids(e);
    destroy(e);
    return ret;
}

int shim_get_info(shim_ep *e, shim_info *info) { *info = e->si; return 0; }

/* Fixed at open, so read without entering: a stuck endpoint still says who it was. */
int shim_getname(shim_ep *e, void *buf, size_t *len, char *err, size_t errlen) {
    if (*len < e->namelen) {
        *len = e->namelen;
        set_err(err, errlen, "fi_getname", -FI_ETOOSMALL);
        return -FI_ETOOSMALL;
    }
    memcpy(buf, e->name, e->namelen);
    *len = e->namelen;
    return 0;
}

/* A peer's address comes from its hello, i.e. from the network: check it is one our
 * provider can parse before fi_av_insert reads it (it reads as many bytes as its own
 * format implies, whatever we were sent). Returns 0 or -FI_EINVAL with `err` set. */
static int check_peer_addr(shim_ep *e, const unsigned char *a, size_t n, char *err, size_t errlen) {
    const char *why = NULL;
    size_t want = e->addrlen;
    switch (e->addr_format) {
    case FI_ADDR_STR:  /* "fi_xxx://...": NUL-terminated, variable length, our scheme */
        if (n < 2 || n > 256 || a[n - 1] != 0 || strlen((const char *)a) != n - 1)
            why = "is not a NUL-terminated address string of at most 256 bytes";
        else if (e->scheme[0] && strncmp((const char *)a, e->scheme, strlen(e->scheme)))
            why = "names another provider's scheme";
        break;
    case FI_SOCKADDR: case FI_SOCKADDR_IN: case FI_SOCKADDR_IN6: {
        sa_family_t fam = 0;
        if (n >= sizeof fam) memcpy(&fam, a, sizeof fam);
        want = fam == AF_INET ? sizeof(struct sockaddr_in) : fam == AF_INET6 ? sizeof(struct sockaddr_in6) : 0;
        if (!want || (e->addr_format == FI_SOCKADDR_IN && fam != AF_INET) ||
            (e->addr_format == FI_SOCKADDR_IN6 && fam != AF_INET6))
            why = "has an address family this provider does not use";
        else if (n != want)
            why = "has the wrong length for its address family";
        break;
    }
    default:           /* fixed-size provider formats (EFA, IB, ...): exactly our length */
        if (n != e->addrlen) why = "has the wrong length for this provider";
    }
    if (!why) return 0;
    if (err && errlen)
        snprintf(err, errlen, "peer address (%zu bytes) %s (%s addresses: format %u, ours %zu bytes); "
                 "different provider or corrupt hello", n, why, e->si.prov, e->addr_format, want);
    return -FI_EINVAL;
}

int shim_av_insert(shim_ep *e, const void *addr, size_t addrlen, uint64_t *fi_addr, char *err, size_t errlen) {
    fi_addr_t a = FI_ADDR_NOTAVAIL;
    int ret = check_peer_addr(e, addr, addrlen, err, errlen);
    if (ret) return ret;
    if ((ret = enter(e, err, errlen))) return ret;
    ret = fi_av_insert(e->av, addr, 1, &a, 0, NULL);
    if (ret == 1) peer_add(&e->postable, a);  /* a slot freed by fi_av_remove may come back */
    leave(e);
    if (ret != 1) {
        set_err(err, errlen, "fi_av_insert", ret < 0 ? ret : -FI_EADDRNOTAVAIL);
        return ret < 0 ? ret : -FI_EADDRNOTAVAIL;
    }
    *fi_addr = a;
    return 0;
}

int shim_av_remove(shim_ep *e, uint64_t fi_addr, char *err, size_t errlen) {
    fi_addr_t a = fi_addr;
    int ret = enter(e, err, errlen);
    if (ret) return ret;
    ret = fi_av_remove(e->av, &a, 1, 0);
    if (!ret) peer_del(&e->postable, a);
    leave(e);
    if (ret) set_err(err, errlen, "fi_av_remove", ret);
    return ret;
}

static const char *iface_name(int iface) {
    return iface == FI_HMEM_SYSTEM ? "FI_HMEM_SYSTEM" : iface == FI_HMEM_CUDA ? "FI_HMEM_CUDA" : "FI_HMEM_?";
}

int shim_mr_reg(shim_ep *e, void *buf, size_t len, int iface, int device, uint64_t *handle, uint64_t *key,
                uint64_t *base, char *err, size_t errlen) {
    struct fid_mr *mr = NULL;
    if (iface != FI_HMEM_SYSTEM && iface != FI_HMEM_CUDA) {
        set_err(err, errlen, "shim_mr_reg: unknown memory interface", -FI_EINVAL);
        return -FI_EINVAL;
    }
    int ret = enter(e, err, errlen);
    if (ret) return ret;
    if (iface != FI_HMEM_SYSTEM && !e->si.hmem) {
        ret = -FI_EOPNOTSUPP;
        if (err && errlen)
            snprintf(err, errlen, "fi_mr_regattr(%s): endpoint opened without FI_HMEM", iface_name(iface));
        goto out;
    }
    /* Keys we choose are random, never 1, 2, 3, ...: the key is what stands between a
     * region and anyone on the network who can reach the endpoint (the tcp provider takes
     * any connection, and without FI_MR_VIRT_ADDR addresses are offsets from 0). */
    uint64_t want = 0;
    if (!e->si.prov_key && getrandom(&want, sizeof want, 0) != (ssize_t)sizeof want) {
        ret = -FI_EIO;
        set_err(err, errlen, "getrandom (an MR key)", ret);
        goto out;
    }
    struct iovec iov = { .iov_base = buf, .iov_len = len };
    struct fi_mr_attr attr = { .mr_iov = &iov, .iov_count = 1, .access = FI_WRITE | FI_REMOTE_WRITE,
                               .requested_key = want, .iface = (enum fi_hmem_iface)iface };
    if (iface == FI_HMEM_CUDA) attr.device.cuda = device;
    __atomic_store_n(&e->slow, 1, __ATOMIC_RELAXED);  /* until `out` */
    ret = fi_mr_regattr(e->domain, &attr, 0, &mr);
    if (ret) {
        if (err && errlen)
            snprintf(err, errlen, "fi_mr_regattr(%s, device %d): %s (%d)", iface_name(iface),
                     iface == FI_HMEM_CUDA ? device : -1, fi_strerror(-ret), ret);
        goto out;
    }
    if (e->si.mr_mode & FI_MR_ENDPOINT) {
        if ((ret = fi_mr_bind(mr, &e->ep->fid, 0)) || (ret = fi_mr_enable(mr))) {
            set_err(err, errlen, "fi_mr_bind/enable", ret); fi_close(&mr->fid); goto out;
        }
    }
    size_t slot = e->n_mrs;
    for (size_t i = 0; i < e->n_mrs; i++) if (!e->mrs[i].mr) { slot = i; break; }
    if (slot == e->n_mrs) {
        struct mr_slot *p = realloc(e->mrs, (e->n_mrs + 1) * sizeof *p);
        if (!p) { ret = -FI_ENOMEM; set_err(err, errlen, "alloc", ret); fi_close(&mr->fid); goto out; }
        e->mrs = p; e->mrs[e->n_mrs].gen = 0; e->n_mrs++;
    }
    uint32_t gen = e->mrs[slot].gen;
    e->mrs[slot] = (struct mr_slot){ mr, buf, len, fi_mr_desc(mr), gen };
    *handle = (uint64_t)slot | ((uint64_t)gen << 32);
    *key = fi_mr_key(mr);
    *base = e->si.virt_addr ? (uint64_t)(uintptr_t)buf : 0;
out:
    __atomic_store_n(&e->slow, 0, __ATOMIC_RELAXED);
    touch(e);
    leave(e);
    return ret;
}

static struct mr_slot *mr_lookup(shim_ep *e, uint64_t handle) {
    size_t slot = MR_SLOT(handle);
    if (slot >= e->n_mrs || !e->mrs[slot].mr || e->mrs[slot].gen != MR_GEN(handle)) return NULL;
    return &e->mrs[slot];
}

int shim_mr_close(shim_ep *e, uint64_t handle, char *err, size_t errlen) {
    int ret = enter(e, err, errlen);
    if (ret) return ret;
    struct mr_slot *s = mr_lookup(e, handle);
    if (s) {
        __atomic_store_n(&e->slow, 1, __ATOMIC_RELAXED);
        ret = fi_close(&s->mr->fid);
        __atomic_store_n(&e->slow, 0, __ATOMIC_RELAXED);
        touch(e);
        s->mr = NULL;
        s->gen++;   /* stale handles (a batch built before this) no longer resolve */
        if (ret) set_err(err, errlen, "fi_close(mr)", ret);
    } else {
        ret = -FI_EINVAL;
        set_err(err, errlen, "fi_close(mr): no such registration", ret);
    }
    leave(e);
    return ret;
}

/* Caller is inside (enter). Returns 0 or a negative status with `err` set; *held = 0 when it
 * returns without the mutex (-SHIM_ESTUCK: it could not take it back after a back-off; the
 * endpoint is given up with `b` in it). */
static int post_locked(shim_ep *e, struct shim_batch *b, size_t n, const uint64_t *mr,
                       const uint64_t *src_off, const uint64_t *raddr, const uint64_t *rkey,
                       const uint64_t *len, uint32_t imm, int *held, char *err, size_t errlen) {
    *held = 1;
    b->remaining = n;
    touch(e);
    b->next = e->live.next; b->prev = &e->live; e->live.next->prev = b; e->live.next = b;
    for (size_t i = 0; i < n; i++) {
        struct mr_slot *s = mr_lookup(e, mr[i]);
        int ret = 0;
        if (!s) {
            ret = -FI_EINVAL;
            set_err(err, errlen, "shim_post: source region was deregistered", ret);
        } else if (src_off[i] + len[i] > s->len || src_off[i] + len[i] < src_off[i]) {
            ret = -FI_EINVAL;
            set_err(err, errlen, "shim_post: local range outside its region", ret);
        }
        struct shim_op *op = &b->ops[i];
        op->b = b; op->kind = OP_WRITE;
        int64_t stalled_since = 0;
        while (!ret) {
            /* Abandoned (the peer was lost) while we backed off: do not go in. */
            ssize_t r = b->abandoned ? -FI_EAGAIN
                      : fi_writedata(e->ep, (char *)s->buf + src_off[i], len[i], s->desc,
                                     imm, b->peer, raddr[i], rkey[i], &op->ctx);
            if (r == 0) break;
            /* A queue that stays full means the peer stopped answering: give up when
             * Python abandoned the peer (control channel EOF) or after POST_STALL_NS. */
            if (r == -FI_EAGAIN && (b->abandoned ||
                (stalled_since && now_ns() - stalled_since > POST_STALL_NS)))
                r = b->abandoned ? -FI_ECONNRESET : -FI_ETIMEDOUT;
            if (r != -FI_EAGAIN) {
                set_err(err, errlen, b->abandoned ? "fi_writedata (peer lost while the queue was full)"
                                                  : "fi_writedata", (int)r);
                ret = (int)r;
                break;
            }
            if (drain(e) == 0) {  /* queue full and nothing completed: let the peer run */
                if (!stalled_since) stalled_since = now_ns();
                pthread_mutex_unlock(&e->lock);
                idle_wait(e);
                if (lock_bounded(e, ENTER_MAX_NS)) { *held = 0; return stuck_err(e, err, errlen); }
                /* close() waits for us (we are counted in `users`), but must not wait
                 * out POST_STALL_NS: stop posting and let it proceed. */
                if (closing(e)) {
                    ret = -FI_ECANCELED;
                    set_err(err, errlen, "fi_writedata: endpoint closed while the queue was full", ret);
                }
                else if (__atomic_load_n(&e->stuck, __ATOMIC_ACQUIRE)) {
                    ret = stuck_err(e, err, errlen);
                }
                /* a region deregistered while we were unlocked must not be read from */
                else if (!(s = mr_lookup(e, mr[i]))) {
                    ret = -FI_EINVAL;
                    set_err(err, errlen, "shim_post: source region was deregistered", ret);
                }
                else if (!peer_find(&e->postable, b->peer)) {  /* dropped while we were unlocked */
                    ret = -FI_ECONNRESET;
                    set_err(err, errlen, "fi_writedata (peer lost while the queue was full)", ret);
                }
            } else {
                stalled_since = 0;
            }
        }
        if (ret) {
            /* ops 0..i-1 are with the provider: their completions free the batch, silently */
            b->remaining -= n - i;
            if (b->remaining == 0) { list_del(b); free(b); }
            else { b->internal = 0; b->abandoned = 1; }
            return ret;
        }
    }
    return 0;
}

static struct shim_batch *new_batch(uint64_t id, uint64_t peer, size_t n) {
    struct shim_batch *b = calloc(1, sizeof *b + n * sizeof(struct shim_op));
    if (b) { b->id = id; b->peer = peer; }
    return b;
}

int shim_post(shim_ep *e, uint64_t batch_id, uint64_t peer, size_t n,
              const uint64_t *mr, const uint64_t *src_off, const uint64_t *raddr,
              const uint64_t *rkey, const uint64_t *len, uint32_t imm, char *err, size_t errlen) {
    struct shim_batch *b = new_batch(batch_id, peer, n);
    if (!b) { set_err(err, errlen, "alloc", -FI_ENOMEM); return -FI_ENOMEM; }
    int ret = enter(e, err, errlen);
    if (ret) { free(b); return ret; }
    if (!peer_find(&e->postable, peer)) {
        /* Lost between Python's check and here, or an address of another endpoint (ours was
         * replaced after the caller read it; a provider may answer -FI_EAGAIN for an address
         * it cannot use, so posting would stall, not fail): post nothing. */
        leave(e);
        free(b);
        set_err(err, errlen, "shim_post: peer was lost or is not in this endpoint's address vector",
                -FI_EADDRNOTAVAIL);
        return -FI_EADDRNOTAVAIL;
    }
    int held = 1;
    ret = n ? post_locked(e, b, n, mr, src_off, raddr, rkey, len, imm, &held, err, errlen) : 0;
    if (n == 0) { b->next = e->done_head; e->done_head = b; }
    if (held) leave(e);
    /* its completions (and, on manual-progress providers, its data) need the poller */
    wake_poller(e);
    return ret;
}

static int collect(shim_ep *e, shim_event *ev, int cap) {
    int k = 0;
    while (k < cap && e->done_head) {
        struct shim_batch *b = e->done_head;
        e->done_head = b->next;
        shim_event *v = &ev[k++];
        memset(v, 0, sizeof *v);
        v->kind = 1; v->id = b->id; v->status = b->status; v->count = b->failed;
        memcpy(v->msg, b->msg, sizeof v->msg);
        free(b);
    }
    while (k < cap && e->n_imms) {
        struct imm_count *c = &e->imms[--e->n_imms];
        shim_event *v = &ev[k++];
        memset(v, 0, sizeof *v);
        v->kind = 2; v->tag = c->tag; v->count = c->count;
    }
    while (k < cap && e->n_tag_errs) {
        struct tag_err *t = &e->tag_errs[--e->n_tag_errs];
        shim_event *v = &ev[k++];
        memset(v, 0, sizeof *v);
        v->kind = 4; v->tag = t->tag; v->status = t->status;
        memcpy(v->msg, t->msg, sizeof v->msg);
    }
    if (k < cap && e->async_status) {
        shim_event *v = &ev[k++];
        memset(v, 0, sizeof *v);
        v->kind = 3; v->status = e->async_status;
        memcpy(v->msg, e->async_msg, sizeof v->msg);
        e->async_status = 0;
    }
    return k;
}

/* Caller holds the lock, found nothing to do. Whether the poller may sleep in the kernel:
 * quiet for IDLE_BLOCK_NS, none of our writes in flight (their completions need our
 * progress calls on manual-progress providers), and libfabric agrees (fi_trywait). */
static int may_block(shim_ep *e) {
    if (e->wait_fd < 0 || e->live.next != &e->live || e->n_unposted) return 0;
    if (now_ns() - __atomic_load_n(&e->last_activity, __ATOMIC_RELAXED) < IDLE_BLOCK_NS) return 0;
    __atomic_store_n(&e->blocked, 1, __ATOMIC_SEQ_CST);
    struct fid *f = &e->cq->fid;
    if (fi_trywait(e->fabric, &f, 1) == FI_SUCCESS) return 1;
    __atomic_store_n(&e->blocked, 0, __ATOMIC_SEQ_CST);
    return 0;
}

static void wake_poller(shim_ep *e) {
    uint64_t one = 1;
    if (__atomic_load_n(&e->blocked, __ATOMIC_SEQ_CST) && e->wake_fd >= 0)
        (void)!write(e->wake_fd, &one, sizeof one);
}

/* Outside the lock: until the CQ's fd or the eventfd is readable, or `end`. */
static void block_until(shim_ep *e, int wait_fd, int64_t end) {
    struct pollfd fds[2] = { { wait_fd, POLLIN, 0 }, { e->wake_fd, POLLIN, 0 } };
    int64_t left = end - now_ns();
    if (left > 0 && !closing(e)) (void)poll(fds, 2, (int)((left + 999999) / 1000000));
    uint64_t v;
    if (fds[1].revents & POLLIN) (void)!read(e->wake_fd, &v, sizeof v);
    __atomic_store_n(&e->blocked, 0, __ATOMIC_SEQ_CST);
}

int shim_poll(shim_ep *e, shim_event *ev, int cap, int timeout_us) {
    int64_t end = now_ns() + (int64_t)timeout_us * 1000;
    for (;;) {
        if (enter_poller(e)) return -FI_ESHUTDOWN;
        int got = drain(e);
        int k = collect(e, ev, cap);
        int block = !k && !got && may_block(e);
        int wait_fd = e->wait_fd;
        leave(e);
        if (k) return k;
        if (now_ns() >= end) { if (block) __atomic_store_n(&e->blocked, 0, __ATOMIC_SEQ_CST); return 0; }
        if (block) block_until(e, wait_fd, end);
        else if (!got) idle_wait(e);
    }
}

/* Entry points that answer a count: -SHIM_ESTUCK when stuck, 0 when closed. */
static int enter_count(shim_ep *e) {
    int ret = enter(e, NULL, 0);
    return ret == -SHIM_ESTUCK ? ret : ret ? 1 : 0;
}

int shim_abandon_peer(shim_ep *e, uint64_t peer) {
    int k = 0, ret = enter_count(e);
    if (ret) return ret < 0 ? ret : 0;
    peer_del(&e->postable, peer);
    /* Count batches abandoned earlier (expired) too: their writes are still the provider's,
     * whose completions may still name the peer's address: it must stay in the AV until they
     * are done, just the same. */
    for (struct shim_batch *b = e->live.next; b != &e->live; b = b->next)
        if (b->peer == peer) { if (!b->internal) b->abandoned = 1; k++; }
    leave(e);
    return k;
}

int shim_abandon_batch(shim_ep *e, uint64_t batch_id) {
    int k = 0, ret = enter_count(e);
    if (ret) return ret < 0 ? ret : 0;
    /* Its writes still belong to the provider (their contexts live in the batch), so it
     * cannot be freed now: mark it to be freed, unreported, when the last one completes. */
    for (struct shim_batch *b = e->live.next; b != &e->live; b = b->next)
        if (b->id == batch_id && !b->internal && !b->abandoned) { b->abandoned = 1; k = 1; break; }
    for (struct shim_batch **pp = &e->done_head; *pp; pp = &(*pp)->next)
        if ((*pp)->id == batch_id) { struct shim_batch *b = *pp; *pp = b->next; free(b); k = 1; break; }
    leave(e);
    return k;
}

int shim_check(shim_ep *e) {
    if (__atomic_load_n(&e->stuck, __ATOMIC_ACQUIRE)) return -SHIM_ESTUCK;
    if (closing(e) || __atomic_load_n(&e->slow, __ATOMIC_RELAXED)) return 0;
    if (pthread_mutex_trylock(&e->lock) == 0) { pthread_mutex_unlock(&e->lock); return 0; }
    if (now_ns() - __atomic_load_n(&e->held_since, __ATOMIC_RELAXED) < STUCK_NS) return 0;
    declare_stuck(e, STUCK_INSIDE);
    return -SHIM_ESTUCK;
}

int shim_live_batches(shim_ep *e) {
    int k = 0, ret = enter_count(e);
    if (ret) return ret < 0 ? ret : 0;
    for (struct shim_batch *b = e->live.next; b != &e->live; b = b->next) k++;
    for (struct shim_batch *b = e->done_head; b; b = b->next) k++;
    leave(e);
    return k;
}

int64_t shim_bench(shim_ep *e, uint64_t peer, size_t n, const uint64_t *mr,
                   const uint64_t *src_off, const uint64_t *raddr, const uint64_t *rkey,
                   const uint64_t *len, uint32_t imm, int iters, int64_t *lat_ns,
                   char *err, size_t errlen) {
    int64_t t0 = now_ns();
    for (int it = 0; it < iters; it++) {
        int64_t t1 = now_ns();
        struct shim_batch *b = new_batch(0, peer, n);
        if (!b) { set_err(err, errlen, "alloc", -FI_ENOMEM); return -FI_ENOMEM; }
        b->internal = 1;  /* never reported to Python; freed here */
        int ret = enter(e, err, errlen);
        if (ret) { free(b); return ret; }
        int held = 1;
        ret = post_locked(e, b, n, mr, src_off, raddr, rkey, len, imm, &held, err, errlen);
        if (ret) { if (held) leave(e); return ret; }
        while (b->remaining && !closing(e)) {
            if (drain(e) == 0) {
                pthread_mutex_unlock(&e->lock);
                idle_wait(e);
                if (lock_bounded(e, ENTER_MAX_NS)) return stuck_err(e, err, errlen);  /* b: given up with e */
            }
        }
        if (b->remaining) {  /* closing: the provider still owns its ops; close frees it */
            b->internal = 0; b->abandoned = 1;
            leave(e);
            set_err(err, errlen, "shim_bench: endpoint closed", -FI_ECANCELED);
            return -FI_ECANCELED;
        }
        int status = b->status;
        if (status) snprintf(err, errlen, "%s", b->msg);
        free(b);
        leave(e);
        if (status) return -status;
        if (lat_ns) lat_ns[it] = now_ns() - t1;
    }
    return now_ns() - t0;
}

/* Caller holds the lock (or owns `e` alone) and nobody else is inside. */
static void close_fids(shim_ep *e) {
    for (size_t i = 0; i < e->n_mrs; i++) if (e->mrs[i].mr) { fi_close(&e->mrs[i].mr->fid); e->mrs[i].mr = NULL; }
    if (e->ep) fi_close(&e->ep->fid);
    if (e->av) fi_close(&e->av->fid);
    if (e->cq) fi_close(&e->cq->fid);
    if (e->domain) fi_close(&e->domain->fid);
    if (e->fabric) fi_close(&e->fabric->fid);
    if (e->info) fi_freeinfo(e->info);
    e->ep = NULL; e->av = NULL; e->cq = NULL; e->domain = NULL; e->fabric = NULL; e->info = NULL;
    /* in-flight ops died with the endpoint: free their batches */
    while (e->live.next != &e->live) { struct shim_batch *b = e->live.next; list_del(b); free(b); }
    while (e->done_head) { struct shim_batch *b = e->done_head; e->done_head = b->next; free(b); }
    e->n_imms = 0; e->n_tag_errs = 0; e->async_status = 0;
}

int shim_close(shim_ep *e) {
    if (!e) return 0;
    /* refuse new callers, even while a stuck one holds the mutex; those inside notice it and leave */
    __atomic_store_n(&e->closing, 1, __ATOMIC_SEQ_CST);
    wake_poller(e);
    int ret = lock_bounded(e, STUCK_NS);
    if (ret) return ret;
    int64_t end = now_ns() + STUCK_NS;
    struct timespec ts = { end / 1000000000LL, end % 1000000000LL };
    while (e->users && now_ns() < end) pthread_cond_clockwait(&e->idle, &e->lock, CLOCK_MONOTONIC, &ts);
    if (e->users) {  /* one gave up on the mutex (stuck) without leaving, or never comes back */
        pthread_mutex_unlock(&e->lock);
        return -SHIM_ESTUCK;
    }
    if (!e->closed) { close_fids(e); e->closed = 1; }
    pthread_mutex_unlock(&e->lock);
    return 0;
}

void shim_free(shim_ep *e) {
    if (!e) return;
    if (shim_close(e) == 0) destroy(e);  /* else a thread is (stuck) inside: leak it */
}
