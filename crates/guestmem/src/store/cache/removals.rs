//! Segments other processes removed, let go of as they go. A process keeps open the
//! segments it reads (up to [`super::MAX_OPEN`]), and a file removed while open keeps its
//! disk space until its last descriptor is closed: a process that served a snapshot and
//! then sat idle while another process over the folder evicted its segments would hold
//! them on the disk, up to a second bound, until it next started a segment. One thread of
//! the process, blocked on one inotify instance with a watch on each cache's segments'
//! folder, takes each removed segment out of its cache's index as it goes, which closes its
//! file (a read under way keeps its own reference, and ends whole). One instance for every
//! cache: instances are few (128 a user by default) and the server's watch on its memory
//! files, which keeps a VM from a mix of two snapshots, needs one too.

use std::collections::{HashMap, HashSet};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use super::index::{Index, Segment};
use super::Active;
use crate::sys::inotify::{Events, Inotify};
use crate::sys::{self, PollFd};

/// A cache's folder, watched while the cache lives.
struct Folder {
    key: u64,
    segdir: PathBuf,
    index: Weak<Mutex<Index>>,
    active: Weak<Mutex<Option<Active>>>,
}

/// The process's instance, and the folders each of its watches stands for (two caches
/// over one folder share a watch: inotify gives a folder one).
struct Watcher {
    inotify: Inotify,
    folders: Mutex<HashMap<i32, Vec<Folder>>>,
}

/// A cache's place among the watched folders; given up when dropped.
#[derive(Debug)]
pub(super) struct Removals {
    wd: i32,
    key: u64,
}

static KEYS: AtomicU64 = AtomicU64::new(0);

/// The process's watcher, its thread started on first use (it lives as long as the
/// process, blocked while nothing is removed).
fn watcher() -> io::Result<&'static Watcher> {
    static WATCHER: OnceLock<Result<&'static Watcher, i32>> = OnceLock::new();
    let w = WATCHER.get_or_init(|| {
        let start = || -> io::Result<&'static Watcher> {
            let w: &'static Watcher = Box::leak(Box::new(Watcher {
                inotify: Inotify::new()?,
                folders: Mutex::new(HashMap::new()),
            }));
            std::thread::Builder::new()
                .name("guestmem-cache-rm".into())
                .spawn(move || w.run())?;
            Ok(w)
        };
        start().map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))
    });
    w.map_err(io::Error::from_raw_os_error)
}

impl Removals {
    /// Watches `segdir` for `index` (and `active`, the segment appended to, so that its
    /// file is closed too), then takes out of the index the segments already gone (removed
    /// between the listing that filled it and the watch).
    pub(super) fn start(
        segdir: &Path,
        index: &Arc<Mutex<Index>>,
        active: &Arc<Mutex<Option<Active>>>,
    ) -> io::Result<Removals> {
        let w = watcher()?;
        let key = KEYS.fetch_add(1, Ordering::Relaxed);
        let folder = Folder {
            key,
            segdir: segdir.to_path_buf(),
            index: Arc::downgrade(index),
            active: Arc::downgrade(active),
        };
        let here = folder.handle();
        let wd = {
            let mut folders = lock(&w.folders);
            let mask = libc::IN_DELETE | libc::IN_MOVED_FROM | libc::IN_ONLYDIR;
            let wd = w.inotify.add_watch(segdir, mask)?;
            folders.entry(wd).or_default().push(folder);
            wd
        };
        here.sweep();
        Ok(Removals { wd, key })
    }
}

