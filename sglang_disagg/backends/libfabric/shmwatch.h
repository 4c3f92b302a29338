/* Spinlocks in libfabric shm regions whose owner died holding them: released (shmwatch.c).
 * Internal to the shim (not part of the cffi cdef). */
#ifndef SGLANG_DISAGG_SHMWATCH_H
#define SGLANG_DISAGG_SHMWATCH_H
#include <stddef.h>
#include <stdint.h>

typedef struct shmwatch shmwatch;

/* Map the first page of /dev/shm/<region> (read-only, or writable), checking that an int at
 * `off` lies in it and in the object: 0, or a negative errno. Shared with the shim's looks. */
int shm_map_page(const char *region, int64_t off, int writable, void **map, size_t *len);

shmwatch *shmwatch_new(int free_value);
void shmwatch_free(shmwatch *w);
/* Watch the lock at `lock_off` of /dev/shm/<region>, owned by the process behind `pidfd`
 * (duplicated here), under `key`. 0, or a negative errno (then nothing is watched). */
int shmwatch_add(shmwatch *w, uint64_t key, int pidfd, const char *region, int64_t lock_off);
/* Watch our own region's lock: released when held while a watched peer has exited. */
#define SHMWATCH_OWN UINT64_MAX
int shmwatch_add_own(shmwatch *w, const char *region, int64_t lock_off);
/* Stop watching `key`'s lock; a peer whose process has exited is remembered a while (shmwatch.c). */
void shmwatch_del(shmwatch *w, uint64_t key);
void shmwatch_clear(shmwatch *w);
/* One look, every look_ns or so: release each peer's lock whose owner has exited and that was
 * held at every look for peer_held_ns, and our own when held at every look for own_held_ns from
 * about when a peer died; returns how many, `msg` naming the last one. Never waits. */
int shmwatch_release_dead(shmwatch *w, int64_t now_ns, int64_t peer_held_ns, int64_t own_held_ns,
                          int64_t look_ns, char *msg, size_t msglen);

#endif
