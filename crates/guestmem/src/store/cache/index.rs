//! The cache's index in memory: where each frame lies, and its segments, least recently
//! used first.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use super::record::record_bytes;

/// Where a frame lies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Entry {
    pub(super) seg: u64,
    /// Its record's header.
    pub(super) off: u64,
    pub(super) len: u64,
}

/// A segment file.
#[derive(Debug)]
pub(super) struct Segment {
    pub(super) path: PathBuf,
    /// Open while it is read (at most [`MAX_OPEN`] segments at once, the least recently
    /// used closed first).
    pub(super) file: Option<Arc<File>>,
    /// Bytes of its records, headers included (what it takes on disk).
    pub(super) bytes: u64,
    /// The frames written to it (some may have left the index: found bad, or kept again).
    pub(super) frames: Vec<[u8; 32]>,
    /// Its last use: its key in `Index::order`.
    pub(super) used: u64,
    /// Made by this cache (it knows every record); else another's, perhaps still appended
    /// to, scanned up to `scanned`.
    pub(super) ours: bool,
    /// Where a scan of it stopped.
    pub(super) scanned: u64,
    /// Its file's modification time as last seen or set: a use is marked there (at most
    /// every [`MARK_EVERY`]), so that a restart, and other processes over the folder, see
    /// which segments were used lately, not only which were written.
    pub(super) marked: Option<SystemTime>,
    /// When this cache last marked a use on it (none yet: the next use is marked).
    pub(super) last_mark: Option<SystemTime>,
}

/// How often a segment's use is marked on its file at most.
pub(super) const MARK_EVERY: Duration = Duration::from_secs(60);

#[derive(Debug, Default)]
pub(super) struct Index {
    pub(super) entries: crate::store::frame::ByHash<Entry>,
    pub(super) segs: HashMap<u64, Segment>,
    /// last use -> segment.
    pub(super) order: BTreeMap<u64, u64>,
    pub(super) bytes: u64,
    pub(super) tick: u64,
    /// The last segment number given.
    pub(super) serial: u64,
    /// Segments with their file open.
    pub(super) open: usize,
    /// Segments evicted, until a look at the folder no longer lists them: a look that did
    /// (their unlink came after it) must not take them in again.
    pub(super) removing: HashSet<PathBuf>,
}

/// Segments kept open at most: a cache's bound keeps about 64, but every process that
/// wrote to it left one or more of its own.
pub(super) const MAX_OPEN: usize = 128;

impl Index {
    pub(super) fn use_seg(&mut self, id: u64) {
        let t = self.tick;
        self.tick += 1;
        if let Some(s) = self.segs.get_mut(&id) {
            self.order.remove(&s.used);
            s.used = t;
            self.order.insert(t, id);
        }
    }

    /// Where the frame of `h` lies, and its segment's file if it is open (else its path),
    /// marked used.
    pub(super) fn touch(&mut self, h: &[u8; 32]) -> Option<(Entry, Result<Arc<File>, PathBuf>)> {
        let e = *self.entries.get(h)?;
        self.use_seg(e.seg);
        let s = self.segs.get(&e.seg)?;
        Some((e, s.file.clone().ok_or_else(|| s.path.clone())))
    }

    /// Segment `id`'s file, just opened: kept open (another closed if too many are).
    pub(super) fn opened(&mut self, id: u64, file: File) -> Arc<File> {
        let Some(s) = self.segs.get_mut(&id) else {
            return Arc::new(file);
        };
        if let Some(f) = &s.file {
            return Arc::clone(f);
        }
        let f = Arc::new(file);
        s.file = Some(Arc::clone(&f));
        self.open += 1;
        self.close_over(id);
        f
    }

    /// Closes the least recently used segments' files (but `keep`'s) while more than
    /// [`MAX_OPEN`] are open.
    pub(super) fn close_over(&mut self, keep: u64) {
        while self.open > MAX_OPEN {
            let lru = self
                .order
                .values()
                .copied()
                .find(|o| *o != keep && self.segs[o].file.is_some());
            let Some(o) = lru else { return };
            self.segs.get_mut(&o).expect("indexed").file = None;
            self.open -= 1;
        }
    }

