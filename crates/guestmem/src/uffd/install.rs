//! Putting pages in: copies (checked against a remove that came in since their source was
//! read), zero pages, moves, the page cache's pages of shared memory, poison, and the wake
//! of threads waiting on a range.

use std::io;

use linux_raw_sys::general as uapi;
use linux_raw_sys::ioctl as nr;

use super::{ioctl, range, Registered, Uffd, UFFDIO_MOVE, UFFDIO_POISON};
use crate::mmap::Mapping;

/// A copy stopped before a page a remove took since its source was read
/// ([`Uffd::copy_checked`]): the bytes copied before it. Carried inside an [`io::Error`].
#[derive(Debug)]
pub(crate) struct RemovedMeanwhile {
    /// Bytes copied (and so installed) before the copy stopped.
    pub(crate) done: usize,
}

impl RemovedMeanwhile {
    /// The error of a copy stopped `done` bytes in.
    pub(crate) fn error(done: usize) -> io::Error {
        io::Error::other(RemovedMeanwhile { done })
    }

    /// The bytes copied, if `e` is a copy stopped so.
    pub(crate) fn of(e: &io::Error) -> Option<usize> {
        e.get_ref()
            .and_then(|i| i.downcast_ref::<RemovedMeanwhile>())
            .map(|r| r.done)
    }
}

impl std::fmt::Display for RemovedMeanwhile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "a remove came in over the pages being copied, {} bytes in",
            self.done
        )
    }
}

impl std::error::Error for RemovedMeanwhile {}

/// A copy stopped because this process reads the descriptor no more (`Uffd::stop_reading`:
/// the VM is being handed to another server, which may have read a remove this one never
/// will). Carried inside an [`io::Error`]; the block is left to whoever serves the VM.
#[derive(Debug)]
pub(crate) struct ReadingStopped;

impl ReadingStopped {
    /// Whether `e` is a copy stopped so.
    pub(crate) fn is(e: &io::Error) -> bool {
        e.get_ref().is_some_and(|i| i.is::<ReadingStopped>())
    }
}

impl std::fmt::Display for ReadingStopped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the VM is being handed to another server: this one copies no more")
    }
}

impl std::error::Error for ReadingStopped {}

impl Uffd {
    /// Copies `src` into `offset..offset + src.len()` of `target` (pages that must not be
    /// present) and wakes the threads waiting there. Returns the bytes copied before a page
    /// that was already present (`EEXIST`), or all of them.
    ///
    /// `EAGAIN` without progress means the sender's address space is changing (a remove or
    /// unmap event waits to be read): `on_busy` runs (it reads events), then the copy goes on.
    /// For bytes a remove cannot make stale (zeros): see [`Uffd::copy_checked`].
    pub(crate) fn copy(
        &self,
        target: &dyn Registered,
        offset: usize,
        src: &[u8],
        on_busy: &dyn Fn(),
    ) -> io::Result<usize> {
        // SAFETY: `src` is live memory of its length, borrowed for the call.
        unsafe {
            self.copy_from(target, offset, (src.as_ptr(), src.len()), on_busy, &|| {
                false
            })
        }
    }

    /// As [`Uffd::copy`], stopping before any page is installed over a remove the source
    /// does not know of: `stale` says whether one was applied since the source was read
    /// (asked before each attempt, with no remove being read meanwhile). Then it returns
    /// [`RemovedMeanwhile`] with the bytes copied so far (those are zapped by the remove, if
    /// it covers them, after the copy).
    pub(crate) fn copy_checked(
        &self,
        target: &dyn Registered,
        offset: usize,
        src: &[u8],
        on_busy: &dyn Fn(),
        stale: &dyn Fn() -> bool,
    ) -> io::Result<usize> {
        // SAFETY: `src` is live memory of its length, borrowed for the call.
        unsafe { self.copy_from(target, offset, (src.as_ptr(), src.len()), on_busy, stale) }
    }

