//! A snapshot in the store as memory to serve: its manifest read and checked once, its
//! frames fetched through the host's [`Frames`] as they are read, a frame put together from
//! its pieces (a whole frame, then the pages of each diff on top).

use std::sync::Arc;
use std::time::Duration;

use super::fetch::Frames;
use super::manifest::{Piece, Snapshot};
use super::url::StoreUrl;
use super::StoreError;
use crate::snapshot::{
    Ahead, Image, ManifestRegion, RawRegion, RemoteMemory, SnapshotError, IMAGE_PAGE_BYTES,
};

/// Reads and checks the manifest of `url`.
pub fn read_snapshot(frames: &Frames, url: &StoreUrl) -> Result<Snapshot, StoreError> {
    let key = url.manifest_key();
    match frames.client.get(&key)? {
        Some(text) => Snapshot::parse(url, &text),
        None => Err(StoreError::NoSnapshot {
            url: url.to_string(),
            key,
        }),
    }
}

/// A snapshot in the store, ready to be served: reads go through the host's frames.
#[derive(Debug, Clone)]
pub struct StoreMemory {
    frames: Arc<Frames>,
    snapshot: Arc<Snapshot>,
    /// Held by the image it reads for (a fresh one each image): its read-ahead stops once
    /// the image is gone (its VM ended), not left fetching for a VM no one serves.
    alive: Arc<()>,
}

impl StoreMemory {
    /// Opens the snapshot at `url`: its bucket answered and its manifest read and checked
    /// here, so that a snapshot that is not there, or not readable, is refused before any VM
    /// is served from it.
    ///
    /// Then connections for its read-ahead are opened ([`Frames::policy`]'s `ahead_gets`,
    /// at most the 64 the client's pool keeps idle), waiting at most eight times what the
    /// manifest took (between 250 ms and 2 s), and 8 more in the fault lane's pool (a fault's
    /// own GETs, the client's lane): a VM's first faults and its working set then find them
    /// open.
    pub fn open(frames: Arc<Frames>, url: &StoreUrl) -> Result<StoreMemory, StoreError> {
        frames.client.check()?;
        let t = std::time::Instant::now();
        let snapshot = Arc::new(read_snapshot(&frames, url)?);
        let within = (t.elapsed() * 8).clamp(Duration::from_millis(250), Duration::from_secs(2));
        frames
            .client
            .warm(&url.manifest_key(), frames.policy().ahead_gets, within);
        Ok(StoreMemory {
            frames,
            snapshot,
            alive: Arc::new(()),
        })
    }

    /// A snapshot whose manifest was read (and checked) elsewhere: a move's chain, its
    /// manifest from the source host.
    pub fn from_snapshot(frames: Arc<Frames>, snapshot: Snapshot) -> StoreMemory {
        StoreMemory {
            frames,
            snapshot: Arc::new(snapshot),
            alive: Arc::new(()),
        }
    }

    /// The snapshot.
    pub fn snapshot(&self) -> &Snapshot {
        &self.snapshot
    }

    /// The frames it is read through.
    pub fn frames(&self) -> &Arc<Frames> {
        &self.frames
    }

    /// A guestmem snapshot pushed to the store, as an image to restore (lazily) into a map
    /// laid out by [`Image::specs`], blocks of `block_bytes`. A raw memory file's snapshot
    /// has no regions of its own: serve it to a VMM that declares them (the page server).
    pub fn image(&self, block_bytes: u64) -> Result<Image, StoreError> {
        let m = &self.snapshot.manifest;
        if m.regions.is_empty() {
            return Err(StoreError::Manifest {
                url: self.snapshot.url.to_string(),
                reason: "a raw memory file's snapshot: it has no regions to restore into (serve it with serve-uffd, or pull it)".into(),
            });
        }
        let largest = m
            .regions
            .iter()
            .map(|r| r.page_size)
            .max()
            .unwrap_or(IMAGE_PAGE_BYTES);
        let block_bytes = block_bytes.max(largest).next_multiple_of(largest);
        let fb = m.frame_bytes;
        let ws: Vec<u64> = m
            .working_set
            .iter()
            .flat_map(|&f| blocks_at(&m.regions, f * fb, fb, block_bytes))
            .collect();
        Ok(Image::remote(
            self.for_image(),
            &self.snapshot.url.to_string(),
            m.regions.clone(),
            block_bytes,
            ws,
        )?)
    }

