//! Segments other processes removed, let go of as they go. A process keeps open the
//! segments it reads (up to [`super::MAX_OPEN`]), and a file removed while open keeps its
//! disk space until its last descriptor is closed: a process that served a snapshot and
//! then sat idle while another process over the folder evicted its segments would hold
//! them on the disk, up to a second bound, until it next started a segment. A thread
//! blocked on inotify over the segments' folder takes each removed segment out of the
//! index as it goes, which closes its file (a read under way keeps its own reference, and
//! ends whole).

use std::collections::HashSet;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use super::index::Index;
use super::Active;
use crate::sys::inotify::{Events, Inotify};
use crate::sys::{self, PollFd};

/// The thread that watches, stopped and joined when dropped.
#[derive(Debug)]
pub(super) struct Removals {
    stop: OwnedFd,
    thread: Option<JoinHandle<()>>,
}

/// A watch on a folder, not yet read: made before the folder is listed, so that a removal
/// after the listing is queued, and read once the index holds what the listing found.
#[derive(Debug)]
pub(super) struct Watch {
    inotify: Inotify,
    segdir: PathBuf,
}

impl Watch {
    /// Watches `segdir` for files removed or moved out of it.
    pub(super) fn new(segdir: &Path) -> io::Result<Watch> {
        let inotify = Inotify::new()?;
        inotify.add_watch(
            segdir,
            libc::IN_DELETE | libc::IN_MOVED_FROM | libc::IN_ONLYDIR,
        )?;
        Ok(Watch {
            inotify,
            segdir: segdir.to_path_buf(),
        })
    }

    /// Starts taking removed segments out of `index` (and out of `active`, the segment
    /// appended to, so that its file is closed too).
    pub(super) fn start(
        self,
        index: Arc<Mutex<Index>>,
        active: Arc<Mutex<Option<Active>>>,
    ) -> io::Result<Removals> {
        let stop = sys::eventfd()?;
        let stopped = stop.try_clone()?;
        let thread = std::thread::Builder::new()
            .name("guestmem-cache-rm".into())
            .spawn(move || self.run(&index, &active, stopped))?;
        Ok(Removals {
            stop,
            thread: Some(thread),
        })
    }

    fn run(self, index: &Mutex<Index>, active: &Mutex<Option<Active>>, stop: OwnedFd) {
        let mut buf = Events::default();
        loop {
            let mut fds = [
                PollFd::readable(self.inotify.fd()),
                PollFd::readable(stop.as_fd()),
            ];
            if sys::poll(&mut fds, None).is_err() || fds[1].ready() {
                return;
            }
            let (mut gone, mut overflow, mut ended) = (Vec::new(), false, false);
            loop {
                let events = match self.inotify.read(&mut buf) {
                    Ok(events) if events.is_empty() => break,
                    Ok(events) => events,
                    Err(_) => return,
                };
                for ev in events {
                    if ev.mask & libc::IN_Q_OVERFLOW != 0 {
                        overflow = true;
                    } else if ev.mask & libc::IN_IGNORED != 0 {
                        // The folder itself is gone: nothing more will come.
                        ended = true;
                    } else if Path::new(ev.name).extension().is_some_and(|e| e == "seg") {
                        gone.push(self.segdir.join(ev.name));
                    }
                }
            }
            if overflow {
                // Removals were dropped (the queue was full): those known before a listing
                // and not in it are gone.
                gone = self.unlisted(index);
            }
            let gone: HashSet<PathBuf> = gone.into_iter().collect();
            let ids: Vec<u64> = {
                let mut ix = index.lock().unwrap_or_else(|e| e.into_inner());
                let ids: Vec<u64> = ix
                    .segs
                    .iter()
                    .filter(|(_, s)| gone.contains(&s.path))
                    .map(|(&id, _)| id)
                    .collect();
                for &id in &ids {
                    ix.remove_seg(id);
                }
                ids
            };
            if !ids.is_empty() {
                // After the index's lock, never under it (an append takes this one first).
                let mut a = active.lock().unwrap_or_else(|e| e.into_inner());
                if a.as_ref().is_some_and(|a| ids.contains(&a.id)) {
                    *a = None;
                }
            }
            if ended {
                return;
            }
        }
    }

    /// The segments the index knew before a listing of the folder that does not show them;
    /// none when the folder cannot be listed.
    fn unlisted(&self, index: &Mutex<Index>) -> Vec<PathBuf> {
        let known: Vec<PathBuf> = {
            let ix = index.lock().unwrap_or_else(|e| e.into_inner());
            ix.segs.values().map(|s| s.path.clone()).collect()
        };
        let Ok(listing) = std::fs::read_dir(&self.segdir) else {
            return Vec::new();
        };
        let Ok(listed) = listing
            .map(|f| f.map(|f| f.path()))
            .collect::<io::Result<HashSet<PathBuf>>>()
        else {
            return Vec::new();
        };
        known.into_iter().filter(|p| !listed.contains(p)).collect()
    }
}

impl Drop for Removals {
    fn drop(&mut self) {
        if sys::eventfd_signal(self.stop.as_fd()).is_ok() {
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
        }
        // Else the thread is left to end with the process (it holds only the index).
    }
}
