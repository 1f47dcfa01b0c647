//! The translate scenario (seed 004): guest-address lookups from several threads (vCPUs), each
//! looking up addresses in its own regions, as each vCPU of KVM's `dirty_log_perf_test`
//! touches its own memslot. The multi-threaded counterpart of the Criterion bench
//! `crates/guestmem/benches/translate.rs`.
//!
//! Regions of 2 MiB every 4 MiB (holes between, as memslots usually have). Thread `t` of `T`
//! owns regions `t*n/T .. (t+1)*n/T` (region `t % n` when there are fewer regions than
//! threads) and visits them in turn, [`LOOKUPS_PER_VISIT`] lookups per visit at
//! pseudo-random 8-byte-aligned offsets (the `own` pattern). In the `scattered` pattern each
//! lookup goes to a pseudo-random region of the thread's share instead, the cache's worst
//! case (a device worker serving buffers all over guest memory). Three ways to look up:
//!
//! - `guestmem-translator`: each thread's own [`guestmem::Translator`] (`find`), with its
//!   last-used-region cache.
//! - `guestmem-snapshot`: one shared [`guestmem::MapView`] (`find`): binary search, no cache.
//! - `vm-memory`: one shared `GuestMemoryMmap` (`find_region`): binary search, no cache.
//!
//! Every lookup's region start is summed and checked against the expected sum, so no
//! lookup can be optimised away or answer wrongly unnoticed.
//!
//! **What is timed**: each thread's own loop (ns per lookup), and the wall time from the
//! first thread's start to the last's end (aggregate lookups/s); threads are created and wait
//! at a gate first. Building the maps is not timed.

use std::hint::black_box;
use std::sync::Arc;

use guestmem::vm_memory::{GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};
use guestmem::{Guard, GuestAddress, GuestMap, RegionSpec, Thp};

use crate::error::LabError;
use crate::plot::{Bar, BarGroup};
use crate::report::{header, LabReport, LabResult};
use crate::run::{available_cpus, ratio, summarise, Order, Protocol, RunInfo, Sampled, Summary};
use crate::workers::timed;

/// The scenario's name.
pub const SCENARIO: &str = "translate";
/// Size of each region, in bytes.
pub const REGION_BYTES: u64 = 2 << 20;
/// Distance between region starts, in bytes.
pub const STRIDE_BYTES: u64 = 4 << 20;
/// Lookups in one region before a thread moves to its next region.
pub const LOOKUPS_PER_VISIT: usize = 1024;
/// Default region counts.
pub const DEFAULT_REGION_COUNTS: [usize; 4] = [1, 8, 64, 512];
/// Default lookups per thread per run.
pub const DEFAULT_LOOKUPS_PER_THREAD: usize = 1 << 23;
/// Default measured rounds.
pub const DEFAULT_ROUNDS: usize = 9;
/// Default warm-up rounds.
pub const DEFAULT_WARMUP_ROUNDS: usize = 1;
/// Nanoseconds per second.
const NS_PER_SEC: f64 = 1e9;
/// Lookups per second per million, for reports.
const PER_MILLION: f64 = 1e6;
/// Seed of the offsets' xorshift generator (fixed, so runs repeat).
const OFFSET_SEED: u64 = 0x2545_f491_4f6c_dd1d;

/// How to run the scenario.
#[derive(Debug, Clone)]
pub struct TranslateLabConfig {
    /// Region counts, each run as its own map.
    pub region_counts: Vec<usize>,
    /// Thread counts (default: 1 and the CPUs).
    pub threads: Vec<usize>,
    /// Lookups each thread makes per run; a multiple of [`LOOKUPS_PER_VISIT`].
    pub lookups_per_thread: usize,
    /// Access patterns (default: both).
    pub patterns: Vec<Pattern>,
    /// Warm-up, rounds, order.
    pub protocol: Protocol,
    /// The command line to record.
    pub command: String,
}

impl Default for TranslateLabConfig {
    fn default() -> Self {
        let mut threads = vec![1, available_cpus()];
        threads.dedup();
        TranslateLabConfig {
            region_counts: DEFAULT_REGION_COUNTS.to_vec(),
            threads,
            lookups_per_thread: DEFAULT_LOOKUPS_PER_THREAD,
            patterns: vec![Pattern::Own, Pattern::Scattered],
            protocol: Protocol {
                warmup: DEFAULT_WARMUP_ROUNDS,
                rounds: DEFAULT_ROUNDS,
                order: Order::default(),
            },
            command: String::new(),
        }
    }
}

