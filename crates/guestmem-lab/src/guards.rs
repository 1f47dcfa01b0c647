//! The guards scenario (seed 003): what a 4 KiB guard page, or a 4 KiB shift, costs a region
//! in transparent huge pages, against guestmem's layout, which keeps guards outside the
//! region's 2 MiB-aligned span and the host address congruent to the guest address.
//!
//! Four ways to map one anonymous region, each advised `MADV_HUGEPAGE` and then populated with
//! one `MADV_POPULATE_WRITE` on one thread (the same call for all, so only the layout differs):
//!
//! - `guestmem-guards`: [`GuestMap::from_specs`] with the default spec: guard pages on,
//!   outside the region.
//! - `guestmem-noguard`: the same with [`Guard::Off`].
//! - `tcg-style`: one 2 MiB-aligned mapping whose last 4 KiB page inside the region is made
//!   `PROT_NONE` with `mprotect`, as QEMU's TCG did with its code regions; the rest of the
//!   region is populated.
//! - `unaligned`: one mapping that starts 4 KiB past a 2 MiB boundary, as a plain `mmap` may
//!   place it; a huge page needs a whole aligned 2 MiB inside one VMA, so the first and last
//!   partial 2 MiB cannot have one.
//!
//! **What is timed**: the `MADV_POPULATE_WRITE` call only. Coverage is read from smaps
//! (`AnonHugePages`) after populate, as bytes, as a share of the region and as a share of the
//! region's own 2 MiB-aligned span (the most huge pages could cover).

use std::time::Instant;

use guestmem::inspect::{self, RegionUsage};
use guestmem::layout::THP_BYTES;
use guestmem::sys::{self, MmapRange};
use guestmem::{Guard, GuestAddress, GuestMap, RegionSpec};

use crate::error::LabError;
use crate::peer::{PeerError, PlacedMapping};
use crate::plot::{Bar, BarGroup};
use crate::report::{header, mib, LabReport};
use crate::run::{ratio, summarise, thp_mode, Order, Protocol, RunInfo, Sampled, Summary};

/// The scenario's name.
pub const SCENARIO: &str = "guards";
/// Default region size, in bytes.
pub const DEFAULT_REGION_BYTES: u64 = 64 << 20;
/// Smallest region the scenario accepts, in bytes: below two huge pages there is no interior
/// huge page to lose or keep.
pub const MIN_REGION_BYTES: u64 = 2 * THP_BYTES;
/// Default measured rounds (a 64 MiB populate takes milliseconds, so many are cheap).
pub const DEFAULT_ROUNDS: usize = 21;
/// Default warm-up rounds.
pub const DEFAULT_WARMUP_ROUNDS: usize = 1;
/// Bytes per MiB, for the populated column (a guard inside shows in its third decimal).
const MIB: f64 = (1u64 << 20) as f64;
/// The TCG-style guard, in bytes: one base page at the region's end.
pub const TCG_GUARD_BYTES: usize = 4096;
/// Default shift of the unaligned peer past a 2 MiB boundary, in bytes.
pub const DEFAULT_UNALIGNED_SHIFT_BYTES: usize = 4096;

/// How to run the scenario.
#[derive(Debug, Clone)]
pub struct GuardsLabConfig {
    /// Region size in bytes: a multiple of 2 MiB, at least [`MIN_REGION_BYTES`].
    pub size: u64,
    /// Warm-up, rounds, order.
    pub protocol: Protocol,
    /// How far past a 2 MiB boundary the unaligned peer starts, in bytes (a multiple of the
    /// base page, below 2 MiB).
    pub unaligned_shift: usize,
    /// The command line to record.
    pub command: String,
}

impl Default for GuardsLabConfig {
    fn default() -> Self {
        GuardsLabConfig {
            size: DEFAULT_REGION_BYTES,
            protocol: Protocol {
                warmup: DEFAULT_WARMUP_ROUNDS,
                rounds: DEFAULT_ROUNDS,
                order: Order::default(),
            },
            unaligned_shift: DEFAULT_UNALIGNED_SHIFT_BYTES,
            command: String::new(),
        }
    }
}

/// One way of mapping the region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Variant {
    Guestmem(Guard),
    Tcg,
    Unaligned,
}

const VARIANTS: [Variant; 4] = [
    Variant::Guestmem(Guard::On),
    Variant::Guestmem(Guard::Off),
    Variant::Tcg,
    Variant::Unaligned,
];

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::Guestmem(Guard::On) => "guestmem-guards",
            Variant::Guestmem(Guard::Off) => "guestmem-noguard",
            Variant::Tcg => "tcg-style",
            Variant::Unaligned => "unaligned",
        }
    }

    fn describe(self, shift: usize) -> String {
        match self {
            Variant::Guestmem(Guard::On) => "GuestMap::from_specs, default spec: host congruent \
                to guest mod 2 MiB, 4 KiB PROT_NONE guards outside the region, MADV_HUGEPAGE"
                .into(),
            Variant::Guestmem(Guard::Off) => {
                "GuestMap::from_specs with Guard::Off: congruent, no guards, MADV_HUGEPAGE".into()
            }
            Variant::Tcg => format!(
                "2 MiB-aligned mmap, MADV_HUGEPAGE, last {TCG_GUARD_BYTES} bytes of the region \
                 mprotect(PROT_NONE) (QEMU TCG region guard); the rest populated"
            ),
            Variant::Unaligned => format!(
                "mmap starting {shift} bytes past a 2 MiB boundary (inside a PROT_NONE \
                 reservation), MADV_HUGEPAGE"
            ),
        }
    }
}

