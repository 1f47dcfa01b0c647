//! Pushing a snapshot: its memory cut into frames, each hashed, compressed where that pays,
//! and uploaded once (frames of zeros never, frames the bucket holds already skipped), by
//! many threads at once; the manifest last, so that a snapshot in the store is whole or
//! absent. A push holds a lease in the bucket while it runs, which `gc` respects.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;

use super::client::Client;
use super::cut::{Counters, Job, Reader};
use super::diff_file::{open_memory_file, open_raw_diff};
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

/// A push's error once its caller asked it to stop ([`PushConfig::stop`]).
fn asked_to_stop(cfg: &PushConfig, url: &StoreUrl) -> Result<(), StoreError> {
    match cfg.stop.as_ref().is_some_and(|s| s.load(Ordering::Relaxed)) {
        true => Err(StoreError::Stopped {
            op: "push",
            url: url.to_string(),
        }),
        false => Ok(()),
    }
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
    lease.wait_for_gc(cfg.stop.as_deref(), url)?;
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
        asked_to_stop(cfg, url)?;
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
    asked_to_stop(cfg, url)?;
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use bytes::Bytes;
    use guestmem_testkit::s3::S3Server;

    use crate::store::Client;

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
