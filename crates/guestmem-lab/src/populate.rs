//! The populate scenario (seeds 000 and 001): how fast fresh guest memory comes up, and how
//! much of it the kernel backs with huge pages, for guestmem and the peers.
//!
//! **What is timed**, per variant and round: from just before the first `mmap` until the last
//! region is populated, and for the Cloud Hypervisor peer until its late THP advice returns:
//! mapping, THP advice, thread creation and populate. guestmem's time is
//! [`GuestMap::from_specs`] plus [`bringup()`] with [`Verify::Off`] (its limit check included);
//! its own populate phase is recorded beside it. Inspecting (smaps) and unmapping are not
//! timed.
//!
//! **Protocol.** The shared [`Protocol`]: `warmup` rounds first (recorded, not summarised),
//! then `rounds` rounds in which every variant runs once (in a new shuffled order each round
//! by default, see [`Order`]), each on fresh memory that is unmapped afterwards, followed by
//! an optional pause (`settle`).
//!
//! The pause defaults to none ([`DEFAULT_SETTLE`]). The project machine is a VM whose host
//! takes back memory about two seconds after the guest frees it (free page reporting), and a
//! first touch of reclaimed memory costs the host several times a normal fault. Measured
//! here (4 GiB, 5 rounds): with no pause every variant ran steadily (guestmem-2 0.259-0.288 s
//! on one region); with 3 s every variant was 2-3x slower and two threads barely helped,
//! since the host's own faults became the limit; with 1 s, rounds flipped between the two
//! regimes and medians of identical code moved by 40%. No pause compares the userspace
//! code, which is what the lab is for; `--settle-ms 3000` shows the reclaimed-host regime.

use std::time::{Duration, Instant};

use guestmem::inspect::{self, RegionUsage};
use guestmem::jobs::default_threads;
use guestmem::layout::THP_BYTES;
use guestmem::{
    bringup, BringupConfig, GuestAddress, GuestMap, Method, PinPolicy, PinStrategy, PopulateConfig,
    RegionSpec, Verify,
};

use crate::error::LabError;
use crate::peer::{self, PeerRun};
use crate::plot::{Bar, BarGroup};
use crate::report::{header, runs_label, sizes_label, LabReport, LabResult};
use crate::run::{
    available_cpus, ratio, summarise, thp_mode, Order, Protocol, RunInfo, Sampled, Summary,
};
use crate::{peer_ch, peer_qemu};

/// Default total guest memory of a layout, in bytes.
pub const DEFAULT_SIZE_BYTES: u64 = 4 << 30;
/// Default measured rounds.
pub const DEFAULT_ROUNDS: usize = 15;
/// Default warm-up rounds.
pub const DEFAULT_WARMUP_ROUNDS: usize = 1;
/// Default pause after each variant unmaps: none (see the module docs for why).
pub const DEFAULT_SETTLE: Duration = Duration::from_millis(0);
/// Bytes per decimal gigabyte (rates are quoted in GB/s, as published populate rates are).
pub const BYTES_PER_GB: f64 = 1e9;
/// The `unequal` layout's regions, as fractions of the total: 1/2, 1/4, 1/8, 1/16, 1/16
/// (2G + 1G + 512M + 256M + 256M of 4 GiB).
pub const UNEQUAL_SHARES_LOG2: [u32; 5] = [1, 2, 3, 4, 4];

/// The scenario's name.
pub const SCENARIO: &str = "populate";

/// A layout of the scenario.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LayoutKind {
    /// One region of the whole size.
    Single,
    /// Several unequal regions ([`UNEQUAL_SHARES_LOG2`]) summing to the size.
    Unequal,
    /// Many small regions of [`DIMM_BYTES`] each, as a VM built from hot-pluggable memory
    /// DIMMs is: QEMU preallocates each DIMM on its own, and with min(CPUs, 16, size / 64 MiB)
    /// threads a 64 MiB DIMM gets one thread.
    Dimms,
}

/// Size of one region of [`LayoutKind::Dimms`].
pub const DIMM_BYTES: u64 = 64 << 20;

