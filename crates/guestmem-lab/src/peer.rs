//! What the peers share: mappings they own through guestmem's owned types (unmapped on drop),
//! the way they fault a range in (one thread per part, `MADV_POPULATE_WRITE`, on
//! [`guestmem::workers::Crew`]), and their errors. Each peer's own policy (how it maps, how
//! many threads, where it cuts, when it advises THP) lives in its module:
//! [`crate::peer_qemu`], [`crate::peer_ch`].

use std::io;

use guestmem::inspect::HostRange;
use guestmem::layout::THP_BYTES;
use guestmem::mmap::{Advice, Mapping, MmapError, Reservation};
use guestmem::workers::{Crew, Start};

/// Why a peer could not bring its memory up.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    /// A call on a mapping failed.
    #[error("{peer}: {source}")]
    Mmap {
        /// The peer.
        peer: &'static str,
        /// What failed, with the call, range and errno.
        #[source]
        source: MmapError,
    },
    /// A populate thread could not be created.
    #[error("{peer}: creating a populate thread: {source}")]
    Spawn {
        /// The peer.
        peer: &'static str,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// A size that does not fit the address space.
    #[error("{peer}: size {size:#x} does not fit the address space")]
    Size {
        /// The peer.
        peer: &'static str,
        /// The size.
        size: u64,
    },
}

/// The error of `peer` for a failed mapping call.
pub(crate) fn mmap_err(peer: &'static str) -> impl Fn(MmapError) -> PeerError {
    move |source| PeerError::Mmap { peer, source }
}

/// Gives `advice` on the whole of `m`, an error naming `peer`.
pub fn advise(peer: &'static str, m: &Mapping, advice: Advice) -> Result<(), PeerError> {
    m.advise(0, m.len(), advice).map_err(mmap_err(peer))
}

/// Whether the mapping starts on a 2 MiB (THP) boundary.
pub fn is_thp_aligned(m: &Mapping) -> bool {
    (m.as_ptr() as u64).is_multiple_of(THP_BYTES)
}

/// The mapping's body, for [`guestmem::inspect::inspect_host_ranges`].
pub fn host_range(m: &Mapping) -> HostRange {
    HostRange {
        start: m.as_ptr() as u64,
        len: m.len() as u64,
        huge_align: THP_BYTES,
    }
}

/// Faults in each `(offset, len)` part of `mapping` with `MADV_POPULATE_WRITE`, one new
/// thread per part, started as `start` says; the calling thread only waits, as both peers'
/// callers do.
pub(crate) fn populate_parts(
    peer: &'static str,
    mapping: &Mapping,
    parts: &[(usize, usize)],
    start: Start,
) -> Result<(), PeerError> {
    let crew = Crew::new(peer).with_start(start);
    let results = crew
        .run(parts.len(), |i| {
            let (offset, len) = parts[i];
            mapping.advise(offset, len, Advice::PopulateWrite)
        })
        .map_err(|source| PeerError::Spawn { peer, source })?;
    results
        .into_iter()
        .try_for_each(|r| r.map_err(mmap_err(peer)))
}

/// Converts a region size to `usize`.
pub(crate) fn len_of(peer: &'static str, size: u64) -> Result<usize, PeerError> {
    usize::try_from(size).map_err(|_| PeerError::Size { peer, size })
}

/// What a peer brought up: its mappings (kept until dropped) and how.
#[derive(Debug)]
pub struct PeerRun {
    /// One mapping per region, in layout order.
    pub mappings: Vec<Mapping>,
    /// Populate threads per region.
    pub threads: Vec<usize>,
}

/// A read-write private anonymous mapping of `mapped` bytes, placed `past_thp` bytes after a
/// 2 MiB boundary inside a `PROT_NONE` reservation of at least `len` bytes beyond that point,
/// which stays around it: the reservation's `PROT_NONE` pages keep the kernel from merging it
/// with any other mapping, so smaps shows its VMAs alone. With `mapped < len`, the
/// `len - mapped` bytes after the mapping stay `PROT_NONE` inside the would-be region: a
/// guard page inside it, as QEMU's TCG placed one. All of it is unmapped on drop.
pub fn placed(
    peer: &'static str,
    len: usize,
    mapped: usize,
    past_thp: usize,
) -> Result<Mapping, PeerError> {
    let thp = THP_BYTES as usize;
    let page = guestmem::base_page_size() as usize;
    let size_err = || PeerError::Size {
        peer,
        size: len as u64,
    };
    if past_thp >= thp || !past_thp.is_multiple_of(page) || mapped > len {
        return Err(size_err());
    }
    // One page below for a neighbour, up to 2 MiB to reach a boundary, `past_thp`, the
    // region, and at least one page above it.
    let res_len = len
        .checked_add(past_thp)
        .and_then(|n| n.checked_add(2 * thp))
        .ok_or_else(size_err)?;
    let res = Reservation::new(res_len).map_err(mmap_err(peer))?;
    let boundary = (res.addr() + page).next_multiple_of(thp);
    let offset = boundary - res.addr() + past_thp;
    res.place(offset, mapped).map_err(mmap_err(peer))
}
