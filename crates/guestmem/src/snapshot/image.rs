//! Opening a snapshot (and the chain under an incremental one) and reading its blocks.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::manifest::{read_manifest, same_layout};
use super::{Manifest, SnapshotError, MANIFEST_FILE};
use crate::files::Dir;

mod plan;
mod read;
mod remote;
use crate::layout::{Backing, HugePageSize, RegionSpec};
use crate::GuestAddress;
pub(crate) use plan::{resolve_chain, Piece, Plan};
pub(crate) use remote::{Ahead, RemoteMemory};

/// Bytes read and hashed at a time (half a typical L2 cache).
const HASH_PIECE: u64 = 256 << 10;

/// How far past a block a raw image's copy asks the kernel to read ahead (see
/// [`Image::mapped_block`]).
const MAPPED_READ_AHEAD: u64 = 16 << 20;

/// Most saves one chain may hold.
pub const MAX_CHAIN: usize = 64;

/// One region of an image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageRegion {
    /// Guest address of the first byte.
    pub guest_addr: u64,
    /// Bytes.
    pub size: u64,
    /// Offset in the memory files.
    pub file_offset: u64,
    /// Page size when saved.
    pub page_size: u64,
    /// Backing when saved ([`Backing::name`]).
    pub backing: String,
    /// Bytes transparent huge pages mapped when the newest save of the chain was taken.
    pub huge_bytes: u64,
    /// Global index of its first block.
    pub first_block: u64,
}

/// One save of a chain.
#[derive(Debug)]
pub(crate) struct Layer {
    pub(crate) dir: PathBuf,
    pub(crate) path: PathBuf,
    pub(crate) file: File,
    pub(crate) manifest: Manifest,
}

#[derive(Debug)]
struct Inner {
    layers: Vec<Layer>,
    regions: Vec<ImageRegion>,
    block_bytes: u64,
    plan: Plan,
    total_blocks: u64,
    /// Whether blocks carry checksums to check (a raw memory file has none).
    checked: bool,
    /// A raw image's memory file mapped read-only, for the kernel to copy blocks from
    /// straight out of the page cache (never read by a CPU: see [`Mapping::file_source`]).
    source: Option<crate::mmap::Mapping>,
    /// Memory read from elsewhere (object storage), for an image of it.
    remote: Option<Arc<dyn RemoteMemory>>,
}

impl Layer {
    /// Opens the save in `at`, checked against `child`, the save above it (whose parent it
    /// must be: its id, layout and block size). The memory file is opened once: every later
    /// read (and a mapped restore's mapping) uses this descriptor, never the path again.
    fn open(at: &Path, child: Option<&Layer>) -> Result<Layer, SnapshotError> {
        let mpath = at.join(MANIFEST_FILE);
        let dir = Dir::open(at)?;
        let m = read_manifest(&dir)?;
        if let Some(child) = child {
            let bad = |reason: String| SnapshotError::Manifest {
                path: mpath.clone(),
                reason,
            };
            let want = child.manifest.parent.as_ref().map(|p| p.id.as_str());
            if want != Some(m.id.as_str()) {
                return Err(bad(format!(
                    "id {}, the save above names its parent {}",
                    m.id,
                    want.unwrap_or("(none)")
                )));
            }
            same_layout(
                &m.regions,
                &child.manifest.regions,
                "a parent",
                "its child has",
            )?;
            if m.block_bytes != child.manifest.block_bytes {
                return Err(bad("block size differs from its child's".into()));
            }
        }
        let (file, len) = dir.open_regular(&m.memory_file, u64::MAX)?;
        let path = dir.join(&m.memory_file);
        if len < m.memory_bytes {
            // Name the first region the file does not hold whole.
            let r = m
                .regions
                .iter()
                .find(|r| r.file_offset + r.size > len)
                .expect("some region ends past the file");
            return Err(SnapshotError::Truncated {
                region: r.guest_addr,
                guest_addr: r.guest_addr + len.saturating_sub(r.file_offset),
                path,
                offset: len.max(r.file_offset),
                file_len: len,
            });
        }
        Ok(Layer {
            dir: at.to_path_buf(),
            path,
            file,
            manifest: m,
        })
    }
}

