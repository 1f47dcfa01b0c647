//! The node-local frame cache: frames as plain bytes in files named by their hash, shared by
//! every VM and snapshot a server serves, bounded in bytes (least recently used out first),
//! and checked every time a frame is read from it. A frame is kept only after its BLAKE3
//! hash was checked against its name (what came from the store is untrusted); the file
//! carries, after the frame, guestmem's block checksum of it sealed with that name, which
//! every read checks: the cache is this host's own, so the re-check is against corruption
//! (a torn write, bit rot, a file changed or moved behind the server's back), at memory
//! speed, where a BLAKE3 pass would cost a warm cache its level with a local file. It
//! outlives the server: a file appears only whole (written beside, then renamed), so a
//! restart, `kill -9` or a hand-over finds every frame it left, and a half-written one is
//! never read (its temporary file is removed at the next start). A full cache writes each
//! new frame over the file of the one it evicts. A full disk is not an error: frames are
//! evicted to make room, and past that served without being kept.

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use super::StoreError;

/// What the cache did, counted since it was opened.
#[derive(Debug, Default)]
pub struct CacheCounters {
    /// Frames read from it.
    pub hits: AtomicU64,
    /// Frames looked for and not there.
    pub misses: AtomicU64,
    /// Frames removed to make room.
    pub evictions: AtomicU64,
    /// Frames not kept: no room even after evicting (a full disk), larger than the cache, or
    /// a fault's frame with no room among the frames waiting to be written.
    pub uncached: AtomicU64,
    /// Frames whose file no longer matched its hash (removed, fetched again).
    pub corrupt: AtomicU64,
}

#[derive(Debug, Default)]
struct Index {
    /// hash -> (bytes, last use).
    entries: super::frame::ByHash<(u64, u64)>,
    /// last use -> hash.
    order: BTreeMap<u64, [u8; 32]>,
    bytes: u64,
    tick: u64,
}

impl Index {
    fn touch(&mut self, h: &[u8; 32]) -> bool {
        let t = self.tick;
        let Some(e) = self.entries.get_mut(h) else {
            return false;
        };
        self.tick += 1;
        self.order.remove(&e.1);
        e.1 = t;
        self.order.insert(t, *h);
        true
    }

    fn insert(&mut self, h: [u8; 32], bytes: u64) {
        if self.touch(&h) {
            return;
        }
        let t = self.tick;
        self.tick += 1;
        self.entries.insert(h, (bytes, t));
        self.order.insert(t, h);
        self.bytes += bytes;
    }

    fn remove(&mut self, h: &[u8; 32]) -> bool {
        match self.entries.remove(h) {
            Some((bytes, t)) => {
                self.order.remove(&t);
                self.bytes -= bytes;
                true
            }
            None => false,
        }
    }

    /// Takes least recently used frames out until `need` more bytes fit under `cap`.
    fn evict_for(&mut self, need: u64, cap: u64) -> Vec<[u8; 32]> {
        let mut out = Vec::new();
        while self.bytes + need > cap {
            let Some((_, h)) = self.order.pop_first() else {
                break;
            };
            let (bytes, _) = self.entries.remove(&h).expect("indexed");
            self.bytes -= bytes;
            out.push(h);
        }
        out
    }
}

/// A node-local cache of frames.
#[derive(Debug)]
pub struct FrameCache {
    dir: PathBuf,
    cap: u64,
    index: Mutex<Index>,
    /// What it did.
    pub counters: CacheCounters,
}

/// Bytes read and checked at a time (half a typical L2 cache).
const CHECK_PIECE: usize = 256 << 10;

/// The trailer after a frame in its file: `GMC2`, 4 zero bytes, the frame's checksum sealed
/// with its name ([`sealed`]). (`GMC1` files, whose checksum was not sealed, are fetched
/// again once.)
const TRAILER: usize = 16;
const TRAILER_MAGIC: [u8; 4] = *b"GMC2";

