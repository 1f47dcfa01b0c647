//! A push's frames, many threads at once: each read (a whole frame, or a diff's pages
//! packed), hashed, and uploaded unless the bucket holds it, or held where it lies in its
//! file for a move ([`super::HeldFrames`]); its stack of pieces kept for the manifest.

use std::collections::HashSet;
use std::fs::File;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;

use super::client::Client;
use super::fetch::{FetchPolicy, Frames};
use super::held::HeldFrames;
use super::lease::Lease;
use super::manifest::{Piece, Snapshot, MAX_MANIFEST_BYTES, MAX_PIECES};
use super::memory::overlay;
use super::source::{is_zero, mask_runs, pack, read_file, read_image, read_runs};
use super::url::frame_key;
use super::StoreError;
use crate::snapshot::{Image, ManifestRegion, IMAGE_PAGE_BYTES};

/// A diff's base, and the ranges of the diff file that hold data.
pub(super) type Diff = (Snapshot, Vec<(u64, u64)>);

/// The memory being pushed, read a frame at a time.
pub(super) enum Reader {
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

#[derive(Default)]
pub(super) struct Counters {
    pub(super) zero: AtomicU64,
    pub(super) base: AtomicU64,
    pub(super) read: AtomicU64,
    pub(super) stored: AtomicU64,
    pub(super) stored_bytes: AtomicU64,
    pub(super) skipped: AtomicU64,
    pub(super) skipped_bytes: AtomicU64,
    pub(super) compressed: AtomicU64,
    pub(super) read_ns: AtomicU64,
    pub(super) hash_ns: AtomicU64,
    pub(super) compress_ns: AtomicU64,
    pub(super) upload_ns: AtomicU64,
}

pub(super) struct Job<'a> {
    pub(super) client: &'a Arc<Client>,
    /// Where frames go instead of `client`, held in place.
    pub(super) hold: Option<&'a HeldFrames>,
    pub(super) base_from: &'a Arc<Client>,
    pub(super) compress: bool,
    pub(super) reader: &'a Reader,
    pub(super) frame_bytes: u64,
    pub(super) memory_bytes: u64,
    /// Hashes this push has uploaded or found (each uploaded once).
    pub(super) seen: Mutex<HashSet<[u8; 32]>>,
    /// Frames skipped because the bucket held them: looked at again before the manifest.
    pub(super) skipped_existing: Mutex<Vec<(u64, blake3::Hash)>>,
    pub(super) stacks: Mutex<Vec<Vec<Piece>>>,
    pub(super) counters: Counters,
    pub(super) failed: Mutex<Option<StoreError>>,
    pub(super) stop: AtomicBool,
    /// The caller's stop ([`super::PushConfig::stop`]), and the push's URL.
    pub(super) asked_to_stop: Option<(&'a AtomicBool, &'a super::url::StoreUrl)>,
    pub(super) next: AtomicU64,
    /// The manifest's bytes, as the frames cut so far will write it.
    pub(super) manifest_bytes: AtomicU64,
}

