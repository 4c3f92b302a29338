/* Small C shim over libfabric used through cffi (API mode).
 * Everything on the data path (posting, CQ polling) lives here so that Python
 * pays once per batch, and every call may run with the GIL released.
 * This header is also the cffi cdef: keep it free of preprocessor logic. */

typedef struct shim_ep shim_ep;

/* SHIM_ESTUCK (negated) is what a call returns once the endpoint is stuck: a thread has been
 * inside the provider holding the endpoint for SHIM_STUCK_MS. Every caller but the poller waits
 * that long at most; the endpoint is of no use any more: replace it. Not a libfabric errno. */
enum { SHIM_ESTUCK = 4000, SHIM_STUCK_MS = 2000 };

typedef struct {
    /* kind 4: a remote write carrying `tag` failed here (target side), status + msg say why */
    int kind;          /* 1 = batch done, 2 = immediates counted, 3 = async error, 4 = tag failed */
    int status;        /* 0 or the libfabric errno of the first failed op */
    uint32_t tag;      /* immediate (kinds 2 and 4) */
    uint64_t id;       /* batch id (kind 1) */
    uint64_t count;    /* immediates (kind 2) or failed ops (kind 1) */
    char msg[192];     /* fi_strerror + provider text of the first failure */
} shim_event;

typedef struct {
    char prov[64];
    char fabric[64];
    char domain[64];
    uint64_t mr_mode;
    uint64_t mode;
    uint64_t max_msg_size;
    uint64_t tx_size;
    uint64_t key_size;
    int virt_addr;     /* remote addresses are virtual addresses, not offsets */
    int prov_key;      /* keys chosen by the provider */
    int mr_local;      /* local buffers need a registered descriptor */
    int rx_cq_data;    /* remote CQ data consumes a posted receive */
    int hmem;          /* opened with FI_HMEM: may register device memory (if the build can) */
} shim_info;

int shim_open(const char *prov, const char *node, int hmem, shim_ep **out, char *err, size_t errlen);
int shim_get_info(shim_ep *ep, shim_info *info);
int shim_getname(shim_ep *ep, void *buf, size_t *len, char *err, size_t errlen);
int shim_av_insert(shim_ep *ep, const void *addr, size_t addrlen, uint64_t *fi_addr, char *err, size_t errlen);
int shim_av_remove(shim_ep *ep, uint64_t fi_addr, char *err, size_t errlen);
/* iface: FI_HMEM_SYSTEM (0) or FI_HMEM_CUDA (1); device: the CUDA ordinal for CUDA */
int shim_mr_reg(shim_ep *ep, void *buf, size_t len, int iface, int device, uint64_t *handle, uint64_t *key,
                uint64_t *base, char *err, size_t errlen);
int shim_mr_close(shim_ep *ep, uint64_t handle, char *err, size_t errlen);
int shim_post(shim_ep *ep, uint64_t batch_id, uint64_t peer, size_t n,
              const uint64_t *mr, const uint64_t *src_off, const uint64_t *raddr,
              const uint64_t *rkey, const uint64_t *len, uint32_t imm, char *err, size_t errlen);
int shim_poll(shim_ep *ep, shim_event *ev, int cap, int timeout_us);
int shim_abandon_peer(shim_ep *ep, uint64_t peer);
int shim_abandon_batch(shim_ep *ep, uint64_t batch_id);
int shim_live_batches(shim_ep *ep);
/* For a watchdog, without waiting: -SHIM_ESTUCK if the endpoint is stuck (found so already, or
 * its mutex is held by a thread that made no progress for SHIM_STUCK_MS), else 0. */
int shim_check(shim_ep *ep);
int64_t shim_bench(shim_ep *ep, uint64_t peer, size_t n, const uint64_t *mr,
                   const uint64_t *src_off, const uint64_t *raddr, const uint64_t *rkey,
                   const uint64_t *len, uint32_t imm, int iters, int64_t *lat_ns,
                   char *err, size_t errlen);
/* shim_close: refuse new callers (-FI_ESHUTDOWN), close the fids once nobody is inside; 0, or
 * -SHIM_ESTUCK when a thread stayed inside SHIM_STUCK_MS: then nothing was closed (leak it).
 * shim_free: close if needed, then free (unless a thread is stuck inside); only when no thread
 * can call in any more. */
int shim_close(shim_ep *ep);
void shim_free(shim_ep *ep);
