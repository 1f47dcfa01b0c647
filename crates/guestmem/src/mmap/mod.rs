//! Owned host mappings: a [`Reservation`] of address space, and the [`Mapping`] placed in it.
//!
//! Design choice, after crosvm's `MemoryMapping`: every range of address space guestmem
//! touches has exactly one owner, which unmaps it when dropped, and every operation on a range
//! is a method of that owner that checks the offset and length first and then makes one
//! `unsafe` call whose SAFETY comment names that check. Neither type is `Copy` or `Clone`, and
//! no method takes a raw address, so safe code cannot unmap, remap or re-protect memory it does
//! not own:
//!
//! - A [`Reservation`] is `PROT_NONE` address space. It can be trimmed (the slack given back)
//!   and consumed by [`Reservation::place`], which maps memory over part of it with
//!   `MAP_FIXED`: the only `MAP_FIXED` in guestmem, and always inside a range the caller owns.
//! - A [`Mapping`] owns what is left of its reservation: its body (the readable, writable
//!   memory) and the `PROT_NONE` pages around it, which serve as guards. Dropping it unmaps
//!   all of them at once.
//!
//! What a mapping offers never hands out a Rust reference to its memory (only raw pointers and
//! `VolatileSlice`s, as vm-memory does for guest memory, which the guest may change at any
//! time). So advice that changes contents (`MADV_DONTNEED`) cannot invalidate a borrow, and no
//! method changes protection: a body stays readable and writable for as long as it lives.

use std::io;
use std::os::fd::BorrowedFd;

use vm_memory::VolatileSlice;

mod huge_page;
mod procmem;
mod reservation;
pub use huge_page::HugePageSize;
pub(crate) use procmem::ProcMem;
pub use reservation::Reservation;

/// Why an operation on a reservation or mapping failed.
#[derive(Debug, thiserror::Error)]
pub enum MmapError {
    /// The range does not lie inside the owner (or its end overflows).
    #[error("range {offset:#x} + {len:#x} lies outside the {size:#x}-byte {what}")]
    OutOfRange {
        /// Offset of the range.
        offset: usize,
        /// Its length.
        len: usize,
        /// The owner's size.
        size: usize,
        /// `mapping` or `reservation`.
        what: &'static str,
    },
    /// A syscall failed.
    #[error("{op} of {len:#x} bytes at host {addr:#x} failed: {source}")]
    Sys {
        /// The call, as `madvise(MADV_POPULATE_WRITE)`.
        op: &'static str,
        /// Host address of the range.
        addr: usize,
        /// Its length.
        len: usize,
        /// The errno.
        source: io::Error,
    },
}

impl MmapError {
    /// The syscall's name, or `range check` for [`MmapError::OutOfRange`].
    pub fn op(&self) -> &'static str {
        match self {
            MmapError::OutOfRange { .. } => "range check",
            MmapError::Sys { op, .. } => op,
        }
    }

    /// The error as an `io::Error` (`EINVAL` for a range outside the owner).
    pub fn into_io(self) -> io::Error {
        match self {
            MmapError::OutOfRange { .. } => io::Error::from_raw_os_error(libc::EINVAL),
            MmapError::Sys { source, .. } => source,
        }
    }
}

fn sys_result(
    ret: libc::c_int,
    op: &'static str,
    addr: usize,
    len: usize,
) -> Result<(), MmapError> {
    if ret == 0 {
        Ok(())
    } else {
        Err(MmapError::Sys {
            op,
            addr,
            len,
            source: io::Error::last_os_error(),
        })
    }
}

/// `offset..offset+len` inside `size`, or the error naming it.
fn check(offset: usize, len: usize, size: usize, what: &'static str) -> Result<(), MmapError> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(MmapError::OutOfRange {
            offset,
            len,
            size,
            what,
        }),
    }
}

/// A fresh private anonymous mapping of `len` bytes with `prot` and `extra_flags`, where the
/// kernel chooses; the caller becomes its one owner.
fn mmap_fresh(
    len: usize,
    prot: libc::c_int,
    extra_flags: libc::c_int,
    op: &'static str,
) -> Result<usize, MmapError> {
    // SAFETY: a fresh anonymous mapping at an address the kernel chooses (no MAP_FIXED)
    // cannot alias memory this process uses; the result is checked against MAP_FAILED below.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            prot,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | extra_flags,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(MmapError::Sys {
            op,
            addr: 0,
            len,
            source: io::Error::last_os_error(),
        });
    }
    Ok(p as usize)
}

