//! Populate and pin every region of a map in one parallel job, transactionally.
//!
//! Choices, and why:
//!
//! - **One job for the whole map** ([`crate::jobs`]): regions of different sizes finish
//!   together, and chunk edges sit on each region's huge-page boundaries, so no huge page is
//!   faulted by two threads.
//! - **[`Method::PopulateWrite`]** (default): one `madvise(MADV_POPULATE_WRITE)` per chunk; the
//!   kernel faults the whole chunk in under one hold of the address-space lock (seed 001),
//!   and reports failure (`EFAULT` when the hugetlb pool runs dry, `ENOMEM`) as an error.
//! - **[`Method::Touch`]** (fallback for kernels before 5.14): one write per page, made through
//!   `/proc/self/mem` (`mmap::ProcMem`) rather than by a CPU store. A CPU store to a
//!   `MAP_NORESERVE` hugetlb page the pool cannot supply raises `SIGBUS`, and Rust has no sound
//!   way to recover from it (no `sigsetjmp`/`siglongjmp`); the kernel's own access fails the
//!   `pwrite` with `EIO` instead. Each page gets back the byte it holds (read first, as QEMU's
//!   `*addr = *addr`), except a private anonymous page that `/proc/self/pagemap` shows was never
//!   faulted in: it reads as zero, and reading it would map the (huge) zero page, which the
//!   write would then split, losing the transparent huge page; it gets a zero written directly.
//! - **Pinning** ([`PinStrategy`]): by default every non-hugetlb region is locked once,
//!   whole, with `mlock2(MLOCK_ONFAULT)` before the workers start, so the kernel accounts
//!   locked memory once per region and the faults that follow lock pages as they come (seed
//!   000). [`PinStrategy::PerChunk`] is the naive way, kept for comparison: each worker
//!   `mlock`s its chunk after populating it, taking the lock as a writer per chunk. Hugetlb
//!   regions are never locked: their pages cannot be swapped and the kernel ignores `mlock`
//!   on them.
//! - **Transactional.** If any chunk fails, everything this call did is undone before it
//!   returns: regions it locked are unlocked, and every chunk that started is released
//!   (hole-punched in a memfd or hugetlb memfd, whose pages would otherwise outlive an
//!   `MADV_DONTNEED`; `MADV_DONTNEED` for private memory and for files, whose data must not be
//!   destroyed). The error names the region, the failing chunk (guest addresses) and the errno.
//!
//! - **Any regions, never losing data.** [`Selection`] picks the regions (a hot-added one,
//!   say); the others are not touched. Before the job, one read of smaps tells which regions
//!   hold pages already: those are never released on failure (their data may be in use),
//!   and regions locked already are neither locked again nor unlocked. `MADV_POPULATE_WRITE`
//!   never writes, so memory a running guest is writing can be populated beside it. The
//!   touch fallback skips pages already mapped, but writes back one byte of each page it
//!   faults, so a writer that faults the same page in between could lose that write: use
//!   the default method for live memory. [`Undo::Keep`] releases nothing at all, for memory
//!   a guest may have written while it ran.
//!
//! [`populate`] is the mechanism and checks no limits; [`crate::limits::check`] does, and
//! [`crate::bringup::bringup`] runs both.

use std::io;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crate::host::Host;
use crate::jobs::{Chunk, Job, JobError, JobFailure, JobRange, JobStats, Numa};
use crate::layout::{Backing, Reserve};
use crate::lifecycle::PopulateClaim;
use crate::map::MapView;
use crate::mmap::ProcMem;

mod touch;
use crate::mmap::{Advice, Lock, MmapError};
use crate::region::Region;
use crate::sys;
use touch::touch;
use vm_memory::GuestAddress;

/// Default smallest chunk worth a thread, in bytes. Creating a thread costs tens of
/// microseconds; populating 64 MiB costs milliseconds even at the fastest published rates, so
/// a thread per 64 MiB (QEMU's heuristic too) always pays for itself.
pub const DEFAULT_MIN_CHUNK_BYTES: u64 = 64 << 20;

/// Bytes of a chunk whose `/proc/self/pagemap` entries the touch fallback reads at once.
pub const TOUCH_PAGEMAP_BATCH_BYTES: usize = 2 << 20;

/// How pages are faulted in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Method {
    /// `madvise(MADV_POPULATE_WRITE)`, one call per chunk (the default; Linux 5.14+).
    #[default]
    PopulateWrite,
    /// One write per page through `/proc/self/mem`: slower, but works on any kernel and turns
    /// what would be a `SIGBUS` into an error.
    Touch,
}

