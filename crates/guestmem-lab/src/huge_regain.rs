//! The huge-regain scenario (issue 20): what a restore that brings a guest back on 4 KiB
//! pages costs it, and what collapsing its memory back to transparent huge pages regains.
//!
//! One map of `size` bytes on transparent huge pages (guestmem's default spec, advised
//! `MADV_HUGEPAGE`), a distinct word in every page, is saved once (the manifest records its
//! huge pages). Each round restores it lazily, every block prefetched, into memory with no
//! THP advice (what a VMM that maps guest memory plainly gets, and what `UFFDIO_COPY` fills
//! with 4 KiB pages whatever the advice), then times three random-access passes over it,
//! back to back, and keeps the quickest:
//!
//! - `4k`: [`RegainHuge::Off`]: the pages as the restore made them;
//! - `regained`: [`RegainHuge::Saved`]: the pass starts once the collapse has ended (its
//!   time is reported apart: it runs in the background of a real guest);
//! - `moved`: the same map saved in 2 MiB blocks, restored into memory advised
//!   `MADV_HUGEPAGE` (guestmem's default spec), no collapse: each block is read into a
//!   staging huge page and moved in whole with `UFFDIO_MOVE`, so it is huge from the start;
//! - `copied-2m`: the 2 MiB-block save restored without THP advice, so copied with
//!   `UFFDIO_COPY` into 4 KiB pages: beside `moved`, what the move saves the restore itself.
//!
//! Each round also records how long the restore took to bring every block in (the lazy
//! report's `complete_secs`, prefetch threads doing all of it).
//!
//! **What is timed**: per pass, `reads` 8-byte volatile reads at pseudo-random (xorshift) addresses
//! over the whole map, one thread, each read's address independent of the last (as a guest
//! touching a large working set at random); every word of a page holds the same value, its
//! own, and the sum of the words read is checked against the same pass over the saved
//! pattern, so a wrong or zero page fails the scenario.
//! Restoring, collapsing and unmapping are not timed. `AnonHugePages` is read from smaps
//! before the pass.

use std::path::{Path, PathBuf};
use std::time::Instant;

use guestmem::inspect;
use guestmem::layout::{RegionSpec, Thp, THP_BYTES};
use guestmem::restore::{self, Prefetch, RegainHuge, RegainReport, RestoreConfig, RestoreMode};
use guestmem::snapshot::{self, Image, SaveConfig};
use guestmem::vm_memory::Bytes;
use guestmem::{GuestAddress, GuestMap};

use crate::error::LabError;
use crate::plot::{Bar, BarGroup};
use crate::report::{header, mib, LabReport, LabResult};
use crate::run::{in_work_dir, ratio, summarise, thp_mode, Protocol, RunInfo, Sampled, Summary};

/// The scenario's name.
pub const SCENARIO: &str = "huge-regain";
/// Default memory restored.
pub const DEFAULT_SIZE: u64 = 1 << 30;
/// Default reads per pass.
pub const DEFAULT_READS: u64 = 16 << 20;
/// Passes per round, back to back over the same memory; the quickest is the round's: a
/// pass that the host (this machine is itself a VM) slowed is not the memory's speed.
const PASSES: usize = 3;

/// How to run the scenario.
#[derive(Debug, Clone)]
pub struct HugeRegainLabConfig {
    /// Memory restored, bytes (a multiple of 2 MiB, at least 4 MiB).
    pub size: u64,
    /// Random reads per pass.
    pub reads: u64,
    /// Warm-up, rounds, order.
    pub protocol: Protocol,
    /// Where the snapshot is written (a scratch folder inside it, removed at the end).
    pub work_dir: PathBuf,
    /// The command line to record.
    pub command: String,
}

impl Default for HugeRegainLabConfig {
    fn default() -> Self {
        HugeRegainLabConfig {
            size: DEFAULT_SIZE,
            reads: DEFAULT_READS,
            protocol: Protocol {
                warmup: 1,
                rounds: 5,
                order: crate::Order::default(),
            },
            work_dir: std::env::temp_dir(),
            command: String::new(),
        }
    }
}

