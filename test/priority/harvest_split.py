#!/usr/bin/env python3
"""Where the idle time the low tenants leave goes (docs/log/2026-11-29-priority-harvest.md).

Reads a PRIO_TENANT_TRACE directory of the many-tenants sweep (prio_tenant.cc:
<pid>.low per low tenant, high.bursts) from a run on the ideal profile, where a
kernel starts when it is launched unless the device is busy, so every low
kernel is [end - KERNEL, end). The device's idle time between the high
tenant's bursts is split into the 2 ms after each burst (the high tenant's
linger, by design) and the rest. Each sleep of a gate (inside cuLaunchKernel)
makes its tenant *due* from its planned wake until its next sleep or the
launch's return; an instant of the rest is charged to the due tenant with the
earliest planned wake:
  hole        no tenant due: every gate asleep until later (design)
  wake-cpu    woken, waiting for a CPU (schedstat run_delay)
  wake-timer  woken later than planned, not for a CPU (timer slack)
  path-cpu    after the wake, on its way to its launch, waiting for a CPU
  path-run    ... running (or blocked in) the gate's path and the launch
  refused-*   woke, looked, and slept again (so did not launch), by the next
              sleep's length: lock (250 us: the level's lock taken), token
              (d - lead: another launch holds the token), hold (<= 1 ms: a
              higher tenant active), slot (longer: a new slot booked);
              (lock_lease's 10 us tries count as token); -cpu: the part of
              it spent waiting for a CPU
Usage: harvest_split.py DIR [KERNEL_US=250]
"""
import bisect
import glob
import heapq
import os
import sys


def main():
    d = sys.argv[1]
    kernel = int(sys.argv[2]) * 1000 if len(sys.argv) > 2 else 250_000
    bursts = []
    with open(os.path.join(d, "high.bursts")) as f:
        for line in f:
            if line[0] != "B":  # H (its launches) and G (the device's busy intervals) lines
                continue
            _, t0, lat = line.split()[:3]
            bursts.append((int(t0), int(t0) + int(lat)))
    launches, per_tenant, sleeps = [], {}, {}
    files = glob.glob(os.path.join(d, "*.low"))
    for t, path in enumerate(files):
        mine, sl = [], {}
        with open(path) as f:
            for line in f:
                v = [int(x) for x in line.split()[1:]]
                if line[0] == "L":
                    mine.append(v)
                else:
                    sl.setdefault(v[5], []).append(v)
        launches.extend(mine)
        per_tenant[t] = mine
        sleeps[t] = sl
    starts = set(v[2] - kernel for v in launches)
    busy = sorted([(s, s + kernel) for s in starts] + bursts)
    merged = []
    for s, e in busy:
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])

    def frac(cpu, length):
        return min(max(cpu, 0), length) / length if length > 0 else 0.0

    due = []  # (from, to, kind, cpu fraction)
    for t, sl in sleeps.items():
        for li, vs in sl.items():
            if li >= len(per_tenant[t]):
                continue
            L = per_tenant[t][li]
            vs.sort()
            for i, (st, target, wake, rd0, rd1) in enumerate(v[:5] for v in vs):
                if wake > target:
                    due.append((target, wake, "wake", frac(rd1 - rd0, wake - target)))
                if i + 1 < len(vs):
                    nxt = vs[i + 1]
                    n = nxt[1] - nxt[0]
                    kind = ("refused-lock" if 245_000 <= n <= 255_000 else
                            "refused-token" if n < 245_000 else
                            "refused-hold" if n <= 1_070_000 else "refused-slot")
                    if nxt[0] > wake:
                        due.append((wake, nxt[0], kind, frac(nxt[3] - rd1, nxt[0] - wake)))
                else:
                    # Until its kernel starts (no later: what the call does
                    # after the launch delays nothing).
                    to = min(L[1], L[2] - kernel)
                    if to > wake:
                        due.append((wake, to, "path", frac(L[4] - rd1, L[1] - wake)))
    due.sort()
    t_begin, t_end = bursts[0][0], bursts[-1][1]
    high_busy = sum(e - s for s, e in bursts)
    near = [(bursts[i][1], min(bursts[i][1] + 2_000_000, bursts[i + 1][0])) for i in range(len(bursts) - 1)]
    near_starts = [a for a, _ in near]

    def near_part(a, b):
        total, i = 0, max(bisect.bisect_right(near_starts, a) - 1, 0)
        while i < len(near) and near[i][0] < b:
            lo, hi = max(a, near[i][0]), min(b, near[i][1])
            total += max(0, hi - lo)
            i += 1
        return total

    cats = {}

    def add(k, v):
        cats[k] = cats.get(k, 0.0) + v

    step = 2000
    heap, di = [], 0  # active due intervals by planned start
    for k in range(len(merged) - 1):
        e, s = merged[k][1], merged[k + 1][0]
        if e >= t_end or s <= t_begin:
            continue
        n = near_part(e, s)
        add("near-2ms", n)
        t = e + n  # the far part is the gap's tail (near windows begin at a burst's end)
        while t < s:
            while di < len(due) and due[di][0] <= t:
                heapq.heappush(heap, due[di])
                di += 1
            while heap and heap[0][1] <= t:
                heapq.heappop(heap)
            w = min(step, s - t)
            if not heap:
                add("hole", w)
            else:
                _, _, kind, cpu = heap[0]
                add(kind + "-cpu", w * cpu)
                add(kind + {"wake": "-timer", "path": "-run"}.get(kind, ""), w * (1 - cpu))
            t += w
    left = (t_end - t_begin) - high_busy
    idle = sum(cats.values())
    print(f"tenants {len(files)} launches {len(launches)} kernels {len(starts)} bursts {len(bursts)} "
          f"left_ms {left / 1e6:.1f} idle_ms {idle / 1e6:.1f} harvest {100 * (1 - idle / left):.1f}")
    print("  idle, % of the time left: " + " ".join(f"{c} {100 * v / left:.2f}" for c, v in sorted(cats.items())))
    late = sorted(v[2] - v[1] for sl in sleeps.values() for vs in sl.values() for v in vs)
    cpu = sorted(v[4] - v[3] for sl in sleeps.values() for vs in sl.values() for v in vs)
    if late:
        def q(xs, p):
            return xs[min(len(xs) - 1, len(xs) * p // 100)] / 1000
        print(f"  gate sleeps {len(late)}: woken after planned (us) p50 {q(late, 50):.0f} p90 {q(late, 90):.0f} "
              f"p99 {q(late, 99):.0f}; of it CPU wait p50 {q(cpu, 50):.0f} p90 {q(cpu, 90):.0f} p99 {q(cpu, 99):.0f}")


if __name__ == "__main__":
    main()