impl Drop for Removals {
    fn drop(&mut self) {
        let Ok(w) = watcher() else { return };
        let mut folders = lock(&w.folders);
        let Some(list) = folders.get_mut(&self.wd) else {
            // The folder went (its watch with it).
            return;
        };
        list.retain(|f| f.key != self.key);
        if list.is_empty() {
            folders.remove(&self.wd);
            let _ = w.inotify.rm_watch(self.wd);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A folder's cache, held while its removals are applied.
struct Handle {
    segdir: PathBuf,
    index: Weak<Mutex<Index>>,
    active: Weak<Mutex<Option<Active>>>,
}

impl Folder {
    fn handle(&self) -> Handle {
        Handle {
            segdir: self.segdir.clone(),
            index: Weak::clone(&self.index),
            active: Weak::clone(&self.active),
        }
    }
}

impl Watcher {
    fn run(&self) {
        let mut buf = Events::default();
        loop {
            let mut fds = [PollFd::readable(self.inotify.fd())];
            if sys::poll(&mut fds, None).is_err() {
                tracing::warn!("the cache's removal watch stopped: poll failed");
                return;
            }
            // Per watch: the names removed; watches whose folder went; whether events were
            // dropped.
            let (mut gone, mut ended) = (HashMap::<i32, Vec<PathBuf>>::new(), Vec::new());
            let mut overflow = false;
            loop {
                let events = match self.inotify.read(&mut buf) {
                    Ok(events) if events.is_empty() => break,
                    Ok(events) => events,
                    Err(e) => {
                        tracing::warn!("the cache's removal watch stopped: {e}");
                        return;
                    }
                };
                for ev in events {
                    if ev.mask & libc::IN_Q_OVERFLOW != 0 {
                        overflow = true;
                    } else if ev.mask & libc::IN_IGNORED != 0 {
                        ended.push(ev.wd);
                    } else if ev.name.as_bytes().ends_with(b".seg") {
                        gone.entry(ev.wd).or_default().push(PathBuf::from(ev.name));
                    }
                }
            }
            let work: Vec<(Handle, Option<Vec<PathBuf>>)> = {
                let mut folders = lock(&self.folders);
                let mut work = Vec::new();
                for (wd, list) in folders.iter() {
                    let names = gone.remove(wd);
                    let list_all = overflow || ended.contains(wd);
                    if !list_all && names.is_none() {
                        continue;
                    }
                    for f in list {
                        let paths = names
                            .as_ref()
                            .filter(|_| !list_all)
                            .map(|n| n.iter().map(|n| f.segdir.join(n)).collect());
                        // `None`: the folder is listed (events were dropped, or it went).
                        work.push((f.handle(), paths));
                    }
                }
                for wd in &ended {
                    folders.remove(wd);
                }
                work
            };
            for (h, paths) in work {
                match paths {
                    Some(paths) => h.drop_paths(&paths.into_iter().collect()),
                    None => h.sweep(),
                }
            }
        }
    }
}

impl Handle {
    /// Takes the segments at `paths` out of the index, and out of `active`; their files
    /// are closed after the locks are let go (the last close of a removed file frees its
    /// blocks, which must not hold up the reads waiting on the index).
    fn drop_paths(&self, paths: &HashSet<PathBuf>) {
        let (Some(index), Some(active)) = (self.index.upgrade(), self.active.upgrade()) else {
            return;
        };
        let out: Vec<(u64, Segment)> = {
            let mut ix = lock(&index);
            let ids: Vec<u64> = ix
                .segs
                .iter()
                .filter(|(_, s)| paths.contains(&s.path))
                .map(|(&id, _)| id)
                .collect();
            ids.into_iter()
                .filter_map(|id| Some((id, ix.remove_seg(id)?.0)))
                .collect()
        };
        if out.is_empty() {
            return;
        }
        // After the index's lock, never under it (an append takes this one first).
        let closed = {
            let mut a = lock(&active);
            if a.as_ref()
                .is_some_and(|a| out.iter().any(|(id, _)| *id == a.id))
            {
                a.take()
            } else {
                None
            }
        };
        drop((out, closed));
    }

    /// Takes out the segments the index knew before a listing of the folder that does
    /// not show them: all of them when the folder is gone; none when it cannot be listed
    /// for another reason.
    fn sweep(&self) {
        let Some(index) = self.index.upgrade() else {
            return;
        };
        let known: Vec<PathBuf> = lock(&index).segs.values().map(|s| s.path.clone()).collect();
        drop(index);
        let listed: HashSet<PathBuf> = match std::fs::read_dir(&self.segdir) {
            Ok(listing) => match listing
                .map(|f| f.map(|f| f.path()))
                .collect::<io::Result<HashSet<PathBuf>>>()
            {
                Ok(listed) => listed,
                Err(_) => return,
            },
            Err(e) if e.kind() == io::ErrorKind::NotFound => HashSet::new(),
            Err(_) => return,
        };
        let gone = known.into_iter().filter(|p| !listed.contains(p)).collect();
        self.drop_paths(&gone);
    }
}