impl LayoutKind {
    /// The name in reports.
    pub fn name(self) -> &'static str {
        match self {
            LayoutKind::Single => "single",
            LayoutKind::Unequal => "unequal",
            LayoutKind::Dimms => "dimms",
        }
    }

    /// Region sizes for a total of `size` bytes; each a whole number of 2 MiB pages.
    pub fn sizes(self, size: u64) -> Result<Vec<u64>, LabError> {
        let granule = match self {
            LayoutKind::Single => THP_BYTES,
            LayoutKind::Unequal => THP_BYTES << UNEQUAL_SHARES_LOG2.iter().max().unwrap_or(&0),
            LayoutKind::Dimms => DIMM_BYTES,
        };
        if size == 0 || !size.is_multiple_of(granule) {
            return Err(LabError::Config {
                scenario: SCENARIO,
                reason: format!(
                    "layout {}: size {size:#x} must be a non-zero multiple of {granule:#x} bytes",
                    self.name()
                ),
            });
        }
        Ok(match self {
            LayoutKind::Single => vec![size],
            LayoutKind::Unequal => UNEQUAL_SHARES_LOG2.iter().map(|s| size >> s).collect(),
            LayoutKind::Dimms => vec![DIMM_BYTES; (size / DIMM_BYTES) as usize],
        })
    }
}

/// How to run the scenario.
#[derive(Debug, Clone)]
pub struct PopulateLabConfig {
    /// Total bytes of each layout.
    pub size: u64,
    /// Warm-up, rounds, order.
    pub protocol: Protocol,
    /// Layouts, run one after another.
    pub layouts: Vec<LayoutKind>,
    /// Pause after each variant unmaps.
    pub settle: Duration,
    /// N, the threads of the multi-threaded guestmem variants (default: all CPUs, at most 16).
    pub threads: usize,
    /// Also guestmem's other ways: the `/proc/self/mem` touch fallback instead of
    /// `MADV_POPULATE_WRITE`, and pinning per chunk instead of up front.
    pub methods: bool,
    /// The command line to record.
    pub command: String,
}

impl Default for PopulateLabConfig {
    fn default() -> Self {
        PopulateLabConfig {
            size: DEFAULT_SIZE_BYTES,
            protocol: Protocol {
                warmup: DEFAULT_WARMUP_ROUNDS,
                rounds: DEFAULT_ROUNDS,
                order: Order::default(),
            },
            layouts: vec![LayoutKind::Single, LayoutKind::Unequal, LayoutKind::Dimms],
            settle: DEFAULT_SETTLE,
            threads: default_threads(),
            methods: false,
            command: String::new(),
        }
    }
}

/// One way of bringing memory up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Variant {
    Guestmem {
        threads: usize,
        pin: PinStrategy,
        method: Method,
    },
    Qemu,
    Ch,
}

impl Variant {
    fn name(self, n: usize) -> String {
        match self {
            Variant::Guestmem {
                method: Method::Touch,
                threads,
                ..
            } => format!("guestmem-touch-{threads}"),
            Variant::Guestmem {
                pin: PinStrategy::None,
                threads,
                ..
            } => format!("guestmem-{threads}"),
            Variant::Guestmem {
                pin: PinStrategy::PerChunk,
                ..
            } => "guestmem-pin-chunks".into(),
            Variant::Guestmem { threads, .. } if threads == n => "guestmem-pin".into(),
            Variant::Guestmem { threads, .. } => format!("guestmem-pin-{threads}"),
            Variant::Qemu => peer_qemu::NAME.into(),
            Variant::Ch => peer_ch::NAME.into(),
        }
    }

    fn describe(self) -> String {
        match self {
            Variant::Guestmem {
                threads,
                pin,
                method,
            } => format!(
                "GuestMap::from_specs (2 MiB congruent, guards, MADV_HUGEPAGE) + bringup, \
                 {threads} thread(s), one job over all regions, {method:?}, pin {pin:?}"
            ),
            Variant::Qemu => "qemu_prealloc_mem: per region, 2 MiB-aligned mmap, MADV_HUGEPAGE, \
                 min(CPUs,16,size/64MiB) threads on a static 4 KiB split, MADV_POPULATE_WRITE"
                .into(),
            Variant::Ch => "create_ram_region_raw: per region, plain mmap, min(16,size/4GiB) \
                 threads, MADV_POPULATE_WRITE, MADV_HUGEPAGE after prefault"
                .into(),
        }
    }
}

