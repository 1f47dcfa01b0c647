//! A snapshot in the store: one small manifest (`snapshots/NAME/manifest.json`), written
//! last, naming every frame of its memory in order. A frame is a stack of pieces, oldest
//! first: a whole frame, then the pages each diff on top wrote (a page mask and the pages,
//! packed). An empty stack is a frame of zeros, stored nowhere. A manifest is
//! self-contained: a diff's manifest names its base's pieces too, so reading a snapshot never
//! needs another manifest, and a base can be collected only once no manifest names its frames.

use serde::{Deserialize, Serialize};

use super::url::StoreUrl;
use super::StoreError;
use crate::snapshot::{ManifestRegion, IMAGE_PAGE_BYTES};

/// The largest page a region may have (1 GiB hugetlb pages).
const MAX_PAGE_BYTES: u64 = 1 << 30;

/// The format's name.
pub const FORMAT: &str = "guestmem-store-snapshot";
/// The format's version.
pub const VERSION: u32 = 1;
/// Smallest frame, bytes.
pub const MIN_FRAME_BYTES: u64 = 64 << 10;
/// Largest frame, bytes.
pub const MAX_FRAME_BYTES: u64 = 16 << 20;
/// The frame size a push uses unless told: 256 KiB. Measured (`guestmem-lab object-store`,
/// 256 MiB, a working set of 10% in 256 KiB runs, 20 ms first byte): the working set read in
/// 0.53 s with 256 KiB frames, 0.76 s with 512 KiB, 1.15 s with 1 MiB, fetching 1.13x, 2.23x
/// and 3.81x its bytes; reading all memory costs 1.3x more with 256 KiB frames than with 1
/// MiB (more GETs). A restore reads a small part of memory first, so the working set wins
/// (docs/object-storage.md).
pub const DEFAULT_FRAME_BYTES: u64 = 256 << 10;
/// Most pieces in one frame's stack (a base and its diffs); a push past it flattens the
/// frame into one whole piece.
pub const MAX_PIECES: usize = 16;
/// Largest manifest read, bytes.
pub const MAX_MANIFEST_BYTES: u64 = 64 << 20;
/// Largest memory a manifest describes, bytes (16 TiB).
pub const MAX_MEMORY_BYTES: u64 = 16 << 40;

/// A manifest as stored.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreManifest {
    /// Always [`FORMAT`].
    pub format: String,
    /// Always [`VERSION`].
    pub version: u32,
    /// The snapshot's name in its bucket.
    pub name: String,
    /// When it was pushed, seconds since the epoch (the pushing host's clock).
    pub created: i64,
    /// Bytes per frame (the last frame may be shorter).
    pub frame_bytes: u64,
    /// Bytes of memory (of the memory file it stands for).
    pub memory_bytes: u64,
    /// The snapshot it was pushed as a diff on, if any (for people: nothing reads it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<String>,
    /// A guestmem image's regions (where each lies in the memory); empty for a raw memory
    /// file.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub regions: Vec<ManifestRegion>,
    /// Frames of the recorded working set, first read first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub working_set: Vec<u64>,
    /// Every frame's pieces, oldest first.
    pub frames: Vec<Vec<PieceRef>>,
}

/// Now, as a manifest's `created`: seconds since the epoch (0 on a clock before it).
pub(crate) fn created_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// One piece of a frame, as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PieceRef {
    /// The BLAKE3 hash of its plain bytes, in hex: its object is `frames/<h>`.
    pub h: String,
    /// For a diff's piece, the pages of the frame it holds (a bit a 4 KiB page, bytes in
    /// hex, lowest page first); absent for a whole frame.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub p: Option<String>,
}

/// A piece, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Piece {
    pub(crate) hash: blake3::Hash,
    /// The pages it holds (bit per page), for a diff's piece.
    pub(crate) pages: Option<Vec<u64>>,
}

impl Piece {
    /// Its plain length, for a frame of `frame_len` bytes.
    pub(crate) fn plain_len(&self, frame_len: u64) -> u64 {
        match &self.pages {
            None => frame_len,
            Some(m) => m.iter().map(|w| w.count_ones() as u64).sum::<u64>() * IMAGE_PAGE_BYTES,
        }
    }

    pub(crate) fn to_ref(&self) -> PieceRef {
        PieceRef {
            h: self.hash.to_hex().to_string(),
            p: self.pages.as_ref().map(|m| mask_hex(m)),
        }
    }
}

