//! Writing a snapshot.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

use super::hash::BlockHasher;
use super::{
    new_id, BlockRecord, Manifest, ManifestRegion, ParentRef, SnapshotError, DEFAULT_BLOCK_BYTES,
    FORMAT, IMAGE_PAGE_BYTES, MANIFEST_FILE, MEMORY_FILE, VERSION,
};
use crate::jobs::{Job, JobRange};
use crate::layout::Backing;
use crate::map::Snapshot;
use crate::region::Region;
use crate::sys::ProcMem;

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
            threads: crate::populate::default_threads(),
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

/// Saves the memory of `snap` into `dir` (created if missing; it must not hold a snapshot).
///
/// The guest must be paused (vCPUs out of `KVM_RUN`, devices quiet) for the image to be
/// consistent; memory written during the save may be saved either way, and for an
/// incremental save, a page written after its dirty bit was read stays dirty for the next.
pub fn save(snap: &Snapshot, dir: &Path, cfg: &SaveConfig) -> Result<SaveReport, SnapshotError> {
    let t0 = Instant::now();
    let file_err = |op, path: &Path| {
        let path = path.to_path_buf();
        move |source| SnapshotError::File { op, path, source }
    };
    let regions = snap.regions();
    if regions.is_empty() {
        return Err(SnapshotError::Layout("the map holds no region".into()));
    }
    for r in regions {
        let why = match r
            .snap_state
            .restore
            .load(std::sync::atomic::Ordering::Acquire)
        {
            0 => continue,
            super::RESTORING => "a lazy restore is still filling it: finish it first",
            _ => "a lazy restore failed and part of it is lost",
        };
        return Err(SnapshotError::NotWhole {
            region: r.guest_addr().0,
            why,
        });
    }
    let largest_page = regions.iter().map(|r| r.page_size()).max().unwrap_or(4096);
    let mut layout = Vec::with_capacity(regions.len());
    let mut file_offset = 0u64;
    for r in regions {
        layout.push(ManifestRegion {
            guest_addr: r.guest_addr().0,
            size: r.size(),
            file_offset,
            page_size: r.page_size(),
            backing: r.backing().name(),
        });
        file_offset += r.size();
    }
    let (block_bytes, parent) = match &cfg.kind {
        SaveKind::Full => {
            if !cfg.block_bytes.is_power_of_two()
                || cfg.block_bytes < IMAGE_PAGE_BYTES
                || cfg.block_bytes > super::manifest::MAX_BLOCK_BYTES
            {
                return Err(SnapshotError::Layout(format!(
                    "block size {:#x}: must be a power of two from 4 KiB to 1 GiB",
                    cfg.block_bytes
                )));
            }
            (cfg.block_bytes.max(largest_page), None)
        }
        SaveKind::Incremental { parent } => {
            let p = super::image::read_manifest(&parent.join(MANIFEST_FILE))?;
            super::image::same_layout(&p.regions, &layout, "the parent save", "this map")?;
            for r in regions {
                if r.dirty_bitmap().is_none() {
                    return Err(SnapshotError::NotTracked {
                        region: r.guest_addr().0,
                    });
                }
            }
            // The dirty bitmaps must count from this parent, or pages written between the
            // parent and the save they count from would be missing.
            for r in regions {
                let from = r
                    .snap_state
                    .saved_as
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone();
                if from.as_deref() != Some(p.id.as_str()) {
                    return Err(SnapshotError::Layout(format!(
                        "region at {:#x}: its dirty pages count from save {}, not from the parent {} ({})",
                        r.guest_addr().0,
                        from.as_deref().unwrap_or("(none: never saved)"),
                        p.id,
                        parent.display()
                    )));
                }
            }
            (p.block_bytes, Some((parent.clone(), p.id)))
        }
    };

    std::fs::create_dir_all(dir).map_err(file_err("create", dir))?;
    let manifest_path = dir.join(MANIFEST_FILE);
    if manifest_path.exists() {
        return Err(SnapshotError::Exists {
            dir: dir.to_path_buf(),
        });
    }
    let mem_path = dir.join(MEMORY_FILE);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&mem_path)
        .map_err(file_err("create", &mem_path))?;
    file.set_len(file_offset)
        .map_err(file_err("size", &mem_path))?;

    // The dirty bits this save covers, taken (cleared) now, so a page written during the save
    // stays dirty for the next one; put back if the save fails.
    let dirty: Vec<Option<Vec<u64>>> = regions
        .iter()
        .map(|r| {
            r.dirty_bitmap().map(|b| {
                let mut w = Vec::new();
                b.take(&mut w);
                w
            })
        })
        .collect();
    let put_back = || {
        for (r, words) in regions.iter().zip(&dirty) {
            if let (Some(b), Some(w)) = (r.dirty_bitmap(), words) {
                let _ = b.merge_words(0, w);
            }
        }
    };
    let incremental = parent.is_some();

    let mut blocks_of = Vec::new();
    for (i, (r, l)) in regions.iter().zip(&layout).enumerate() {
        let n = r.size().div_ceil(block_bytes);
        for k in 0..n {
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
    let proc = ProcMem::open().map_err(file_err("open", Path::new("/proc/self/pagemap")))?;
    let records = Mutex::new(Vec::new());
    let written = std::sync::atomic::AtomicU64::new(0);
    let job = Job::over(vec![JobRange::new(0, total_blocks)])
        .expect("block count fits")
        .with_max_threads(cfg.threads);
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
                let pages = if incremental {
                    let words = dirty[ri].as_ref().expect("checked tracked");
                    Some(dirty_pages(words, offset, len, block_bytes))
                } else {
                    None
                };
                if let Some((rec, bytes)) = save_block(&at, b, pages, &proc, &file, &mem_path)? {
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
        .map_err(|f| f.error);
    let stats = match stats.and_then(|s| {
        file.sync_data().map_err(file_err("sync", &mem_path))?;
        Ok(s)
    }) {
        Ok(s) => s,
        Err(e) => {
            put_back();
            let _ = std::fs::remove_file(&mem_path);
            return Err(e);
        }
    };

    let mut blocks = records.into_inner().unwrap_or_else(|e| e.into_inner());
    blocks.sort_by_key(|r: &BlockRecord| r.index);
    let id = new_id();
    let manifest = Manifest {
        format: FORMAT.into(),
        version: VERSION,
        id: id.clone(),
        parent: parent.map(|(p, pid)| ParentRef {
            dir: relative_parent(dir, &p),
            id: pid,
        }),
        memory_file: MEMORY_FILE.into(),
        memory_bytes: file_offset,
        block_bytes,
        regions: layout,
        blocks,
        working_set: Vec::new(),
        meta: cfg.meta.clone(),
    };
    let n_blocks = manifest.blocks.len() as u64;
    if let Err(e) = write_manifest(dir, &manifest) {
        put_back();
        let _ = std::fs::remove_file(&mem_path);
        return Err(e);
    }
    // The dirty bitmaps count from this save now.
    for r in regions {
        *r.snap_state
            .saved_as
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(id.clone());
    }
    Ok(SaveReport {
        dir: dir.to_path_buf(),
        id,
        memory_bytes: file_offset,
        bytes_written: written.into_inner(),
        blocks: n_blocks,
        threads: stats.threads,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// Writes `manifest` into `dir` through a temporary file and a rename.
pub(crate) fn write_manifest(dir: &Path, manifest: &Manifest) -> Result<(), SnapshotError> {
    let path = dir.join(MANIFEST_FILE);
    let tmp = dir.join(format!("{MANIFEST_FILE}.tmp"));
    let err = |op, p: &Path| {
        let p = p.to_path_buf();
        move |source| SnapshotError::File {
            op,
            path: p,
            source,
        }
    };
    let text = serde_json::to_vec_pretty(manifest).expect("a manifest serialises");
    {
        use std::io::Write;
        let mut f = File::create(&tmp).map_err(err("create", &tmp))?;
        f.write_all(&text).map_err(err("write", &tmp))?;
        f.sync_all().map_err(err("sync", &tmp))?;
    }
    std::fs::rename(&tmp, &path).map_err(err("rename", &path))?;
    // The rename itself must reach the disk.
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(err("sync", dir))
}

/// `parent` as the child in `dir` should name it: relative when both sit in one directory.
fn relative_parent(dir: &Path, parent: &Path) -> PathBuf {
    let (Ok(d), Ok(p)) = (dir.canonicalize(), parent.canonicalize()) else {
        return parent.to_path_buf();
    };
    match (d.parent(), p.parent(), p.file_name()) {
        (Some(a), Some(b), Some(name)) if a == b => Path::new("..").join(name),
        _ => p,
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
    let base = r.host_addr() as usize + at.offset as usize;
    let mut h = BlockHasher::default();
    let mut nonzero = vec![false; n];
    for i in 0..n {
        if wanted[i] && there[i] {
            // SAFETY: the page lies in the region's mapping (the block is inside the region),
            // which `r` keeps mapped; hashing reads it with volatile loads.
            nonzero[i] = unsafe { h.update_volatile((base + i * page) as *const u8, page) };
        } else {
            h.update_zeros(page);
        }
    }
    if dirty.is_none() && !nonzero.iter().any(|&z| z) {
        // A full save leaves an all-zero block out: no record reads as zero.
        return Ok(None);
    }
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
        let len = (i - run_start) * page;
        let mut done = 0usize;
        while done < len {
            let off = at.file_offset + (run_start * page + done) as u64;
            let src = base + run_start * page + done;
            // SAFETY: src..src+len-done lies in the region's mapping, kept mapped by `r`;
            // the kernel reads it into the file (no Rust reference to guest memory is made).
            let ret = unsafe {
                libc::pwrite(
                    file.as_raw_fd(),
                    src as *const libc::c_void,
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
                return Err(SnapshotError::Io {
                    region: r.guest_addr().0,
                    guest_addr: r.guest_addr().0 + at.offset + (run_start * page + done) as u64,
                    op: "write",
                    path: path.to_path_buf(),
                    offset: off,
                    source,
                });
            }
            done += ret as usize;
        }
        bytes += len as u64;
    }
    let pages = match dirty {
        Some(words) if wanted.iter().any(|&w| !w) => Some(words),
        _ => None,
    };
    Ok(Some((
        BlockRecord {
            index,
            checksum: format!("{:016x}", h.finish()),
            pages,
        },
        bytes,
    )))
}

/// Writes `working_set` into the manifest in `dir` (through a rename).
pub(crate) fn record_working_set(dir: &Path, working_set: &[u64]) -> Result<(), SnapshotError> {
    let mut m = super::image::read_manifest(&dir.join(MANIFEST_FILE))?;
    m.working_set = working_set.to_vec();
    write_manifest(dir, &m)
}
