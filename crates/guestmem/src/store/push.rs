//! Pushing a snapshot: its memory cut into frames, each hashed, compressed where that pays,
//! and uploaded once (frames of zeros never, frames the bucket holds already skipped), by
//! many threads at once; the manifest last, so that a snapshot in the store is whole or
//! absent. A push holds a lease in the bucket while it runs, which `gc` respects.

use std::collections::HashSet;
use std::fs::File;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;

use super::client::Client;
use super::fetch::{FetchPolicy, Frames};
use super::held::HeldFrames;
use super::lease::Lease;
use super::manifest::{
    check_frame_bytes, Piece, Snapshot, StoreManifest, FORMAT, MAX_PIECES, VERSION,
};
use super::memory::{overlay, read_snapshot};
use super::source::{
    check_len, image_regions, is_zero, mask_runs, pack, read_file, read_image, read_runs,
    working_frames,
};
use super::url::{frame_key, StoreUrl};
use super::StoreError;
use crate::snapshot::{Image, ManifestRegion, IMAGE_PAGE_BYTES};

/// What a push reads.
#[derive(Debug, Clone)]
pub enum PushSource {
    /// A guestmem snapshot directory (an incremental one with the chain under it): its
    /// memory as its blocks read and checked, its regions and working set kept.
    Guestmem(PathBuf),
    /// A raw memory file, as Firecracker writes a Full snapshot's.
    Raw(PathBuf),
    /// A raw memory file as Firecracker writes a Diff snapshot's: a sparse file whose holes
    /// take the base's pages. Only its pages are stored; the manifest names the base's
    /// frames for the rest.
    RawDiff {
        /// The diff file.
        path: PathBuf,
        /// The snapshot it is a diff on.
        base: StoreUrl,
    },
}

/// How a push runs.
#[derive(Debug, Clone)]
pub struct PushConfig {
    /// Bytes per frame (a power of two, 64 KiB to 16 MiB); a diff takes its base's.
    pub frame_bytes: u64,
    /// Threads reading, hashing, compressing and uploading at once.
    pub threads: usize,
    /// Compress frames where that pays (a move's frames served from its source host are
    /// not: the time is the VM's pause, and the link is fast).
    pub compress: bool,
    /// Where a diff's base is read from, when not from where the push writes (a move's
    /// frames are kept in memory, their base is in the store).
    pub base_from: Option<Arc<Client>>,
    /// A diff's base's manifest, read already (a move reads it before the pause, and the
    /// push during the pause asks the store nothing).
    pub base: Option<Arc<Snapshot>>,
    /// Ask the bucket whether it holds a frame before uploading it (a HEAD each); a push
    /// into an empty place (a move's frames in memory) skips that.
    pub look_first: bool,
}

impl Default for PushConfig {
    fn default() -> Self {
        PushConfig {
            frame_bytes: super::manifest::DEFAULT_FRAME_BYTES,
            threads: 16,
            compress: true,
            base_from: None,
            base: None,
            look_first: true,
        }
    }
}

/// What a push did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct PushReport {
    /// The snapshot's URL.
    pub url: String,
    /// Bytes of memory the snapshot stands for.
    pub memory_bytes: u64,
    /// Frames of it.
    pub frames: u64,
    /// Frames of zeros (stored nowhere).
    pub zero_frames: u64,
    /// Frames that took their base's pieces unchanged (a diff's holes).
    pub base_frames: u64,
    /// Bytes read from the source.
    pub bytes_read: u64,
    /// Objects uploaded (frames; the manifest not counted).
    pub objects_stored: u64,
    /// Bytes uploaded (frame objects, compressed where that paid).
    pub bytes_stored: u64,
    /// Frames not uploaded: the bucket held them already, or this push had just.
    pub objects_skipped: u64,
    /// Plain bytes of the frames skipped.
    pub bytes_skipped: u64,
    /// Frames kept compressed.
    pub compressed: u64,
    /// Bytes of the manifest.
    pub manifest_bytes: u64,
    /// Seconds reading, hashing, compressing and uploading, each summed over threads.
    pub read_secs: f64,
    /// See `read_secs`.
    pub hash_secs: f64,
    /// See `read_secs`.
    pub compress_secs: f64,
    /// See `read_secs`.
    pub upload_secs: f64,
    /// Seconds from start to the manifest written.
    pub wall_secs: f64,
}

