//! Bring-up: check a layout against the host's limits, map it, populate and pin it in one
//! job, and (optionally) read back what the kernel did. This is the policy over the mechanism
//! in [`mod@crate::populate`]: it never touches memory before the checks of [`crate::host`] and
//! [`crate::limits`] pass, it decides whether to pin ([`PinPolicy`]), and it reports every
//! phase's duration, so a caller (the CLI, the lab, a VMM) prints, never measures.
//!
//! [`bringup_specs`] is the whole thing from region specs; [`bringup`] brings up a map that
//! exists already.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crate::host::Needs;
use crate::host::{Host, HostError};
use crate::inspect::{self, InspectError, ProcessMemory, RegionUsage};
use crate::layout::RegionSpec;
use crate::limits::{self, LimitError};
use crate::map::{GuestMap, MapError, MapView};
use crate::populate::{self, Method, PinStrategy, PopulateConfig, PopulateError, Undo};

/// Bytes per decimal gigabyte, for throughput figures (GB/s, as published populate rates are).
pub const BYTES_PER_GB: f64 = 1e9;

/// Whether bring-up reads back the kernel's account after populating.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Verify {
    /// Read smaps and status afterwards (the default; costs a few milliseconds per thousand
    /// mappings).
    #[default]
    On,
    /// Skip it.
    Off,
}

/// Whether pinning is a requirement or a wish.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PinPolicy {
    /// Pin as `populate.pin` says if `RLIMIT_MEMLOCK` (or `CAP_IPC_LOCK`) allows it, else go
    /// on unpinned and say so in the report (the default).
    #[default]
    IfAllowed,
    /// Pin as `populate.pin` says, or refuse.
    Required,
}

/// How to bring a map up.
#[derive(Debug, Clone, Default)]
pub struct BringupConfig {
    /// Threads, method, pinning, minimum chunk, NUMA and progress.
    pub populate: PopulateConfig,
    /// Whether pinning may be dropped when the locked-memory limit does not allow it.
    pub pin_policy: PinPolicy,
    /// Whether to read back the kernel's account.
    pub verify: Verify,
}

