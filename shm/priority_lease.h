// The priority board's lease files (docs/priority.md, "Many tenants"): per
// level and device one small file, <board>/<level>/<GPU-uuid>.lease, holding
// the level's timetable on that device: `booked_until_ns`, when the launches
// its bounded containers have booked should be done (when to wake), and
// `launched_until_ns`, when those it has launched should be (whether to go
// now). A booking or a launch reads and writes it (pread/pwrite: another
// container may truncate it, so it is never read or written through a
// mapping) under an OFD write lock on one byte past its end, taken without waiting; a
// process killed inside drops the lock with its last descriptor, and a
// booking it left behind only books device time that passes. Each process
// that uses the file holds a read lock on byte kLeaseUserBase + its pid while
// it has it open; the last one to leave removes it. The handoff: each launch
// that goes bumps `wake_seq` and wakes one waiting booking (a futex on a
// read-only shared mapping of the record's page, only ever passed to the
// futex syscall, which answers EFAULT, never SIGBUS, on a truncated page).
// Heap-free.
#pragma once

#include <cstdint>

#include "gpuslice/priority_board.h"
#include "platform/uuid.h"
#include "shm/region_file.h"

namespace gpuslice::shm {

inline constexpr std::uint64_t kLeaseMagic = 0x3153414c49525047ull;  // "GPRILAS1" little-endian
inline constexpr std::uint32_t kLeaseAbiVersion = 2;
// The file's name after the GPU's uuid. Version 2 (lag_shift_us: bookings
// follow the corrections of the timetable) has a file of its own: a version-1
// process never moves its booking with a correction, so beside version-2
// processes it would lose its turn at almost every correction. During an
// upgrade the two versions keep a budget each (two launches of the level may
// be queued where one was).
inline constexpr const char* kLeaseSuffix = ".v2.lease";
// The booking lock's byte (past the record: nothing is written there).
inline constexpr std::uint64_t kLeaseLockByte = 1ull << 20;
// The users' presence locks: this + pid.
inline constexpr std::uint64_t kLeaseUserBase = 1ull << 21;

struct PriorityLease {
  std::uint64_t magic;            // kLeaseMagic
  std::uint32_t abi_version;      // kLeaseAbiVersion
  std::uint32_t size;             // sizeof(PriorityLease)
  std::uint64_t booked_until_ns;  // CLOCK_MONOTONIC
  std::uint32_t booker_pid;       // the latest booking's process (tools only)
  // Bumped by each launch that goes (limiter::launched_lease): the futex word
  // of the handoff (wait_wake). (Formerly reserved, zero: kept as read.)
  std::uint32_t wake_seq;
  std::uint64_t bookings;           // how many launches booked (tools only)
  std::uint64_t launched_until_ns;  // CLOCK_MONOTONIC
  // The level's device token (docs/priority.md, "Many tenants"): a claimed
  // launch holds it until it has gone to the driver (then launched_until is
  // counted from its real launch), at most until token_until_ns. 0: free.
  // (Formerly reserved, zero: a library without the token keeps them as read.)
  std::uint32_t token_pid;
  // The corrections of the timetable by the device's lag, summed (µs, modulo
  // 2^32; limiter::correct_lease): a launch claimed before the latest one
  // does not correct it again, a booking made before it moves its slot by
  // the difference. (Formerly reserved, zero: a library without it keeps it as read.)
  std::uint32_t lag_shift_us;
  std::uint64_t token_until_ns;  // CLOCK_MONOTONIC
};
static_assert(sizeof(PriorityLease) == 64);

// Opens (creating it, and the level directory, if needed: mode 0644 / 01777
// set explicitly) the lease file of `level` on the GPU `uuid_text`, for reading
// and writing, and takes this process's presence lock on it. -1 + err when it cannot (a level directory this process may not
// write, a file of another user, not a regular file): then its launches keep
// the per-process bound only.
int open_lease(const char* board, Priority level, const char uuid_text[platform::kUuidTextSize], Error* err) noexcept;
// Takes the booking lock without waiting, trying `tries` times with short
// sleeps between (another process's booking takes a few syscalls). False when
// it stays taken (a process stopped inside a booking) or the file system has
// no OFD locks.
bool lock_lease(int fd, unsigned tries) noexcept;
void unlock_lease(int fd) noexcept;
// Called by a process that leaves (at exit): drops its presence lock and
// removes the file when nobody else holds one and the name still names it.
// (A process that opens it meanwhile finds it unlinked, lease_unlinked, and
// opens a new one.) True when removed.
bool remove_lease(const char* board, Priority level, const char uuid_text[platform::kUuidTextSize], int fd) noexcept;
// Whether fd's file has been removed from the board.
bool lease_unlinked(int fd) noexcept;
// Whether another open file description (another process) holds a presence
// lock on it: the level has another bounded process on the device.
bool lease_shared(int fd) noexcept;
// Whether a process whose pid (in its own namespace) is `pid` may still hold
// a presence lock on it: false only when nobody holds that byte (the process
// is gone, or never used the file); true when the kernel cannot tell.
bool lease_user_alive(int fd, std::uint32_t pid) noexcept;
// The record as stored; a short or foreign one reads as nothing booked or
// launched (all zero: the next write makes it whole).
void read_lease(int fd, PriorityLease* out) noexcept;
// Writes a whole record (magic, version, size and this process as the booker
// filled in).
bool write_lease(int fd, PriorityLease rec) noexcept;

// The handoff's futex word: fd's wake_seq in a read-only shared mapping of
// the file's first page, or nullptr. Never dereferenced: only its address is
// given to the kernel (which reads the page cache that pwrite writes).
const std::uint32_t* map_wake_word(int fd) noexcept;
void unmap_wake_word(const std::uint32_t* word) noexcept;
enum class Wake { woken, moved, timeout, unavailable };
// Waits until a waker (wake_one) wakes it (woken), or timeout_ns passes
// (bounded always). `moved`: it did not sleep, the word is no longer `seen`
// (a launch went since it was read, and its wake went to another waiter or
// to nobody), or a signal interrupted it. `unavailable`: no futex on this
// word (nullptr, a truncated page): the caller sleeps instead.
Wake wait_wake(const std::uint32_t* word, std::uint32_t seen, std::uint64_t timeout_ns) noexcept;
// Wakes one waiter on the word (the longest waiting: the kernel queues
// waiters of equal priority in order); how many it woke (0 or 1).
int wake_one(const std::uint32_t* word) noexcept;

}  // namespace gpuslice::shm
