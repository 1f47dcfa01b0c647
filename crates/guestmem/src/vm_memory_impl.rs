//! rust-vmm `vm-memory` compatibility: guestmem's map works wherever `GuestMemory` and
//! `Bytes<GuestAddress>` are expected (virtio-queue, vhost-user backends, linux-loader), and
//! keeps two promises vm-memory's own types cannot.
//!
//! Design choice, after vm-memory's `IommuMemory`: what device code gets, [`MapView`] (what
//! [`GuestMap`]'s `GuestAddressSpace::memory` returns) and [`Translator`], implements
//! vm-memory's `GuestMemory` directly, not `GuestMemoryBackend`, because only `GuestMemory`
//! sees the access mode (`Permissions`) of every access, and every `Bytes` method goes
//! through it. So:
//! - **Read-only regions stay read-only.** An access asking for `Permissions::Write` that
//!   touches a read-only region is refused before any byte moves, with an error naming the
//!   address and the region. vm-memory's `Bytes` over a `GuestMemoryBackend` ignores the
//!   access mode, which would let any virtio device model write guest ROM.
//! - **Writes are dirty-tracked.** A region with [`crate::layout::DirtyTracking::On`] has a
//!   word-level [`DirtyBitmap`], implemented as vm-memory's `Bitmap`, and every slice of it
//!   marks the pages written through it; a region without one costs an `Option` check.
//!
//! Everything else is vm-memory's own behaviour: an access that stays in one region is served
//! by one slice (found by binary search, or through the translator's cache), and anything
//! else is handed to vm-memory's own `GuestMemoryBackend::get_slices` over the view's
//! [`RegionTable`], so holes, region edges and partial accesses behave exactly as over
//! `GuestMemoryMmap`. `physical_memory()` returns `None`, so nothing reaches the table
//! through the device view; host code that means to (loading a ROM image) takes
//! [`MapView::table`] or a [`Region`]'s own `Bytes`.

use std::iter::FusedIterator;
use std::sync::Arc;

use vm_memory::bitmap::{Bitmap, RefSlice, WithBitmapSlice, BS};
use vm_memory::guest_memory::{GuestMemorySliceIterator, Result as GmResult};
use vm_memory::{
    Address, FileOffset, GuestAddress, GuestAddressSpace, GuestMemory, GuestMemoryBackend,
    GuestMemoryError, GuestMemoryRegion, GuestMemoryRegionBytes, GuestUsize, MemoryRegionAddress,
    Permissions, VolatileSlice,
};

use crate::dirty::DirtyBitmap;
use crate::map::{GuestMap, MapView, RegionTable, Span};
use crate::region::Region;
use crate::translate::{guest_slice, DirtySlice, GuestSlice, Translator};

impl<'a> WithBitmapSlice<'a> for DirtyBitmap {
    type S = RefSlice<'a, DirtyBitmap>;
}

impl Bitmap for DirtyBitmap {
    /// Marks the pages `offset..offset+len` touches, clipped to the bitmap (vm-memory calls
    /// this with the offsets of an access it just made, which lie inside; clipping keeps a
    /// wrapped offset from doing anything but nothing).
    #[inline]
    fn mark_dirty(&self, offset: usize, len: usize) {
        let (offset, size) = (offset as u64, self.size());
        let len = (len as u64).min(size.saturating_sub(offset));
        if len > 0 {
            // In range by the clip above, so this cannot fail.
            let _ = self.mark(offset, len);
        }
    }

    fn dirty_at(&self, offset: usize) -> bool {
        self.is_dirty(offset as u64 / self.page_size())
    }

    fn slice_at(&self, offset: usize) -> RefSlice<'_, Self> {
        RefSlice::new(self, offset)
    }
}

impl GuestMemoryRegion for Region {
    type B = Option<DirtyBitmap>;

    fn len(&self) -> GuestUsize {
        self.size()
    }

    fn start_addr(&self) -> GuestAddress {
        self.guest_addr()
    }