    /// This memory for one image: its read-ahead lives as long as the image.
    fn for_image(&self) -> Arc<StoreMemory> {
        Arc::new(StoreMemory {
            alive: Arc::new(()),
            ..self.clone()
        })
    }

    /// The memory as an image of a VM's `regions` (each where its peer says it lies in the
    /// memory), blocks of `block_bytes`.
    pub(crate) fn raw_image(
        &self,
        regions: &[RawRegion],
        block_bytes: u64,
    ) -> Result<Image, SnapshotError> {
        let mregions = regions
            .iter()
            .map(|r| ManifestRegion {
                guest_addr: r.name,
                size: r.size,
                file_offset: r.file_offset,
                page_size: r.page_size,
                backing: "anonymous".into(),
                huge_bytes: 0,
            })
            .collect();
        Image::remote(
            self.for_image(),
            &self.snapshot.url.to_string(),
            mregions,
            block_bytes,
            Vec::new(),
        )
    }

    /// The memory offsets of its recorded working set, first read first.
    pub fn working_set_offsets(&self) -> Vec<u64> {
        let fb = self.snapshot.manifest.frame_bytes;
        self.snapshot
            .manifest
            .working_set
            .iter()
            .map(|&f| f * fb)
            .collect()
    }

    /// Fetches every frame that holds data into the host's cache (and checks it), on
    /// `threads` threads: a host warmed before a burst of restores. It returns once they are
    /// kept (`Frames::settle`). Bytes of frames read.
    pub fn fetch_all(&self, threads: usize) -> Result<u64, StoreError> {
        let next = std::sync::atomic::AtomicU64::new(0);
        let done = std::sync::atomic::AtomicU64::new(0);
        let failed = std::sync::Mutex::new(None);
        let count = self.snapshot.frame_count();
        std::thread::scope(|s| {
            for _ in 0..threads.clamp(1, 64) {
                s.spawn(|| {
                    // Background work: below the VMs' faults, and it waits for room to keep
                    // its frames (it goes no faster than the cache's disk).
                    crate::restore::as_prefetcher();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        if i >= count {
                            return;
                        }
                        if !self.snapshot.held(i) {
                            continue;
                        }
                        match self.frame(i) {
                            Ok(f) => {
                                done.fetch_add(
                                    f.len() as u64,
                                    std::sync::atomic::Ordering::Relaxed,
                                );
                            }
                            Err(e) => {
                                failed
                                    .lock()
                                    .unwrap_or_else(|e| e.into_inner())
                                    .get_or_insert(e);
                                return;
                            }
                        }
                    }
                });
            }
        });
        self.frames.settle();
        if let Some(e) = failed.into_inner().unwrap_or_else(|e| e.into_inner()) {
            return Err(StoreError::Frame {
                url: self.snapshot.url.to_string(),
                reason: e.to_string(),
            });
        }
        Ok(done.into_inner())
    }

    /// Frame `i`, put together from its pieces.
    pub(crate) fn frame(&self, i: u64) -> Result<Arc<Vec<u8>>, Arc<StoreError>> {
        // A fault's frame whose other pieces are on this host: the piece its source owes
        // is read on this thread, which waits for it anyway. Not when another piece is
        // fetched too (its flight, which other VMs' faults may join, would wait behind the
        // blocking read), nor for a prefetch thread (through the runtime, many at once).
        let frames = &self.frames;
        let here = !crate::restore::is_prefetcher()
            && self.snapshot.frames[i as usize]
                .iter()
                .all(|p| frames.owed_here(&p.hash) || frames.held_here(&p.hash));
        let _here = here.then(super::direct::read_here);
        self.frames.client.block_on(self.frame_async(i))
    }

    /// Frame `i`, put together from its pieces, fetched side by side. A fault's wait for a
    /// frame of which a move's source owed a piece is counted (`peer_fault_wait`).
    async fn frame_async(&self, i: u64) -> Result<Arc<Vec<u8>>, Arc<StoreError>> {
        let t0 = std::time::Instant::now();
        let frames = &self.frames;
        let remote = frames.following()
            && !crate::restore::is_prefetcher()
            && self.snapshot.frames[i as usize]
                .iter()
                .any(|p| frames.owed_here(&p.hash));
        let out = self.assemble(i).await;
        if remote && out.is_ok() {
            let waited = t0.elapsed();
            frames.counters.peer_fault_wait.record(waited);
            frames.counters.peer_fault_wait_recent.record(waited);
        }
        out
    }

    /// Frame `i` from its pieces: each fetched (side by side), then laid over the last.
    async fn assemble(&self, i: u64) -> Result<Arc<Vec<u8>>, Arc<StoreError>> {
        let len = self.snapshot.frame_len(i) as usize;
        let pieces = &self.snapshot.frames[i as usize];
        match pieces.as_slice() {
            [] => Ok(Arc::new(vec![0u8; len])),
            [Piece { hash, pages: None }] => self.frames.get_async(*hash, len).await,
            _ => {
                // The newest piece first: a diff's is the likeliest to be fetched, and its
                // GET is then in flight while the older pieces are read from the cache
                // (a read there holds the polling thread).
                let frames = &self.frames;
                let mut got = futures::future::join_all(
                    pieces
                        .iter()
                        .rev()
                        .map(|p| frames.get_async(p.hash, p.plain_len(len as u64) as usize)),
                )
                .await;
                got.reverse();
                let mut out = vec![0u8; len];
                for (p, bytes) in pieces.iter().zip(got) {
                    overlay(&mut out, p, &bytes?);
                }
                Ok(Arc::new(out))
            }
        }
    }
}