/// A snapshot's manifest, read and checked: its frames as pieces.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// Where it is.
    pub url: StoreUrl,
    /// The manifest as read.
    pub manifest: StoreManifest,
    pub(crate) frames: Vec<Vec<Piece>>,
    /// The BLAKE3 hash of the manifest's bytes: which snapshot this is, whatever its name.
    pub digest: blake3::Hash,
}

impl Snapshot {
    /// Checks a manifest read from `url`.
    pub fn parse(url: &StoreUrl, text: &[u8]) -> Result<Snapshot, StoreError> {
        let bad = |reason: String| StoreError::Manifest {
            url: url.object(&url.manifest_key()),
            reason,
        };
        if text.len() as u64 > MAX_MANIFEST_BYTES {
            return Err(bad(format!(
                "{} bytes, past the limit of {MAX_MANIFEST_BYTES}",
                text.len()
            )));
        }
        let m: StoreManifest =
            serde_json::from_slice(text).map_err(|e| bad(format!("not a manifest: {e}")))?;
        if m.format != FORMAT {
            return Err(bad(format!("format {:?}, not {FORMAT:?}", m.format)));
        }
        if m.version != VERSION {
            return Err(bad(format!(
                "version {}, this guestmem reads {VERSION}",
                m.version
            )));
        }
        check_frame_bytes(m.frame_bytes).map_err(|e| bad(e.to_string()))?;
        // Shown to people (`ls`): no control characters (a terminal's escapes), and short.
        for (what, text) in [("name", Some(&m.name)), ("base", m.base.as_ref())] {
            if let Some(t) = text.filter(|t| t.len() > 1024 || t.chars().any(char::is_control)) {
                return Err(bad(format!(
                    "its {what} ({} bytes) holds control characters or is longer than 1024",
                    t.len()
                )));
            }
        }
        if m.memory_bytes == 0
            || m.memory_bytes > MAX_MEMORY_BYTES
            || !m.memory_bytes.is_multiple_of(IMAGE_PAGE_BYTES)
        {
            return Err(bad(format!(
                "memory of {:#x} bytes: must be a non-zero multiple of 4 KiB up to {MAX_MEMORY_BYTES:#x}",
                m.memory_bytes
            )));
        }
        let count = m.memory_bytes.div_ceil(m.frame_bytes);
        if m.frames.len() as u64 != count {
            return Err(bad(format!(
                "{} frames, {:#x} bytes of memory in frames of {:#x} make {count}",
                m.frames.len(),
                m.memory_bytes,
                m.frame_bytes
            )));
        }
        let mut frames = Vec::with_capacity(m.frames.len());
        for (i, stack) in m.frames.iter().enumerate() {
            let pages = frame_len(&m, i as u64) / IMAGE_PAGE_BYTES;
            if stack.len() > MAX_PIECES {
                return Err(bad(format!(
                    "frame {i}: {} pieces, past the limit of {MAX_PIECES}",
                    stack.len()
                )));
            }
            let mut out = Vec::with_capacity(stack.len());
            for (k, p) in stack.iter().enumerate() {
                let hash = blake3::Hash::from_hex(&p.h).map_err(|_| {
                    bad(format!("frame {i}: {:?} is not a BLAKE3 hash in hex", p.h))
                })?;
                let pages = match &p.p {
                    None if k > 0 => {
                        return Err(bad(format!("frame {i}: a whole piece above another")))
                    }
                    None => None,
                    Some(h) => Some(
                        parse_mask(h, pages)
                            .map_err(|why| bad(format!("frame {i}: page mask {why}")))?,
                    ),
                };
                out.push(Piece { hash, pages });
            }
            frames.push(out);
        }
        if let Some(&f) = m.working_set.iter().find(|&&f| f >= count) {
            return Err(bad(format!(
                "working set names frame {f}, the snapshot has {count}"
            )));
        }
        if m.regions.len() > crate::layout::MAX_REGIONS {
            return Err(bad(format!(
                "{} regions; at most {}",
                m.regions.len(),
                crate::layout::MAX_REGIONS
            )));
        }
        let mut prev_end = 0u64;
        for (i, r) in m.regions.iter().enumerate() {
            if r.file_offset
                .checked_add(r.size)
                .is_none_or(|e| e > m.memory_bytes)
            {
                return Err(bad(format!(
                    "region {i} at {:#x}: offset {:#x} + size {:#x} is past the memory's {:#x} bytes",
                    r.guest_addr, r.file_offset, r.size, m.memory_bytes
                )));
            }
            // As a local image's regions are held to: in order, apart, whole pages of a
            // page size a mapping can have.
            let page_ok = r.page_size.is_power_of_two()
                && (IMAGE_PAGE_BYTES..=MAX_PAGE_BYTES).contains(&r.page_size);
            let end = r.guest_addr.checked_add(r.size);
            if !page_ok
                || r.size == 0
                || !r.size.is_multiple_of(r.page_size)
                || !r.guest_addr.is_multiple_of(r.page_size)
                || !r.file_offset.is_multiple_of(IMAGE_PAGE_BYTES)
                || end.is_none()
                || (i > 0 && r.guest_addr < prev_end)
            {
                return Err(bad(format!(
                    "region {i} at {:#x} size {:#x} page {:#x}: empty, unaligned, overflowing, overlapping the one before, or of a page size no mapping has",
                    r.guest_addr, r.size, r.page_size
                )));
            }
            prev_end = end.unwrap_or(u64::MAX);
        }
        Ok(Snapshot {
            url: url.clone(),
            manifest: m,
            frames,
            digest: blake3::hash(text),
        })
    }

