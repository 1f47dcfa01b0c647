//! The memory files, watched while served: a file written in place (or truncated) under
//! a running VM would serve it a mix of two snapshots. `inotify` tells the server's supervisor when
//! a served file is modified or its attributes change; the file is then compared with what
//! it was when the server started (device, inode, size, modification time, through the
//! descriptor served from), and if it differs every VM of that socket is ended (fail
//! closed) and the socket stops taking VMs. A file replaced by a rename is not a change:
//! the server goes on serving the file it opened, which is whole. When inotify's queue
//! overflows (events dropped), every file is compared.

use std::io;
use std::os::fd::BorrowedFd;

use super::files::{FileId, MemoryFile};
use crate::sys::inotify::{Events, Inotify};

/// The inotify watches of a server's memory files.
pub(super) struct FileWatch {
    inotify: Inotify,
    /// (watch descriptor, socket index).
    wds: Vec<(i32, usize)>,
    /// Each socket's file as it was when the server started.
    ids: Vec<Option<FileId>>,
}

impl FileWatch {
    /// Watches every file of `mems` (socket `i` is `mems[i]`).
    pub(super) fn new(mems: &[&MemoryFile]) -> io::Result<FileWatch> {
        let inotify = Inotify::new()?;
        let mut wds = Vec::new();
        for (i, m) in mems.iter().enumerate() {
            if !m.is_local() {
                // A snapshot in the store is named by its contents: it cannot change.
                continue;
            }
            let mask = libc::IN_MODIFY | libc::IN_ATTRIB | libc::IN_CLOSE_WRITE;
            wds.push((inotify.add_watch(m.path(), mask)?, i));
        }
        Ok(FileWatch {
            inotify,
            wds,
            ids: mems.iter().map(|m| m.identity().ok()).collect(),
        })
    }

    /// What the server's supervisor polls.
    pub(super) fn fd(&self) -> BorrowedFd<'_> {
        self.inotify.fd()
    }

    /// Reads what inotify has to say; the sockets whose file is no longer what it was.
    pub(super) fn changed(&mut self, mems: &[&MemoryFile]) -> Vec<usize> {
        let mut buf = Events::default();
        let mut touched = Vec::new();
        loop {
            let events = match self.inotify.read(&mut buf) {
                Ok(events) if !events.is_empty() => events,
                _ => break,
            };
            for ev in events {
                if ev.mask & libc::IN_Q_OVERFLOW != 0 {
                    // Events were dropped (the queue was full): any file may have changed
                    // unseen, so every one is compared.
                    touched.extend(self.wds.iter().map(|&(_, i)| i));
                } else if let Some(&(_, i)) = self.wds.iter().find(|(wd, _)| *wd == ev.wd) {
                    touched.push(i);
                }
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
