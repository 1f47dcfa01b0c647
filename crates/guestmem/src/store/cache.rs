//! The node-local frame cache: frames as plain bytes in segment files, shared by every VM
//! and snapshot a server serves, bounded in bytes (the least recently used segment out
//! first), and checked every time a frame is read from it.
//!
//! A segment is a file of records appended one after the other, each a header (its frame's
//! length, its BLAKE3 hash, and guestmem's block checksum of its bytes sealed with that
//! hash) and then the frame. A process appends only to the segments it made itself, and a
//! segment is never written over: a full cache removes its least recently used segments,
//! about a 64th of its bound each, whole. Processes over one folder keep one bound: as each
//! starts a segment it takes in those the others made and drops those they removed, and a
//! thread blocked on inotify lets go of a removed segment's file as it goes, so that an
//! idle process does not hold its disk space ([`removals`]). Why not
//! a file a frame: making a file costs its inode, and on this project's host (ext4 without
//! a journal, whose inode allocator looks up each inode freed in the last minutes) 0.7-0.9
//! ms each, against 0.04 ms to append a 256 KiB frame to a segment; writing the cache took a
//! third of both CPUs while a VM was served from a cold one. A read is two `pread`s on a
//! segment held open: no path looked up.
//!
//! A frame is kept only after its BLAKE3 hash was checked against its name (what came from
//! the store is untrusted); every read checks its header's hash and length and the block
//! checksum of what it read: the cache is this host's own, so the re-check is against
//! corruption (a torn write, bit rot, a file changed behind the server's back), at memory
//! speed, where a BLAKE3 pass would cost a warm cache its level with a local file. It
//! outlives the server: a restart, `kill -9` or a hand-over finds every record whose header
//! is whole (a record's bytes are written before its header; a scan stops at the first
//! header that is not), and a record whose bytes did not all reach the disk fails its
//! check when read, and is dropped. A full disk is not an error: segments are removed to
//! make room, and past that a frame is served without being kept.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use super::StoreError;

mod index;
mod record;
mod removals;
#[cfg(test)]
use index::MAX_OPEN;
use index::{Entry, Index, Segment};
#[cfg(test)]
use record::{checksum, MAGIC};
use record::{
    header, open_segment, parse_header, record_bytes, scan_from, sealed, DROPPED, HEADER,
};

/// What the cache did, counted since it was opened.
#[derive(Debug, Default)]
pub struct CacheCounters {
    /// Frames read from it.
    pub hits: AtomicU64,
    /// Frames looked for and not there.
    pub misses: AtomicU64,
    /// Frames removed to make room. Segments past the bound when the cache is opened (one
    /// reopened smaller) are removed unread, and not counted.
    pub evictions: AtomicU64,
    /// Frames not kept: no room even after evicting (a full disk), larger than the cache, or
    /// a fault's frame with no room among the frames waiting to be written.
    pub uncached: AtomicU64,
    /// Frames whose record no longer matched its hash or checksum (dropped, fetched again).
    pub corrupt: AtomicU64,
}

/// The segment this process appends to.
#[derive(Debug)]
struct Active {
    id: u64,
    file: Arc<File>,
    /// Where its next record goes.
    end: u64,
}

/// A node-local cache of frames.
#[derive(Debug)]
pub struct FrameCache {
    dir: PathBuf,
    cap: u64,
    /// A segment is started once the active one holds this many bytes (a record larger
    /// than that has a segment of its own).
    segment_bytes: u64,
    index: Arc<Mutex<Index>>,
    /// Appends, one reservation at a time (written side by side).
    active: Arc<Mutex<Option<Active>>>,
    /// Held by the one thread looking at the folder ([`FrameCache::adopt`]).
    adopting: Mutex<()>,
    /// Until when a full disk is not made room on by evicting (a room made did not help).
    full_until: Mutex<Option<std::time::Instant>>,
    /// What it did.
    pub counters: CacheCounters,
    /// Lets go of segments other processes remove (none where inotify cannot be had: then
    /// only as a segment is started, or a removed one is read).
    _removals: Option<removals::Removals>,
}

/// How long a full disk that room made by evicting did not help is left as it is: frames
/// go uncached meanwhile (a disk filled by others empties no cache).
const FULL_BACKOFF: std::time::Duration = std::time::Duration::from_secs(5);

/// A cache's bound over its segments' size: a segment removed takes this share.
const SEGMENTS: u64 = 64;
/// Largest segment started (4 GiB: a cache up to 256 GiB holds about 64 segments).
const MAX_SEGMENT: u64 = 4 << 30;

/// Bytes read and checked at a time (half a typical L2 cache).
const CHECK_PIECE: usize = 256 << 10;

/// Largest cache, bytes (1 PiB: a typo's guard, not a policy).
pub const MAX_CACHE_BYTES: u64 = 1 << 50;

/// A segment without a whole record younger than this may be another process's, being
/// written: a cache opening leaves it.
const YOUNG: std::time::Duration = std::time::Duration::from_secs(60);

/// Refuses `d` as a cache directory unless it is a directory that this process's user
/// owns; one others may write to is made theirs no more (`chmod go-w`, said in the log):
/// anyone who can write there can plant records the server would read, and its checksum
/// names no writer. With `may_link` (the folder given) it may be a symbolic link to one;
/// `segments/` may not (a cache removes files it does not know there: through a link, at
/// the link's target).
fn own_dir(d: &Path, may_link: bool) -> std::io::Result<()> {
    let m = match may_link {
        true => std::fs::metadata(d)?,
        false => d.symlink_metadata()?,
    };
    let refuse = |why: String| {
        Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            why,
        ))
    };
    if !m.file_type().is_dir() {
        return refuse("not a directory (a symbolic link?)".into());
    }
    if m.uid() != crate::sys::euid() {
        return refuse(format!("owned by uid {}, not this process's user", m.uid()));
    }
    let mode = m.mode() & 0o7777;
    if mode & 0o022 != 0 {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(mode & !0o022))?;
        tracing::warn!(
            "cache directory {}: others could write to it (mode {mode:o}): made {:o}",
            d.display(),
            mode & !0o022
        );
    }
    Ok(())
}

/// The cache directory tag (<https://bford.info/cachedir/>): marks a folder as a guestmem
/// frame cache, so that a later open knows the folder is one to manage (and backup tools
/// skip it).
const TAG_FILE: &str = "CACHEDIR.TAG";
/// See [`TAG_FILE`]: the standard signature, then what guestmem looks for.
const TAG: &str = "Signature: 8a477f597d28d172789f06886806bc55\n\
    # This file is a cache directory tag created by guestmem: a guestmem frame cache\n\
    # (frames of VM snapshots in object storage; fetched again once removed).\n";
/// What a folder's tag must say for guestmem to take it as its own.
const TAG_MARK: &str = "guestmem frame cache";

/// Why `dir` is not to be taken as a frame cache, if it is not: a folder that holds
/// anything but what a frame cache keeps, and no guestmem cache tag. A cache removes files
/// it does not know in its folder (`frames/`, stray files in `segments/`) and changes the
/// folder's mode: a folder given by mistake (a home, `/tmp`) must be refused, not managed.
fn foreign_entry(dir: &Path) -> std::io::Result<Option<String>> {
    use std::io::Read;
    let entries = match std::fs::read_dir(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        r => r?,
    };
    let mut tag = String::new();
    let tagged = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(dir.join(TAG_FILE))
        .and_then(|f| f.take(4096).read_to_string(&mut tag))
        .is_ok_and(|_| tag.contains(TAG_MARK));
    if tagged {
        return Ok(None);
    }
    // A cache made before the tag (2026-11-29): a `segments/` of segments only, whatever
    // else the folder holds (a file system's `lost+found`, an operator's note).
    if all_named(&dir.join("segments"), |n, _| n.ends_with(".seg")) {
        return Ok(None);
    }
    for e in entries {
        let name = e?.file_name();
        let name = name.to_string_lossy();
        let ours = matches!(
            &*name,
            "segments" | "frames" | "learnt" | "lost+found" | BOUND_FILE | TAG_FILE
        ) || (name.starts_with("bound.") && name.ends_with(".tmp"));
        if !ours {
            return Ok(Some(name.into_owned()));
        }
    }
    Ok(None)
}

/// Whether `dir` is a directory (not a link) holding at least one entry, each of which
/// `ok` takes (its name, and whether it is a directory).
fn all_named(dir: &Path, ok: impl Fn(&str, bool) -> bool) -> bool {
    if !dir.symlink_metadata().is_ok_and(|m| m.is_dir()) {
        return false;
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return false;
    };
    let mut any = false;
    for e in entries {
        let Ok(e) = e else { return false };
        let is_dir = e.file_type().is_ok_and(|t| t.is_dir());
        if !ok(&e.file_name().to_string_lossy(), is_dir) {
            return false;
        }
        any = true;
    }
    any
}

/// What a segment found on disk takes there, counted against the bound: up to where its
/// scan stopped (`end`: its records, and those found bad and dropped), and the rest of its
/// file (`len`: a header that cannot be read and all after it) unless a writer may still
/// be appending there (`growing`: a segment written to lately, or one whose scan goes on
/// as it grows).
fn on_disk(end: u64, len: u64, growing: bool) -> u64 {
    if growing {
        end
    } else {
        end.max(len)
    }
}

/// The disk the records of a scan take.
fn records_bytes(records: &[record::Record]) -> u64 {
    records.iter().map(|r| record_bytes(r.2)).sum()
}

fn is_io_full(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT))
}

/// Learnt working sets (`DIR/learnt/`, one a snapshot served) kept: those used within
/// [`LEARNT_KEEP`], at most [`LEARNT_MAX`] of them, the most recently used. Each is at most
/// a few MiB (`serve::learn`), so this bounds what they take by what is served lately, not
/// by every snapshot the host ever served.
const LEARNT_KEEP: std::time::Duration = std::time::Duration::from_secs(30 * 24 * 3600);
/// See [`LEARNT_KEEP`].
const LEARNT_MAX: usize = 1024;