/// One run of one variant.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GuardsSample {
    /// Seconds in `MADV_POPULATE_WRITE`.
    pub seconds: f64,
    /// The region's host start modulo 2 MiB (0: aligned).
    pub host_offset_in_thp: u64,
    /// Bytes populated (the region less any guard inside it).
    pub populated: u64,
    /// Bytes resident afterwards (smaps `Rss`).
    pub resident: u64,
    /// Bytes mapped by huge pages afterwards (smaps `AnonHugePages`).
    pub huge: u64,
    /// Bytes of the region's own 2 MiB-aligned span: the most huge pages could cover.
    pub huge_span: u64,
}

/// One variant's results.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GuardsVariant {
    /// Name in reports.
    pub name: String,
    /// What it does.
    pub description: String,
    /// Every run, warm-ups included.
    pub samples: Vec<Sampled<GuardsSample>>,
    /// Populate seconds over the measured rounds.
    pub seconds: Summary,
    /// Huge-page bytes over the measured rounds.
    pub huge: Summary,
    /// Huge-page bytes / region bytes over the measured rounds.
    pub coverage_of_region: Summary,
    /// Huge-page bytes / aligned-span bytes over the measured rounds.
    pub coverage_of_span: Summary,
    /// 2 MiB pages of the region (size / 2 MiB) not backed by a huge page, at the median.
    pub lost_huge_pages: f64,
    /// Median populate seconds / guestmem-guards' median.
    pub time_vs_guestmem: f64,
}

/// Settings a result was measured with.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GuardsSettings {
    /// Region size in bytes.
    pub size: u64,
    /// Warm-up, rounds, order.
    pub protocol: Protocol,
    /// The unaligned peer's shift past a 2 MiB boundary, in bytes.
    pub unaligned_shift: usize,
    /// `/sys/kernel/mm/transparent_hugepage/enabled`.
    pub thp_mode: String,
    /// `/sys/kernel/mm/transparent_hugepage/defrag`.
    pub thp_defrag: String,
}

/// The scenario's whole result, as written to `result.json`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GuardsResult {
    /// `guards`.
    pub scenario: String,
    /// The seeds it reproduces.
    pub seeds: Vec<String>,
    /// Machine and command.
    pub run: RunInfo,
    /// Settings.
    pub settings: GuardsSettings,
    /// What the timed seconds cover.
    pub timed: String,
    /// The variants, in [`VARIANTS`] order.
    pub variants: Vec<GuardsVariant>,
}

fn populate(range: MmapRange) -> Result<f64, LabError> {
    let t = Instant::now();
    sys::madvise(range, sys::MADV_POPULATE_WRITE).map_err(|source| LabError::Sys {
        scenario: SCENARIO,
        op: "madvise(MADV_POPULATE_WRITE)",
        addr: range.addr(),
        len: range.len(),
        source,
    })?;
    Ok(t.elapsed().as_secs_f64())
}

fn advise_huge(peer: &'static str, m: &PlacedMapping) -> Result<(), PeerError> {
    sys::madvise(m.range(), libc::MADV_HUGEPAGE).map_err(|source| PeerError::Sys {
        peer,
        op: "madvise(MADV_HUGEPAGE)",
        addr: m.range().addr(),
        len: m.range().len(),
        source,
    })
}

/// Maps, advises and populates the region once with `variant`; unmapped on return.
fn measure(variant: Variant, cfg: &GuardsLabConfig) -> Result<GuardsSample, LabError> {
    let len = usize::try_from(cfg.size).map_err(|_| LabError::Config {
        scenario: SCENARIO,
        reason: format!("size {:#x} does not fit the address space", cfg.size),
    })?;
    let sample = |seconds, start: usize, populated: usize, u: RegionUsage| GuardsSample {
        seconds,
        host_offset_in_thp: start as u64 % THP_BYTES,
        populated: populated as u64,
        resident: u.resident,
        huge: u.huge,
        huge_span: u.huge_span,
    };
    match variant {
        Variant::Guestmem(guard) => {
            let spec = RegionSpec::new(GuestAddress(0), cfg.size).with_guard(guard);
            let map = GuestMap::from_specs(&[spec])?;
            let snap = map.snapshot();
            let range = snap.regions()[0].host_range();
            let seconds = populate(range)?;
            let usage = inspect::inspect(&snap)?.remove(0);
            Ok(sample(seconds, range.addr(), len, usage))
        }
        Variant::Tcg | Variant::Unaligned => {
            let name = variant.name();
            let shift = if variant == Variant::Tcg {
                0
            } else {
                cfg.unaligned_shift
            };
            let m = PlacedMapping::map(name, len, shift)?;
            advise_huge(name, &m)?;
            let populated = if variant == Variant::Tcg {
                m.protect_none(name, len - TCG_GUARD_BYTES, TCG_GUARD_BYTES)?;
                len - TCG_GUARD_BYTES
            } else {
                len
            };
            let part = m.range().sub(0, populated).expect("inside the mapping");
            let seconds = populate(part)?;
            let usage = inspect::inspect_host_ranges(&[m.host_range()])?;
            Ok(sample(seconds, m.range().addr(), populated, usage))
        }
    }
}

