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
use super::cut::{Counters, Job, Reader};
use super::fetch::{FetchPolicy, Frames};
use super::held::HeldFrames;
use super::lease::{Lease, LEASE_HELD};
use super::manifest::{
    check_frame_bytes, created_now, Piece, Snapshot, StoreManifest, FORMAT, VERSION,
};
use super::memory::read_snapshot;
use super::source::{check_len, image_regions, working_frames};
use super::url::{frame_key, StoreUrl};
use super::StoreError;
use crate::snapshot::{Image, IMAGE_PAGE_BYTES};

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
    ///
    /// Firecracker writes a Diff into a file that is there already, if it has the memory's
    /// size, without truncating it (it merges the diff into it), so every page the file
    /// held before is data too, pushed as changed. Write each Diff to a new path. A file
    /// born long before its last write ([`PushConfig::reused_file_ok`]) is refused.
    RawDiff {
        /// The diff file.
        path: PathBuf,
        /// The snapshot it is a diff on.
        base: StoreUrl,
    },
}

/// Checks that a Firecracker Diff written into `folder` can be pushed as one
/// ([`PushSource::RawDiff`]) or taken by a move: its file system must report a sparse
/// file's data page by page (a hole is the base's page, so data reported in coarser
/// ranges, as a tmpfs with huge pages does, would read the base's pages around each write
/// as zeros). Asked of the file system itself, by writing one page into a sparse file
/// there that is never linked. An error names the folder and why.
pub fn check_diff_folder(folder: &Path) -> Result<(), StoreError> {
    let refused = |source| StoreError::Io {
        op: "hold a Firecracker Diff in",
        path: folder.to_path_buf(),
        source,
    };
    match diff_folder_problem(folder).map_err(refused)? {
        None => Ok(()),
        Some(why) => Err(refused(std::io::Error::other(why))),
    }
}

