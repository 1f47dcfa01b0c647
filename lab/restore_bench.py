#!/usr/bin/env python3
"""Restore measurements (issue 9): guestmem vm --restore in every mode beside a
Firecracker-style peer, handler scaling, eager threads and the plainest C reader.

Usage: python3 lab/restore_bench.py [--size 1G] [--rounds 5] [--out DIR]
Variants run interleaved (round by round), on memory touched before in the same run:
a warm-up round is run and dropped, and the image is read once first (page cache warm).
Prints a Markdown table: median, min and max of each figure, and the ratios the issue
asks for.
"""
import argparse, json, os, shutil, statistics, subprocess, sys

ap = argparse.ArgumentParser()
ap.add_argument("--size", default="1G")
ap.add_argument("--rounds", type=int, default=5)
ap.add_argument("--vcpus", type=int, default=2)
ap.add_argument("--out", default="/tmp/guestmem-restore-bench")
a = ap.parse_args()

BIN = "target/release/guestmem"
subprocess.run(["cargo", "build", "--release", "-q", "-p", "guestmem-cli"], check=True)
shutil.rmtree(a.out, ignore_errors=True)
os.makedirs(a.out)
creader = os.path.join(a.out, "eager_read")
subprocess.run(["cc", "-O2", "-pthread", "crates/guestmem-lab/c/eager_read.c", "-o", creader], check=True)
snap = os.path.join(a.out, "snap")
mode = "long64" if a.size.upper().endswith("G") and int(a.size[:-1]) >= 3 else "protected32"
common = ["--vcpus", str(a.vcpus), "--passes", "1", "--mode", mode]
subprocess.run([BIN, "vm", "--size", a.size, "--slots", "8", "--save", snap] + common,
               check=True, stdout=subprocess.DEVNULL)

def vm(*extra):
    out = subprocess.run([BIN, "vm", "--restore", snap, "--json"] + common + list(extra),
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)

# The working set, recorded once by a lazy restore without prefetch.
vm("--restore-mode", "lazy", "--prefetch", "none", "--record")
subprocess.run(["cat", os.path.join(snap, "memory")], stdout=subprocess.DEVNULL, check=True)

VARIANTS = {
    "eager": ["--restore-mode", "eager"],
    "mapped": ["--restore-mode", "mapped"],
    "lazy, prefetch none": ["--restore-mode", "lazy", "--prefetch", "none"],
    "lazy, prefetch recorded": ["--restore-mode", "lazy", "--prefetch", "recorded"],
    "fc-peer": ["--restore-mode", "fc-peer"],
    "lazy none, 1 handler": ["--restore-mode", "lazy", "--prefetch", "none", "--handler-threads", "1"],
    "lazy none, 2 handlers": ["--restore-mode", "lazy", "--prefetch", "none", "--handler-threads", "2"],
    "eager, 1 thread": ["--restore-mode", "eager", "--prefetch-threads", "1"],
    "eager, 2 threads": ["--restore-mode", "eager", "--prefetch-threads", "2"],
}
rows = {k: [] for k in VARIANTS}
CREADERS = {"C reader, 1 thread": ["1"], "C reader, 2 threads": ["2"],
            "C reader, 2 threads, THP-advised": ["2", "huge"]}
creads = {k: [] for k in CREADERS}
jobs = [("vm", k) for k in VARIANTS] + [("c", k) for k in CREADERS]
for rnd in range(a.rounds + 1):
    # Rotate the order each round: what ran just before a variant (its freed memory, the
    # host's reclaim, THP compaction) changes its time on this machine.
    k = rnd % len(jobs)
    for kind, name in jobs[k:] + jobs[:k]:
        if kind == "vm":
            r = vm(*VARIANTS[name])
            if rnd > 0:
                rows[name].append(r)
        else:
            s = float(subprocess.run([creader, os.path.join(snap, "memory")] + CREADERS[name],
                                     check=True, capture_output=True, text=True).stdout)
            if rnd > 0:
                creads[name].append(s)
    print(f"round {rnd} done", file=sys.stderr)

def stat(xs):
    return statistics.median(xs), min(xs), max(xs)

def fmt(xs, unit="s"):
    m, lo, hi = stat(xs)
    if unit == "s":
        return f"{m:.3f} ({lo:.3f}-{hi:.3f})"
    return f"{m:,.0f} ({lo:,.0f}-{hi:,.0f})"

print(f"\n{a.size} image, {a.vcpus} vCPUs, {mode}, {a.rounds} interleaved rounds (+1 warm-up dropped); median (min-max)\n")
print("| variant | setup s | guest start s | verify done s | demand paging pages/s | faults waited | huge coverage |")
print("|---|---|---|---|---|---|---|")
for name, rs in rows.items():
    rr = [r["restore"] for r in rs]
    faults = [ (x["lazy"] or {}).get("faults", 0) if x["lazy"] else (x["peer_faults"] or 0) for x in rr]
    print(f"| {name} | {fmt([x['setup_secs'] for x in rr])} | {fmt([r['guest_start_secs'] for r in rs])} | "
          f"{fmt([x['verify_done_secs'] for x in rr])} | {fmt([x['demand_paging_pages_per_sec'] for x in rr], 'n')} | "
          f"{statistics.median(faults):.0f} | {statistics.median([x['huge_coverage'] for x in rr]) * 100:.0f}% |")
for name, xs in creads.items():
    print(f"| {name} (mmap + pread only) | {fmt(xs)} | | | | | |")

med = lambda name, f: statistics.median([f(r) for r in rows[name]])
vd = lambda r: r["restore"]["verify_done_secs"]
rate = lambda r: r["restore"]["demand_paging_pages_per_sec"]
setup = lambda r: r["restore"]["setup_secs"]
print("\nRatios (of medians):")
print(f"- fc-peer / lazy recorded, verify done: {med('fc-peer', vd) / med('lazy, prefetch recorded', vd):.2f}x (target >= 3)")
print(f"- lazy recorded / eager, verify done: {med('lazy, prefetch recorded', vd) / med('eager', vd):.2f} (target <= 1)")
print(f"- 2 handlers / 1 handler, demand paging rate: {med('lazy none, 2 handlers', rate) / med('lazy none, 1 handler', rate):.2f}x (target >= 1.6)")
print(f"- eager 1 thread / 2 threads, setup: {med('eager, 1 thread', setup) / med('eager, 2 threads', setup):.2f}x (target >= 1.7)")
c2 = statistics.median(creads["C reader, 2 threads"])
c2h = statistics.median(creads["C reader, 2 threads, THP-advised"])
print(f"- eager 2 threads / C reader 2 threads: {med('eager, 2 threads', setup) / c2:.2f}; THP-advised: {med('eager, 2 threads', setup) / c2h:.2f} (target <= 1.2)")