/// How memory is pinned (locked against swap).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PinStrategy {
    /// Not pinned.
    None,
    /// `mlock2(MLOCK_ONFAULT)` on every whole region once, before workers populate (default).
    #[default]
    UpFront,
    /// Each worker `mlock`s its own chunk after populating it (the naive way, for comparison).
    PerChunk,
}

/// A progress callback: called after each chunk with the bytes done so far, from any worker.
pub type Progress = Arc<dyn Fn(u64) + Send + Sync>;

/// How to populate.
#[derive(Clone)]
pub struct PopulateConfig {
    /// Most threads, the calling thread included (0 means 1).
    pub threads: usize,
    /// Smallest chunk worth a thread, in bytes.
    pub min_chunk: u64,
    /// How pages are faulted in.
    pub method: Method,
    /// How memory is pinned.
    pub pin: PinStrategy,
    /// Whether workers follow the regions' NUMA nodes.
    pub numa: Numa,
    /// Called after each chunk, if set.
    pub progress: Option<Progress>,
    /// Which regions of the snapshot to populate.
    pub regions: Selection,
    /// What a failure does to the memory this call populated.
    pub undo: Undo,
    /// Guest ranges `(address, length)` populated first, in this order (the memory a guest
    /// touches first, say); the rest follows in address order.
    pub first: Vec<(GuestAddress, u64)>,
}

/// Which regions of a snapshot a populate works on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Selection {
    /// Every region (the default).
    #[default]
    All,
    /// Only the regions starting at these guest addresses (a hot-added region, say); the
    /// others are not touched.
    Starting(Vec<GuestAddress>),
}

/// What a failed populate does to the memory it populated.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Undo {
    /// Give back what this call populated in regions that held nothing before it (the
    /// default). Regions that held pages before the call are never released: their data
    /// may be in use.
    #[default]
    Release,
    /// Release nothing: for memory a running guest may already have written (a background
    /// bring-up), where only the failure is reported.
    Keep,
}

impl std::fmt::Debug for PopulateConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PopulateConfig")
            .field("threads", &self.threads)
            .field("min_chunk", &self.min_chunk)
            .field("method", &self.method)
            .field("pin", &self.pin)
            .field("numa", &self.numa)
            .field("progress", &self.progress.is_some())
            .field("regions", &self.regions)
            .field("undo", &self.undo)
            .field("first", &self.first)
            .finish()
    }
}

impl Default for PopulateConfig {
    fn default() -> Self {
        PopulateConfig {
            threads: crate::jobs::default_threads(),
            min_chunk: DEFAULT_MIN_CHUNK_BYTES,
            method: Method::default(),
            pin: PinStrategy::default(),
            numa: Numa::default(),
            progress: None,
            regions: Selection::All,
            undo: Undo::Release,
            first: Vec::new(),
        }
    }
}

/// What a populate did.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct PopulateReport {
    /// Regions populated.
    pub regions: usize,
    /// Bytes populated.
    pub bytes: u64,
    /// How the job ran: threads, chunk size, chunks.
    pub job: JobStats,
    /// Seconds spent locking regions up front (0 unless [`PinStrategy::UpFront`]).
    pub lock_seconds: f64,
    /// Seconds spent in the parallel job.
    pub populate_seconds: f64,
}

