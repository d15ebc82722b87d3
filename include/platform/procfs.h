// The one /proc reader of the library, the agent and the tools: a process's
// stat line (pid, state, thread count, start time), its pid namespace and the
// NSpid line of its status file.
// Heap-free, stdio-free and exception-free (the preload library reads its own
// identity during bootstrap); parsers take the text, so malformed files are
// unit-tested without a /proc (test/unit/procfs_test.cc).
#pragma once

#include <cstddef>
#include <cstdint>

namespace gpuslice::platform::procfs {

// "/proc/<pid>/<leaf>", or "/proc/self/<leaf>" for pid 0, into buf[cap].
void path(char* buf, std::size_t cap, std::uint32_t pid, const char* leaf) noexcept;

// Reads a small /proc file whole into buf[cap], NUL-terminated (at most
// cap - 1 bytes: the rest is cut). Returns its length, or -errno.
long read_file(const char* path, char* buf, std::size_t cap) noexcept;

// /proc/<pid>/stat (proc(5)): "pid (comm) state ppid ... starttime ...".
struct Stat {
  std::uint32_t pid = 0;          // field 1, in the /proc mount's pid namespace
  char state = 0;                 // field 3: R, S, D, Z, X, ...
  std::uint64_t flags = 0;        // field 9: the leader's PF_* flags (PF_EXITING 0x4: in its exit)
  std::uint64_t num_threads = 0;  // field 20: the thread group's threads (a zombie leader counts itself)
  std::uint64_t start_time = 0;   // field 22, clock ticks after boot
};
// comm may hold spaces and parentheses (up to 15 bytes of anything but NUL):
// the fields resume after the *last* ')'. False when the text is not a stat
// line up to field 22 (a number, ending at a space, newline or the end).
bool parse_stat(const char* text, std::size_t len, Stat* out) noexcept;
// Reads and parses /proc/<pid>/stat (pid 0: self). 0, or the errno of the
// failure (ENOENT/ESRCH: no such process; EINVAL: unparsable).
int read_stat(std::uint32_t pid, Stat* out) noexcept;
// In its exit: a zombie leader whose other threads still exit, or a leader
// that runs its exit (PF_EXITING, not yet a zombie: a SIGKILL's exit closes
// the files first). Not dead: a leader's pthread_exit passes through here
// too while its other threads live on. What the chaos monitor excuses as
// mid-exit; the liveness rule keeps such a process (shm::judge_liveness).
bool in_exit(const Stat& st) noexcept;

// What the one rule of liveness (shm::judge_liveness) judges a process by:
// its stat line and, when asked for, its pid namespace.
struct Process {
  int error = 0;                  // 0, or why nothing was read (ENOENT/ESRCH: no such process)
  Stat stat;                      // valid when error == 0
  std::uint64_t pidns_inode = 0;  // stat("/proc/<pid>/ns/pid").st_ino; 0: not asked for, or no access
};
// Reads /proc/<pid>/stat (pid 0: self) and, with want_pidns, the inode of its
// ns/pid link (which needs ptrace access: another user's process keeps 0).
// Returns out->error.
int read_process(std::uint32_t pid, bool want_pidns, Process* out) noexcept;

// The "NSpid:" line of /proc/<pid>/status: the pid in each pid namespace
// from the outermost this /proc can see to the process's own. False when
// there is no such line (kernels before 4.1) or it holds no number.
struct NsPids {
  std::uint32_t outermost = 0;  // what NVML reports when /proc is the host's
  std::uint32_t innermost = 0;  // the pid the process sees itself as
};
bool parse_nspid(const char* text, std::size_t len, NsPids* out) noexcept;
// Reads and parses /proc/<pid>/status (pid 0: self). 0, or an errno (EINVAL:
// no NSpid line).
int read_nspid(std::uint32_t pid, NsPids* out) noexcept;

}  // namespace gpuslice::platform::procfs