/// Lays a piece's plain bytes over a frame: a whole piece is the frame; a diff's holds the
/// pages its mask names, packed in page order.
pub(crate) fn overlay(frame: &mut [u8], p: &Piece, bytes: &[u8]) {
    match &p.pages {
        None => frame.copy_from_slice(bytes),
        Some(mask) => {
            let page = IMAGE_PAGE_BYTES as usize;
            let mut at = 0;
            for pg in 0..frame.len() / page {
                if mask[pg / 64] >> (pg % 64) & 1 != 0 {
                    frame[pg * page..(pg + 1) * page].copy_from_slice(&bytes[at..at + page]);
                    at += page;
                }
            }
        }
    }
}

/// The blocks (of `block_bytes`, cut within each region) that `offset..offset + len` of
/// the memory falls in.
fn blocks_at(regions: &[ManifestRegion], offset: u64, len: u64, block_bytes: u64) -> Vec<u64> {
    let mut first = 0u64;
    let mut out = Vec::new();
    for r in regions {
        let blocks = r.size.div_ceil(block_bytes);
        let (s, e) = (
            offset.max(r.file_offset),
            (offset + len).min(r.file_offset + r.size),
        );
        if s < e {
            let (a, b) = (
                (s - r.file_offset) / block_bytes,
                (e - r.file_offset).div_ceil(block_bytes),
            );
            out.extend((a..b).map(|x| first + x));
        }
        first += blocks;
    }
    out
}

