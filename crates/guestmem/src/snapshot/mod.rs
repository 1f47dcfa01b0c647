//! Snapshots of guest memory: [`save`] writes a map's memory to a directory, [`Image`] opens
//! one (with the chain of incremental saves under it), and [`crate::restore`] brings it
//! back.
//!
//! # On disk
//!
//! A snapshot directory holds two files:
//!
//! - `memory`: the raw guest memory of every region, in guest-address order, each region
//!   right after the one before (file offset = the sizes of the regions before it). This is
//!   the layout of Firecracker's memory file, so either can read the other's (Firecracker
//!   keeps the layout in its VM state file; guestmem in the manifest). The file is sparse:
//!   pages that are zero, or were never touched, are holes, found through
//!   `/proc/self/pagemap` for private memory (pages never faulted in are not read at all),
//!   `SEEK_DATA` for memfds (their page cache, however written) and `mincore` for hugetlb,
//!   then a zero check of each page that is there.
//! - `manifest.json` ([`Manifest`]): the layout, the block size, a checksum for each block
//!   that holds data, the working set recorded by a lazy restore, the parent of an
//!   incremental save, and the caller's notes. It is written last, through a rename: a
//!   directory without one holds no snapshot.
//!
//! Memory is cut into blocks of [`Manifest::block_bytes`] (1 MiB by default, at least the
//! largest page size), each inside one region. A block is the unit of everything after:
//! one checksum, one job-splitter step when saving, one `UFFDIO_COPY` or `UFFDIO_CONTINUE`
//! when restoring lazily (so a fault brings in its whole block, and no block is copied
//! twice).
//!
//! # Incremental saves
//!
//! [`SaveKind::Incremental`] writes only the pages dirtied since the last save: the regions'
//! dirty bitmaps ([`crate::DirtyTracking::On`]), which hold the device's writes and, once
//! [`crate::kvm::Memslots::harvest`] has run, KVM's log. Its memory file has the same
//! full-size, sparse layout (as a Firecracker diff snapshot); each block it holds lists its
//! pages. Saving clears the bits it saved, so each save starts the next one's set. A restore
//! applies the chain from the full save up.

mod blocks;
mod hash;
mod image;
pub(crate) mod manifest;
mod save;
mod store;

use std::collections::BTreeMap;
use std::io;
use std::path::PathBuf;

pub(crate) use image::Ahead;
pub(crate) use image::RawRegion;
#[cfg(feature = "store")]
pub(crate) use image::RemoteMemory;
pub use image::{Image, ImageRegion, MAX_CHAIN};
pub use manifest::{MAX_BLOCKS, MAX_MANIFEST_BYTES};
pub use save::{save, SaveConfig, SaveKind, SaveReport};

pub(crate) use hash::BlockHasher;

/// The manifest's file name in a snapshot directory.
pub const MANIFEST_FILE: &str = "manifest.json";
/// The memory file's name in a snapshot directory.
pub const MEMORY_FILE: &str = "memory";
/// [`Manifest::format`].
pub const FORMAT: &str = "guestmem-snapshot";
/// [`Manifest::version`] this build writes and reads.
pub const VERSION: u32 = 1;
// Block sizes, in one place for every user (saves, restores, the page server), each named
// by what it bounds.
/// Default block: the unit a save writes and checksums, and the unit a lazy restore or the
/// page server brings in per fault.
pub const DEFAULT_BLOCK_BYTES: u64 = 1 << 20;
/// Largest block made of pages smaller than itself: each thread of a lazy restore or of the
/// page server stages one block whole, so this bounds what a manifest or a setting can make
/// each thread allocate.
pub const MAX_STAGED_BLOCK_BYTES: u64 = 64 << 20;
/// Largest block of all: one page of the largest size (1 GiB hugetlb); a block is never
/// smaller than its region's page.
pub const MAX_PAGE_BLOCK_BYTES: u64 = 1 << 30;
/// The unit of sparseness and of incremental saves: KVM's dirty-log page.
pub const IMAGE_PAGE_BYTES: u64 = 4096;

