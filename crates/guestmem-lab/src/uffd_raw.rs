//! The few userfaultfd calls the lab's instruments make themselves (the Firecracker-style
//! server and the Firecracker stand-in): raw, as those programs make them. guestmem's own
//! wrapper is crate-private to the library on purpose.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use linux_raw_sys::general as uapi;
use linux_raw_sys::ioctl as nr;

/// One ioctl on a userfaultfd.
///
/// # Safety
/// `arg` must be the uapi struct `req` names (the kernel reads and writes that struct through
/// the pointer), and every address in it one the call may use: a range this descriptor has
/// registered, a source buffer live and readable for its whole length.
pub(crate) unsafe fn ioctl<T>(fd: &OwnedFd, req: u32, arg: &mut T) -> io::Result<()> {
    // SAFETY: the caller's contract: `arg` is the struct `req` expects, borrowed for the call.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), req as _, arg as *mut T) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// A non-blocking, close-on-exec userfaultfd, its API enabled with `features`.
pub(crate) fn open(features: u64) -> io::Result<OwnedFd> {
    // SAFETY: flags only.
    let raw = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nothing else owns.
    let uffd = unsafe { OwnedFd::from_raw_fd(raw as i32) };
    let mut api = uapi::uffdio_api {
        api: uapi::UFFD_API as u64,
        features,
        ioctls: 0,
    };
    // SAFETY: a uffdio_api for UFFDIO_API; it names no memory.
    unsafe { ioctl(&uffd, nr::UFFDIO_API, &mut api) }?;
    Ok(uffd)
}

/// Registers `start..start + len` for missing faults.
pub(crate) fn register_missing(uffd: &OwnedFd, start: u64, len: u64) -> io::Result<()> {
    let mut reg = uapi::uffdio_register {
        range: uapi::uffdio_range { start, len },
        mode: u64::from(uapi::UFFDIO_REGISTER_MODE_MISSING),
        ioctls: 0,
    };
    // SAFETY: a uffdio_register for UFFDIO_REGISTER; the kernel checks the range is mapped
    // and the caller names its own memory.
    unsafe { ioctl(uffd, nr::UFFDIO_REGISTER, &mut reg) }
}