/// A diff's base, and the ranges of the diff file that hold data.
type Diff = (Snapshot, Vec<(u64, u64)>);

/// The memory being pushed, read a frame at a time.
enum Reader {
    Image {
        image: Image,
        regions: Vec<ManifestRegion>,
    },
    File {
        file: File,
        len: u64,
        /// For a diff: its base, and the ranges of the file that hold data.
        diff: Option<Box<Diff>>,
    },
}

/// Pushes `source` to `url` through `client`.
pub fn push(
    client: &Arc<Client>,
    source: &PushSource,
    url: &StoreUrl,
    cfg: &PushConfig,
) -> Result<PushReport, StoreError> {
    push_to(client, source, url, cfg, None)
}

/// A push of a raw memory file (a diff, for a move) whose frames go to `frames`, held as
/// where they lie in the file (read again when served), and its manifest to `client`: no
/// memory of the diff's size is taken, and no frame is read twice in it. The manifest is
/// the one [`push`] would write.
pub fn push_held(
    client: &Arc<Client>,
    source: &PushSource,
    url: &StoreUrl,
    cfg: &PushConfig,
    frames: &HeldFrames,
) -> Result<PushReport, StoreError> {
    push_to(client, source, url, cfg, Some(frames))
}

fn push_to(
    client: &Arc<Client>,
    source: &PushSource,
    url: &StoreUrl,
    cfg: &PushConfig,
    hold: Option<&HeldFrames>,
) -> Result<PushReport, StoreError> {
    let t0 = Instant::now();
    client.check()?;
    if client.get(&url.manifest_key())?.is_some() {
        return Err(StoreError::Exists {
            url: url.to_string(),
        });
    }
    let io = |op, path: &Path| {
        let path = path.to_path_buf();
        move |source| StoreError::Io { op, path, source }
    };
    let (reader, memory_bytes, frame_bytes, base_name) = match source {
        PushSource::Guestmem(dir) => {
            if hold.is_some() {
                return Err(StoreError::Io {
                    op: "hold frames in place (a raw memory file only) of",
                    path: dir.clone(),
                    source: std::io::Error::from_raw_os_error(libc::EINVAL),
                });
            }
            let image = Image::open(dir)?;
            let regions = image_regions(&image);
            let memory = regions
                .iter()
                .map(|r| r.file_offset + r.size)
                .max()
                .unwrap_or(0);
            check_frame_bytes(cfg.frame_bytes)?;
            (
                Reader::Image { image, regions },
                memory.next_multiple_of(IMAGE_PAGE_BYTES),
                cfg.frame_bytes,
                None,
            )
        }
        PushSource::Raw(path) => {
            let file = File::open(path).map_err(io("open", path))?;
            let len = file.metadata().map_err(io("stat", path))?.len();
            check_frame_bytes(cfg.frame_bytes)?;
            check_len(len, path)?;
            (
                Reader::File {
                    file,
                    len,
                    diff: None,
                },
                len,
                cfg.frame_bytes,
                None,
            )
        }
        PushSource::RawDiff { path, base } => {
            let file = File::open(path).map_err(io("open", path))?;
            let len = file.metadata().map_err(io("stat", path))?.len();
            let snap = match &cfg.base {
                Some(s) if s.url == *base => Snapshot::clone(s),
                _ => {
                    let from = cfg.base_from.as_ref().unwrap_or(client);
                    let frames = Frames::new(Arc::clone(from), None, FetchPolicy::default());
                    read_snapshot(&frames, base)?
                }
            };
            if len > snap.memory_bytes() {
                return Err(StoreError::Base {
                    url: base.to_string(),
                    reason: format!(
                        "{} is {len:#x} bytes, the base's memory only {:#x}: not a diff of it",
                        path.display(),
                        snap.memory_bytes()
                    ),
                });
            }
            if !snap.manifest.regions.is_empty() {
                return Err(StoreError::Base {
                    url: base.to_string(),
                    reason: "a guestmem snapshot: a raw diff goes on a raw memory file's snapshot"
                        .into(),
                });
            }
            let data = crate::sys::data_ranges(file.as_fd(), 0, len)
                .map_err(io("find the data (SEEK_DATA) of", path))?;
            let (mb, fb) = (snap.memory_bytes(), snap.frame_bytes());
            (
                Reader::File {
                    file,
                    len,
                    diff: Some(Box::new((snap, data))),
                },
                mb,
                fb,
                Some(base.name.clone()),
            )
        }
    };
    if let (Some(h), Reader::File { file, len, .. }) = (hold, &reader) {
        let path = match source {
            PushSource::Raw(p) | PushSource::RawDiff { path: p, .. } => p.as_path(),
            PushSource::Guestmem(p) => p.as_path(),
        };
        h.attach(file.try_clone().map_err(io("open again", path))?, *len)?;
    }
    let count = memory_bytes.div_ceil(frame_bytes);
    if memory_bytes == 0 {
        return Err(StoreError::Limit {
            what: "memory to push, bytes (none)",
            value: 0,
            limit: 0,
        });
    }
    let lease = Lease::take(client, url)?;
    let job = Job {
        client,
        hold,
        base_from: cfg.base_from.as_ref().unwrap_or(client),
        compress: cfg.compress,
        reader: &reader,
        frame_bytes,
        memory_bytes,
        seen: Mutex::new(HashSet::new()),
        skipped_existing: Mutex::new(Vec::new()),
        stacks: Mutex::new(vec![Vec::new(); count as usize]),
        counters: Counters::default(),
        failed: Mutex::new(None),
        stop: AtomicBool::new(false),
        next: AtomicU64::new(0),
    };
    let all: Vec<u64> = (0..count).collect();
    job.run(&all, cfg.threads, !cfg.look_first, &lease);
    if let Some(e) = job.failed.lock().unwrap_or_else(|e| e.into_inner()).take() {
        lease.release();
        return Err(e);
    }
    // A gc that ran between our look at a frame and now may have taken one we skipped as
    // there already (it could not see our lease yet): look again, and upload what went.
    let skipped = std::mem::take(
        &mut *job
            .skipped_existing
            .lock()
            .unwrap_or_else(|e| e.into_inner()),
    );
    let gone: Vec<u64> = {
        let checks = skipped.iter().map(|(i, h)| async move {
            client
                .exists_async(&frame_key(h))
                .await
                .map(|there| (!there).then_some(*i))
        });
        let r = client.block_on(futures::future::try_join_all(checks));
        match r {
            Ok(v) => v.into_iter().flatten().collect(),
            Err(e) => {
                lease.release();
                return Err(e);
            }
        }
    };
    if !gone.is_empty() {
        job.seen.lock().unwrap_or_else(|e| e.into_inner()).clear();
        job.next.store(0, Ordering::Relaxed);
        job.run(&gone, cfg.threads, true, &lease);
        if let Some(e) = job.failed.lock().unwrap_or_else(|e| e.into_inner()).take() {
            lease.release();
            return Err(e);
        }
    }
    let (regions, working_set) = match &reader {
        Reader::Image { image, regions } => (regions.clone(), working_frames(image, frame_bytes)),
        Reader::File { .. } => (Vec::new(), Vec::new()),
    };
    let stacks = std::mem::take(&mut *job.stacks.lock().unwrap_or_else(|e| e.into_inner()));
    let manifest = StoreManifest {
        format: FORMAT.into(),
        version: VERSION,
        name: url.name.clone(),
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() as i64),
        frame_bytes,
        memory_bytes,
        base: base_name,
        regions,
        working_set,
        frames: stacks
            .iter()
            .map(|s| s.iter().map(Piece::to_ref).collect())
            .collect(),
    };
    let text = serde_json::to_vec(&manifest).expect("serialises");
    // Checked as a reader will check it, before it is published (frames held for a move
    // are published to one reader, which checks it so before it loads anything).
    if hold.is_none() {
        Snapshot::parse(url, &text)?;
    }
    if client.get(&url.manifest_key())?.is_some() {
        lease.release();
        return Err(StoreError::Exists {
            url: url.to_string(),
        });
    }
    let r = client.put(&url.manifest_key(), Bytes::from(text.clone()));
    lease.release();
    r?;
    let c = &job.counters;
    let secs = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64 / 1e9;
    Ok(PushReport {
        url: url.to_string(),
        memory_bytes,
        frames: count,
        zero_frames: c.zero.load(Ordering::Relaxed),
        base_frames: c.base.load(Ordering::Relaxed),
        bytes_read: c.read.load(Ordering::Relaxed),
        objects_stored: c.stored.load(Ordering::Relaxed),
        bytes_stored: c.stored_bytes.load(Ordering::Relaxed),
        objects_skipped: c.skipped.load(Ordering::Relaxed),
        bytes_skipped: c.skipped_bytes.load(Ordering::Relaxed),
        compressed: c.compressed.load(Ordering::Relaxed),
        manifest_bytes: text.len() as u64,
        read_secs: secs(&c.read_ns),
        hash_secs: secs(&c.hash_ns),
        compress_secs: secs(&c.compress_ns),
        upload_secs: secs(&c.upload_ns),
        wall_secs: t0.elapsed().as_secs_f64(),
    })
}

