//! userfaultfd, wrapped by hand.
//!
//! Why by hand: the bytecodealliance `userfaultfd` crate (Firecracker's) generates its
//! bindings with bindgen at build time and so needs libclang, which a fresh machine of the
//! kind guestmem's README targets does not have: it would break the two set-up commands.
//! `linux-raw-sys` (already in the dependency tree through rustix) ships the structs, flags
//! and ioctl numbers pre-generated, so only the few calls below are written here. Every call
//! that names memory takes a [`Registered`] and an offset, checked first: either the [`Mapping`]
//! that owns the memory, or a [`RemoteRange`], memory of another process (a Firecracker
//! process that sent its userfaultfd) that only a validated handshake creates. No raw
//! address reaches an ioctl.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use linux_raw_sys::general as uapi;
use linux_raw_sys::ioctl as nr;

use crate::mmap::Mapping;

mod events;
pub(crate) use events::Event;

/// `_IOWR(UFFDIO, _UFFDIO_POISON, struct uffdio_poison)`: linux-raw-sys 0.12 has the struct
/// and the feature bit but not the ioctl number, which is computed here as the kernel's
/// `_IOWR` does: direction read|write (3 << 30), size 32 << 16, type 0xAA << 8, number 8.
const UFFDIO_POISON: u32 =
    (3 << 30) | ((std::mem::size_of::<uapi::uffdio_poison>() as u32) << 16) | (0xAA << 8) | 8;

/// `_IOWR(UFFDIO, _UFFDIO_MOVE, struct uffdio_move)`: linux-raw-sys 0.12 has the struct and
/// the feature bit but not the ioctl number: read|write (3 << 30), size 40 << 16, type 0xAA
/// << 8, number 5.
const UFFDIO_MOVE: u32 = (3 << 30)
    | ((std::mem::size_of::<uapi::uffdio_move>() as u32) << 16)
    | (0xAA << 8)
    | uapi::_UFFDIO_MOVE;

/// What a range is registered for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RegisterMode {
    /// Faults on pages not present (private anonymous memory).
    Missing,
    /// Missing faults, and minor faults on pages in the page cache but not mapped here
    /// (shared memfd and hugetlb backings, resolved with `UFFDIO_CONTINUE`).
    MissingMinor,
}

/// An owned userfaultfd.
#[derive(Debug)]
pub(crate) struct Uffd {
    fd: OwnedFd,
    features: u64,
    /// Opened by this process for its own memory (not received from a peer): only then do
    /// addresses of our own mappings name memory of the descriptor's address space, which
    /// `UFFDIO_MOVE` needs for its source.
    own: bool,
    /// Held (written) by a reader from its read of the messages pending to the end of
    /// applying the removes among them ([`Uffd::read_events`]); held (read) by each copy
    /// once the memory's owner has removed pages ([`Uffd::copy_from`]), so that no remove
    /// is read, and its zap let go, while a copy that did not know of it installs pages.
    reading: std::sync::RwLock<()>,
    /// Set (for good) when the first remove is read: from then on copies hold `reading`.
    /// Before it, they do not (Firecracker enables remove events for every VM, and a VM
    /// without a balloon never sends one: holding it there would cost every copy).
    removes_seen: std::sync::atomic::AtomicBool,
    /// Set while this process must read nothing from it ([`Uffd::stop_reading`]).
    stopped: std::sync::atomic::AtomicBool,
}

/// Memory a userfaultfd call may name: it turns `offset..offset + len` into the kernel's
/// range once that lies inside the target.
pub(crate) trait Registered {
    /// `offset..offset + len` as a uffd range, or `EINVAL` when it leaves the target.
    fn uffd_range(&self, offset: usize, len: usize) -> io::Result<uapi::uffdio_range>;
}

impl Registered for Mapping {
    fn uffd_range(&self, offset: usize, len: usize) -> io::Result<uapi::uffdio_range> {
        range(self, offset, len)
    }
}

/// A range of another process's address space, registered there with a userfaultfd that
/// process sent us. The calls only ever fill pages missing there (`UFFDIO_COPY`,
/// `UFFDIO_ZEROPAGE` never replace a present page) and only inside ranges that process
/// registered itself, which the kernel checks; our own memory is never named. Made only
/// from a checked handshake; neither `Copy` nor `Clone`.
#[derive(Debug)]
pub(crate) struct RemoteRange {
    start: u64,
    len: u64,
}

