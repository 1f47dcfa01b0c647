//! The vm-restore scenario: a real guest (the lab's KVM guest, `guestmem-lab vm`) saved once and
//! restored in every way guestmem offers, beside the Firecracker-style peer and the plainest
//! eager reader, until the guest has verified every page it wrote before the save. (This
//! replaced a Python script that ran the same variants as `guestmem-lab vm` processes, and a
//! C program for the plain reader: one lab protocol now.)
//!
//! Before the rounds: the guest runs once and is saved (`--save`); a lazy restore without
//! prefetch records the order the guest faults its memory in (the working set the
//! `lazy-recorded` variant prefetches first); the memory file is read once (page cache warm).
//!
//! Variants (each restores the same snapshot; the guest verifies every page, and a run with
//! one wrong dword fails the scenario):
//!
//! - `eager`, `eager-1t`, `eager-2t`: populate and read everything (all CPUs, 1, 2 threads).
//! - `mapped`: the memory file mapped privately (Firecracker's `File` backend).
//! - `lazy-none`, `lazy-none-1h`, `lazy-none-2h`: userfaultfd, only the guest's faults bring
//!   memory in (2, 1, 2 handler threads).
//! - `lazy-recorded`: userfaultfd, the recorded working set prefetched first, then the rest.
//! - `fc-peer`: the Firecracker-style server (one thread, one 4 KiB `UFFDIO_COPY` per fault).
//! - `plain-read-1t`, `plain-read-2t`, `plain-read-2t-thp`: no guest; fresh anonymous memory
//!   (THP-advised for the last) and threads `pread`ing their share of the memory file into
//!   it, 1 MiB at a time: the floor an eager restore is compared with.
//!
//! **What is timed**: per run, the restore's setup (from the start until the restore call
//! returned; eager: all of it), the guest's start, the end of its verify pass, its demand
//! paging rate (pages verified per second) and the faults it waited on; for the plain
//! readers, from before the mapping to the last byte read.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Instant;

use guestmem::mmap::{Advice, Mapping};
use guestmem::restore::{Prefetch, RestoreMode};

use crate::error::LabError;
use crate::plot::{Bar, BarGroup};
use crate::report::{header, LabReport, LabResult};
use crate::run::{ratio, summarise, thp_mode, Order, Protocol, RunInfo, Sampled, Summary};
use crate::vm::guest::GuestMode;
use crate::vm::perf::{self, PerfConfig, RestoreRun};

/// The scenario's name.
pub const SCENARIO: &str = "vm-restore";
/// Default guest memory.
pub const DEFAULT_SIZE_BYTES: u64 = 1 << 30;
/// Default measured rounds.
pub const DEFAULT_ROUNDS: usize = 5;
/// Bytes each plain reader's `pread` asks for at a time.
const PLAIN_READ_BYTES: usize = 1 << 20;

/// One way of restoring.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Way {
    /// An eager restore on `threads` (0: all CPUs).
    Eager {
        /// Threads reading.
        threads: usize,
    },
    /// A mapped restore.
    Mapped,
    /// A lazy restore with `handlers` handler threads, prefetching the recorded working set
    /// first (or nothing).
    Lazy {
        /// Handler threads.
        handlers: usize,
        /// Whether the recorded working set is prefetched.
        recorded: bool,
    },
    /// The Firecracker-style peer.
    FcPeer,
    /// No guest: `threads` threads `pread` the memory file into fresh memory, THP-advised or
    /// not.
    PlainRead {
        /// Threads.
        threads: usize,
        /// Whether the memory is advised `MADV_HUGEPAGE` first.
        thp: bool,
    },
}

impl Way {
    /// The name in reports.
    pub fn name(self) -> String {
        match self {
            Way::Eager { threads: 0 } => "eager".into(),
            Way::Eager { threads } => format!("eager-{threads}t"),
            Way::Mapped => "mapped".into(),
            Way::Lazy {
                recorded: true,
                handlers: 2,
            } => "lazy-recorded".into(),
            Way::Lazy {
                recorded: true,
                handlers,
            } => format!("lazy-recorded-{handlers}h"),
            Way::Lazy { handlers, .. } => format!("lazy-none-{handlers}h"),
            Way::FcPeer => "fc-peer".into(),
            Way::PlainRead { threads, thp } => {
                format!("plain-read-{threads}t{}", if thp { "-thp" } else { "" })
            }
        }
    }
}