/// Why populating failed. Whatever it had done was undone first, unless `undo_errors` says
/// otherwise.
#[derive(Debug, thiserror::Error)]
pub enum PopulateError {
    /// Locking a region up front failed; the regions locked before it were unlocked.
    #[error("region at {region:#x}: mlock2(MLOCK_ONFAULT) failed: {source}")]
    Lock {
        /// Guest address of the region.
        region: u64,
        /// The errno.
        source: io::Error,
    },
    /// A chunk failed; everything this populate did was undone.
    #[error("region at {region:#x}: {op} of chunk at {chunk:#x} len {len:#x} failed: {source}{}{}",
        cause.as_ref().map_or(String::new(), |c| format!(": {c}")),
        if undo_errors.is_empty() { String::new() } else { format!(" (and undo failed: {})", undo_errors.join("; ")) })]
    Chunk {
        /// Guest address of the region.
        region: u64,
        /// Guest address of the failing chunk.
        chunk: u64,
        /// Length of the failing chunk.
        len: u64,
        /// The operation that failed.
        op: &'static str,
        /// The errno.
        source: io::Error,
        /// What the errno means here, when guestmem can tell: a hugetlb pool or hugetlb
        /// cgroup run dry, a backing file truncated under the region.
        cause: Option<String>,
        /// Steps of the undo that failed (empty when it all went back).
        undo_errors: Vec<String>,
    },
    /// `/proc/self/mem` or `/proc/self/pagemap` could not be opened for the touch fallback.
    #[error("opening /proc/self/mem for the touch fallback: {0}")]
    ProcMem(io::Error),
    /// The map's regions could not be made into a job.
    #[error(transparent)]
    Job(#[from] JobError),
    /// A selected address starts no region of the snapshot.
    #[error("no region starts at guest address {addr:#x}")]
    NoSuchRegion {
        /// The address.
        addr: u64,
    },
    /// A restore is filling the region (or failed to): its memory is the restore's; or
    /// another populate runs on it.
    #[error("region at {region:#x}: not populated: {why}")]
    Restoring {
        /// Guest address of the region.
        region: u64,
        /// What the restore is doing.
        why: &'static str,
    },
    /// The kernel's account of the regions (which hold pages already) could not be read.
    #[error(transparent)]
    Inspect(#[from] crate::inspect::InspectError),
}

/// What failed inside one chunk.
#[derive(Debug)]
struct ChunkError {
    op: &'static str,
    source: io::Error,
}

fn fail(op: &'static str) -> impl FnOnce(io::Error) -> ChunkError {
    move |source| ChunkError { op, source }
}

impl From<MmapError> for ChunkError {
    fn from(e: MmapError) -> Self {
        ChunkError {
            op: e.op(),
            source: e.into_io(),
        }
    }
}

/// `(offset, len)` of `chunk` inside `region`'s mapping. The job's chunks lie inside their
/// regions; the mapping checks again on every call.
fn chunk_range(region: &Region, chunk: &Chunk) -> (usize, usize) {
    (
        (chunk.start - region.guest_addr().0) as usize,
        chunk.len as usize,
    )
}

/// What a failed chunk's errno means for its region, when it can be told: a hugetlb region
/// whose pool (or hugetlb cgroup) ran dry, or a file truncated under its region. `EFAULT`
/// (`MADV_POPULATE_WRITE`), `EIO` (the touch fallback) and `ENOMEM` are how the kernel says
/// a page could not be had.
fn cause(region: &Region, source: &io::Error) -> Option<String> {
    let errno = source.raw_os_error()?;
    if !matches!(errno, libc::EFAULT | libc::EIO | libc::ENOMEM) {
        return None;
    }
    if let Backing::Hugetlb(size) = region.backing() {
        let host = Host::read();
        let dir = size.sysfs_dir();
        return Some(match host.pool(*size) {
            Some(p) if p.available() == 0 => format!(
                "the {size} hugetlb pool ran dry ({} pages, {} free, {} reserved; raise {dir}/nr_hugepages)",
                p.total, p.free, p.reserved
            ),
            Some(p) => format!(
                "no {size} hugetlb page could be had although the pool has {} free; a hugetlb cgroup limit (hugetlb.{}.limit_in_bytes) may have been reached",
                p.available(),
                match size {
                    crate::layout::HugePageSize::Size2M => "2MB",
                    crate::layout::HugePageSize::Size1G => "1GB",
                }
            ),
            None => format!("the {size} hugetlb pool is gone ({dir})"),
        });
    }
    region.check_backing().err().map(|e| e.to_string())
}

/// The regions of `snap` that `selection` names, in address order, each once.
pub fn selected(snap: &MapView, selection: &Selection) -> Result<Vec<Arc<Region>>, PopulateError> {
    match selection {
        Selection::All => Ok(snap.regions().to_vec()),
        Selection::Starting(addrs) => {
            let mut addrs = addrs.clone();
            addrs.sort_unstable();
            addrs.dedup();
            addrs
                .iter()
                .map(|a| {
                    snap.find(*a)
                        .filter(|r| r.guest_addr() == *a)
                        .cloned()
                        .ok_or(PopulateError::NoSuchRegion { addr: a.0 })
                })
                .collect()
        }
    }
}

/// Populates (and pins, per `cfg.pin`) every region of `snap` in one job. Checks no limits:
/// see [`crate::limits::check`]. On failure, undoes everything it did before returning.
pub fn populate(snap: &MapView, cfg: &PopulateConfig) -> Result<PopulateReport, PopulateError> {
    let regions = selected(snap, &cfg.regions)?;
    let regions = &regions[..];
    // Each region from Whole to Populating (or none) until this call returns, however it
    // returns. Memory a restore is filling is the restore's: populating it would fault
    // blocks in out of order, and undoing a failed populate would discard restored data;
    // and no restore may begin on memory a populate may yet undo.
    let _claimed = PopulateClaim::take(regions.iter().map(|r| &r.lifecycle.restore)).map_err(
        |(i, state)| PopulateError::Restoring {
            region: guest(&regions[i]),
            why: state.refusal().unwrap_or("its restore state changed"),
        },
    )?;
    let before = Before::read(regions)?;
    let job = job_over(regions, cfg)?;
    let mem = match cfg.method {
        Method::Touch => Some(ProcMem::open().map_err(PopulateError::ProcMem)?),
        Method::PopulateWrite => None,
    };

    let t0 = Instant::now();
    let locked = match cfg.pin {
        PinStrategy::UpFront => lock_up_front(regions, &before.was_locked)?,
        PinStrategy::None | PinStrategy::PerChunk => Vec::new(),
    };
    let lock_seconds = t0.elapsed().as_secs_f64();

    let t1 = Instant::now();
    let result = run_unlocking_on_panic(regions, &before, cfg, || {
        run_chunks(&job, regions, mem.as_ref(), cfg)
    });
    let populate_seconds = t1.elapsed().as_secs_f64();

    match result {
        Ok(job) => Ok(PopulateReport {
            regions: regions.len(),
            bytes: regions.iter().map(|r| r.size()).sum(),
            job,
            lock_seconds,
            populate_seconds,
        }),
        Err(failure) => Err(undo(regions, &before, &locked, cfg, failure)),
    }
}

/// What each region held before the call: memory in use is never released on failure, and
/// what was locked before is neither locked again nor unlocked.
struct Before {
    in_use: Vec<bool>,
    was_locked: Vec<bool>,
}

impl Before {
    /// Residency is asked of the kernel page by page (`mincore`), not read from smaps: a
    /// memfd written through its descriptor, or a region whose mapping merged with a
    /// neighbour, holds data smaps does not show for it.
    fn read(regions: &[Arc<Region>]) -> Result<Before, PopulateError> {
        let usage = crate::inspect::inspect_regions(regions)?;
        let in_use = regions
            .iter()
            .map(|r| {
                let m = r.mapping();
                m.any_resident(0, m.len())
                    .map_err(|e| PopulateError::Chunk {
                        region: guest(r),
                        chunk: guest(r),
                        len: r.size(),
                        op: e.op(),
                        source: e.into_io(),
                        cause: None,
                        undo_errors: Vec::new(),
                    })
            })
            .collect::<Result<_, _>>()?;
        let was_locked = regions
            .iter()
            .zip(&usage)
            .map(|(r, u)| !r.is_hugetlb() && u.locked >= r.size())
            .collect();
        Ok(Before { in_use, was_locked })
    }
}

/// One job over the regions, huge-page aligned, on their NUMA nodes, `cfg.first` first.
fn job_over(regions: &[Arc<Region>], cfg: &PopulateConfig) -> Result<Job, PopulateError> {
    let ranges = regions
        .iter()
        .map(|r| JobRange {
            start: r.guest_addr().0,
            len: r.size(),
            align: r.huge_align(),
            node: r.numa_node(),
        })
        .collect();
    let first: Vec<(u64, u64)> = cfg.first.iter().map(|&(a, l)| (a.0, l)).collect();
    Ok(Job::over(ranges)?
        .with_first(&first)
        .with_min_chunk(cfg.min_chunk)
        .with_max_threads(cfg.threads)
        .with_numa(cfg.numa))
}

/// Runs `f`; a panic in it (the caller's progress callback, say) must not leave regions
/// locked: it is caught, what was locked up front is unlocked, and the panic goes on. (Pages
/// it populated stay: which chunks ran is not known once a worker has unwound.)
fn run_unlocking_on_panic<T>(
    regions: &[Arc<Region>],
    before: &Before,
    cfg: &PopulateConfig,
    f: impl FnOnce() -> T,
) -> T {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(t) => t,
        Err(panic) => {
            if cfg.pin != PinStrategy::None {
                let mine = regions.iter().zip(&before.was_locked).filter(|(_, &w)| !w);
                for (r, _) in mine.filter(|(r, _)| !r.is_hugetlb()) {
                    // Best effort on the way out: the panic is what the caller will see.
                    let _ = r.mapping().unlock(0, r.mapping().len());
                }
            }
            std::panic::resume_unwind(panic);
        }
    }
}

