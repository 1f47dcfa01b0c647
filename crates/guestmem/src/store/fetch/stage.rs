//! Frames read ahead into memory, checked, for the fill that will install them: read-ahead
//! asks for a frame the cache holds, a thread of the [`Stage`] reads and checks it on
//! another CPU, and the fill (a prefetch thread's or a fault's) takes it and copies it into
//! the guest straight from there. Without it, the one thread that installs a block also
//! opened, read and checked its frame: a warm pass from the cache cost 1.36-1.53x the local
//! file's, whose blocks are copied straight from the page cache. A frame read-ahead fetched
//! from the store is staged as it lands too, so that it is not read back from the cache.
//!
//! Bounded: the buffers of staged frames and of the one being read hold at most
//! [`STAGED_BYTES`] between them (give or take the one being read), every VM a server serves
//! from one bucket together (a `Frames`), and spare buffers [`SPARE_BYTES`] more. Room for a
//! new one is made by dropping the oldest staged frame nobody has taken (the guest went
//! elsewhere). A staged frame is taken once: whoever reads it first (a fill, a fault's
//! fetch) removes it. A fault never waits for the reader (it runs below the vCPUs): it
//! reads a frame being read itself. The `Frames` side (`stage`, `take_staged`,
//! `give_back`) is here too.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use std::sync::atomic::Ordering;

use super::super::frame::ByHash;
use super::{FrameCache, Frames, Later};

/// Buffers of staged frames and of the one being read, bytes at most (32 MiB: read-ahead's
/// window of 64 frames of 256 KiB twice over).
pub(super) const STAGED_BYTES: usize = 32 << 20;

/// Spare buffers, bytes at most (beside [`STAGED_BYTES`]). A buffer of a frame taken and
/// installed is read into again, not freed and made again (a new one cost the reader a
/// zeroing and a page fault a page: 10% of its time).
const SPARE_BYTES: usize = 8 << 20;

/// How long the reader keeps spare buffers with nothing to read.
const SPARE_IDLE: std::time::Duration = std::time::Duration::from_secs(1);

/// Frames waiting to be read, at most: a frame asked for past this drops the one asked for
/// longest ago (the guest has gone elsewhere since: read-ahead after scattered faults asks
/// for a window at each, and reading stale windows first held up the ones in use).
const MAX_QUEUED: usize = 16;

/// Nice value of the reader thread: prefetch's (it reads what prefetch will install).
const STAGE_NICE: libc::c_int = 5;

#[derive(Debug)]
enum State {
    /// Asked for; no thread reads it yet (it holds no buffer).
    Queued,
    /// A thread reads and checks it now, into a buffer of its length.
    Reading,
    /// Read, checked; whether from the cache (counted as a cache hit when taken).
    Ready(Arc<Vec<u8>>, bool),
}

#[derive(Debug)]
struct Entry {
    state: State,
    len: usize,
    /// The bytes of buffer it holds (its capacity; none while queued).
    held: usize,
}

/// Whether a buffer of capacity `cap` may hold a frame of `len` bytes: not one far larger
/// (frames of 64 KiB to 16 MiB may share a `Frames`), which would hold more than it counts.
fn fits(cap: usize, len: usize) -> bool {
    (len..=2 * len).contains(&cap)
}

#[derive(Debug, Default)]
struct Inner {
    entries: ByHash<Entry>,
    /// Staged frames, oldest first (keys of frames taken since linger until they reach the
    /// front, or the list is swept: never more than twice the entries, plus a few).
    ready: VecDeque<[u8; 32]>,
    /// Frames to read, in the order asked (the same bound).
    queue: VecDeque<[u8; 32]>,
    /// Bytes of the buffers entries hold.
    bytes: usize,
    /// Buffers of frames taken, for the reader to read into again.
    spare: Vec<Vec<u8>>,
    /// Their bytes.
    spare_bytes: usize,
    /// Whether the reader thread runs: it reads into spare buffers, and frees them once
    /// idle; without it none is kept.
    reading: bool,
    stop: bool,
}

impl Inner {
    fn insert(&mut self, h: [u8; 32], state: State, len: usize) {
        let held = match &state {
            State::Ready(b, _) => {
                self.ready.push_back(h);
                b.capacity()
            }
            State::Queued | State::Reading => 0,
        };
        self.bytes += held;
        self.entries.insert(h, Entry { state, len, held });
    }