/// Removes the learnt working sets in `dir` past [`LEARNT_KEEP`] at `now` or past the
/// newest [`LEARNT_MAX`] (by modification time: a server marks one used when it loads it).
fn prune_learnt(dir: &Path, now: SystemTime) {
    let Ok(listing) = std::fs::read_dir(dir) else {
        return;
    };
    let mut files: Vec<(SystemTime, PathBuf)> = listing
        .flatten()
        .filter(|f| {
            f.file_name()
                .to_string_lossy()
                .ends_with(".guestmem-ws.json")
        })
        .filter_map(|f| {
            let m = f.path().symlink_metadata().ok().filter(|m| m.is_file())?;
            Some((m.modified().ok()?, f.path()))
        })
        .collect();
    files.sort_by(|a, b| b.cmp(a));
    for (i, (t, path)) in files.iter().enumerate() {
        let old = now.duration_since(*t).is_ok_and(|age| age > LEARNT_KEEP);
        if old || i >= LEARNT_MAX {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// The file in a cache's folder that holds the bound it was last opened with.
const BOUND_FILE: &str = "bound";

impl FrameCache {
    /// The bound the cache in `dir` was last opened with, if it says: the one to take where
    /// none is given, so that a process given none does not shrink the folder under a
    /// server with a larger one.
    pub fn recorded_bound(dir: &Path) -> Option<u64> {
        use std::io::Read;
        let mut text = String::new();
        // Read before the folder's checks (a process given no bound asks first): a link or
        // a FIFO planted there is not followed or waited on.
        let f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(dir.join(BOUND_FILE))
            .ok()?;
        if !f.metadata().ok()?.is_file() {
            return None;
        }
        f.take(64).read_to_string(&mut text).ok()?;
        text.trim().parse().ok().filter(|&b| b <= MAX_CACHE_BYTES)
    }

    /// [`FrameCache::open`], or `None` (said in the log) where the disk under `dir` cannot
    /// take it now (full, out of quota, read-only, failing): a server then fetches every
    /// frame from the store, uncached, rather than serve no VM. Other refusals (a folder
    /// another user owns, a link, a bound past the limit) are the operator's to fix, and
    /// returned.
    pub fn open_or_none(dir: &Path, cap: u64) -> Result<Option<FrameCache>, StoreError> {
        match FrameCache::open(dir, cap) {
            Ok(c) => Ok(Some(c)),
            Err(StoreError::Io { op, path, source })
                if matches!(
                    source.raw_os_error(),
                    Some(libc::ENOSPC | libc::EDQUOT | libc::EROFS | libc::EIO)
                ) =>
            {
                tracing::warn!(
                    "frame cache: could not {op} {}: {source}; serving uncached (every frame from the store)",
                    path.display()
                );
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Opens (or makes) the cache in `dir`, bounded by `cap` bytes: the segments a server
    /// left there are indexed (oldest use first, by modification time), every record whose
    /// header is whole, and segments past `cap` removed. A cache in the layout before
    /// segments (a file a frame, in `frames/`) is removed: its frames are fetched again.
    pub fn open(dir: &Path, cap: u64) -> Result<FrameCache, StoreError> {
        if cap > MAX_CACHE_BYTES {
            return Err(StoreError::Limit {
                what: "cache size, bytes",
                value: cap,
                limit: MAX_CACHE_BYTES,
            });
        }
        let segdir = dir.join("segments");
        let io = |op, path: &Path| {
            let path = path.to_path_buf();
            move |source| StoreError::Io { op, path, source }
        };
        if let Some(name) = foreign_entry(dir).map_err(io("look into the cache directory", dir))? {
            return Err(StoreError::Io {
                op: "use as the cache directory",
                path: dir.to_path_buf(),
                source: std::io::Error::new(
                    std::io::ErrorKind::AlreadyExists,
                    format!(
                        "not a guestmem frame cache: it holds {name:?} (a cache removes what it \
                         does not know in its folder; give a new or empty folder, or, for a \
                         cache, write \"{TAG_MARK}\" into {TAG_FILE} there)"
                    ),
                ),
            });
        }
        // Made for this user alone (0700 before the umask); one found is checked below.
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&segdir)
            .map_err(io("create the cache directory", &segdir))?;
        for (d, may_link) in [(dir, true), (segdir.as_path(), false)] {
            own_dir(d, may_link).map_err(io("use as the cache directory", d))?;
        }
        // Tagged as a guestmem cache (best effort: an untagged folder of only the cache's
        // own names is taken all the same).
        let tag = dir.join(TAG_FILE);
        if tag.symlink_metadata().is_err() {
            let _ = std::fs::write(&tag, TAG);
        }
        // The bound, kept for the next process over this folder that is given none (a
        // `move-in` beside a server, a successor): one opened with a smaller bound evicts the
        // others' segments down to it.
        match FrameCache::recorded_bound(dir) {
            Some(was) if was != cap => tracing::warn!(
                "frame cache {}: opened with a bound of {cap} bytes, last opened with {was}: while processes with both run, the folder keeps the smaller",
                dir.display()
            ),
            _ => {}
        }
        let bound = dir.join(BOUND_FILE);
        static SERIAL: AtomicU64 = AtomicU64::new(0);
        let tmp = dir.join(format!(
            "{BOUND_FILE}.{}.{}.tmp",
            std::process::id(),
            SERIAL.fetch_add(1, Ordering::Relaxed)
        ));
        let kept =
            std::fs::write(&tmp, format!("{cap}\n")).and_then(|()| std::fs::rename(&tmp, &bound));
        if kept.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        prune_learnt(&dir.join("learnt"), SystemTime::now());
        // The layout before segments: `frames/ab/<hash>`, and files being written beside.
        let old = dir.join("frames");
        let fan = |n: &str, is_dir: bool| {
            (is_dir && n.len() == 2 && n.bytes().all(|b| b.is_ascii_hexdigit()))
                || (!is_dir && n.ends_with(".tmp"))
        };
        if all_named(&old, fan) {
            let _ = std::fs::remove_dir_all(&old);
        }
        // The segments, newest first (ties, a coarse clock, by name: its creation time).
        let mut listed = Vec::new();
        for f in std::fs::read_dir(&segdir).map_err(io("read the cache directory", &segdir))? {
            let Ok(f) = f else { continue };
            let path = f.path();
            let Ok(meta) = path.symlink_metadata() else {
                continue;
            };
            if !meta.is_file() {
                continue;
            }
            if !f.file_name().to_string_lossy().ends_with(".seg") {
                // Not a segment (nothing of guestmem's but segments is written here).
                let _ = std::fs::remove_file(&path);
                continue;
            }
            let mtime = i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec());
            listed.push((mtime, path));
        }
        listed.sort_by(|a, b| (b.0, &b.1).cmp(&(a.0, &a.1)));
        // Read newest first, and only while they fit the bound: the older ones would be
        // evicted at once, and reading them first would cost memory for what the folder
        // holds, not for the bound (a large cache reopened with a small one).
        let (mut found, mut held) = (Vec::new(), 0u64);
        for (_, path) in listed {
            let Ok(file) = open_segment(&path) else {
                continue;
            };
            let Ok(meta) = file.metadata() else { continue };
            if !meta.is_file() {
                continue;
            }
            let young = || {
                meta.modified()
                    .ok()
                    .and_then(|t| t.elapsed().ok())
                    .is_none_or(|age| age < YOUNG)
            };
            if held >= cap {
                // Past the bound, but for one that may be another process's, just made.
                let mut t = [0u8; HEADER];
                let headed = file.read_exact_at(&mut t, 0).is_ok() && parse_header(&t).is_some();
                if headed || !young() {
                    let _ = std::fs::remove_file(&path);
                }
                continue;
            }
            let (records, headers, end) = scan_from(&file, 0, meta.len());
            if records.is_empty() {
                // No record to serve: removed, unless it has no header yet and may be
                // another process's, just made (its first record's bytes go first).
                if !(headers == 0 && young()) {
                    let _ = std::fs::remove_file(&path);
                }
                continue;
            }
            let span = on_disk(end, meta.len(), young());
            if held + span > cap {
                held = cap;
                let _ = std::fs::remove_file(&path);
                continue;
            }
            held += span;
            found.push((path, records, end, span, meta.modified().ok()));
        }
        // Indexed oldest first: the least recently used.
        let mut index = Index::default();
        for (path, records, end, span, marked) in found.into_iter().rev() {
            let id = index.add_seg(path, None, end, marked);
            index.hold(id, span.saturating_sub(records_bytes(&records)));
            for (h, off, len) in records {
                index.add(h, Entry { seg: id, off, len });
            }
        }
        let evicted = index.evict_for(0, cap);
        let (index, active) = (Arc::new(Mutex::new(index)), Arc::new(Mutex::new(None)));
        let removals = match removals::Removals::start(&segdir, &index, &active) {
            Ok(r) => Some(r),
            Err(e) => {
                tracing::warn!(
                    "cache {}: segments other processes remove are let go of only as a \
                     segment is started (no inotify watch: {e})",
                    dir.display()
                );
                None
            }
        };
        let cache = FrameCache {
            dir: dir.to_path_buf(),
            cap,
            segment_bytes: (cap / SEGMENTS).min(MAX_SEGMENT),
            index,
            active,
            adopting: Mutex::new(()),
            full_until: Mutex::new(None),
            counters: CacheCounters::default(),
            _removals: removals,
        };
        cache.remove_evicted(evicted);
        Ok(cache)
    }

    /// Its directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Its bound, bytes.
    pub fn capacity(&self) -> u64 {
        self.cap
    }

    /// Bytes held now: its segments' records, headers included.
    pub fn bytes(&self) -> u64 {
        self.lock().bytes
    }

    /// Frames held now.
    pub fn frames(&self) -> u64 {
        self.lock().entries.len() as u64
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the frame of `hash` is held (without reading it).
    pub(crate) fn contains(&self, hash: &blake3::Hash) -> bool {
        self.lock().entries.contains_key(hash.as_bytes())
    }

    /// The frame of `hash` (`len` plain bytes), read and checked; `None` when it is not
    /// held, or its record no longer holds it (then it is dropped).
    pub(crate) fn get(&self, hash: &blake3::Hash, len: usize) -> Option<Vec<u8>> {
        let mut buf = vec![0u8; len];
        self.read_checked(hash.as_bytes(), &mut buf, true, true)
            .then_some(buf)
    }

    /// Reads the frame of `hash` into `dst` (its length), checked; false when it is not
    /// held or its record no longer holds it (then it is dropped). A frame it cannot give is
    /// not counted as a miss: the caller fetches it next, and that look counts it.
    pub(crate) fn read_into(&self, hash: &blake3::Hash, dst: &mut [u8]) -> bool {
        self.read_into_counted(hash, dst, true)
    }

    /// [`FrameCache::read_into`], counted as a hit only if `hit` (a frame read ahead is
    /// counted when a reader takes it: [`FrameCache::hit`]).
    pub(crate) fn read_into_counted(&self, hash: &blake3::Hash, dst: &mut [u8], hit: bool) -> bool {
        self.read_checked(hash.as_bytes(), dst, false, hit)
    }

    /// Counts a hit: a frame read ahead from the cache, taken by its reader.
    pub(crate) fn hit(&self) {
        self.counters.hits.fetch_add(1, Ordering::Relaxed);
    }

    /// Reads the frame of `h` into `dst`, checking its header and checksum; `miss`: count
    /// it as a miss if it is not held or cannot be given.
    fn read_checked(&self, h: &[u8; 32], dst: &mut [u8], miss: bool, hit: bool) -> bool {
        let count_miss = || {
            if miss {
                self.counters.misses.fetch_add(1, Ordering::Relaxed);
            }
        };
        // Whether its use is to be marked on the file (see `mark_due`), asked under the
        // same lock as the look-up.
        let now = SystemTime::now();
        let found = {
            let mut ix = self.lock();
            ix.touch(h)
                .map(|(at, file)| (at, file, ix.mark_due(at.seg, now)))
        };
        let Some((at, file, mark)) = found else {
            count_miss();
            return false;
        };
        let file = match file {
            Ok(f) => f,
            Err(path) => match open_segment(&path) {
                Ok(f) => self.lock().opened(at.seg, f),
                Err(e) => {
                    // Removed behind its back (by another process over the same folder,
                    // or by hand): out of the index. Anything else (no descriptor left, say)
                    // is a miss this time.
                    count_miss();
                    if e.kind() == std::io::ErrorKind::NotFound {
                        self.lock().remove_seg(at.seg);
                    }
                    return false;
                }
            },
        };
        // The segment stays open while it is read: one removed meanwhile (evicted) is
        // still read whole.
        if at.len != dst.len() as u64 {
            // Asked for with another length than it was kept with (a manifest that does
            // not match its frame's bytes): not given, and left as it is.
            count_miss();
            return false;
        }
        // Whether its header still names it: only then is a record whose bytes fail the
        // check marked dropped.
        let mut named = false;
        let mut read = || -> std::io::Result<bool> {
            let mut t = [0u8; HEADER];
            file.read_exact_at(&mut t, at.off)?;
            if parse_header(&t) != Some((at.len, *h, false)) {
                return Ok(false);
            }
            named = true;
            // Read and checked a piece at a time: the check reads what the read just left in
            // the CPU's cache, not the whole frame again from memory.
            let mut sum = crate::snapshot::BlockHasher::default();
            let data = at.off + HEADER as u64;
            for (k, piece) in dst.chunks_mut(CHECK_PIECE).enumerate() {
                file.read_exact_at(piece, data + (k * CHECK_PIECE) as u64)?;
                sum.update(piece);
            }
            Ok(t[48..56] == sealed(h, sum.finish()).to_le_bytes())
        };
        let checked = read();
        if let Ok(true) = checked {
            if hit {
                self.counters.hits.fetch_add(1, Ordering::Relaxed);
            }
            // Its use marked on the file (at most a minute apart), for a restart's order
            // and other processes' (best effort).
            if mark {
                let _ = file.set_modified(now);
            }
            return true;
        }
        // Bad bytes, or a segment cut short behind the server's back (or a read error):
        // out of the index, fetched again; a record whose bytes were read and failed the
        // check is marked dropped, for the next start's scan.
        if named && matches!(checked, Ok(false)) {
            let _ = file.write_all_at(&DROPPED, at.off + 56);
        }
        self.counters.corrupt.fetch_add(1, Ordering::Relaxed);
        count_miss();
        self.lock().forget(h, at);
        false
    }

    /// Counts a frame not kept because the writes waiting were full.
    pub(crate) fn skipped(&self) {
        self.counters.uncached.fetch_add(1, Ordering::Relaxed);
    }

    /// Keeps `plain`, the frame of `hash`. Never fails: a frame that cannot be kept (no
    /// room even after evicting, a disk error) is counted as uncached.
    pub(crate) fn put(&self, hash: &blake3::Hash, plain: &[u8]) {
        let h = *hash.as_bytes();
        let rec = record_bytes(plain.len() as u64);
        if rec > self.cap || !record::frame_len_ok(plain.len() as u64) {
            self.counters.uncached.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let evicted = {
            let mut ix = self.lock();
            if ix.touch(&h).is_some() {
                return;
            }
            ix.evict_for(rec, self.cap)
        };
        self.remove_evicted(evicted);
        for attempt in 0..2 {
            match self.append(&h, plain) {
                Ok(true) => {
                    // Another thread's frame may have gone in meanwhile.
                    let evicted = self.lock().evict_for(0, self.cap);
                    self.remove_evicted(evicted);
                    return;
                }
                Ok(false) => break,
                Err(e) if attempt == 0 && is_io_full(&e) => {
                    // The disk is fuller than the bound says (other files on it): make room
                    // of an eighth of the cache, and try once more. Unless room made lately
                    // did not help (the space is another's, or held by a segment a peer
                    // still has open): then the frame goes uncached, and the cache is not
                    // emptied an eighth a frame.
                    let full = self.full_until.lock().unwrap_or_else(|e| e.into_inner());
                    if full.is_some_and(|t| std::time::Instant::now() < t) {
                        break;
                    }
                    drop(full);
                    let evicted = {
                        let mut ix = self.lock();
                        let target = ix.bytes.saturating_sub(self.cap / 8);
                        ix.evict_for(0, target)
                    };
                    self.remove_evicted(evicted);
                }
                Err(e) => {
                    if is_io_full(&e) {
                        *self.full_until.lock().unwrap_or_else(|e| e.into_inner()) =
                            Some(std::time::Instant::now() + FULL_BACKOFF);
                    }
                    break;
                }
            }
        }
        self.counters.uncached.fetch_add(1, Ordering::Relaxed);
    }

    /// Appends the frame of `h` to this process's segment (a new one when it is full,
    /// gone, or another process removed it): its bytes, then its header. False when its
    /// segment left the cache before it was indexed (not kept).
    fn append(&self, h: &[u8; 32], plain: &[u8]) -> std::io::Result<bool> {
        let rec = record_bytes(plain.len() as u64);
        // A segment takes records until it holds `segment_bytes` (the last may go past).
        let fits = |active: &Option<Active>| {
            active.as_ref().is_some_and(|a| {
                (a.end == 0 || a.end < self.segment_bytes)
                    && self.lock().segs.contains_key(&a.id)
                    && a.file.metadata().is_ok_and(|m| m.nlink() > 0)
            })
        };
        let (id, file, off) = {
            let mut active = self.active.lock().unwrap_or_else(|e| e.into_inner());
            if !fits(&active) {
                // Before a segment is started, the folder looked at, without holding up
                // the appends meanwhile (another thread may start one first).
                drop(active);
                self.adopt();
                active = self.active.lock().unwrap_or_else(|e| e.into_inner());
                if !fits(&active) {
                    *active = None;
                    *active = Some(self.new_segment()?);
                }
            }
            let a = active.as_mut().expect("just made");
            let off = a.end;
            a.end += rec;
            (a.id, Arc::clone(&a.file), off)
        };
        let written = file
            .write_all_at(plain, off + HEADER as u64)
            .and_then(|()| file.write_all_at(&header(h, plain), off));
        // No fsync: a frame lost in a power cut is fetched again, and one half-written
        // fails its check when read, and is dropped.
        if let Err(e) = written {
            let mut active = self.active.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(a) = active.as_mut().filter(|a| a.id == id) {
                // A full disk: cut back if it is the last record. Else (or another error:
                // a bad block, a file-size limit) no more appends to this segment (a scan
                // stops at the hole).
                if is_io_full(&e) && a.end == off + rec && file.set_len(off).is_ok() {
                    a.end = off;
                } else {
                    *active = None;
                    drop(active);
                    // Given up with no record in it, it would stay for ever (an empty
                    // segment frees nothing when evicted, so none ever is), and a disk
                    // that stays full would make one a frame.
                    let empty = {
                        let mut ix = self.lock();
                        match ix.segs.get(&id).is_some_and(|s| s.frames.is_empty()) {
                            true => ix.remove_seg(id),
                            false => None,
                        }
                    };
                    if let Some((s, _)) = empty {
                        let _ = std::fs::remove_file(&s.path);
                    }
                }
            }
            return Err(e);
        }
        let len = plain.len() as u64;
        Ok(self.lock().add(*h, Entry { seg: id, off, len }))
    }

    /// Brings the index level with the folder, as a segment is started (once every 64th of
    /// the bound written): the segments other processes over the folder made since this
    /// one looked (a hand-over's old server, a `move-in` beside a server) come in
    /// with their whole records, records appended since to those it knows come in too,
    /// those removed behind its back go out, and the least recently used go until the
    /// bound holds. So the bound is kept on what the folder holds, give or take what the
    /// others appended since, not on this process's view of it. One thread looks at a
    /// time (another skips it); a folder that cannot be read leaves the index as it was.
    fn adopt(&self) {
        let _one = match self.adopting.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return,
        };
        let segdir = self.dir.join("segments");
        // What the index knew before the listing: one of these not listed was removed (a
        // segment made meanwhile is not among them).
        let (known, foreign): (HashSet<PathBuf>, Vec<(PathBuf, u64)>) = {
            let ix = self.lock();
            // Those evicted and not yet gone from the folder are not taken in again either.
            let known = ix
                .segs
                .values()
                .map(|s| s.path.clone())
                .chain(ix.removing.iter().cloned())
                .collect();
            let foreign = ix
                .segs
                .values()
                .filter(|s| !s.ours)
                .map(|s| (s.path.clone(), s.scanned))
                .collect();
            (known, foreign)
        };
        let Ok(listing) = std::fs::read_dir(&segdir) else {
            return;
        };
        let Ok(there) = listing
            .map(|f| f.map(|f| f.path()))
            .collect::<std::io::Result<Vec<PathBuf>>>()
        else {
            return;
        };
        let mut there: Vec<PathBuf> = there
            .into_iter()
            .filter(|p| p.extension().is_some_and(|e| e == "seg"))
            .collect();
        // By name, which starts with the time it was made: the oldest is used least.
        there.sort();
        let listed: HashSet<&PathBuf> = there.iter().collect();
        // Records past where each was scanned: those of new segments, and those appended
        // to others' since.
        let scan_on = |path: &Path, from: u64| {
            let file = open_segment(path).ok()?;
            let meta = file.metadata().ok().filter(|m| m.is_file())?;
            let (records, headers, end) = scan_from(&file, from, meta.len());
            // No record to serve, and no writer's (a header written, or a minute since
            // its last write): a killed process's leftover, removed as a start would.
            let young = || {
                meta.modified()
                    .ok()
                    .and_then(|t| t.elapsed().ok())
                    .is_none_or(|age| age < YOUNG)
            };
            if from == 0 && records.is_empty() && (headers > 0 || !young()) {
                let _ = std::fs::remove_file(path);
                return None;
            }
            // Bytes from `from` on that no record holds (a new segment taken whole where
            // no writer may still append to it).
            let span = on_disk(end, meta.len(), from > 0 || young()) - from.min(end);
            let unheld = span.saturating_sub(records_bytes(&records));
            Some((records, end, unheld, meta.modified().ok()))
        };
        let mut fresh: Vec<_> = there
            .iter()
            .filter(|p| !known.contains(*p))
            .filter_map(|p| Some((p.clone(), scan_on(p, 0)?)))
            .filter(|(_, (records, ..))| !records.is_empty())
            .collect();
        // Taken in least recently used first: by when each was last used (or written).
        fresh.sort_by_key(|(p, (_, _, _, t))| (*t, p.clone()));
        let grown: Vec<_> = foreign
            .iter()
            .filter(|(p, _)| listed.contains(p))
            .filter_map(|(p, from)| Some((p.clone(), scan_on(p, *from)?)))
            .filter(|(_, (records, ..))| !records.is_empty())
            .collect();
        // When each segment known here was last marked used, by whichever process.
        let seen: Vec<(PathBuf, SystemTime)> = there
            .iter()
            .filter(|p| known.contains(*p))
            .filter_map(|p| Some((p.clone(), p.symlink_metadata().ok()?.modified().ok()?)))
            .collect();
        let evicted = {
            let mut ix = self.lock();
            let gone: Vec<u64> = ix
                .segs
                .iter()
                .filter(|(_, s)| known.contains(&s.path) && !listed.contains(&s.path))
                .map(|(&id, _)| id)
                .collect();
            for id in gone {
                ix.remove_seg(id);
            }
            let mut ids: HashMap<PathBuf, u64> = ix
                .segs
                .iter()
                .map(|(&id, s)| (s.path.clone(), id))
                .collect();
            let seen = seen
                .into_iter()
                .filter_map(|(p, t)| Some((t, *ids.get(&p)?)))
                .collect();
            ix.used_elsewhere(seen);
            for (path, (records, end, unheld, marked)) in fresh {
                // One this cache made since it looked, or evicted and is removing.
                if ids.contains_key(&path) || ix.removing.contains(&path) {
                    continue;
                }
                let id = ix.add_seg(path.clone(), None, end, marked);
                ids.insert(path, id);
                ix.hold(id, unheld);
                for (h, off, len) in records {
                    ix.add(h, Entry { seg: id, off, len });
                }
            }
            for (path, (records, end, unheld, _)) in grown {
                let Some(&id) = ids.get(&path) else { continue };
                match ix.segs.get_mut(&id) {
                    Some(s) if s.scanned < end => s.scanned = end,
                    _ => continue,
                }
                ix.hold(id, unheld);
                for (h, off, len) in records {
                    ix.add(h, Entry { seg: id, off, len });
                }
            }
            // An evicted segment is kept out until a listing no longer shows it (its unlink
            // may come after a look that listed it).
            ix.removing.retain(|p| listed.contains(p));
            ix.evict_for(0, self.cap)
        };
        self.remove_evicted(evicted);
    }

    /// A new segment, in the index, empty.
    fn new_segment(&self) -> std::io::Result<Active> {
        // Unique in this process, whatever the caches open in it, and apart from other
        // processes' by the pid and the time.
        static SERIAL: AtomicU64 = AtomicU64::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let path = self.dir.join("segments").join(format!(
            "{nanos:016x}-{}-{}.seg",
            std::process::id(),
            SERIAL.fetch_add(1, Ordering::Relaxed)
        ));
        // Only the segment is made: a cache whose folder was removed (a write that
        // finished after its owner went) is never made again.
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)?;
        let reader = file.try_clone()?;
        let made = reader.metadata().ok().and_then(|m| m.modified().ok());
        let id = self.lock().add_seg(path, Some(reader), 0, made);
        Ok(Active {
            id,
            file: Arc::new(file),
            end: 0,
        })
    }

    fn remove_evicted(&self, (segs, frames): (Vec<Segment>, u64)) {
        self.counters.evictions.fetch_add(frames, Ordering::Relaxed);
        for s in &segs {
            let _ = std::fs::remove_file(&s.path);
        }
    }
}

#[cfg(test)]
impl FrameCache {
    /// Whether it lets go of removed segments as they go (an inotify watch could be had).
    pub(crate) fn watched(&self) -> bool {
        self._removals.is_some()
    }

    /// Where the record of `h` lies: its segment's path and its header's offset.
    pub(crate) fn record_of(&self, h: &blake3::Hash) -> (PathBuf, u64) {
        let ix = self.lock();
        let e = ix.entries[h.as_bytes()];
        (ix.segs[&e.seg].path.clone(), e.off)
    }

    /// Writes `bytes` over the frame of `h` in its record, at `at` (a disk's bit rot).
    pub(crate) fn spoil(&self, h: &blake3::Hash, at: u64, bytes: &[u8]) {
        let (path, off) = self.record_of(h);
        std::fs::OpenOptions::new()
            .write(true)
            .open(path)
            .unwrap()
            .write_all_at(bytes, off + HEADER as u64 + at)
            .unwrap();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Learnt working sets unused for longer than the keep, or past the newest kept, go
    /// when a cache is opened; other files there stay.
    #[test]
    fn learnt_working_sets_unused_for_long_go_when_a_cache_opens() {
        let scratch = guestmem_testkit::Scratch::new("cache-learnt");
        let dir = scratch.join("learnt");
        std::fs::create_dir_all(&dir).unwrap();
        let day = std::time::Duration::from_secs(24 * 3600);
        let now = SystemTime::now();
        let made = |name: &str, age: std::time::Duration| {
            let p = dir.join(name);
            std::fs::write(&p, b"{}").unwrap();
            std::fs::File::options()
                .write(true)
                .open(&p)
                .unwrap()
                .set_modified(now - age)
                .unwrap();
            p
        };
        let old = made("a.guestmem-ws.json", 31 * day);
        let recent = made("b.guestmem-ws.json", 2 * day);
        let other = made("notes.txt", 90 * day);
        prune_learnt(&dir, now);
        assert!(!old.exists() && recent.exists() && other.exists());
        // Past the most kept, the least recently used go.
        for i in 0..LEARNT_MAX + 2 {
            let age = 3 * day + std::time::Duration::from_secs(i as u64);
            made(&format!("{i:05}.guestmem-ws.json"), age);
        }
        prune_learnt(&dir, now);
        let left = std::fs::read_dir(&dir).unwrap().count();
        assert_eq!(left, LEARNT_MAX + 1, "the newest kept, and notes.txt");
        let nth = |i: usize| dir.join(format!("{i:05}.guestmem-ws.json"));
        assert!(recent.exists() && nth(LEARNT_MAX - 2).exists() && !nth(LEARNT_MAX - 1).exists());
    }

    /// The bound a cache was last opened with is kept in its folder, for a process given
    /// none; a folder that says nothing, or nonsense, gives none.
    #[test]
    fn a_caches_bound_is_kept_for_the_next_process() {
        let scratch = guestmem_testkit::Scratch::new("cache-bound");
        let dir = scratch.join("cache");
        assert_eq!(FrameCache::recorded_bound(&dir), None);
        drop(FrameCache::open(&dir, 64 << 20).unwrap());
        assert_eq!(FrameCache::recorded_bound(&dir), Some(64 << 20));
        drop(FrameCache::open(&dir, 32 << 20).unwrap());
        assert_eq!(FrameCache::recorded_bound(&dir), Some(32 << 20));
        std::fs::write(dir.join(BOUND_FILE), "lots\n").unwrap();
        assert_eq!(FrameCache::recorded_bound(&dir), None);
        std::fs::write(dir.join(BOUND_FILE), format!("{}", MAX_CACHE_BYTES + 1)).unwrap();
        assert_eq!(FrameCache::recorded_bound(&dir), None);
        // A FIFO there is not waited on.
        std::fs::remove_file(dir.join(BOUND_FILE)).unwrap();
        let fifo =
            std::ffi::CString::new(dir.join(BOUND_FILE).into_os_string().into_encoded_bytes())
                .unwrap();
        // SAFETY: a NUL-terminated path, live for the call.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        assert_eq!(FrameCache::recorded_bound(&dir), None);
        let left: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .map(|f| f.file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".tmp"))
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }

    /// A folder given by mistake (a home, `/tmp`: it holds anything but a cache's own
    /// names) is refused naming what it holds, and left as it was: its `frames/`, its mode.
    /// An empty one, and a cache of before the tag (its own names only), are taken and
    /// tagged; a tagged one is taken whatever else it holds.
    #[test]
    fn a_folder_that_is_not_a_cache_is_refused_and_left_as_it_was() {
        use std::os::unix::fs::PermissionsExt;
        let scratch = guestmem_testkit::Scratch::new("cache-foreign");
        let home = scratch.join("home");
        std::fs::create_dir_all(home.join("frames")).unwrap();
        std::fs::write(home.join("frames/photo"), b"mine").unwrap();
        std::fs::write(home.join("notes.txt"), b"mine").unwrap();
        std::fs::set_permissions(&home, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = FrameCache::open(&home, 64 << 20).err().unwrap().to_string();
        assert!(
            e.contains("not a guestmem frame cache") && e.contains("home"),
            "{e}"
        );
        assert_eq!(std::fs::read(home.join("frames/photo")).unwrap(), b"mine");
        let mode = std::fs::metadata(&home).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o777, "the folder's mode was changed");
        assert!(!home.join("segments").exists() && !home.join(BOUND_FILE).exists());
        // Empty: taken, and tagged.
        let empty = scratch.join("empty");
        std::fs::create_dir(&empty).unwrap();
        drop(FrameCache::open(&empty, 64 << 20).unwrap());
        let tag = std::fs::read_to_string(empty.join(TAG_FILE)).unwrap();
        assert!(tag.starts_with("Signature: 8a477f597d28d172789f06886806bc55"));
        // Tagged: taken with a file of the operator's beside it.
        std::fs::write(empty.join("README"), b"the host's frame cache").unwrap();
        drop(FrameCache::open(&empty, 64 << 20).unwrap());
        assert!(empty.join("README").exists());
        // A cache made before the tag: its own names only.
        std::fs::remove_file(empty.join(TAG_FILE)).unwrap();
        std::fs::remove_file(empty.join("README")).unwrap();
        drop(FrameCache::open(&empty, 64 << 20).unwrap());
        assert!(empty.join(TAG_FILE).exists());
        // One on a disk of its own (`lost+found`) with a segment and a note beside: a
        // `segments/` of segments only makes it a cache.
        let disk = scratch.join("disk");
        std::fs::create_dir_all(disk.join("lost+found")).unwrap();
        std::fs::create_dir_all(disk.join("segments")).unwrap();
        std::fs::write(disk.join("segments/1.seg"), b"").unwrap();
        std::fs::write(disk.join("NOTES"), b"the frame cache").unwrap();
        drop(FrameCache::open(&disk, 64 << 20).unwrap());
        assert!(disk.join(TAG_FILE).exists() && disk.join("NOTES").exists());
        // A folder of a `frames/` that is not the old layout's: taken (only a cache's own
        // names), its `frames/` left alone.
        let art = scratch.join("art");
        std::fs::create_dir_all(art.join("frames")).unwrap();
        std::fs::write(art.join("frames/0001.png"), b"mine").unwrap();
        drop(FrameCache::open(&art, 64 << 20).unwrap());
        assert_eq!(std::fs::read(art.join("frames/0001.png")).unwrap(), b"mine");
    }

    /// A cache folder on a disk that cannot take it (read-only here) serves uncached; one
    /// the operator must fix (a file where the folder goes) is refused naming it.
    #[test]
    fn a_cache_on_a_disk_that_cannot_take_it_serves_uncached() {
        let scratch = guestmem_testkit::Scratch::new("cache-ro");
        let ro = match guestmem_testkit::Tmpfs::mount(scratch.join("ro"), "ro,size=1m") {
            Ok(t) => t,
            Err(why) => return guestmem_testkit::skip(why),
        };
        let e = FrameCache::open(&ro.join("cache"), 16 << 20).err().unwrap();
        assert!(e.to_string().contains("Read-only"), "{e}");
        assert!(FrameCache::open_or_none(&ro.join("cache"), 16 << 20)
            .unwrap()
            .is_none());
        std::fs::write(scratch.join("file"), b"x").unwrap();
        let e = FrameCache::open_or_none(&scratch.join("file"), 16 << 20)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("file"), "{e}");
        assert!(FrameCache::open_or_none(&scratch.join("ok"), 16 << 20)
            .unwrap()
            .is_some());
    }

    /// The segment files in a cache's folder, by name.
    fn segments(dir: &Path) -> Vec<PathBuf> {
        let mut v: Vec<_> = std::fs::read_dir(dir.join("segments"))
            .unwrap()
            .flatten()
            .map(|f| f.path())
            .collect();
        v.sort();
        v
    }

    /// A tmpfs of `size` (mount options) in a scratch folder of its own, for a test of a
    /// full disk; none where it cannot be mounted (the test skipped, the reason printed).
    /// The mount comes second: bound as `(scratch, disk)`, it is unmounted first.
    fn small_disk(
        name: &str,
        size: &str,
    ) -> Option<(guestmem_testkit::Scratch, guestmem_testkit::Tmpfs)> {
        let scratch = guestmem_testkit::Scratch::new(name);
        match guestmem_testkit::Tmpfs::mount(scratch.join("disk"), size) {
            Ok(t) => Some((scratch, t)),
            Err(why) => {
                guestmem_testkit::skip(why);
                None
            }
        }
    }

    /// Takes the room left on its disk with the file `path`, a page at a time.
    fn fill(path: &Path) {
        let mut f = File::create(path).unwrap();
        let chunk = vec![1u8; 4096];
        while std::io::Write::write_all(&mut f, &chunk).is_ok() {}
    }

    /// Whether every segment holds whole records only, up to its end: nothing half-written
    /// left behind.
    fn whole(dir: &Path) -> bool {
        segments(dir).iter().all(|p| {
            let f = File::open(p).unwrap();
            let len = f.metadata().unwrap().len();
            let end = scan_from(&f, 0, len)
                .0
                .last()
                .map_or(0, |&(_, off, l)| off + record_bytes(l));
            end == len
        })
    }

    #[test]
    fn the_cache_is_bounded_checked_and_found_again_after_a_restart() {
        // Removed when dropped, a failing assertion included.
        let scratch = guestmem_testkit::Scratch::new("cache");
        let dir = scratch.to_path_buf();
        let frames: Vec<Vec<u8>> = (0..5u8).map(|i| vec![i; 4096]).collect();
        let hashes: Vec<_> = frames.iter().map(|f| blake3::hash(f)).collect();
        // Three records' worth: a segment a record.
        let cap = 3 * record_bytes(4096);
        {
            let c = FrameCache::open(&dir, cap).unwrap();
            for (f, h) in frames.iter().zip(&hashes).take(3) {
                c.put(h, f);
            }
            assert_eq!(segments(&dir).len(), 3);
            assert_eq!(c.get(&hashes[0], 4096).as_ref(), Some(&frames[0]));
            // Frame 1 is now the least recently used: it goes for frame 3, its segment
            // removed.
            c.put(&hashes[3], &frames[3]);
            assert_eq!(c.frames(), 3);
            assert!(c.get(&hashes[1], 4096).is_none());
            assert_eq!(c.counters.evictions.load(Ordering::Relaxed), 1);
            assert_eq!(segments(&dir).len(), 3);
            // A frame whose bytes changed on the disk is not served, and is dropped.
            c.spoil(&hashes[2], 100, b"bad");
            assert!(c.get(&hashes[2], 4096).is_none());
            assert_eq!(c.counters.corrupt.load(Ordering::Relaxed), 1);
            assert_eq!(c.frames(), 2);
            // A write a crash cut short: a header whole, its frame not.
            c.put(&hashes[4], &frames[4]);
            let (cut, off) = c.record_of(&hashes[4]);
            let f = File::options().write(true).open(&cut).unwrap();
            f.set_len(off + HEADER as u64 + 100).unwrap();
            // Another process's segment, just made, is left: this one is not young.
            let past = std::time::SystemTime::now() - 2 * YOUNG;
            f.set_modified(past).unwrap();
        }
        // Frame 0 went with frame 4; frame 2 was dropped, and its record marked so.
        let c = FrameCache::open(&dir, cap).unwrap();
        assert_eq!(c.frames(), 1);
        assert_eq!(c.get(&hashes[3], 4096).as_ref(), Some(&frames[3]));
        assert!(c.get(&hashes[2], 4096).is_none());
        assert_eq!(c.counters.corrupt.load(Ordering::Relaxed), 0);
        assert!(whole(&dir), "a segment with no whole record is removed");
        c.put(&hashes[0], &frames[0]);
        c.put(&hashes[1], &frames[1]);
        assert_eq!(c.frames(), 3);
        // Reopened smaller: evicted down to the bound.
        drop(c);
        let c = FrameCache::open(&dir, record_bytes(4096)).unwrap();
        assert_eq!(c.frames(), 1);
        assert_eq!(segments(&dir).len(), 1);
        assert_eq!(c.get(&hashes[1], 4096).as_ref(), Some(&frames[1]));
    }

    /// A disk fuller than the cache's bound says (a 1 MiB tmpfs under a 64 MiB bound): a
    /// frame that finds no room makes some by evicting and is kept; one larger than the
    /// disk is left uncached. Nothing fails, every frame read back is whole or not given,
    /// and no half-written record is left.
    #[test]
    fn a_full_disk_makes_room_by_evicting_or_leaves_the_frame_uncached() {
        let Some((_scratch, disk)) = small_disk("cache-full-disk", "size=1m") else {
            return;
        };
        let dir = disk.join("cache");
        let c = FrameCache::open(&dir, 64 << 20).unwrap();
        let frames: Vec<Vec<u8>> = (1..=8u8).map(|i| vec![i; 256 << 10]).collect();
        for (i, f) in frames.iter().enumerate() {
            let h = blake3::hash(f);
            c.put(&h, f);
            assert_eq!(c.get(&h, f.len()).as_ref(), Some(f), "frame {i} just kept");
        }
        // The disk holds three such frames, not the 64 MiB the bound allows.
        assert!(c.bytes() < 1 << 20, "{} bytes held", c.bytes());
        assert!(c.counters.evictions.load(Ordering::Relaxed) >= 5);
        assert_eq!(c.counters.uncached.load(Ordering::Relaxed), 0);
        for (i, f) in frames.iter().enumerate() {
            if let Some(got) = c.get(&blake3::hash(f), f.len()) {
                assert!(got == *f, "frame {i}: other bytes");
            }
        }
        assert!(whole(&dir));
        // Larger than the whole disk: counted as uncached, not kept, nothing of it left.
        let big = vec![9u8; 2 << 20];
        let hb = blake3::hash(&big);
        c.put(&hb, &big);
        assert_eq!(c.counters.uncached.load(Ordering::Relaxed), 1);
        assert!(c.get(&hb, big.len()).is_none());
        assert!(whole(&dir));
        // And the disk takes frames again.
        let h = blake3::hash(&frames[0]);
        c.put(&h, &frames[0]);
        assert_eq!(c.get(&h, frames[0].len()).as_ref(), Some(&frames[0]));
        drop(c);
    }

    /// A disk full of what evicting does not free (segments a peer still has open, another
    /// program's files): one eighth of the cache is evicted for it, then frames go uncached
    /// for a while, where before each frame evicted another eighth and a few emptied the
    /// cache (a helper's review).
    #[test]
    fn a_disk_that_evicting_does_not_free_costs_the_cache_one_eighth() {
        let Some((_scratch, disk)) = small_disk("cache-full-held", "size=40m") else {
            return;
        };
        let dir = disk.join("cache");
        let c = FrameCache::open(&dir, 32 << 20).unwrap();
        for i in 0..96u32 {
            let f: Vec<u8> = std::iter::repeat_n(i.to_le_bytes(), 64 << 10)
                .flatten()
                .collect();
            c.put(&blake3::hash(&f), &f);
        }
        let held = c.bytes();
        assert!(held >= 24 << 20, "{held}");
        // The rest of the disk taken by another file, and every segment held open.
        fill(&disk.join("filler"));
        let _open: Vec<File> = segments(&dir)
            .iter()
            .map(|p| File::open(p).unwrap())
            .collect();
        let evicted_before = c.counters.evictions.load(Ordering::Relaxed);
        for i in 0..6u8 {
            let f = vec![200 + i; 256 << 10];
            c.put(&blake3::hash(&f), &f);
        }
        assert_eq!(c.counters.uncached.load(Ordering::Relaxed), 6);
        let evicted = c.counters.evictions.load(Ordering::Relaxed) - evicted_before;
        // An eighth (4 MiB), in whole segments.
        assert!(
            c.bytes() >= held - (5 << 20),
            "{} of {held} bytes kept",
            c.bytes()
        );
        assert!(evicted <= 16, "{evicted} frames evicted");
        assert!(whole(&dir));
    }

    #[test]
    fn a_full_cache_removes_its_least_recently_used_segment_whole() {
        let scratch = guestmem_testkit::Scratch::new("cache-segments");
        let dir = scratch.to_path_buf();
        // Four records a segment, 64 segments.
        let cap = SEGMENTS * 4 * record_bytes(4096);
        let c = FrameCache::open(&dir, cap).unwrap();
        let frame = |i: u32| {
            let mut f = vec![0u8; 4096];
            f[..4].copy_from_slice(&i.to_le_bytes());
            (blake3::hash(&f), f)
        };
        for i in 0..256 {
            let (h, f) = frame(i);
            c.put(&h, &f);
        }
        assert_eq!((c.frames(), c.bytes()), (256, cap));
        assert_eq!(segments(&dir).len(), 64);
        // One read keeps frames 0-3's segment; frames 4-7's goes for the next frame.
        assert!(c.get(&frame(0).0, 4096).is_some());
        let (h, f) = frame(256);
        c.put(&h, &f);
        assert_eq!(c.counters.evictions.load(Ordering::Relaxed), 4);
        assert_eq!(c.frames(), 253);
        assert_eq!(segments(&dir).len(), 64);
        for i in 0..257 {
            let got = c.get(&frame(i).0, 4096);
            assert_eq!(got.is_some(), !(4..8).contains(&i), "frame {i}");
            if let Some(got) = got {
                assert_eq!(got, frame(i).1, "frame {i}");
            }
        }
        drop(c);
        let c = FrameCache::open(&dir, cap).unwrap();
        assert_eq!(c.frames(), 253);
        assert_eq!(c.counters.corrupt.load(Ordering::Relaxed), 0);
    }

    /// Which segments were used lately is kept on their files: a restarted cache evicts the
    /// least recently used, not the least recently written, and a second cache over the
    /// folder sees the first one's reads.
    #[test]
    fn the_least_recently_used_order_outlives_a_restart_and_is_shared() {
        let scratch = guestmem_testkit::Scratch::new("cache-lru-kept");
        let dir = scratch.to_path_buf();
        let cap = SEGMENTS * 4 * record_bytes(4096);
        let frame = |i: u32| {
            let mut f = vec![0u8; 4096];
            f[..4].copy_from_slice(&i.to_le_bytes());
            (blake3::hash(&f), f)
        };
        let c = FrameCache::open(&dir, cap).unwrap();
        for i in 0..256 {
            let (h, f) = frame(i);
            c.put(&h, &f);
        }
        // Frames 0-3's segment, the first written, is read last (past a second: a file
        // system's times may be that coarse).
        std::thread::sleep(std::time::Duration::from_millis(1100));
        assert!(c.get(&frame(0).0, 4096).is_some());
        drop(c);
        let c = FrameCache::open(&dir, cap).unwrap();
        let (h, f) = frame(256);
        c.put(&h, &f);
        assert!(
            c.get(&frame(0).0, 4096).is_some(),
            "the segment read last went"
        );
        assert!(c.get(&frame(4).0, 4096).is_none(), "frames 4-7's stayed");
        drop(c);

        // Two caches over one folder: what one reads, the other keeps.
        let a = FrameCache::open(&dir, cap).unwrap();
        let b = FrameCache::open(&dir, cap).unwrap();
        // The least recently used segment now holds frames 8-11; `a` reads it.
        std::thread::sleep(std::time::Duration::from_millis(1100));
        assert!(a.get(&frame(8).0, 4096).is_some());
        // `b` starts segments (it looks at the folder as it does), and evicts.
        for i in 300..304 {
            let (h, f) = frame(i);
            b.put(&h, &f);
        }
        let (h, f) = frame(304);
        b.put(&h, &f);
        assert!(b.get(&frame(8).0, 4096).is_some(), "what `a` read went");
        assert!(b.get(&frame(12).0, 4096).is_none(), "frames 12-15's stayed");
    }

    /// What a killed process left in the folder without a whole record (a record's bytes,
    /// no header), a minute old, is removed when a running cache next looks; a young one
    /// (perhaps another process's, being written) stays.
    #[test]
    fn a_killed_writers_headerless_segment_goes_at_the_next_look() {
        let scratch = guestmem_testkit::Scratch::new("cache-leftover");
        let dir = scratch.to_path_buf();
        let cap = SEGMENTS * 4 * record_bytes(4096);
        let c = FrameCache::open(&dir, cap).unwrap();
        let left = |name: &str, age: std::time::Duration| {
            let p = dir.join("segments").join(name);
            std::fs::write(&p, vec![7u8; 4096]).unwrap();
            File::options()
                .write(true)
                .open(&p)
                .unwrap()
                .set_modified(SystemTime::now() - age)
                .unwrap();
            p
        };
        let old = left(
            "0000000000000001-999999-0.seg",
            std::time::Duration::from_secs(120),
        );
        let young = left("0000000000000002-999999-0.seg", std::time::Duration::ZERO);
        // Frames enough to start a second segment: the cache looks at its folder.
        for i in 0..5u32 {
            let f = vec![i as u8 + 1; 4096];
            c.put(&blake3::hash(&f), &f);
        }
        assert!(!old.exists(), "the leftover stayed");
        assert!(young.exists(), "a young segment went");
    }

    #[test]
    fn a_record_under_another_frames_name_is_not_served() {
        // What a power cut can leave, or a file changed behind the server: one frame's
        // whole record where another's was.
        let scratch = guestmem_testkit::Scratch::new("cache-sealed");
        let (a, b) = (vec![5u8; 8192], vec![6u8; 8192]);
        let (ha, hb) = (blake3::hash(&a), blake3::hash(&b));
        let c = FrameCache::open(&scratch, 64 * 4 * 8192).unwrap();
        c.put(&ha, &a);
        c.put(&hb, &b);
        let ((pa, oa), (pb, ob)) = (c.record_of(&ha), c.record_of(&hb));
        let mut rec = vec![0u8; record_bytes(8192) as usize];
        File::open(&pa)
            .unwrap()
            .read_exact_at(&mut rec, oa)
            .unwrap();
        File::options()
            .write(true)
            .open(&pb)
            .unwrap()
            .write_all_at(&rec, ob)
            .unwrap();
        let mut out = vec![0u8; 8192];
        assert!(!c.read_into(&hb, &mut out));
        assert_eq!(c.counters.corrupt.load(Ordering::Relaxed), 1);
        assert!(!c.contains(&hb), "dropped once found wrong");
        assert_eq!(c.get(&ha, 8192).as_ref(), Some(&a));
        // Its bytes under its own header, its checksum sealed with the other's name: the
        // same.
        c.put(&hb, &b);
        let (pb, ob) = c.record_of(&hb);
        File::options()
            .write(true)
            .open(&pb)
            .unwrap()
            .write_all_at(&a, ob + HEADER as u64)
            .unwrap();
        assert!(c.get(&hb, 8192).is_none());
        assert_eq!(c.counters.corrupt.load(Ordering::Relaxed), 2);
    }

    /// Two caches over one folder (two processes, a hand-over): each appends to its own
    /// segments only, sees what was there when it opened, and reads a segment the other
    /// removed until it lets it go.
    #[test]
    fn two_caches_over_one_folder_append_to_their_own_segments() {
        let scratch = guestmem_testkit::Scratch::new("cache-two");
        let dir = scratch.to_path_buf();
        let frame = |i: u8| {
            let f = vec![i; 4096];
            (blake3::hash(&f), f)
        };
        let cap = 1 << 20;
        let first = FrameCache::open(&dir, cap).unwrap();
        for i in 0..2 {
            let (h, f) = frame(i);
            first.put(&h, &f);
        }
        let second = FrameCache::open(&dir, cap).unwrap();
        assert_eq!(second.frames(), 2);
        let (h2, f2) = frame(2);
        first.put(&h2, &f2);
        assert!(!second.contains(&h2), "appended after it opened");
        let (h3, f3) = frame(3);
        second.put(&h3, &f3);
        let (p1, _) = first.record_of(&h2);
        let (p2, _) = second.record_of(&h3);
        assert_ne!(p1, p2, "a segment of its own");
        assert_eq!(segments(&dir).len(), 2);
        // The second removes the first's segment (evicted down to nothing): the first lets
        // go of it (its frames are fetched again) if it watches the folder, then starts a
        // segment of its own for its next frame.
        drop(second);
        let second = FrameCache::open(&dir, 0).unwrap();
        assert_eq!(second.frames(), 0);
        assert_eq!(segments(&dir).len(), 0);
        if first.watched() {
            // Its files closed last (the index first, then the files): waited for, they
            // say the index let go too.
            assert!(let_go(&dir).is_empty(), "removed segments still held");
            assert_eq!(first.frames(), 0);
            assert_eq!(first.get(&h2, 4096), None);
        } else {
            // No inotify watch to be had: it still reads the file it holds.
            assert_eq!(first.get(&h2, 4096).as_ref(), Some(&f2));
        }
        let (h4, f4) = frame(4);
        first.put(&h4, &f4);
        assert_eq!(segments(&dir).len(), 1);
        drop((first, second));
        let c = FrameCache::open(&dir, cap).unwrap();
        assert_eq!(c.frames(), 1);
        assert_eq!(c.get(&h4, 4096).as_ref(), Some(&f4));
    }

    /// Frame `i` of 4 KiB (its number, then its number's low byte): with its hash.
    fn numbered(i: u32) -> (blake3::Hash, Vec<u8>) {
        let mut f = vec![(i % 251) as u8; 4096];
        f[..4].copy_from_slice(&i.to_le_bytes());
        (blake3::hash(&f), f)
    }

    /// Bytes the segments in a cache's folder take, and that they take no more than `cap`
    /// and a segment each for two caches appending (each may have appended to its open
    /// segment since the other last looked); then that every frame `0..n` either cache
    /// gives is right (a frame the other removed since it looked is a miss).
    fn within_one_bound(dir: &Path, cap: u64, caches: [&FrameCache; 2], n: u32) {
        let on_disk: u64 = segments(dir)
            .iter()
            .map(|p| p.metadata().map_or(0, |m| m.len()))
            .sum();
        let seg = cap / SEGMENTS;
        assert!(
            on_disk <= cap + 2 * seg,
            "{on_disk} bytes on disk, bound {cap}"
        );
        for c in caches {
            for i in 0..n {
                let (h, f) = numbered(i);
                if let Some(got) = c.get(&h, 4096) {
                    assert!(got == f, "frame {i}");
                }
            }
        }
    }

    /// Two caches over one folder keep one bound between them: each takes in the segments
    /// the other made as it starts one of its own (reading the other's frames from then on),
    /// and drops those the other removed. Without that, the folder held 1.8 bounds here.
    #[test]
    fn two_caches_over_one_folder_keep_one_bound() {
        let scratch = guestmem_testkit::Scratch::new("cache-bound");
        let dir = scratch.to_path_buf();
        let frame = numbered;
        // Four records a segment, 64 segments.
        let cap = SEGMENTS * 4 * record_bytes(4096);
        let a = FrameCache::open(&dir, cap).unwrap();
        for i in 0..200 {
            let (h, f) = frame(i);
            a.put(&h, &f);
        }
        let b = FrameCache::open(&dir, cap).unwrap();
        for i in 200..400 {
            let (h, f) = frame(i);
            b.put(&h, &f);
        }
        // The first's next segment (its last is full) takes in the second's: a frame only
        // the second kept is read through the first.
        let (h, f) = frame(400);
        a.put(&h, &f);
        let (h399, f399) = frame(399);
        assert!(
            a.get(&h399, 4096) == Some(f399),
            "the second's frame through the first"
        );
        for i in 401..600 {
            let (h, f) = frame(i);
            a.put(&h, &f);
        }
        within_one_bound(&dir, cap, [&a, &b], 600);
    }

    /// Two caches over one folder writing in turns keep one bound, and each takes in what
    /// the other appended to the segments it knows, not only the segments it had not seen.
    #[test]
    fn two_caches_writing_in_turns_keep_one_bound() {
        let scratch = guestmem_testkit::Scratch::new("cache-turns");
        let dir = scratch.to_path_buf();
        let frame = numbered;
        let cap = SEGMENTS * 4 * record_bytes(4096);
        let a = FrameCache::open(&dir, cap).unwrap();
        let b = FrameCache::open(&dir, cap).unwrap();
        // The first takes in the second's segment with one record; the second appends
        // another to it; the first's next segment (four records a segment) finds it.
        let put = |c: &FrameCache, i: u32| {
            let (h, f) = frame(i);
            c.put(&h, &f);
            h
        };
        let x1 = put(&b, 10_001);
        put(&a, 10_101);
        assert!(a.contains(&x1));
        let x2 = put(&b, 10_002);
        assert!(!a.contains(&x2));
        for i in 10_102..=10_104 {
            put(&a, i);
        }
        assert!(!a.contains(&x2), "its segment is not full yet");
        put(&a, 10_105);
        assert!(a.contains(&x2), "appended to a segment it knew");
        assert!(a.get(&x2, 4096) == Some(frame(10_002).1));
        for i in 0..800 {
            for (c, k) in [(&a, 2 * i), (&b, 2 * i + 1)] {
                let (h, f) = frame(k);
                c.put(&h, &f);
            }
        }
        within_one_bound(&dir, cap, [&a, &b], 1600);
    }

    /// Files of `dir` this process holds open after they were removed.
    fn held_removed(dir: &Path) -> Vec<PathBuf> {
        let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .flatten()
            .filter_map(|fd| std::fs::read_link(fd.path()).ok())
            .filter(|t| t.starts_with(&dir) && t.to_string_lossy().ends_with(" (deleted)"))
            .collect()
    }

    /// A cache that sits idle while another over its folder removes its segments lets go
    /// of their files, so that their disk space comes back: it does not wait for its next
    /// append. Without that, the idle one held every segment it had written (a second
    /// bound on the disk) until it next started a segment.
    #[test]
    fn segments_another_cache_removed_are_let_go_by_an_idle_one() {
        let scratch = guestmem_testkit::Scratch::new("cache-idle");
        let dir = scratch.to_path_buf();
        let cap = SEGMENTS * 4 * record_bytes(4096);
        let a = FrameCache::open(&dir, cap).unwrap();
        if !a.watched() {
            return guestmem_testkit::skip(
                "no inotify instance to be had (fs.inotify.max_user_instances reached)",
            );
        }
        for i in 0..200 {
            let (h, f) = numbered(i);
            a.put(&h, &f);
        }
        assert!((0..200).all(|i| a.get(&numbered(i).0, 4096) == Some(numbered(i).1)));
        let b = FrameCache::open(&dir, cap).unwrap();
        for i in 200..600 {
            let (h, f) = numbered(i);
            b.put(&h, &f);
        }
        assert!(
            (0..200).any(|i| !b.contains(&numbered(i).0)),
            "the second removed some of the first's segments"
        );
        // Let go of by the process's watch, soon: waited for, not timed.
        let held = let_go(&dir);
        assert!(held.is_empty(), "removed segments still open: {held:?}");
        // What the first still gives is right; what went is a miss, not an error.
        for i in 0..600 {
            let (h, f) = numbered(i);
            if let Some(got) = a.get(&h, 4096) {
                assert!(got == f, "frame {i}");
            }
        }
        let on_disk: u64 = segments(&dir)
            .iter()
            .map(|p| p.metadata().map_or(0, |m| m.len()))
            .sum();
        assert!(
            a.bytes() <= on_disk,
            "{} indexed, {on_disk} on disk",
            a.bytes()
        );
    }

    /// Waits (not timed: up to 20 s) until this process holds no removed file of `dir`.
    fn let_go(dir: &Path) -> Vec<PathBuf> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        let mut held = held_removed(dir);
        while !held.is_empty() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
            held = held_removed(dir);
        }
        held
    }

    /// A cache whose whole folder is removed under it lets go of every segment (the watch
    /// ends with its folder), and every cache of the process shares one inotify instance.
    #[test]
    fn caches_share_one_watch_and_let_go_of_a_removed_folder() {
        let inotify_fds = || {
            std::fs::read_dir("/proc/self/fd")
                .unwrap()
                .flatten()
                .filter_map(|fd| std::fs::read_link(fd.path()).ok())
                .filter(|t| t.to_string_lossy().contains("inotify"))
                .count()
        };
        let scratch = guestmem_testkit::Scratch::new("cache-gone");
        let dir = scratch.join("c0");
        let c = FrameCache::open(&dir, 64 * 4 * record_bytes(4096)).unwrap();
        if !c.watched() {
            return guestmem_testkit::skip(
                "no inotify instance to be had (fs.inotify.max_user_instances reached)",
            );
        }
        let before = inotify_fds();
        let more: Vec<FrameCache> = (1..=50)
            .map(|k| FrameCache::open(&scratch.join(format!("c{k}")), 1 << 20).unwrap())
            .collect();
        assert!(more.iter().all(FrameCache::watched));
        // Fifty caches make no instance of their own (other tests of this binary may make a
        // few meanwhile).
        let after = inotify_fds();
        assert!(after < before + 10, "{after} instances, {before} before");
        drop(more);
        for i in 0..40 {
            let (h, f) = numbered(i);
            c.put(&h, &f);
        }
        let canonical = dir.canonicalize().unwrap();
        assert!(held_removed(&canonical).is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
        let held = let_go(&canonical);
        assert!(held.is_empty(), "removed segments still open: {held:?}");
        assert_eq!(c.frames(), 0);
    }

    #[test]
    fn segments_left_by_many_processes_are_read_with_few_files_open() {
        let scratch = guestmem_testkit::Scratch::new("cache-many");
        let dir = scratch.to_path_buf();
        let n = MAX_OPEN as u32 + 22;
        let frame = |i: u32| {
            let mut f = vec![0u8; 4096];
            f[..4].copy_from_slice(&i.to_le_bytes());
            (blake3::hash(&f), f)
        };
        // A process a frame: a segment each.
        for i in 0..n {
            let c = FrameCache::open(&dir, 1 << 30).unwrap();
            let (h, f) = frame(i);
            c.put(&h, &f);
        }
        assert_eq!(segments(&dir).len(), n as usize);
        let c = FrameCache::open(&dir, 1 << 30).unwrap();
        assert_eq!(c.frames(), u64::from(n));
        for round in 0..2 {
            for i in 0..n {
                let (h, f) = frame(i);
                assert_eq!(c.get(&h, 4096), Some(f), "frame {i}, round {round}");
                assert!(c.lock().open <= MAX_OPEN);
            }
        }
        let open = c.lock().segs.values().filter(|s| s.file.is_some()).count();
        assert_eq!(open, MAX_OPEN);
        assert_eq!(c.lock().open, MAX_OPEN);
    }

    /// Threads keeping, reading and evicting frames at once: every frame read is its own
    /// bytes, and what the cache counts is what it holds.
    #[test]
    fn frames_kept_read_and_evicted_at_once_are_read_right() {
        let frame = |i: u32| {
            let mut f = vec![(i % 251) as u8; 4096];
            f[..4].copy_from_slice(&i.to_le_bytes());
            (blake3::hash(&f), f)
        };
        // A segment a record, then four records a segment.
        for per_seg in [0, 4] {
            let scratch = guestmem_testkit::Scratch::new("cache-threads");
            let cap = if per_seg == 0 {
                32 * record_bytes(4096)
            } else {
                SEGMENTS * per_seg * record_bytes(4096)
            };
            let c = FrameCache::open(&scratch, cap).unwrap();
            let frames = if per_seg == 0 { 64 } else { 512 };
            let right = AtomicU64::new(0);
            std::thread::scope(|s| {
                for t in 0..4u32 {
                    let (c, right) = (&c, &right);
                    s.spawn(move || {
                        let mut x = t.wrapping_mul(2654435761) | 1;
                        for _ in 0..1500 {
                            x ^= x << 13;
                            x ^= x >> 17;
                            x ^= x << 5;
                            let (h, f) = frame(x % frames);
                            if (x >> 16) & 1 == 0 {
                                c.put(&h, &f);
                            } else if let Some(got) = c.get(&h, 4096) {
                                assert!(got == f, "frame {} read as another", x % frames);
                                right.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    });
                }
            });
            assert!(right.load(Ordering::Relaxed) > 0);
            assert_eq!(c.counters.corrupt.load(Ordering::Relaxed), 0);
            assert!(c.bytes() <= cap);
            let held = c.frames();
            let on_disk: u64 = segments(&scratch)
                .iter()
                .map(|p| {
                    let f = File::open(p).unwrap();
                    scan_from(&f, 0, f.metadata().unwrap().len()).0.len() as u64
                })
                .sum();
            assert!(held <= on_disk, "{held} held, {on_disk} on disk");
            assert!(c.lock().open <= MAX_OPEN);
            drop(c);
            let c = FrameCache::open(&scratch, cap).unwrap();
            for i in 0..frames {
                let (h, f) = frame(i);
                if let Some(got) = c.get(&h, 4096) {
                    assert!(got == f, "frame {i} after a restart");
                }
            }
            assert_eq!(c.counters.corrupt.load(Ordering::Relaxed), 0);
        }
    }

    /// A cache directory someone else could plant files in is refused, naming why, or made
    /// the server's user's alone: a `segments` that is a link is refused (a cache removes
    /// what it does not know there, so the link's target would lose its files), as is a
    /// folder another user owns; one others may write to is made `go-w`. The folder given
    /// may itself be a link (a cache on another disk). Nothing at the link's target is
    /// touched.
    #[test]
    fn a_cache_folder_others_could_plant_files_in_is_refused_or_made_private() {
        use std::os::unix::fs::PermissionsExt;
        let scratch = guestmem_testkit::Scratch::new("cache-planted");
        let elsewhere = scratch.join("elsewhere");
        std::fs::create_dir(&elsewhere).unwrap();
        std::fs::write(elsewhere.join("victim.txt"), b"mine").unwrap();
        let linked = scratch.join("linked");
        std::fs::create_dir(&linked).unwrap();
        std::os::unix::fs::symlink(&elsewhere, linked.join("segments")).unwrap();
        let Err(e) = FrameCache::open(&linked, 1 << 20) else {
            panic!("a linked segments/ opened");
        };
        assert!(e.to_string().contains("not a directory"), "{e}");
        assert!(
            elsewhere.join("victim.txt").exists(),
            "a file elsewhere went"
        );
        let open = scratch.join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        FrameCache::open(&open, 1 << 20).unwrap();
        let mode = std::fs::metadata(&open).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o755, "{mode:o}");
        // The segments folder it makes is its user's alone.
        let mode = std::fs::metadata(open.join("segments")).unwrap().mode();
        assert_eq!(mode & 0o077, 0, "{mode:o}");
        // A link to a folder of its own, given as the folder: taken.
        let to_open = scratch.join("to-open");
        std::os::unix::fs::symlink(&open, &to_open).unwrap();
        FrameCache::open(&to_open, 1 << 20).unwrap();
        // Another user's (root can make one): refused.
        let theirs = scratch.join("theirs");
        std::fs::create_dir(&theirs).unwrap();
        if std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).is_ok()
            && crate::sys::euid() != 65534
        {
            let Err(e) = FrameCache::open(&theirs, 1 << 20) else {
                panic!("another user's folder opened");
            };
            assert!(e.to_string().contains("owned by uid 65534"), "{e}");
        }
    }

    /// Headers of no length, or of a length no frame has (not whole pages), are not
    /// records: a segment of 100,000 of them (6.4 MB) is opened with nothing indexed, where
    /// each would have been an index entry.
    #[test]
    fn headers_of_no_length_or_part_of_a_page_are_not_records() {
        let scratch = guestmem_testkit::Scratch::new("cache-empty-records");
        std::fs::create_dir_all(scratch.join("segments")).unwrap();
        let mut bytes = Vec::with_capacity(100_000 * HEADER);
        for i in 0..100_000u64 {
            let mut t = [0u8; HEADER];
            t[..8].copy_from_slice(&MAGIC);
            let mut h = [0u8; 32];
            h[8..16].copy_from_slice(&i.to_le_bytes());
            t[16..48].copy_from_slice(&h);
            t[48..56].copy_from_slice(&sealed(&h, checksum(&[])).to_le_bytes());
            bytes.extend_from_slice(&t);
        }
        std::fs::write(scratch.join("segments/planted.seg"), &bytes).unwrap();
        let c = FrameCache::open(&scratch, 1 << 30).unwrap();
        assert_eq!(c.frames(), 0);
        // A whole frame's record is one; one of 100 bytes is not.
        for (len, ok) in [(4096, true), (100, false), (0, false), (8192 + 512, false)] {
            let mut t = header(&[1u8; 32], &[0u8; 4096]);
            t[8..16].copy_from_slice(&(len as u64).to_le_bytes());
            assert_eq!(parse_header(&t).is_some(), ok, "{len}");
        }
    }

    /// Threads that find the disk full at once give their segments up with nothing in
    /// them: each such segment goes (file and index entry), so a disk that stays full does
    /// not leave a segment a frame behind. Before, every one stayed, and was never evicted.
    #[test]
    fn segments_given_up_empty_on_a_full_disk_go() {
        let Some((_scratch, disk)) = small_disk("cache-full-threads", "size=1m") else {
            return;
        };
        let dir = disk.join("cache");
        let c = FrameCache::open(&dir, 64 << 20).unwrap();
        // Everything but the cache's folders goes to a filler.
        fill(&disk.join("filler"));
        std::thread::scope(|s| {
            for t in 0..4u32 {
                let c = &c;
                s.spawn(move || {
                    for i in 0..50u32 {
                        let mut frame = vec![0u8; 64 << 10];
                        frame[..4].copy_from_slice(&t.to_le_bytes());
                        frame[4..8].copy_from_slice(&i.to_le_bytes());
                        c.put(&blake3::hash(&frame), &frame);
                    }
                });
            }
        });
        assert_eq!(c.frames(), 0);
        assert_eq!(c.counters.uncached.load(Ordering::Relaxed), 200);
        let left = segments(&dir).len();
        assert!(left <= 1, "{left} segments left behind");
        assert!(c.lock().segs.len() <= 1, "{} indexed", c.lock().segs.len());
    }

    #[test]
    fn a_young_segment_without_a_whole_record_is_left_to_its_maker() {
        let scratch = guestmem_testkit::Scratch::new("cache-young");
        let first = FrameCache::open(&scratch, 1 << 20).unwrap();
        // What another process sees while the first record's bytes are being written.
        let seg = first.new_segment().unwrap();
        seg.file.write_all_at(&[7u8; 4096], HEADER as u64).unwrap();
        let _second = FrameCache::open(&scratch, 1 << 20).unwrap();
        assert_eq!(segments(&scratch).len(), 1, "left to its maker");
        let old = std::time::SystemTime::now() - 2 * YOUNG;
        seg.file.set_modified(old).unwrap();
        let _third = FrameCache::open(&scratch, 1 << 20).unwrap();
        assert_eq!(segments(&scratch).len(), 0, "an old one is removed");
    }

    /// A segment takes its whole file on disk whatever of it the index can serve: a
    /// record found bad (dropped), and a header a restart cannot read with every record
    /// after it, are counted against the bound too, not left outside it until the
    /// segment is evicted (a helper's review: a flipped byte in a full segment's second
    /// header counted one record of up to 4 GiB on disk).
    #[test]
    fn a_segment_is_counted_whole_after_a_restart_whatever_its_index_holds() {
        let scratch = guestmem_testkit::Scratch::new("cache-counted-whole");
        let frames: Vec<Vec<u8>> = (1..=6u8).map(|i| vec![i; 8192]).collect();
        let hs: Vec<_> = frames.iter().map(|f| blake3::hash(f)).collect();
        let rec = record_bytes(8192);
        {
            let c = FrameCache::open(&scratch, 64 << 20).unwrap();
            for (h, f) in hs.iter().zip(&frames) {
                c.put(h, f);
            }
            let (p1, o1) = c.record_of(&hs[1]);
            let f1 = File::options().write(true).open(&p1).unwrap();
            f1.write_all_at(&[9u8; 4096], o1 + HEADER as u64).unwrap();
            assert!(c.get(&hs[1], 8192).is_none(), "found bad, dropped");
            let (p3, o3) = c.record_of(&hs[3]);
            assert_eq!(p3, p1, "one segment");
            let f3 = File::options().write(true).open(&p3).unwrap();
            f3.write_all_at(&[0u8; 8], o3).unwrap();
        }
        let segs = segments(&scratch);
        assert_eq!(segs.len(), 1);
        let len = std::fs::metadata(&segs[0]).unwrap().len();
        assert_eq!(len, 6 * rec);
        // Written to lately (a writer may still append): up to where the scan stopped,
        // the dropped record included.
        let young = FrameCache::open(&scratch, 64 << 20).unwrap();
        assert_eq!(young.bytes(), 3 * rec);
        drop(young);
        // Left for long: the whole file.
        File::options()
            .write(true)
            .open(&segs[0])
            .unwrap()
            .set_modified(std::time::SystemTime::now() - 2 * YOUNG)
            .unwrap();
        let c = FrameCache::open(&scratch, 64 << 20).unwrap();
        assert_eq!(c.bytes(), len);
        for (i, (h, f)) in hs.iter().zip(&frames).enumerate() {
            let got = c.get(h, 8192);
            match i {
                0 | 2 => assert_eq!(got.as_ref(), Some(f), "frame {i}"),
                _ => assert!(got.is_none(), "frame {i}"),
            }
        }
    }

    #[test]
    fn a_cache_in_the_layout_before_segments_is_removed() {
        let scratch = guestmem_testkit::Scratch::new("cache-old");
        let old = scratch.join("frames").join("ab");
        std::fs::create_dir_all(&old).unwrap();
        std::fs::write(old.join("ab01"), b"x").unwrap();
        let c = FrameCache::open(&scratch, 1 << 20).unwrap();
        assert_eq!(c.frames(), 0);
        assert!(!scratch.join("frames").exists());
        // A folder with anything else in it is not taken for a cache at all
        // (a_folder_that_is_not_a_cache_is_refused_and_left_as_it_was).
    }
}