/// A variant: its name, whether it restores the 2 MiB-block save, the target's THP advice,
/// and the collapse.
struct Way {
    name: &'static str,
    blocks_2m: bool,
    thp: Thp,
    regain: RegainHuge,
}

const VARIANTS: [Way; 4] = [
    Way {
        name: "4k",
        blocks_2m: false,
        thp: Thp::Default,
        regain: RegainHuge::Off,
    },
    Way {
        name: "regained",
        blocks_2m: false,
        thp: Thp::Default,
        regain: RegainHuge::Saved,
    },
    Way {
        name: "moved",
        blocks_2m: true,
        thp: Thp::Huge,
        regain: RegainHuge::Off,
    },
    Way {
        name: "copied-2m",
        blocks_2m: true,
        thp: Thp::Default,
        regain: RegainHuge::Off,
    },
];

/// One round of one variant.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RegainSample {
    /// The quickest of the round's passes, seconds.
    pub seconds: f64,
    /// Every pass of the round, seconds, in order.
    #[serde(default)]
    pub passes: Vec<f64>,
    /// From the restore's start until every block was in, seconds.
    #[serde(default)]
    pub restore_secs: f64,
    /// Bytes the restore moved in with `UFFDIO_MOVE` (the rest it copied).
    #[serde(default)]
    pub bytes_moved: u64,
    /// Transparent huge pages mapping the restored memory when the pass began, bytes.
    pub huge: u64,
    /// The collapse (for `regained`): its report's seconds.
    pub collapse_secs: Option<f64>,
    /// Chunks of 2 MiB collapsed, and refused.
    pub collapsed: u64,
    /// Chunks the kernel refused.
    pub refused: u64,
}

/// One variant over every round.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RegainVariant {
    /// Its name.
    pub name: String,
    /// Every round.
    pub samples: Vec<Sampled<RegainSample>>,
    /// The pass, seconds.
    pub seconds: Summary,
    /// Nanoseconds per read.
    pub ns_per_read: Summary,
    /// Huge bytes at the pass.
    pub huge: Summary,
    /// The restore, seconds (every block in).
    #[serde(default)]
    pub restore: Summary,
    /// The pass's median over `4k`'s.
    pub time_vs_4k: f64,
}

/// The settings recorded.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RegainSettings {
    /// Memory, bytes.
    pub size: u64,
    /// Reads per pass.
    pub reads: u64,
    /// The protocol.
    pub protocol: Protocol,
    /// The host's THP mode.
    pub thp_mode: String,
    /// Huge bytes the saved map had (the manifest's record).
    pub saved_huge: u64,
}

/// What was found.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RegainFindings {
    /// Each variant.
    pub variants: Vec<RegainVariant>,
}

/// The scenario's result.
pub type HugeRegainResult = LabResult<RegainSettings, RegainFindings>;

fn word(at: u64) -> u64 {
    at.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5A17_C0DE
}

/// The addresses of a pass: `reads` of them, 8-byte aligned, below `size`.
fn addresses(size: u64, reads: u64) -> impl Iterator<Item = u64> {
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    (0..reads).map(move |_| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        // Lemire's multiply-shift reduction to [0, words): a 64-bit division here would
        // bound the pass (the divider is not pipelined) and hide the page walks it measures.
        ((u128::from(x) * u128::from(size / 8)) >> 64) as u64 * 8
    })
}

/// What a pass over the saved pattern sums to: every word of a page holds `word(page)`.
fn expected_sum(size: u64, reads: u64) -> u64 {
    addresses(size, reads).fold(0u64, |s, a| s.wrapping_add(word(a / 4096 * 4096)))
}

