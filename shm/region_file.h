// The shared region file of a container: create/attach, validation, process
// slots, device entries. Everything here is heap-free, never blocks on another
// process, never changes process state (umask, signals) and never throws.
#pragma once

#include <cstddef>
#include <cstdint>

#include "gpuslice/region.h"
#include "platform/procfs.h"

namespace gpuslice::shm {

// One line: "gpuslice: GPUSLICE_REGION=/x/y: <what is wrong>, expected <what>".
struct Error {
  char message[512];
};

// Device entry states (DeviceState::uuid_state).
inline constexpr std::uint32_t kDeviceFree = 0;
inline constexpr std::uint32_t kDeviceWriting = 1;
inline constexpr std::uint32_t kDevicePublished = 2;
// The writer stalled (or died) between claiming and publishing for longer than
// the claim timeout; a waiter retired the entry so that nobody waits again and
// no second entry can ever be published for the same UUID (the stalled
// writer's publish CAS fails and it rescans).
inline constexpr std::uint32_t kDeviceAbandoned = 3;
inline constexpr std::uint64_t kDeviceClaimTimeoutNs = 1'000'000'000;

// Slot::seq: low 20 bits = accounting operations in flight (threads of one
// process share its slot), high bits = generation, bumped as each one ends.
inline constexpr std::uint64_t kSeqInflightMask = (std::uint64_t{1} << 20) - 1;
inline constexpr std::uint64_t kSeqGeneration = std::uint64_t{1} << 20;

// Maps the region at path, creating it if absent: the creator builds the whole
// file in a temporary file of the same directory and link()s it into place, so
// nobody ever sees a partial region; losers of the race unlink their temporary
// file and map the winner's. Missing parent directories are created 01777
// (mode set on a descriptor of the directory created, platform/fs.h); the
// directory is opened once and the file looked up and created relative to it.
// The file is 0666 (set with fchmod, whatever the umask: every user of the
// container shares it, docs/security.md), 0600 in a directory shared by users
// (world-writable, and sticky or another user's), where another user's region
// is never joined nor a symbolic link followed. nullptr + err on failure
// (unwritable directory, foreign or corrupt file, other ABI version, wrong
// size). Never blocks on a FIFO. `created` (optional) tells whether this call
// created the file.
Region* attach(const char* path, const char* container_name, Error* err) noexcept;
Region* attach(const char* path, const char* container_name, Error* err, bool* created) noexcept;
// Same, and keeps the file open (O_CLOEXEC, never descriptor 0-2) in *fd for
// mapped_file_intact(), holding the joining lock until end_attach(*fd).
Region* attach(const char* path, const char* container_name, Error* err, bool* created, int* fd) noexcept;
// A region private to this process (and the children it forks), in anonymous
// shared memory: what GPUSLICE_PASSTHROUGH accounts into, so that nothing is
// shared and no file is created.
Region* create_private(const char* container_name, Error* err) noexcept;
// Whether the mapped file (fd from attach) still has a region's size and
// magic. A file shrunk under a MAP_SHARED mapping raises SIGBUS at the next
// touch of a page past its end; without a signal handler (the library installs
// none) the only defence is to look before touching (docs/security.md).
bool mapped_file_intact(int fd, const char* path, Error* err) noexcept;
// Tools and the agent: maps an existing region only (read-only unless writable).
Region* attach_existing(const char* path, bool writable, Error* err) noexcept;
// A new open file description (O_RDWR, close-on-exec, never 0-2) of the very
// file `fd` is open on (a forked child's own, for its slot lock), through
// /proc/self/fd, else through `path` when that still names the same file; -1
// otherwise (the path now names another file: never that one).
int reopen(int fd, const char* path) noexcept;
// A forked child's join of the region it inherited (fd: its own description,
// from reopen): takes the joining lock (as attach does) and checks that
// `path` still names the file and that it is still linked. false, with the
// lock dropped, when the region was renamed away or removed (the agent
// removed it while idle: the child attaches by name instead); true holds the
// joining lock until end_attach(fd).
bool rejoin(int fd, const char* path) noexcept;
// Validates a region header; `size` is the number of bytes at data (the whole
// file). The message names what is wrong and what was expected. Fuzzed.
bool validate_header(const void* data, std::size_t size, Error* err) noexcept;
void detach(Region* r) noexcept;

struct ProcessIdentity {
  std::uint32_t pid;
  std::uint64_t pidns_inode;  // 0 = unknown (no /proc, or /proc of another pid namespace)
  std::uint64_t start_time;   // clock ticks since boot; 0 = unknown
};
// pid 0 = the calling process. From /proc/<pid>/stat (field 22; comm may hold
// spaces and parentheses) and stat("/proc/<pid>/ns/pid").st_ino. False if the
// process does not exist or /proc cannot be read; for pid 0 `out` still holds
// getpid() with unknown namespace and start time, usable for a slot whose
// liveness then stays "unknown" to everybody but the agent.
bool read_identity(std::uint32_t pid, ProcessIdentity* out) noexcept;

// Claims a free slot lock-free (CAS kSlotFree->kSlotClaiming, identity, then
// kSlotLive). -1 if none is free: the caller reaps (limiter::reap_dead) and
// retries. Slots are never moved or compacted.
int claim_slot(Region* r, const ProcessIdentity& self) noexcept;
// Gives a slot back on a clean exit. Only frees it if no accounting operation
// is in flight and it holds no memory; otherwise it stays live and the reaper
// reclaims it, exactly, once the process is gone. The caller guarantees that no
// thread of the process uses the slot afterwards (see docs/memory-accounting.md).
void release_slot(Region* r, int slot) noexcept;

// A slot's device files (docs/memory-accounting.md, "Reaping"): its claimer
// holds an open-file-description lock on byte sizeof(Region) + slot of the
// region file, through a descriptor it opened itself. A forked child shares
// that description — as it shares the driver's device files, which keep the
// dead parent's device memory allocated until the child execs or exits — so
// the lock is held exactly as long as some process may still hold the
// slot's memory on the device. lock_slot_file/unlock_slot_file take and drop
// it (false when the lock cannot be taken: held elsewhere, or no OFD locks).
bool lock_slot_file(int fd, int slot) noexcept;
void unlock_slot_file(int fd, int slot) noexcept;
// Joining (docs/agent.md, "Removal"): a process holds a
// shared OFD lock on byte sizeof(Region) + kMaxSlots from attach (the fd
// variant: before the name is checked to still name the file it opened, or
// before a file it created is linked) until its slot is claimed and locked;
// end_attach drops it (fd < 0: nothing). Whoever removes an unused region
// (the agent) takes the byte exclusively first (lock_for_removal: true only
// with the byte held, or where OFD locks do not exist; false while a process
// is joining, or when the take keeps losing to joiners) and checks the
// slots again under it, so no process ever claims a slot in a region being
// renamed away or unlinked. unlock_for_removal drops it.
inline constexpr std::uint64_t kJoinLockByte = sizeof(Region) + kMaxSlots;
enum class Join { held, removing, no_locks };
// Takes the shared lock; removing: the remover holds it now.
Join begin_attach(int fd) noexcept;
void end_attach(int fd) noexcept;
bool lock_for_removal(int fd) noexcept;
void unlock_for_removal(int fd) noexcept;
// The slot's lock seen through region_fd, the observer's own description of
// the region file (the library's, or the agent's: each passes its own).
// held: another description holds it (the slot's process, or a child it
// forked, still has the driver's files); free; unknown when it cannot be
// told (region_fd < 0, no OFD locks). Nothing process-global: any process
// holding a descriptor of the file may ask.
enum class SlotLock { held, free, unknown };
SlotLock probe_slot_lock(int region_fd, int slot) noexcept;

// Who judges the others' slots: its identity (whose pid namespace its /proc
// shows) and its own open description of the region file, for the slots'
// file locks (-1: none; the locks are then unknown). An identity alone is an
// observer without a descriptor.
struct Observer : ProcessIdentity {
  int region_fd;
  constexpr Observer() noexcept : ProcessIdentity{}, region_fd(-1) {}
  constexpr Observer(const ProcessIdentity& self, int fd = -1) noexcept : ProcessIdentity(self), region_fd(fd) {}
};

enum class Liveness { alive, dead, unknown };
// The one definition of death, used by the library and the node agent alike:
// whether the device may still hold the memory of the process that claimed
// a slot as (pidns_inode, start_time), judged from what /proc says of the pid
// the observer takes for it (facts: platform::procfs::read_process) and from
// the slot's file lock (SlotLock::unknown when the question is the process
// alone, as for the reaper lock's holder). In order:
//   the slot's lock is held              alive: it, or a child it forked, has
//                                        the driver's files
//   no such process (ENOENT, ESRCH)      dead
//   /proc unreadable otherwise           alive: it cannot be proved dead
//   another pid namespace (when read),   dead: the pid was reused
//   or another start time
//   a zombie, the last of its threads    dead: its memory went with its
//                                        address space
//   a zombie leader with threads         alive: its other threads (a
//                                        pthread_exit in main, a SIGKILL's
//                                        exit in progress) hold the memory
//   otherwise                            alive
// start_time is compared as (actual & start_time_mask) (the reaper lock keeps
// only low bits); 0 means unknown and is not compared, nor is a namespace 0.
Liveness judge_liveness(const platform::procfs::Process& facts, std::uint64_t pidns_inode, std::uint64_t start_time,
                        SlotLock lock, std::uint64_t start_time_mask = ~std::uint64_t{0}) noexcept;
// The rule for a slot seen from observer, which reads /proc/<pid> of its own
// pid namespace: unknown for a slot of another (or an unknown) pid namespace
// (the node agent, which maps namespaces, decides those through host pids),
// unless its lock is held (alive).
Liveness slot_liveness(const Slot& s, const Observer& observer, SlotLock lock = SlotLock::unknown) noexcept;
// The same for a bare identity, the process alone (no lock).
Liveness identity_liveness(std::uint32_t pid, std::uint64_t pidns_inode, std::uint64_t start_time,
                           const ProcessIdentity& observer, std::uint64_t start_time_mask = ~std::uint64_t{0}) noexcept;

// Finds the device entry whose UUID matches, or claims the lowest free one
// (uuid_state 0->1, UUID, quota, SM limit, policy, cost_scale_ppm = 1e6, then
// 2 with release). An entry being written by another process is waited for at
// most claim_timeout_ns (it is a handful of stores) and then abandoned. -1 if
// all kMaxDevices entries are taken. The first process to name a UUID sets its
// quota: later processes' *_if_new values are ignored (compare and warn).
int device_index(Region* r, const std::uint8_t uuid[16], std::uint64_t quota_bytes_if_new,
                 std::uint32_t sm_limit_pct_if_new, SmPolicy policy_if_new) noexcept;
int device_index(Region* r, const std::uint8_t uuid[16], std::uint64_t quota_bytes_if_new,
                 std::uint32_t sm_limit_pct_if_new, SmPolicy policy_if_new, std::uint64_t claim_timeout_ns) noexcept;

}  // namespace gpuslice::shm
