//! Where a lazy restore's regions are: our own (a `Region`, with a page-cache alias for
//! shared backings) or the memory of a peer that sent its userfaultfd.

use std::os::fd::AsFd;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use crate::layout::Reserve;
use crate::mmap::{MapSource, Mapping, Reservation};
use crate::region::Region;
use crate::snapshot::SnapshotError;
use crate::uffd::{Registered, RemoteRange};

/// Where a region's memory is.
pub(super) enum Place {
    /// Our own region.
    Own {
        region: Arc<Region>,
        /// A second, unregistered mapping of a memfd or hugetlb region's file, through which
        /// its page cache is filled.
        alias: Option<Mapping>,
    },
    /// Private anonymous memory of the process that sent its userfaultfd (a page server).
    Remote(RemoteRange),
}

pub(super) struct LRegion {
    pub(super) place: Place,
    pub(super) first_block: u64,
    pub(super) host: u64,
    pub(super) size: u64,
    pub(super) page: u64,
    /// The address errors name the region by: its guest address, or for a remote region
    /// its host address in the peer.
    pub(super) name: u64,
    /// Pages of a remote region its owner removed (`UFFD_EVENT_REMOVE`), a bit per page:
    /// they read as zero from then on. Empty for our own regions.
    pub(super) removed: Box<[AtomicU64]>,
    /// Where its words of `removed` start in the restore's removed-pages file (the words of
    /// the regions before it come first).
    pub(super) removed_at: usize,
}

impl LRegion {
    pub(super) fn own(region: Arc<Region>, alias: Option<Mapping>, first_block: u64) -> LRegion {
        LRegion {
            first_block,
            host: region.host_addr() as u64,
            size: region.size(),
            page: region.page_size(),
            name: region.guest_addr().0,
            removed: Box::new([]),
            removed_at: 0,
            place: Place::Own { region, alias },
        }
    }

    /// A region of the peer's memory, `host..host + size`, pages of `page` bytes.
    pub(super) fn remote(host: u64, size: u64, page: u64, first_block: u64) -> LRegion {
        let words = (size / page).div_ceil(64) as usize;
        LRegion {
            first_block,
            host,
            size,
            page,
            name: host,
            removed: (0..words).map(|_| AtomicU64::new(0)).collect(),
            removed_at: 0,
            place: Place::Remote(RemoteRange::new(host, size)),
        }
    }

    /// What the uffd calls name.
    pub(super) fn target(&self) -> &dyn Registered {
        match &self.place {
            Place::Own { region, .. } => region.mapping(),
            Place::Remote(r) => r,
        }
    }

    pub(super) fn alias(&self) -> Option<&Mapping> {
        match &self.place {
            Place::Own { alias, .. } => alias.as_ref(),
            Place::Remote(_) => None,
        }
    }

    pub(super) fn region(&self) -> Option<&Arc<Region>> {
        match &self.place {
            Place::Own { region, .. } => Some(region),
            Place::Remote(_) => None,
        }
    }
}

/// A second mapping of `region`'s file, aligned to its page size, not registered.
pub(super) fn alias(region: &Region) -> Result<Mapping, SnapshotError> {
    let fo = region
        .file_offset()
        .expect("memfd and hugetlb regions have a file");
    let err = |e: crate::mmap::MmapError| SnapshotError::Memory {
        region: region.guest_addr().0,
        guest_addr: region.guest_addr().0,
        op: "map the page-cache alias",
        source: e.into_io(),
    };
    let size = region.size() as usize;
    let align = region.page_size() as usize;
    let res = Reservation::new(size + align).map_err(err)?;
    let head = res.addr().next_multiple_of(align) - res.addr();
    let res = res.trim(head, size).map_err(err)?;
    let source = MapSource::SharedFile {
        fd: fo.file().as_fd(),
        offset: fo.start(),
    };
    // SAFETY: the file is the region's own memfd (guestmem's memfds are sealed against
    // shrinking and growing at map time) and holds `start..start + size`, the region; it
    // reads and writes as memory.
    unsafe { res.place_file(0, size, source, Reserve::Reserve) }.map_err(err)
}