/// The base save's regions with the global index of each one's first block (and the huge
/// pages each had when the newest save, `top`, was taken), and the blocks in all.
fn image_regions(base: &Manifest, top: &Manifest) -> (Vec<ImageRegion>, u64) {
    let mut first_block = 0;
    let regions = base
        .regions
        .iter()
        .zip(&top.regions)
        .map(|(r, t)| {
            let ir = ImageRegion {
                guest_addr: r.guest_addr,
                size: r.size,
                file_offset: r.file_offset,
                page_size: r.page_size,
                backing: r.backing.clone(),
                huge_bytes: t.huge_bytes,
                first_block,
            };
            first_block += r.size.div_ceil(base.block_bytes);
            ir
        })
        .collect();
    (regions, first_block)
}

/// An opened snapshot: its manifest checked, its memory file open, and for an incremental
/// save the chain of saves under it, each checked against the next (ids, layout, sizes).
/// Cheap to clone (shared).
#[derive(Debug, Clone)]
pub struct Image {
    inner: Arc<Inner>,
}

/// A region of a bare memory file ([`Image::raw`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RawRegion {
    /// The address errors name it by (a peer's host address).
    pub(crate) name: u64,
    /// Bytes.
    pub(crate) size: u64,
    /// Where it starts in the file.
    pub(crate) file_offset: u64,
    /// Its page size, bytes.
    pub(crate) page_size: u64,
}

impl Image {
    /// Opens the snapshot in `dir` and every save under it.
    pub fn open(dir: &Path) -> Result<Image, SnapshotError> {
        let mut layers: Vec<Layer> = Vec::new();
        let mut at = dir.to_path_buf();
        loop {
            if layers.len() == MAX_CHAIN {
                return Err(SnapshotError::Manifest {
                    path: at.join(MANIFEST_FILE),
                    reason: format!("chain longer than {MAX_CHAIN} saves"),
                });
            }
            let layer = Layer::open(&at, layers.last())?;
            let parent = layer.manifest.parent.clone();
            layers.push(layer);
            match parent {
                None => break,
                Some(p) if p.dir.is_absolute() => at = p.dir,
                Some(p) => at = at.join(p.dir),
            }
        }
        layers.reverse();
        let base = &layers[0].manifest;
        let block_bytes = base.block_bytes;
        let top = &layers[layers.len() - 1].manifest;
        let (regions, total_blocks) = image_regions(base, top);
        let plan = resolve_chain(layers.iter().map(|l| &l.manifest.blocks[..]));
        Ok(Image {
            inner: Arc::new(Inner {
                layers,
                regions,
                block_bytes,
                plan,
                total_blocks,
                checked: true,
                source: None,
                remote: None,
            }),
        })
    }

    /// A bare memory file, as Firecracker writes it, read as an image without a manifest:
    /// `regions` say where each region is in the file, blocks of `block_bytes` (a multiple
    /// of every page size) cut within each region; `file` is the
    /// memory file, opened and checked by the caller (`path` names it). Blocks the
    /// file holds no data for (`SEEK_DATA`) read as zero; nothing is checksummed. The caller
    /// has checked the file holds every region.
    pub(crate) fn raw(
        file: File,
        path: &Path,
        regions: &[RawRegion],
        block_bytes: u64,
    ) -> Result<Image, SnapshotError> {
        let mut iregions = Vec::with_capacity(regions.len());
        let mut mregions = Vec::with_capacity(regions.len());
        let mut plan = Plan::whole();
        let mut first_block = 0u64;
        for &RawRegion {
            name,
            size,
            file_offset,
            page_size,
        } in regions
        {
            let data = crate::sys::data_ranges(file.as_fd(), file_offset, file_offset + size)
                .map_err(|source| SnapshotError::File {
                    op: "find the data (SEEK_DATA) of",
                    path: path.to_path_buf(),
                    source,
                })?;
            let blocks = size.div_ceil(block_bytes);
            for (s, e) in data {
                let (s, e) = (s - file_offset, e - file_offset);
                for b in s / block_bytes..e.div_ceil(block_bytes).min(blocks) {
                    plan.hold(first_block + b);
                }
            }
            iregions.push(ImageRegion {
                guest_addr: name,
                size,
                file_offset,
                page_size,
                backing: "anonymous".into(),
                huge_bytes: 0,
                first_block,
            });
            first_block += blocks;
            mregions.push(super::ManifestRegion {
                guest_addr: name,
                size,
                file_offset,
                page_size,
                backing: "anonymous".into(),
                huge_bytes: 0,
            });
        }
        // The file's length now; the caller checked it holds every region. If it shrinks
        // later, the kernel's copies from past its end fail (EFAULT), never read zeros.
        let source = match file.metadata().map(|m| m.len()) {
            Ok(len) if len > 0 => usize::try_from(len).ok().and_then(|len| {
                // SAFETY: the mapping is only ever a UFFDIO_COPY source (mapped_block),
                // never read by a CPU.
                unsafe { crate::mmap::Mapping::file_source(file.as_fd(), len) }.ok()
            }),
            _ => None,
        };
        let manifest = Manifest {
            format: super::FORMAT.into(),
            version: super::VERSION,
            id: "raw".into(),
            parent: None,
            memory_file: path.display().to_string(),
            memory_bytes: regions.iter().map(|r| r.size).sum(),
            block_bytes,
            regions: mregions,
            blocks: Vec::new(),
            working_set: Vec::new(),
            meta: BTreeMap::new(),
        };
        Ok(Image {
            inner: Arc::new(Inner {
                layers: vec![Layer {
                    dir: path.parent().unwrap_or(Path::new(".")).to_path_buf(),
                    path: path.to_path_buf(),
                    file,
                    manifest,
                }],
                regions: iregions,
                block_bytes,
                plan,
                total_blocks: first_block,
                checked: false,
                source,
                remote: None,
            }),
        })
    }
}

