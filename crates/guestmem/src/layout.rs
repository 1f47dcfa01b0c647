//! Where a region goes in the host address space, and what backs it.
//!
//! The one rule that matters for speed: a region's host address is congruent to its guest
//! address modulo the region's huge-page size. KVM (and the kernel's THP code) can only map a
//! guest huge page with a host huge page when both are aligned the same way; QEMU's TCG guard
//! pages (seed 003) and Cloud Hypervisor's unaligned regions lose huge pages for lack of it.
//!
//! So every region is placed in a private `PROT_NONE` reservation: we pick the host start
//! inside it that satisfies the congruence, map the backing there with `MAP_FIXED`, and keep
//! one base page on each side as a `PROT_NONE` guard. The guards lie outside the region's own
//! span, so they never split one of its huge pages; the rest of the reservation is returned.

use std::path::PathBuf;

use vm_memory::GuestAddress;

pub use crate::mmap::{HugePageSize, Reserve};

/// Most regions one map may hold.
///
/// 32,764 is the number of user memslots x86 KVM accepts (`KVM_USER_MEM_SLOTS`); a map larger
/// than that could not be registered with KVM one slot per region.
pub const MAX_REGIONS: usize = 32_764;

/// Size of one guard area on each side of a region, in bytes (one base page).
pub const GUARD_BYTES: u64 = 4096;

/// THP size on x86_64: the alignment that lets anonymous and shmem regions use huge pages.
pub const THP_BYTES: u64 = 2 << 20;

/// What backs a region's memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backing {
    /// Private anonymous memory (THP-capable).
    Anonymous,
    /// A memfd, shareable with another process (vhost-user) through its descriptor.
    Memfd,
    /// A hugetlb memfd of the given page size.
    Hugetlb(HugePageSize),
    /// A file, mapped shared from `offset`; the file must hold the whole region.
    File {
        /// The file's path.
        path: PathBuf,
        /// Byte offset into the file; a multiple of the base page size.
        offset: u64,
    },
    /// A file, mapped private (copy on write) from `offset`: reads come from the file's page
    /// cache as the guest first touches each page, writes stay in this process and never
    /// reach the file. How a snapshot's memory file is restored in
    /// [`RestoreMode::Mapped`](crate::restore::RestoreMode::Mapped).
    FilePrivate {
        /// The file's path.
        path: PathBuf,
        /// Byte offset into the file; a multiple of the base page size.
        offset: u64,
    },
}

impl Backing {
    /// Short name for reports.
    pub fn name(&self) -> String {
        match self {
            Backing::Anonymous => "anon".into(),
            Backing::Memfd => "memfd".into(),
            Backing::Hugetlb(HugePageSize::Size2M) => "hugetlb-2M".into(),
            Backing::Hugetlb(HugePageSize::Size1G) => "hugetlb-1G".into(),
            Backing::File { path, offset } => format!("file:{}@{offset:#x}", path.display()),
            Backing::FilePrivate { path, offset } => {
                format!("file-private:{}@{offset:#x}", path.display())
            }
        }
    }
}

/// THP advice given to a region at map time, before anything is populated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Thp {
    /// `MADV_HUGEPAGE` (the default).
    Huge,
    /// `MADV_NOHUGEPAGE`.
    NoHuge,
    /// No advice: the system default.
    Default,
}

/// Guard pages around a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Guard {
    /// One `PROT_NONE` base page on each side, outside the region's span (the default).
    On,
    /// None.
    Off,
}

/// Who may write the region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Access {
    /// Guest and host read and write (the default).
    ReadWrite,
    /// The guest may only read (KVM `KVM_MEM_READONLY`; the translator refuses writes).
    /// The host mapping stays writable so the VMM can load an image into it.
    ReadOnly,
}

/// Whether a region records which pages are written through vm-memory (device code) in a
/// dirty bitmap of its own.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DirtyTracking {
    /// No bitmap (the default): a write costs nothing extra.
    #[default]
    Off,
    /// A word-level bitmap, one bit per 4 KiB (KVM's dirty-log granule), marked by every
    /// write through the region's slices and merged with KVM's log on harvest.
    On,
}

/// Everything needed to map one region: where it sits in the guest, its size and backing,
/// and the options. Build one with [`RegionSpec::new`] and the `with_*` methods.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionSpec {
    pub(crate) guest_addr: GuestAddress,
    pub(crate) size: u64,
    pub(crate) backing: Backing,
    pub(crate) thp: Thp,
    pub(crate) guard: Guard,
    pub(crate) numa_node: Option<u32>,
    pub(crate) access: Access,
    pub(crate) reserve: Reserve,
    pub(crate) dirty: DirtyTracking,
}

impl RegionSpec {
    /// An anonymous, THP-advised, guarded, read-write region of `size` bytes at `guest_addr`.
    pub fn new(guest_addr: GuestAddress, size: u64) -> Self {
        RegionSpec {
            guest_addr,
            size,
            backing: Backing::Anonymous,
            thp: Thp::Huge,
            guard: Guard::On,
            numa_node: None,
            access: Access::ReadWrite,
            reserve: Reserve::Reserve,
            dirty: DirtyTracking::Off,
        }
    }

    /// Sets whether writes through vm-memory are recorded in a dirty bitmap.
    pub fn with_dirty_tracking(mut self, dirty: DirtyTracking) -> Self {
        self.dirty = dirty;
        self
    }

