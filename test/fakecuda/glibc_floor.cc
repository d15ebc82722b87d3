// The simulated driver loads under glibc 2.31 too (Debian bullseye), so that
// the old-glibc test (test/deploy) runs the preload library against it there:
// its libc calls whose default version is newer are pinned to their oldest
// version (glibc_floor.h). libstdc++ stays dynamic: the
// old root's own libstdc++.so.6 (GCC 10, GLIBCXX_3.4.28) serves it.
#include <pthread.h>

#include "glibc_floor.h"

// libpthread before 2.34: the robust, process-shared mutex of the state file.
FAKECUDA_GLIBC_PIN(int, pthread_mutexattr_init, "GLIBC_2.2.5", (pthread_mutexattr_t * attr), (attr))
FAKECUDA_GLIBC_PIN(int, pthread_mutexattr_destroy, "GLIBC_2.2.5", (pthread_mutexattr_t * attr), (attr))
FAKECUDA_GLIBC_PIN(int, pthread_mutexattr_setpshared, "GLIBC_2.2.5", (pthread_mutexattr_t * attr, int shared),
                   (attr, shared))
FAKECUDA_GLIBC_PIN(int, pthread_mutexattr_setrobust, "GLIBC_2.12", (pthread_mutexattr_t * attr, int robust),
                   (attr, robust))
FAKECUDA_GLIBC_PIN(int, pthread_mutex_consistent, "GLIBC_2.12", (pthread_mutex_t * mutex), (mutex))
// The chaos reports' holdings list (observer.cc) never waits for the registries' lock.
FAKECUDA_GLIBC_PIN(int, pthread_mutex_trylock, "GLIBC_2.2.5", (pthread_mutex_t * mutex), (mutex))
// GLIBC_2.33.
FAKECUDA_GLIBC_STAT_BY_SYSCALL()
