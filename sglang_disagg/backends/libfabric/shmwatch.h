/* Spinlocks in libfabric shm regions whose owner died holding them: released (shmwatch.c).
 * Internal to the shim (not part of the cffi cdef). */
#include <stddef.h>
#include <stdint.h>

typedef struct shmwatch shmwatch;

shmwatch *shmwatch_new(int free_value);
void shmwatch_free(shmwatch *w);
/* Watch the lock at `lock_off` of /dev/shm/<region>, owned by the process behind `pidfd`
 * (duplicated here), under `key`. 0, or a negative errno (then nothing is watched). */
int shmwatch_add(shmwatch *w, uint64_t key, int pidfd, const char *region, int64_t lock_off);
void shmwatch_del(shmwatch *w, uint64_t key);
void shmwatch_clear(shmwatch *w);
/* Release every watched lock whose owner has exited and that was held at every look for
 * min_held_ns; returns how many, `msg` naming the last one. Never waits. */
int shmwatch_release_dead(shmwatch *w, int64_t now_ns, int64_t min_held_ns, char *msg, size_t msglen);
