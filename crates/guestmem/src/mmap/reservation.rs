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
    /// On failure the reservation is unmapped and nothing is left behind; but where the
    /// kernel left a gap in the range and another thread mapped something into it before
    /// this call could look, the range placed into is left reserved (address space leaked)
    /// rather than that mapping unmapped.
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
        let source_kind = match source {
            MapSource::Anonymous => Kind::Anonymous,
            _ => Kind::File,
        };
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
        // Out of Drop from here: a failed MAP_FIXED may have left a gap in the body (Linux
        // before 6.12 unmaps the old range first; 6.12 and later still do where a file's
        // own mmap fails, a hugetlb reservation say), which another thread's mmap can take
        // before we look: only what is still ours is given back (`give_back_after_failure`).
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: body..body+len lies inside this reservation (checked above), which we own
        // and no one can use (PROT_NONE); the Mapping returned owns the result. That the
        // pages of the new mapping stay backed is the caller's contract.
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
            let source = io::Error::last_os_error();
            let anonymous = matches!(source_kind, Kind::Anonymous);
            give_back_after_failure(this.addr, this.len, body, len, anonymous);
            return Err(MmapError::Sys {
                op: "mmap(MAP_FIXED)",
                addr: body,
                len,
                source,
            });
        }
        Ok(Mapping {
            owned: (this.addr, this.len),
            addr: body,
            len,
        })
    }
}

/// What a placement maps.
enum Kind {
    Anonymous,
    File,
}

/// Gives back a reservation `addr..addr+total` whose `MAP_FIXED` over `body..body+len`
/// failed. The parts around the body are ours still. The body is ours if the kernel put the
/// reservation back (Linux 6.12 and later do for private anonymous memory: nothing is
/// unmapped before the new mapping is sure) or if it is a gap still (taken back with
/// `MAP_FIXED_NOREPLACE`, which maps nothing where anything is). Else something another
/// thread mapped into the gap may be there, and the body is left mapped: address space
/// leaked, never another owner's memory unmapped (no look at `/proc/self/maps` can tell
/// another's `PROT_NONE` mapping from ours).
fn give_back_after_failure(addr: usize, total: usize, body: usize, len: usize, anonymous: bool) {
    let ours = (anonymous && restored_on_failure()) || {
        // SAFETY: MAP_FIXED_NOREPLACE maps nothing over an existing mapping: it takes the
        // range only where nothing is; the result is checked below.
        let p = unsafe {
            libc::mmap(
                body as *mut libc::c_void,
                len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE
                    | libc::MAP_ANONYMOUS
                    | libc::MAP_NORESERVE
                    | libc::MAP_FIXED_NOREPLACE,
                -1,
                0,
            )
        };
        if p != libc::MAP_FAILED && p as usize != body {
            // A kernel before 4.17 takes the flag for a hint and maps elsewhere: that
            // mapping is ours, given back at once.
            // SAFETY: a fresh mapping of ours that nothing else knows of.
            let _ = unsafe { munmap(p as usize, len) };
        }
        p as usize == body
    };
    let (head, tail) = (body - addr, addr + total - (body + len));
    if ours {
        // SAFETY: the whole reservation is ours again (above), and goes.
        let _ = unsafe { munmap(addr, total) };
    } else {
        // SAFETY: the head and the tail were never touched by the failed MAP_FIXED: ours.
        let _ = unsafe { munmap(addr, head) };
        // SAFETY: as above.
        let _ = unsafe { munmap(body + len, tail) };
    }
}

/// Whether this kernel puts a private anonymous mapping back when a `MAP_FIXED` over it
/// fails (Linux 6.12 and later), as `/proc/sys/kernel/osrelease` says.
fn restored_on_failure() -> bool {
    static AT_LEAST: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AT_LEAST.get_or_init(|| {
        let v = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        let mut parts = v.trim().split(['.', '-']).map(|p| p.parse::<u32>().ok());
        match (parts.next().flatten(), parts.next().flatten()) {
            (Some(major), Some(minor)) => (major, minor) >= (6, 12),
            _ => false,
        }
    })
}

