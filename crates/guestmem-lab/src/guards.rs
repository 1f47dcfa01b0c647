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
//! - `tcg-style`: a 2 MiB-aligned region whose last 4 KiB page is `PROT_NONE`, as QEMU's TCG
//!   made it with `mprotect` on its code regions: here the region's memory is mapped one page
//!   short inside a `PROT_NONE` reservation, which leaves the kernel the same two VMAs (the
//!   memory, then a `PROT_NONE` page inside the last 2 MiB) without an `mprotect` on memory a
//!   mapping owns; the rest of the region is populated.
//! - `unaligned`: one mapping that starts 4 KiB past a 2 MiB boundary, as a plain `mmap` may
//!   place it; a huge page needs a whole aligned 2 MiB inside one VMA, so the first and last
//!   partial 2 MiB cannot have one.
//!
//! **What is timed**: the `MADV_POPULATE_WRITE` call only (for guestmem, its own
//! [`guestmem::populate()`] on one thread, which makes that one call over the region). Coverage is read from smaps
//! (`AnonHugePages`) after populate, as bytes, as a share of the region and as a share of the
//! region's own 2 MiB-aligned span (the most huge pages could cover).

use std::time::Instant;

use guestmem::inspect::{self, RegionUsage};
use guestmem::layout::THP_BYTES;
use guestmem::mmap::{Advice, Mapping};
use guestmem::{Guard, GuestAddress, GuestMap, PinStrategy, PopulateConfig, RegionSpec};

use crate::error::LabError;
use crate::peer::{self, mmap_err, placed};
use crate::plot::{Bar, BarGroup};
use crate::report::{header, mib, LabReport, LabResult};
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

/// What the scenario found.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GuardsFindings {
    /// The variants, in `VARIANTS` order.
    pub variants: Vec<GuardsVariant>,
}

/// The scenario's whole result, as written to `result.json`.
pub type GuardsResult = LabResult<GuardsSettings, GuardsFindings>;

/// One `MADV_POPULATE_WRITE` over the whole of `m`, timed.
fn populate(m: &Mapping) -> Result<f64, LabError> {
    let t = Instant::now();
    m.advise(0, m.len(), Advice::PopulateWrite)
        .map_err(mmap_err(SCENARIO))?;
    Ok(t.elapsed().as_secs_f64())
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
            let snap = map.view();
            // One thread, one chunk: a single MADV_POPULATE_WRITE over the region.
            let one_call = PopulateConfig {
                threads: 1,
                min_chunk: cfg.size,
                pin: PinStrategy::None,
                ..PopulateConfig::default()
            };
            let t = Instant::now();
            guestmem::populate(&snap, &one_call)?;
            let seconds = t.elapsed().as_secs_f64();
            let usage = inspect::inspect(&snap)?.remove(0);
            Ok(sample(
                seconds,
                snap.regions()[0].host_addr() as usize,
                len,
                usage,
            ))
        }
        Variant::Tcg | Variant::Unaligned => {
            let name = variant.name();
            let shift = if variant == Variant::Tcg {
                0
            } else {
                cfg.unaligned_shift
            };
            let populated = if variant == Variant::Tcg {
                len - TCG_GUARD_BYTES
            } else {
                len
            };
            let m = placed(name, len, populated, shift)?;
            peer::advise(name, &m, Advice::HugePage)?;
            let seconds = populate(&m)?;
            let mut region = peer::host_range(&m);
            region.len = len as u64; // the region's span, its inside guard included
            let usage = inspect::inspect_host_ranges(&[region])?;
            Ok(sample(seconds, m.as_ptr() as usize, populated, usage))
        }
    }
}

/// Runs the scenario and returns its result; writes nothing (see [`crate::report::write_run`]).
pub fn run_guards(cfg: &GuardsLabConfig) -> Result<GuardsResult, LabError> {
    cfg.protocol.validate(SCENARIO)?;
    if cfg.size < MIN_REGION_BYTES || !cfg.size.is_multiple_of(THP_BYTES) {
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
    Ok(LabResult {
        scenario: SCENARIO.into(),
        seeds: vec!["003".into()],
        run,
        settings: GuardsSettings {
            size: cfg.size,
            protocol: cfg.protocol,
            unaligned_shift: cfg.unaligned_shift,
            thp_mode: thp_mode(),
            thp_defrag: guestmem::Host::read().thp_defrag,
        },
        timed: "one MADV_POPULATE_WRITE over the region (less an inside guard), one thread, \
                after MADV_HUGEPAGE; mapping, inspecting and unmapping not timed"
            .into(),
        body: GuardsFindings { variants },
    })
}

impl LabReport for GuardsResult {
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
        for v in &self.body.variants {
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
            .body
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
