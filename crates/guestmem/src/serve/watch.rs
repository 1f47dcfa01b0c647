//! The memory files, watched while served: a file written in place (or truncated) under
//! a running VM would serve it a mix of two snapshots. `inotify` tells the server's supervisor when
//! a served file is modified or its attributes change; the file is then compared with what
//! it was when the server started (device, inode, size, modification time, through the
//! descriptor served from), and if it differs every VM of that socket is ended (fail
//! closed) and the socket stops taking VMs. A file replaced by a rename is not a change:
//! the server goes on serving the file it opened, which is whole. When inotify's queue
//! overflows (events dropped), every file is compared.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;

use super::files::{FileId, MemoryFile};

/// The inotify watches of a server's memory files.
pub(super) struct FileWatch {
    fd: OwnedFd,
    /// (watch descriptor, socket index).
    wds: Vec<(i32, usize)>,
    /// Each socket's file as it was when the server started.
    ids: Vec<Option<FileId>>,
}

impl FileWatch {
    /// Watches every file of `mems` (socket `i` is `mems[i]`).
    pub(super) fn new(mems: &[&MemoryFile]) -> io::Result<FileWatch> {
        // SAFETY: flags only; returns a new descriptor or -1.
        let fd = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let mut wds = Vec::new();
        for (i, m) in mems.iter().enumerate() {
            if !m.is_local() {
                // A snapshot in the store is named by its contents: it cannot change.
                continue;
            }
            let path = std::ffi::CString::new(m.path().as_os_str().as_bytes())
                .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
            // SAFETY: a live NUL-terminated path and a descriptor we own.
            let wd = unsafe {
                libc::inotify_add_watch(
                    fd.as_raw_fd(),
                    path.as_ptr(),
                    libc::IN_MODIFY | libc::IN_ATTRIB | libc::IN_CLOSE_WRITE,
                )
            };
            if wd < 0 {
                return Err(io::Error::last_os_error());
            }
            wds.push((wd, i));
        }
        Ok(FileWatch {
            fd,
            wds,
            ids: mems.iter().map(|m| m.identity().ok()).collect(),
        })
    }

    /// What the server's supervisor polls.
    pub(super) fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Reads what inotify has to say; the sockets whose file is no longer what it was.
    pub(super) fn changed(&mut self, mems: &[&MemoryFile]) -> Vec<usize> {
        let mut buf = [0u64; 512];
        let mut touched = Vec::new();
        loop {
            // SAFETY: reads into a live buffer of its size; the descriptor is non-blocking.
            let n = unsafe {
                libc::read(
                    self.fd.as_raw_fd(),
                    buf.as_mut_ptr() as *mut libc::c_void,
                    std::mem::size_of_val(&buf),
                )
            };
            if n <= 0 {
                break;
            }
            let bytes = &bytemuck_bytes(&buf)[..n as usize];
            let mut at = 0;
            let head = std::mem::size_of::<libc::inotify_event>();
            while at + head <= bytes.len() {
                // SAFETY: the kernel wrote whole events; read_unaligned copies one header.
                let ev: libc::inotify_event =
                    unsafe { std::ptr::read_unaligned(bytes[at..].as_ptr() as *const _) };
                if ev.mask & libc::IN_Q_OVERFLOW != 0 {
                    // Events were dropped (the queue was full): any file may have changed
                    // unseen, so every one is compared.
                    touched.extend(self.wds.iter().map(|&(_, i)| i));
                } else if let Some(&(_, i)) = self.wds.iter().find(|(wd, _)| *wd == ev.wd) {
                    touched.push(i);
                }
                at += head + ev.len as usize;
            }
        }
        touched.sort_unstable();
        touched.dedup();
        touched
            .into_iter()
            .filter(|&i| mems[i].identity().ok() != self.ids[i])
            .collect()
    }
}

/// The bytes of a u64 buffer (aligned for inotify events).
fn bytemuck_bytes(buf: &[u64]) -> &[u8] {
    // SAFETY: a u64 slice is readable as bytes, its whole length.
    unsafe { std::slice::from_raw_parts(buf.as_ptr() as *const u8, std::mem::size_of_val(buf)) }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::path::Path;

    use super::FileWatch;
    use crate::serve::files::MemoryFile;

    const QUEUE: &str = "/proc/sys/fs/inotify/max_queued_events";

    /// Sets inotify's queue length for the instances made while it lives (it is read at
    /// `inotify_init`), and puts the old one back when dropped: it is the host's, so it is
    /// held only around one `inotify_init` (an instance made meanwhile elsewhere gets the
    /// short queue, whose overflow is what this module now handles).
    struct Queue(String);

    impl Queue {
        fn set(n: u32) -> std::io::Result<Queue> {
            let old = std::fs::read_to_string(QUEUE)?;
            std::fs::write(QUEUE, n.to_string())?;
            Ok(Queue(old))
        }
    }

    impl Drop for Queue {
        fn drop(&mut self) {
            let _ = std::fs::write(QUEUE, self.0.trim());
        }
    }

    fn file(path: &Path) -> MemoryFile {
        std::fs::write(path, vec![7u8; 8192]).unwrap();
        MemoryFile::open(path).unwrap()
    }

    /// A file changed while the queue was full of another file's events (so that the
    /// change's own events were dropped) is still found changed: an overflow compares
    /// every file.
    #[test]
    fn a_change_lost_to_a_full_queue_is_still_found() {
        let scratch = guestmem_testkit::Scratch::new("watch-overflow");
        let (a, b) = (scratch.join("a.mem"), scratch.join("b.mem"));
        let (ma, mb) = (file(&a), file(&b));
        let mut watch = {
            let _small = match Queue::set(2) {
                Ok(q) => q,
                Err(e) => {
                    return guestmem_testkit::skip(format!("cannot set {QUEUE} (needs root): {e}"))
                }
            };
            FileWatch::new(&[&ma, &mb]).unwrap()
        };
        // Events on the first file that leave its identity as it was (its attributes set
        // again, a close after opening it to write), alternated so that none is folded
        // into the one before, fill the queue; the second file's write is then dropped.
        let mode = std::fs::metadata(&a).unwrap().permissions();
        for _ in 0..3 {
            std::fs::set_permissions(&a, mode.clone()).unwrap();
            drop(std::fs::OpenOptions::new().write(true).open(&a).unwrap());
        }
        let mut f = std::fs::OpenOptions::new().append(true).open(&b).unwrap();
        f.write_all(&[1u8; 4096]).unwrap();
        drop(f);
        assert_eq!(watch.changed(&[&ma, &mb]), vec![1]);
    }
}
