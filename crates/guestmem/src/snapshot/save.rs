//! Writing a snapshot.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use super::hash::BlockHasher;
use super::manifest::{read_manifest, same_layout, MAX_SMALL_PAGE_BLOCK_BYTES};
use super::{
    new_id, BlockRecord, Manifest, ManifestRegion, ParentRef, SnapshotError, DEFAULT_BLOCK_BYTES,
    FORMAT, IMAGE_PAGE_BYTES, MANIFEST_FILE, MEMORY_FILE, VERSION,
};
use crate::files::Dir;
use crate::jobs::{Job, JobRange};
use crate::layout::Backing;
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

/// One block's place.
struct BlockAt<'a> {
    region: &'a Region,
    /// Offset in the region.
    offset: u64,
    len: u64,
    /// Offset in the memory file.
    file_offset: u64,
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
        return Err(SnapshotError::Layout("the map holds no region".into()));
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
    let target = Target::new(dir)?;
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
    target: &Target,
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

/// Refuses regions a restore is filling or failed to fill.
fn check_whole(regions: &[Arc<Region>]) -> Result<(), SnapshotError> {
    for r in regions {
        if let Some(why) = r.lifecycle.restore.get().refusal() {
            return Err(SnapshotError::NotWhole {
                region: r.guest_addr().0,
                why,
            });
        }
    }
    Ok(())
}