impl StoreMemory {
    /// The pieces (hash, plain length) of the frames `ranges` fall in, in order, each frame
    /// once.
    fn pieces(&self, ranges: &[(u64, u64)]) -> Vec<(blake3::Hash, usize)> {
        let fb = self.snapshot.manifest.frame_bytes;
        let mut want = Vec::new();
        let mut last = u64::MAX;
        for &(off, len) in ranges {
            let end = (off + len).min(self.snapshot.memory_bytes());
            for i in off / fb..end.div_ceil(fb) {
                if i == last {
                    continue;
                }
                last = i;
                let flen = self.snapshot.frame_len(i);
                for p in &self.snapshot.frames[i as usize] {
                    want.push((p.hash, p.plain_len(flen) as usize));
                }
            }
        }
        want
    }
}

impl RemoteMemory for StoreMemory {
    fn read(
        &self,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), Arc<dyn std::error::Error + Send + Sync>> {
        let fb = self.snapshot.manifest.frame_bytes;
        let end = offset + dst.len() as u64;
        if end > self.snapshot.memory_bytes() {
            return Err(Arc::new(StoreError::Limit {
                what: "read past the snapshot's memory, offset",
                value: end,
                limit: self.snapshot.memory_bytes(),
            }));
        }
        // What the cache holds is read straight into place; the frames it does not hold
        // are fetched side by side, so that a read of several frames (a fault's block)
        // waits one round trip, not one a frame.
        let mut fetch: Vec<(u64, u64, u64)> = Vec::new();
        let mut at = offset;
        while at < end {
            let i = at / fb;
            let (fs, fe) = (i * fb, (i * fb + fb).min(end));
            let n = (fe - at) as usize;
            let d = &mut dst[(at - offset) as usize..][..n];
            let whole = at == fs && n as u64 == self.snapshot.frame_len(i);
            let pieces = &self.snapshot.frames[i as usize];
            match (pieces.as_slice(), whole) {
                _ if !self.snapshot.held(i) => d.fill(0),
                ([Piece { hash, pages: None }], true) if self.frames.read_cached(hash, d) => {}
                _ => fetch.push((i, at, fe)),
            }
            at = fe;
        }
        let got = match fetch.as_slice() {
            [] => return Ok(()),
            [(i, ..)] => vec![self.frame(*i)],
            _ => self.frames.client.block_on(futures::future::join_all(
                fetch.iter().map(|&(i, ..)| self.frame_async(i)),
            )),
        };
        for (&(i, at, fe), f) in fetch.iter().zip(got) {
            let f = f.map_err(|e| e as Arc<dyn std::error::Error + Send + Sync>)?;
            let fs = i * fb;
            dst[(at - offset) as usize..(fe - offset) as usize]
                .copy_from_slice(&f[(at - fs) as usize..(fe - fs) as usize]);
        }
        Ok(())
    }

    fn take_ready(&self, offset: u64, len: u64) -> Option<Arc<Vec<u8>>> {
        let fb = self.snapshot.manifest.frame_bytes;
        let i = offset / fb;
        if !offset.is_multiple_of(fb) || len != self.snapshot.frame_len(i) {
            return None;
        }
        match self.snapshot.frames.get(i as usize)?.as_slice() {
            [Piece { hash, pages: None }] => self.frames.take_staged(hash, len as usize),
            _ => None,
        }
    }

    fn give_back(&self, bytes: Arc<Vec<u8>>) {
        self.frames.give_back(bytes);
    }

    fn held(&self, offset: u64, len: u64) -> bool {
        let fb = self.snapshot.manifest.frame_bytes;
        let end = (offset + len).min(self.snapshot.memory_bytes());
        (offset / fb..end.div_ceil(fb)).any(|i| self.snapshot.held(i))
    }

    fn ahead(&self, ranges: &[(u64, u64)], why: Ahead) {
        self.frames
            .ahead(&self.pieces(ranges), why, Some(Arc::downgrade(&self.alive)));
    }

    fn stage(&self, ranges: &[(u64, u64)]) {
        self.frames.stage(&self.pieces(ranges));
    }

    fn name(&self) -> String {
        self.snapshot.url.to_string()
    }
}