impl RemoteRange {
    /// The range `start..start + len` of the peer's address space (checked by the caller
    /// against the handshake: page-aligned, no overflow, no overlap).
    pub(crate) fn new(start: u64, len: u64) -> RemoteRange {
        RemoteRange { start, len }
    }
}

impl Registered for RemoteRange {
    fn uffd_range(&self, offset: usize, len: usize) -> io::Result<uapi::uffdio_range> {
        match (offset as u64).checked_add(len as u64) {
            Some(end) if end <= self.len => Ok(uapi::uffdio_range {
                start: self.start + offset as u64,
                len: len as u64,
            }),
            _ => Err(io::Error::from_raw_os_error(libc::EINVAL)),
        }
    }
}

/// One ioctl on a userfaultfd.
///
/// # Safety
/// `arg` must be the uapi struct that `request` names (`uffdio_copy` for `UFFDIO_COPY`, and
/// so on): the kernel reads and writes `size_of` of that struct through the pointer. Any
/// address inside it must be one the call may use: a destination range this descriptor has
/// registered (checked by the kernel, and by [`Registered`] here), a source buffer that is live
/// and readable for its whole length during the call.
unsafe fn ioctl<T>(fd: &OwnedFd, request: u32, arg: &mut T) -> io::Result<()> {
    // SAFETY: the caller's contract: `arg` is the struct `request` expects, borrowed
    // mutably for the call, and the addresses in it may be used.
    let ret = unsafe { libc::ioctl(fd.as_raw_fd(), request as _, arg as *mut T) };
    if ret == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

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

impl Uffd {
    /// Opens a non-blocking userfaultfd that sees kernel faults too (KVM's), and enables the
    /// API with the features wanted that the kernel offers.
    pub(crate) fn open(want_features: u64) -> io::Result<Uffd> {
        // Ask what the kernel has first (features 0), then enable what is wanted of it on a
        // new descriptor: the API handshake can be done only once per descriptor.
        let (_, offered) = Uffd::handshake(0)?;
        Ok(Uffd::handshake(offered & want_features)?.0)
    }

    /// A new non-blocking descriptor, its API enabled with `features`; and the features the
    /// kernel offers.
    fn handshake(features: u64) -> io::Result<(Uffd, u64)> {
        // SAFETY: the syscall takes flags only and returns a new descriptor or -1.
        let raw =
            unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a descriptor the kernel just gave us and nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw as i32) };
        let mut api = uapi::uffdio_api {
            api: uapi::UFFD_API as u64,
            features,
            ioctls: 0,
        };
        // SAFETY: a uffdio_api for UFFDIO_API; it names no memory.
        unsafe { ioctl(&fd, nr::UFFDIO_API, &mut api) }?;
        Ok((
            Uffd {
                fd,
                features,
                own: true,
                reading: std::sync::RwLock::new(()),
                removes_seen: std::sync::atomic::AtomicBool::new(false),
                stopped: std::sync::atomic::AtomicBool::new(false),
            },
            api.features,
        ))
    }

    /// A userfaultfd another process opened and sent us (its API enabled there, its ranges
    /// registered there), checked to be one and made non-blocking. Its features are the
    /// sender's, read from `/proc/self/fdinfo` (the kernel shows them there).
    pub(crate) fn from_received(fd: OwnedFd) -> io::Result<Uffd> {
        let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))?;
        if link.as_os_str() != "anon_inode:[userfaultfd]" {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("the descriptor is {}, not a userfaultfd", link.display()),
            ));
        }
        // Unknown (0) when /proc does not say: the events the server refuses cannot then be
        // seen, and nothing is assumed enabled.
        let features = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", fd.as_raw_fd()))
            .ok()
            .and_then(|info| parse_fdinfo_features(&info))
            .unwrap_or(0);
        // SAFETY: fcntl on a descriptor we own touches no memory.
        let fl = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
        if fl < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: as above.
        let set = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, fl | libc::O_NONBLOCK) };
        if set < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Uffd {
            fd,
            features,
            own: false,
            reading: std::sync::RwLock::new(()),
            removes_seen: std::sync::atomic::AtomicBool::new(false),
            stopped: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// The features enabled on it.
    pub(crate) fn features(&self) -> u64 {
        self.features
    }

    /// The descriptor.
    #[cfg(feature = "lab-internals")]
    pub(crate) fn into_fd(self) -> OwnedFd {
        self.fd
    }

    /// The descriptor, to watch with epoll.
    pub(crate) fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        std::os::fd::AsFd::as_fd(&self.fd)
    }

    /// Unregisters the whole of `target` (another process's range: the descriptor names its
    /// address space); threads waiting there are woken, and a later touch of a page not
    /// present reads zero, so only a range whose every page is in may be unregistered.
    pub(crate) fn unregister_remote(&self, target: &RemoteRange) -> io::Result<()> {
        let mut r = target.uffd_range(0, target.len as usize)?;
        // SAFETY: a uffdio_range for UFFDIO_UNREGISTER, the peer's whole range as its
        // handshake declared it (checked by uffd_range).
        unsafe { ioctl(&self.fd, nr::UFFDIO_UNREGISTER, &mut r) }
    }

    /// Whether the kernel granted `feature`.
    pub(crate) fn has(&self, feature: u32) -> bool {
        self.features & u64::from(feature) != 0
    }

    /// Registers the whole body of `mapping`.
    pub(crate) fn register(&self, mapping: &Mapping, mode: RegisterMode) -> io::Result<()> {
        let mode = match mode {
            RegisterMode::Missing => uapi::UFFDIO_REGISTER_MODE_MISSING,
            RegisterMode::MissingMinor => {
                uapi::UFFDIO_REGISTER_MODE_MISSING | uapi::UFFDIO_REGISTER_MODE_MINOR
            }
        };
        let mut reg = uapi::uffdio_register {
            range: range(mapping, 0, mapping.len())?,
            mode: u64::from(mode),
            ioctls: 0,
        };
        // SAFETY: a uffdio_register for UFFDIO_REGISTER, over the mapping's own range
        // (`range` checked it).
        unsafe { ioctl(&self.fd, nr::UFFDIO_REGISTER, &mut reg) }
    }

    /// Unregisters the whole body of `mapping`; threads waiting on it are woken.
    pub(crate) fn unregister(&self, mapping: &Mapping) -> io::Result<()> {
        let mut r = range(mapping, 0, mapping.len())?;
        // SAFETY: a uffdio_range for UFFDIO_UNREGISTER, the mapping's own range.
        unsafe { ioctl(&self.fd, nr::UFFDIO_UNREGISTER, &mut r) }
    }

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