    /// Adds a segment: this cache's own, just made, with its file (`Some`); another's, or
    /// one found at a start, scanned up to `scanned`; `marked`, its modification time.
    pub(super) fn add_seg(
        &mut self,
        path: PathBuf,
        file: Option<File>,
        scanned: u64,
        marked: Option<SystemTime>,
    ) -> u64 {
        self.serial += 1;
        let id = self.serial;
        self.open += usize::from(file.is_some());
        let s = Segment {
            path,
            ours: file.is_some(),
            file: file.map(Arc::new),
            bytes: 0,
            frames: Vec::new(),
            used: 0,
            scanned,
            marked,
            last_mark: None,
        };
        let t = self.tick;
        self.tick += 1;
        self.segs.insert(id, Segment { used: t, ..s });
        self.order.insert(t, id);
        self.close_over(id);
        id
    }

    /// Whether a use of segment `id` at `now` is to be marked on its file: at most once
    /// every [`MARK_EVERY`] (noted as done).
    pub(super) fn mark_due(&mut self, id: u64, now: SystemTime) -> bool {
        let Some(s) = self.segs.get_mut(&id) else {
            return false;
        };
        let due = s
            .last_mark
            .is_none_or(|t| now.duration_since(t).is_ok_and(|d| d >= MARK_EVERY));
        if due {
            s.marked = Some(now);
            s.last_mark = Some(now);
        }
        due
    }

    /// Segments whose files were marked since this index last saw them (used by another
    /// process over the folder), by their modification times `seen`: made the most
    /// recently used, in the order of those times.
    pub(super) fn used_elsewhere(&mut self, mut seen: Vec<(SystemTime, u64)>) {
        seen.retain(|(t, id)| {
            self.segs
                .get(id)
                .is_some_and(|s| s.marked.is_some_and(|m| *t > m))
        });
        seen.sort();
        for (t, id) in seen {
            self.use_seg(id);
            if let Some(s) = self.segs.get_mut(&id) {
                s.marked = Some(t);
            }
        }
    }

    /// Records a frame written to segment `seg`; false when the segment has left the cache
    /// meanwhile.
    pub(super) fn add(&mut self, h: [u8; 32], e: Entry) -> bool {
        let Some(s) = self.segs.get_mut(&e.seg) else {
            return false;
        };
        let rec = record_bytes(e.len);
        s.bytes += rec;
        s.frames.push(h);
        self.bytes += rec;
        self.entries.insert(h, e);
        self.use_seg(e.seg);
        true
    }

    /// Counts `n` more bytes on disk in segment `id` that no record in the index holds
    /// (records found bad and dropped, a record whose header cannot be read and what
    /// follows it): they take the disk until the segment goes.
    pub(super) fn hold(&mut self, id: u64, n: u64) {
        if let Some(s) = self.segs.get_mut(&id) {
            s.bytes += n;
            self.bytes += n;
        }
    }

    /// Drops the frame of `h` if it still lies at `at` (it may have been kept again since).
    pub(super) fn forget(&mut self, h: &[u8; 32], at: Entry) {
        if self.entries.get(h) == Some(&at) {
            self.entries.remove(h);
        }
    }

    /// Takes segment `id` out of the index; how many frames it held.
    pub(super) fn remove_seg(&mut self, id: u64) -> Option<(Segment, u64)> {
        let s = self.segs.remove(&id)?;
        self.order.remove(&s.used);
        self.bytes -= s.bytes;
        self.open -= usize::from(s.file.is_some());
        let mut frames = 0;
        for h in &s.frames {
            if self.entries.get(h).is_some_and(|e| e.seg == id) {
                self.entries.remove(h);
                frames += 1;
            }
        }
        Some((s, frames))
    }

    /// Takes least recently used segments out until `need` more bytes fit under `cap`; the
    /// segments and how many frames they held.
    pub(super) fn evict_for(&mut self, need: u64, cap: u64) -> (Vec<Segment>, u64) {
        let (mut out, mut frames) = (Vec::new(), 0);
        while self.bytes + need > cap {
            let Some((_, &id)) = self.order.first_key_value() else {
                break;
            };
            let (s, n) = self.remove_seg(id).expect("indexed");
            frames += n;
            self.removing.insert(s.path.clone());
            out.push(s);
        }
        (out, frames)
    }
}
