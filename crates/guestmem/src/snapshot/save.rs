//! Writing a snapshot.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use super::blocks::{dirty_pages, save_block, BlockAt};
use super::manifest::{read_manifest, same_layout};
use super::store::{Destination, Staging};
use super::{
    new_id, BlockRecord, Manifest, ManifestRegion, ParentRef, SnapshotError, DEFAULT_BLOCK_BYTES,
    FORMAT, IMAGE_PAGE_BYTES, MANIFEST_FILE, MAX_STAGED_BLOCK_BYTES, MEMORY_FILE, VERSION,
};
use crate::files::Dir;
use crate::jobs::{Job, JobRange};
use crate::map::MapView;
use crate::mmap::ProcMem;
use crate::region::Region;

/// Full or incremental.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum SaveKind {
    /// Every page (the default).
    #[default]
    Full,
    /// The pages dirtied since the save in `parent` (or since the last save, for the dirty
    /// bitmaps are cleared by each): every region needs dirty tracking.
    Incremental {
        /// The previous save's directory.
        parent: PathBuf,
    },
}

/// How to save.
#[derive(Debug, Clone)]
pub struct SaveConfig {
    /// Threads, the calling one included.
    pub threads: usize,
    /// Block size (a power of two; raised to the largest page size). Incremental saves take
    /// their parent's.
    pub block_bytes: u64,
    /// Full or incremental.
    pub kind: SaveKind,
    /// Notes kept in the manifest.
    pub meta: BTreeMap<String, String>,
}

impl Default for SaveConfig {
    fn default() -> Self {
        SaveConfig {
            threads: crate::jobs::default_threads(),
            block_bytes: DEFAULT_BLOCK_BYTES,
            kind: SaveKind::Full,
            meta: BTreeMap::new(),
        }
    }
}

/// What a save did.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SaveReport {
    /// The directory.
    pub dir: PathBuf,
    /// The manifest's id.
    pub id: String,
    /// Guest memory covered, bytes.
    pub memory_bytes: u64,
    /// Bytes written to the memory file (the rest are holes).
    pub bytes_written: u64,
    /// Blocks the save holds.
    pub blocks: u64,
    /// Threads that worked.
    pub threads: usize,
    /// Seconds, from the start to the manifest's rename.
    pub seconds: f64,
}