/// One run of one variant.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Sample {
    /// Timed seconds: map + advice + populate (see the module docs).
    pub seconds: f64,
    /// guestmem only: its own lock + populate phases.
    pub populate_phase_seconds: Option<f64>,
    /// Bytes brought up.
    pub size: u64,
    /// Bytes resident afterwards (smaps).
    pub resident: u64,
    /// Bytes mapped by huge pages afterwards.
    pub huge: u64,
    /// Bytes that huge pages could cover (each mapping's 2 MiB-aligned span).
    pub huge_span: u64,
    /// Bytes locked.
    pub locked: u64,
    /// Mappings (regions) brought up.
    pub mappings: usize,
    /// Of them, those whose host start is 2 MiB aligned.
    pub thp_aligned_mappings: usize,
    /// Populate threads per region (guestmem: threads of its one job).
    pub threads: Vec<usize>,
}

impl Sample {
    /// `huge / huge_span`.
    pub fn huge_coverage(&self) -> f64 {
        if self.huge_span == 0 {
            0.0
        } else {
            self.huge as f64 / self.huge_span as f64
        }
    }
}

/// One variant's results on one layout.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct VariantResult {
    /// Name in reports.
    pub name: String,
    /// What it does.
    pub description: String,
    /// Every run, warm-ups included.
    pub samples: Vec<Sampled<Sample>>,
    /// Timed seconds of the measured rounds.
    pub seconds: Summary,
    /// Layout bytes / median seconds, in GB/s.
    pub gbps_at_median: f64,
    /// Median seconds / guestmem-N's median seconds (above 1: slower than guestmem-N).
    pub time_vs_guestmem_n: f64,
    /// Median huge-page coverage of the aligned span over the measured rounds.
    pub huge_coverage_median: f64,
}

/// One layout's results.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LayoutResult {
    /// The layout.
    pub layout: LayoutKind,
    /// Its region sizes in bytes.
    pub region_sizes: Vec<u64>,
    /// The variants, in run order.
    pub variants: Vec<VariantResult>,
    /// guestmem-N's rate over guestmem-1's, from medians (ideal: N).
    pub guestmem_scaling: f64,
}

/// Settings a result was measured with.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Settings {
    /// Total bytes per layout.
    pub size: u64,
    /// Warm-up, rounds, order.
    pub protocol: Protocol,
    /// Pause after each variant, in seconds.
    pub settle_seconds: f64,
    /// N of guestmem-N.
    pub threads: usize,
    /// `/sys/kernel/mm/transparent_hugepage/enabled`.
    pub thp_mode: String,
}

/// What the scenario found.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PopulateFindings {
    /// One entry per layout.
    pub layouts: Vec<LayoutResult>,
}

/// The scenario's whole result, as written to `result.json`.
pub type PopulateResult = LabResult<Settings, PopulateFindings>;

