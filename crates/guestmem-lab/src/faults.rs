//! The faults scenario (seed 002): do page faults from several threads scale, with all their
//! memory in one VMA or with one VMA each? Before per-VMA locks, every fault took the one
//! address-space lock (`mmap_lock`) for reading, and its cache line bounced between CPUs;
//! with per-VMA locks (Linux 6.4+) a fault locks only its VMA.
//!
//! T threads each fault in their own equal share of `size` bytes, 4 KiB pages only
//! (`MADV_NOHUGEPAGE`, so each page is one fault):
//!
//! - `one-vma-touch`: all shares in one mapping; each thread writes one byte per page.
//! - `vma-per-thread-touch`: one mapping per thread (kept apart by `PROT_NONE` reservations,
//!   so the kernel cannot merge them); each thread writes one byte per page.
//! - `one-vma-populate`: all shares in one mapping; each thread gives one
//!   `MADV_POPULATE_WRITE` on its share (faults taken in the kernel, no user-mode trap).
//!
//! **What is timed**: from the first worker's start to the last worker's end; workers are
//! created and wait at a gate first (see `workers.rs`). Mapping, advice, inspection
//! and unmapping are not timed. Minor faults are counted from `/proc/self/stat` (`minflt`)
//! around the timed part; VMAs are counted in `/proc/self/maps` afterwards.

use guestmem::inspect;
use guestmem::mmap::{Advice, Mapping};

use crate::error::LabError;
use crate::peer::{self, mmap_err, placed};
use crate::plot::{Bar, BarGroup};
use crate::report::{header, mib, LabReport, LabResult};
use crate::run::{
    available_cpus, ratio, summarise, thp_mode, Order, Protocol, RunInfo, Sampled, Summary,
};
use crate::workers::timed;

/// The scenario's name.
pub const SCENARIO: &str = "faults";
/// Default total bytes faulted per run (262,144 faults of 4 KiB).
pub const DEFAULT_SIZE_BYTES: u64 = 1 << 30;
/// Default measured rounds.
pub const DEFAULT_ROUNDS: usize = 9;
/// Default warm-up rounds.
pub const DEFAULT_WARMUP_ROUNDS: usize = 1;
/// Faults per second per million, for reports.
const PER_MILLION: f64 = 1e6;

/// How to run the scenario.
#[derive(Debug, Clone)]
pub struct FaultsLabConfig {
    /// Total bytes faulted per run, split evenly among the threads.
    pub size: u64,
    /// Thread counts to run (default: 1 and every count up to the CPUs).
    pub threads: Vec<usize>,
    /// Warm-up, rounds, order.
    pub protocol: Protocol,
    /// The command line to record.
    pub command: String,
}

impl Default for FaultsLabConfig {
    fn default() -> Self {
        FaultsLabConfig {
            size: DEFAULT_SIZE_BYTES,
            threads: (1..=available_cpus()).collect(),
            protocol: Protocol {
                warmup: DEFAULT_WARMUP_ROUNDS,
                rounds: DEFAULT_ROUNDS,
                order: Order::default(),
            },
            command: String::new(),
        }
    }
}

/// How the threads' memory is laid out and faulted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FaultKind {
    /// One VMA, a byte written per page.
    OneVmaTouch,
    /// One VMA per thread, a byte written per page.
    VmaPerThreadTouch,
    /// One VMA, `MADV_POPULATE_WRITE` per share.
    OneVmaPopulate,
}

const KINDS: [FaultKind; 3] = [
    FaultKind::OneVmaTouch,
    FaultKind::VmaPerThreadTouch,
    FaultKind::OneVmaPopulate,
];

impl FaultKind {
    /// The name in reports.
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::OneVmaTouch => "one-vma-touch",
            FaultKind::VmaPerThreadTouch => "vma-per-thread-touch",
            FaultKind::OneVmaPopulate => "one-vma-populate",
        }
    }
}

/// One run of one variant.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct FaultsSample {
    /// Wall seconds of the timed part.
    pub seconds: f64,
    /// Each thread's own seconds.
    pub thread_seconds: Vec<f64>,
    /// Pages faulted (size / 4 KiB).
    pub pages: u64,
    /// Minor faults the process counted during the timed part.
    pub minor_faults: u64,
    /// VMAs the mappings formed, from `/proc/self/maps`.
    pub vmas: usize,
    /// Bytes resident afterwards.
    pub resident: u64,
    /// Bytes mapped by huge pages afterwards (0 expected).
    pub huge: u64,
}

/// One variant's results.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct FaultsVariant {
    /// Name in reports: `<kind>-<threads>`.
    pub name: String,
    /// The layout and fault method.
    pub kind: FaultKind,
    /// Threads.
    pub threads: usize,
    /// Every run, warm-ups included.
    pub samples: Vec<Sampled<FaultsSample>>,
    /// Wall seconds over the measured rounds.
    pub seconds: Summary,
    /// Pages / median seconds.
    pub faults_per_sec_at_median: f64,
    /// This variant's rate over the same kind's 1-thread rate, from medians (ideal: threads).
    pub scaling_vs_1_thread: f64,
}