    fn remove(&mut self, h: &[u8; 32]) -> Option<Entry> {
        let e = self.entries.remove(h)?;
        self.bytes -= e.held;
        // Keys of entries gone are swept before they outnumber the live ones.
        let live = self.entries.len();
        for list in [&mut self.ready, &mut self.queue] {
            if list.len() > 2 * live + 16 {
                let entries = &self.entries;
                list.retain(|k| entries.contains_key(k));
            }
        }
        Some(e)
    }

    /// Drops the oldest staged frame nobody took (the guest went elsewhere): `None` if
    /// there is none; else its buffer, if nothing else holds it.
    fn evict_oldest(&mut self) -> Option<Option<Vec<u8>>> {
        loop {
            let h = self.ready.pop_front()?;
            if !matches!(self.entries.get(&h), Some(e) if matches!(e.state, State::Ready(..))) {
                continue;
            }
            return match self.remove(&h).map(|e| e.state) {
                Some(State::Ready(b, _)) => Some(Arc::try_unwrap(b).ok()),
                _ => Some(None),
            };
        }
    }

    /// Makes room for a frame of `len` more bytes by dropping the oldest staged frames.
    /// False if even then there is none.
    fn room_for(&mut self, len: usize) -> bool {
        while self.bytes + len > STAGED_BYTES {
            if self.evict_oldest().is_none() {
                break;
            }
        }
        self.bytes + len <= STAGED_BYTES
    }

    /// A buffer for the reader to read a frame of `len` into: a spare, an old staged
    /// frame's, or a new one (empty: the caller sizes it, outside the lock) while the bound
    /// allows. The caller counts it as the entry's.
    fn buffer(&mut self, len: usize) -> Option<Vec<u8>> {
        while let Some(b) = self.take_spare() {
            if fits(b.capacity(), len) {
                return Some(b);
            }
        }
        loop {
            if self.bytes + len <= STAGED_BYTES {
                return Some(Vec::new());
            }
            match self.evict_oldest()? {
                Some(b) if fits(b.capacity(), len) => return Some(b),
                _ => continue,
            }
        }
    }

    /// Keeps `buf` for the reader, if it runs (a `Frames` with no cache, or none read from
    /// its cache yet, has no reader to read into it or to free it once idle), nothing else
    /// holds it and it fits the bound.
    fn spare(&mut self, buf: Arc<Vec<u8>>) {
        if self.reading && self.spare_bytes + buf.capacity() <= SPARE_BYTES {
            if let Ok(v) = Arc::try_unwrap(buf) {
                self.spare_bytes += v.capacity();
                self.spare.push(v);
            }
        }
    }

    /// A spare buffer, if any.
    fn take_spare(&mut self) -> Option<Vec<u8>> {
        let b = self.spare.pop()?;
        self.spare_bytes -= b.capacity();
        Some(b)
    }
}

