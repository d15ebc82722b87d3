// This process's slot across its life (lifecycle.cc): whose it is across
// process creation (fork, _Fork, clone: the owner word), and its release at
// exit (the exit bracket). hook/bootstrap.h claims the slot and starts over
// in a child; hook/account.h accounts on it.
#pragma once

#include <atomic>
#include <cstdint>

#include "gpuslice/region.h"

namespace gpuslice::hook {

// Ownership of the slot across process creation. The word lives in a page
// the kernel zeroes in every child it forks (MADV_WIPEONFORK), however the
// child was made: fork() with its handlers, _Fork(), raw clone(). A child
// that finds it zero holds its parent's slot and must claim its own before
// accounting anything (own_slot(), hook/bootstrap.h). Kernels before 4.14
// lack the advice: the word then stays in ordinary memory and only fork()
// (through pthread_atfork) and the exit path's pid check protect the
// parent's slot (docs/security.md).
// Hidden on the declaration: read PC-relative (process.h).
enum : std::uint32_t { kSlotNotOurs = 0, kSlotAdopting = 1, kSlotOurs = 2 };
[[gnu::visibility("hidden")]] extern std::atomic<std::atomic<std::uint32_t>*> g_owner;

// The page the owner word heads also holds this process's slot, for the
// accounting fast paths (hook/account.h): one load says "the slot is ours"
// (owner word and slot index both). Set by own_claimed_slot (after
// g_process.lease_tag and slot: an acquire load of it sees them), only in
// the wipe-on-fork page: a child however made finds it null and goes out of
// line, where own_slot() claims its own. Without MADV_WIPEONFORK it stays
// null (every call out of line). Written once per page: a claim in this
// process is made once, and a new one only in a child, whose page the
// kernel zeroed.
// The page holds too the allocation pair's fast word (hook/memory.cc,
// issue 35): 0 sends cuMemAlloc_v2 and cuMemFree_v2 the whole way; else, set
// once by this process (after slot, never in the fallback page), it says in
// one load what those would otherwise test call by call and that, once
// true in a process, stays true there: bootstrap done and the slot ours,
// the only device's entry (its low bits), oversubscription off, counting
// operations off or per thread (kFastCounting), the linear table entered.
// What can change later (the region file, the lease word, a stuck table,
// pools, the thread's counter) is still tested on the fast path.
// With the fast word the page holds (stored before it) this process's
// epoch (include/platform/pointer_table.h: a counting operation's thread
// check reads it from here, one load fewer) and the entry's lease and
// committed bytes. Only the word is ever set to 0 again: these stay.
struct OwnerPage {
  std::atomic<std::uint32_t> owner;                    // what g_owner points to
  std::atomic<std::uint32_t> fast;                     // 0, or kFastArmed | flags | entry
  std::atomic<Slot*> slot;                             // &region->slots[g_process.slot], or null
  std::atomic<std::uint64_t> epoch;                    // the process epoch, once the fast word is set
  std::atomic<Slot::Lease*> lease;                     // &slot->lease[entry], once the fast word is set
  std::atomic<std::atomic<std::uint64_t>*> committed;  // &slot->committed_bytes[entry], likewise
  std::atomic<std::atomic<std::uint32_t>*> waiting;    // &region->devices[entry].oversub_waiting, likewise
  std::atomic<int> entry;                              // the word's entry, likewise (-2 until then)
};
inline constexpr std::uint32_t kFastEntryMask = 0xff;
inline constexpr std::uint32_t kFastArmed = 0x100;
inline constexpr std::uint32_t kFastCounting = 0x200;
inline OwnerPage& owner_page() noexcept {
  return *reinterpret_cast<OwnerPage*>(g_owner.load(std::memory_order_relaxed));
}

// The slot just claimed (g_process.slot) is this process's: the owner word
// (bootstrap.cc calls this once the claim succeeded).
void own_claimed_slot() noexcept;
// Our own descriptor holding the slot's file lock (-1: none), closed with
// the lock at exit.
void hold_slot_lock(int fd) noexcept;

// Set once the exit-time release ran: later allocations (other libraries'
// destructors, threads still running during exit) are refused, not left
// unlimited. Threads inside reserve()/charge() are counted so that the slot
// is only given back when none of them can still write to it. A forked
// child clears both (bootstrap.cc).
[[gnu::visibility("hidden")]] extern std::atomic<bool> g_exited;
[[gnu::visibility("hidden")]] extern std::atomic<int> g_accounting_calls;

// Brackets an operation that may add to the slot (see release_at_exit).
struct AddingCall {
  AddingCall() noexcept { g_accounting_calls.fetch_add(1, std::memory_order_seq_cst); }
  ~AddingCall() { g_accounting_calls.fetch_sub(1, std::memory_order_release); }
  AddingCall(const AddingCall&) = delete;
  AddingCall& operator=(const AddingCall&) = delete;
};

// True (with one capped warning) once the exit-time release ran.
bool refused_after_exit() noexcept;

}  // namespace gpuslice::hook