/// Where a thread's lookups go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Pattern {
    /// [`LOOKUPS_PER_VISIT`] lookups in one region of the thread's share, then the next:
    /// a vCPU touching its own memslot.
    Own,
    /// Every lookup in a pseudo-random region of the thread's share: the cache's worst case.
    Scattered,
}

impl Pattern {
    /// The name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Pattern::Own => "own",
            Pattern::Scattered => "scattered",
        }
    }
}

/// How a lookup is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LookupKind {
    /// A per-thread guestmem `Translator` (cached).
    GuestmemTranslator,
    /// A shared guestmem `MapView` (binary search).
    GuestmemSnapshot,
    /// A shared vm-memory `GuestMemoryMmap::find_region` (binary search).
    VmMemory,
}

const KINDS: [LookupKind; 3] = [
    LookupKind::GuestmemTranslator,
    LookupKind::GuestmemSnapshot,
    LookupKind::VmMemory,
];

impl LookupKind {
    /// The name in reports.
    pub fn name(self) -> &'static str {
        match self {
            LookupKind::GuestmemTranslator => "guestmem-translator",
            LookupKind::GuestmemSnapshot => "guestmem-snapshot",
            LookupKind::VmMemory => "vm-memory",
        }
    }
}

/// One run of one variant.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TranslateSample {
    /// Wall seconds, first thread start to last thread end.
    pub seconds: f64,
    /// Each thread's nanoseconds per lookup.
    pub thread_ns_per_lookup: Vec<f64>,
    /// The mean over threads of their nanoseconds per lookup.
    pub ns_per_lookup: f64,
    /// All threads' lookups / wall seconds.
    pub lookups_per_sec: f64,
}

/// One variant's results on one region count.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TranslateVariant {
    /// Name in reports: `<kind>-<pattern>-<threads>`.
    pub name: String,
    /// How lookups are made.
    pub kind: LookupKind,
    /// Where they go.
    pub pattern: Pattern,
    /// Threads.
    pub threads: usize,
    /// Every run, warm-ups included.
    pub samples: Vec<Sampled<TranslateSample>>,
    /// Nanoseconds per lookup per thread over the measured rounds.
    pub ns_per_lookup: Summary,
    /// Aggregate lookups per second over the measured rounds.
    pub lookups_per_sec: Summary,
    /// vm-memory's median ns per lookup at the same pattern and thread count / this
    /// variant's.
    pub speedup_vs_vm_memory: f64,
}

/// One region count's results.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RegionCountResult {
    /// Regions in the map.
    pub regions: usize,
    /// The variants: every kind at every thread count, kinds first.
    pub variants: Vec<TranslateVariant>,
}

/// Settings a result was measured with.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TranslateSettings {
    /// Region counts.
    pub region_counts: Vec<usize>,
    /// Thread counts.
    pub threads: Vec<usize>,
    /// Lookups per thread per run.
    pub lookups_per_thread: usize,
    /// Lookups per visit to a region.
    pub lookups_per_visit: usize,
    /// Access patterns.
    #[serde(default)]
    pub patterns: Vec<Pattern>,
    /// Warm-up, rounds, order.
    pub protocol: Protocol,
}

/// What the scenario found.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TranslateFindings {
    /// One entry per region count.
    pub region_counts: Vec<RegionCountResult>,
}

/// The scenario's whole result, as written to `result.json`.
pub type TranslateResult = LabResult<TranslateSettings, TranslateFindings>;

/// The regions thread `t` of `threads` looks up in, of `n`.
fn share(t: usize, threads: usize, n: usize) -> std::ops::Range<usize> {
    if n >= threads {
        t * n / threads..(t + 1) * n / threads
    } else {
        t % n..t % n + 1
    }
}

/// The guest addresses of one pass of `pattern` over `regions`, and the sum of the region
/// starts they are in (what one pass of lookups must find). `own`: each region in turn,
/// [`LOOKUPS_PER_VISIT`] pseudo-random 8-byte-aligned offsets in it; `scattered`: as many
/// lookups, each in a pseudo-random region of `regions`.
fn addresses(regions: std::ops::Range<usize>, pattern: Pattern) -> (Vec<u64>, u64) {
    let mut x = OFFSET_SEED;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let n = regions.len() as u64;
    let mut out = Vec::with_capacity(regions.len() * LOOKUPS_PER_VISIT);
    let mut sum = 0u64;
    for r in regions.clone() {
        for _ in 0..LOOKUPS_PER_VISIT {
            let region = match pattern {
                Pattern::Own => r as u64,
                Pattern::Scattered => regions.start as u64 + (next() >> 32) % n,
            };
            let start = region * STRIDE_BYTES;
            out.push(start + ((next() % REGION_BYTES) & !7));
            sum = sum.wrapping_add(start);
        }
    }
    (out, sum)
}