/// Brings `sizes` up once with `variant` and measures it; memory is unmapped on return.
fn measure(variant: Variant, sizes: &[u64]) -> Result<Sample, LabError> {
    let size: u64 = sizes.iter().sum();
    let sample = |seconds, phase, u: RegionUsage, mappings, aligned, threads| Sample {
        seconds,
        populate_phase_seconds: phase,
        size,
        resident: u.resident,
        huge: u.huge,
        huge_span: u.huge_span,
        locked: u.locked,
        mappings,
        thp_aligned_mappings: aligned,
        threads,
    };
    match variant {
        Variant::Guestmem {
            threads,
            pin,
            method,
        } => {
            let mut specs = Vec::with_capacity(sizes.len());
            let mut at = 0u64;
            for &s in sizes {
                specs.push(RegionSpec::new(GuestAddress(at), s));
                at += s;
            }
            let cfg = BringupConfig {
                populate: PopulateConfig {
                    threads,
                    pin,
                    method,
                    ..PopulateConfig::default()
                },
                // The pinned variant measures pinning: it must pin, or fail.
                pin_policy: PinPolicy::Required,
                verify: Verify::Off,
            };
            let t = Instant::now();
            let map = GuestMap::from_specs(&specs)?;
            let snap = map.view();
            let report = bringup(&snap, &cfg)?;
            let seconds = t.elapsed().as_secs_f64();
            let usage = inspect::inspect(&snap)?;
            let aligned = snap
                .regions()
                .iter()
                .filter(|r| (r.host_addr() as u64).is_multiple_of(THP_BYTES))
                .count();
            let phase = report.seconds("lock") + report.seconds("populate");
            Ok(sample(
                seconds,
                Some(phase),
                sum(&usage),
                usage.len(),
                aligned,
                vec![report.threads],
            ))
        }
        Variant::Qemu | Variant::Ch => {
            let t = Instant::now();
            let run: PeerRun = match variant {
                Variant::Qemu => peer_qemu::bring_up(sizes, available_cpus())?,
                _ => peer_ch::bring_up(sizes)?,
            };
            let seconds = t.elapsed().as_secs_f64();
            let ranges: Vec<_> = run.mappings.iter().map(peer::host_range).collect();
            let usage = inspect::inspect_host_ranges(&ranges)?;
            let aligned = run
                .mappings
                .iter()
                .filter(|m| peer::is_thp_aligned(m))
                .count();
            Ok(sample(
                seconds,
                None,
                usage,
                run.mappings.len(),
                aligned,
                run.threads.clone(),
            ))
        }
    }
}

fn sum(usage: &[RegionUsage]) -> RegionUsage {
    usage.iter().fold(RegionUsage::default(), |mut a, u| {
        a.size += u.size;
        a.resident += u.resident;
        a.huge += u.huge;
        a.huge_span += u.huge_span;
        a.locked += u.locked;
        a
    })
}

/// Runs the scenario and returns its result; writes nothing (see [`crate::report::write_run`]).
pub fn run_populate(cfg: &PopulateLabConfig) -> Result<PopulateResult, LabError> {
    cfg.protocol.validate(SCENARIO)?;
    let n = cfg.threads.max(1);
    let guestmem = |threads, pin, method| Variant::Guestmem {
        threads,
        pin,
        method,
    };
    let mut variants = vec![
        guestmem(1, PinStrategy::None, Method::PopulateWrite),
        guestmem(n, PinStrategy::None, Method::PopulateWrite),
        guestmem(n, PinStrategy::UpFront, Method::PopulateWrite),
        Variant::Qemu,
        Variant::Ch,
    ];
    if cfg.methods {
        variants.push(guestmem(n, PinStrategy::None, Method::Touch));
        variants.push(guestmem(n, PinStrategy::PerChunk, Method::PopulateWrite));
    }
    // Every layout's sizes first, so a bad size is refused before anything is measured.
    let sized: Vec<(LayoutKind, Vec<u64>)> = cfg
        .layouts
        .iter()
        .map(|&l| Ok((l, l.sizes(cfg.size)?)))
        .collect::<Result<_, LabError>>()?;
    let run = RunInfo::collect(cfg.command.clone());
    let mut layouts = Vec::new();
    for (layout, sizes) in sized {
        let samples = cfg.protocol.run(variants.len(), |i| {
            let sample = measure(variants[i], &sizes);
            std::thread::sleep(cfg.settle);
            sample
        })?;
        layouts.push(summarise_layout(layout, sizes, &variants, samples, n));
    }
    Ok(LabResult {
        scenario: SCENARIO.into(),
        seeds: vec!["000".into(), "001".into()],
        run,
        settings: Settings {
            size: cfg.size,
            protocol: cfg.protocol,
            settle_seconds: cfg.settle.as_secs_f64(),
            threads: n,
            thp_mode: thp_mode(),
        },
        timed:
            "wall seconds from before the first mmap until the last region is populated \
                (and, for ch-style, THP-advised): map + THP advice + thread start + populate; \
                guestmem = GuestMap::from_specs + bringup(Verify::Off); inspect and unmap not timed"
                .into(),
        body: PopulateFindings { layouts },
    })
}

