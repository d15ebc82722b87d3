// NVML utilisation samples -> measurement windows. See compute_samples.h.
#include "limiter/compute_samples.h"

#include "limiter/compute.h"

namespace gpuslice::limiter {
namespace {

// Stamps closer than this are one sampling instant (a driver may stamp each
// process's sample separately, microseconds apart); also the shortest period
// that is believed.
constexpr std::uint64_t kSameInstantUs = 5'000;
constexpr unsigned kMaxInstants = 64;

struct Instants {
  std::uint64_t at[kMaxInstants];  // ascending; each the latest stamp of its cluster
  unsigned n = 0;

  void add(std::uint64_t stamp) noexcept {
    for (unsigned i = 0; i < n; ++i) {
      const std::uint64_t d = stamp > at[i] ? stamp - at[i] : at[i] - stamp;
      if (d < kSameInstantUs) {
        if (stamp > at[i]) at[i] = stamp;
        return;
      }
    }
    if (n == kMaxInstants) return;  // beyond NVML's buffer: folded into the nearest below
    unsigned i = n++;
    while (i > 0 && at[i - 1] > stamp) {
      at[i] = at[i - 1];
      --i;
    }
    at[i] = stamp;
  }
  // Index of the instant a stamp belongs to.
  unsigned of(std::uint64_t stamp) const noexcept {
    unsigned best = 0;
    std::uint64_t best_d = ~0ull;
    for (unsigned i = 0; i < n; ++i) {
      const std::uint64_t d = stamp > at[i] ? stamp - at[i] : at[i] - stamp;
      if (d < best_d) {
        best_d = d;
        best = i;
      }
    }
    return best;
  }
};

}  // namespace

void samples_begin(SampleClock& c, std::uint64_t now_us) noexcept {
  c.last_seen_us = now_us;
  c.last_is_stamp = false;
  // The mode and period are properties of the driver: kept across baselines.
}

std::uint32_t share_permille(std::uint64_t busy_ns, std::uint64_t window_ns) noexcept {
  if (window_ns == 0) return 0;
  // 128 bits: busy x 1000 overflows 64 past ~213 days of device time.
  const unsigned __int128 pm = static_cast<unsigned __int128>(busy_ns) * kFullPermille / window_ns;
  return pm > kFullPermille ? kFullPermille : static_cast<std::uint32_t>(pm);
}

bool samples_window(SampleClock& c, nvmlReturn_t rc, const nvmlProcessUtilizationSample_t* samples, unsigned n,
                    std::uint64_t asked_us, AddBusy add, void* ctx, std::uint64_t* window_ns) noexcept {
  if (rc != NVML_SUCCESS && rc != NVML_ERROR_NOT_FOUND) return false;
  if (rc != NVML_SUCCESS) n = 0;
  Instants inst;
  for (unsigned i = 0; i < n; ++i)
    if (samples[i].timeStamp > c.last_seen_us) inst.add(samples[i].timeStamp);

  if (inst.n == 0) {
    // Nothing new. With exact windows that is an idle window; with a
    // sampling driver, only once two whole periods passed without a sample.
    const std::uint64_t since = asked_us > c.last_seen_us ? asked_us - c.last_seen_us : 0;
    std::uint64_t end = asked_us;
    if (c.periodic && c.period_us != 0) {
      const std::uint64_t periods = since / c.period_us;
      if (periods < 3) return false;
      end = c.last_seen_us + (periods - 1) * c.period_us;  // the newest period may not be published yet
    } else if (!c.exact || c.periodic) {
      if (since < kNoSampleIdleUs) return false;
    }
    if (end <= c.last_seen_us) return false;
    // A window closed at "now" is off the sample grid: the next gap teaches no period.
    if (end == asked_us) c.last_is_stamp = false;
    *window_ns = (end - c.last_seen_us) * 1000;
    c.last_seen_us = end;
    return true;
  }

  // Which kind of NVML: a sampling one stamps the end of a period that was
  // already over when asked (before asked_us, read before the call); an exact
  // one stamps the moment of the call (never before asked_us).
  const std::uint64_t newest = inst.at[inst.n - 1];
  if (newest < asked_us) c.periodic = true;
  if (!c.periodic) c.exact = true;

  // Learn the period: the smallest gap between consecutive instants.
  if (c.periodic) {
    std::uint64_t prev = c.last_is_stamp ? c.last_seen_us : 0;
    for (unsigned i = 0; i < inst.n; ++i) {
      if (prev != 0 && inst.at[i] - prev >= kSameInstantUs && (c.period_us == 0 || inst.at[i] - prev < c.period_us))
        c.period_us = inst.at[i] - prev;
      prev = inst.at[i];
    }
  }

  // Each sample weighs the time it covers: the gap to the previous instant,
  // at most one period (before a gap with no sample at all, nobody ran).
  std::uint64_t weight_us[kMaxInstants];
  std::uint64_t prev = c.last_seen_us;
  for (unsigned i = 0; i < inst.n; ++i) {
    std::uint64_t w = inst.at[i] - prev;
    if (c.periodic && c.period_us != 0 && w > c.period_us) w = c.period_us;
    weight_us[i] = w;
    prev = inst.at[i];
  }
  for (unsigned i = 0; i < n; ++i) {
    if (samples[i].timeStamp <= c.last_seen_us) continue;
    const std::uint64_t pct = samples[i].smUtil > 100 ? 100 : samples[i].smUtil;
    add(ctx, samples[i].pid, pct * weight_us[inst.of(samples[i].timeStamp)] * 10);  // % x us -> ns
  }
  *window_ns = (newest - c.last_seen_us) * 1000;
  c.last_seen_us = newest;
  c.last_is_stamp = true;
  return true;
}

namespace {

struct Split {
  IsOurs is_ours;
  const void* ctx;
  std::uint64_t busy_ns = 0, others_ns = 0;
};

void add_split(void* split, std::uint32_t pid, std::uint64_t busy_ns) noexcept {
  Split& s = *static_cast<Split*>(split);
  (s.is_ours(s.ctx, pid) ? s.busy_ns : s.others_ns) += busy_ns;
}

}  // namespace

bool samples_reduce(SampleClock& c, nvmlReturn_t rc, const nvmlProcessUtilizationSample_t* samples, unsigned n,
                    std::uint64_t asked_us, IsOurs is_ours, const void* ctx, Measurement* out) noexcept {
  Split split{is_ours, ctx};
  std::uint64_t window_ns = 0;
  if (!samples_window(c, rc, samples, n, asked_us, add_split, &split, &window_ns)) return false;
  out->window_ns = window_ns;
  out->busy_ns = split.busy_ns;
  out->others_ns = split.others_ns;
  // A sampling NVML reports whole percents of its period: each of the
  // container's samples may be half a percent off (one process's worth is
  // counted; more is noise the sums average out). An exact one is exact.
  out->resolution_ns = c.periodic ? window_ns / 200 : 0;
  return true;
}

}  // namespace gpuslice::limiter