#[derive(Default)]
struct Counters {
    zero: AtomicU64,
    base: AtomicU64,
    read: AtomicU64,
    stored: AtomicU64,
    stored_bytes: AtomicU64,
    skipped: AtomicU64,
    skipped_bytes: AtomicU64,
    compressed: AtomicU64,
    read_ns: AtomicU64,
    hash_ns: AtomicU64,
    compress_ns: AtomicU64,
    upload_ns: AtomicU64,
}

struct Job<'a> {
    client: &'a Arc<Client>,
    /// Where frames go instead of `client`, held in place.
    hold: Option<&'a HeldFrames>,
    base_from: &'a Arc<Client>,
    compress: bool,
    reader: &'a Reader,
    frame_bytes: u64,
    memory_bytes: u64,
    /// Hashes this push has uploaded or found (each uploaded once).
    seen: Mutex<HashSet<[u8; 32]>>,
    /// Frames skipped because the bucket held them: looked at again before the manifest.
    skipped_existing: Mutex<Vec<(u64, blake3::Hash)>>,
    stacks: Mutex<Vec<Vec<Piece>>>,
    counters: Counters,
    failed: Mutex<Option<StoreError>>,
    stop: AtomicBool,
    next: AtomicU64,
}

fn timed<T>(ns: &AtomicU64, f: impl FnOnce() -> T) -> T {
    let t = Instant::now();
    let r = f();
    ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
    r
}