/// Saves the memory of `snap` as a new snapshot at `dir`, which must not exist (or be an
/// empty directory): a save never overwrites anything. The snapshot directory is made with
/// mode 0700: it holds guest memory.
///
/// The snapshot is written into a uniquely named staging directory beside `dir`, synced,
/// and published with one `renameat2(RENAME_NOREPLACE)`: a reader (or a crash) sees no
/// snapshot at `dir` or a complete one, never a mix of two saves. A failed save removes its
/// staging directory and nothing else. Two saves of one map run one after the other (each
/// region's save lock is held throughout), so an incremental save checks its parent and takes
/// the dirty set as one step: of two incremental saves from one parent, the second is refused.
///
/// The guest must be paused (vCPUs out of `KVM_RUN`, devices quiet) for the image to be
/// consistent; memory written during the save may be saved either way, and for an
/// incremental save, a page written after its dirty bit was read stays dirty for the next.
pub fn save(snap: &MapView, dir: &Path, cfg: &SaveConfig) -> Result<SaveReport, SnapshotError> {
    let t0 = Instant::now();
    let regions = snap.regions();
    if regions.is_empty() {
        return Err(SnapshotError::EmptyMap);
    }
    // One save of a region at a time, in address order (every snapshot of a map lists its
    // regions in that order, so two saves cannot deadlock).
    let mut saved_as: Vec<MutexGuard<'_, Option<String>>> = regions
        .iter()
        .map(|r| {
            r.lifecycle
                .saved_as
                .lock()
                .unwrap_or_else(|e| e.into_inner())
        })
        .collect();
    check_whole(regions)?;
    let layout = layout_of(regions);
    let memory_bytes = layout.last().map_or(0, |l| l.file_offset + l.size);
    let target = Destination::new(dir)?;
    let base = match &cfg.kind {
        SaveKind::Full => full_base(regions, cfg.block_bytes)?,
        SaveKind::Incremental { parent } => {
            incremental_base(regions, &layout, &saved_as, parent, &target)?
        }
    };
    let staging = Staging::create(&target)?;
    // The dirty bits this save covers, taken (cleared) now, so a page written during the save
    // stays dirty for the next one; put back if the save fails.
    let dirty = take_dirty(regions);
    let written = write_and_publish(regions, layout, &dirty, &base, cfg, staging, &target);
    let (w, id, blocks) = match written {
        Ok(done) => done,
        Err(e) => {
            put_back(regions, &dirty);
            return Err(e);
        }
    };
    // The dirty bitmaps count from this save now.
    for g in &mut saved_as {
        **g = Some(id.clone());
    }
    Ok(SaveReport {
        dir: dir.to_path_buf(),
        id,
        memory_bytes,
        bytes_written: w.bytes,
        blocks,
        threads: w.threads,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// Writes the memory file and the manifest into `staging` and publishes it at `target`;
/// what was written, the new id, and the blocks the save holds.
fn write_and_publish(
    regions: &[Arc<Region>],
    layout: Vec<ManifestRegion>,
    dirty: &[Option<Vec<u64>>],
    base: &Base,
    cfg: &SaveConfig,
    staging: Staging,
    target: &Destination,
) -> Result<(Written, String, u64), SnapshotError> {
    let memory_bytes = layout.last().map_or(0, |l| l.file_offset + l.size);
    let mem_path = staging.dir.join(MEMORY_FILE);
    let file = staging.dir.create_new(MEMORY_FILE)?;
    file.set_len(memory_bytes)
        .map_err(|source| SnapshotError::File {
            op: "size",
            path: mem_path.clone(),
            source,
        })?;
    let mut w = write_blocks(regions, &layout, dirty, base, cfg.threads, &file, &mem_path)?;
    let id = new_id();
    let manifest = Manifest {
        format: FORMAT.into(),
        version: VERSION,
        id: id.clone(),
        parent: base.parent.clone(),
        memory_file: MEMORY_FILE.into(),
        memory_bytes,
        block_bytes: base.block_bytes,
        regions: layout,
        blocks: std::mem::take(&mut w.records),
        working_set: Vec::new(),
        meta: cfg.meta.clone(),
    };
    write_new_manifest(&staging.dir, &manifest)?;
    staging.publish(target)?;
    Ok((w, id, manifest.blocks.len() as u64))
}

/// Refuses regions a restore is filling or failed to fill. A region being populated is
/// whole (a populate faults zeros in, and its undo gives back only memory that held nothing
/// before): saved as any other, a background bring-up's included.
fn check_whole(regions: &[Arc<Region>]) -> Result<(), SnapshotError> {
    for r in regions {
        let state = r.lifecycle.restore.get();
        if state == crate::lifecycle::RestoreState::Populating {
            continue;
        }
        if let Some(why) = state.refusal() {
            return Err(SnapshotError::NotWhole {
                region: r.guest_addr().0,
                why,
            });
        }
    }
    Ok(())
}

/// The regions as the manifest lists them, laid end to end in the memory file, each with
/// the transparent huge pages the kernel maps it with now (none recorded if smaps cannot be
/// read: a restore then leaves its pages as they come).
fn layout_of(regions: &[Arc<Region>]) -> Vec<ManifestRegion> {
    let usage = crate::inspect::inspect_regions(regions).ok();
    let mut file_offset = 0u64;
    regions
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let huge_bytes = match (r.backing(), &usage) {
                (crate::layout::Backing::Anonymous, Some(u)) => u[i].huge.min(r.size()),
                _ => 0,
            };
            let l = ManifestRegion {
                guest_addr: r.guest_addr().0,
                size: r.size(),
                file_offset,
                page_size: r.page_size(),
                backing: r.backing().name(),
                huge_bytes,
            };
            file_offset += r.size();
            l
        })
        .collect()
}

/// What a save builds on: its block size and, for an incremental save, its parent (whose
/// directory stays locked while the save runs).
struct Base {
    block_bytes: u64,
    parent: Option<ParentRef>,
    _parent_lock: Option<Dir>,
}

fn full_base(regions: &[Arc<Region>], block_bytes: u64) -> Result<Base, SnapshotError> {
    if !block_bytes.is_power_of_two()
        || !(IMAGE_PAGE_BYTES..=MAX_STAGED_BLOCK_BYTES).contains(&block_bytes)
    {
        return Err(SnapshotError::BlockSize {
            block_bytes,
            max: MAX_STAGED_BLOCK_BYTES,
        });
    }
    let largest_page = regions
        .iter()
        .map(|r| r.page_size())
        .max()
        .unwrap_or(IMAGE_PAGE_BYTES);
    Ok(Base {
        block_bytes: block_bytes.max(largest_page),
        parent: None,
        _parent_lock: None,
    })
}

/// Opens and locks the parent, and checks that this map's dirty bitmaps count from it.
/// Runs under the regions' save locks (`saved_as`).
fn incremental_base(
    regions: &[Arc<Region>],
    layout: &[ManifestRegion],
    saved_as: &[MutexGuard<'_, Option<String>>],
    parent: &Path,
    target: &Destination,
) -> Result<Base, SnapshotError> {
    let pdir = Dir::open(parent)?;
    pdir.lock(true, true)
        .map_err(|source| SnapshotError::File {
            op: "lock",
            path: parent.to_path_buf(),
            source,
        })?;
    let p = read_manifest(&pdir)?;
    same_layout(&p.regions, layout, "the parent save", "this map has")?;
    for r in regions {
        if r.dirty_bitmap().is_none() {
            return Err(SnapshotError::NotTracked {
                region: r.guest_addr().0,
            });
        }
    }
    // The dirty bitmaps must count from this parent, or pages written between the parent and
    // the save they count from would be missing.
    for (r, from) in regions.iter().zip(saved_as) {
        if from.as_deref() != Some(p.id.as_str()) {
            return Err(SnapshotError::NotFromParent {
                region: r.guest_addr().0,
                counts_from: (**from).clone(),
                parent_id: p.id.clone(),
                parent: parent.to_path_buf(),
            });
        }
    }
    Ok(Base {
        block_bytes: p.block_bytes,
        parent: Some(ParentRef {
            dir: target.name_parent(parent),
            id: p.id,
        }),
        _parent_lock: Some(pdir),
    })
}

/// Takes (clears) every tracked region's dirty bits.
fn take_dirty(regions: &[Arc<Region>]) -> Vec<Option<Vec<u64>>> {
    regions
        .iter()
        .map(|r| {
            r.dirty_bitmap().map(|b| {
                let mut w = Vec::new();
                b.take(&mut w);
                w
            })
        })
        .collect()
}

/// Puts back the dirty bits a failed save took.
fn put_back(regions: &[Arc<Region>], dirty: &[Option<Vec<u64>>]) {
    for (r, words) in regions.iter().zip(dirty) {
        if let (Some(b), Some(w)) = (r.dirty_bitmap(), words) {
            let _ = b.merge_words(0, w);
        }
    }
}

/// What writing the blocks did.
struct Written {
    records: Vec<BlockRecord>,
    bytes: u64,
    threads: usize,
}

/// Writes every block (every dirty page of one, for an incremental save) on the job
/// splitter, and syncs the file.
fn write_blocks(
    regions: &[Arc<Region>],
    layout: &[ManifestRegion],
    dirty: &[Option<Vec<u64>>],
    base: &Base,
    threads: usize,
    file: &File,
    mem_path: &Path,
) -> Result<Written, SnapshotError> {
    let block_bytes = base.block_bytes;
    let incremental = base.parent.is_some();
    let mut blocks_of = Vec::new();
    for (i, (r, l)) in regions.iter().zip(layout).enumerate() {
        for k in 0..r.size().div_ceil(block_bytes) {
            let offset = k * block_bytes;
            blocks_of.push((
                i,
                offset,
                (r.size() - offset).min(block_bytes),
                l.file_offset,
            ));
        }
    }
    let total_blocks = blocks_of.len() as u64;
    let proc = ProcMem::open().map_err(|source| SnapshotError::File {
        op: "open",
        path: "/proc/self/pagemap".into(),
        source,
    })?;
    let records = Mutex::new(Vec::new());
    let written = std::sync::atomic::AtomicU64::new(0);
    let job = Job::over(vec![JobRange::new(0, total_blocks)])
        .expect("block count fits")
        .with_max_threads(threads);
    let stats = job
        .run(|chunk| {
            let mut local = Vec::new();
            for b in chunk.start..chunk.start + chunk.len {
                let (ri, offset, len, region_file_offset) = blocks_of[b as usize];
                let at = BlockAt {
                    region: &regions[ri],
                    offset,
                    len,
                    file_offset: region_file_offset + offset,
                };
                let pages = incremental.then(|| {
                    let words = dirty[ri].as_ref().expect("checked tracked");
                    dirty_pages(words, offset, len, block_bytes)
                });
                if let Some((rec, bytes)) = save_block(&at, b, pages, &proc, file, mem_path)? {
                    written.fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
                    local.push(rec);
                }
            }
            records
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend(local);
            Ok::<(), SnapshotError>(())
        })
        .map_err(|f| f.error)?;
    file.sync_data().map_err(|source| SnapshotError::File {
        op: "sync",
        path: mem_path.to_path_buf(),
        source,
    })?;
    let mut records = records.into_inner().unwrap_or_else(|e| e.into_inner());
    records.sort_by_key(|r: &BlockRecord| r.index);
    Ok(Written {
        records,
        bytes: written.into_inner(),
        threads: stats.threads,
    })
}

/// Writes `manifest` as a new file in `dir` (a staging directory nobody reads yet), synced.
fn write_new_manifest(dir: &Dir, manifest: &Manifest) -> Result<(), SnapshotError> {
    use std::io::Write;
    let text = serde_json::to_vec_pretty(manifest).expect("a manifest serialises");
    let path = dir.join(MANIFEST_FILE);
    let err = |op| {
        let path = path.clone();
        move |source| SnapshotError::File { op, path, source }
    };
    let mut f = dir.create_new(MANIFEST_FILE)?;
    f.write_all(&text).map_err(err("write"))?;
    f.sync_all().map_err(err("sync"))
}

/// Writes `working_set` into the manifest in `dir` (a new file renamed over the old).
pub(crate) fn record_working_set(dir: &Path, working_set: &[u64]) -> Result<(), SnapshotError> {
    let mut m = read_manifest(&Dir::open(dir)?)?;
    m.working_set = working_set.to_vec();
    let text = serde_json::to_vec_pretty(&m).expect("a manifest serialises");
    crate::files::publish_file(&dir.join(MANIFEST_FILE), &text)?;
    Ok(())
}
