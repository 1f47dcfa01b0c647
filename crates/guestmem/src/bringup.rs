//! Bring-up: check a layout against the host's limits, map it, populate and pin it in one
//! job, and (optionally) read back what the kernel did. This is the policy over the mechanism
//! in [`crate::populate`]: it never touches memory before the checks of [`crate::host`] and
//! [`crate::limits`] pass, it decides whether to pin ([`PinPolicy`]), and it reports every
//! phase's duration, so a caller (the CLI, the lab, a VMM) prints, never measures.
//!
//! [`bringup_specs`] is the whole thing from region specs; [`bringup`] brings up a map that
//! exists already.

use std::time::Instant;

use crate::host::Needs;
use crate::host::{Host, HostError};
use crate::inspect::{self, InspectError, ProcessMemory, RegionUsage};
use crate::layout::RegionSpec;
use crate::limits::{self, LimitError};
use crate::map::{GuestMap, MapError, Snapshot};
use crate::populate::{self, Method, PinStrategy, PopulateConfig, PopulateError};

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

/// Checks, populates and pins every region of `snap` (for a [`crate::GuestMap`], pass
/// `&map.snapshot()`), then reads back what the kernel did.
pub fn bringup(snap: &Snapshot, cfg: &BringupConfig) -> Result<BringupReport, BringupError> {
    let t = Instant::now();
    let host = Host::read();
    let mut pin_note = None;
    let mut populate_cfg = cfg.populate.clone();
    let needs = match limits::check_on(snap, populate_cfg.pin, &host) {
        Err(LimitError::Host(e @ HostError::Memlock { .. }))
            if cfg.pin_policy == PinPolicy::IfAllowed =>
        {
            pin_note = Some(format!("not pinned: {e}"));
            populate_cfg.pin = PinStrategy::None;
            limits::check_on(snap, PinStrategy::None, &host)?
        }
        other => other?,
    };
    let check_seconds = t.elapsed().as_secs_f64();

    let pop = populate::populate(snap, &populate_cfg)?;

    let t = Instant::now();
    let (usage, process) = match cfg.verify {
        Verify::On => (inspect::inspect(snap)?, Some(ProcessMemory::read()?)),
        Verify::Off => (Vec::new(), None),
    };
    let verify_seconds = t.elapsed().as_secs_f64();

    let busy = pop.lock_seconds + pop.populate_seconds;
    Ok(BringupReport {
        regions: pop.regions,
        bytes: pop.bytes,
        threads: pop.job.threads,
        chunk_bytes: pop.job.chunk_bytes,
        chunks: pop.job.chunks,
        method: populate_cfg.method,
        pin: populate_cfg.pin,
        phases: vec![
            Phase {
                name: "check",
                seconds: check_seconds,
            },
            Phase {
                name: "lock",
                seconds: pop.lock_seconds,
            },
            Phase {
                name: "populate",
                seconds: pop.populate_seconds,
            },
            Phase {
                name: "verify",
                seconds: verify_seconds,
            },
        ],
        populate_gbps: if busy > 0.0 {
            pop.bytes as f64 / busy / BYTES_PER_GB
        } else {
            0.0
        },
        needs,
        usage,
        process,
        pin_note,
        warnings: snap
            .regions()
            .iter()
            .flat_map(|r| r.warnings().iter().cloned())
            .collect(),
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
    crate::plan::check_layout(specs, &Host::read())?;
    let map = GuestMap::from_specs(specs)?;
    let map_seconds = t.elapsed().as_secs_f64();
    let mut report = bringup(&map.snapshot(), cfg)?;
    report.phases.insert(
        0,
        Phase {
            name: "map",
            seconds: map_seconds,
        },
    );
    Ok((map, report))
}