/// Saves a map of `size` on THP with the pattern, in blocks of `block_bytes`; the huge
/// bytes the manifest records.
fn save(size: u64, dir: &Path, block_bytes: u64) -> Result<u64, LabError> {
    let map = GuestMap::from_specs(&[RegionSpec::new(GuestAddress(0), size)])?;
    let view = map.view();
    for p in 0..size / 4096 {
        let page: Vec<u8> = std::iter::repeat_n(word(p * 4096).to_ne_bytes(), 512)
            .flatten()
            .collect();
        view.write_slice(&page, GuestAddress(p * 4096))
            .map_err(|e| LabError::Config {
                scenario: SCENARIO,
                reason: format!("writing the pattern: {e}"),
            })?;
    }
    let scfg = SaveConfig {
        block_bytes,
        ..SaveConfig::default()
    };
    snapshot::save(&view, dir, &scfg).map_err(LabError::restore)?;
    Ok(Image::open(dir).map_err(LabError::restore)?.regions()[0].huge_bytes)
}

fn measure(
    image: &Image,
    way: &Way,
    cfg: &HugeRegainLabConfig,
    want: u64,
) -> Result<RegainSample, LabError> {
    let specs = [RegionSpec::new(GuestAddress(0), cfg.size).with_thp(way.thp)];
    let rcfg = RestoreConfig {
        mode: RestoreMode::Lazy,
        prefetch: Prefetch::WorkingSet,
        regain: way.regain,
        ..RestoreConfig::default()
    };
    let r = restore::restore(image, &specs, &rcfg).map_err(LabError::restore)?;
    let lazy = r.lazy.as_ref().expect("a lazy restore");
    lazy.wait_complete().map_err(|reason| LabError::Config {
        scenario: SCENARIO,
        reason: format!("the restore failed: {reason}"),
    })?;
    let lazy_report = lazy.report();
    let report: Option<RegainReport> = r.regain.as_ref().map(|h| h.wait());
    let view = r.map.view();
    let huge = inspect::inspect(&view)?[0].huge;
    let host = view.regions()[0].host_addr() as usize;
    let mut passes = Vec::with_capacity(PASSES);
    for _ in 0..PASSES {
        let t = Instant::now();
        let mut sum = 0u64;
        for a in addresses(cfg.size, cfg.reads) {
            let p = (host + a as usize) as *const u64;
            // SAFETY: `a + 8 <= size`, 8-byte aligned, inside the restored region, which
            // `r.map` keeps mapped; every block is in (waited above), so the read never
            // faults to a server; guest memory is read only through raw pointers here.
            let w = unsafe { std::ptr::read_volatile(p) };
            sum = sum.wrapping_add(w);
        }
        passes.push(t.elapsed().as_secs_f64());
        if sum != want {
            return Err(LabError::Config {
                scenario: SCENARIO,
                reason: format!("the pass read {sum:#x}, the saved memory holds {want:#x}"),
            });
        }
    }
    let seconds = passes.iter().copied().fold(f64::INFINITY, f64::min);
    if let Some(l) = r.lazy {
        l.finish().map_err(LabError::restore)?;
    }
    Ok(RegainSample {
        seconds,
        passes,
        restore_secs: lazy_report.complete_secs.unwrap_or(0.0),
        bytes_moved: lazy_report.bytes_moved,
        huge,
        collapse_secs: report.as_ref().map(|r| r.secs),
        collapsed: report.as_ref().map_or(0, |r| r.collapsed),
        refused: report.as_ref().map_or(0, |r| r.failed),
    })
}