impl Image {
    /// The regions, in guest-address order.
    pub fn regions(&self) -> &[ImageRegion] {
        &self.inner.regions
    }

    /// For a raw image (a Firecracker memory file), where `block`'s bytes lie in a read-only
    /// mapping of the file, for the kernel to copy from (one copy, page cache to guest,
    /// instead of a read into a buffer and a copy from it), once the kernel has been asked to
    /// read them ahead (`POSIX_FADV_WILLNEED`: a cold cache is read a block at a time, not a
    /// page per fault). `None` for a checked image, whose blocks must be read and hashed.
    pub(crate) fn mapped_block(&self, block: u64) -> Option<(*const u8, usize)> {
        let source = self.inner.source.as_ref()?;
        let (ri, offset, len) = self.block_span(block);
        let at = self.inner.regions[ri].file_offset + offset;
        if at + len > source.len() as u64 {
            return None;
        }
        let fd = self.inner.layers[0].file.as_raw_fd();
        let end = source.len() as u64;
        // The block itself, and as much again `MAPPED_READ_AHEAD` further on: a stream of
        // blocks (a prefetch in address order, a guest read ahead of) keeps the disk busy
        // with the next blocks while this one is copied, instead of one block's read at a
        // time. Measured here on a cold 512 MiB file read 1 MiB at a time through a mapping:
        // median 0.67 s with each block advised alone, 0.47 s with a 16 MiB window.
        for (from, bytes) in [(at, len), (at + MAPPED_READ_AHEAD, len)] {
            let bytes = bytes.min(end.saturating_sub(from));
            if bytes > 0 {
                // SAFETY: advice only; it reads nothing into this process.
                unsafe {
                    libc::posix_fadvise(
                        fd,
                        from as libc::off_t,
                        bytes as libc::off_t,
                        libc::POSIX_FADV_WILLNEED,
                    )
                };
            }
        }
        Some((
            source.as_ptr().wrapping_add(at as usize) as *const u8,
            len as usize,
        ))
    }

    /// Unmaps from this process the page-cache pages a copy out of [`Image::mapped_block`]
    /// mapped for `block` (the page cache keeps them): a server's own memory does not grow
    /// by every memory file it serves.
    pub(crate) fn release_mapped(&self, block: u64) {
        let Some(source) = self.inner.source.as_ref() else {
            return;
        };
        let (ri, offset, len) = self.block_span(block);
        let at = self.inner.regions[ri].file_offset + offset;
        if at + len <= source.len() as u64 {
            let _ = source.advise(at as usize, len as usize, crate::mmap::Advice::DontNeed);
        }
    }

    /// The host ranges `(start, len)` that hold saved data, each region `i` of the image at
    /// host address `hosts[i]`: the blocks some save holds, joined where they touch (blocks
    /// no save holds read as zero).
    pub(crate) fn data_spans(&self, hosts: &[u64]) -> Vec<(u64, u64)> {
        let mut spans: Vec<(u64, u64)> = Vec::new();
        for b in 0..self.total_blocks() {
            if !self.held_from(b, 0) {
                continue;
            }
            let (ri, offset, len) = self.block_span(b);
            let Some(&host) = hosts.get(ri) else { continue };
            let start = host + offset;
            match spans.last_mut() {
                Some((s, l)) if *s + *l == start => *l += len,
                _ => spans.push((start, len)),
            }
        }
        spans
    }

