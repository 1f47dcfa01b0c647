//! Restoring guest memory from a snapshot ([`crate::snapshot`]): eager, mapped or lazy, one
//! API.
//!
//! - [`RestoreMode::Eager`]: populate fresh memory in parallel (the job splitter's chunks,
//!   each populated with `MADV_POPULATE_WRITE` so THP-advised memory gets huge pages) and
//!   read the image into it with `pread`, checking every block's checksum. Returns when all
//!   memory holds the image.
//! - [`RestoreMode::Mapped`]: map each region privately from the memory file
//!   ([`Backing::FilePrivate`]), what Firecracker does by default: the kernel reads each page
//!   from the page cache at the guest's first touch. The baseline: nothing is read up front,
//!   so the base save's checksums are not checked (an incremental chain's later saves are
//!   read and checked as they are applied over it). Memory is page-cache pages until
//!   written, then private 4 KiB copies: no huge pages.
//! - [`RestoreMode::Lazy`]: register the regions with userfaultfd and return at once;
//!   handler threads serve faults a block at a time while background workers prefetch the
//!   rest, the recorded working set first. See [`LazyRestore`].
//!
//! Once an anonymous map's restore is complete (eager, or lazy with every block in), the
//! regions that had transparent huge pages when saved get them back in the background
//! ([`RegainHuge`], see `regain.rs`); [`Restored::regain`] says what that did.
//!
//! A restore refuses a map that holds resident memory, an image whose layout differs from
//! the map's, and reports a corrupt, truncated or unreadable image naming the region, the
//! guest address and the file offset. An eager restore that fails leaves the map as
//! populated memory the caller drops; a lazy restore that fails stops (see
//! [`LazyRestore`]).

pub(crate) mod latency;
mod lazy;
mod regain;

use std::sync::Arc;
use std::time::Instant;

pub use crate::lifecycle::RestoreState;
pub use latency::{ExactLatency, FaultClass, FaultLatency, LatencySummary};
pub use lazy::{LazyReport, LazyRestore};
// The engine as the page server reaches it (`crate::serve`): nothing else of `lazy`.
pub(crate) use lazy::{
    as_prefetcher, staging_oversized, trim_staging, PeerRange, Pooled, RemoteRestore, Start,
    STAGING_IDLE,
};
// Whether a read is a prefetch's, not a fault's: what the store's fetches ask.
#[cfg(feature = "store")]
pub(crate) use lazy::is_prefetcher;
pub use regain::{RegainHuge, RegainReport, Regaining, REGAIN_SETTLE};

use crate::jobs::{Job, JobRange};
use crate::layout::{Backing, RegionSpec};
use crate::map::GuestMap;
use crate::mmap::Advice;
use crate::region::Region;
use crate::snapshot::{Image, SnapshotError};

/// How to restore.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RestoreMode {
    /// Populate and read everything now.
    Eager,
    /// Map the memory file privately; the kernel reads pages at first touch.
    Mapped,
    /// userfaultfd: return at once, serve faults and prefetch in the background (default).
    #[default]
    Lazy,
}

/// What a lazy restore prefetches in the background.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Prefetch {
    /// The image's recorded working set first, in recorded order, then everything else
    /// (the default; without a recorded set, everything in address order).
    #[default]
    WorkingSet,
    /// Nothing: pages come in only as the guest faults them (until
    /// [`LazyRestore::finish`], which brings in the rest).
    None,
}

/// How to restore.
#[derive(Debug, Clone)]
pub struct RestoreConfig {
    /// The mode.
    pub mode: RestoreMode,
    /// Threads reading the image (eager) or prefetching it (lazy), the calling thread
    /// included for eager.
    pub threads: usize,
    /// Lazy: threads serving faults.
    pub handler_threads: usize,
    /// Lazy: what to prefetch.
    pub prefetch: Prefetch,
    /// Whether huge pages come back once the restore is complete (from [`REGAIN_SETTLE`]
    /// later).
    pub regain: RegainHuge,
}

impl Default for RestoreConfig {
    fn default() -> Self {
        RestoreConfig {
            mode: RestoreMode::Lazy,
            threads: crate::jobs::default_threads(),
            handler_threads: crate::jobs::default_threads(),
            prefetch: Prefetch::WorkingSet,
            regain: RegainHuge::Saved,
        }
    }
}