/// The variants, in the order of the report.
pub const WAYS: [Way; 11] = [
    Way::Eager { threads: 0 },
    Way::Mapped,
    Way::Lazy {
        handlers: 2,
        recorded: false,
    },
    Way::Lazy {
        handlers: 2,
        recorded: true,
    },
    Way::FcPeer,
    Way::Lazy {
        handlers: 1,
        recorded: false,
    },
    Way::Eager { threads: 1 },
    Way::Eager { threads: 2 },
    Way::PlainRead {
        threads: 1,
        thp: false,
    },
    Way::PlainRead {
        threads: 2,
        thp: false,
    },
    Way::PlainRead {
        threads: 2,
        thp: true,
    },
];

/// How to run the scenario.
#[derive(Debug, Clone)]
pub struct VmRestoreLabConfig {
    /// Guest memory, bytes (a multiple of 64 MiB; 3 GiB and more run the guest in long
    /// mode).
    pub size: u64,
    /// vCPUs.
    pub vcpus: usize,
    /// Warm-up, rounds, order.
    pub protocol: Protocol,
    /// Where the snapshot is made (removed after).
    pub work_dir: PathBuf,
    /// The command line to record.
    pub command: String,
}

impl Default for VmRestoreLabConfig {
    fn default() -> Self {
        VmRestoreLabConfig {
            size: DEFAULT_SIZE_BYTES,
            vcpus: 2,
            protocol: Protocol {
                warmup: 1,
                rounds: DEFAULT_ROUNDS,
                order: Order::Rotate,
            },
            work_dir: std::env::temp_dir()
                .join(format!("guestmem-vm-restore-{}", std::process::id())),
            command: String::new(),
        }
    }
}

/// One run of one variant.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct VmRestoreSample {
    /// Restore setup (plain readers: the whole read), seconds.
    pub setup_secs: f64,
    /// The guest's start, seconds (0 for plain readers).
    pub guest_start_secs: f64,
    /// The end of the guest's verify pass, seconds (plain readers: the whole read).
    pub verify_done_secs: f64,
    /// Pages the guest verified per second (0 for plain readers).
    pub demand_paging_pages_per_sec: f64,
    /// Faults that waited on a server (lazy, fc-peer).
    pub faults: u64,
    /// Huge-page bytes over the data memory after the verify pass.
    pub huge_coverage: f64,
}

/// One variant's results.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct VmRestoreVariant {
    /// The way.
    pub way: Way,
    /// Every run, warm-ups included.
    pub samples: Vec<Sampled<VmRestoreSample>>,
    /// Verify done (plain readers: the read), over the measured rounds.
    pub verify_done: Summary,
    /// Setup, over the measured rounds.
    pub setup: Summary,
}

/// Settings a result was measured with.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct VmRestoreSettings {
    /// Guest memory, bytes.
    pub size: u64,
    /// vCPUs.
    pub vcpus: usize,
    /// Warm-up, rounds, order.
    pub protocol: Protocol,
    /// THP mode.
    pub thp_mode: String,
}

/// What the scenario found.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct VmRestoreFindings {
    /// Every variant, in [`WAYS`] order.
    pub variants: Vec<VmRestoreVariant>,
}

/// The scenario's whole result.
pub type VmRestoreResult = LabResult<VmRestoreSettings, VmRestoreFindings>;