fn trailer(h: &[u8; 32], plain: &[u8]) -> [u8; TRAILER] {
    let mut t = [0u8; TRAILER];
    t[..4].copy_from_slice(&TRAILER_MAGIC);
    t[8..].copy_from_slice(&sealed(h, checksum(plain)).to_le_bytes());
    t
}

/// A frame's checksum folded with the first 8 bytes of its hash, so that a file passes the
/// check only under the name of the frame it was written for: a file holding another
/// frame's bytes, whole, with their own trailer, fails. That happens when a file is taken
/// for another frame while a reader has it open (the reader then reads the other frame,
/// whole), or after a power cut in which a taken file's rename reached the disk and its
/// overwrite did not.
fn sealed(h: &[u8; 32], sum: u64) -> u64 {
    sum ^ u64::from_le_bytes(h[..8].try_into().expect("8 bytes"))
}

/// The checksum a frame's file carries: guestmem's block checksum (`snapshot/hash.rs`, the
/// check local snapshot images carry), a pass at memory speed. (CRC-64 through crc-fast
/// measured the same here, and overflows a 256 KiB worker stack in a debug build.)
fn checksum(plain: &[u8]) -> u64 {
    let mut h = crate::snapshot::BlockHasher::default();
    h.update(plain);
    h.finish()
}

/// Largest cache, bytes (1 PiB: a typo's guard, not a policy).
pub const MAX_CACHE_BYTES: u64 = 1 << 50;