/// What a restore did before it returned.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RestoreReport {
    /// The mode.
    pub mode: RestoreMode,
    /// Guest memory, bytes.
    pub memory_bytes: u64,
    /// Blocks, and of them those holding data.
    pub blocks: u64,
    /// Blocks holding data.
    pub data_blocks: u64,
    /// Saves applied (1 for a full save).
    pub chain_len: usize,
    /// From the call to its return, seconds: for eager, the whole restore.
    pub setup_secs: f64,
    /// Threads that read (eager).
    pub threads: usize,
}

/// A restored map, and for a lazy restore the engine still filling it.
#[derive(Debug)]
pub struct Restored {
    /// The memory.
    pub map: GuestMap,
    /// The lazy restore serving it, for [`RestoreMode::Lazy`].
    pub lazy: Option<LazyRestore>,
    /// What the call did.
    pub report: RestoreReport,
    /// The huge pages coming back in the background, where the saved map had them
    /// ([`RegainHuge::Saved`]): [`Regaining::wait`] says before and after.
    pub regain: Option<Regaining>,
}

/// Maps `specs` (which must lay out the image's regions: [`Image::specs`] gives them) and
/// restores `image` into them as `cfg` says. For [`RestoreMode::Mapped`] each region is
/// mapped privately from the memory file instead of its spec's backing.
pub fn restore(
    image: &Image,
    specs: &[RegionSpec],
    cfg: &RestoreConfig,
) -> Result<Restored, SnapshotError> {
    let t0 = Instant::now();
    let mut sorted: Vec<&RegionSpec> = specs.iter().collect();
    sorted.sort_by_key(|s| s.guest_addr().0);
    check_spec_layout(image, &sorted)?;
    let map = match cfg.mode {
        RestoreMode::Mapped => {
            // The descriptor Image::open checked, not the path: a file swapped in since is
            // not mapped.
            let base = image.base_file_path();
            let mapped: Vec<RegionSpec> = sorted
                .iter()
                .zip(image.regions())
                .map(|(s, r)| {
                    (*s).clone().with_backing(Backing::FilePrivate {
                        path: base.clone(),
                        offset: r.file_offset,
                    })
                })
                .collect();
            GuestMap::from_specs(&mapped)?
        }
        _ => GuestMap::from_specs(specs)?,
    };
    let (lazy, regain) = restore_mode(image, &map, cfg, t0)?;
    let report = RestoreReport {
        mode: cfg.mode,
        memory_bytes: image.memory_bytes(),
        blocks: image.total_blocks(),
        data_blocks: image.data_blocks(),
        chain_len: image.chain_len(),
        setup_secs: t0.elapsed().as_secs_f64(),
        threads: cfg.threads.max(1),
    };
    Ok(Restored {
        map,
        lazy,
        report,
        regain,
    })
}

/// Restores `image` into `map`, a map of fresh memory with the image's layout, eagerly or
/// lazily ([`RestoreMode::Mapped`] needs its own mappings: use [`restore`]). Returns the
/// lazy restore serving it, for [`RestoreMode::Lazy`] (its [`LazyRestore::regaining`]
/// follows the huge pages coming back; an eager restore's come back unobserved: [`restore`]
/// returns a handle for them).
pub fn restore_into(
    image: &Image,
    map: &GuestMap,
    cfg: &RestoreConfig,
) -> Result<Option<LazyRestore>, SnapshotError> {
    if cfg.mode == RestoreMode::Mapped {
        return Err(SnapshotError::MappedInto);
    }
    restore_mode(image, map, cfg, Instant::now()).map(|(lazy, _)| lazy)
}

/// The collapse that gives `regions` back the huge pages the image says they had, if any
/// had them and `cfg` asks for it (anonymous regions only: hugetlb memory is huge already,
/// and a mapped restore's memory is the file's).
fn regain_job(
    image: &Image,
    regions: &[Arc<Region>],
    cfg: &RestoreConfig,
) -> Option<(regain::Job, Regaining)> {
    if cfg.regain == RegainHuge::Off || cfg.mode == RestoreMode::Mapped {
        return None;
    }
    let had: Vec<(&Arc<Region>, u64)> = regions
        .iter()
        .zip(image.regions())
        .filter(|(r, ir)| ir.huge_bytes > 0 && r.backing() == &Backing::Anonymous)
        .map(|(r, ir)| (r, ir.huge_bytes))
        .collect();
    if had.is_empty() {
        return None;
    }
    let saved = had.iter().map(|(_, b)| b).sum();
    let memory = regain::Memory::Local(had.iter().map(|(r, _)| Arc::downgrade(r)).collect());
    let hosts: Vec<u64> = regions.iter().map(|r| r.host_addr() as u64).collect();
    Some(regain::Job::new(
        memory,
        Some(saved),
        image.data_spans(&hosts),
    ))
}

