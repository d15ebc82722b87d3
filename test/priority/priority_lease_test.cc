// The level's shared in-flight budget on a device (docs/priority.md, "Many
// tenants"): the lease file's timetable and its booking lock
// (shm/priority_lease.h), and what a process that dies or stops while holding
// it leaves to the others: nothing they wait for.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "limiter/priority.h"
#include "platform/clock.h"
#include "shm/priority_lease.h"

namespace {

using namespace gpuslice;
constexpr char kUuid[] = "GPU-00000000-0000-0000-0000-000000000001";

struct Board {
  std::string dir;
  Board() {
    char tmpl[] = "/tmp/gpuslice-lease-XXXXXX";
    dir = mkdtemp(tmpl);
  }
  ~Board() { std::system(("rm -rf " + dir).c_str()); }
  int open(Priority level = Priority::low) const {
    shm::Error err{};
    const int fd = shm::open_lease(dir.c_str(), level, kUuid, &err);
    EXPECT_GE(fd, 0) << err.message;
    return fd;
  }
};

shm::PriorityLease record(int fd) {
  shm::PriorityLease rec;
  shm::read_lease(fd, &rec);
  return rec;
}

// One booking as the gate makes it (hook/priority_board.cc, board::book).
std::uint64_t book(int fd, std::uint64_t now, std::uint64_t launch_ns) {
  EXPECT_TRUE(shm::lock_lease(fd, 48));
  shm::PriorityLease rec = record(fd);
  const limiter::Slot slot = limiter::book_slot(rec.booked_until_ns, now, launch_ns);
  rec.booked_until_ns = slot.until_ns;
  ++rec.bookings;
  EXPECT_TRUE(shm::write_lease(fd, rec));
  shm::unlock_lease(fd);
  return slot.start_ns;
}

// One claim (board::claim): 0 when it goes, else when the level's launched
// work should be done or, with the token taken, until when it lasts at most.
// The claim is kept in *out (for launched()). `pid` is the claimer's.
std::uint64_t claim(int fd, std::uint64_t now, std::uint64_t launch_ns, std::uint64_t allow,
                    limiter::Claim* out = nullptr, std::uint32_t pid = static_cast<std::uint32_t>(getpid())) {
  EXPECT_TRUE(shm::lock_lease(fd, 48));
  shm::PriorityLease rec = record(fd);
  const bool alive = rec.token_pid == pid || shm::lease_user_alive(fd, rec.token_pid);
  const limiter::Claim c = limiter::claim_lease(rec, now, launch_ns, allow, pid, alive);
  if (c.go) {
    EXPECT_TRUE(shm::write_lease(fd, rec));
  }
  shm::unlock_lease(fd);
  if (out != nullptr) *out = c;
  return c.go ? 0 : c.busy_until_ns;
}

// The claimed launch went to the driver at `now` (board::launched).
void launched(int fd, const limiter::Claim& c, std::uint64_t now, std::uint64_t launch_ns,
              std::uint32_t pid = static_cast<std::uint32_t>(getpid())) {
  EXPECT_TRUE(shm::lock_lease(fd, 48));
  shm::PriorityLease rec = record(fd);
  if (limiter::launched_lease(rec, c, now, launch_ns, pid)) {
    EXPECT_TRUE(shm::write_lease(fd, rec));
  }
  shm::unlock_lease(fd);
}

TEST(PriorityLease, BookingsOfTheLevelFollowEachOther) {
  Board b;
  const int x = b.open(), y = b.open();  // two containers of the level (two descriptions)
  const std::uint64_t now = platform::monotonic_ns();
  EXPECT_EQ(book(x, now, 250'000), now);
  EXPECT_EQ(book(y, now, 250'000), now + 250'000);
  EXPECT_EQ(book(x, now + 10, 0), now + 500'000);  // unmeasured: books kLeaseUnmeasuredNs
  EXPECT_EQ(book(y, now + 20, 100'000), now + 500'000 + limiter::kLeaseUnmeasuredNs);
  // Another level has its own timetable.
  const int z = b.open(Priority::normal);
  EXPECT_EQ(book(z, now, 250'000), now);
  EXPECT_EQ(record(x).bookings, 4u);
  close(x);
  close(y);
  close(z);
}

// A woken launch goes when the level's launched work ends within its lead,
// else it learns when that work ends; each launch that goes extends it.
TEST(PriorityLease, AClaimGoesOnlyBehindNearlyDoneWork) {
  Board b;
  const int x = b.open(), y = b.open();
  const std::uint64_t now = platform::monotonic_ns();
  limiter::Claim c;
  EXPECT_EQ(claim(x, now, 250'000, 80'000, &c), 0u);
  launched(x, c, now, 250'000);
  EXPECT_EQ(claim(y, now + 10'000, 250'000, 80'000), now + 250'000);  // two would be queued: not now
  EXPECT_EQ(claim(y, now + 170'000, 250'000, 80'000, &c), 0u);        // within the lead: behind it
  launched(y, c, now + 170'000, 250'000);
  EXPECT_EQ(record(x).launched_until_ns, now + 500'000);
  EXPECT_EQ(claim(x, now + 10'000'000, 0, 80'000), 0u);  // all past: from now
  EXPECT_EQ(record(x).launched_until_ns, now + 10'000'000 + limiter::kLeaseUnmeasuredNs);
  close(x);
  close(y);
}

// A claim whose last look at the board finds a higher neighbour active gives
// its place back, unless another launch of the level claimed behind it (then
// the place is its: taking it back would let a second launch queue).
TEST(PriorityLease, AHeldClaimGivesItsPlaceBackWhenNobodyClaimedBehind) {
  Board b;
  const int x = b.open(), y = b.open();
  const std::uint64_t now = platform::monotonic_ns();
  limiter::Claim c;
  ASSERT_EQ(claim(x, now, 250'000, 80'000, &c), 0u);
  ASSERT_TRUE(shm::lock_lease(x, 48));
  shm::PriorityLease rec = record(x);
  ASSERT_TRUE(limiter::unclaim_lease(rec, c, 250'000, static_cast<std::uint32_t>(getpid())));  // board::unclaim
  ASSERT_TRUE(shm::write_lease(x, rec));
  shm::unlock_lease(x);
  EXPECT_EQ(record(x).launched_until_ns, now) << "given back";
  EXPECT_EQ(claim(y, now + 1'000, 250'000, 80'000), 0u) << "the next one goes at once";
  // Claimed behind: the word is not the claim's any more, and stays.
  EXPECT_EQ(limiter::unclaim_slot(now + 500'000, now + 250'000, 250'000), now + 500'000);
  EXPECT_EQ(limiter::unclaim_slot(now + 250'000, now + 250'000, 0), now + 250'000 - limiter::kLeaseUnmeasuredNs);
  EXPECT_EQ(limiter::unclaim_slot(100, 100, 250'000), 100u);  // never below zero
  close(x);
  close(y);
}

// The level's device token (docs/priority.md, "Many tenants"): a claimed
// launch that has not gone to the driver yet (its thread lost its CPU
// between its claim and its launch) keeps the next one of the level from
// going, however late it is: two low kernels are never queued together
// behind a claim's predicted end.
TEST(PriorityLease, TwoLaunchesOfTheLevelNeverHoldTheDeviceAtOnce) {
  Board b;
  const int x = b.open(), y = b.open();
  const std::uint64_t now = platform::monotonic_ns();
  limiter::Claim c;
  ASSERT_EQ(claim(x, now, 250'000, 80'000, &c), 0u) << "x claims the device";
  // x's thread is descheduled; its slot has passed by the time y's comes.
  EXPECT_NE(claim(y, now + 400'000, 250'000, 80'000), 0u) << "x has not launched yet: y must not go";
  EXPECT_NE(claim(y, now + 1'500'000, 250'000, 80'000), 0u) << "nor later, while x's token lasts";
  // x launches 1.6 ms late: the level's work ends 250 us after that.
  launched(x, c, now + 1'600'000, 250'000);
  EXPECT_EQ(record(x).launched_until_ns, now + 1'850'000);
  EXPECT_EQ(record(x).token_pid, 0u) << "the token is free";
  EXPECT_EQ(claim(y, now + 1'700'000, 250'000, 80'000), now + 1'850'000) << "behind x's real launch";
  EXPECT_EQ(claim(y, now + 1'780'000, 250'000, 80'000), 0u) << "within the lead of its real end";
  close(x);
  close(y);
}

// The token is a lease: a holder stopped between its claim and its launch
// keeps the level waiting kLeaseTokenNs at most; a dead one (its presence
// lock gone with it) not at all. A word too far ahead is not believed.
TEST(PriorityLease, TheTokenOfAStoppedHolderExpiresAndADeadOnesIsFree) {
  Board b;
  const int y = b.open();
  const std::uint64_t now = platform::monotonic_ns();
  shm::PriorityLease rec{};
  rec.token_pid = static_cast<std::uint32_t>(getpid());
  rec.token_until_ns = now + limiter::kLeaseTokenNs;
  rec.launched_until_ns = now;
  EXPECT_TRUE(limiter::token_taken(rec, now, true));
  EXPECT_FALSE(limiter::token_taken(rec, now + limiter::kLeaseTokenNs, true)) << "expired";
  EXPECT_FALSE(limiter::token_taken(rec, now, false)) << "its holder is dead";
  rec.token_until_ns = now + limiter::kLeaseTokenNs + 1;
  EXPECT_FALSE(limiter::token_taken(rec, now, true)) << "too far ahead: not believed";
  // A process that held it and died: its presence lock went with it.
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    shm::Error err{};
    const int own = shm::open_lease(b.dir.c_str(), Priority::low, kUuid, &err);
    if (own < 0 || !shm::lock_lease(own, 100)) _exit(2);
    shm::PriorityLease held{};
    held.token_pid = static_cast<std::uint32_t>(getpid());
    held.token_until_ns = platform::monotonic_ns() + limiter::kLeaseTokenNs;
    held.launched_until_ns = platform::monotonic_ns();
    shm::write_lease(own, held);
    shm::unlock_lease(own);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  ASSERT_EQ(record(y).token_pid, static_cast<std::uint32_t>(child));
  EXPECT_FALSE(shm::lease_user_alive(y, static_cast<std::uint32_t>(child)));
  const int x = b.open();  // another description of this process: its presence lock is seen from y
  EXPECT_TRUE(shm::lease_user_alive(y, static_cast<std::uint32_t>(getpid())));
  close(x);
  EXPECT_EQ(claim(y, platform::monotonic_ns(), 250'000, 80'000), 0u) << "a dead holder's token is free";
  close(y);
}

// The estimate of a booked launch: the least sample of the last window or two
// (a sample includes the wait behind the level's previous launch).
TEST(PriorityLease, BookedSamplesKeepTheLeast) {
  limiter::InflightEstimate e;
  limiter::observe_booked(e, 40'000'000);  // the first: behind the level's old queues
  EXPECT_EQ(e.avg_ns, limiter::kLeaseUnmeasuredNs);
  for (std::uint64_t ns : {330'000, 250'000, 310'000, 400'000}) limiter::observe_booked(e, ns);
  EXPECT_EQ(e.avg_ns, 250'000u);
  for (int i = 0; i < 2 * static_cast<int>(limiter::kBookedWindow); ++i) limiter::observe_booked(e, 1'000'000);
  EXPECT_EQ(e.avg_ns, 1'000'000u) << "longer launches are learnt within two windows";
  limiter::observe_booked(e, 600'000);
  EXPECT_EQ(e.avg_ns, 600'000u) << "shorter ones at once";
}

// The timetable counts launches by estimates; a booked launch that ended
// later than it said moves it (and the bookings) by its lag, once: a launch
// claimed before that correction saw the same lag and must not move it again;
// a lag within half the lead, or one the device has caught up on (the
// timetable ended before now), moves nothing. Bookings made before learn how
// far their slots moved from lag_shift_us (wrapping).
TEST(PriorityLease, ALaunchThatEndedLateMovesTheTimetableOnce) {
  const std::uint64_t now = 10'000'000'000;
  shm::PriorityLease rec{};
  rec.launched_until_ns = now + 300'000;
  rec.booked_until_ns = now + 2'000'000;
  rec.lag_shift_us = 7;
  const limiter::Claim refused = limiter::claim_lease(rec, now, 250'000, 80'000, 1, true);
  ASSERT_FALSE(refused.go);
  EXPECT_EQ(refused.lag_shift_us, 7u) << "a refused claim reads the shift too";
  EXPECT_TRUE(limiter::correct_lease(rec, 7, 250'000, now));
  EXPECT_EQ(rec.launched_until_ns, now + 550'000);
  EXPECT_EQ(rec.booked_until_ns, now + 2'250'000);
  EXPECT_EQ(limiter::lag_moved_ns(rec.lag_shift_us, 7), 250'000u);
  const shm::PriorityLease after = rec;
  EXPECT_FALSE(limiter::correct_lease(rec, 7, 250'000, now)) << "claimed before the correction";
  EXPECT_FALSE(limiter::correct_lease(rec, rec.lag_shift_us, limiter::kLeaseLagFixNs - 1, now)) << "within the lead";
  EXPECT_EQ(std::memcmp(&rec, &after, sizeof rec), 0);
  rec.launched_until_ns = now - 1'000'000;
  EXPECT_FALSE(limiter::correct_lease(rec, rec.lag_shift_us, 300'000, now)) << "the device has caught up";
  EXPECT_EQ(rec.launched_until_ns, now - 1'000'000);
  rec.launched_until_ns = now + 100'000;
  rec.booked_until_ns = now - 5;  // no booking ahead: stays
  rec.lag_shift_us = 0xfffffffeu;
  EXPECT_TRUE(limiter::correct_lease(rec, 0xfffffffeu, 60'500, now));
  EXPECT_EQ(rec.launched_until_ns, now + 161'000) << "whole microseconds, rounded up";
  EXPECT_EQ(rec.booked_until_ns, now - 5);
  EXPECT_EQ(limiter::lag_moved_ns(rec.lag_shift_us, 0xfffffffeu), 61'000u) << "across the wrap";
}

// A booking follows a moved timetable only by what corrections can move: a
// shift word that went back (another level's lease read after a change of
// priority, or a neighbour's write) reads as ~2^32 µs moved and once slept
// the booking for ~71 minutes (review of be173de).
TEST(PriorityLease, ABookingFollowsOnlyWhatCorrectionsCanMove) {
  const std::uint64_t now = 10'000'000'000;
  std::uint64_t start = now + 1'000'000;
  EXPECT_TRUE(limiter::follow_correction(&start, now, 107, 7, now + 1'050'000));
  EXPECT_EQ(start, now + 1'100'000) << "moved by the 100 us corrected";
  EXPECT_FALSE(limiter::follow_correction(&start, now, 107, 107, now)) << "nothing moved";
  EXPECT_FALSE(limiter::follow_correction(&start, now, 106, 107, now)) << "the word went back";
  EXPECT_EQ(start, now + 1'100'000);
  EXPECT_FALSE(limiter::follow_correction(&start, now, 107 + 1'000'001, 107, now)) << "more than a correction moves";
  EXPECT_FALSE(limiter::follow_correction(&start, now, 107 + 999'999, 107, now)) << "a slot beyond a second ahead";
  EXPECT_FALSE(limiter::follow_correction(&start, now, 207, 107, now + 1'300'000)) << "the level is busy past it";
  EXPECT_EQ(start, now + 1'100'000);
  std::uint64_t wrapped = now;
  EXPECT_TRUE(limiter::follow_correction(&wrapped, now, 5, 0xfffffffbu, now)) << "across the wrap";
  EXPECT_EQ(wrapped, now + 10'000);
}

TEST(PriorityLease, SlotsInThePastAndWordsTooFarAheadStartNow) {
  const std::uint64_t now = 10'000'000'000;
  EXPECT_EQ(limiter::book_slot(now - 1, now, 100).start_ns, now);
  EXPECT_EQ(limiter::book_slot(0, now, 100).start_ns, now);
  EXPECT_EQ(limiter::book_slot(now + limiter::kLeaseMaxAheadNs, now, 100).start_ns, now + limiter::kLeaseMaxAheadNs);
  EXPECT_EQ(limiter::book_slot(now + limiter::kLeaseMaxAheadNs + 1, now, 100).start_ns, now);  // not believed
  EXPECT_EQ(limiter::book_slot(~0ull, now, 100).until_ns, now + 100);
}

TEST(PriorityLease, AllowIsTheLeadWhileTightAndAboutTheRelaxedBoundOtherwise) {
  EXPECT_EQ(limiter::lease_allow(250'000, true, 0), limiter::kLeaseLeadNs);
  EXPECT_EQ(limiter::lease_allow(250'000, true, 100'000), 125'000u);                // late: up to half a launch
  EXPECT_EQ(limiter::lease_allow(50'000, true, 1'000'000), limiter::kLeaseLeadNs);  // never below the lead
  EXPECT_EQ(limiter::lease_allow(250'000, false, 0), limiter::kBoundWorkNs - 250'000);
  EXPECT_EQ(limiter::lease_allow(2'000'000, false, 0), limiter::kLeaseLeadNs);
}

// A truncated or garbage record reads as nothing booked and is made whole.
TEST(PriorityLease, ATruncatedFileIsNothingBooked) {
  Board b;
  const int fd = b.open();
  const std::uint64_t now = platform::monotonic_ns();
  book(fd, now, 250'000);
  ASSERT_EQ(ftruncate(fd, 7), 0);
  EXPECT_EQ(book(fd, now, 250'000), now);
  EXPECT_EQ(book(fd, now, 250'000), now + 250'000);
  close(fd);
}

// A process killed while it holds the booking lock: the kernel drops the lock
// with its last descriptor, the next booking takes it at once. A process
// stopped there is not waited for: the booking gives up within its tries
// (the gate then uses the per-process bound).
TEST(PriorityLease, AKilledHolderReleasesTheBudgetAndAStoppedOneIsNotWaitedFor) {
  Board b;
  const int fd = b.open();
  for (const bool stop : {false, true}) {
    int ready[2];
    ASSERT_EQ(pipe(ready), 0);
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      shm::Error err{};
      const int own = shm::open_lease(b.dir.c_str(), Priority::low, kUuid, &err);
      if (own < 0 || !shm::lock_lease(own, 1)) _exit(2);
      // Booked 0.8 s of the device (under kLeaseMaxAheadNs: believed; far
      // enough that no delay of a loaded machine lets it pass before the
      // checks below), then gone (or stopped) holding the lock.
      shm::PriorityLease rec{};
      rec.booked_until_ns = rec.launched_until_ns = platform::monotonic_ns() + 800'000'000;
      shm::write_lease(own, rec);
      if (write(ready[1], "x", 1) != 1) _exit(3);
      for (;;) pause();
    }
    close(ready[1]);
    char c = 0;
    ASSERT_EQ(read(ready[0], &c, 1), 1);
    close(ready[0]);
    EXPECT_FALSE(shm::lock_lease(fd, 1)) << "the child holds it";
    if (stop) {
      ASSERT_EQ(kill(child, SIGSTOP), 0);
      const std::uint64_t t0 = platform::monotonic_ns();
      EXPECT_FALSE(shm::lock_lease(fd, 48));
      EXPECT_LT(platform::monotonic_ns() - t0, 200'000'000u) << "waited for a stopped holder";
      kill(child, SIGCONT);
    }
    ASSERT_EQ(kill(child, SIGKILL), 0);
    int status = 0;
    ASSERT_EQ(waitpid(child, &status, 0), child);
    ASSERT_TRUE(WIFSIGNALED(status));
    // Dead: the lock is free at the first try, and its booking only delays
    // the next slot until the time it booked has passed.
    const std::uint64_t now = platform::monotonic_ns();
    ASSERT_TRUE(shm::lock_lease(fd, 1)) << "the dead holder's lock was not dropped";
    const std::uint64_t until = record(fd).booked_until_ns;
    shm::unlock_lease(fd);
    EXPECT_GT(until, now);
    EXPECT_LE(until, now + 800'000'000);
    EXPECT_EQ(book(fd, until + 1, 250'000), until + 1);
    EXPECT_EQ(claim(fd, now, 250'000, 80'000), record(fd).launched_until_ns) << "its launch is still ahead";
    EXPECT_EQ(claim(fd, until + 1, 250'000, 80'000), 0u) << "its launch is past";
  }
  close(fd);
}

// Another user's file in its place is never used (it could write the
// timetable); a symbolic link is not followed.
TEST(PriorityLease, ALinkInItsPlaceIsRefused) {
  Board b;
  mkdir((b.dir + "/low").c_str(), 01777);
  ASSERT_EQ(symlink("/etc/passwd", (b.dir + "/low/" + kUuid + shm::kLeaseSuffix).c_str()), 0);
  shm::Error err{};
  EXPECT_LT(shm::open_lease(b.dir.c_str(), Priority::low, kUuid, &err), 0);
  EXPECT_NE(std::string(err.message).find("lease"), std::string::npos) << err.message;
}

// The handoff (docs/priority.md, "Many tenants"): a booking waits for its
// slot on the lease's wake word, and a launch of the level that goes wakes
// exactly one waiter at once (the longest waiting), instead of every waiter
// sleeping to its slot while the device idles. Counted, not timed: how many
// waiters each wake woke, and which waiters returned woken rather than at
// their (5 s, bounding) timeout.
TEST(PriorityLease, ALaunchThatGoesWakesExactlyOneWaitingBooking) {
  Board b;
  const int fd = b.open();
  const std::uint32_t* word = shm::map_wake_word(fd);
  ASSERT_NE(word, nullptr);
  // A booking writes the record before it waits (a new file is empty: a wait
  // on its word, past the file's end, answers unavailable).
  EXPECT_EQ(shm::wait_wake(word, 0, 1'000'000), shm::Wake::unavailable);
  book(fd, platform::monotonic_ns(), 250'000);
  pid_t children[2];
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  for (pid_t& child : children) {
    child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      // Another process of the level: its own descriptor and mapping.
      shm::Error err{};
      const int own = shm::open_lease(b.dir.c_str(), Priority::low, kUuid, &err);
      const std::uint32_t* w = shm::map_wake_word(own);
      if (own < 0 || w == nullptr) _exit(2);
      std::uint32_t seen = record(own).wake_seq;
      if (write(ready[1], "x", 1) != 1) _exit(3);
      // As board::wait_turn: a word moved before it slept is read again.
      shm::Wake r = shm::Wake::moved;
      for (int i = 0; i < 100 && r == shm::Wake::moved; ++i) {
        r = shm::wait_wake(w, seen, 5'000'000'000ull);
        seen = record(own).wake_seq;
      }
      _exit(r == shm::Wake::woken ? 0 : r == shm::Wake::timeout ? 1 : 4);
    }
  }
  close(ready[1]);
  char c[2];
  ASSERT_EQ(read(ready[0], c, 1), 1);
  ASSERT_EQ(read(ready[0], c + 1, 1), 1);
  close(ready[0]);
  // Both block on the word: a wake finds one as soon as one waits (bounded
  // tries; a waiter not yet asleep returns woken on the moved word below).
  int woken = 0;
  for (int i = 0; i < 5000 && woken == 0; ++i) {
    woken = shm::wake_one(word);
    if (woken == 0) usleep(1000);
  }
  EXPECT_EQ(woken, 1) << "a wake woke no waiting booking";
  auto reap = [&](int want) {
    int exited = 0, woke = 0;
    for (int i = 0; i < 5000 && exited < want; ++i) {
      for (pid_t& child : children) {
        int status = 0;
        if (child > 0 && waitpid(child, &status, WNOHANG) == child) {
          ++exited;
          woke += WIFEXITED(status) && WEXITSTATUS(status) == 0;
          child = -1;
        }
      }
      if (exited < want) usleep(1000);
    }
    return woke;
  };
  EXPECT_EQ(reap(1), 1) << "the woken booking did not return woken";
  // The other still waits (one wake, one waiter); the next launch that goes
  // moves the word (limiter::launched_lease) and wakes it.
  limiter::Claim claimed;
  const std::uint64_t now = platform::monotonic_ns();
  ASSERT_EQ(claim(fd, now, 250'000, 80'000, &claimed), 0u);
  const std::uint32_t before = record(fd).wake_seq;
  launched(fd, claimed, now, 250'000);
  EXPECT_EQ(record(fd).wake_seq, before + 1) << "a launch that goes moves the word";
  int second = 0;
  for (int i = 0; i < 5000 && second == 0; ++i) {
    second = shm::wake_one(word);
    if (second == 0) usleep(1000);
  }
  EXPECT_EQ(second, 1);
  EXPECT_EQ(reap(1), 1) << "the second booking did not return woken";
  for (pid_t child : children)
    if (child > 0) kill(child, SIGKILL), waitpid(child, nullptr, 0);
  // No waiter: nobody to wake, and a wait on a word that moved returns at
  // once, not as a wake (that launch's wake went to another waiter).
  EXPECT_EQ(shm::wake_one(word), 0);
  EXPECT_EQ(shm::wait_wake(word, before, 5'000'000'000ull), shm::Wake::moved);
  EXPECT_EQ(shm::wait_wake(word, record(fd).wake_seq, 1'000'000), shm::Wake::timeout);
  // A file truncated under the mapping (another container may): the wait
  // answers unavailable (the caller sleeps), never a SIGBUS.
  ASSERT_EQ(ftruncate(fd, 0), 0);
  EXPECT_EQ(shm::wait_wake(word, 0, 1'000'000), shm::Wake::unavailable);
  EXPECT_EQ(shm::wake_one(word), 0);
  shm::unmap_wake_word(word);
  close(fd);
}

// A booking woken by the level's launch claims one lead before that launch
// should end: the device's pace, not its own slot's.
TEST(PriorityLease, AWokenBookingClaimsOneLeadBeforeTheLevelsWorkEnds) {
  constexpr std::uint64_t kT0 = 10'000'000'000ull;
  EXPECT_EQ(limiter::handoff_at(kT0 + 250'000, kT0, 80'000), kT0 + 170'000);
  EXPECT_EQ(limiter::handoff_at(kT0 + 50'000, kT0, 80'000), kT0) << "nearly done: at once";
  EXPECT_EQ(limiter::handoff_at(kT0 - 1, kT0, 80'000), kT0) << "done: at once";
  EXPECT_EQ(limiter::handoff_at(kT0 + 2 * limiter::kLeaseMaxAheadNs, kT0, 80'000), kT0) << "not believed";
}

}  // namespace