    /// Bytes of frame `i`.
    pub(crate) fn frame_len(&self, i: u64) -> u64 {
        frame_len(&self.manifest, i)
    }

    /// Frames.
    pub fn frame_count(&self) -> u64 {
        self.frames.len() as u64
    }

    /// Bytes of memory.
    pub fn memory_bytes(&self) -> u64 {
        self.manifest.memory_bytes
    }

    /// Bytes per frame.
    pub fn frame_bytes(&self) -> u64 {
        self.manifest.frame_bytes
    }

    /// Frames that hold data (the rest read as zero).
    pub fn data_frames(&self) -> u64 {
        self.frames.iter().filter(|s| !s.is_empty()).count() as u64
    }

    /// Whether frame `i` holds data.
    pub(crate) fn held(&self, i: u64) -> bool {
        self.frames.get(i as usize).is_some_and(|s| !s.is_empty())
    }
}

fn frame_len(m: &StoreManifest, i: u64) -> u64 {
    m.frame_bytes.min(m.memory_bytes - i * m.frame_bytes)
}

/// Checks a frame size: a power of two from [`MIN_FRAME_BYTES`] to [`MAX_FRAME_BYTES`].
pub fn check_frame_bytes(b: u64) -> Result<(), StoreError> {
    if !b.is_power_of_two() || !(MIN_FRAME_BYTES..=MAX_FRAME_BYTES).contains(&b) {
        return Err(StoreError::Limit {
            what: "frame size (a power of two from 64 KiB to 16 MiB), bytes",
            value: b,
            // The bound it is past.
            limit: if b < MIN_FRAME_BYTES {
                MIN_FRAME_BYTES
            } else {
                MAX_FRAME_BYTES
            },
        });
    }
    Ok(())
}

/// A page mask in hex, a byte at a time, lowest page first.
pub(crate) fn mask_hex(m: &[u64]) -> String {
    let mut s = String::with_capacity(m.len() * 16);
    for w in m {
        for b in w.to_le_bytes() {
            s.push_str(&format!("{b:02x}"));
        }
    }
    s
}

