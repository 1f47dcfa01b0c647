//! Reserved address space: a `PROT_NONE` range owned until something is placed in it with
//! `MAP_FIXED` (a region and its guard pages), or given back.

use std::io;
use std::os::fd::AsRawFd;

use super::{check, mmap_fresh, munmap, MapSource, Mapping, MmapError, Reserve};

/// A range of `PROT_NONE` address space, owned: nothing can be mapped there except through
/// [`Reservation::place`], and it is unmapped when dropped.
#[derive(Debug)]
pub struct Reservation {
    addr: usize,
    len: usize,
}

impl Reservation {
    /// Reserves `len` bytes (`PROT_NONE`, private, no swap reservation) where the kernel
    /// chooses.
    pub fn new(len: usize) -> Result<Reservation, MmapError> {
        let addr = mmap_fresh(len, libc::PROT_NONE, libc::MAP_NORESERVE, "mmap(PROT_NONE)")?;
        Ok(Reservation { addr, len })
    }

    /// The first address, for placement arithmetic.
    pub fn addr(&self) -> usize {
        self.addr
    }

    /// The length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the reservation is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Keeps `offset..offset+len` and gives the rest back to the kernel. `offset` and `len`
    /// must be multiples of the base page size.
    pub fn trim(self, offset: usize, len: usize) -> Result<Reservation, MmapError> {
        check(offset, len, self.len, "reservation")?;
        let page = crate::sys::base_page_size() as usize;
        if !offset.is_multiple_of(page) || !len.is_multiple_of(page) {
            return Err(MmapError::OutOfRange {
                offset,
                len,
                size: self.len,
                what: "reservation (page-aligned)",
            });
        }
        let this = std::mem::ManuallyDrop::new(self);
        let (addr, total) = (this.addr, this.len);
        let keep = Reservation {
            addr: addr + offset,
            len,
        };
        let tail = offset + len;
        // SAFETY: head and tail lie inside this reservation (checked above), which we own and
        // give up here; `keep`, the only owner from now on, covers neither of them.
        let head_res = unsafe { munmap(addr, offset) };
        // SAFETY: as above, for the part after the kept range.
        let tail_res = unsafe { munmap(addr + tail, total - tail) };
        head_res?;
        tail_res?;
        Ok(keep)
    }

    /// Maps `len` bytes of private anonymous memory at `offset` inside the reservation with
    /// `MAP_FIXED`, readable and writable, and returns the mapping, which takes over the whole
    /// reservation: the parts not mapped stay `PROT_NONE` (guards) and are unmapped with it.
    ///
    /// On failure the reservation is unmapped and nothing is left behind.
    pub fn place(self, offset: usize, len: usize) -> Result<Mapping, MmapError> {
        // SAFETY: anonymous memory is backed for as long as it is mapped: nothing can shrink
        // it, so every byte of the mapping stays accessible.
        unsafe { self.place_source(offset, len, MapSource::Anonymous, Reserve::Reserve) }
    }

    /// As [`Reservation::place`], with memory from `source`: a file, shared or private, and
    /// for hugetlb files `Reserve::NoReserve` to take pages at first touch (`MAP_NORESERVE`).
    ///
    /// # Safety
    /// Every byte of the mapping must stay backed while it lives, or an access raises
    /// `SIGBUS`: the file must hold `offset..offset + len` of the source now and must not
    /// shrink (a memfd sealed against shrinking, or a file whose length the caller controls),
    /// must be a file whose pages read and write as memory (not a device), and with
    /// `Reserve::NoReserve` on hugetlb every page must be populated successfully before
    /// anything touches it from a CPU.
    pub unsafe fn place_file(
        self,
        offset: usize,
        len: usize,
        source: MapSource<'_>,
        reserve: Reserve,
    ) -> Result<Mapping, MmapError> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.place_source(offset, len, source, reserve) }
    }

    /// The one `MAP_FIXED`.
    ///
    /// # Safety
    /// As [`Reservation::place_file`].
    unsafe fn place_source(
        self,
        offset: usize,
        len: usize,
        source: MapSource<'_>,
        reserve: Reserve,
    ) -> Result<Mapping, MmapError> {
        check(offset, len, self.len, "reservation")?;
        let (flags, fd, file_offset) = match source {
            MapSource::Anonymous => (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0),
            MapSource::SharedFile { fd, offset } => (libc::MAP_SHARED, fd.as_raw_fd(), offset),
            MapSource::PrivateFile { fd, offset } => (libc::MAP_PRIVATE, fd.as_raw_fd(), offset),
        };
        let flags = match reserve {
            Reserve::Reserve => flags,
            Reserve::NoReserve => flags | libc::MAP_NORESERVE,
        };
        let body = self.addr + offset;
        let file_offset = libc::off_t::try_from(file_offset).map_err(|_| MmapError::Sys {
            op: "mmap(MAP_FIXED)",
            addr: body,
            len,
            source: io::Error::from_raw_os_error(libc::EOVERFLOW),
        })?;
        // On failure Linux 6.12+ restores the replaced pages rather than leaving a gap another
        // mmap could take before our Drop unmaps the range; that the pages of the new mapping
        // stay backed is the caller's contract.
        // SAFETY: body..body+len lies inside this reservation (checked above), which we own
        // and no one can use (PROT_NONE); the Mapping returned owns the result.
        let p = unsafe {
            libc::mmap(
                body as *mut libc::c_void,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                flags | libc::MAP_FIXED,
                fd,
                file_offset,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(MmapError::Sys {
                op: "mmap(MAP_FIXED)",
                addr: body,
                len,
                source: io::Error::last_os_error(),
            });
        }
        let this = std::mem::ManuallyDrop::new(self);
        Ok(Mapping {
            owned: (this.addr, this.len),
            addr: body,
            len,
        })
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        // SAFETY: the reservation owns addr..addr+len and is going away. A failed munmap of
        // our own range could only leak address space.
        let _ = unsafe { munmap(self.addr, self.len) };
    }
}