impl Drop for Reservation {
    fn drop(&mut self) {
        // SAFETY: the reservation owns addr..addr+len and is going away. A failed munmap of
        // our own range could only leak address space.
        let _ = unsafe { munmap(self.addr, self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether nothing at all is mapped at `addr..addr+len` (taken with
    /// `MAP_FIXED_NOREPLACE`, and given back at once).
    fn nothing_at(addr: usize, len: usize) -> bool {
        // SAFETY: maps only where nothing is; unmapped again at once if it did.
        let p = unsafe {
            libc::mmap(
                addr as *mut libc::c_void,
                len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return false;
        }
        // SAFETY: the fresh mapping just made.
        let _ = unsafe { munmap(p as usize, len) };
        p as usize == addr
    }

    /// Runs `try_once` until it says the range it checks was not taken meanwhile (`Some`),
    /// at most 5 times: other threads of this test binary map memory where the kernel
    /// chooses, which may be a range a test just freed. A real fault fails every try.
    fn in_a_quiet_moment(mut try_once: impl FnMut() -> Option<()>) {
        for _ in 0..5 {
            if try_once().is_some() {
                return;
            }
        }
        panic!("5 tries, each with the range taken or left mapped");
    }

    /// After a failed `MAP_FIXED` that left a gap in the body, another thread's mapping
    /// there is never unmapped: the parts around it go, the mapping stays whole. A gap
    /// with nothing in it is taken back and all of it goes.
    #[test]
    fn a_failed_placement_gives_back_only_what_is_still_its_own() {
        let page = crate::sys::base_page_size() as usize;
        for foreign in [true, false] {
            in_a_quiet_moment(|| {
                let r = Reservation::new(8 * page).unwrap();
                let (addr, total) = (r.addr(), r.len());
                let this = std::mem::ManuallyDrop::new(r);
                let (body, len) = (addr + 2 * page, 4 * page);
                // The gap a kernel leaves, and another thread's mapping in it.
                // SAFETY: the body is this test's reservation's.
                unsafe { munmap(body, len) }.unwrap();
                let other = if foreign {
                    // SAFETY: maps only where nothing is (the gap just made).
                    let p = unsafe {
                        libc::mmap(
                            (body + page) as *mut libc::c_void,
                            page,
                            libc::PROT_READ | libc::PROT_WRITE,
                            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
                            -1,
                            0,
                        )
                    };
                    if p as usize != body + page {
                        // Another thread took the gap first: given back, tried again.
                        if p != libc::MAP_FAILED {
                            // SAFETY: the mapping just made.
                            let _ = unsafe { munmap(p as usize, page) };
                        }
                        // SAFETY: head and tail are this test's.
                        let _ = unsafe { munmap(addr, 2 * page) };
                        // SAFETY: as above.
                        let _ = unsafe { munmap(body + len, 2 * page) };
                        return None;
                    }
                    // SAFETY: the page just mapped, read and writable.
                    unsafe { *(p as *mut u64) = 0x5eed };
                    Some(p as usize)
                } else {
                    None
                };
                give_back_after_failure(this.addr, this.len, body, len, false);
                match other {
                    Some(p) => {
                        // SAFETY: still mapped (what the test shows), this test's to read.
                        assert_eq!(unsafe { *(p as *const u64) }, 0x5eed);
                        // SAFETY: the test's own foreign page, given back.
                        unsafe { munmap(p, page) }.unwrap();
                        (nothing_at(addr, 2 * page) && nothing_at(body + len, 2 * page))
                            .then_some(())
                    }
                    None => nothing_at(addr, total).then_some(()),
                }
            });
        }
    }

    /// An anonymous placement past all the memory the kernel would promise (16 TiB, under
    /// its heuristic overcommit) is refused, and the reservation is given back whole.
    #[test]
    fn a_refused_anonymous_placement_leaves_nothing_mapped() {
        let mode = std::fs::read_to_string("/proc/sys/vm/overcommit_memory").unwrap_or_default();
        if mode.trim() != "0" {
            return guestmem_testkit::skip(format!(
                "vm.overcommit_memory is {}: 16 TiB would be promised, not refused",
                mode.trim()
            ));
        }
        let mut left = true;
        for _ in 0..5 {
            let r = Reservation::new(1 << 44).unwrap();
            let (addr, total) = (r.addr(), r.len());
            assert!(r.place(0, 1 << 44).is_err(), "16 TiB promised");
            left = !nothing_at(addr, total);
            if !left {
                break;
            }
        }
        assert!(!left, "the reservation was left mapped, 5 tries");
    }

    /// A placement the kernel refuses (a hugetlb file with no huge page to reserve: the
    /// file's own mmap fails, after the range was unmapped) leaves nothing mapped.
    #[test]
    fn a_refused_placement_leaves_nothing_mapped() {
        let _g = guestmem_testkit::host_lock();
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let free = meminfo
            .lines()
            .find_map(|l| l.strip_prefix("HugePages_Free:"))
            .and_then(|v| v.trim().parse::<u64>().ok());
        let over = std::fs::read_to_string("/proc/sys/vm/nr_overcommit_hugepages")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok());
        if free != Some(0) || over != Some(0) {
            return guestmem_testkit::skip(
                "huge pages free or overcommitted here: a hugetlb mapping would not be refused",
            );
        }
        // SAFETY: a NUL-terminated name; the flags ask for a hugetlb memfd.
        let fd = unsafe { libc::memfd_create(c"gm-refused".as_ptr(), libc::MFD_HUGETLB) };
        if fd < 0 {
            return guestmem_testkit::skip(format!(
                "no hugetlb memfd: {}",
                io::Error::last_os_error()
            ));
        }
        // SAFETY: a descriptor just made, owned by nothing else.
        let file = std::fs::File::from(unsafe {
            <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd)
        });
        file.set_len(2 << 20).unwrap();
        // Whether the refused placement left its reservation mapped; tried again where
        // another thread mapped into the range as it was freed.
        let placed_and_left = || {
            let r = Reservation::new(8 << 20).unwrap();
            let (addr, total) = (r.addr(), r.len());
            let source = MapSource::SharedFile {
                fd: std::os::fd::AsFd::as_fd(&file),
                offset: 0,
            };
            // SAFETY: refused before anything is mapped (no huge page to reserve).
            let e = unsafe { r.place_file(2 << 20, 2 << 20, source, Reserve::Reserve) };
            assert!(e.is_err(), "placed with no huge page");
            !nothing_at(addr, total)
        };
        let left = (0..5).all(|_| placed_and_left());
        assert!(!left, "the reservation was left mapped, 5 tries");
    }
}
