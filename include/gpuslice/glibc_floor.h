// Pinning a shared library's libc calls to old symbol versions, so that it
// loads under a glibc older than the one it is built with (docs/deploy.md,
// "glibc floor"). Used by the preload library (hook/glibc_floor.cc); the
// simulated driver keeps its own copy (test/fakecuda/glibc_floor.h).
//
// Built against a newer glibc, the linker binds each call to the newest
// (default) version of the function: 2.34 moved libpthread and libdl into libc
// under new versions, 2.33 made stat/fstat real functions (before, only
// __xstat/__fxstat behind inline wrappers), 2.32 re-versioned pthread_sigmask.
// A library that asks for such a version does not load at all under an older
// glibc ("version `GLIBC_2.34' not found"), and neither does any program that
// preloads it.
//
// GPUSLICE_GLIBC_PIN defines the function in the library itself, hidden (and
// kept out of the exports by the library's version script, so it never
// interposes the application's): every call from the library's objects and
// static archives binds to it at link time, before libc is searched. It
// forwards to the oldest version of the same function, named with .symver.
// Pin only versions that are aliases of the default one: on the glibc this is
// built with, both names share one address (glibc kept the old names when it
// moved the functions; `objdump -T libc.so.6` shows it), and on an older glibc
// the pinned version is the only one there is. Never pin a function whose old
// version is a different implementation (pthread_cond_*@GLIBC_2.2.5 is).
// Before 2.34 the pinned pthread and dl functions live in libpthread.so.0 and
// libdl.so.2: the library must list those as needed (they are empty
// placeholders since 2.34).
#pragma once

#if !defined(__x86_64__)
#error "gpuslice/glibc_floor.h pins x86_64 symbol versions (GLIBC_2.2.5 is that architecture's base)"
#endif

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

// GPUSLICE_GLIBC_PIN(ret, name, "GLIBC_x.y", (params), (args)): <name> forwards
// to <name>@GLIBC_x.y. The parameters are declared as glibc's headers declare
// them (noexcept: glibc's __THROW in C++).
#define GPUSLICE_GLIBC_PIN(ret, name, version, params, args)      \
  extern "C" ret gpuslice_glibc_##name params noexcept;           \
  __asm__(".symver gpuslice_glibc_" #name "," #name "@" version); \
  extern "C" __attribute__((visibility("hidden"))) ret name params noexcept { return gpuslice_glibc_##name args; }

// stat, fstat and fstatat as glibc runs them on x86_64 (fstatat/fstat system calls;
// the kernel's struct stat is glibc's there), for libraries that must load
// under glibc < 2.33.
#define GPUSLICE_GLIBC_STAT_BY_SYSCALL()                                                                          \
  extern "C" __attribute__((visibility("hidden"))) int stat(const char* __restrict path,                          \
                                                            struct stat* __restrict buf) noexcept {               \
    return static_cast<int>(syscall(SYS_newfstatat, AT_FDCWD, path, buf, 0));                                     \
  }                                                                                                               \
  extern "C" __attribute__((visibility("hidden"))) int fstat(int fd, struct stat* buf) noexcept {                 \
    return static_cast<int>(syscall(SYS_fstat, fd, buf));                                                         \
  }                                                                                                               \
  extern "C" __attribute__((visibility("hidden"))) int fstatat(int dirfd, const char* __restrict path,            \
                                                               struct stat* __restrict buf, int flags) noexcept { \
    return static_cast<int>(syscall(SYS_newfstatat, dirfd, path, buf, flags));                                    \
  }
