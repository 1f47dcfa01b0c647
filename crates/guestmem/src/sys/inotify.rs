//! An inotify instance and its events, read whole. (No crate of the project's list wraps
//! inotify with a blocking-free read that also gives the overflow event; this is the four
//! calls it takes.)

use std::ffi::{CString, OsStr};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// A non-blocking inotify instance.
#[derive(Debug)]
pub struct Inotify(OwnedFd);

/// One event: its watch, what happened (`IN_*` bits) and the name it is about, in a
/// watched folder (empty for the watched file itself, and for an overflow).
#[derive(Debug, Clone, Copy)]
pub struct Event<'a> {
    pub wd: i32,
    pub mask: u32,
    // Read by the frame cache's watch (the `store` feature).
    #[cfg_attr(not(feature = "store"), allow(dead_code))]
    pub name: &'a OsStr,
}

/// Room for what one `read` returns: at least one event with the longest name.
pub struct Events([u64; 512]);

impl Default for Events {
    fn default() -> Events {
        Events([0; 512])
    }
}

impl Inotify {
    /// A new instance, non-blocking and closed on exec.
    pub fn new() -> io::Result<Inotify> {
        // SAFETY: flags only; returns a new descriptor or -1.
        let fd = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor nothing else owns.
        Ok(Inotify(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Watches `path` for `mask`; the watch's descriptor.
    pub fn add_watch(&self, path: &Path, mask: u32) -> io::Result<i32> {
        let path = CString::new(path.as_os_str().as_bytes())
            .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: a live NUL-terminated path and a descriptor we own.
        let wd = unsafe { libc::inotify_add_watch(self.0.as_raw_fd(), path.as_ptr(), mask) };
        if wd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(wd)
    }

    /// Stops watch `wd` (its `IN_IGNORED` event follows).
    #[cfg_attr(not(feature = "store"), allow(dead_code))]
    pub fn rm_watch(&self, wd: i32) -> io::Result<()> {
        // SAFETY: a descriptor we own and a number; no memory is passed.
        if unsafe { libc::inotify_rm_watch(self.0.as_raw_fd(), wd) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// What to poll for its events.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }

    /// The events queued now, read into `buf` (none when there are none: it never waits).
    /// Call again until it gives none to drain the queue.
    pub fn read<'b>(&self, buf: &'b mut Events) -> io::Result<Vec<Event<'b>>> {
        let n = loop {
            // SAFETY: reads into a live buffer of its size; the descriptor is non-blocking.
            let n = unsafe {
                libc::read(
                    self.0.as_raw_fd(),
                    buf.0.as_mut_ptr() as *mut libc::c_void,
                    std::mem::size_of_val(&buf.0),
                )
            };
            if n >= 0 {
                break n as usize;
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::EAGAIN) => return Ok(Vec::new()),
                _ => return Err(e),
            }
        };
        // SAFETY: a u64 array is readable as bytes, its whole length.
        let all = unsafe {
            std::slice::from_raw_parts(buf.0.as_ptr() as *const u8, std::mem::size_of_val(&buf.0))
        };
        let bytes = &all[..n.min(all.len())];
        let head = std::mem::size_of::<libc::inotify_event>();
        let mut events = Vec::new();
        let mut at = 0;
        while at + head <= bytes.len() {
            // SAFETY: the kernel wrote whole events; read_unaligned copies one header.
            let ev: libc::inotify_event =
                unsafe { std::ptr::read_unaligned(bytes[at..].as_ptr() as *const _) };
            let end = (at + head + ev.len as usize).min(bytes.len());
            let name = &bytes[at + head..end];
            // The name is padded with NULs to its record's length.
            let name = &name[..name.iter().position(|&b| b == 0).unwrap_or(name.len())];
            events.push(Event {
                wd: ev.wd,
                mask: ev.mask,
                name: OsStr::from_bytes(name),
            });
            at = end;
        }
        Ok(events)
    }
}