/// Settings a result was measured with.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct FaultsSettings {
    /// Total bytes per run.
    pub size: u64,
    /// Thread counts.
    pub threads: Vec<usize>,
    /// Warm-up, rounds, order.
    pub protocol: Protocol,
    /// `/sys/kernel/mm/transparent_hugepage/enabled` (the mappings are `MADV_NOHUGEPAGE`).
    pub thp_mode: String,
}

/// What the scenario found.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct FaultsFindings {
    /// Every kind at every thread count, kinds first.
    pub variants: Vec<FaultsVariant>,
}

/// The scenario's whole result, as written to `result.json`.
pub type FaultsResult = LabResult<FaultsSettings, FaultsFindings>;

/// Minor faults of this process so far (`minflt`, the 10th field of `/proc/self/stat`).
fn minor_faults() -> u64 {
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|t| parse_minflt(&t))
        .unwrap_or(0)
}

/// `minflt` of a `/proc/<pid>/stat` text: the fields after the command name (which is in
/// parentheses and may hold spaces) start with the state, field 3; `minflt` is field 10.
fn parse_minflt(stat: &str) -> Option<u64> {
    let after_comm = &stat[stat.rfind(')')? + 1..];
    after_comm.split_whitespace().nth(7)?.parse().ok()
}

/// VMAs in `/proc/self/maps` lying wholly inside the memory of one of `mappings` (their
/// `PROT_NONE` surroundings left out).
fn count_vmas(mappings: &[Mapping]) -> Result<usize, LabError> {
    let text = std::fs::read_to_string("/proc/self/maps").map_err(|source| LabError::Read {
        scenario: SCENARIO,
        what: "/proc/self/maps",
        source,
    })?;
    let owned: Vec<(usize, usize)> = mappings
        .iter()
        .map(|m| (m.as_ptr() as usize, m.len()))
        .collect();
    Ok(text
        .lines()
        .filter_map(|l| {
            let (a, b) = l.split_whitespace().next()?.split_once('-')?;
            Some((
                usize::from_str_radix(a, 16).ok()?,
                usize::from_str_radix(b, 16).ok()?,
            ))
        })
        .filter(|&(s, e)| owned.iter().any(|&(a, len)| s >= a && e <= a + len))
        .count())
}

/// Writes one byte in every page of `offset..offset+len` of `m`: one write fault per page.
fn touch(m: &Mapping, offset: usize, len: usize, page: usize) {
    assert!(offset + len <= m.len(), "the share lies inside its mapping");
    let base = m.as_ptr();
    for off in (offset..offset + len).step_by(page) {
        // SAFETY: off < offset + len <= m.len() (asserted above): the byte is in the body `m`
        // keeps mapped read-write; no Rust reference to it exists, so a volatile write is sound.
        unsafe { base.add(off).write_volatile(1) };
    }
}

/// Maps, then faults in `size` bytes with `threads` threads as `kind` says; unmapped on return.
fn measure(kind: FaultKind, threads: usize, size: usize) -> Result<FaultsSample, LabError> {
    let page = guestmem::base_page_size() as usize;
    let share = size / threads;
    let mappings: Vec<Mapping> = match kind {
        FaultKind::VmaPerThreadTouch => (0..threads)
            .map(|_| placed(SCENARIO, share, share, 0))
            .collect::<Result<_, _>>()?,
        _ => vec![placed(SCENARIO, size, size, 0)?],
    };
    for m in &mappings {
        peer::advise(SCENARIO, m, Advice::NoHugePage)?;
    }
    // Worker i's share: (mapping, offset).
    let part = |i: usize| match kind {
        FaultKind::VmaPerThreadTouch => (&mappings[i], 0),
        _ => (&mappings[0], i * share),
    };
    let before = minor_faults();
    let (seconds, times) = timed(SCENARIO, threads, |i| {
        let (m, offset) = part(i);
        match kind {
            FaultKind::OneVmaPopulate => m.advise(offset, share, Advice::PopulateWrite),
            _ => {
                touch(m, offset, share, page);
                Ok(())
            }
        }
    })?;
    let minor = minor_faults().saturating_sub(before);
    let thread_seconds: Vec<f64> = times.iter().map(|w| w.seconds).collect();
    for w in times {
        w.value.map_err(mmap_err(SCENARIO))?;
    }
    let ranges: Vec<_> = mappings.iter().map(peer::host_range).collect();
    let usage = inspect::inspect_host_ranges(&ranges)?;
    Ok(FaultsSample {
        seconds,
        thread_seconds,
        pages: (share * threads / page) as u64,
        minor_faults: minor,
        vmas: count_vmas(&mappings)?,
        resident: usage.resident,
        huge: usage.huge,
    })
}