type Started = (Option<LazyRestore>, Option<Regaining>);

fn restore_mode(
    image: &Image,
    map: &GuestMap,
    cfg: &RestoreConfig,
    t0: Instant,
) -> Result<Started, SnapshotError> {
    let regions: Vec<Arc<Region>> = map.view().regions().to_vec();
    check_region_layout(image, &regions, cfg.mode)?;
    // The regions are this restore's from here (a second restore, or a populate, is
    // refused), and only then are they checked fresh and their dirty base changed.
    begin(&regions)?;
    if let Err(e) = check_fresh(&regions, cfg.mode) {
        regions.iter().for_each(|r| r.lifecycle.restore.abort());
        return Err(e);
    }
    // Restored memory is the image's top save: dirty bitmaps count from it.
    for r in &regions {
        *r.lifecycle
            .saved_as
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(image.id().to_string());
    }
    let eager_from = match cfg.mode {
        RestoreMode::Lazy => {
            // The lazy restore owns the regions' state from here: complete or lose.
            let mut lazy = LazyRestore::start(image, regions.clone(), cfg, t0)
                .inspect_err(|_| regions.iter().for_each(|r| r.lifecycle.restore.abort()))?;
            let regain = regain_job(image, &regions, cfg).map(|(job, handle)| {
                lazy.regain_when_complete(job, handle.clone());
                handle
            });
            return Ok((Some(lazy), regain));
        }
        RestoreMode::Eager => Some(0),
        // The base save is the mapped file; later saves of a chain go on top.
        RestoreMode::Mapped => (image.chain_len() > 1).then_some(1),
    };
    let done = eager_from.map_or(Ok(()), |from| eager(image, &regions, cfg.threads, from));
    for r in &regions {
        match &done {
            Ok(()) => r.lifecycle.restore.complete(),
            // Part of the map holds the image and part does not: the caller drops it.
            Err(_) => r.lifecycle.restore.lose(),
        }
    }
    done?;
    Ok((
        None,
        regain_job(image, &regions, cfg).map(|(job, handle)| {
            job.queue();
            handle
        }),
    ))
}

/// Refuses regions that hold memory already (but for a mapped restore, whose memory is the
/// file's).
fn check_fresh(regions: &[Arc<Region>], mode: RestoreMode) -> Result<(), SnapshotError> {
    if mode == RestoreMode::Mapped {
        return Ok(());
    }
    let proc = crate::mmap::ProcMem::open().map_err(|source| SnapshotError::File {
        op: "open",
        path: "/proc/self/pagemap".into(),
        source,
    })?;
    for r in regions {
        let err = |op, source| SnapshotError::Memory {
            region: r.guest_addr().0,
            guest_addr: r.guest_addr().0,
            op,
            source,
        };
        // A GiB at a time: a byte or eight a page of a whole large region at once would be
        // gigabytes.
        const STEP: u64 = 1 << 30;
        let mut off = 0;
        while off < r.size() {
            let len = STEP.min(r.size() - off) as usize;
            // Private memory: faulted in, present or swapped (mincore misses swapped
            // pages). Shared memory: in the page cache, however it got there.
            let resident = match r.backing() {
                Backing::Anonymous => proc
                    .faulted_in(r.mapping(), off as usize, len)
                    .map_err(|e| err("read /proc/self/pagemap", e))?
                    .contains(&true),
                _ => r
                    .mapping()
                    .any_resident(off as usize, len)
                    .map_err(|e| err("mincore", e.into_io()))?,
            };
            if resident {
                return Err(SnapshotError::Populated {
                    region: r.guest_addr().0,
                });
            }
            off += STEP;
        }
    }
    Ok(())
}

/// Moves every region to `Restoring`, or none: a region another restore is filling (or
/// lost) is refused.
fn begin(regions: &[Arc<Region>]) -> Result<(), SnapshotError> {
    for (i, r) in regions.iter().enumerate() {
        if let Err(state) = r.lifecycle.restore.begin() {
            regions[..i]
                .iter()
                .for_each(|r| r.lifecycle.restore.abort());
            return Err(SnapshotError::NotWhole {
                region: r.guest_addr().0,
                why: state.refusal().unwrap_or("its restore state changed"),
            });
        }
    }
    Ok(())
}

fn check_spec_layout(image: &Image, specs: &[&RegionSpec]) -> Result<(), SnapshotError> {
    check_pairs(
        image,
        specs.iter().map(|s| (s.guest_addr().0, s.size())).collect(),
        "the specs",
    )
}