/// Unmaps `addr..addr+len`.
///
/// # Safety
/// The range must be owned by the caller (a reservation or mapping it is dropping or
/// trimming), with nothing else using it afterwards.
unsafe fn munmap(addr: usize, len: usize) -> Result<(), MmapError> {
    if len == 0 {
        return Ok(());
    }
    // SAFETY: the caller owns the range and gives it up (this function's contract).
    let ret = unsafe { libc::munmap(addr as *mut libc::c_void, len) };
    sys_result(ret, "munmap", addr, len)
}

/// What a mapping maps.
#[derive(Debug, Clone, Copy)]
pub enum MapSource<'a> {
    /// Private anonymous memory.
    Anonymous,
    /// A file from `offset`, shared: writes reach the file and other mappings of it.
    SharedFile {
        /// The file.
        fd: BorrowedFd<'a>,
        /// Byte offset, a multiple of the page size.
        offset: u64,
    },
    /// A file from `offset`, private: writes stay in this process (copy on write).
    PrivateFile {
        /// The file.
        fd: BorrowedFd<'a>,
        /// Byte offset, a multiple of the page size.
        offset: u64,
    },
}

/// `madvise` advice that leaves every page of a mapping readable and writable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Advice {
    /// `MADV_HUGEPAGE`: back it with transparent huge pages where possible.
    HugePage,
    /// `MADV_NOHUGEPAGE`.
    NoHugePage,
    /// `MADV_POPULATE_WRITE`: fault every page in writable now (Linux 5.14), without
    /// writing.
    PopulateWrite,
    /// `MADV_DONTNEED`: drop the pages; private anonymous memory reads as zero afterwards,
    /// file-backed memory as the file holds it.
    DontNeed,
    /// `MADV_COLLAPSE` (Linux 6.1): copy the pages of each whole 2 MiB into a transparent
    /// huge page now, keeping their contents (pages not present are allocated zero).
    Collapse,
    /// `MADV_DONTFORK`: a child made by `fork` does not get the range (this process keeps
    /// it as it is).
    DontFork,
}

impl Advice {
    fn raw(self) -> (libc::c_int, &'static str) {
        match self {
            Advice::HugePage => (libc::MADV_HUGEPAGE, "madvise(MADV_HUGEPAGE)"),
            Advice::NoHugePage => (libc::MADV_NOHUGEPAGE, "madvise(MADV_NOHUGEPAGE)"),
            Advice::PopulateWrite => (libc::MADV_POPULATE_WRITE, "madvise(MADV_POPULATE_WRITE)"),
            Advice::DontNeed => (libc::MADV_DONTNEED, "madvise(MADV_DONTNEED)"),
            Advice::Collapse => (libc::MADV_COLLAPSE, "madvise(MADV_COLLAPSE)"),
            Advice::DontFork => (libc::MADV_DONTFORK, "madvise(MADV_DONTFORK)"),
        }
    }
}

/// Node numbers at or above this are refused by [`Mapping::bind_node`]: the kernel's largest
/// `MAX_NUMNODES` (`1 << CONFIG_NODES_SHIFT`, at most 10 bits on x86_64).
pub const MAX_NUMA_NODES: u32 = 1 << 10;

/// How [`Mapping::lock`] locks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lock {
    /// `mlock`: fault every page in and lock it now.
    Now,
    /// `mlock2(MLOCK_ONFAULT)`: account the range as locked now, lock pages as they fault in.
    OnFault,
}

/// Readable, writable memory at a fixed host address, owned, with the `PROT_NONE` guard pages
/// of the reservation it was placed in; all of it is unmapped when dropped.
#[derive(Debug)]
pub struct Mapping {
    /// The whole range owned: body and guards.
    owned: (usize, usize),
    addr: usize,
    len: usize,
}