/// A frame's bytes in a manifest, as JSON writes its stack (`[{"h":"…"},{"h":"…","p":"…"}],`).
pub(super) fn entry_bytes(stack: &[Piece]) -> u64 {
    // `[`, `]` and the comma after it; 72 a piece (`{"h":"` 64 hex `"}`), a comma between
    // two; a piece's pages `,"p":"` and 16 hex a word `"`.
    let pieces = stack.len() as u64;
    3 + 72 * pieces
        + pieces.saturating_sub(1)
        + stack
            .iter()
            .map(|p| p.pages.as_ref().map_or(0, |m| 7 + 16 * m.len() as u64))
            .sum::<u64>()
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
    pub(super) fn run(&self, which: &[u64], threads: usize, force: bool, lease: &Lease) {
        std::thread::scope(|s| {
            for _ in 0..threads.clamp(1, 64) {
                s.spawn(|| {
                    // Whole u64s holding at least a frame (a frame's slice is cut from it).
                    let mut buf = vec![0u64; self.frame_bytes.div_ceil(8) as usize];
                    let mut scratch = Vec::new();
                    loop {
                        if self.stop.load(Ordering::Relaxed) {
                            return;
                        }
                        if let Some((_, url)) = self
                            .asked_to_stop
                            .filter(|(s, _)| s.load(Ordering::Relaxed))
                        {
                            self.stop.store(true, Ordering::Relaxed);
                            self.failed
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .get_or_insert(StoreError::Stopped {
                                    op: "push",
                                    url: url.to_string(),
                                });
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
        // The manifest's bytes so far, as JSON writes this frame's stack (`[{"h":"…"},
        // {"h":"…","p":"…"}],`): past the limit a reader takes, the push ends now, not
        // once every frame is up.
        let entry = entry_bytes(&stack);
        let so_far = self.manifest_bytes.fetch_add(entry, Ordering::Relaxed) + entry;
        if so_far > MAX_MANIFEST_BYTES {
            return Err(StoreError::Limit {
                what: "manifest bytes, from the frames cut so far (a larger --frame-size names fewer frames)",
                value: so_far,
                limit: MAX_MANIFEST_BYTES,
            });
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
        let start = i * fb;
        let page = IMAGE_PAGE_BYTES;
        let pages = bytes.len() as u64 / page;
        let (mask, held) = diff_mask(data, start, bytes.len() as u64);
        let below = &base.frames[i as usize];
        let kind = DiffKind::of(held, pages, below.len());
        if kind == DiffKind::Base {
            self.counters.base.fetch_add(1, Ordering::Relaxed);
            return Ok(below.clone());
        }
        self.counters.read.fetch_add(held * page, Ordering::Relaxed);
        if kind == DiffKind::Partial {
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
        if kind == DiffKind::Whole {
            let run = vec![(start, bytes.len() as u64)];
            return Ok(self
                .whole(i, Plain::Read(bytes, run), force)?
                .into_iter()
                .collect());
        }
        {
            // DiffKind::Flatten, the one kind left: too deep a stack, the frame flattened
            // into one whole piece, its base's pieces fetched and the diff's pages laid over
            // them.
            debug_assert_eq!(kind, DiffKind::Flatten);
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
            Ok(self
                .whole(i, Plain::Bytes(&whole), force)?
                .into_iter()
                .collect())
        }
    }
}

/// The pages of the memory at `start..start + len` that a diff holds (`data`: the ranges of
/// its file that hold data, in order): a mask of them, and how many.
pub(super) fn diff_mask(data: &[(u64, u64)], start: u64, len: u64) -> (Vec<u64>, u64) {
    let page = IMAGE_PAGE_BYTES;
    let end = start + len;
    let mut mask = vec![0u64; (len / page).div_ceil(64) as usize];
    let first = data.partition_point(|&(_, e)| e <= start);
    for &(s, e) in &data[first..] {
        if s >= end {
            break;
        }
        for p in (s.max(start) - start) / page..((e.min(end) - start).div_ceil(page)) {
            mask[(p / 64) as usize] |= 1 << (p % 64);
        }
    }
    let held = mask.iter().map(|w| w.count_ones() as u64).sum();
    (mask, held)
}

/// What a diff makes of one frame of its base.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum DiffKind {
    /// It holds none of the frame: the base's pieces stay.
    Base,
    /// Some of its pages: the base's pieces, and one of the diff's pages on top.
    Partial,
    /// All of it: one whole piece (none if its bytes are all zero).
    Whole,
    /// Some of its pages on a stack already [`MAX_PIECES`] deep: one whole piece, the base's
    /// bytes fetched and the diff's laid over them.
    Flatten,
}

impl DiffKind {
    /// The kind of a frame of `pages` pages of which the diff holds `held`, on a stack of
    /// `below` pieces.
    pub(super) fn of(held: u64, pages: u64, below: usize) -> DiffKind {
        match held {
            0 => DiffKind::Base,
            h if h == pages => DiffKind::Whole,
            _ if below < MAX_PIECES => DiffKind::Partial,
            _ => DiffKind::Flatten,
        }
    }
}