/// A frame's plain bytes to upload: borrowed, read from runs (offset, bytes) of a raw file
/// (held as those runs where frames are held in place), or already in a raw frame object
/// (its header first), which is stored as it is where nothing is compressed.
enum Plain<'b> {
    Bytes(&'b [u8]),
    Read(&'b [u8], Vec<(u64, u64)>),
    Raw(Vec<u8>),
}

impl Plain<'_> {
    fn plain(&self) -> &[u8] {
        match self {
            Plain::Bytes(b) | Plain::Read(b, _) => b,
            Plain::Raw(obj) => &obj[super::frame::HEADER_BYTES..],
        }
    }
}

impl Job<'_> {
    /// Frames `which`, on `threads` threads; `force`: upload even what the bucket holds.
    fn run(&self, which: &[u64], threads: usize, force: bool, lease: &Lease) {
        std::thread::scope(|s| {
            for _ in 0..threads.clamp(1, 64) {
                s.spawn(|| {
                    let mut buf = vec![0u64; (self.frame_bytes / 8) as usize];
                    let mut scratch = Vec::new();
                    loop {
                        if self.stop.load(Ordering::Relaxed) {
                            return;
                        }
                        lease.renew_if_due();
                        let k = self.next.fetch_add(1, Ordering::Relaxed) as usize;
                        let Some(&i) = which.get(k) else { return };
                        if let Err(e) = self.frame(i, &mut buf, &mut scratch, force) {
                            self.stop.store(true, Ordering::Relaxed);
                            self.failed
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .get_or_insert(e);
                            return;
                        }
                    }
                });
            }
        });
    }

    fn frame(
        &self,
        i: u64,
        buf: &mut [u64],
        scratch: &mut Vec<u8>,
        force: bool,
    ) -> Result<(), StoreError> {
        let fb = self.frame_bytes;
        let len = fb.min(self.memory_bytes - i * fb) as usize;
        // SAFETY: a u64 buffer viewed as bytes (any bit pattern is a valid u8).
        let bytes: &mut [u8] =
            unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr() as *mut u8, len) };
        let stack = match self.reader {
            Reader::Image { image, regions } => {
                timed(&self.counters.read_ns, || {
                    read_image(image, regions, i * fb, bytes)
                })?;
                self.counters.read.fetch_add(len as u64, Ordering::Relaxed);
                self.whole(i, Plain::Bytes(bytes), force)?
                    .into_iter()
                    .collect()
            }
            Reader::File {
                file,
                len: flen,
                diff: None,
            } => {
                timed(&self.counters.read_ns, || {
                    read_file(file, *flen, i * fb, bytes)
                })?;
                self.counters.read.fetch_add(len as u64, Ordering::Relaxed);
                self.whole(i, Plain::Read(bytes, vec![(i * fb, len as u64)]), force)?
                    .into_iter()
                    .collect()
            }
            Reader::File {
                file,
                len: flen,
                diff: Some(diff),
            } => self.diff_frame(i, file, *flen, &diff.0, &diff.1, bytes, scratch, force)?,
        };
        if stack.is_empty() {
            self.counters.zero.fetch_add(1, Ordering::Relaxed);
        }
        self.stacks.lock().unwrap_or_else(|e| e.into_inner())[i as usize] = stack;
        Ok(())
    }

    /// A whole frame: `None` for zeros, else its piece (uploaded unless there already).
    fn whole(&self, i: u64, bytes: Plain<'_>, force: bool) -> Result<Option<Piece>, StoreError> {
        if is_zero(bytes.plain()) {
            return Ok(None);
        }
        let hash = self.upload(i, bytes, force)?;
        Ok(Some(Piece { hash, pages: None }))
    }

    /// Hashes `plain` (of frame `i`) and uploads it unless this push or the bucket has it.
    fn upload(&self, i: u64, plain: Plain<'_>, force: bool) -> Result<blake3::Hash, StoreError> {
        let c = &self.counters;
        let object = plain;
        let plain_len = object.plain().len() as u64;
        let hash = timed(&c.hash_ns, || blake3::hash(object.plain()));
        if !self
            .seen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(*hash.as_bytes())
        {
            c.skipped.fetch_add(1, Ordering::Relaxed);
            c.skipped_bytes.fetch_add(plain_len, Ordering::Relaxed);
            return Ok(hash);
        }
        if let Some(h) = self.hold {
            // Held in place: nothing stored now (no memory of the frame's size taken).
            let n = plain_len + super::frame::HEADER_BYTES as u64;
            match object {
                Plain::Read(_, runs) => h.hold_runs(&hash, runs),
                Plain::Raw(obj) => h.hold_object(&hash, Bytes::from(obj)),
                Plain::Bytes(b) => h.hold_object(&hash, Bytes::from(super::frame::raw(b))),
            }
            c.stored.fetch_add(1, Ordering::Relaxed);
            c.stored_bytes.fetch_add(n, Ordering::Relaxed);
            return Ok(hash);
        }
        let key = frame_key(&hash);
        if !force {
            let there = timed(&c.upload_ns, || {
                self.client.block_on(self.client.exists_async(&key))
            })?;
            if there {
                c.skipped.fetch_add(1, Ordering::Relaxed);
                c.skipped_bytes.fetch_add(plain_len, Ordering::Relaxed);
                self.skipped_existing
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push((i, hash));
                return Ok(hash);
            }
        }
        let (obj, enc) = match (self.compress, object) {
            (true, o) => timed(&c.compress_ns, || super::frame::encode(o.plain())),
            (false, Plain::Raw(obj)) => (obj, super::frame::Encoding::Raw),
            (false, Plain::Bytes(plain) | Plain::Read(plain, _)) => {
                (super::frame::raw(plain), super::frame::Encoding::Raw)
            }
        };
        if enc == super::frame::Encoding::Zstd {
            c.compressed.fetch_add(1, Ordering::Relaxed);
        }
        let n = obj.len() as u64;
        timed(&c.upload_ns, || self.client.put(&key, Bytes::from(obj)))?;
        c.stored.fetch_add(1, Ordering::Relaxed);
        c.stored_bytes.fetch_add(n, Ordering::Relaxed);
        Ok(hash)
    }

    /// A diff's frame: the base's pieces where the diff holds none of it; a whole piece
    /// where it holds all of it; else the base's pieces and one of the diff's pages.
    #[allow(clippy::too_many_arguments)]
    fn diff_frame(
        &self,
        i: u64,
        file: &File,
        flen: u64,
        base: &Snapshot,
        data: &[(u64, u64)],
        bytes: &mut [u8],
        scratch: &mut Vec<u8>,
        force: bool,
    ) -> Result<Vec<Piece>, StoreError> {
        let fb = self.frame_bytes;
        let (start, end) = (i * fb, i * fb + bytes.len() as u64);
        let page = IMAGE_PAGE_BYTES;
        let pages = bytes.len() as u64 / page;
        let mut mask = vec![0u64; pages.div_ceil(64) as usize];
        let first = data.partition_point(|&(_, e)| e <= start);
        for &(s, e) in &data[first..] {
            if s >= end {
                break;
            }
            for p in (s.max(start) - start) / page..((e.min(end) - start).div_ceil(page)) {
                mask[(p / 64) as usize] |= 1 << (p % 64);
            }
        }
        let held: u64 = mask.iter().map(|w| w.count_ones() as u64).sum();
        let below = &base.frames[i as usize];
        if held == 0 {
            self.counters.base.fetch_add(1, Ordering::Relaxed);
            return Ok(below.clone());
        }
        self.counters.read.fetch_add(held * page, Ordering::Relaxed);
        if held < pages && below.len() < MAX_PIECES {
            // Only the diff's pages are read, packed: straight into their object, or into
            // this thread's scratch where frames are held in place.
            let runs = mask_runs(start, &mask, pages);
            let hash = match self.hold {
                Some(_) => {
                    scratch.clear();
                    timed(&self.counters.read_ns, || {
                        read_runs(file, flen, &runs, scratch)
                    })?;
                    self.upload(i, Plain::Read(scratch, runs), force)?
                }
                None => {
                    let mut packed = super::frame::raw_for((held * page) as usize);
                    timed(&self.counters.read_ns, || {
                        read_runs(file, flen, &runs, &mut packed)
                    })?;
                    self.upload(i, Plain::Raw(packed), force)?
                }
            };
            let mut stack = below.clone();
            stack.push(Piece {
                hash,
                pages: Some(mask),
            });
            return Ok(stack);
        }
        timed(&self.counters.read_ns, || {
            read_file(file, flen, start, bytes)
        })?;
        if held == pages {
            let run = vec![(start, bytes.len() as u64)];
            return Ok(self
                .whole(i, Plain::Read(bytes, run), force)?
                .into_iter()
                .collect());
        }
        if below.len() + 1 > MAX_PIECES {
            // Too deep a stack: the frame flattened into one whole piece, its base's pieces
            // fetched and the diff's pages laid over them.
            let frames = Frames::new(Arc::clone(self.base_from), None, FetchPolicy::default());
            let mut whole = vec![0u8; bytes.len()];
            for p in below {
                let b = frames
                    .get(&p.hash, p.plain_len(bytes.len() as u64) as usize)
                    .map_err(|e| StoreError::Base {
                        url: base.url.to_string(),
                        reason: e.to_string(),
                    })?;
                overlay(&mut whole, p, &b);
            }
            overlay(
                &mut whole,
                &Piece {
                    hash: blake3::hash(b""),
                    pages: Some(mask.clone()),
                },
                &pack(bytes, &mask),
            );
            return Ok(self
                .whole(i, Plain::Bytes(&whole), force)?
                .into_iter()
                .collect());
        }
        // Too deep a stack: the frame flattened into one whole piece (above).
        unreachable!("a partial frame on a stack of {} pieces", below.len())
    }
}