/// Parses a mask of a frame of `pages` pages: whole words, no bit past the frame's pages,
/// at least one bit.
fn parse_mask(h: &str, pages: u64) -> Result<Vec<u64>, String> {
    let words = pages.div_ceil(64) as usize;
    if h.len() != words * 16 {
        return Err(format!(
            "of {} hex digits, a frame of {pages} pages needs {}",
            h.len(),
            words * 16
        ));
    }
    let mut m = vec![0u64; words];
    for (w, chunk) in m.iter_mut().zip(h.as_bytes().chunks(16)) {
        let mut bytes = [0u8; 8];
        for (b, pair) in bytes.iter_mut().zip(chunk.chunks(2)) {
            let s = std::str::from_utf8(pair).map_err(|_| "is not hex".to_string())?;
            *b = u8::from_str_radix(s, 16).map_err(|_| "is not hex".to_string())?;
        }
        *w = u64::from_le_bytes(bytes);
    }
    if !pages.is_multiple_of(64) && m[words - 1] >> (pages % 64) != 0 {
        return Err(format!("names a page past the frame's {pages}"));
    }
    if m.iter().all(|&w| w == 0) {
        return Err("names no page".into());
    }
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest(frames: Vec<Vec<PieceRef>>, memory: u64) -> Vec<u8> {
        serde_json::to_vec(&StoreManifest {
            format: FORMAT.into(),
            version: VERSION,
            name: "x".into(),
            created: 0,
            frame_bytes: 1 << 20,
            memory_bytes: memory,
            base: None,
            regions: vec![],
            working_set: vec![],
            frames,
        })
        .unwrap()
    }

    #[test]
    fn manifests_are_checked_before_use() {
        let url = StoreUrl::parse("s3://bucket/x", false).unwrap();
        let h = blake3::hash(b"a").to_hex().to_string();
        let whole = PieceRef {
            h: h.clone(),
            p: None,
        };
        let mut mask = vec![0u64; 4];
        mask[1] = 1;
        let diff = PieceRef {
            h: h.clone(),
            p: Some(mask_hex(&mask)),
        };
        let s = Snapshot::parse(
            &url,
            &manifest(vec![vec![whole.clone(), diff.clone()], vec![]], 2 << 20),
        )
        .unwrap();
        assert_eq!(s.data_frames(), 1);
        assert_eq!(s.frames[0][1].plain_len(1 << 20), 4096);
        assert_eq!(s.frames[0][1].to_ref(), diff);
        // Wrong frame count, a whole piece on top, a mask past the frame, a bad hash.
        for bad in [
            manifest(vec![vec![]], 2 << 20),
            manifest(vec![vec![diff.clone(), whole.clone()], vec![]], 2 << 20),
            manifest(
                vec![
                    vec![PieceRef {
                        h: "zz".into(),
                        p: None,
                    }],
                    vec![],
                ],
                2 << 20,
            ),
            manifest(
                vec![
                    vec![PieceRef {
                        h: h.clone(),
                        p: Some("00".into()),
                    }],
                    vec![],
                ],
                2 << 20,
            ),
            manifest(vec![vec![]; 2], (2 << 20) + 1),
        ] {
            assert!(Snapshot::parse(&url, &bad).is_err());
        }
        // A base that would write a terminal's escapes where `ls` shows it.
        let mut m: StoreManifest =
            serde_json::from_slice(&manifest(vec![vec![]; 2], 2 << 20)).unwrap();
        m.base = Some("s3://b/x\u{1b}]0;pwned\u{7}".into());
        let e = Snapshot::parse(&url, &serde_json::to_vec(&m).unwrap()).unwrap_err();
        assert!(e.to_string().contains("control characters"), "{e}");
        m.base = Some("s3://b/base".into());
        assert!(Snapshot::parse(&url, &serde_json::to_vec(&m).unwrap()).is_ok());
    }

    /// A guestmem snapshot's regions are held to what a local image's are: a page size
    /// of 0 (which once panicked where the image was laid out), one no mapping has,
    /// overlapping or unaligned regions are refused, naming the region.
    #[test]
    fn a_manifests_regions_are_checked_before_use() {
        let url = StoreUrl::parse("s3://bucket/x", false).unwrap();
        let region =
            |guest_addr: u64, size: u64, file_offset: u64, page_size: u64| ManifestRegion {
                guest_addr,
                size,
                file_offset,
                page_size,
                backing: "anonymous".into(),
                huge_bytes: 0,
            };
        let with = |regions: Vec<ManifestRegion>| {
            let mut m: StoreManifest =
                serde_json::from_slice(&manifest(vec![vec![]; 2], 2 << 20)).unwrap();
            m.regions = regions;
            Snapshot::parse(&url, &serde_json::to_vec(&m).unwrap())
        };
        let good = vec![
            region(0, 1 << 20, 0, 4096),
            region(4 << 20, 1 << 20, 1 << 20, 4096),
        ];
        assert!(with(good).is_ok());
        for bad in [
            vec![region(0, 1 << 20, 0, 0)],
            vec![region(0, 1 << 20, 0, 12288)],
            vec![region(0, 1 << 20, 0, 2 << 30)],
            vec![region(0, 0, 0, 4096)],
            vec![region(100, 4096, 0, 4096)],
            vec![region(0, 1 << 20, 100, 4096)],
            vec![
                region(0, 1 << 20, 0, 4096),
                region(4096, 4096, 1 << 20, 4096),
            ],
            vec![region(u64::MAX - 4095, 4096, 0, 4096)],
        ] {
            let e = with(bad.clone()).expect_err("refused");
            assert!(e.to_string().contains("region"), "{bad:?}: {e}");
        }
    }
}