fn summarise_layout(
    layout: LayoutKind,
    sizes: Vec<u64>,
    variants: &[Variant],
    samples: Vec<Vec<Sampled<Sample>>>,
    n: usize,
) -> LayoutResult {
    let size: u64 = sizes.iter().sum();
    let mut out: Vec<VariantResult> = variants
        .iter()
        .zip(samples)
        .map(|(v, samples)| {
            let seconds = summarise(&samples, |s| s.seconds);
            VariantResult {
                name: v.name(n),
                description: v.describe(),
                gbps_at_median: rate(size, seconds.median),
                time_vs_guestmem_n: 0.0,
                huge_coverage_median: summarise(&samples, Sample::huge_coverage).median,
                seconds,
                samples,
            }
        })
        .collect();
    // Variant 1 is guestmem-N, variant 0 guestmem-1 (see `run_populate`).
    let base = out[1].seconds.median;
    for v in &mut out {
        v.time_vs_guestmem_n = ratio(v.seconds.median, base);
    }
    let scaling = ratio(out[0].seconds.median, out[1].seconds.median);
    LayoutResult {
        layout,
        region_sizes: sizes,
        variants: out,
        guestmem_scaling: scaling,
    }
}

fn rate(bytes: u64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        bytes as f64 / seconds / BYTES_PER_GB
    } else {
        0.0
    }
}

impl LabReport for PopulateResult {
    fn markdown(&self) -> String {
        let mut md = header(
            "populate (seeds 000/001)",
            &self.run,
            &self.settings.thp_mode,
            &self.settings.protocol,
            &format!(
                "{:.1} s settle between variants.",
                self.settings.settle_seconds
            ),
        );
        md.push_str(&format!("Timed: {}.\n", self.timed));
        for l in &self.body.layouts {
            md.push_str(&format!(
                "\n## {} ({})\n\n| variant | threads | median s | min s | max s | max/min \
                 | GB/s @median | time / guestmem-{n} | huge coverage | 2M-aligned maps |\n\
                 |---|---|---|---|---|---|---|---|---|---|\n",
                l.layout.name(),
                sizes_label(&l.region_sizes),
                n = self.settings.threads,
            ));
            for v in &l.variants {
                let last = v.samples.last().map(|s| &s.sample);
                let threads = last.map_or(String::new(), |s| {
                    runs_label(&s.threads, "+", |t| t.to_string())
                });
                let aligned = last.map_or(String::new(), |s| {
                    format!("{}/{}", s.thp_aligned_mappings, s.mappings)
                });
                md.push_str(&format!(
                    "| {} | {} | {:.3} | {:.3} | {:.3} | {:.2} | {:.1} | {:.2} | {:.1}% | {} |\n",
                    v.name,
                    threads,
                    v.seconds.median,
                    v.seconds.min,
                    v.seconds.max,
                    ratio(v.seconds.max, v.seconds.min),
                    v.gbps_at_median,
                    v.time_vs_guestmem_n,
                    v.huge_coverage_median * 100.0,
                    aligned,
                ));
            }
            md.push_str(&format!(
                "\nguestmem scaling, {} threads vs 1 (rate ratio of medians): {:.2}x\n",
                self.settings.threads, l.guestmem_scaling
            ));
        }
        md
    }

    fn bars(&self) -> (&'static str, Vec<BarGroup>) {
        let groups = self
            .body
            .layouts
            .iter()
            .map(|l| BarGroup {
                title: format!("{} ({})", l.layout.name(), sizes_label(&l.region_sizes)),
                bars: l
                    .variants
                    .iter()
                    .map(|v| Bar {
                        label: v.name.clone(),
                        median: v.seconds.median,
                        min: v.seconds.min,
                        max: v.seconds.max,
                    })
                    .collect(),
            })
            .collect();
        ("seconds (bar: median, line: min to max)", groups)
    }
}
