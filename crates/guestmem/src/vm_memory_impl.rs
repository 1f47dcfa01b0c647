//! rust-vmm `vm-memory` compatibility: guestmem's map works wherever `GuestMemory` and
//! `Bytes<GuestAddress>` are expected (virtio-queue, vhost-user backends, linux-loader).
//!
//! Three views implement `GuestMemoryBackend`:
//! - [`Snapshot`]: binary search, `Sync`; what [`GuestMap`]'s `GuestAddressSpace` hands out.
//! - [`Translator`]: `find_region` goes through the per-thread last-used cache, so a device
//!   worker that hands its translator to generic code gets seed 004's speed-up there too.
//!
//! Regions use `()` as their vm-memory bitmap; guestmem tracks dirty pages on its own
//! (word-level, see the dirty module) rather than through vm-memory's bit-at-a-time bitmap.

use std::sync::Arc;

use vm_memory::bitmap::BS;
use vm_memory::guest_memory::Result as GmResult;
use vm_memory::{
    Address, FileOffset, GuestAddress, GuestAddressSpace, GuestMemoryBackend, GuestMemoryError,
    GuestMemoryRegion, GuestMemoryRegionBytes, GuestUsize, MemoryRegionAddress, VolatileSlice,
};

use crate::map::{GuestMap, Snapshot};
use crate::region::Region;
use crate::translate::Translator;

impl GuestMemoryRegion for Region {
    type B = ();

    fn len(&self) -> GuestUsize {
        self.size()
    }

    fn start_addr(&self) -> GuestAddress {
        self.guest_addr()
    }

    fn bitmap(&self) -> BS<'_, ()> {}

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
    ) -> GmResult<VolatileSlice<'_, BS<'_, ()>>> {
        let end = offset
            .raw_value()
            .checked_add(count as u64)
            .ok_or(GuestMemoryError::InvalidBackendAddress)?;
        if end > self.size() {
            return Err(GuestMemoryError::InvalidBackendAddress);
        }
        // SAFETY: offset..offset+count lies inside the region (checked above without
        // overflow), and the mapping lives as long as `self`, which the slice borrows.
        Ok(unsafe { VolatileSlice::new(self.host_addr().add(offset.raw_value() as usize), count) })
    }

    fn is_hugetlbfs(&self) -> Option<bool> {
        Some(self.is_hugetlb())
    }
}

// The host mapping of every region is readable and writable (read-only regions are
// read-only to the guest, see `layout::Access`), so vm-memory's default `Bytes` is sound.
impl GuestMemoryRegionBytes for Region {}

impl GuestMemoryBackend for Snapshot {
    type R = Region;

    fn num_regions(&self) -> usize {
        self.len()
    }

    fn find_region(&self, addr: GuestAddress) -> Option<&Region> {
        self.find(addr).map(|r| &**r)
    }

    fn iter(&self) -> impl Iterator<Item = &Region> {
        self.regions().iter().map(|r| &**r)
    }
}

impl GuestMemoryBackend for Translator {
    type R = Region;

    fn num_regions(&self) -> usize {
        self.snapshot().len()
    }

    #[inline]
    fn find_region(&self, addr: GuestAddress) -> Option<&Region> {
        self.find(addr).map(|r| &**r)
    }

    fn iter(&self) -> impl Iterator<Item = &Region> {
        self.snapshot().regions().iter().map(|r| &**r)
    }
}

impl GuestAddressSpace for GuestMap {
    type M = Snapshot;
    type T = Arc<Snapshot>;

    fn memory(&self) -> Arc<Snapshot> {
        self.snapshot()
    }
}