/// The staged frames of one `Frames`, and the thread that reads them from its cache (started
/// on the first frame asked for, stopped when the `Stage` goes).
#[derive(Debug)]
pub(super) struct Stage {
    shared: Arc<(Mutex<Inner>, Condvar)>,
    reader: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Stage {
    pub(super) fn new() -> Stage {
        Stage {
            shared: Arc::new((Mutex::new(Inner::default()), Condvar::new())),
            reader: Mutex::new(None),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.shared.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reads the frame of `hash` (`len` bytes) from `cache` ahead, unless it is staged or
    /// asked for already.
    pub(super) fn ask(&self, cache: &Arc<FrameCache>, hash: &blake3::Hash, len: usize) {
        let h = *hash.as_bytes();
        {
            let mut s = self.lock();
            if s.stop || s.entries.contains_key(&h) {
                return;
            }
            s.insert(h, State::Queued, len);
            s.queue.push_back(h);
            while s.queue.len() > MAX_QUEUED {
                let Some(old) = s.queue.pop_front() else {
                    break;
                };
                if matches!(s.entries.get(&old), Some(e) if matches!(e.state, State::Queued)) {
                    s.remove(&old);
                }
            }
        }
        self.shared.1.notify_all();
        self.start(cache);
    }

    /// Stages `bytes`, the checked frame of `hash` (fetched by read-ahead), if there is room.
    pub(super) fn put(&self, hash: &blake3::Hash, bytes: &Arc<Vec<u8>>) {
        let h = *hash.as_bytes();
        let mut s = self.lock();
        if s.stop || s.entries.contains_key(&h) || !s.room_for(bytes.capacity()) {
            return;
        }
        s.insert(h, State::Ready(Arc::clone(bytes), false), bytes.len());
    }

    /// Takes the frame of `hash` if it is staged (`len` bytes), and whether it was read from
    /// the cache; one only asked for is dropped from the queue (the caller reads it itself).
    /// A prefetch waits for a read under way; a fault does not wait for a thread below the
    /// vCPUs' priority: it reads it itself.
    pub(super) fn take(&self, hash: &blake3::Hash, len: usize) -> Option<(Arc<Vec<u8>>, bool)> {
        let h = *hash.as_bytes();
        let wait = crate::restore::is_prefetcher();
        let mut s = self.lock();
        loop {
            match s.entries.get(&h).map(|e| &e.state) {
                None => return None,
                Some(State::Reading) if wait && !s.stop => {
                    s = self.shared.1.wait(s).unwrap_or_else(|e| e.into_inner());
                }
                Some(State::Reading) => return None,
                Some(State::Queued) => {
                    s.remove(&h);
                    return None;
                }
                Some(State::Ready(..)) => {
                    let e = s.remove(&h).expect("looked up");
                    return match e.state {
                        State::Ready(b, cached) if b.len() == len => Some((b, cached)),
                        _ => None,
                    };
                }
            }
        }
    }

    /// Gives back a frame's bytes taken from it and installed: read into again.
    pub(super) fn give_back(&self, bytes: Arc<Vec<u8>>) {
        let mut s = self.lock();
        if !s.stop {
            let had = !s.spare.is_empty();
            s.spare(bytes);
            if !had && !s.spare.is_empty() {
                // The reader sleeps without a timeout while it holds no spare: wake it to
                // free this one after SPARE_IDLE if nothing comes to read.
                drop(s);
                self.shared.1.notify_all();
            }
        }
    }

    /// Bytes staged or waiting to be read.
    #[cfg(test)]
    fn bytes(&self) -> usize {
        self.lock().bytes
    }

    /// Waits until the frame of `hash` is read (or dropped).
    #[cfg(test)]
    fn read(&self, hash: &blake3::Hash) {
        let s = self.lock();
        let pending = |s: &mut Inner| {
            s.entries
                .get(hash.as_bytes())
                .is_some_and(|e| matches!(e.state, State::Queued | State::Reading))
        };
        drop(self.shared.1.wait_while(s, pending));
    }

    /// Starts the reader thread, once.
    fn start(&self, cache: &Arc<FrameCache>) {
        let mut r = self.reader.lock().unwrap_or_else(|e| e.into_inner());
        if r.is_some() {
            return;
        }
        let (shared, cache) = (Arc::clone(&self.shared), Arc::clone(cache));
        match std::thread::Builder::new()
            .name("guestmem-stage".into())
            .stack_size(crate::jobs::WORKER_STACK_BYTES)
            .spawn(move || read_frames(&shared, &cache))
        {
            Ok(t) => {
                *r = Some(t);
                self.lock().reading = true;
            }
            Err(_) => {
                // No thread: nothing is staged; every fill reads its frame itself.
                let mut s = self.lock();
                s.stop = true;
                for h in std::mem::take(&mut s.queue) {
                    s.remove(&h);
                }
            }
        }
    }
}

impl Drop for Stage {
    /// Stops the reader, without waiting for it (a read on a hung disk must not hold up a
    /// server's stop): it holds only what it shares with nothing else, and exits after its
    /// read.
    fn drop(&mut self) {
        self.lock().stop = true;
        self.shared.1.notify_all();
    }
}

/// Stops a `Stage` whose reader thread unwinds: no fill ever waits for a read that will
/// not finish.
struct Unwinding<'a>(&'a (Mutex<Inner>, Condvar));

impl Drop for Unwinding<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let mut s = self.0 .0.lock().unwrap_or_else(|e| e.into_inner());
            s.stop = true;
            let pending: Vec<[u8; 32]> = s
                .entries
                .iter()
                .filter(|(_, e)| matches!(e.state, State::Queued | State::Reading))
                .map(|(h, _)| *h)
                .collect();
            for h in pending {
                s.remove(&h);
            }
            drop(s);
            self.0 .1.notify_all();
        }
    }
}