fn read_trimmed(path: &str) -> String {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

/// Runs the scenario and returns its result; writes nothing (see [`crate::report::write_run`]).
pub fn run_guards(cfg: &GuardsLabConfig) -> Result<GuardsResult, LabError> {
    if cfg.size < MIN_REGION_BYTES || cfg.size % THP_BYTES != 0 {
        return Err(LabError::Config {
            scenario: SCENARIO,
            reason: format!(
                "size {:#x} must be a multiple of 2 MiB and at least {MIN_REGION_BYTES:#x}",
                cfg.size
            ),
        });
    }
    let run = RunInfo::collect(cfg.command.clone());
    let samples = cfg
        .protocol
        .run(VARIANTS.len(), |i| measure(VARIANTS[i], cfg))?;
    let size = cfg.size as f64;
    let mut variants: Vec<GuardsVariant> = VARIANTS
        .iter()
        .zip(samples)
        .map(|(v, samples)| {
            let huge = summarise(&samples, |s| s.huge as f64);
            GuardsVariant {
                name: v.name().into(),
                description: v.describe(cfg.unaligned_shift),
                seconds: summarise(&samples, |s| s.seconds),
                coverage_of_region: summarise(&samples, |s| s.huge as f64 / size),
                coverage_of_span: summarise(&samples, |s| ratio(s.huge as f64, s.huge_span as f64)),
                lost_huge_pages: (size - huge.median) / THP_BYTES as f64,
                huge,
                time_vs_guestmem: 0.0,
                samples,
            }
        })
        .collect();
    let base = variants[0].seconds.median;
    for v in &mut variants {
        v.time_vs_guestmem = ratio(v.seconds.median, base);
    }
    Ok(GuardsResult {
        scenario: SCENARIO.into(),
        seeds: vec!["003".into()],
        run,
        settings: GuardsSettings {
            size: cfg.size,
            protocol: cfg.protocol,
            unaligned_shift: cfg.unaligned_shift,
            thp_mode: thp_mode(),
            thp_defrag: read_trimmed("/sys/kernel/mm/transparent_hugepage/defrag"),
        },
        timed: "one MADV_POPULATE_WRITE over the region (less an inside guard), one thread, \
                after MADV_HUGEPAGE; mapping, inspecting and unmapping not timed"
            .into(),
        variants,
    })
}

impl LabReport for GuardsResult {
    fn scenario(&self) -> &str {
        &self.scenario
    }

    fn run_info(&self) -> &RunInfo {
        &self.run
    }

    fn markdown(&self) -> String {
        let s = &self.settings;
        let mut md = header(
            "guards (seed 003)",
            &self.run,
            &s.thp_mode,
            &s.protocol,
            &format!(
                "Region {} MiB ({} huge pages of 2 MiB); THP defrag {}. Timed: {}.\n",
                mib(s.size),
                s.size / THP_BYTES,
                s.thp_defrag,
                self.timed
            ),
        );
        md.push_str(
            "| variant | host start mod 2M | populated MiB | huge MiB (median) \
             | huge % of region (min-max) | huge % of 2M span | 2M pages lost \
             | populate median s | min s | max s | time / guestmem-guards |\n\
             |---|---|---|---|---|---|---|---|---|---|---|\n",
        );
        for v in &self.variants {
            let last = v.samples.last().map(|s| &s.sample);
            md.push_str(&format!(
                "| {} | {} | {} | {} | {:.1}% ({:.1}-{:.1}) | {:.1}% | {:.1} | {:.4} | {:.4} | {:.4} | {:.2} |\n",
                v.name,
                last.map_or(String::new(), |s| format!("{:#x}", s.host_offset_in_thp)),
                last.map_or(String::new(), |s| format!("{:.3}", s.populated as f64 / MIB)),
                mib(v.huge.median as u64),
                v.coverage_of_region.median * 100.0,
                v.coverage_of_region.min * 100.0,
                v.coverage_of_region.max * 100.0,
                v.coverage_of_span.median * 100.0,
                v.lost_huge_pages,
                v.seconds.median,
                v.seconds.min,
                v.seconds.max,
                v.time_vs_guestmem,
            ));
        }
        md
    }

    fn bars(&self) -> (&'static str, Vec<BarGroup>) {
        let bars = self
            .variants
            .iter()
            .map(|v| Bar::of(&v.name, &v.coverage_of_region))
            .collect();
        let title = "huge-page coverage of the region".to_string();
        (
            "fraction of the region in huge pages",
            vec![BarGroup { title, bars }],
        )
    }
}