/// What `manifest.json` holds.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Always [`FORMAT`].
    pub format: String,
    /// [`VERSION`].
    pub version: u32,
    /// This save's id (hex), which an incremental save on top of it names.
    pub id: String,
    /// The save this one holds the changes since, for an incremental save.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<ParentRef>,
    /// The memory file's name, in the same directory.
    pub memory_file: String,
    /// Bytes of the memory file: the sum of the regions' sizes.
    pub memory_bytes: u64,
    /// Block size in bytes.
    pub block_bytes: u64,
    /// The regions, in guest-address order.
    pub regions: Vec<ManifestRegion>,
    /// The blocks this save holds, by global index (regions' blocks numbered in order).
    pub blocks: Vec<BlockRecord>,
    /// Blocks in the order a lazy restore's guest first faulted them (recorded), for the next
    /// restore to prefetch first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub working_set: Vec<u64>,
    /// The caller's notes (a VMM's run parameters, say).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub meta: BTreeMap<String, String>,
}

/// An incremental save's parent.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParentRef {
    /// The parent's directory: relative to this one when they share a directory, else
    /// absolute.
    pub dir: PathBuf,
    /// The parent's [`Manifest::id`].
    pub id: String,
}

/// One region of a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ManifestRegion {
    /// Guest address of the first byte.
    pub guest_addr: u64,
    /// Bytes.
    pub size: u64,
    /// Offset of its first byte in the memory file.
    pub file_offset: u64,
    /// The page size its memory had (a restore keeps it unless told otherwise).
    pub page_size: u64,
    /// Its backing when saved, as [`crate::Backing::name`].
    pub backing: String,
    /// Bytes of it that transparent huge pages mapped when saved (smaps `AnonHugePages`;
    /// 0 for other backings, and in manifests written before guestmem recorded it). A
    /// restore collapses a region that had any back to huge pages (see
    /// [`crate::restore::RegainHuge`]).
    #[serde(default)]
    pub huge_bytes: u64,
}

/// One block a save holds.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlockRecord {
    /// Global block index.
    pub index: u64,
    /// Checksum of the block's bytes as this save's memory file holds them (pages it does
    /// not hold read as zero), 16 hex digits.
    pub checksum: String,
    /// For an incremental save, the 4 KiB pages of the block it holds (bit `i` of word `j`
    /// is page `64 j + i`); absent when it holds them all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pages: Option<Vec<u64>>,
}