/// Runs the scenario and returns its result; writes nothing (see [`crate::report::write_run`]).
pub fn run_faults(cfg: &FaultsLabConfig) -> Result<FaultsResult, LabError> {
    cfg.protocol.validate(SCENARIO)?;
    let page = guestmem::base_page_size();
    let bad = |reason: String| LabError::Config {
        scenario: SCENARIO,
        reason,
    };
    let size =
        usize::try_from(cfg.size).map_err(|_| bad(format!("size {:#x} too big", cfg.size)))?;
    if cfg.threads.is_empty() || cfg.threads.contains(&0) {
        return Err(bad("thread counts must be given and non-zero".into()));
    }
    for &t in &cfg.threads {
        if cfg.size == 0 || !cfg.size.is_multiple_of(t as u64 * page) {
            return Err(bad(format!(
                "size {:#x} must split into {t} equal non-empty shares of whole pages",
                cfg.size
            )));
        }
    }
    let variants: Vec<(FaultKind, usize)> = cfg
        .threads
        .iter()
        .flat_map(|&t| KINDS.iter().map(move |&k| (k, t)))
        .collect();
    let run = RunInfo::collect(cfg.command.clone());
    let samples = cfg.protocol.run(variants.len(), |i| {
        measure(variants[i].0, variants[i].1, size)
    })?;
    let pages = (cfg.size / page) as f64;
    let mut out: Vec<FaultsVariant> = variants
        .iter()
        .zip(samples)
        .map(|(&(kind, threads), samples)| {
            let seconds = summarise(&samples, |s| s.seconds);
            FaultsVariant {
                name: format!("{}-{threads}", kind.name()),
                kind,
                threads,
                faults_per_sec_at_median: ratio(pages, seconds.median),
                scaling_vs_1_thread: 0.0,
                seconds,
                samples,
            }
        })
        .collect();
    let one: Vec<(FaultKind, f64)> = out
        .iter()
        .filter(|v| v.threads == 1)
        .map(|v| (v.kind, v.seconds.median))
        .collect();
    for v in &mut out {
        if let Some(&(_, base)) = one.iter().find(|(k, _)| *k == v.kind) {
            v.scaling_vs_1_thread = ratio(base, v.seconds.median);
        }
    }
    Ok(LabResult {
        scenario: SCENARIO.into(),
        seeds: vec!["002".into()],
        run,
        settings: FaultsSettings {
            size: cfg.size,
            threads: cfg.threads.clone(),
            protocol: cfg.protocol,
            thp_mode: thp_mode(),
        },
        timed: "first worker start to last worker end; workers created and waiting at a gate \
                before; mapping (MADV_NOHUGEPAGE), inspection and unmapping not timed"
            .into(),
        body: FaultsFindings { variants: out },
    })
}

impl LabReport for FaultsResult {
    fn markdown(&self) -> String {
        let s = &self.settings;
        let mut md = header(
            "faults (seed 002)",
            &self.run,
            &s.thp_mode,
            &s.protocol,
            &format!(
                "{} MiB per run in 4 KiB pages ({} faults), split evenly among the threads; \
                 MADV_NOHUGEPAGE. Timed: {}.\n",
                mib(s.size),
                s.size / guestmem::base_page_size(),
                self.timed
            ),
        );
        md.push_str(
            "| variant | threads | VMAs | median s | min s | max s | max/min \
             | M faults/s @median | scaling vs 1 thread | minor faults counted | resident MiB \
             | huge MiB |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n",
        );
        for v in &self.body.variants {
            let last = v.samples.last().map(|s| &s.sample);
            md.push_str(&format!(
                "| {} | {} | {} | {:.3} | {:.3} | {:.3} | {:.2} | {:.2} | {:.2}x | {} | {} | {} |\n",
                v.name,
                v.threads,
                last.map_or(0, |s| s.vmas),
                v.seconds.median,
                v.seconds.min,
                v.seconds.max,
                ratio(v.seconds.max, v.seconds.min),
                v.faults_per_sec_at_median / PER_MILLION,
                v.scaling_vs_1_thread,
                last.map_or(0, |s| s.minor_faults),
                last.map_or(String::new(), |s| mib(s.resident)),
                last.map_or(String::new(), |s| mib(s.huge)),
            ));
        }
        md
    }

    fn bars(&self) -> (&'static str, Vec<BarGroup>) {
        let bars = self
            .body
            .variants
            .iter()
            .map(|v| Bar::of(&v.name, &v.seconds))
            .collect();
        let title = format!("{} MiB of 4 KiB faults", self.settings.size >> 20);
        (
            "seconds (bar: median, line: min to max)",
            vec![BarGroup { title, bars }],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_minflt_reads_field_ten_past_a_command_with_spaces() {
        let stat = "4242 (my (odd) cmd) R 1 4242 4242 0 -1 4194560 1234 0 5 0 7 3";
        assert_eq!(parse_minflt(stat), Some(1234));
        assert!(minor_faults() > 0);
    }
}