/// Why bring-up failed.
#[derive(Debug, thiserror::Error)]
pub enum BringupError {
    /// The layout does not fit the host (memory, memory cgroup, hugetlb pools, mappings);
    /// nothing was mapped.
    #[error(transparent)]
    Host(#[from] HostError),
    /// The layout could not be mapped; nothing is left mapped.
    #[error(transparent)]
    Map(#[from] MapError),
    /// The request exceeds the host's limits; nothing was touched.
    #[error(transparent)]
    Limits(#[from] LimitError),
    /// Populating or pinning failed; what it did was undone.
    #[error(transparent)]
    Populate(#[from] PopulateError),
    /// Memory is up, but the kernel's account could not be read.
    #[error(transparent)]
    Inspect(#[from] InspectError),
    /// The background bring-up's thread could not be started; nothing was touched.
    #[error("starting the background bring-up thread: {0}")]
    Spawn(String),
    /// A background bring-up's handle was misused.
    #[error("background bring-up: {0}")]
    Background(&'static str),
}

/// One phase and how long it took.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Phase {
    /// `map`, `check`, `lock`, `populate` or `verify`.
    pub name: &'static str,
    /// Wall-clock seconds.
    pub seconds: f64,
}

/// What bring-up did.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct BringupReport {
    /// Regions brought up.
    pub regions: usize,
    /// Bytes brought up.
    pub bytes: u64,
    /// Threads that worked, the calling thread included.
    pub threads: usize,
    /// Chunk size the job was cut with, in bytes.
    pub chunk_bytes: u64,
    /// Number of chunks.
    pub chunks: usize,
    /// How pages were faulted in.
    pub method: Method,
    /// How memory was pinned.
    pub pin: PinStrategy,
    /// Each phase, in order.
    pub phases: Vec<Phase>,
    /// Bytes per second of the lock and populate phases together, in GB/s.
    pub populate_gbps: f64,
    /// What the request needed, and the limits it was checked against.
    pub needs: Needs,
    /// The kernel's account of each region (empty without [`Verify::On`]).
    pub usage: Vec<RegionUsage>,
    /// The process's memory figures afterwards (`None` without [`Verify::On`]).
    pub process: Option<ProcessMemory>,
    /// Why memory was not pinned although pinning was asked for ([`PinPolicy::IfAllowed`]).
    pub pin_note: Option<String>,
    /// Hints that failed while mapping (THP advice), per region.
    pub warnings: Vec<String>,
}

impl BringupReport {
    /// Seconds of phase `name` (0 if it did not run).
    pub fn seconds(&self, name: &str) -> f64 {
        self.phases
            .iter()
            .filter(|p| p.name == name)
            .map(|p| p.seconds)
            .sum()
    }
}

/// What [`prepare`] decided: the check's figures and the populate to run.
struct Prepared {
    needs: Needs,
    populate: PopulateConfig,
    pin_note: Option<String>,
    check_seconds: f64,
}

/// The checks, and the pinning decision of [`PinPolicy`]: nothing is touched.
fn prepare(snap: &MapView, cfg: &BringupConfig) -> Result<Prepared, BringupError> {
    let t = Instant::now();
    let host = &Host::read();
    let mut pin_note = None;
    let mut populate = cfg.populate.clone();
    // Only what this bring-up selects is checked (and counted for pinning).
    let regions = populate::selected(snap, &populate.regions)?;
    let needs = match limits::check_regions(&regions, populate.pin, host) {
        Err(LimitError::Host(e @ HostError::Memlock { .. }))
            if cfg.pin_policy == PinPolicy::IfAllowed =>
        {
            pin_note = Some(format!("not pinned: {e}"));
            populate.pin = PinStrategy::None;
            limits::check_regions(&regions, PinStrategy::None, host)?
        }
        other => other?,
    };
    Ok(Prepared {
        needs,
        populate,
        pin_note,
        check_seconds: t.elapsed().as_secs_f64(),
    })
}

/// The verify phase and the report.
fn finish(
    snap: &MapView,
    cfg: &BringupConfig,
    prepared: Prepared,
    pop: populate::PopulateReport,
) -> Result<BringupReport, BringupError> {
    let t = Instant::now();
    let (usage, process) = match cfg.verify {
        Verify::On => (inspect::inspect(snap)?, Some(ProcessMemory::read()?)),
        Verify::Off => (Vec::new(), None),
    };
    let verify_seconds = t.elapsed().as_secs_f64();

    let busy = pop.lock_seconds + pop.populate_seconds;
    let phase = |name, seconds| Phase { name, seconds };
    Ok(BringupReport {
        regions: pop.regions,
        bytes: pop.bytes,
        threads: pop.job.threads,
        chunk_bytes: pop.job.chunk_bytes,
        chunks: pop.job.chunks,
        method: prepared.populate.method,
        pin: prepared.populate.pin,
        phases: vec![
            phase("check", prepared.check_seconds),
            phase("lock", pop.lock_seconds),
            phase("populate", pop.populate_seconds),
            phase("verify", verify_seconds),
        ],
        populate_gbps: if busy > 0.0 {
            pop.bytes as f64 / busy / BYTES_PER_GB
        } else {
            0.0
        },
        needs: prepared.needs,
        usage,
        process,
        pin_note: prepared.pin_note,
        warnings: snap
            .regions()
            .iter()
            .flat_map(|r| r.warnings().iter().cloned())
            .collect(),
    })
}

/// Checks, populates and pins every region of `snap` (for a [`crate::GuestMap`], pass
/// `&map.view()`), then reads back what the kernel did.
pub fn bringup(snap: &MapView, cfg: &BringupConfig) -> Result<BringupReport, BringupError> {
    let prepared = prepare(snap, cfg)?;
    let pop = populate::populate(snap, &prepared.populate)?;
    finish(snap, cfg, prepared, pop)
}

/// A bring-up running behind the caller ([`bringup_background`]): its progress, its end,
/// and its failure, if it fails.
#[derive(Debug)]
pub struct BringupHandle {
    done: Arc<AtomicU64>,
    total: u64,
    thread: Option<std::thread::JoinHandle<Result<BringupReport, BringupError>>>,
}

impl BringupHandle {
    /// Bytes populated so far, of all.
    pub fn progress(&self) -> crate::Progress {
        crate::Progress {
            done: self.done.load(Ordering::Relaxed),
            total: self.total,
        }
    }

    /// Whether it has ended, well or not.
    pub fn is_finished(&self) -> bool {
        self.thread.as_ref().is_none_or(|t| t.is_finished())
    }

    /// Waits for the end: the report, or the failure with the region, address and errno.
    pub fn wait(mut self) -> Result<BringupReport, BringupError> {
        self.join()
    }

    fn join(&mut self) -> Result<BringupReport, BringupError> {
        match self.thread.take() {
            Some(t) => t.join().unwrap_or_else(|p| std::panic::resume_unwind(p)),
            None => Err(BringupError::Background(
                "the bring-up was waited for already",
            )),
        }
    }
}

impl Drop for BringupHandle {
    /// Dropping the handle waits for the bring-up to end, and its outcome is lost, a panic
    /// of the caller's progress callback included: the workers never outlive the handle,
    /// and a drop never panics (not even while the caller unwinds).
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Brings up every region of `map`'s current snapshot behind the caller: the checks run now
/// (a refusal returns here, nothing touched), then populate and pin run on their own
/// threads and this returns at once, with a handle. A guest may run meanwhile: a page it
/// touches first is faulted in by the kernel as usual, and populate skips nothing it needs
/// to (`MADV_POPULATE_WRITE` never writes, so it cannot undo a guest's write).
/// `cfg.populate.first` says which ranges to populate first.
///
/// On failure nothing is released ([`Undo::Keep`]): the guest may already have written the
/// memory this bring-up populated, so discarding it could lose guest data. The handle
/// reports the failure (region, address, errno) and the memory stays as it is; what it
/// locked up front is unlocked.
pub fn bringup_background(
    map: &GuestMap,
    cfg: &BringupConfig,
) -> Result<BringupHandle, BringupError> {
    if cfg.populate.method == Method::Touch {
        return Err(BringupError::Background(
            "the touch fallback cannot run beside a guest: it writes each page it faults and could undo a guest's first write to it; use Method::PopulateWrite",
        ));
    }
    let snap = map.view();
    let mut prepared = prepare(&snap, cfg)?;
    let done = Arc::new(AtomicU64::new(0));
    let counter = done.clone();
    let user = prepared.populate.progress.take();
    prepared.populate.progress = Some(Arc::new(move |bytes| {
        // Workers report out of order: keep the largest.
        counter.fetch_max(bytes, Ordering::Relaxed);
        if let Some(p) = &user {
            p(bytes);
        }
    }));
    prepared.populate.undo = Undo::Keep;
    let total = populate::selected(&snap, &prepared.populate.regions)?
        .iter()
        .map(|r| r.size())
        .sum();
    let cfg = cfg.clone();
    let thread = std::thread::Builder::new()
        .name("guestmem-bringup".into())
        .spawn(move || {
            let pop = populate::populate(&snap, &prepared.populate)?;
            finish(&snap, &cfg, prepared, pop)
        })
        .map_err(|e| BringupError::Spawn(e.to_string()))?;
    Ok(BringupHandle {
        done,
        total,
        thread: Some(thread),
    })
}

/// Brings up the layout `specs` describes, all of it: checks it against the host before
/// anything is mapped (memory not yet resident against `MemAvailable` and the memory cgroup's
/// limit and usage, hugetlb pools, NUMA nodes, `vm.max_map_count`), maps it, then runs
/// [`bringup`]. The report's phases start with `map`. On any error nothing is left mapped.
pub fn bringup_specs(
    specs: &[RegionSpec],
    cfg: &BringupConfig,
) -> Result<(GuestMap, BringupReport), BringupError> {
    let t = Instant::now();
    // One read of the host's facts for the layout check and the mapping; read again after:
    // mapping reserved hugetlb regions takes pages from their pools, which the populate
    // check counts.
    let host = Host::read();
    crate::plan::check_layout(specs, &host)?;
    let map = GuestMap::from_specs_on(specs, &host)?;
    let map_seconds = t.elapsed().as_secs_f64();
    let mut report = bringup(&map.view(), cfg)?;
    report.phases.insert(
        0,
        Phase {
            name: "map",
            seconds: map_seconds,
        },
    );
    Ok((map, report))
}