/// Why a save, an open or a restore failed. Each names the region (by its guest address),
/// the guest address, the file and offset, or the limit at fault.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// A file operation on the snapshot failed.
    #[error("{op} {}: {source}", path.display())]
    File {
        /// What was done (`create`, `open`, `write manifest`...).
        op: &'static str,
        /// The path.
        path: PathBuf,
        /// The errno.
        source: io::Error,
    },
    /// The target exists (and is not an empty directory): a save never overwrites.
    #[error("{} exists and is not an empty directory: a save never overwrites a snapshot or anything else; save to a new path", dir.display())]
    Exists {
        /// The directory.
        dir: PathBuf,
    },
    /// The manifest does not parse or does not hold together.
    #[error("manifest {}: {reason}", path.display())]
    Manifest {
        /// The manifest's path.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// Two layouts disagree at a region: the image's and the map's (or specs'), or an
    /// incremental save's parent's and its child's. `None` where one has no region there.
    #[error(
        "layout mismatch: region {index}: {a_name} has {}, {b_name} {}",
        show(a),
        show(b)
    )]
    Layout {
        /// The region's index.
        index: usize,
        /// What the first layout is (`the image`, `a parent`).
        a_name: &'static str,
        /// Its region there: (guest address, size).
        a: Option<(u64, u64)>,
        /// What the second layout is, as the message says it (`the map`, `the specs`, `its
        /// child has`).
        b_name: &'static str,
        /// Its region there.
        b: Option<(u64, u64)>,
    },
    /// There is nothing to save: the map holds no region.
    #[error("the map holds no region")]
    EmptyMap,
    /// A save's block size is out of range.
    #[error("block size {block_bytes:#x}: must be a power of two from 4 KiB to {max:#x}")]
    BlockSize {
        /// The size asked for.
        block_bytes: u64,
        /// The largest allowed.
        max: u64,
    },
    /// An incremental save's parent is not the save the region's dirty bits count from.
    #[error("region at {region:#x}: its dirty pages count from save {}, not from the parent {parent_id} ({}); another save of this map since the parent took them", counts_from.as_deref().unwrap_or("(none: never saved)"), parent.display())]
    NotFromParent {
        /// The region.
        region: u64,
        /// The save its dirty bits count from, if any.
        counts_from: Option<String>,
        /// The parent's id.
        parent_id: String,
        /// The parent's directory.
        parent: PathBuf,
    },
    /// A region's page size is not the one its memory had when saved.
    #[error(
        "region at {region:#x}: saved with pages of {saved:#x} bytes, but the map's region has \
         pages of {map:#x} bytes; restore into memory of the page size it was saved with"
    )]
    PageSizeDiffers {
        /// The region.
        region: u64,
        /// The page size the snapshot records.
        saved: u64,
        /// The map region's page size.
        map: u64,
    },
    /// A region's page size does not divide the image's block size.
    #[error("region at {region:#x}: page size {page_size:#x} does not divide the image's block size {block_bytes:#x}")]
    PageSize {
        /// The region.
        region: u64,
        /// Its page size.
        page_size: u64,
        /// The image's block size.
        block_bytes: u64,
    },
    /// A lazy restore cannot serve this backing.
    #[error("region at {region:#x}: a lazy restore serves anonymous, memfd and hugetlb memory, not {backing}")]
    LazyBacking {
        /// The region.
        region: u64,
        /// Its backing's name.
        backing: String,
    },
    /// `restore_into` was asked for a mapped restore, which maps memory of its own.
    #[error("a mapped restore maps its own memory: use restore::restore")]
    MappedInto,
    /// A working set names a block the image does not have.
    #[error("working set names block {block}, the image has {blocks}")]
    WorkingSet {
        /// The block named.
        block: u64,
        /// Blocks in the image.
        blocks: u64,
    },
    /// A page server's peer faulted outside every region its handshake declared.
    #[error(
        "the peer faulted at host address {addr:#x}, outside every region its handshake declared"
    )]
    PeerFaultOutside {
        /// The faulting host address in the peer.
        addr: u64,
    },
    /// The region's memory is not whole: a lazy restore is still filling it, or failed; or,
    /// to a restore, a populate runs on it.
    #[error("region at {region:#x}: {why}")]
    NotWhole {
        /// The region.
        region: u64,
        /// Why.
        why: &'static str,
    },
    /// An incremental save needs a region's dirty bitmap.
    #[error("region at {region:#x}: an incremental save needs dirty tracking (RegionSpec::with_dirty_tracking)")]
    NotTracked {
        /// The region.
        region: u64,
    },
    /// The memory file ends before a block the manifest says it holds.
    #[error("region at {region:#x}: guest {guest_addr:#x} is at offset {offset:#x} of {}, which is only {file_len:#x} bytes (truncated)", path.display())]
    Truncated {
        /// The region.
        region: u64,
        /// Guest address of the block.
        guest_addr: u64,
        /// The memory file.
        path: PathBuf,
        /// Offset read.
        offset: u64,
        /// The file's length.
        file_len: u64,
    },
    /// A block's bytes do not match its checksum.
    #[error("region at {region:#x}: guest {guest_addr:#x} (offset {offset:#x} of {}): checksum {found:016x}, manifest says {expected:016x}", path.display())]
    Checksum {
        /// The region.
        region: u64,
        /// Guest address of the block.
        guest_addr: u64,
        /// The memory file.
        path: PathBuf,
        /// Offset of the block.
        offset: u64,
        /// From the manifest.
        expected: u64,
        /// Computed.
        found: u64,
    },
    /// Reading or writing the memory file failed.
    #[error("region at {region:#x}: guest {guest_addr:#x}: {op} at offset {offset:#x} of {}: {source}", path.display())]
    Io {
        /// The region.
        region: u64,
        /// Guest address of the block.
        guest_addr: u64,
        /// `read` or `write`.
        op: &'static str,
        /// The memory file.
        path: PathBuf,
        /// Offset in the file.
        offset: u64,
        /// The errno.
        source: io::Error,
    },
    /// Memory read from elsewhere than a file of this host (object storage) could not be
    /// read: after the retries and the deadline its source allows.
    #[error(
        "region at {region:#x}: guest {guest_addr:#x} (offset {offset:#x} of {from}): {source}"
    )]
    Remote {
        /// The region.
        region: u64,
        /// Guest address of the block.
        guest_addr: u64,
        /// Offset in the memory it is read from.
        offset: u64,
        /// Where it is read from (a URL).
        from: String,
        /// Why.
        source: std::sync::Arc<dyn std::error::Error + Send + Sync>,
    },
    /// A syscall on guest memory failed.
    #[error("region at {region:#x}: guest {guest_addr:#x}: {op}: {source}")]
    Memory {
        /// The region.
        region: u64,
        /// Guest address.
        guest_addr: u64,
        /// The call.
        op: &'static str,
        /// The errno.
        source: io::Error,
    },
    /// Serving another process's memory (a page server) failed. Addresses are the peer's
    /// host addresses, not guest addresses: a Firecracker handshake names no guest address.
    #[error("peer region at host address {region:#x}: host address {host_addr:#x} (memory-file offset {file_offset:#x}): {what}")]
    Peer {
        /// Host address of the region in the peer.
        region: u64,
        /// Host address of the block in the peer.
        host_addr: u64,
        /// Offset of the block in the memory file.
        file_offset: u64,
        /// What failed and, for a userfaultfd errno, what it means here.
        what: String,
    },
    /// The map to restore into holds memory already.
    #[error("region at {region:#x} holds resident pages: restore needs fresh, unpopulated memory")]
    Populated {
        /// The region.
        region: u64,
    },
    /// userfaultfd is missing something a lazy restore needs.
    #[error("userfaultfd: {op}: {source}")]
    Userfaultfd {
        /// What was tried.
        op: String,
        /// The errno.
        source: io::Error,
    },
    /// Mapping the restored memory failed.
    #[error(transparent)]
    Map(#[from] crate::MapError),
    /// A lazy restore failed earlier and its first error was returned then (see
    /// `LazyRestore::failure` for its text).
    #[error("lazy restore stopped: its first error was returned earlier")]
    AlreadyReported,
    /// A lazy restore was finished already.
    #[error("lazy restore finished already")]
    FinishedAlready,
}

