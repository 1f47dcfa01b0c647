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

/// `madvise` advice that faults every page of a range in writable, as a write would, without
/// writing (Linux 5.14). Its value is 23 on every Linux architecture.
pub const MADV_POPULATE_WRITE: libc::c_int = libc::MADV_POPULATE_WRITE;

/// `mlock2` flag: lock pages as they are faulted in, instead of faulting them all in now.
pub const MLOCK_ONFAULT: libc::c_uint = libc::MLOCK_ONFAULT;

/// The soft `RLIMIT_MEMLOCK` of this process in bytes, or `None` when it is unlimited.
pub fn memlock_limit() -> io::Result<Option<u64>> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid, writable rlimit that outlives the call.
    check(unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) })?;
    Ok(if lim.rlim_cur == libc::RLIM_INFINITY {
        None
    } else {
        Some(lim.rlim_cur)
    })
}

/// A set of CPUs, for [`sched_setaffinity`].
#[derive(Clone, Copy)]
pub struct CpuSet(libc::cpu_set_t);

impl std::fmt::Debug for CpuSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.cpus()).finish()
    }
}

impl CpuSet {
    /// Most CPUs a set can name (`CPU_SETSIZE`).
    pub const CAPACITY: usize = libc::CPU_SETSIZE as usize;

    /// The set of `cpus`; CPUs at or above [`CpuSet::CAPACITY`] are left out.
    pub fn from_cpus(cpus: impl IntoIterator<Item = usize>) -> CpuSet {
        // SAFETY: cpu_set_t is a plain bit array; all zeroes is the empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        for cpu in cpus.into_iter().filter(|&c| c < Self::CAPACITY) {
            // SAFETY: CPU_SET writes only bit `cpu` of `set`; the filter above keeps `cpu`
            // below CPU_SETSIZE, the number of bits in the set.
            unsafe { libc::CPU_SET(cpu, &mut set) };
        }
        CpuSet(set)
    }

    /// The CPUs in the set.
    pub fn cpus(&self) -> Vec<usize> {
        (0..Self::CAPACITY)
            // SAFETY: CPU_ISSET reads only bit `c` of the set; the range keeps `c` below
            // CPU_SETSIZE, the number of bits in the set.
            .filter(|&c| unsafe { libc::CPU_ISSET(c, &self.0) })
            .collect()
    }
}

/// The CPUs the calling thread may run on.
pub fn sched_getaffinity() -> io::Result<CpuSet> {
    let mut set = CpuSet::from_cpus([]);
    // SAFETY: `set.0` is a valid, writable cpu_set_t of the size passed; pid 0 is this thread.
    check(unsafe {
        libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set.0)
    })?;
    Ok(set)
}

/// Restricts the calling thread to the CPUs in `set`.
pub fn sched_setaffinity(set: &CpuSet) -> io::Result<()> {
    // SAFETY: `set.0` is a valid cpu_set_t of the size passed; pid 0 is this thread, and
    // affinity touches no memory.
    check(unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set.0) })
}

/// This process's memory as a file (`/proc/self/mem`), for touching pages without risking a
/// `SIGBUS`.
///
/// An access through this file is made by the kernel on the process's behalf (`access_remote_vm`):
/// a fault that would raise `SIGBUS` on a CPU access (a hugetlb pool run dry under
/// `MAP_NORESERVE`, a file truncated under its mapping) fails the `pread`/`pwrite` with `EIO`
/// instead. That is the only reason guestmem uses it, and it needs no signal handler (Rust has
/// no sound `sigsetjmp`/`siglongjmp`).
#[derive(Debug)]
pub struct ProcMem {
    mem: std::fs::File,
    pagemap: std::fs::File,
}

/// `/proc/self/pagemap` bit: the page is present in RAM.
const PAGEMAP_PRESENT: u64 = 1 << 63;
/// `/proc/self/pagemap` bit: the page is swapped out.
const PAGEMAP_SWAPPED: u64 = 1 << 62;
/// Bytes per `/proc/self/pagemap` entry (one per base page).
const PAGEMAP_ENTRY_BYTES: usize = 8;

impl ProcMem {
    /// Opens `/proc/self/mem` (read-write) and `/proc/self/pagemap`.
    pub fn open() -> io::Result<ProcMem> {
        use std::fs::OpenOptions;
        Ok(ProcMem {
            mem: OpenOptions::new()
                .read(true)
                .write(true)
                .open("/proc/self/mem")?,
            pagemap: std::fs::File::open("/proc/self/pagemap")?,
        })
    }

    /// Reads the byte at `range.addr() + offset`, faulting its page in for reading.
    pub fn read_byte(&self, range: MmapRange, offset: usize) -> io::Result<u8> {
        use std::os::unix::fs::FileExt;
        let at = range
            .sub(offset, 1)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))?;
        let mut b = [0u8; 1];
        match self.mem.read_at(&mut b, at.addr() as u64)? {
            1 => Ok(b[0]),
            _ => Err(io::Error::from_raw_os_error(libc::EIO)),
        }
    }

    /// Writes `byte` at `range.addr() + offset`, faulting its page in for writing.
    ///
    /// The caller must write back the byte that is there (or zero into a page never faulted
    /// in, which reads as zero): then no reader can see a change, and the write only has the
    /// kernel allocate the page. `MmapRange`'s contract makes the range the caller's to touch.
    pub fn write_byte(&self, range: MmapRange, offset: usize, byte: u8) -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        let at = range
            .sub(offset, 1)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))?;
        match self.mem.write_at(&[byte], at.addr() as u64)? {
            1 => Ok(()),
            _ => Err(io::Error::from_raw_os_error(libc::EIO)),
        }
    }

    /// For each base page of `range` (whose address must be base-page aligned), whether it has
    /// ever been faulted in: present in RAM or swapped out. A private anonymous page that has
    /// not reads as zero.
    pub fn faulted_in(&self, range: MmapRange) -> io::Result<Vec<bool>> {
        use std::os::unix::fs::FileExt;
        let page = base_page_size() as usize;
        let pages = range.len().div_ceil(page);
        let mut buf = vec![0u8; pages * PAGEMAP_ENTRY_BYTES];
        let at = (range.addr() / page * PAGEMAP_ENTRY_BYTES) as u64;
        self.pagemap.read_exact_at(&mut buf, at)?;
        Ok(buf
            .chunks_exact(PAGEMAP_ENTRY_BYTES)
            .map(|e| {
                let v = u64::from_ne_bytes(e.try_into().expect("8-byte entry"));
                v & (PAGEMAP_PRESENT | PAGEMAP_SWAPPED) != 0
            })
            .collect())
    }
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