/// The features of a userfaultfd as `/proc/PID/fdinfo` shows them (`API:\t<api>:<features>:
/// <ioctls>`, hex), less the kernel's own "initialised" bit (shown by newer kernels); `None`
/// when the line is missing or does not parse.
pub(crate) fn parse_fdinfo_features(info: &str) -> Option<u64> {
    const INITIALIZED: u64 = 1 << 31;
    let line = info.lines().find_map(|l| l.strip_prefix("API:"))?;
    let mut parts = line.trim().split(':');
    let _api = parts.next()?;
    let features = u64::from_str_radix(parts.next()?.trim(), 16).ok()?;
    Some(features & !INITIALIZED)
}

/// `offset..offset+len` of `mapping` as a uffd range, once checked to lie in its body.
fn range(mapping: &Mapping, offset: usize, len: usize) -> io::Result<uapi::uffdio_range> {
    match offset.checked_add(len) {
        Some(end) if end <= mapping.len() => Ok(uapi::uffdio_range {
            start: mapping.as_ptr() as u64 + offset as u64,
            len: len as u64,
        }),
        _ => Err(io::Error::from_raw_os_error(libc::EINVAL)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fdinfo_features_are_read_and_garbage_is_none() {
        let enabled = "pos:\t0\nflags:\t02004000\npending:\t0\ntotal:\t0\nAPI:\taa:8000000a:80000000000001ff\n";
        assert_eq!(parse_fdinfo_features(enabled), Some(0xa));
        assert_eq!(parse_fdinfo_features("API:\taa:0:0\n"), Some(0));
        assert_eq!(parse_fdinfo_features("pos:\t0\n"), None);
        assert_eq!(parse_fdinfo_features("API:\taa:zz:0\n"), None);
    }

    #[test]
    fn a_descriptor_we_open_shows_its_features_in_fdinfo() {
        let Ok(u) = Uffd::open(u64::from(uapi::UFFD_FEATURE_EVENT_REMOVE)) else {
            eprintln!("skipped: userfaultfd unavailable (needs root)");
            return;
        };
        let info =
            std::fs::read_to_string(format!("/proc/self/fdinfo/{}", u.fd.as_raw_fd())).unwrap();
        let f = parse_fdinfo_features(&info).unwrap();
        assert_eq!(
            f & u64::from(uapi::UFFD_FEATURE_EVENT_REMOVE),
            u64::from(uapi::UFFD_FEATURE_EVENT_REMOVE)
        );
    }
}