    /// Sets the backing.
    pub fn with_backing(mut self, backing: Backing) -> Self {
        self.backing = backing;
        self
    }

    /// Sets the THP advice.
    pub fn with_thp(mut self, thp: Thp) -> Self {
        self.thp = thp;
        self
    }

    /// Sets the guard pages.
    pub fn with_guard(mut self, guard: Guard) -> Self {
        self.guard = guard;
        self
    }

    /// Binds the region's memory to NUMA node `node` (`mbind(MPOL_BIND)`).
    pub fn with_numa_node(mut self, node: u32) -> Self {
        self.numa_node = Some(node);
        self
    }

    /// Sets who may write the region.
    pub fn with_access(mut self, access: Access) -> Self {
        self.access = access;
        self
    }

    /// Sets how hugetlb pages are reserved (ignored for other backings). [`Reserve::Reserve`],
    /// the default, needs no promise; this is `unsafe` for the sake of `NoReserve`.
    ///
    /// # Safety
    /// With [`Reserve::NoReserve`] a hugetlb region's pages come from the pool at first
    /// touch, and a CPU access to a page the pool cannot supply raises `SIGBUS` (through the
    /// translator, vm-memory's `Bytes`, or a vCPU). The caller must populate the region
    /// successfully ([`mod@crate::populate`] turns a dry pool into an error, never a signal)
    /// before anything accesses its memory.
    pub unsafe fn with_reserve(mut self, reserve: Reserve) -> Self {
        self.reserve = reserve;
        self
    }

    /// The guest address of the region's first byte.
    pub fn guest_addr(&self) -> GuestAddress {
        self.guest_addr
    }

    /// The size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The backing.
    pub fn backing(&self) -> &Backing {
        &self.backing
    }

    /// The guest address one past the region's last byte, or `None` if that overflows u64
    /// (a region may end exactly at 2^64 only in theory; we refuse it to keep arithmetic
    /// simple).
    pub fn guest_end(&self) -> Option<u64> {
        self.guest_addr.0.checked_add(self.size)
    }

    /// The granule the region's size and offsets must be multiples of: the hugetlb page size
    /// for hugetlb, else the base page size.
    pub fn page_size(&self) -> u64 {
        match self.backing {
            Backing::Hugetlb(h) => h.bytes(),
            _ => crate::sys::base_page_size(),
        }
    }

    /// The alignment the host address must share with the guest address: the size of the
    /// largest page the kernel may map the region with.
    pub fn huge_align(&self) -> u64 {
        match self.backing {
            Backing::Hugetlb(h) => h.bytes(),
            _ => THP_BYTES,
        }
    }
}

/// Where a region lands inside its reservation: all offsets from the reservation's start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    /// Bytes to reserve in all.
    pub reserve_len: u64,
    /// Bytes of leading guard the reservation must keep below the region.
    pub guard: u64,
    /// Bytes to ask for beyond the region and its guards, to find an aligned start.
    pub slack: u64,
}

impl Placement {
    /// How much address space to reserve for a region of `size` bytes whose host address must
    /// be congruent to its guest address modulo `align`, with `guard` bytes on each side.
    pub fn plan(size: u64, align: u64, guard: u64) -> Option<Placement> {
        // An mmap'd reservation is only base-page aligned; `align - base` more bytes always
        // contain a start with the right residue. We ask for `align` for simplicity.
        let slack = if align > crate::sys::base_page_size() {
            align
        } else {
            0
        };
        let reserve_len = size
            .checked_add(guard.checked_mul(2)?)?
            .checked_add(slack)?;
        Some(Placement {
            reserve_len,
            guard,
            slack,
        })
    }

    /// The host address for the region inside a reservation starting at `res_start`:
    /// the lowest address `>= res_start + guard` that is congruent to `guest_addr`
    /// modulo `align` (a power of two; 0 is taken as 1). Addresses wrap at 2^64: a
    /// reservation the kernel gave lies far below.
    pub fn host_start(&self, res_start: u64, guest_addr: u64, align: u64) -> u64 {
        let lowest = res_start.wrapping_add(self.guard);
        let mask = align.max(1).wrapping_sub(1);
        let want = guest_addr & mask;
        let have = lowest & mask;
        lowest.wrapping_add(want.wrapping_sub(have) & mask)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn host_start_is_congruent_and_fits(
            res_page in 0u64..(1 << 30),
            guest in 0u64..(1u64 << 50),
            pages in 1u64..4096,
            align_shift in prop::sample::select(vec![12u32, 21, 30]),
            guard in prop::sample::select(vec![0u64, 4096]),
        ) {
            let align = 1u64 << align_shift;
            let guest = guest & !4095;
            let size = pages * 4096;
            let res_start = res_page * 4096;
            let p = Placement::plan(size, align, guard).unwrap();
            let h = p.host_start(res_start, guest, align);
            prop_assert_eq!(h % align, guest % align);
            prop_assert!(h >= res_start + guard);
            prop_assert!(h + size + guard <= res_start + p.reserve_len);
        }
    }

    #[test]
    fn huge_page_size_bits_match_the_kernel_encoding() {
        assert_eq!(HugePageSize::Size2M.shift_bits(), libc::MAP_HUGE_2MB as u32);
        assert_eq!(HugePageSize::Size1G.shift_bits(), libc::MAP_HUGE_1GB as u32);
        assert_eq!(HugePageSize::Size2M.shift_bits(), libc::MFD_HUGE_2MB);
    }
}
