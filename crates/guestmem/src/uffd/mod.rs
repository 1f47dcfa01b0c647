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
mod install;
pub(crate) use events::Event;
pub(crate) use install::{ReadingStopped, RemovedMeanwhile};

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