// SAFETY: a Mapping is plain ownership of a range of address space; the kernel serialises
// every operation on it, and access to its memory goes through raw pointers and
// VolatileSlices, whose users accept that others may write it concurrently.
unsafe impl Send for Mapping {}
// SAFETY: as above; `&Mapping` offers only syscalls on the owned range and volatile access.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// A private anonymous mapping of `len` bytes wherever the kernel puts it (base-page
    /// aligned), with no guards.
    pub fn anonymous(len: usize) -> Result<Mapping, MmapError> {
        let addr = mmap_fresh(len, libc::PROT_READ | libc::PROT_WRITE, 0, "mmap")?;
        Ok(Mapping {
            owned: (addr, len),
            addr,
            len,
        })
    }

    /// A read-only shared mapping of the first `len` bytes of the file `fd`, wherever the
    /// kernel puts it: a source for the kernel to copy from (`UFFDIO_COPY`), straight from
    /// the page cache.
    ///
    /// # Safety
    /// No CPU access may read it (neither through [`Mapping::slice`] nor its pointer): a
    /// file that shrinks under it turns a read past its new end into `SIGBUS`, where the
    /// kernel's own copy fails with `EFAULT`. (It is never writable.)
    pub(crate) unsafe fn file_source(
        fd: std::os::fd::BorrowedFd<'_>,
        len: usize,
    ) -> Result<Mapping, MmapError> {
        use std::os::fd::AsRawFd;
        // SAFETY: a fresh shared read-only mapping at an address the kernel chooses (no
        // MAP_FIXED) aliases nothing of this process; checked against MAP_FAILED below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(MmapError::Sys {
                op: "mmap(PROT_READ, MAP_SHARED) of the memory file",
                addr: 0,
                len,
                source: io::Error::last_os_error(),
            });
        }
        let addr = p as usize;
        Ok(Mapping {
            owned: (addr, len),
            addr,
            len,
        })
    }

    /// A private anonymous mapping of `len` bytes of hugetlb pages of `size` (as Firecracker
    /// maps a `huge_pages` guest), wherever the kernel puts it; `len` must be a whole number
    /// of pages. Its pages are reserved from the pool as it is mapped (no `MAP_NORESERVE`):
    /// a pool with too few free fails the map, not a touch. (A hugetlb cgroup limit charged
    /// at fault time, on a kernel without reservation accounting, can still fail a touch
    /// with `SIGBUS`, as for any hugetlb memory.)
    pub fn anonymous_huge(len: usize, size: HugePageSize) -> Result<Mapping, MmapError> {
        let page = size.bytes() as usize;
        if len == 0 || !len.is_multiple_of(page) {
            return Err(MmapError::Sys {
                op: "mmap (hugetlb: not a whole number of pages)",
                addr: 0,
                len,
                source: io::Error::from_raw_os_error(libc::EINVAL),
            });
        }
        let huge = match size {
            HugePageSize::Size2M => libc::MAP_HUGE_2MB,
            HugePageSize::Size1G => libc::MAP_HUGE_1GB,
        };
        let addr = mmap_fresh(
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_HUGETLB | huge,
            "mmap (hugetlb)",
        )?;
        Ok(Mapping {
            owned: (addr, len),
            addr,
            len,
        })
    }

    /// The host address of the first byte. Reading or writing through it is `unsafe`; the
    /// memory stays mapped as long as `self` lives.
    pub fn as_ptr(&self) -> *mut u8 {
        self.addr as *mut u8
    }

    /// The length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the mapping is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The host address range this mapping owns, guards included: `(start, len)`.
    pub fn owned_range(&self) -> (usize, usize) {
        self.owned
    }

    /// Host address of `offset..offset+len`, once checked to lie in the body.
    fn range(&self, offset: usize, len: usize) -> Result<usize, MmapError> {
        check(offset, len, self.len, "mapping")?;
        Ok(self.addr + offset)
    }

    /// `offset..offset+len` of the body as a volatile slice, borrowed from the mapping.
    pub fn slice(&self, offset: usize, len: usize) -> Result<VolatileSlice<'_>, MmapError> {
        let addr = self.range(offset, len)?;
        // SAFETY: addr..addr+len lies in the body (checked by `range`), which stays mapped
        // readable and writable while `self`, which the slice borrows, lives.
        Ok(unsafe { VolatileSlice::new(addr as *mut u8, len) })
    }

    /// Gives `advice` on `offset..offset+len`.
    pub fn advise(&self, offset: usize, len: usize, advice: Advice) -> Result<(), MmapError> {
        let addr = self.range(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let (raw, op) = advice.raw();
        // SAFETY: addr..addr+len lies in the body this mapping owns (checked by `range`);
        // every `Advice` leaves the pages readable and writable, and no Rust reference into
        // them exists (only raw pointers and volatile slices), so none can be invalidated.
        let ret = unsafe { libc::madvise(addr as *mut libc::c_void, len, raw) };
        sys_result(ret, op, addr, len)
    }

    /// Locks `offset..offset+len` against swap.
    pub fn lock(&self, offset: usize, len: usize, how: Lock) -> Result<(), MmapError> {
        let addr = self.range(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let (flags, op) = match how {
            Lock::Now => (0, "mlock"),
            Lock::OnFault => (libc::MLOCK_ONFAULT, "mlock2(MLOCK_ONFAULT)"),
        };
        // SAFETY: addr..addr+len lies in the body this mapping owns (checked by `range`);
        // locking changes neither its contents nor its protection.
        let ret = unsafe { libc::mlock2(addr as *const libc::c_void, len, flags) };
        sys_result(ret, op, addr, len)
    }

    /// Unlocks `offset..offset+len`.
    pub fn unlock(&self, offset: usize, len: usize) -> Result<(), MmapError> {
        let addr = self.range(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        // SAFETY: addr..addr+len lies in the body this mapping owns (checked by `range`);
        // unlocking changes neither its contents nor its protection.
        let ret = unsafe { libc::munlock(addr as *const libc::c_void, len) };
        sys_result(ret, "munlock", addr, len)
    }

    /// Whether any page of `offset..offset+len` is resident (`mincore`): for private memory,
    /// a page faulted in; for a shared file or memfd, a page in its page cache, however it
    /// got there (written through the descriptor or another mapping too). Read in batches,
    /// stopping at the first resident page.
    pub fn any_resident(&self, offset: usize, len: usize) -> Result<bool, MmapError> {
        let mut any = false;
        self.residency(offset, len, |pages| {
            any = pages.iter().any(|&b| b & 1 != 0);
            !any
        })?;
        Ok(any)
    }

    /// How many base pages of `offset..offset+len` are resident (`mincore`: for a file
    /// mapping, in the page cache, whether or not this process touched them).
    pub(crate) fn resident_pages(&self, offset: usize, len: usize) -> Result<usize, MmapError> {
        let mut n = 0;
        self.residency(offset, len, |pages| {
            n += pages.iter().filter(|&&b| b & 1 != 0).count();
            true
        })?;
        Ok(n)
    }

    /// `mincore` over `offset..offset+len` a batch at a time, each batch's bytes (one per
    /// base page) given to `each`, until it returns false.
    fn residency(
        &self,
        offset: usize,
        len: usize,
        mut each: impl FnMut(&[u8]) -> bool,
    ) -> Result<(), MmapError> {
        /// Pages whose residency one `mincore` call reads.
        const BATCH_PAGES: usize = 1 << 14;
        let addr = self.range(offset, len)?;
        let page = crate::sys::base_page_size() as usize;
        let first = addr / page * page;
        let end = addr + len;
        let mut vec = vec![0u8; BATCH_PAGES];
        let mut at = first;
        while at < end {
            let n = BATCH_PAGES.min((end - at).div_ceil(page));
            // at..at+n pages lies in the body (checked by `range`, rounded down to the page
            // holding `addr`, part of the same mapping).
            // SAFETY: the range is this mapping's own; mincore only reads page state and
            // writes n <= BATCH_PAGES bytes into `vec`.
            let ret = unsafe { libc::mincore(at as *mut libc::c_void, n * page, vec.as_mut_ptr()) };
            sys_result(ret, "mincore", at, n * page)?;
            if !each(&vec[..n]) {
                return Ok(());
            }
            at += n * page;
        }
        Ok(())
    }

    /// Binds `offset..offset+len` to NUMA node `node` (`mbind(MPOL_BIND)`; libc has no
    /// wrapper, so this goes through `syscall`).
    pub fn bind_node(&self, offset: usize, len: usize, node: u32) -> Result<(), MmapError> {
        const MPOL_BIND: libc::c_ulong = 2;
        let addr = self.range(offset, len)?;
        if node >= MAX_NUMA_NODES {
            // The kernel would refuse it anyway; refusing first also spares allocating a
            // mask of `node` bits.
            return Err(MmapError::Sys {
                op: "mbind",
                addr,
                len,
                source: io::Error::from_raw_os_error(libc::EINVAL),
            });
        }
        let bits = usize::BITS as usize;
        let words = (node as usize) / bits + 1;
        let mut mask = vec![0usize; words];
        mask[node as usize / bits] |= 1 << (node as usize % bits);
        let maxnode = (words * bits + 1) as libc::c_ulong;
        // SAFETY: addr..addr+len lies in the body this mapping owns (checked by `range`), and
        // a memory policy only decides where its pages are placed; `mask` outlives the call
        // and holds `maxnode - 1` bits, as mbind requires.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_mbind,
                addr,
                len,
                MPOL_BIND,
                mask.as_ptr(),
                maxnode,
                0 as libc::c_uint,
            )
        };
        sys_result(if ret == 0 { 0 } else { -1 }, "mbind", addr, len)
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping owns `owned` (body and guards) and is going away; nothing can
        // borrow its memory past this point (slices borrow `self`). A failed munmap of our
        // own range could only leak address space.
        let _ = unsafe { munmap(self.owned.0, self.owned.1) };
    }
}