/// Populates (and pins per chunk, when asked) every chunk of the job.
fn run_chunks(
    job: &Job,
    regions: &[Arc<Region>],
    mem: Option<&ProcMem>,
    cfg: &PopulateConfig,
) -> Result<JobStats, JobFailure<ChunkError>> {
    let bytes_done = AtomicU64::new(0);
    job.run(|chunk: &Chunk| -> Result<(), ChunkError> {
        let region = &regions[chunk.range];
        let (offset, len) = chunk_range(region, chunk);
        let mapping = region.mapping();
        match mem {
            Some(mem) => touch(mem, region, offset, len)?,
            None => mapping.advise(offset, len, Advice::PopulateWrite)?,
        }
        if cfg.pin == PinStrategy::PerChunk && !region.is_hugetlb() {
            mapping.lock(offset, len, Lock::Now)?;
        }
        let done = bytes_done.fetch_add(chunk.len, Ordering::Relaxed) + chunk.len;
        if let Some(p) = &cfg.progress {
            p(done);
        }
        Ok(())
    })
}

/// Undoes what a failed populate did (unlocks what it locked, releases what it populated in
/// memory that held nothing before) and says what failed, why, and what of the undo failed.
fn undo(
    regions: &[Arc<Region>],
    before: &Before,
    locked: &[usize],
    cfg: &PopulateConfig,
    failure: JobFailure<ChunkError>,
) -> PopulateError {
    // Read what the errno means before the undo gives pages back to their pool.
    let failed = &regions[failure.chunk.range];
    let cause = cause(failed, &failure.error.source);
    let mut undo_errors = Vec::new();
    for &i in locked {
        let m = regions[i].mapping();
        if let Err(e) = m.unlock(0, m.len()) {
            undo_errors.push(format!("munlock region {:#x}: {e}", guest(&regions[i])));
        }
    }
    for chunk in failure.started() {
        let region = &regions[chunk.range];
        let (offset, len) = chunk_range(region, &chunk);
        let mine = !before.was_locked[chunk.range];
        if cfg.pin == PinStrategy::PerChunk && !region.is_hugetlb() && mine {
            if let Err(e) = region.mapping().unlock(offset, len) {
                undo_errors.push(format!("munlock chunk {:#x}: {e}", chunk.start));
            }
        }
        // Memory that held pages before this call may hold data: never released.
        if cfg.undo == Undo::Release && !before.in_use[chunk.range] {
            if let Err(e) = release(region, &chunk) {
                undo_errors.push(format!("release chunk {:#x}: {e}", chunk.start));
            }
        }
    }
    PopulateError::Chunk {
        region: guest(failed),
        chunk: failure.chunk.start,
        len: failure.chunk.len,
        op: failure.error.op,
        cause,
        source: failure.error.source,
        undo_errors,
    }
}