/// The regions against the image: addresses and sizes, and (but for a mapped restore, whose
/// memory is the file's, in base pages) the page size each was saved with.
fn check_region_layout(
    image: &Image,
    regions: &[Arc<Region>],
    mode: RestoreMode,
) -> Result<(), SnapshotError> {
    check_pairs(
        image,
        regions
            .iter()
            .map(|r| (r.guest_addr().0, r.size()))
            .collect(),
        "the map",
    )?;
    for (r, ir) in regions.iter().zip(image.regions()) {
        if mode != RestoreMode::Mapped && r.page_size() != ir.page_size {
            return Err(SnapshotError::PageSizeDiffers {
                region: ir.guest_addr,
                saved: ir.page_size,
                map: r.page_size(),
            });
        }
        if !image.block_bytes().is_multiple_of(r.page_size()) {
            return Err(SnapshotError::PageSize {
                region: ir.guest_addr,
                page_size: r.page_size(),
                block_bytes: image.block_bytes(),
            });
        }
    }
    Ok(())
}

fn check_pairs(
    image: &Image,
    have: Vec<(u64, u64)>,
    name: &'static str,
) -> Result<(), SnapshotError> {
    let want = image.regions();
    for i in 0..want.len().max(have.len()) {
        match (want.get(i), have.get(i)) {
            (Some(w), Some(&(a, s))) if w.guest_addr == a && w.size == s => {}
            (w, h) => {
                return Err(SnapshotError::Layout {
                    index: i,
                    a_name: "the image",
                    a: w.map(|w| (w.guest_addr, w.size)),
                    b_name: name,
                    b: h.copied(),
                })
            }
        }
    }
    Ok(())
}

/// Eager: each job chunk of blocks is populated, then read from the image. With
/// `from_layer` 1 (a mapped restore's chain), only blocks a later save holds are read, over
/// the mapped base, and nothing is populated.
fn eager(
    image: &Image,
    regions: &[Arc<Region>],
    threads: usize,
    from_layer: usize,
) -> Result<(), SnapshotError> {
    let total = image.total_blocks();
    let job = Job::over(vec![JobRange::new(0, total)])
        .expect("block count fits")
        .with_max_threads(threads);
    job.run(|chunk| {
        let mut scratch = Vec::new();
        // A remote image's blocks are read into a buffer of this thread's and copied from
        // there: its reads borrow their destination as a slice, and the map's memory may be
        // reached by views made before this call.
        let mut staging: Vec<u64> = Vec::new();
        let end = chunk.start + chunk.len;
        // Populate the chunk's blocks region by region (a chunk may cross regions).
        if from_layer == 0 {
            let mut b = chunk.start;
            while b < end {
                let (ri, offset, _) = image.block_span(b);
                let r = &regions[ri];
                let region_end =
                    image.regions()[ri].first_block + r.size().div_ceil(image.block_bytes());
                let last = region_end.min(end);
                let (_, last_off, last_len) = image.block_span(last - 1);
                let len = last_off + last_len - offset;
                r.mapping()
                    .advise(offset as usize, len as usize, Advice::PopulateWrite)
                    .map_err(|e| SnapshotError::Memory {
                        region: r.guest_addr().0,
                        guest_addr: r.guest_addr().0 + offset,
                        op: e.op(),
                        source: e.into_io(),
                    })?;
                b = last;
            }
        }
        for b in chunk.start..end {
            if !image.held_from(b, from_layer) {
                continue;
            }
            let (ri, offset, len) = image.block_span(b);
            let r = &regions[ri];
            let dst = r.host_addr().wrapping_add(offset as usize);
            if image.is_remote() {
                staging.resize((len as usize).div_ceil(8), 0);
                let buf = staging.as_mut_ptr() as *mut u8;
                // SAFETY: `staging` holds at least `len` bytes, 8-byte aligned, this
                // thread's alone; its blocks read whole (not zero first).
                unsafe { image.read_block(b, buf, false, &mut scratch)? };
                // SAFETY: the block lies inside region `ri` (layout checked), kept mapped;
                // `buf` holds its `len` bytes.
                unsafe { std::ptr::copy_nonoverlapping(buf, dst, len as usize) };
                continue;
            }
            // The memory is fresh (populated zero, or the mapped file's pages for
            // from_layer 1); read through raw pointers only (a file read, zeroes).
            // SAFETY: the block lies inside region `ri` (layout checked), kept mapped, aligned.
            unsafe { image.read_block(b, dst, from_layer == 0, &mut scratch)? };
        }
        Ok::<(), SnapshotError>(())
    })
    .map_err(|f| f.error)?;
    Ok(())
}