    fn bitmap(&self) -> BS<'_, Self::B> {
        self.dirty_option().slice_at(0)
    }

    fn get_host_address(&self, addr: MemoryRegionAddress) -> GmResult<*mut u8> {
        self.check_address(addr)
            .ok_or(GuestMemoryError::InvalidBackendAddress)
            // SAFETY: check_address proved `addr` < size, so the pointer stays in the mapping.
            .map(|a| unsafe { self.host_addr().add(a.raw_value() as usize) })
    }

    fn file_offset(&self) -> Option<&FileOffset> {
        Region::file_offset(self)
    }

    fn get_slice(
        &self,
        offset: MemoryRegionAddress,
        count: usize,
    ) -> GmResult<VolatileSlice<'_, BS<'_, Self::B>>> {
        let end = offset
            .raw_value()
            .checked_add(count as u64)
            .ok_or(GuestMemoryError::InvalidBackendAddress)?;
        if end > self.size() {
            return Err(GuestMemoryError::InvalidBackendAddress);
        }
        let off = offset.raw_value() as usize;
        // SAFETY: offset..offset+count lies inside the region (checked above without
        // overflow), and the mapping and bitmap live as long as `self`, which the slice
        // borrows.
        Ok(unsafe {
            VolatileSlice::with_bitmap(
                self.host_addr().add(off),
                count,
                self.dirty_option().slice_at(off),
                None,
            )
        })
    }

    fn is_hugetlbfs(&self) -> Option<bool> {
        Some(self.is_hugetlb())
    }
}

// The host mapping of every region is readable and writable (read-only regions are
// read-only to the guest and to device code, see the module docs); a region's own `Bytes`
// are the host's way in, to load an image into a ROM, and mark its bitmap like any write.
impl GuestMemoryRegionBytes for Region {}

impl GuestMemoryBackend for RegionTable {
    type R = Region;

    fn num_regions(&self) -> usize {
        self.regions().len()
    }

    fn find_region(&self, addr: GuestAddress) -> Option<&Region> {
        self.find_index(addr).map(|i| &*self.regions()[i])
    }

    fn iter(&self) -> impl Iterator<Item = &Region> {
        self.regions().iter().map(|r| &**r)
    }
}

/// A write the device view refused: it would have touched a read-only region.
#[derive(Debug, thiserror::Error)]
#[error("write of {len:#x} bytes at guest address {addr:#x} refused: region {region_addr:#x}..{region_end:#x} is read-only")]
pub struct ReadOnlyWrite {
    /// Start of the access.
    pub addr: u64,
    /// Its length.
    pub len: usize,
    /// Start of the read-only region.
    pub region_addr: u64,
    /// Its end (exclusive).
    pub region_end: u64,
}

fn read_only(addr: GuestAddress, len: usize, span: &Span) -> GuestMemoryError {
    GuestMemoryError::IOError(std::io::Error::new(
        std::io::ErrorKind::PermissionDenied,
        ReadOnlyWrite {
            addr: addr.0,
            len,
            region_addr: span.start,
            region_end: span.end,
        },
    ))
}

/// Refuses a write to `addr..addr+count` that would touch a read-only region, walking the
/// regions it covers up to the first hole (where vm-memory's own iteration stops too).
fn check_writable(table: &RegionTable, addr: GuestAddress, count: usize) -> GmResult<()> {
    let end = addr.0.saturating_add(count as u64);
    let mut at = addr.0;
    while at < end {
        let Some(i) = table.find_index(GuestAddress(at)) else {
            break;
        };
        let span = &table.spans()[i];
        if span.read_only {
            return Err(read_only(addr, count, span));
        }
        at = span.end;
    }
    Ok(())
}

/// Whether `access` includes writing (vm-memory's `Permissions::has_write`, which is not
/// inlinable across crates: this is on every device access).
#[inline]
fn writes(access: Permissions) -> bool {
    (access as u8) & (Permissions::Write as u8) != 0
}

/// The slices of one access, one per region it covers, produced as they are asked for:
/// step for step what vm-memory's own `GuestMemoryBackendSliceIterator` does (the same
/// errors for a hole and for running past the end of the address space), with the region
/// the caller's lookup already found used for the first step.
struct ViewSlices<'a> {
    table: &'a RegionTable,
    addr: GuestAddress,
    count: usize,
    /// The span holding `addr`, if the caller's lookup found it (a reference into the table:
    /// the iterator stays as small as vm-memory's own).
    found: Option<&'a Span>,
}

