//! One safe wrapper per Linux syscall that guestmem makes on memory.
//!
//! Every wrapper takes an [`MmapRange`], whose constructor checked that the range lies inside
//! a mapping this process owns and whose arithmetic cannot overflow; the `unsafe` call inside
//! relies on that check and says so. Errors carry the raw `errno` as an [`std::io::Error`] so
//! callers can name the region and offset at fault.

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// The base page size of this host, in bytes.
pub fn base_page_size() -> u64 {
    // SAFETY: sysconf has no memory-safety preconditions; it only reads a kernel constant.
    let v = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if v <= 0 {
        4096
    } else {
        v as u64
    }
}

/// A host virtual address range that the caller owns as a mapping (or a reservation).
///
/// Constructing one is `unsafe`: the caller promises the range is a mapping it owns, so that
/// changing its protection, advice or contents cannot break memory that Rust code elsewhere
/// relies on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MmapRange {
    addr: usize,
    len: usize,
}

impl MmapRange {
    /// Describes `len` bytes at `addr`.
    ///
    /// Returns `None` when `addr + len` overflows.
    ///
    /// # Safety
    /// `addr..addr+len` must be (part of) a mapping owned by the caller, which no Rust
    /// reference borrows in a way that an `madvise`, `mprotect`, `mlock` or `munmap` on it
    /// would invalidate.
    pub unsafe fn new(addr: usize, len: usize) -> Option<Self> {
        addr.checked_add(len)?;
        Some(MmapRange { addr, len })
    }

    /// The start address.
    pub fn addr(&self) -> usize {
        self.addr
    }

    /// The length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the range is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The sub-range `offset..offset+len` of this range, if it lies inside it.
    pub fn sub(&self, offset: usize, len: usize) -> Option<MmapRange> {
        let end = offset.checked_add(len)?;
        if end > self.len {
            return None;
        }
        Some(MmapRange {
            addr: self.addr + offset,
            len,
        })
    }
}

fn check(ret: libc::c_int) -> io::Result<()> {
    if ret == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Reserves `len` bytes of address space: `PROT_NONE`, private, no swap reservation.
///
/// The returned range is owned by the caller, who must [`munmap`] it.
pub fn reserve(len: usize) -> io::Result<MmapRange> {
    // SAFETY: a fresh anonymous PROT_NONE mapping at an address the kernel chooses cannot
    // alias any existing memory; we check the result against MAP_FAILED below.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(MmapRange {
        addr: p as usize,
        len,
    })
}

/// Maps memory with `MAP_FIXED` over `range`, which must lie in a reservation the caller owns.
///
/// `flags` must not contain `MAP_FIXED` itself; it is added here, and only here.
pub fn map_fixed(
    range: MmapRange,
    prot: libc::c_int,
    flags: libc::c_int,
    fd: Option<BorrowedFd<'_>>,
    offset: u64,
) -> io::Result<()> {
    let offset =
        libc::off_t::try_from(offset).map_err(|_| io::Error::from_raw_os_error(libc::EOVERFLOW))?;
    let raw_fd = fd.map_or(-1, |f| f.as_raw_fd());
    // SAFETY: MmapRange's constructor guarantees `range` is owned by the caller (a reservation
    // made by `reserve`), so replacing its pages with MAP_FIXED cannot clobber foreign memory.
    let p = unsafe {
        libc::mmap(
            range.addr as *mut libc::c_void,
            range.len,
            prot,
            flags | libc::MAP_FIXED,
            raw_fd,
            offset,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    debug_assert_eq!(p as usize, range.addr);
    Ok(())
}

/// Unmaps `range`.
pub fn munmap(range: MmapRange) -> io::Result<()> {
    if range.len == 0 {
        return Ok(());
    }
    // SAFETY: the range is owned by the caller (MmapRange's contract) and nothing borrows it.
    check(unsafe { libc::munmap(range.addr as *mut libc::c_void, range.len) })
}

/// Gives `madvise(advice)` on `range`.
pub fn madvise(range: MmapRange, advice: libc::c_int) -> io::Result<()> {
    if range.len == 0 {
        return Ok(());
    }
    // SAFETY: the range is owned by the caller (MmapRange's contract); advice cannot touch
    // memory outside it.
    check(unsafe { libc::madvise(range.addr as *mut libc::c_void, range.len, advice) })
}

/// `mlock2(range, flags)`; `flags` is 0 or `MLOCK_ONFAULT`.
pub fn mlock2(range: MmapRange, flags: libc::c_uint) -> io::Result<()> {
    if range.len == 0 {
        return Ok(());
    }
    // SAFETY: the range is owned by the caller (MmapRange's contract); locking does not
    // change its contents.
    check(unsafe { libc::mlock2(range.addr as *const libc::c_void, range.len, flags) })
}

/// `munlock(range)`.
pub fn munlock(range: MmapRange) -> io::Result<()> {
    if range.len == 0 {
        return Ok(());
    }
    // SAFETY: the range is owned by the caller (MmapRange's contract).
    check(unsafe { libc::munlock(range.addr as *const libc::c_void, range.len) })
}

/// Binds `range` to NUMA node `node` with `MPOL_BIND` (`mbind(2)`; libc has no wrapper, so
/// this goes through `syscall`).
pub fn mbind_node(range: MmapRange, node: u32) -> io::Result<()> {
    const MPOL_BIND: libc::c_ulong = 2;
    let bits = usize::BITS as usize;
    let words = (node as usize) / bits + 1;
    let mut mask = vec![0usize; words];
    mask[node as usize / bits] |= 1 << (node as usize % bits);
    let maxnode = (words * bits + 1) as libc::c_ulong;
    // SAFETY: the range is owned by the caller (MmapRange's contract); `mask` lives across the
    // call and holds `maxnode - 1` bits, as mbind requires.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_mbind,
            range.addr,
            range.len,
            MPOL_BIND,
            mask.as_ptr(),
            maxnode,
            0 as libc::c_uint,
        )
    };
    if ret == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Creates a memfd named `name` with `flags` (`MFD_CLOEXEC` is always added).
pub fn memfd_create(name: &CStr, flags: libc::c_uint) -> io::Result<OwnedFd> {
    // SAFETY: `name` is a valid NUL-terminated string for the duration of the call.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), flags | libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: memfd_create returned a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Punches a hole over `offset..offset+len` of `fd`, freeing its pages.
pub fn punch_hole(fd: BorrowedFd<'_>, offset: u64, len: u64) -> io::Result<()> {
    let off =
        libc::off_t::try_from(offset).map_err(|_| io::Error::from_raw_os_error(libc::EOVERFLOW))?;
    let l =
        libc::off_t::try_from(len).map_err(|_| io::Error::from_raw_os_error(libc::EOVERFLOW))?;
    // SAFETY: fallocate on a descriptor we borrow touches no memory of this process.
    check(unsafe {
        libc::fallocate(
            fd.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            off,
            l,
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sub_range_outside_is_refused() {
        // SAFETY: the range is never used for a syscall; only its arithmetic is tested.
        let r = unsafe { MmapRange::new(0x1000, 0x2000) }.unwrap();
        assert_eq!(r.sub(0x1000, 0x1000).unwrap().addr(), 0x2000);
        assert!(r.sub(0x1000, 0x1001).is_none());
        assert!(r.sub(usize::MAX, 2).is_none());
    }

    #[test]
    fn range_overflow_is_refused() {
        // SAFETY: as above, arithmetic only.
        assert!(unsafe { MmapRange::new(usize::MAX, 2) }.is_none());
    }
}