fn guest(region: &Region) -> u64 {
    region.guest_addr().0
}

/// Locks every non-hugetlb region with `MLOCK_ONFAULT`; on failure unlocks those it locked.
/// Returns the indices of the regions locked.
fn lock_up_front(
    regions: &[Arc<Region>],
    was_locked: &[bool],
) -> Result<Vec<usize>, PopulateError> {
    let mut locked: Vec<usize> = Vec::new();
    for (i, r) in regions.iter().enumerate() {
        if r.is_hugetlb() || was_locked[i] {
            continue;
        }
        let m = r.mapping();
        if let Err(e) = m.lock(0, m.len(), Lock::OnFault) {
            for &j in locked.iter() {
                // Best effort: we are already failing with the lock error.
                let m = regions[j].mapping();
                let _ = m.unlock(0, m.len());
            }
            return Err(PopulateError::Lock {
                region: guest(r),
                source: e.into_io(),
            });
        }
        locked.push(i);
    }
    Ok(locked)
}

/// Frees the pages of `chunk` of `region`, so the memory it took is given back.
fn release(region: &Region, chunk: &Chunk) -> io::Result<()> {
    match (region.backing(), region.file_offset()) {
        // A reserved hugetlb region's pages were taken from the pool when it was mapped, and
        // populating took nothing more: leave them. A hole punch would give back the
        // reservation with them, and a later touch could then find the pool dry (SIGBUS).
        (Backing::Hugetlb(_), _) if region.reserve() == Reserve::Reserve => Ok(()),
        // A memfd's pages live in its page cache: only a hole punch frees them (it unmaps
        // them too). Hugetlbfs rounds the hole inwards to its pages; chunk edges are on them.
        (Backing::Memfd | Backing::Hugetlb(_), Some(fo)) => {
            let offset = fo.start() + (chunk.start - guest(region));
            sys::punch_hole(fo.file().as_fd(), offset, chunk.len)
        }
        // Private memory, and files whose data is not ours to destroy.
        _ => {
            let (offset, len) = chunk_range(region, chunk);
            region
                .mapping()
                .advise(offset, len, Advice::DontNeed)
                .map_err(MmapError::into_io)
        }
    }
}