/// The reader thread: reads and checks the frames asked for, in their order, until its
/// `Stage` goes.
fn read_frames(shared: &(Mutex<Inner>, Condvar), cache: &FrameCache) {
    let _unwinding = Unwinding(shared);
    crate::sys::set_thread_nice(STAGE_NICE);
    // Any CPU the process may use (best effort): it was started on the first thread that
    // asked, which may be pinned to one node (a populate job's worker).
    let _ = crate::sys::sched_setaffinity(&crate::sys::CpuSet::from_cpus(
        0..libc::CPU_SETSIZE as usize,
    ));
    let (lock, cv) = shared;
    loop {
        let (h, len, mut buf) = {
            let mut s = lock.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if s.stop {
                    return;
                }
                match s.queue.pop_front() {
                    // Spare buffers are let go after SPARE_IDLE with nothing to read; with
                    // none, it waits without a timeout (an idle server never wakes).
                    None if s.spare.is_empty() => {
                        s = cv.wait(s).unwrap_or_else(|e| e.into_inner());
                    }
                    None => {
                        let (g, idle) = cv
                            .wait_timeout(s, SPARE_IDLE)
                            .unwrap_or_else(|e| e.into_inner());
                        s = g;
                        if idle.timed_out() && s.queue.is_empty() {
                            s.spare.clear();
                            s.spare_bytes = 0;
                        }
                    }
                    Some(h) => {
                        let len = match s.entries.get(&h) {
                            Some(e) if matches!(e.state, State::Queued) => e.len,
                            // Taken (or dropped) before its turn.
                            _ => continue,
                        };
                        let Some(buf) = s.buffer(len) else {
                            // No room (cannot happen with one reader): its fill reads it.
                            s.remove(&h);
                            continue;
                        };
                        // Counted at its length until its capacity is known (within 2x).
                        if let Some(e) = s.entries.get_mut(&h) {
                            e.state = State::Reading;
                            e.held = len;
                        }
                        s.bytes += len;
                        break (h, len, buf);
                    }
                }
            }
        };
        // Every byte of it is overwritten by the read (or the frame is not staged).
        buf.resize(len, 0);
        let read = cache.read_into_counted(&blake3::Hash::from_bytes(h), &mut buf, false);
        let mut s = lock.lock().unwrap_or_else(|e| e.into_inner());
        match s.entries.get_mut(&h) {
            Some(e) if read => {
                let (was, now) = (e.held, buf.capacity());
                e.held = now;
                e.state = State::Ready(Arc::new(buf), true);
                s.bytes = s.bytes + now - was;
                s.ready.push_back(h);
            }
            _ => {
                // Gone from the cache since it was asked for: its fill fetches it.
                s.remove(&h);
                s.spare(Arc::new(buf));
            }
        }
        drop(s);
        cv.notify_all();
    }
}

impl Frames {
    /// The frame of `hash` (`len` plain bytes) if it was read ahead into memory (from the
    /// cache, or fetched by read-ahead), checked: taken, so that a fill installs it straight
    /// from there. No read, no fetch.
    pub(crate) fn take_staged(&self, hash: &blake3::Hash, len: usize) -> Option<Arc<Vec<u8>>> {
        let key = match self.later_of(hash) {
            None | Some(Later::Pending) => *hash,
            Some(Later::Zero) => return None,
            Some(Later::Served(h) | Later::Named(h)) => h,
        };
        self.take_from_stage(&key, len)
    }

    /// The staged frame kept as `key`, taken and counted (as a cache hit too if it was read
    /// from the cache).
    pub(super) fn take_from_stage(&self, key: &blake3::Hash, len: usize) -> Option<Arc<Vec<u8>>> {
        let (b, cached) = self.stage.take(key, len)?;
        self.counters.staged.fetch_add(1, Ordering::Relaxed);
        if let (true, Some(c)) = (cached, &self.cache) {
            c.hit();
        }
        Some(b)
    }

    /// Gives back the bytes [`Frames::take_staged`] gave, once installed.
    pub(crate) fn give_back(&self, bytes: Arc<Vec<u8>>) {
        self.stage.give_back(bytes);
    }