impl FrameCache {
    /// Opens (or makes) the cache in `dir`, bounded by `cap` bytes: the frames a server left
    /// there are indexed (oldest use first, by modification time), temporary files of a
    /// write that never finished removed, and frames past `cap` evicted.
    pub fn open(dir: &Path, cap: u64) -> Result<FrameCache, StoreError> {
        if cap > MAX_CACHE_BYTES {
            return Err(StoreError::Limit {
                what: "cache size, bytes",
                value: cap,
                limit: MAX_CACHE_BYTES,
            });
        }
        let frames = dir.join("frames");
        let io = |op, path: &Path| {
            let path = path.to_path_buf();
            move |source| StoreError::Io { op, path, source }
        };
        std::fs::create_dir_all(&frames).map_err(io("create the cache directory", &frames))?;
        let mut found: Vec<(i128, [u8; 32], u64)> = Vec::new();
        for fan in std::fs::read_dir(&frames).map_err(io("read the cache directory", &frames))? {
            let Ok(fan) = fan else { continue };
            let Ok(files) = std::fs::read_dir(fan.path()) else {
                continue;
            };
            for f in files.flatten() {
                let name = f.file_name();
                let name = name.to_string_lossy();
                let Ok(meta) = f.path().symlink_metadata() else {
                    continue;
                };
                if name.ends_with(".tmp") || !meta.is_file() {
                    let _ = std::fs::remove_file(f.path());
                    continue;
                }
                let Ok(h) = blake3::Hash::from_hex(name.as_bytes()) else {
                    continue;
                };
                let mtime = meta
                    .modified()
                    .ok()
                    .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                    .map_or(0, |d| d.as_nanos() as i128);
                found.push((
                    mtime,
                    *h.as_bytes(),
                    meta.len().saturating_sub(TRAILER as u64),
                ));
            }
        }
        found.sort();
        let mut index = Index::default();
        for (_, h, len) in found {
            index.insert(h, len);
        }
        let cache = FrameCache {
            dir: dir.to_path_buf(),
            cap,
            index: Mutex::new(Index::default()),
            counters: CacheCounters::default(),
        };
        let evicted = index.evict_for(0, cap);
        *cache.index.lock().unwrap_or_else(|e| e.into_inner()) = index;
        cache.remove_files(&evicted);
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

    /// Bytes held now.
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

    fn path_of(&self, h: &[u8; 32]) -> PathBuf {
        let hex = blake3::Hash::from_bytes(*h).to_hex();
        self.dir.join("frames").join(&hex[..2]).join(hex.as_str())
    }

    /// Whether the frame of `hash` is held (without reading it).
    pub(crate) fn contains(&self, hash: &blake3::Hash) -> bool {
        self.lock().entries.contains_key(hash.as_bytes())
    }

    /// The frame of `hash` (`len` plain bytes), read and checked; `None` when it is not
    /// held, or its file no longer holds it (then it is removed).
    pub(crate) fn get(&self, hash: &blake3::Hash, len: usize) -> Option<Vec<u8>> {
        let h = hash.as_bytes();
        if !self.lock().touch(h) {
            self.counters.misses.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        let mut buf = vec![0u8; len];
        self.read_checked(h, &mut buf, true, true).then_some(buf)
    }

    /// Reads the frame of `hash` into `dst` (its length), checked; false when it is not
    /// held or its file no longer holds it (then it is removed). A frame it cannot give is
    /// not counted as a miss: the caller fetches it next, and that look counts it.
    pub(crate) fn read_into(&self, hash: &blake3::Hash, dst: &mut [u8]) -> bool {
        self.read_into_counted(hash, dst, true)
    }

    /// [`FrameCache::read_into`], counted as a hit only if `hit` (a frame read ahead is
    /// counted when a reader takes it: [`FrameCache::hit`]).
    pub(crate) fn read_into_counted(&self, hash: &blake3::Hash, dst: &mut [u8], hit: bool) -> bool {
        let h = hash.as_bytes();
        if !self.lock().touch(h) {
            return false;
        }
        self.read_checked(h, dst, false, hit)
    }

    /// Counts a hit: a frame read ahead from the cache, taken by its reader.
    pub(crate) fn hit(&self) {
        self.counters.hits.fetch_add(1, Ordering::Relaxed);
    }

    /// Reads a frame the index holds into `dst`, checking its length and checksum; `miss`:
    /// count it as a miss if it cannot be given.
    fn read_checked(&self, h: &[u8; 32], dst: &mut [u8], miss: bool, hit: bool) -> bool {
        let count_miss = || {
            if miss {
                self.counters.misses.fetch_add(1, Ordering::Relaxed);
            }
        };
        use std::os::unix::fs::FileExt;
        let path = self.path_of(h);
        let mut read = || -> std::io::Result<bool> {
            // O_NOATIME: a read must not write the inode back (on a relatime mount, the first
            // read of each frame after it was kept did: 6% of a warm pass's prefetch thread).
            // Refused (EPERM) for a file of another owner: opened without it then.
            let open = |flags| {
                std::fs::OpenOptions::new()
                    .read(true)
                    .custom_flags(libc::O_NOFOLLOW | flags)
                    .open(&path)
            };
            let f = match open(libc::O_NOATIME) {
                Err(e) if e.raw_os_error() == Some(libc::EPERM) => open(0)?,
                f => f?,
            };
            if f.metadata()?.len() != (dst.len() + TRAILER) as u64 {
                return Ok(false);
            }
            let mut t = [0u8; TRAILER];
            f.read_exact_at(&mut t, dst.len() as u64)?;
            // Read and checked a piece at a time: the check reads what the read just left in
            // the CPU's cache, not the whole frame again from memory.
            let mut sum = crate::snapshot::BlockHasher::default();
            for (k, piece) in dst.chunks_mut(CHECK_PIECE).enumerate() {
                f.read_exact_at(piece, (k * CHECK_PIECE) as u64)?;
                sum.update(piece);
            }
            Ok(t[..4] == TRAILER_MAGIC && t[8..] == sealed(h, sum.finish()).to_le_bytes())
        };
        match read() {
            Ok(true) => {
                if hit {
                    self.counters.hits.fetch_add(1, Ordering::Relaxed);
                }
                true
            }
            Ok(false) => {
                self.counters.corrupt.fetch_add(1, Ordering::Relaxed);
                count_miss();
                if self.lock().remove(h) {
                    let _ = std::fs::remove_file(&path);
                }
                false
            }
            Err(_) => {
                // Evicted since it was looked up, or removed from outside.
                count_miss();
                self.lock().remove(h);
                false
            }
        }
    }

    /// Counts a frame not kept because the writes waiting were full.
    pub(crate) fn skipped(&self) {
        self.counters.uncached.fetch_add(1, Ordering::Relaxed);
    }

    /// Keeps `plain`, the frame of `hash`. Never fails: a frame that cannot be kept (no
    /// room even after evicting, a disk error) is counted as uncached.
    pub(crate) fn put(&self, hash: &blake3::Hash, plain: &[u8]) {
        let h = *hash.as_bytes();
        let len = plain.len() as u64;
        if len > self.cap {
            self.counters.uncached.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let evicted = {
            let mut ix = self.lock();
            if ix.touch(&h) {
                return;
            }
            ix.evict_for(len, self.cap)
        };
        // The first frame evicted gives its file to this one (see `write`).
        let mut reuse = evicted.first().map(|e| self.path_of(e));
        self.remove_files(evicted.get(1..).unwrap_or_default());
        self.counters
            .evictions
            .fetch_add(u64::from(reuse.is_some()), Ordering::Relaxed);
        for attempt in 0..2 {
            match self.write(&h, plain, reuse.take()) {
                Ok(()) => {
                    let evicted = {
                        let mut ix = self.lock();
                        ix.insert(h, len);
                        // Another thread's frame may have gone in meanwhile.
                        ix.evict_for(0, self.cap)
                    };
                    self.remove_files(&evicted);
                    return;
                }
                Err(e)
                    if attempt == 0
                        && matches!(e.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT)) =>
                {
                    // The disk is fuller than the bound says (other files on it): make room
                    // of an eighth of the cache, and try once more.
                    let evicted = {
                        let mut ix = self.lock();
                        let target = ix.bytes.saturating_sub(self.cap / 8);
                        ix.evict_for(self.cap - target, self.cap)
                    };
                    self.remove_files(&evicted);
                }
                Err(_) => break,
            }
        }
        self.counters.uncached.fetch_add(1, Ordering::Relaxed);
    }

    /// Writes the frame of `h` beside its name, then renames it into place. `reuse`: the
    /// file of a frame just evicted, taken for this one ([`take`]) and overwritten in place:
    /// no file made and none removed. A full cache keeps one frame for each it evicts, and
    /// on ext4 without a journal, making a file after many were removed costs 0.4-1.2 ms
    /// (its inode allocator looks up each inode freed in the last minutes, to skip it),
    /// where overwriting one costs what its bytes do. A reader that opened the evicted
    /// frame's file just before reads this frame, or a mix, and neither passes the check
    /// under the evicted frame's name ([`sealed`]): a miss, fetched again.
    fn write(&self, h: &[u8; 32], plain: &[u8], reuse: Option<PathBuf>) -> std::io::Result<()> {
        let path = self.path_of(h);
        let parent = path.parent().expect("in a fan-out folder");
        // Only the fan-out folder is made: a cache whose folder was removed (a write that
        // finished after its owner went) is never made again.
        match std::fs::create_dir(parent) {
            Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
                if let Some(old) = reuse {
                    let _ = std::fs::remove_file(old);
                }
                return Err(e);
            }
            _ => {}
        }
        // Unique in this process, whatever the caches open in it.
        static SERIAL: AtomicU64 = AtomicU64::new(0);
        let tmp = parent.join(format!(
            "{}.{}.{}.tmp",
            &path.file_name().expect("named").to_string_lossy()[..16],
            std::process::id(),
            SERIAL.fetch_add(1, Ordering::Relaxed)
        ));
        let r = (|| {
            let (mut f, taken) = match reuse.and_then(|old| take(&old, &tmp)) {
                Some(f) => (f, true),
                None => (
                    std::fs::OpenOptions::new()
                        .write(true)
                        .create_new(true)
                        .mode(0o600)
                        .open(&tmp)?,
                    false,
                ),
            };
            f.write_all(plain)?;
            f.write_all(&trailer(h, plain))?;
            if taken {
                // A larger frame's file is cut to this one's length.
                f.set_len((plain.len() + TRAILER) as u64)?;
            }
            // No fsync: a frame lost in a power cut is fetched again, and one half-written
            // fails its hash when read, and is removed.
            std::fs::rename(&tmp, &path)
        })();
        if r.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        r
    }

    fn remove_files(&self, hashes: &[[u8; 32]]) {
        for h in hashes {
            let _ = std::fs::remove_file(self.path_of(h));
            self.counters.evictions.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The file of an evicted frame at `old`, renamed to `tmp` and opened to be written over;
/// `None`, with no file left under either name, when it is not a plain file with one name:
/// a hard link's other names (a cache copied with `cp -al`) would see the overwrite, and a
/// FIFO or a folder put there from outside must not hold up or break a write.
fn take(old: &Path, tmp: &Path) -> Option<std::fs::File> {
    use std::os::unix::fs::MetadataExt;
    let plain = |m: &std::fs::Metadata| m.file_type().is_file() && m.nlink() == 1;
    if !std::fs::symlink_metadata(old).is_ok_and(|m| plain(&m))
        || std::fs::rename(old, tmp).is_err()
    {
        let _ = std::fs::remove_file(old);
        return None;
    }
    let f = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(tmp);
    match f {
        Ok(f) if f.metadata().is_ok_and(|m| plain(&m)) => Some(f),
        _ => {
            let _ = std::fs::remove_file(tmp);
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cache_is_bounded_checked_and_found_again_after_a_restart() {
        // Removed when dropped, a failing assertion included.
        let scratch = guestmem_testkit::Scratch::new("cache");
        let dir = scratch.to_path_buf();
        let frames: Vec<Vec<u8>> = (0..5u8).map(|i| vec![i; 4096]).collect();
        let hashes: Vec<_> = frames.iter().map(|f| blake3::hash(f)).collect();
        {
            let c = FrameCache::open(&dir, 3 * 4096).unwrap();
            for (f, h) in frames.iter().zip(&hashes).take(3) {
                c.put(h, f);
            }
            assert_eq!(c.get(&hashes[0], 4096).as_ref(), Some(&frames[0]));
            // Frame 1 is now the least recently used: it goes for frame 3.
            c.put(&hashes[3], &frames[3]);
            assert_eq!(c.frames(), 3);
            assert!(c.get(&hashes[1], 4096).is_none());
            assert_eq!(c.counters.evictions.load(Ordering::Relaxed), 1);
            // A frame whose file was changed is not served, and is removed.
            std::fs::write(c.path_of(hashes[2].as_bytes()), vec![9u8; 4096 + TRAILER]).unwrap();
            assert!(c.get(&hashes[2], 4096).is_none());
            assert_eq!(c.counters.corrupt.load(Ordering::Relaxed), 1);
            // A write that never finished.
            let tmp = c.path_of(hashes[4].as_bytes()).with_extension("x.tmp");
            std::fs::create_dir_all(tmp.parent().unwrap()).unwrap();
            std::fs::write(
                c.path_of(hashes[4].as_bytes()).with_extension("x.tmp"),
                b"half",
            )
            .unwrap();
        }
        let c = FrameCache::open(&dir, 3 * 4096).unwrap();
        assert_eq!(c.frames(), 2);
        assert_eq!(c.get(&hashes[3], 4096).as_ref(), Some(&frames[3]));
        // Reopened smaller: evicted down to the bound.
        drop(c);
        let c = FrameCache::open(&dir, 4096).unwrap();
        assert_eq!(c.frames(), 1);
        assert_eq!(tmp_files(&dir), Vec::<PathBuf>::new());
    }

    /// Every `.tmp` file under a cache's folder.
    fn tmp_files(dir: &Path) -> Vec<PathBuf> {
        std::fs::read_dir(dir.join("frames"))
            .unwrap()
            .flatten()
            .flat_map(|d| std::fs::read_dir(d.path()).unwrap().flatten())
            .map(|f| f.path())
            .filter(|p| p.to_string_lossy().ends_with(".tmp"))
            .collect()
    }

    /// A disk fuller than the cache's bound says (a 1 MiB tmpfs under a 64 MiB bound): a
    /// frame that finds no room makes some by evicting and is kept; one larger than the
    /// disk is left uncached. Nothing fails, every frame read back is whole or not given,
    /// and no half-written file is left.
    #[test]
    fn a_full_disk_makes_room_by_evicting_or_leaves_the_frame_uncached() {
        let scratch = guestmem_testkit::Scratch::new("cache-full-disk");
        let disk = match guestmem_testkit::Tmpfs::mount(scratch.join("disk"), "size=1m") {
            Ok(t) => t,
            Err(why) => return guestmem_testkit::skip(why),
        };
        let dir = disk.join("cache");
        let c = FrameCache::open(&dir, 64 << 20).unwrap();
        let frames: Vec<Vec<u8>> = (1..=8u8).map(|i| vec![i; 256 << 10]).collect();
        for (i, f) in frames.iter().enumerate() {
            let h = blake3::hash(f);
            c.put(&h, f);
            assert_eq!(c.get(&h, f.len()).as_ref(), Some(f), "frame {i} just kept");
        }
        // The disk holds three such files, not the 64 MiB the bound allows.
        assert!(c.bytes() < 1 << 20, "{} bytes held", c.bytes());
        assert!(c.counters.evictions.load(Ordering::Relaxed) >= 5);
        assert_eq!(c.counters.uncached.load(Ordering::Relaxed), 0);
        for (i, f) in frames.iter().enumerate() {
            if let Some(got) = c.get(&blake3::hash(f), f.len()) {
                assert!(got == *f, "frame {i}: other bytes");
            }
        }
        // Larger than the whole disk: counted as uncached, not kept, no file left behind.
        let big = vec![9u8; 2 << 20];
        let hb = blake3::hash(&big);
        c.put(&hb, &big);
        assert_eq!(c.counters.uncached.load(Ordering::Relaxed), 1);
        assert!(c.get(&hb, big.len()).is_none());
        assert_eq!(tmp_files(&dir), Vec::<PathBuf>::new());
        // And the disk takes frames again.
        let h = blake3::hash(&frames[0]);
        c.put(&h, &frames[0]);
        assert_eq!(c.get(&h, frames[0].len()).as_ref(), Some(&frames[0]));
        drop(c);
    }

    #[test]
    fn a_full_cache_writes_a_new_frame_over_the_file_of_the_one_it_evicts() {
        use std::os::unix::fs::MetadataExt;
        let scratch = guestmem_testkit::Scratch::new("cache-reuse");
        let dir = scratch.to_path_buf();
        let (a, b, small) = (vec![1u8; 8192], vec![2u8; 8192], vec![3u8; 4096]);
        let (ha, hb, hs) = (blake3::hash(&a), blake3::hash(&b), blake3::hash(&small));
        let c = FrameCache::open(&dir, 2 * 8192).unwrap();
        c.put(&ha, &a);
        c.put(&hb, &b);
        // Held open across the eviction: what the file it names holds afterwards.
        let a_file = std::fs::File::open(c.path_of(ha.as_bytes())).unwrap();
        // Full: `a`, the least recently used, goes, and its file now holds `small`, cut to
        // its length, under `small`'s name.
        c.put(&hs, &small);
        let m = a_file.metadata().unwrap();
        assert_eq!(
            m.nlink(),
            1,
            "the evicted frame's file was removed, not taken"
        );
        let mut held = Vec::new();
        std::io::Read::read_to_end(&mut &a_file, &mut held).unwrap();
        let mut want = small.clone();
        want.extend_from_slice(&trailer(hs.as_bytes(), &small));
        assert_eq!(held, want);
        let small_path = c.path_of(hs.as_bytes());
        assert_eq!(std::fs::metadata(&small_path).unwrap().ino(), m.ino());
        assert!(
            !c.path_of(ha.as_bytes()).exists(),
            "the evicted frame's name is gone"
        );
        assert_eq!(c.get(&hs, 4096).as_ref(), Some(&small));
        assert!(c.get(&ha, 8192).is_none());
        assert_eq!(c.get(&hb, 8192).as_ref(), Some(&b));
        assert_eq!(c.counters.evictions.load(Ordering::Relaxed), 1);
        assert_eq!(c.counters.corrupt.load(Ordering::Relaxed), 0);
        // A file taken while it was being written over (a kill -9) was renamed away first:
        // the next start finds the frames whole, and removes the half-written one.
        let half = c.path_of(hb.as_bytes()).with_extension("1.2.tmp");
        std::fs::rename(c.path_of(hb.as_bytes()), &half).unwrap();
        drop(c);
        let c = FrameCache::open(&dir, 2 * 8192).unwrap();
        assert_eq!(c.frames(), 1);
        assert_eq!(c.get(&hs, 4096).as_ref(), Some(&small));
        assert!(!half.exists());
    }

    #[test]
    fn a_frame_whole_under_another_frames_name_is_not_served() {
        // What a reader of a file taken for another frame reads, or a power cut can leave:
        // one frame's whole file, trailer and all, under another's name.
        let scratch = guestmem_testkit::Scratch::new("cache-sealed");
        let (a, b) = (vec![5u8; 8192], vec![6u8; 8192]);
        let (ha, hb) = (blake3::hash(&a), blake3::hash(&b));
        let c = FrameCache::open(&scratch, 4 * 8192).unwrap();
        c.put(&ha, &a);
        c.put(&hb, &b);
        std::fs::copy(c.path_of(ha.as_bytes()), c.path_of(hb.as_bytes())).unwrap();
        let mut out = vec![0u8; 8192];
        assert!(!c.read_into(&hb, &mut out));
        assert_eq!(c.counters.corrupt.load(Ordering::Relaxed), 1);
        assert!(
            !c.path_of(hb.as_bytes()).exists(),
            "removed once found wrong"
        );
        assert_eq!(c.get(&ha, 8192).as_ref(), Some(&a));
    }

    #[test]
    fn an_evicted_frame_with_another_name_is_removed_not_written_over() {
        use std::os::unix::fs::MetadataExt;
        // A cache copied with hard links (`cp -al`): writing over the evicted frame's file
        // would change it under every other name.
        let scratch = guestmem_testkit::Scratch::new("cache-linked");
        let (a, b, d) = (vec![7u8; 8192], vec![8u8; 8192], vec![9u8; 8192]);
        let (ha, hb, hd) = (blake3::hash(&a), blake3::hash(&b), blake3::hash(&d));
        let c = FrameCache::open(&scratch.join("cache"), 2 * 8192).unwrap();
        c.put(&ha, &a);
        c.put(&hb, &b);
        let elsewhere = scratch.join("a-linked");
        std::fs::hard_link(c.path_of(ha.as_bytes()), &elsewhere).unwrap();
        let linked = std::fs::metadata(&elsewhere).unwrap().ino();
        c.put(&hd, &d);
        let mut want = a.clone();
        want.extend_from_slice(&trailer(ha.as_bytes(), &a));
        assert_eq!(std::fs::read(&elsewhere).unwrap(), want);
        assert_eq!(std::fs::metadata(&elsewhere).unwrap().nlink(), 1);
        assert_ne!(
            std::fs::metadata(c.path_of(hd.as_bytes())).unwrap().ino(),
            linked
        );
        assert_eq!(c.get(&hd, 8192).as_ref(), Some(&d));
        assert_eq!(c.counters.evictions.load(Ordering::Relaxed), 1);
    }
}