/// Why a Diff in `folder` would not read right, if it would not.
pub(crate) fn diff_folder_problem(folder: &Path) -> std::io::Result<Option<String>> {
    let dir = File::open(folder)?;
    crate::sys::coarse_data_ranges(dir.as_fd())
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
    /// Push a Diff whose file was there long before Firecracker last wrote it. Firecracker
    /// merges a Diff into a file of the memory's size that is there already (it does not
    /// truncate it), so such a file holds pages from before as data, and they would be
    /// pushed as changed: refused unless this is set (see [`PushSource::RawDiff`]).
    pub reused_file_ok: bool,
    /// Set to stop the push (a signal's handler, say): its threads stop after the frame
    /// each is on, nothing is published, and its lease is given back
    /// ([`StoreError::Stopped`]). A manifest already being written is let finish.
    pub stop: Option<Arc<AtomicBool>>,
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
            reused_file_ok: false,
            stop: None,
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
            let file = open_memory_file(path)?;
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
            let snap = match &cfg.base {
                Some(s) if s.url == *base => Snapshot::clone(s),
                _ => {
                    let from = cfg.base_from.as_ref().unwrap_or(client);
                    let frames = Frames::new(Arc::clone(from), None, FetchPolicy::default());
                    read_snapshot(&frames, base)?
                }
            };
            let (file, len, data) = open_raw_diff(path, base, &snap, cfg.reused_file_ok)?;
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
    // Deleted when dropped, on every way out (else it holds a gc off until it goes stale).
    let lease = Lease::take(client, url)?;
    lease.wait_for_gc()?;
    // A diff's base read before the lease: its manifest deleted (or pushed anew) since, a
    // gc may collect the frames this diff would name. Read again now the lease holds gc off.
    // (Not for a move's diff held for its destination: its lease is on the held client,
    // holds no gc of the store off, and the check would send a GET in the pause.)
    if let (
        None,
        Reader::File {
            diff: Some(diff), ..
        },
    ) = (hold, &reader)
    {
        let base = &diff.0;
        let from = cfg.base_from.as_ref().unwrap_or(client);
        let now = from.get(&base.url.manifest_key())?;
        if now.as_deref().map(blake3::hash) != Some(base.digest) {
            return Err(StoreError::Base {
                url: base.url.to_string(),
                reason: "its manifest was deleted or replaced since it was read (a gc may \
                         take the frames it named): nothing pushed"
                    .into(),
            });
        }
    }
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
        asked_to_stop: cfg.stop.as_deref().map(|s| (s, url)),
        next: AtomicU64::new(0),
        manifest_bytes: AtomicU64::new(0),
    };
    let all: Vec<u64> = (0..count).collect();
    job.run(&all, cfg.threads, !cfg.look_first, &lease);
    if let Some(e) = job.failed.lock().unwrap_or_else(|e| e.into_inner()).take() {
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
    let mut gone: Vec<u64> = Vec::new();
    // At most 64 at once, and the lease renewed between chunks: a push of a large VM whose
    // frames are mostly there skips hundreds of thousands.
    for chunk in skipped.chunks(4096) {
        lease.renew_if_due();
        let checks = chunk.iter().map(|(i, h)| async move {
            client
                .exists_async(&frame_key(h))
                .await
                .map(|there| (!there).then_some(*i))
        });
        use futures::{StreamExt, TryStreamExt};
        let found = client.block_on(
            futures::stream::iter(checks)
                .buffer_unordered(64)
                .try_collect::<Vec<_>>(),
        )?;
        gone.extend(found.into_iter().flatten());
    }
    if !gone.is_empty() {
        // Cut again below, and counted again.
        let stacks = job.stacks.lock().unwrap_or_else(|e| e.into_inner());
        let counted: u64 = gone
            .iter()
            .map(|&i| super::cut::entry_bytes(&stacks[i as usize]))
            .sum();
        drop(stacks);
        job.manifest_bytes.fetch_sub(counted, Ordering::Relaxed);
        job.seen.lock().unwrap_or_else(|e| e.into_inner()).clear();
        job.next.store(0, Ordering::Relaxed);
        job.run(&gone, cfg.threads, true, &lease);
        if let Some(e) = job.failed.lock().unwrap_or_else(|e| e.into_inner()).take() {
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
        created: created_now(),
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
    // The frames' bytes counted as they were cut are what JSON wrote (`[`, `]`, no comma
    // after the last): the early refusal refuses only what a reader would.
    debug_assert!(
        manifest.frames.is_empty()
            || job.manifest_bytes.load(Ordering::Relaxed) + 1
                == serde_json::to_vec(&manifest.frames).map_or(0, |v| v.len() as u64),
        "counted {} bytes of frames",
        job.manifest_bytes.load(Ordering::Relaxed),
    );
    // Checked as a reader will check it, before it is published (frames held for a move
    // are published to one reader, which checks it so before it loads anything).
    let checked = match hold {
        None => Snapshot::parse(url, &text).map(|_| ()),
        Some(_) => Ok(()),
    };
    let there = checked.and_then(|()| client.get(&url.manifest_key()));
    if !matches!(there, Ok(None)) {
        there?;
        return Err(StoreError::Exists {
            url: url.to_string(),
        });
    }
    // Published only if no manifest of that name is there still, decided by the store in
    // the PUT itself: of two pushes to one new name at once, one fails (a store that does
    // not honour the condition leaves only the look above). The lease is confirmed just
    // before: never left unwritten long enough for a gc to take it for a dead push's; and
    // renewed while the PUT runs.
    // Asked to stop after the last frame: nothing is published.
    if cfg.stop.as_ref().is_some_and(|s| s.load(Ordering::Relaxed)) {
        return Err(StoreError::Stopped {
            op: "push",
            url: url.to_string(),
        });
    }
    lease.confirm()?;
    let r = lease.renewed_while(|| client.put_new(&url.manifest_key(), Bytes::from(text.clone())));
    if matches!(r, Ok(true)) && lease.longest_gap() > LEASE_HELD {
        // Published, but the store took no renewal for a while as the PUT ran: a gc may
        // have taken the lease for a dead push's meanwhile.
        tracing::warn!(
            "{url}: published, but the push's lease went {} s without a renewal the store \
             took while its manifest was written (limit {} s): a gc running meanwhile may have \
             deleted frames it names; pull it to check",
            lease.longest_gap().as_secs(),
            LEASE_HELD.as_secs()
        );
    }
    drop(lease);
    if !r? {
        return Err(StoreError::Exists {
            url: url.to_string(),
        });
    }
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

/// Opens the memory file at `path` to read: a regular file (a FIFO is not waited on for a
/// writer, a device not read), refused naming what it is.
fn open_memory_file(path: &Path) -> Result<File, StoreError> {
    use std::os::unix::fs::OpenOptionsExt;
    let err = |op, source| StoreError::Io {
        op,
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| err("open", e))?;
    let meta = file.metadata().map_err(|e| err("stat", e))?;
    if !meta.is_file() {
        use std::os::unix::fs::FileTypeExt;
        let t = meta.file_type();
        let what = match () {
            _ if t.is_dir() => "a directory",
            _ if t.is_fifo() => "a FIFO",
            _ if t.is_socket() => "a socket",
            _ if t.is_block_device() || t.is_char_device() => "a device",
            _ => "not a regular file",
        };
        return Err(err(
            "read as a memory file",
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{what}: a memory file is a regular file"),
            ),
        ));
    }
    Ok(file)
}

/// The slowest a Firecracker Diff is taken to be written (bytes a second, of the memory's
/// length): a file born longer before its last write than the whole memory takes at this
/// rate, and at least a minute, was there before the Diff.
const DIFF_WRITE_MIN_BYTES_PER_SEC: u64 = 32 << 20;

/// How long before its last write a Diff file of `len` bytes may have been made: writing
/// the whole memory at [`DIFF_WRITE_MIN_BYTES_PER_SEC`], and at least a minute.
fn diff_write_limit(len: u64) -> std::time::Duration {
    std::time::Duration::from_secs((len / DIFF_WRITE_MIN_BYTES_PER_SEC).max(60))
}

/// Why a Diff file looks written into a file that was there before, if it does: born
/// (`statx`'s birth time) more than `limit` before its last write. Firecracker opens a
/// Diff's path without truncating a file of the memory's size (it merges into it), so the
/// pages such a file held before read as the diff's. A file system that keeps no birth
/// time, or a file modified before its birth (copied keeping its times), is taken as it is.
fn written_into_older(meta: &std::fs::Metadata, limit: std::time::Duration) -> Option<String> {
    let (born, written) = (meta.created().ok()?, meta.modified().ok()?);
    let apart = written.duration_since(born).ok()?;
    (apart > limit).then(|| {
        format!(
            "it was made {}s before its last write (writing the whole memory takes under \
             {}s): Firecracker writes a Diff into a file of the memory's size that is there \
             already without truncating it, so every page it held before would be pushed as \
             changed (stale where a later layer changed it). Write each Diff to a new path; \
             if this file held only pages of this VM on this base before (an earlier diff \
             of it on this base), push with --reused-file",
            apart.as_secs(),
            limit.as_secs()
        )
    })
}

/// The ranges (offset, end) of a file that hold data.
pub(super) type DataRanges = Vec<(u64, u64)>;

/// Opens the raw diff at `path` as a diff on `snap` (the snapshot at `base`): checked that it
/// fits the base, that its holes are the base's pages and, unless `reused_ok`, that it was
/// not written into a file that was there long before; its length and the ranges of it
/// that hold data.
pub(super) fn open_raw_diff(
    path: &Path,
    base: &StoreUrl,
    snap: &Snapshot,
    reused_ok: bool,
) -> Result<(File, u64, DataRanges), StoreError> {
    let io = |op, path: &Path| {
        let path = path.to_path_buf();
        move |source| StoreError::Io { op, path, source }
    };
    let file = open_memory_file(path)?;
    let meta = file.metadata().map_err(io("stat", path))?;
    let len = meta.len();
    if !reused_ok {
        if let Some(why) = written_into_older(&meta, diff_write_limit(len)) {
            return Err(StoreError::Io {
                op: "read as a diff (Firecracker merges a Diff into a file already there)",
                path: path.to_path_buf(),
                source: std::io::Error::other(why),
            });
        }
    }
    // A base handed in is checked as one read from the store is (its manifest's
    // fields are public): the frames are cut to its frame size.
    check_frame_bytes(snap.frame_bytes())?;
    if snap.frames.len() as u64 != snap.memory_bytes().div_ceil(snap.frame_bytes()) {
        return Err(StoreError::Base {
            url: base.to_string(),
            reason: format!(
                "{} frames for {:#x} bytes in frames of {:#x}",
                snap.frames.len(),
                snap.memory_bytes(),
                snap.frame_bytes()
            ),
        });
    }
    // Firecracker sizes a Diff to the whole of memory: a shorter file is another's, or
    // one cut short (its lost tail would take the base's pages, stale).
    if len != snap.memory_bytes() {
        return Err(StoreError::Base {
            url: base.to_string(),
            reason: format!(
                "{} is {len:#x} bytes, the base's memory {:#x}: not a diff of it (a \
                 Firecracker Diff is as long as the memory it was taken of)",
                path.display(),
                snap.memory_bytes()
            ),
        });
    }
    if !snap.manifest.regions.is_empty() {
        return Err(StoreError::Base {
            url: base.to_string(),
            reason: "a guestmem snapshot: a raw diff goes on a raw memory file's snapshot".into(),
        });
    }
    // A hole is the base's page: data ranges coarser than the pages written would
    // take zeros for memory.
    let folder = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    if let Some(why) = diff_folder_problem(folder).map_err(io("find the filesystem of", path))? {
        return Err(StoreError::Io {
            op: "read as a diff (its holes are the base's pages)",
            path: path.to_path_buf(),
            source: std::io::Error::other(why),
        });
    }
    let data = crate::sys::data_ranges(file.as_fd(), 0, len)
        .map_err(io("find the data (SEEK_DATA) of", path))?;
    // Pages are written whole: data that starts or ends inside one is a file system that
    // reports otherwise than it was written, or not a Diff.
    const PAGE: u64 = 4096;
    if let Some(&(at, end)) = data
        .iter()
        .find(|&&(at, end)| at % PAGE != 0 || (end % PAGE != 0 && end != len))
    {
        return Err(StoreError::Io {
            op: "read as a diff (its holes are the base's pages)",
            path: path.to_path_buf(),
            source: std::io::Error::other(format!(
                "data at {at:#x}..{end:#x} starts or ends inside a 4 KiB page"
            )),
        });
    }
    Ok((file, len, data))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use bytes::Bytes;
    use guestmem_testkit::s3::S3Server;

    use crate::store::Client;

    /// A Diff file made well before its last write (Firecracker merged into a file that
    /// was there: it does not truncate one of the memory's size) is taken as reused; one
    /// written as it is made is not. The limit is a minute at least, and the time the
    /// whole memory takes at 32 MiB/s.
    #[test]
    fn a_diff_file_made_long_before_its_last_write_is_taken_as_reused() {
        use std::io::Write;
        let scratch = guestmem_testkit::Scratch::new("diff-reused");
        let path = scratch.join("diff");
        let mut f = std::fs::File::create(&path).unwrap();
        f.write_all(&[1u8; 4096]).unwrap();
        let Ok(born) = f.metadata().unwrap().created() else {
            eprintln!("skipped: {} keeps no birth time", scratch.display());
            return;
        };
        let meta = f.metadata().unwrap();
        assert!(super::written_into_older(&meta, Duration::from_millis(500)).is_none());
        // Written again past the limit: the file was there before this write.
        while born.elapsed().unwrap() < Duration::from_millis(700) {
            std::thread::sleep(Duration::from_millis(50));
        }
        f.write_all(&[2u8; 4096]).unwrap();
        let meta = f.metadata().unwrap();
        let why = super::written_into_older(&meta, Duration::from_millis(500))
            .expect("a file made before the limit is taken as reused");
        assert!(why.contains("--reused-file"), "{why}");
        assert!(super::written_into_older(&meta, Duration::from_secs(60)).is_none());
        assert_eq!(super::diff_write_limit(1 << 30), Duration::from_secs(60));
        assert_eq!(super::diff_write_limit(64 << 30), Duration::from_secs(2048));
    }

    /// A manifest is written only where none is: the real S3 server decides from the PUT's
    /// `If-None-Match`, so a name taken between a push's look and its write is refused and
    /// the manifest there is left as it was; the same bytes again count as written.
    #[test]
    fn a_manifest_is_written_only_where_none_is() {
        let s3 = S3Server::start("put-new", &["snaps"]);
        let env = s3.env();
        let get = move |k: &str| env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone());
        let c = Arc::new(Client::connect_with("snaps", &get).unwrap());
        let key = "vm/manifest.json";
        assert!(c.put_new(key, Bytes::from_static(b"first")).unwrap());
        assert!(!c.put_new(key, Bytes::from_static(b"second")).unwrap());
        assert_eq!(c.get(key).unwrap().unwrap(), Bytes::from_static(b"first"));
        assert!(c.put_new(key, Bytes::from_static(b"first")).unwrap());
        assert_eq!(c.get(key).unwrap().unwrap(), Bytes::from_static(b"first"));
        // A store that does not take the condition, as the operator says
        // (`AWS_CONDITIONAL_PUT=disabled`): a plain PUT, the caller's look the only guard.
        let mut env = s3.env();
        env.push(("AWS_CONDITIONAL_PUT", "disabled".into()));
        let get = move |k: &str| env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone());
        let plain = Client::connect_with("snaps", &get).unwrap();
        assert!(plain.put_new(key, Bytes::from_static(b"third")).unwrap());
        assert_eq!(c.get(key).unwrap().unwrap(), Bytes::from_static(b"third"));
    }
}
