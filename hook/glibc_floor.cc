// The preload library's glibc floor: GLIBC_2.17 at most, no libstdc++
// (docs/deploy.md, "glibc floor"; the glibc_floor test reads the built
// library's version references). It is loaded into every program of a
// container, whatever glibc the image has.
//
// The libc functions the library (its shm and limiter archives included) calls
// whose default version is above the floor, pinned to their oldest version
// (see gpuslice/glibc_floor.h for how and why that is safe).
#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>

#include "gpuslice/glibc_floor.h"

// libpthread before 2.34.
GPUSLICE_GLIBC_PIN(int, pthread_create, "GLIBC_2.2.5",
                   (pthread_t * thread, const pthread_attr_t* attr, void* (*start)(void*), void* arg),
                   (thread, attr, start, arg))
GPUSLICE_GLIBC_PIN(int, pthread_attr_setstacksize, "GLIBC_2.2.5", (pthread_attr_t * attr, size_t size), (attr, size))
GPUSLICE_GLIBC_PIN(int, pthread_setname_np, "GLIBC_2.12", (pthread_t thread, const char* name), (thread, name))
GPUSLICE_GLIBC_PIN(int, pthread_mutex_trylock, "GLIBC_2.2.5", (pthread_mutex_t * mutex), (mutex))
GPUSLICE_GLIBC_PIN(int, pthread_once, "GLIBC_2.2.5", (pthread_once_t * once, void (*init)(void)), (once, init))
// The thread-exit hand-back (hook/account.cc).
GPUSLICE_GLIBC_PIN(int, pthread_key_create, "GLIBC_2.2.5", (pthread_key_t * key, void (*destructor)(void*)),
                   (key, destructor))
// glibc declares the value __attr_access_none: GCC then takes forwarding it
// for a read of memory nobody wrote.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
GPUSLICE_GLIBC_PIN(int, pthread_setspecific, "GLIBC_2.2.5", (pthread_key_t key, const void* value), (key, value))
#pragma GCC diagnostic pop
// Weakly referenced by the inline std::mutex code (gthreads' "is libpthread there").
GPUSLICE_GLIBC_PIN(int, __pthread_key_create, "GLIBC_2.2.5", (pthread_key_t * key, void (*destructor)(void*)),
                   (key, destructor))
// Re-versioned in 2.32 (the same function).
GPUSLICE_GLIBC_PIN(int, pthread_sigmask, "GLIBC_2.2.5", (int how, const sigset_t* set, sigset_t* old), (how, set, old))
// libdl before 2.34. RTLD_NEXT and the caller's RUNPATH go by the caller's
// object: these forwarders are in the library itself, so nothing changes.
GPUSLICE_GLIBC_PIN(void*, dlopen, "GLIBC_2.2.5", (const char* file, int mode), (file, mode))
GPUSLICE_GLIBC_PIN(void*, dlvsym, "GLIBC_2.2.5", (void* handle, const char* name, const char* version),
                   (handle, name, version))
GPUSLICE_GLIBC_PIN(char*, dlerror, "GLIBC_2.2.5", (void), ())
// GLIBC_2.33.
GPUSLICE_GLIBC_STAT_BY_SYSCALL()

namespace std {
// No libstdc++: the library is compiled without exceptions and linked by the C
// driver (hook/CMakeLists.txt). The inline std::mutex::lock and
// std::unique_lock code still calls this when pthread_mutex_lock fails or a
// unique_lock is misused. A default mutex never fails to lock (glibc returns
// errors only for error-checking, recursive and robust mutexes) and every
// unique_lock in hook/ locks what it owns, so this is not reached. Were it
// reached, the exception would leave a noexcept path and std::terminate would
// abort the process: this does the same, without libstdc++'s exception runtime.
[[noreturn]] __attribute__((visibility("hidden"))) void __throw_system_error(int) { ::abort(); }
}  // namespace std