/// A layout's region as an error shows it.
fn show(r: &Option<(u64, u64)>) -> String {
    r.map_or("nothing".to_string(), |(addr, size)| {
        format!("{size:#x} bytes at {addr:#x}")
    })
}

impl From<crate::files::FileError> for SnapshotError {
    fn from(e: crate::files::FileError) -> Self {
        SnapshotError::File {
            op: e.op,
            path: e.path,
            source: e.source,
        }
    }
}

impl Manifest {
    /// Parses and checks a manifest's text as [`Image::open`] does (every field bounded and
    /// checked against the others; not against a memory file). For tools and fuzzers.
    pub fn from_json(text: &[u8]) -> Result<Manifest, SnapshotError> {
        manifest::parse_manifest(text, std::path::Path::new(MANIFEST_FILE))
    }

    /// Blocks of `region` (its size over the block size, rounded up; none for a manifest
    /// built by hand with a block size of 0, which no parsed manifest has).
    pub fn region_blocks(&self, region: &ManifestRegion) -> u64 {
        region
            .size
            .checked_div(self.block_bytes)
            .map_or(0, |whole| {
                whole + u64::from(!region.size.is_multiple_of(self.block_bytes))
            })
    }

    /// Blocks of all regions.
    pub fn total_blocks(&self) -> u64 {
        self.regions.iter().map(|r| self.region_blocks(r)).sum()
    }
}

/// A fresh id: the time, the process and a counter, mixed.
fn new_id() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut h = BlockHasher::default();
    let mut stripe = [0u8; 64];
    stripe[..8].copy_from_slice(&nanos.to_le_bytes());
    stripe[8..16].copy_from_slice(&u64::from(std::process::id()).to_le_bytes());
    stripe[16..24].copy_from_slice(&COUNTER.fetch_add(1, Ordering::Relaxed).to_le_bytes());
    h.update(&stripe);
    format!("{:016x}", h.finish())
}