/// Makes `lookups` lookups, going round `addresses` (one pass: `pass_sum`), with `find`
/// (which returns the region's guest start); whether every lookup found its region.
#[inline(always)]
fn drive(
    addresses: &[u64],
    pass_sum: u64,
    lookups: usize,
    find: impl Fn(GuestAddress) -> Option<u64>,
) -> bool {
    let mut sum = 0u64;
    let mut want = 0u64;
    let mut done = 0;
    while done < lookups {
        let pass = &addresses[..addresses.len().min(lookups - done)];
        for &a in pass {
            match find(black_box(GuestAddress(a))) {
                Some(start) => sum = sum.wrapping_add(start),
                None => return false,
            }
        }
        if pass.len() == addresses.len() {
            want = want.wrapping_add(pass_sum);
        } else {
            // A last, partial pass (lookups are a multiple of a visit, a pass of visits).
            let partial: u64 = pass.iter().fold(0u64, |s, &a| {
                s.wrapping_add(a / STRIDE_BYTES * STRIDE_BYTES)
            });
            want = want.wrapping_add(partial);
        }
        done += pass.len();
    }
    sum == want
}

struct Maps {
    n: usize,
    guestmem: GuestMap,
    snapshot: Arc<guestmem::MapView>,
    vmm: GuestMemoryMmap<()>,
}

fn build(n: usize) -> Result<Maps, LabError> {
    let specs: Vec<RegionSpec> = (0..n as u64)
        .map(|i| {
            RegionSpec::new(GuestAddress(i * STRIDE_BYTES), REGION_BYTES)
                .with_thp(Thp::Default)
                .with_guard(Guard::Off)
        })
        .collect();
    let guestmem = GuestMap::from_specs(&specs)?;
    let ranges: Vec<(GuestAddress, usize)> = (0..n as u64)
        .map(|i| (GuestAddress(i * STRIDE_BYTES), REGION_BYTES as usize))
        .collect();
    let vmm =
        GuestMemoryMmap::from_ranges(&ranges).map_err(|e| LabError::VmMemory(e.to_string()))?;
    Ok(Maps {
        n,
        snapshot: guestmem.view(),
        guestmem,
        vmm,
    })
}

fn measure(
    maps: &Maps,
    (kind, pattern, threads): (LookupKind, Pattern, usize),
    lookups: usize,
) -> Result<TranslateSample, LabError> {
    let passes: Vec<(Vec<u64>, u64)> = (0..threads)
        .map(|t| addresses(share(t, threads, maps.n), pattern))
        .collect();
    let (seconds, times) = timed(SCENARIO, threads, |t| {
        let (addrs, pass_sum) = (&passes[t].0, passes[t].1);
        match kind {
            LookupKind::GuestmemTranslator => {
                let tr = maps.guestmem.translator();
                drive(addrs, pass_sum, lookups, |a| {
                    tr.find(a).map(|r| r.guest_addr().0)
                })
            }
            LookupKind::GuestmemSnapshot => drive(addrs, pass_sum, lookups, |a| {
                maps.snapshot.find(a).map(|r| r.guest_addr().0)
            }),
            LookupKind::VmMemory => drive(addrs, pass_sum, lookups, |a| {
                maps.vmm.find_region(a).map(|r| r.start_addr().0)
            }),
        }
    })?;
    if let Some(t) = times.iter().position(|w| !w.value) {
        return Err(LabError::Config {
            scenario: SCENARIO,
            reason: format!("{} thread {t} found a wrong region", kind.name()),
        });
    }
    let ns: Vec<f64> = times
        .iter()
        .map(|w| w.seconds * NS_PER_SEC / lookups as f64)
        .collect();
    Ok(TranslateSample {
        seconds,
        ns_per_lookup: ns.iter().sum::<f64>() / ns.len() as f64,
        thread_ns_per_lookup: ns,
        lookups_per_sec: ratio((threads * lookups) as f64, seconds),
    })
}