impl<'a> Iterator for ViewSlices<'a> {
    type Item = GmResult<GuestSlice<'a>>;

    #[inline]
    fn next(&mut self) -> Option<Self::Item> {
        if self.count == 0 {
            return None;
        }
        let addr = self.addr;
        let table = self.table;
        let found = self
            .found
            .take()
            .or_else(|| table.find_index(addr).map(|i| &table.spans()[i]));
        let Some(span) = found else {
            self.count = 0;
            return Some(Err(GuestMemoryError::InvalidGuestAddress(addr)));
        };
        let offset = addr.0 - span.start;
        let len = std::cmp::min(span.end - addr.0, self.count as u64) as usize;
        self.count -= len;
        self.addr = match addr.0.overflowing_add(len as u64) {
            (0, _) | (_, false) => GuestAddress(addr.0.wrapping_add(len as u64)),
            (_, true) => {
                self.count = 0;
                return Some(Err(GuestMemoryError::GuestAddressOverflow));
            }
        };
        // SAFETY: addr..addr+len lies in the region of `span` (`addr` is in it: the lookup
        // found it there; `len` is at most its distance to the region's end), and `span` came
        // from the view `table` belongs to, which keeps the region alive for 'a.
        Some(Ok(unsafe {
            guest_slice(span.host + offset as usize, len, span, offset)
        }))
    }
}

impl<'a> FusedIterator for ViewSlices<'a> {}

impl<'a> GuestMemorySliceIterator<'a, DirtySlice<'a>> for ViewSlices<'a> {}

/// The device view's `get_slices`: `found` is the region the caller's lookup found for
/// `addr` (by binary search or through a translator's cache), if any. A write is checked
/// whole before the first slice is made: nothing is written if any part is read-only.
#[inline]
fn slices<'a>(
    table: &'a RegionTable,
    found: Option<&'a Span>,
    addr: GuestAddress,
    count: usize,
    access: Permissions,
) -> GmResult<ViewSlices<'a>> {
    if writes(access) {
        match found {
            // The common case: the whole access lies in the region found.
            Some(s) if (count as u64) <= s.end - addr.0 => {
                if s.read_only && count > 0 {
                    return Err(read_only(addr, count, s));
                }
            }
            _ => check_writable(table, addr, count)?,
        }
    }
    Ok(ViewSlices {
        table,
        addr,
        count,
        // Both lookups return the span holding `addr` (or none), so it serves the first step.
        found,
    })
}

impl GuestMemory for MapView {
    type PhysicalMemory = RegionTable;
    type Bitmap = Option<DirtyBitmap>;

    fn check_range(&self, addr: GuestAddress, count: usize, access: Permissions) -> bool {
        GuestMemoryBackend::check_range(self.table(), addr, count)
            && (!writes(access) || check_writable(self.table(), addr, count).is_ok())
    }

    #[inline]
    fn get_slices<'a>(
        &'a self,
        addr: GuestAddress,
        count: usize,
        access: Permissions,
    ) -> GmResult<impl GuestMemorySliceIterator<'a, BS<'a, Self::Bitmap>>> {
        let table = self.table();
        let found = table.find_index(addr).map(|i| &table.spans()[i]);
        slices(table, found, addr, count, access)
    }
}

impl GuestMemory for Translator {
    type PhysicalMemory = RegionTable;
    type Bitmap = Option<DirtyBitmap>;

    fn check_range(&self, addr: GuestAddress, count: usize, access: Permissions) -> bool {
        GuestMemory::check_range(self.view(), addr, count, access)
    }

    #[inline]
    fn get_slices<'a>(
        &'a self,
        addr: GuestAddress,
        count: usize,
        access: Permissions,
    ) -> GmResult<impl GuestMemorySliceIterator<'a, BS<'a, Self::Bitmap>>> {
        let table = self.view().table();
        // The cached index belongs to the view this translator pins: `get` keeps even a
        // stale one in bounds.
        let found = self.region_index(addr).and_then(|i| table.spans().get(i));
        slices(table, found, addr, count, access)
    }
}

impl GuestAddressSpace for GuestMap {
    type M = MapView;
    type T = Arc<MapView>;

    fn memory(&self) -> Arc<MapView> {
        self.view()
    }
}