/// Runs the scenario.
pub fn run_huge_regain(cfg: &HugeRegainLabConfig) -> Result<HugeRegainResult, LabError> {
    cfg.protocol.validate(SCENARIO)?;
    if cfg.size < 2 * THP_BYTES || !cfg.size.is_multiple_of(THP_BYTES) || cfg.reads == 0 {
        return Err(LabError::Config {
            scenario: SCENARIO,
            reason: format!(
                "size {:#x} must be a multiple of 2 MiB, at least 4 MiB, and reads above 0",
                cfg.size
            ),
        });
    }
    let run = RunInfo::collect(cfg.command.clone());
    let work = cfg
        .work_dir
        .join(format!("guestmem-lab-regain-{}", std::process::id()));
    let (saved_huge, samples) = in_work_dir(&work, || {
        let (small, big) = (work.join("snap"), work.join("snap-2m"));
        let saved_huge = save(cfg.size, &small, 1 << 20)?;
        save(cfg.size, &big, THP_BYTES)?;
        let images = [
            Image::open(&small).map_err(LabError::restore)?,
            Image::open(&big).map_err(LabError::restore)?,
        ];
        let want = expected_sum(cfg.size, cfg.reads);
        let samples = cfg.protocol.run(VARIANTS.len(), |i| {
            let way = &VARIANTS[i];
            measure(&images[usize::from(way.blocks_2m)], way, cfg, want)
        })?;
        Ok((saved_huge, samples))
    })?;
    let mut variants: Vec<RegainVariant> = VARIANTS
        .iter()
        .zip(samples)
        .map(|(way, samples)| RegainVariant {
            name: way.name.into(),
            seconds: summarise(&samples, |s| s.seconds),
            ns_per_read: summarise(&samples, |s| s.seconds * 1e9 / cfg.reads as f64),
            huge: summarise(&samples, |s| s.huge as f64),
            restore: summarise(&samples, |s| s.restore_secs),
            time_vs_4k: 0.0,
            samples,
        })
        .collect();
    let base = variants[0].seconds.median;
    for v in &mut variants {
        v.time_vs_4k = ratio(v.seconds.median, base);
    }
    Ok(LabResult {
        scenario: SCENARIO.into(),
        seeds: Vec::new(),
        run,
        settings: RegainSettings {
            size: cfg.size,
            reads: cfg.reads,
            protocol: cfg.protocol,
            thp_mode: thp_mode(),
            saved_huge,
        },
        timed: "the quickest of 3 passes of random 8-byte reads over the restored memory, \
                one thread, once every block is in (and, for regained, once the collapse has \
                ended)"
            .into(),
        body: RegainFindings { variants },
    })
}

impl LabReport for HugeRegainResult {
    fn markdown(&self) -> String {
        let s = &self.settings;
        let mut md = header(
            "huge-regain (issue 20)",
            &self.run,
            &s.thp_mode,
            &s.protocol,
            &format!(
                "{} MiB saved on transparent huge pages ({} MiB of them huge, as the manifest \
                 records), in 1 MiB blocks and again in 2 MiB blocks, restored lazily (see \
                 the variants); {} random reads per pass; `pass` is the quickest of a round's {PASSES}. Timed: {}.\n",
                mib(s.size),
                mib(s.saved_huge),
                s.reads,
                self.timed
            ),
        );
        md.push_str(
            "| variant | AnonHugePages at the pass, MiB | pass median s | min s | max s \
             | ns per read | time / 4k | collapse s | chunks collapsed / refused \
             | restore s, median (min-max) | MiB moved |\n\
             |---|---|---|---|---|---|---|---|---|---|---|\n",
        );
        for v in &self.body.variants {
            let last = v.samples.last().map(|s| &s.sample);
            md.push_str(&format!(
                "| {} | {} | {:.3} | {:.3} | {:.3} | {:.1} | {:.2} | {} | {} | {:.3} ({:.3}-{:.3}) | {} |\n",
                v.name,
                mib(v.huge.median as u64),
                v.seconds.median,
                v.seconds.min,
                v.seconds.max,
                v.ns_per_read.median,
                v.time_vs_4k,
                last.and_then(|s| s.collapse_secs)
                    .map_or("-".into(), |c| format!("{c:.2}")),
                last.map_or("-".into(), |s| format!("{} / {}", s.collapsed, s.refused)),
                v.restore.median,
                v.restore.min,
                v.restore.max,
                last.map_or("-".into(), |s| mib(s.bytes_moved).to_string()),
            ));
        }
        md
    }

    fn bars(&self) -> (&'static str, Vec<BarGroup>) {
        let group = BarGroup {
            title: "random-access pass".into(),
            bars: self
                .body
                .variants
                .iter()
                .map(|v| Bar::of(&v.name, &v.seconds))
                .collect(),
        };
        ("seconds", vec![group])
    }
}