    /// As [`Uffd::copy_checked`], from `len` bytes at `src`, which only the kernel reads.
    ///
    /// Once the owner has removed pages, each attempt holds the read lock shared: a remove
    /// is read (and its zap let go) only between attempts, and `stale` is asked under the
    /// lock first. So a page installed here either came before the remove's zap (which then
    /// takes it) or after its pages were marked, when `stale` stops the copy. (The kernel
    /// makes a remove wait, before it is queued, for a copy already under way, and fails a
    /// copy that starts while one is queued: what is left is a copy that starts between
    /// the remove's read and its marking, which the lock shuts out. For a VM's first
    /// remove it is not held yet: that window stays.)
    ///
    /// # Safety
    /// `src..src + len` must stay mapped for the call. (A page of it the kernel cannot read,
    /// a file mapping's page past a shrunk file's end, fails the copy with `EFAULT`.)
    pub(crate) unsafe fn copy_from(
        &self,
        target: &dyn Registered,
        offset: usize,
        (src, len): (*const u8, usize),
        on_busy: &dyn Fn(),
        stale: &dyn Fn() -> bool,
    ) -> io::Result<usize> {
        let r = target.uffd_range(offset, len)?;
        let mut done = 0usize;
        while done < len {
            let mut c = uapi::uffdio_copy {
                dst: r.start + done as u64,
                src: src as u64 + done as u64,
                len: (len - done) as u64,
                mode: 0,
                copy: 0,
            };
            let guard = self
                .removes_seen
                .load(std::sync::atomic::Ordering::Acquire)
                .then(|| self.reading.read().unwrap_or_else(|e| e.into_inner()));
            if guard.is_some() && self.reading_stopped() {
                return Err(io::Error::other(ReadingStopped));
            }
            if guard.is_some() && stale() {
                return Err(RemovedMeanwhile::error(done));
            }
            // SAFETY: a uffdio_copy for UFFDIO_COPY: `dst` lies in the target (checked above),
            // `src` is the rest of the source, mapped for the call (the caller's contract).
            let result = unsafe { ioctl(&self.fd, nr::UFFDIO_COPY, &mut c) };
            drop(guard);
            match result {
                Ok(()) => done += c.copy as usize,
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
                    // The mm changed under the copy: `copy` says how far it got. The events
                    // are read with the lock let go (above).
                    if c.copy <= 0 {
                        on_busy();
                    }
                    done += c.copy.max(0) as usize;
                }
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                    return Ok(done + c.copy.max(0) as usize)
                }
                Err(e) => return Err(e),
            }
        }
        Ok(done)
    }

    /// Whether [`Uffd::move_in`] may be used: the kernel has `UFFDIO_MOVE` (6.8 and later),
    /// it was enabled, and this process opened the descriptor for its own memory.
    pub(crate) fn can_move(&self) -> bool {
        self.own && self.has(uapi::UFFD_FEATURE_MOVE)
    }

    /// Moves the pages of `src` at `src_offset..src_offset + len` into `target` at
    /// `offset` (missing there) with `UFFDIO_MOVE`, and wakes the threads waiting there: no
    /// copy, and a transparent huge page of `src` moved whole to a 2 MiB-aligned range of
    /// `target` stays huge there. `src`'s range is left unmapped (it reads as zero and
    /// faults fresh pages when next written). Returns the bytes moved and, when that is not
    /// all of them, why it stopped (`EEXIST`: a page of `target` was present; `EBUSY`: a
    /// page of `src` is shared or pinned, and must be copied instead); what was not moved
    /// is still in `src`.
    ///
    /// # Safety
    /// Nothing may read or write `src`'s range during the call, and no reference into it
    /// may be live: its pages change owner under it.
    pub(crate) unsafe fn move_in(
        &self,
        target: &Mapping,
        offset: usize,
        src: &Mapping,
        src_offset: usize,
        len: usize,
        on_busy: &dyn Fn(),
    ) -> (usize, Option<io::Error>) {
        if !self.can_move() {
            return (0, Some(io::Error::from_raw_os_error(libc::EINVAL)));
        }
        let (d, s) = match (target.uffd_range(offset, len), range(src, src_offset, len)) {
            (Ok(d), Ok(s)) => (d, s),
            (Err(e), _) | (_, Err(e)) => return (0, Some(e)),
        };
        let mut done = 0usize;
        while done < len {
            let mut m = uapi::uffdio_move {
                dst: d.start + done as u64,
                src: s.start + done as u64,
                len: (len - done) as u64,
                mode: 0,
                move_: 0,
            };
            // SAFETY: a uffdio_move for UFFDIO_MOVE on a descriptor this process opened for
            // its own address space (`can_move`): `dst` lies in `target`, `src` in `src`, both
            // our own mappings (checked above); the caller keeps everything else off `src`.
            match unsafe { ioctl(&self.fd, UFFDIO_MOVE, &mut m) } {
                Ok(()) => done += m.move_ as usize,
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
                    if m.move_ <= 0 {
                        on_busy();
                    }
                    done += m.move_.max(0) as usize;
                }
                Err(e) => return (done + m.move_.max(0) as usize, Some(e)),
            }
        }
        (done, None)
    }

    /// Maps the zero page at `offset..offset + len` of `target` (private anonymous memory)
    /// and wakes the waiters.
    /// `on_busy` runs when the kernel made no progress (`EAGAIN`: an event waits to be read,
    /// perhaps by this very thread).
    pub(crate) fn zeropage(
        &self,
        target: &dyn Registered,
        offset: usize,
        len: usize,
        on_busy: &dyn Fn(),
    ) -> io::Result<()> {
        let mut r = target.uffd_range(offset, len)?;
        while r.len > 0 {
            let mut z = uapi::uffdio_zeropage {
                range: r,
                mode: 0,
                zeropage: 0,
            };
            // SAFETY: a uffdio_zeropage for UFFDIO_ZEROPAGE over a range of the target
            // (checked above).
            match unsafe { ioctl(&self.fd, nr::UFFDIO_ZEROPAGE, &mut z) } {
                Ok(()) => return Ok(()),
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
                    let n = z.zeropage.max(0) as u64;
                    r.start += n;
                    r.len -= n;
                    if n == 0 {
                        on_busy();
                    }
                }
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => return Ok(()),
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Maps the page-cache pages already there at `offset..offset + len` of `target` (a
    /// shared memfd or hugetlb mapping registered for minor faults) and wakes the waiters;
    /// pages (of `page` bytes) mapped already are stepped over.
    pub(crate) fn continue_range(
        &self,
        target: &dyn Registered,
        offset: usize,
        len: usize,
        page: usize,
    ) -> io::Result<()> {
        self.step_range(target, offset, len, page, |range| {
            let mut c = uapi::uffdio_continue {
                range,
                mode: 0,
                mapped: 0,
            };
            // SAFETY: a uffdio_continue for UFFDIO_CONTINUE over a range of the target
            // (step_range checked it).
            let r = unsafe { ioctl(&self.fd, nr::UFFDIO_CONTINUE, &mut c) };
            (r, c.mapped)
        })
    }

    /// Marks `offset..offset + len` of `target` as lost memory (`UFFDIO_POISON`, Linux 6.6):
    /// a later access raises `SIGBUS` as a hardware memory error would, so no zero page can
    /// stand in for data that never arrived. Pages there already hold data and are stepped
    /// over.
    pub(crate) fn poison(
        &self,
        target: &dyn Registered,
        offset: usize,
        len: usize,
        page: usize,
    ) -> io::Result<()> {
        self.step_range(target, offset, len, page, |range| {
            let mut p = uapi::uffdio_poison {
                range,
                mode: 0,
                updated: 0,
            };
            // SAFETY: a uffdio_poison for UFFDIO_POISON over a range of the target
            // (step_range checked it).
            let r = unsafe { ioctl(&self.fd, UFFDIO_POISON, &mut p) };
            (r, p.updated)
        })
    }

    /// Runs `op` over the range until it is all done: after partial progress (`EAGAIN`, or
    /// `EEXIST` past some pages) from where it stopped, and over a page already present
    /// (`EEXIST` at the start) by stepping one `page`.
    fn step_range(
        &self,
        target: &dyn Registered,
        offset: usize,
        len: usize,
        page: usize,
        op: impl Fn(uapi::uffdio_range) -> (io::Result<()>, i64),
    ) -> io::Result<()> {
        let mut r = target.uffd_range(offset, len)?;
        while r.len > 0 {
            let (res, done) = op(r);
            match res {
                Ok(()) => return Ok(()),
                Err(e)
                    if matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EEXIST))
                        && done > 0 =>
                {
                    r.start += done as u64;
                    r.len = r.len.saturating_sub(done as u64);
                }
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                    r.start += page as u64;
                    r.len = r.len.saturating_sub(page as u64);
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Wakes the threads waiting at `offset..offset + len` of `target`.
    pub(crate) fn wake(
        &self,
        target: &dyn Registered,
        offset: usize,
        len: usize,
    ) -> io::Result<()> {
        let mut r = target.uffd_range(offset, len)?;
        // SAFETY: a uffdio_range for UFFDIO_WAKE, inside the target (checked above).
        unsafe { ioctl(&self.fd, nr::UFFDIO_WAKE, &mut r) }
    }
}