    /// Reads `frames` (hash, plain length) that the cache holds into memory, checked, on
    /// the stage's thread, in their order, for the fills that install them next
    /// (`stage.rs`). Returns at once.
    pub(crate) fn stage(&self, frames: &[(blake3::Hash, usize)]) {
        let Some(cache) = &self.cache else {
            return;
        };
        for (asked, len) in frames {
            let hash = match self.later_of(asked) {
                None | Some(Later::Pending) => *asked,
                Some(Later::Zero) => continue,
                Some(Later::Served(h) | Later::Named(h)) => h,
            };
            if cache.contains(&hash) {
                self.stage.ask(cache, &hash, *len);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(len: usize, seed: u8) -> (blake3::Hash, Vec<u8>) {
        let bytes: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(seed) | 1).collect();
        (blake3::hash(&bytes), bytes)
    }

    #[test]
    fn a_frame_asked_for_is_read_checked_and_taken_once_and_room_is_bounded() {
        let dir = std::env::temp_dir().join(format!("guestmem-stage-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cache = Arc::new(FrameCache::open(&dir, 64 << 20).unwrap());
        let stage = Stage::new();
        let len = 256 << 10;
        let (h, bytes) = frame(len, 3);
        cache.put(&h, &bytes);
        let hits = || {
            cache
                .counters
                .hits
                .load(std::sync::atomic::Ordering::Relaxed)
        };
        let before = hits();

        // Asked for: read by the stage's thread, the same bytes, taken once, and said to be
        // from the cache (its reader counts the hit; the read ahead alone does not).
        stage.ask(&cache, &h, len);
        stage.read(&h);
        let (got, cached) = stage.take(&h, len).expect("staged");
        assert_eq!(&got[..], &bytes[..]);
        assert!(cached);
        assert_eq!(hits(), before, "a read ahead is not a hit until taken");
        assert!(stage.take(&h, len).is_none(), "taken once");
        assert_eq!(stage.bytes(), 0);

        // A frame whose record no longer holds it is not staged (its fill fetches it).
        let (h2, b2) = frame(len, 5);
        cache.put(&h2, &b2);
        cache.spoil(&h2, 0, b"torn");
        stage.ask(&cache, &h2, len);
        stage.read(&h2);
        assert!(stage.take(&h2, len).is_none());
        assert_eq!(stage.bytes(), 0, "nothing left behind");

        // Bounded: frames staged as they land drop the oldest for room, never past the bound.
        let n = STAGED_BYTES / len + 8;
        let landed: Vec<_> = (0..n)
            .map(|i| {
                let (h, b) = frame(len, i as u8 + 7);
                (h, Arc::new(b))
            })
            .collect();
        for (h, b) in &landed {
            stage.put(h, b);
            assert!(stage.bytes() <= STAGED_BYTES);
        }
        assert!(
            stage.take(&landed[0].0, len).is_none(),
            "the oldest made room"
        );
        let last = landed.last().unwrap();
        let (b, cached) = stage.take(&last.0, len).expect("staged as it landed");
        assert_eq!(&b[..], &last.1[..]);
        assert!(!cached, "fetched, not read from the cache");
        // A frame of another length than asked is not given.
        let mid = &landed[n / 2];
        assert!(stage.take(&mid.0, len / 2).is_none());
        drop(stage);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn buffers_given_back_are_kept_only_for_a_reader_that_frees_them_when_idle() {
        let len = 256 << 10;
        let unique = || Arc::new(vec![0u8; len]);
        // No reader (a `Frames` with no cache, or none read from it yet): a buffer given
        // back is freed at once, else it would be held for as long as the `Frames` lives.
        let mut inner = Inner::default();
        inner.spare(unique());
        assert_eq!((inner.spare.len(), inner.spare_bytes), (0, 0));
        // A reader: kept for it to read into, if nothing else holds it.
        inner.reading = true;
        inner.spare(unique());
        assert_eq!((inner.spare.len(), inner.spare_bytes), (1, len));
        let held = unique();
        inner.spare(Arc::clone(&held));
        assert_eq!(
            inner.spare.len(),
            1,
            "a buffer still held elsewhere is not kept"
        );

        // The reader frees what it keeps once idle for `SPARE_IDLE`.
        let stage = Stage::new();
        // Removed on drop, a failed assertion too.
        let scratch = guestmem_testkit::Scratch::new("stage-spares");
        let cache = Arc::new(FrameCache::open(&scratch.join("cache"), 16 << 20).unwrap());
        let (h, b) = frame(len, 5);
        cache.put(&h, &b);
        stage.ask(&cache, &h, len);
        stage.read(&h);
        let (got, _) = stage.take(&h, len).expect("read by the reader");
        assert!(
            stage.lock().reading,
            "its reader runs: spares are kept for it"
        );
        stage.give_back(got);
        let spares = || stage.lock().spare.len();
        let t0 = std::time::Instant::now();
        while spares() > 0 {
            assert!(t0.elapsed() < SPARE_IDLE * 20, "spares kept while idle");
            std::thread::sleep(SPARE_IDLE / 10);
        }
        assert_eq!(stage.lock().spare_bytes, 0);
    }
}
