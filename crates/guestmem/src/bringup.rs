//! Bring-up: check a map against the host's limits, populate and pin it in one job, and
//! (optionally) read back what the kernel did. This is the policy over the mechanism in
//! [`crate::populate`]: it never touches memory before the limits in [`crate::limits`] pass,
//! and it reports every phase's duration, so a caller (the CLI, the lab) prints, never measures.

use std::time::Instant;

use crate::host::Needs;
use crate::inspect::{self, InspectError, ProcessMemory, RegionUsage};
use crate::limits::{self, LimitError};
use crate::map::Snapshot;
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

/// How to bring a map up.
#[derive(Debug, Clone, Default)]
pub struct BringupConfig {
    /// Threads, method, pinning, minimum chunk, NUMA and progress.
    pub populate: PopulateConfig,
    /// Whether to read back the kernel's account.
    pub verify: Verify,
}

/// Why bring-up failed.
#[derive(Debug, thiserror::Error)]
pub enum BringupError {
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
    /// `check`, `lock`, `populate` or `verify`.
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
    let needs = limits::check(snap, cfg.populate.pin)?;
    let check_seconds = t.elapsed().as_secs_f64();

    let pop = populate::populate(snap, &cfg.populate)?;

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
        method: cfg.populate.method,
        pin: cfg.populate.pin,
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
    })
}