fn fail(what: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> LabError {
    LabError::restore(what)
}

/// The guest run every variant starts from.
fn base(cfg: &VmRestoreLabConfig) -> PerfConfig {
    PerfConfig {
        memory_bytes: cfg.size,
        vcpus: cfg.vcpus,
        slots: 8,
        passes: 1,
        mode: if cfg.size >= 3 << 30 {
            GuestMode::Long64
        } else {
            GuestMode::Protected32
        },
        ..PerfConfig::default()
    }
}

/// A restore of `snap` the way `way` says (not a plain reader).
fn restore_config(cfg: &VmRestoreLabConfig, snap: &Path, way: Way, record: bool) -> PerfConfig {
    let cpus = crate::run::available_cpus();
    let (mode, handlers, threads, prefetch) = match way {
        Way::Eager { threads } => (RestoreMode::Eager, 2, threads, Prefetch::None),
        Way::Mapped => (RestoreMode::Mapped, 2, 0, Prefetch::None),
        Way::Lazy { handlers, recorded } => (
            RestoreMode::Lazy,
            handlers,
            0,
            if recorded {
                Prefetch::WorkingSet
            } else {
                Prefetch::None
            },
        ),
        Way::FcPeer | Way::PlainRead { .. } => (RestoreMode::Lazy, 2, 0, Prefetch::None),
    };
    PerfConfig {
        restore: Some(RestoreRun {
            dir: snap.to_path_buf(),
            mode,
            fc_peer: way == Way::FcPeer,
            handler_threads: handlers,
            prefetch_threads: if threads == 0 { cpus } else { threads },
            prefetch,
            record,
        }),
        ..base(cfg)
    }
}

/// One guest run restored `way`; refuses a run whose guest found a wrong dword.
fn restored(cfg: &VmRestoreLabConfig, snap: &Path, way: Way) -> Result<VmRestoreSample, LabError> {
    let r = perf::run(&restore_config(cfg, snap, way, false)).map_err(fail)?;
    let rr = r
        .restore
        .ok_or_else(|| fail("the run made no restore report"))?;
    if rr.mismatches != 0 {
        return Err(fail(format!(
            "{}: the guest found {} wrong dwords",
            way.name(),
            rr.mismatches
        )));
    }
    Ok(VmRestoreSample {
        setup_secs: rr.setup_secs,
        guest_start_secs: r.guest_start_secs,
        verify_done_secs: rr.verify_done_secs,
        demand_paging_pages_per_sec: rr.demand_paging_pages_per_sec,
        faults: rr.lazy.map_or(rr.peer_faults.unwrap_or(0), |l| l.faults),
        huge_coverage: rr.huge_coverage,
    })
}

/// The plainest eager restore: fresh anonymous memory (THP-advised with `thp`), `threads`
/// threads each `pread`ing its share of `file`, 1 MiB at a time.
fn plain_read(file: &Path, threads: usize, thp: bool) -> Result<VmRestoreSample, LabError> {
    let f = std::fs::File::open(file).map_err(fail)?;
    let size = f.metadata().map_err(fail)?.len() as usize;
    let t0 = Instant::now();
    let m = Mapping::anonymous(size).map_err(fail)?;
    if thp {
        m.advise(0, size, Advice::HugePage).map_err(fail)?;
    }
    let per = size.div_ceil(threads.max(1)).next_multiple_of(4096);
    let base = m.as_ptr() as usize;
    let read = std::thread::scope(|s| {
        let parts: Vec<_> = (0..threads.max(1))
            .map(|t| {
                let f = &f;
                s.spawn(move || -> std::io::Result<()> {
                    let (start, end) = ((t * per).min(size), ((t + 1) * per).min(size));
                    let mut at = start;
                    while at < end {
                        let n = PLAIN_READ_BYTES.min(end - at);
                        // SAFETY: base+at..base+at+n lies in the mapping `m`, which outlives
                        // the scope; the threads' shares do not overlap; the kernel writes it.
                        let got = unsafe {
                            libc::pread(
                                f.as_raw_fd(),
                                (base + at) as *mut libc::c_void,
                                n,
                                at as libc::off_t,
                            )
                        };
                        if got <= 0 {
                            return Err(std::io::Error::last_os_error());
                        }
                        at += got as usize;
                    }
                    Ok(())
                })
            })
            .collect();
        parts
            .into_iter()
            .map(|p| p.join().expect("a reader thread panicked"))
            .collect::<std::io::Result<Vec<()>>>()
    });
    read.map_err(fail)?;
    let secs = t0.elapsed().as_secs_f64();
    Ok(VmRestoreSample {
        setup_secs: secs,
        guest_start_secs: 0.0,
        verify_done_secs: secs,
        demand_paging_pages_per_sec: 0.0,
        faults: 0,
        huge_coverage: 0.0,
    })
}

/// Runs the scenario (needs `/dev/kvm`); returns its result and writes nothing.
pub fn run_vm_restore(cfg: &VmRestoreLabConfig) -> Result<VmRestoreResult, LabError> {
    cfg.protocol.validate(SCENARIO)?;
    if cfg.size == 0 || !cfg.size.is_multiple_of(64 << 20) || cfg.vcpus == 0 {
        return Err(LabError::Config {
            scenario: SCENARIO,
            reason: "the size must be a non-zero multiple of 64 MiB, with at least one vCPU".into(),
        });
    }
    let _ = std::fs::remove_dir_all(&cfg.work_dir);
    crate::run::in_work_dir(&cfg.work_dir, || run_in(cfg))
}

fn run_in(cfg: &VmRestoreLabConfig) -> Result<VmRestoreResult, LabError> {
    let run = RunInfo::collect(cfg.command.clone());
    let snap = cfg.work_dir.join("snap");
    perf::run(&PerfConfig {
        save: Some(snap.clone()),
        ..base(cfg)
    })
    .map_err(fail)?;
    // The working set lazy-recorded prefetches first.
    let none = Way::Lazy {
        handlers: 2,
        recorded: false,
    };
    perf::run(&restore_config(cfg, &snap, none, true)).map_err(fail)?;
    let memory = snap.join(guestmem::snapshot::MEMORY_FILE);
    std::fs::read(&memory).map_err(fail)?;
    let samples = cfg.protocol.run(WAYS.len(), |i| match WAYS[i] {
        Way::PlainRead { threads, thp } => plain_read(&memory, threads, thp),
        way => restored(cfg, &snap, way),
    })?;
    let variants = WAYS
        .iter()
        .zip(samples)
        .map(|(&way, samples)| VmRestoreVariant {
            way,
            verify_done: summarise(&samples, |s| s.verify_done_secs),
            setup: summarise(&samples, |s| s.setup_secs),
            samples,
        })
        .collect();
    Ok(LabResult {
        scenario: SCENARIO.into(),
        seeds: Vec::new(),
        run,
        settings: VmRestoreSettings {
            size: cfg.size,
            vcpus: cfg.vcpus,
            protocol: cfg.protocol,
            thp_mode: thp_mode(),
        },
        timed: "restores: setup until the restore call returned, the guest's start and the end \
                of its verify pass; plain readers: from before the mapping to the last byte \
                read. The memory file is in the page cache"
            .into(),
        body: VmRestoreFindings { variants },
    })
}

impl VmRestoreResult {
    fn median(&self, way: Way, f: impl Fn(&VmRestoreVariant) -> f64) -> f64 {
        self.body
            .variants
            .iter()
            .find(|v| v.way == way)
            .map_or(0.0, f)
    }
}

impl LabReport for VmRestoreResult {
    fn markdown(&self) -> String {
        let s = &self.settings;
        let mut md = header(
            "vm-restore (a KVM guest restored every way, until it has verified every page)",
            &self.run,
            &s.thp_mode,
            &s.protocol,
            &format!(
                "{} MiB guest, {} vCPUs. Timed: {}.\n",
                s.size >> 20,
                s.vcpus,
                self.timed
            ),
        );
        md.push_str(
            "| variant | setup s (min-max) | verify done s (min-max) | guest start s | demand \
             paging pages/s | faults waited | huge coverage |\n|---|---|---|---|---|---|---|\n",
        );
        for v in &self.body.variants {
            let med = |f: fn(&VmRestoreSample) -> f64| summarise(&v.samples, f).median;
            md.push_str(&format!(
                "| {} | {:.3} ({:.3}-{:.3}) | {:.3} ({:.3}-{:.3}) | {:.3} | {:.0} | {:.0} | {:.0}% |\n",
                v.way.name(),
                v.setup.median,
                v.setup.min,
                v.setup.max,
                v.verify_done.median,
                v.verify_done.min,
                v.verify_done.max,
                med(|x| x.guest_start_secs),
                med(|x| x.demand_paging_pages_per_sec),
                med(|x| x.faults as f64),
                med(|x| x.huge_coverage) * 100.0,
            ));
        }
        let vd = |v: &VmRestoreVariant| v.verify_done.median;
        let setup = |v: &VmRestoreVariant| v.setup.median;
        let lazy = |handlers, recorded| Way::Lazy { handlers, recorded };
        md.push_str(&format!(
            "\nRatios of medians: fc-peer / lazy-recorded, verify done {:.2}x; lazy-recorded / \
             eager, verify done {:.2}; eager-1t / eager-2t, setup {:.2}x; eager-2t / \
             plain-read-2t, setup {:.2} (THP-advised reader: {:.2}).\n",
            ratio(self.median(Way::FcPeer, vd), self.median(lazy(2, true), vd)),
            ratio(
                self.median(lazy(2, true), vd),
                self.median(Way::Eager { threads: 0 }, vd)
            ),
            ratio(
                self.median(Way::Eager { threads: 1 }, setup),
                self.median(Way::Eager { threads: 2 }, setup)
            ),
            ratio(
                self.median(Way::Eager { threads: 2 }, setup),
                self.median(
                    Way::PlainRead {
                        threads: 2,
                        thp: false
                    },
                    vd
                )
            ),
            ratio(
                self.median(Way::Eager { threads: 2 }, setup),
                self.median(
                    Way::PlainRead {
                        threads: 2,
                        thp: true
                    },
                    vd
                )
            ),
        ));
        md
    }

    fn bars(&self) -> (&'static str, Vec<BarGroup>) {
        let bars = self
            .body
            .variants
            .iter()
            .map(|v| Bar::of(&v.way.name(), &v.verify_done))
            .collect();
        (
            "seconds until the guest verified every page (plain readers: the read)",
            vec![BarGroup {
                title: format!("{} MiB", self.settings.size >> 20),
                bars,
            }],
        )
    }
}