/// Runs the scenario and returns its result; writes nothing (see [`crate::report::write_run`]).
pub fn run_translate(cfg: &TranslateLabConfig) -> Result<TranslateResult, LabError> {
    cfg.protocol.validate(SCENARIO)?;
    let bad = |reason: String| LabError::Config {
        scenario: SCENARIO,
        reason,
    };
    if cfg.threads.is_empty() || cfg.threads.contains(&0) {
        return Err(bad("thread counts must be given and non-zero".into()));
    }
    if cfg.region_counts.is_empty() || cfg.region_counts.contains(&0) {
        return Err(bad("region counts must be given and non-zero".into()));
    }
    if cfg.lookups_per_thread == 0 || !cfg.lookups_per_thread.is_multiple_of(LOOKUPS_PER_VISIT) {
        return Err(bad(format!(
            "lookups per thread must be a non-zero multiple of {LOOKUPS_PER_VISIT}"
        )));
    }
    let run = RunInfo::collect(cfg.command.clone());
    if cfg.patterns.is_empty() {
        return Err(bad("at least one pattern must be given".into()));
    }
    let variants: Vec<(LookupKind, Pattern, usize)> = cfg
        .patterns
        .iter()
        .flat_map(|&p| {
            cfg.threads
                .iter()
                .flat_map(move |&t| KINDS.iter().map(move |&k| (k, p, t)))
        })
        .collect();
    let mut region_counts = Vec::with_capacity(cfg.region_counts.len());
    for &n in &cfg.region_counts {
        let maps = build(n)?;
        let samples = cfg.protocol.run(variants.len(), |i| {
            measure(&maps, variants[i], cfg.lookups_per_thread)
        })?;
        let mut out: Vec<TranslateVariant> = variants
            .iter()
            .zip(samples)
            .map(|(&(kind, pattern, threads), samples)| TranslateVariant {
                name: format!("{}-{}-{threads}", kind.name(), pattern.name()),
                kind,
                pattern,
                threads,
                ns_per_lookup: summarise(&samples, |s| s.ns_per_lookup),
                lookups_per_sec: summarise(&samples, |s| s.lookups_per_sec),
                speedup_vs_vm_memory: 0.0,
                samples,
            })
            .collect();
        let vmm: Vec<(Pattern, usize, f64)> = out
            .iter()
            .filter(|v| v.kind == LookupKind::VmMemory)
            .map(|v| (v.pattern, v.threads, v.ns_per_lookup.median))
            .collect();
        for v in &mut out {
            if let Some(&(_, _, base)) = vmm
                .iter()
                .find(|(p, t, _)| *p == v.pattern && *t == v.threads)
            {
                v.speedup_vs_vm_memory = ratio(base, v.ns_per_lookup.median);
            }
        }
        region_counts.push(RegionCountResult {
            regions: n,
            variants: out,
        });
    }
    Ok(LabResult {
        scenario: SCENARIO.into(),
        seeds: vec!["004".into()],
        run,
        settings: TranslateSettings {
            region_counts: cfg.region_counts.clone(),
            threads: cfg.threads.clone(),
            lookups_per_thread: cfg.lookups_per_thread,
            lookups_per_visit: LOOKUPS_PER_VISIT,
            patterns: cfg.patterns.clone(),
            protocol: cfg.protocol,
        },
        timed: "per thread: its lookup loop (ns/lookup); wall: first thread start to last \
                thread end (aggregate lookups/s); threads wait at a gate before; maps built \
                untimed"
            .into(),
        body: TranslateFindings { region_counts },
    })
}

impl LabReport for TranslateResult {
    fn markdown(&self) -> String {
        let s = &self.settings;
        let mut md = header(
            "translate (seed 004)",
            &self.run,
            "n/a (lookups only)",
            &s.protocol,
            &format!(
                "Regions of 2 MiB every 4 MiB; each thread owns an equal share of them and \
                 makes {} lookups per run: `own`, {} per visit to a region; `scattered`, each \
                 in a pseudo-random region of its share. Timed: {}.\n",
                s.lookups_per_thread, s.lookups_per_visit, self.timed
            ),
        );
        for rc in &self.body.region_counts {
            md.push_str(&format!(
                "\n## {} region(s)\n\n| variant | threads | ns/lookup/thread median | min | max \
                 | aggregate M lookups/s @median | vm-memory ns / this ns |\n\
                 |---|---|---|---|---|---|---|\n",
                rc.regions
            ));
            for v in &rc.variants {
                md.push_str(&format!(
                    "| {} | {} | {:.2} | {:.2} | {:.2} | {:.1} | {:.2}x |\n",
                    v.name,
                    v.threads,
                    v.ns_per_lookup.median,
                    v.ns_per_lookup.min,
                    v.ns_per_lookup.max,
                    v.lookups_per_sec.median / PER_MILLION,
                    v.speedup_vs_vm_memory,
                ));
            }
        }
        md
    }

    fn bars(&self) -> (&'static str, Vec<BarGroup>) {
        let groups = self
            .body
            .region_counts
            .iter()
            .map(|r| BarGroup {
                title: format!("{} regions", r.regions),
                bars: r
                    .variants
                    .iter()
                    .map(|v| Bar::of(&v.name, &v.ns_per_lookup))
                    .collect(),
            })
            .collect();
        (
            "ns per lookup per thread (bar: median, line: min to max)",
            groups,
        )
    }
}