/// The regions as the manifest lists them, laid end to end in the memory file.
fn layout_of(regions: &[Arc<Region>]) -> Vec<ManifestRegion> {
    let mut file_offset = 0u64;
    regions
        .iter()
        .map(|r| {
            let l = ManifestRegion {
                guest_addr: r.guest_addr().0,
                size: r.size(),
                file_offset,
                page_size: r.page_size(),
                backing: r.backing().name(),
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
        || !(IMAGE_PAGE_BYTES..=MAX_SMALL_PAGE_BLOCK_BYTES).contains(&block_bytes)
    {
        return Err(SnapshotError::Layout(format!(
            "block size {block_bytes:#x}: must be a power of two from 4 KiB to \
             {MAX_SMALL_PAGE_BLOCK_BYTES:#x}"
        )));
    }
    let largest_page = regions.iter().map(|r| r.page_size()).max().unwrap_or(4096);
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
    target: &Target,
) -> Result<Base, SnapshotError> {
    let pdir = Dir::open(parent)?;
    pdir.lock(true, true)
        .map_err(|source| SnapshotError::File {
            op: "lock",
            path: parent.to_path_buf(),
            source,
        })?;
    let p = read_manifest(&pdir)?;
    same_layout(&p.regions, layout, "the parent save", "this map")?;
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
            return Err(SnapshotError::Layout(format!(
                "region at {:#x}: its dirty pages count from save {}, not from the parent {} \
                 ({}); another save of this map since the parent took them",
                r.guest_addr().0,
                from.as_deref().unwrap_or("(none: never saved)"),
                p.id,
                parent.display()
            )));
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

/// Where a save is published: the directory it goes in, and its name there.
struct Target {
    parent: Dir,
    name: String,
    path: PathBuf,
}

impl Target {
    /// Refuses a target that exists as anything but an empty directory.
    fn new(dir: &Path) -> Result<Target, SnapshotError> {
        let (parent, name) = crate::files::split(dir)?;
        if let Ok(meta) = std::fs::symlink_metadata(dir) {
            let empty_dir =
                meta.is_dir() && std::fs::read_dir(dir).is_ok_and(|mut d| d.next().is_none());
            if !empty_dir {
                return Err(SnapshotError::Exists {
                    dir: dir.to_path_buf(),
                });
            }
        }
        Ok(Target {
            parent: Dir::open(&parent)?,
            name,
            path: dir.to_path_buf(),
        })
    }

    /// `parent` as the child published here should name it: `../NAME` when both sit in one
    /// directory, else its absolute path.
    fn name_parent(&self, parent: &Path) -> PathBuf {
        let (Ok(here), Ok(p)) = (self.parent.path().canonicalize(), parent.canonicalize()) else {
            return parent.to_path_buf();
        };
        match (p.parent(), p.file_name()) {
            (Some(pp), Some(name)) if pp == here => Path::new("..").join(name),
            _ => p,
        }
    }
}

/// A save in the making: a directory beside its target, named `.NAME.guestmem-save-*` and
/// locked (`flock`) while its save runs, removed unless published.
struct Staging {
    /// The directory it was made in.
    parent: Dir,
    dir: Dir,
    name: String,
    published: bool,
}

/// How old an unlocked staging directory must be before a later save removes it as the
/// remains of a save that died (so one just made, not yet locked, is never taken).
const STALE_STAGING_SECS: u64 = 60;

impl Staging {
    fn prefix(target: &Target) -> String {
        format!(".{}.guestmem-save-", target.name)
    }

    fn create(target: &Target) -> Result<Staging, SnapshotError> {
        Staging::sweep(target);
        let name = format!(
            "{}{}",
            Staging::prefix(target),
            crate::files::unique_suffix()
        );
        let path = target.parent.join(&name);
        let ferr = |op| {
            let path = path.clone();
            move |source| SnapshotError::File { op, path, source }
        };
        target.parent.mkdir(&name).map_err(ferr("create"))?;
        let opened = target.parent.open_child(&name).and_then(|d| {
            d.check_private()
                .map_err(|source| crate::files::FileError {
                    op: "check",
                    path: path.clone(),
                    source,
                })?;
            Ok(d)
        });
        let dir = match opened {
            Ok(d) => d,
            Err(e) => {
                let _ = target.parent.rmdir(&name);
                return Err(e.into());
            }
        };
        let mut staging = Staging {
            parent: target.parent.try_clone().map_err(ferr("open"))?,
            dir,
            name,
            published: false,
        };
        if let Err(e) = staging.dir.lock(true, true) {
            staging.remove();
            return Err(ferr("lock")(e));
        }
        Ok(staging)
    }

    /// Removes what saves that died left beside `target`: staging directories nobody holds
    /// the lock of, older than [`STALE_STAGING_SECS`]. Best effort.
    fn sweep(target: &Target) {
        let prefix = Staging::prefix(target);
        let Ok(entries) = std::fs::read_dir(target.parent.path()) else {
            return;
        };
        for e in entries.flatten() {
            let Some(name) = e.file_name().to_str().map(str::to_string) else {
                continue;
            };
            // Only real directories: an entry is never followed through a symlink (a link
            // named like a staging directory must not make this sweep delete elsewhere).
            if !e.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let old = e
                .metadata()
                .ok()
                .and_then(|m| m.modified().ok())
                .is_some_and(|t| t.elapsed().is_ok_and(|a| a.as_secs() >= STALE_STAGING_SECS));
            if !name.starts_with(&prefix) || !old {
                continue;
            }
            let Ok(dir) = target.parent.open_child(&name) else {
                continue;
            };
            // Locked, and the name still names it: its save died. (A save that published
            // it since has renamed it away; one that still runs holds the lock.)
            if dir.lock(true, false).unwrap_or(false) && target.parent.names(&name, &dir) {
                let Ok(parent) = target.parent.try_clone() else {
                    continue;
                };
                Staging {
                    parent,
                    dir,
                    name,
                    published: false,
                }
                .remove();
            }
        }
    }

    /// Moves the staging directory to the target in one rename that never replaces a
    /// snapshot, then syncs the directory holding both.
    fn publish(mut self, target: &Target) -> Result<(), SnapshotError> {
        self.dir.sync()?;
        let exists = || SnapshotError::Exists {
            dir: target.path.clone(),
        };
        // An empty directory at the target is taken as a place to save into: removed just
        // before the rename. If another save publishes there in between, one rename loses.
        match target.parent.rmdir(&target.name) {
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOTEMPTY) => return Err(exists()),
            Err(e) if e.raw_os_error() == Some(libc::ENOTDIR) => return Err(exists()),
            Err(source) => {
                return Err(SnapshotError::File {
                    op: "replace the empty directory",
                    path: target.path.clone(),
                    source,
                })
            }
        }
        match target.parent.rename(&self.name, &target.name, false) {
            Ok(()) => {}
            Err(e)
                if matches!(
                    e.source.raw_os_error(),
                    Some(libc::EEXIST | libc::ENOTEMPTY)
                ) =>
            {
                return Err(exists())
            }
            Err(e) => return Err(e.into()),
        }
        self.published = true;
        target.parent.sync()?;
        Ok(())
    }

    fn remove(&mut self) {
        self.dir.unlink(MEMORY_FILE);
        self.dir.unlink(MANIFEST_FILE);
        let _ = self.parent.rmdir(&self.name);
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.published {
            self.remove();
        }
    }
}

/// The dirty 4 KiB pages of `offset..offset+len` of a region, as block-relative words.
fn dirty_pages(words: &[u64], offset: u64, len: u64, block_bytes: u64) -> Vec<u64> {
    let first = offset / IMAGE_PAGE_BYTES;
    let n = len.div_ceil(IMAGE_PAGE_BYTES);
    // Every block's page list has the whole block's length, a region's short last block too.
    let mut out = vec![0u64; (block_bytes / IMAGE_PAGE_BYTES).div_ceil(64) as usize];
    for i in 0..n {
        let p = first + i;
        if words
            .get((p / 64) as usize)
            .is_some_and(|w| w >> (p % 64) & 1 != 0)
        {
            out[(i / 64) as usize] |= 1 << (i % 64);
        }
    }
    out
}

/// Which 4 KiB pages of the block may hold data (others read as zero without being read).
fn maybe_data(at: &BlockAt<'_>, proc: &ProcMem) -> std::io::Result<Vec<bool>> {
    let r = at.region;
    let (off, len) = (at.offset as usize, at.len as usize);
    match r.backing() {
        // Private memory: a page never faulted in (present or swapped) reads as zero.
        Backing::Anonymous => proc.faulted_in(r.mapping(), off, len),
        // A memfd holds what its page cache (or swap) holds, whoever wrote it.
        Backing::Memfd => {
            let fo = r.file_offset().expect("a memfd region has its file");
            let start = fo.start() + at.offset;
            let ranges = crate::sys::data_ranges(
                std::os::fd::AsFd::as_fd(fo.file()),
                start,
                start + at.len,
            )?;
            let mut v = vec![false; len / IMAGE_PAGE_BYTES as usize];
            for (s, e) in ranges {
                let (a, b) = (
                    (s - start) / IMAGE_PAGE_BYTES,
                    (e - start).div_ceil(IMAGE_PAGE_BYTES),
                );
                for x in &mut v[a as usize..(b as usize).min(len / 4096)] {
                    *x = true;
                }
            }
            Ok(v)
        }
        // Hugetlb: a page may be in the file without being mapped here (another process's
        // mapping, a vhost-user backend): read them all (the zero check keeps holes).
        Backing::Hugetlb(_) => Ok(vec![true; len / IMAGE_PAGE_BYTES as usize]),
        // A file's pages are the file's: read them all.
        Backing::File { .. } | Backing::FilePrivate { .. } => Ok(vec![true; len / 4096]),
    }
}

/// Saves one block: hashes it as the file will hold it, writes its non-zero pages. Returns
/// its record and the bytes written, or `None` when the save holds nothing of it.
fn save_block(
    at: &BlockAt<'_>,
    index: u64,
    dirty: Option<Vec<u64>>,
    proc: &ProcMem,
    file: &File,
    path: &Path,
) -> Result<Option<(BlockRecord, u64)>, SnapshotError> {
    let r = at.region;
    let page = IMAGE_PAGE_BYTES as usize;
    let n = at.len as usize / page;
    let guest_addr = r.guest_addr().0 + at.offset;
    let wanted: Vec<bool> = match &dirty {
        Some(words) => (0..n).map(|i| words[i / 64] >> (i % 64) & 1 != 0).collect(),
        None => vec![true; n],
    };
    if !wanted.iter().any(|&w| w) {
        return Ok(None);
    }
    let there = maybe_data(at, proc).map_err(|source| SnapshotError::Memory {
        region: r.guest_addr().0,
        guest_addr,
        op: "read page state",
        source,
    })?;
    let (nonzero, checksum) = hash_pages(at, &wanted, &there);
    if dirty.is_none() && !nonzero.iter().any(|&z| z) {
        // A full save leaves an all-zero block out: no record reads as zero.
        return Ok(None);
    }
    let bytes = write_runs(at, &nonzero, file, path)?;
    let pages = match dirty {
        Some(words) if wanted.iter().any(|&w| !w) => Some(words),
        _ => None,
    };
    Ok(Some((
        BlockRecord {
            index,
            checksum: format!("{checksum:016x}"),
            pages,
        },
        bytes,
    )))
}

/// Hashes a block as the file will hold it (pages not wanted, or holding no data, as
/// zeros); which of its pages are non-zero, and the checksum.
fn hash_pages(at: &BlockAt<'_>, wanted: &[bool], there: &[bool]) -> (Vec<bool>, u64) {
    let page = IMAGE_PAGE_BYTES as usize;
    let base = at.region.host_addr() as usize + at.offset as usize;
    let mut h = BlockHasher::default();
    let nonzero = (0..wanted.len())
        .map(|i| {
            if wanted[i] && there[i] {
                // SAFETY: the page lies in the region's mapping (the block is inside the
                // region), which the region keeps mapped; hashing reads it with volatile
                // loads.
                unsafe { h.update_volatile((base + i * page) as *const u8, page) }
            } else {
                h.update_zeros(page);
                false
            }
        })
        .collect();
    (nonzero, h.finish())
}

/// Writes each run of non-zero pages of a block to its place in the file; the bytes written.
fn write_runs(
    at: &BlockAt<'_>,
    nonzero: &[bool],
    file: &File,
    path: &Path,
) -> Result<u64, SnapshotError> {
    let page = IMAGE_PAGE_BYTES as usize;
    let base = at.region.host_addr() as usize + at.offset as usize;
    let n = nonzero.len();
    let mut bytes = 0u64;
    let mut i = 0;
    while i < n {
        if !nonzero[i] {
            i += 1;
            continue;
        }
        let run_start = i;
        while i < n && nonzero[i] {
            i += 1;
        }
        let (from, len) = (run_start * page, (i - run_start) * page);
        // SAFETY: base+from..base+from+len lies in the region's mapping (the block is inside
        // the region), which the region keeps mapped.
        unsafe { pwrite_all(at, file, path, base + from, len, from) }?;
        bytes += len as u64;
    }
    Ok(bytes)
}

/// Writes `len` bytes of guest memory at host address `src` to the file, at the block's
/// file offset plus `from`.
///
/// # Safety
/// `src..src + len` must be mapped, readable memory for the whole call.
unsafe fn pwrite_all(
    at: &BlockAt<'_>,
    file: &File,
    path: &Path,
    src: usize,
    len: usize,
    from: usize,
) -> Result<(), SnapshotError> {
    let mut done = 0usize;
    while done < len {
        let off = at.file_offset + (from + done) as u64;
        // SAFETY: src+done..src+len is readable (the caller's contract); the kernel reads it
        // into the file (no Rust reference to guest memory is made).
        let ret = unsafe {
            libc::pwrite(
                file.as_raw_fd(),
                (src + done) as *const libc::c_void,
                len - done,
                off as libc::off_t,
            )
        };
        if ret <= 0 {
            let source = if ret == 0 {
                std::io::Error::from(std::io::ErrorKind::WriteZero)
            } else {
                std::io::Error::last_os_error()
            };
            if source.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            let region = at.region.guest_addr().0;
            return Err(SnapshotError::Io {
                region,
                guest_addr: region + at.offset + (from + done) as u64,
                op: "write",
                path: path.to_path_buf(),
                offset: off,
                source,
            });
        }
        done += ret as usize;
    }
    Ok(())
}

/// Writes `working_set` into the manifest in `dir` (a new file renamed over the old).
pub(crate) fn record_working_set(dir: &Path, working_set: &[u64]) -> Result<(), SnapshotError> {
    let mut m = read_manifest(&Dir::open(dir)?)?;
    m.working_set = working_set.to_vec();
    let text = serde_json::to_vec_pretty(&m).expect("a manifest serialises");
    crate::files::publish_file(&dir.join(MANIFEST_FILE), &text)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dirty_pages_cut_a_block_out_of_the_region_bitmap_at_full_block_length() {
        // Region pages 0..256 (1 MiB); dirty: 3, 64, 200, 255.
        let mut words = vec![0u64; 4];
        for p in [3u64, 64, 200, 255] {
            words[(p / 64) as usize] |= 1 << (p % 64);
        }
        // The block at 256 KiB (pages 64..128): only page 64, as the block's page 0.
        let b = dirty_pages(&words, 256 << 10, 256 << 10, 256 << 10);
        assert_eq!(b, [1]);
        // A short last block (pages 192..256 of a 512 KiB block) has the whole block's
        // length: pages 200 and 255 at 8 and 63.
        let b = dirty_pages(&words, 768 << 10, 256 << 10, 512 << 10);
        assert_eq!(b.len(), 2);
        assert_eq!(b[0], (1 << 8) | (1 << 63));
        // Past the bitmap: nothing.
        assert_eq!(dirty_pages(&words, 2 << 20, 4096, 4096), [0]);
    }
}