    /// Block size in bytes.
    pub fn block_bytes(&self) -> u64 {
        self.inner.block_bytes
    }

    /// The largest block of the image, bytes: the block size, or the largest region when
    /// every region is smaller (what one thread stages to restore a block).
    pub fn largest_block(&self) -> u64 {
        let largest_region = self.inner.regions.iter().map(|r| r.size).max().unwrap_or(0);
        self.inner.block_bytes.min(largest_region)
    }

    /// Blocks of all regions.
    pub fn total_blocks(&self) -> u64 {
        self.inner.total_blocks
    }

    /// Blocks that hold data (the rest are zero).
    pub fn data_blocks(&self) -> u64 {
        self.inner.plan.len()
    }

    /// Guest memory, bytes.
    pub fn memory_bytes(&self) -> u64 {
        self.inner.regions.iter().map(|r| r.size).sum()
    }

    /// Saves in the chain (1 for a full save).
    pub fn chain_len(&self) -> usize {
        self.inner.layers.len()
    }

    /// The top save's directory.
    pub fn dir(&self) -> &Path {
        &self.top().dir
    }

    /// The top save's memory file.
    pub fn memory_path(&self) -> &Path {
        &self.top().path
    }

    /// The top save's id.
    pub fn id(&self) -> &str {
        &self.top().manifest.id
    }

    /// The top save's notes.
    pub fn meta(&self) -> &BTreeMap<String, String> {
        &self.top().manifest.meta
    }

    /// The top save's recorded working set (global block indices, first fault first).
    pub fn working_set(&self) -> &[u64] {
        &self.top().manifest.working_set
    }

    /// Writes `working_set` (as [`crate::restore::LazyRestore::working_set`] returns it)
    /// into the top save's manifest, for the next restore to prefetch first.
    pub fn record_working_set(&self, working_set: &[u64]) -> Result<(), SnapshotError> {
        if let Some(w) = working_set.iter().find(|&&w| w >= self.total_blocks()) {
            return Err(SnapshotError::WorkingSet {
                block: *w,
                blocks: self.total_blocks(),
            });
        }
        super::save::record_working_set(self.dir(), working_set)
    }

    /// A path that opens the very file the top save's base layer was checked as (its
    /// descriptor under `/proc/self/fd`), for a mapped restore: a file renamed over the
    /// original since [`Image::open`] is not the one mapped. Valid while this image lives.
    pub(crate) fn base_file_path(&self) -> PathBuf {
        PathBuf::from(format!(
            "/proc/self/fd/{}",
            self.inner.layers[0].file.as_raw_fd()
        ))
    }

    /// Region specs for a map this image can be restored into: the saved layout and
    /// backings (a saved file backing becomes anonymous memory), with the defaults
    /// otherwise.
    pub fn specs(&self) -> Vec<RegionSpec> {
        self.inner
            .regions
            .iter()
            .map(|r| {
                let backing = match r.backing.as_str() {
                    "memfd" => Backing::Memfd,
                    "hugetlb-2M" => Backing::Hugetlb(HugePageSize::Size2M),
                    "hugetlb-1G" => Backing::Hugetlb(HugePageSize::Size1G),
                    _ => Backing::Anonymous,
                };
                RegionSpec::new(GuestAddress(r.guest_addr), r.size).with_backing(backing)
            })
            .collect()
    }

    fn top(&self) -> &Layer {
        self.inner.layers.last().expect("an image has a save")
    }

    /// The saves that hold `block`, oldest first; `None` when it reads as zero.
    pub(crate) fn plan(&self, block: u64) -> Option<&[Piece]> {
        self.inner.plan.get(block)
    }

    /// Whether a save at `layer` or above holds any of `block` (else it reads as zero, or as
    /// the saves below `layer` hold it).
    pub(crate) fn held_from(&self, block: u64, layer: usize) -> bool {
        self.plan(block)
            .is_some_and(|p| p.iter().any(|p| p.layer >= layer))
    }

    /// Region index, offset in the region and length of `block`.
    pub(crate) fn block_span(&self, block: u64) -> (usize, u64, u64) {
        let regions = &self.inner.regions;
        let i = regions.partition_point(|r| r.first_block <= block) - 1;
        let r = &regions[i];
        let offset = (block - r.first_block) * self.inner.block_bytes;
        (i, offset, (r.size - offset).min(self.inner.block_bytes))
    }
}