/// How the kernel reserves hugetlb pages for a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Reserve {
    /// Reserve every page at map time, so a pool that is too small fails the map (default).
    Reserve,
    /// `MAP_NORESERVE`: pages are taken when first touched, so population can fail part-way,
    /// and a CPU touch of a page the pool cannot supply raises `SIGBUS`: opting in is
    /// `unsafe` ([`crate::RegionSpec::with_reserve`]).
    NoReserve,
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::Bytes;

    const PAGE: usize = 4096;

    #[test]
    fn place_inside_reservation_reads_back_and_keeps_guards() {
        let r = Reservation::new(4 * PAGE).unwrap();
        let base = r.addr();
        let m = r.place(PAGE, 2 * PAGE).unwrap();
        assert_eq!(m.as_ptr() as usize, base + PAGE);
        assert_eq!(m.owned_range(), (base, 4 * PAGE));
        let s = m.slice(0, 2 * PAGE).unwrap();
        s.write_obj(0xa5u8, 2 * PAGE - 1).unwrap();
        assert_eq!(s.read_obj::<u8>(2 * PAGE - 1).unwrap(), 0xa5);
    }

    #[test]
    fn range_outside_the_body_is_refused_before_any_syscall() {
        let m = Mapping::anonymous(2 * PAGE).unwrap();
        for (off, len) in [(PAGE, 2 * PAGE), (usize::MAX, 2), (3 * PAGE, 0)] {
            let e = m.advise(off, len, Advice::DontNeed).unwrap_err();
            assert!(matches!(e, MmapError::OutOfRange { .. }), "{e}");
            assert!(m.lock(off, len, Lock::Now).is_err());
            assert!(m.slice(off, len).is_err());
        }
        assert!(m.advise(PAGE, PAGE, Advice::DontNeed).is_ok());
    }

    #[test]
    fn place_outside_reservation_is_refused_and_unmaps_it() {
        let r = Reservation::new(2 * PAGE).unwrap();
        let e = r.place(PAGE, 2 * PAGE).unwrap_err();
        assert!(matches!(e, MmapError::OutOfRange { .. }), "{e}");
    }

    #[test]
    fn trim_keeps_the_middle_and_refuses_unaligned_parts() {
        let r = Reservation::new(8 * PAGE).unwrap();
        let base = r.addr();
        let r = r.trim(2 * PAGE, 3 * PAGE).unwrap();
        assert_eq!((r.addr(), r.len()), (base + 2 * PAGE, 3 * PAGE));
        assert!(Reservation::new(2 * PAGE).unwrap().trim(1, PAGE).is_err());
    }

    #[test]
    fn bind_node_past_the_kernels_node_limit_is_refused() {
        let m = Mapping::anonymous(PAGE).unwrap();
        let e = m.bind_node(0, PAGE, u32::MAX).unwrap_err();
        assert_eq!(e.into_io().raw_os_error(), Some(libc::EINVAL));
        if crate::host::numa_nodes().iter().any(|n| n.id == 0) {
            assert!(m.bind_node(0, PAGE, 0).is_ok(), "node 0 exists here");
        }
    }

    #[test]
    fn any_resident_sees_faulted_pages_only() {
        let m = Mapping::anonymous(64 * PAGE).unwrap();
        assert!(!m.any_resident(0, 64 * PAGE).unwrap());
        m.slice(40 * PAGE + 8, 8)
            .unwrap()
            .write_obj(1u64, 0)
            .unwrap();
        assert!(m.any_resident(0, 64 * PAGE).unwrap());
        assert!(m.any_resident(40 * PAGE, PAGE).unwrap());
        assert!(!m.any_resident(0, 40 * PAGE).unwrap());
        assert!(m.any_resident(0, 65 * PAGE).is_err());
    }

    #[test]
    fn dont_need_zeroes_private_anonymous_memory() {
        let m = Mapping::anonymous(PAGE).unwrap();
        let s = m.slice(0, PAGE).unwrap();
        s.write_obj(7u64, 8).unwrap();
        m.advise(0, PAGE, Advice::DontNeed).unwrap();
        assert_eq!(s.read_obj::<u64>(8).unwrap(), 0);
    }
}
