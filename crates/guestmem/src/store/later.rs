//! A move's diff with its frames named later: the chain's manifest made in the pause from the
//! diff's shape alone (which pages it holds, from `SEEK_DATA`), each of the diff's pieces
//! named by a placeholder, not by the hash of its bytes. Nothing of the diff is read or
//! hashed in the pause; the destination runs the VM on that manifest.
//!
//! A placeholder is the keyed BLAKE3 hash of the frame's index under a key drawn for the
//! move: it names no content, and never one of another move. The source serves it
//! ([`super::HeldFrames`]) as the hash of the piece's bytes, read and hashed when asked,
//! then the piece's object; the destination ([`super::Frames`]) checks the bytes against
//! that hash and keeps them under it. When the store holds the diff, its manifest names
//! every piece: the destination checks that it has the same shape, and that each piece it
//! was served has the hash the store names, before it lets the source go.
//!
//! A frame whose pieces are already [`super::MAX_PIECES`] deep would be flattened (the
//! base's bytes fetched), which the pause cannot do unread: such a diff is cut in the pause
//! instead ([`super::push_held`]).

use std::collections::HashSet;
use std::path::Path;

use super::cut::{diff_mask, DiffKind};
use super::diff_file::open_raw_diff;
use super::held::HeldFrames;
use super::manifest::{created_now, Piece, Snapshot, StoreManifest, FORMAT, VERSION};
use super::source::mask_runs;
use super::url::StoreUrl;
use super::StoreError;
use crate::snapshot::IMAGE_PAGE_BYTES;

/// A diff's chain with its pieces named later.
#[derive(Debug)]
pub struct NamedLater {
    /// The chain's manifest (JSON), as a push of the diff writes it but for the names of
    /// the diff's pieces.
    pub manifest: Vec<u8>,
    /// Bytes of memory the diff holds.
    pub diff_bytes: u64,
}

/// The chain's manifest of the raw diff at `path` on `base`, to be pushed as `url`, each of
/// its pieces named by a placeholder and held in `held` as the runs of the file it lies in.
/// `None`: a frame would have to be flattened; cut the diff instead.
pub fn name_later(
    path: &Path,
    base: &Snapshot,
    url: &StoreUrl,
    held: &HeldFrames,
) -> Result<Option<NamedLater>, StoreError> {
    // Checked as any Diff (a move writes its Diff to a path it made sure was new, so the
    // check passes).
    let (file, len, data) = open_raw_diff(path, &base.url, base, false)?;
    let (fb, mb) = (base.frame_bytes(), base.memory_bytes());
    let key = crate::sys::random_32().map_err(|source| StoreError::Io {
        op: "draw a key (getrandom) for the placeholders of",
        path: path.to_path_buf(),
        source,
    })?;
    let mut frames = Vec::with_capacity(base.frames.len());
    let mut later = Vec::new();
    let mut diff_bytes = 0;
    for (i, below) in base.frames.iter().enumerate() {
        let start = i as u64 * fb;
        let flen = fb.min(mb - start);
        let pages = flen / IMAGE_PAGE_BYTES;
        let (mask, held_pages) = diff_mask(&data, start, flen);
        diff_bytes += held_pages * IMAGE_PAGE_BYTES;
        let hash = placeholder(&key, i as u64);
        let stack: Vec<Piece> = match DiffKind::of(held_pages, pages, below.len()) {
            DiffKind::Base => below.clone(),
            DiffKind::Flatten => return Ok(None),
            DiffKind::Whole => {
                later.push((hash, vec![(start, flen)]));
                vec![Piece { hash, pages: None }]
            }
            DiffKind::Partial => {
                later.push((hash, mask_runs(start, &mask, pages)));
                let mut s = below.clone();
                s.push(Piece {
                    hash,
                    pages: Some(mask),
                });
                s
            }
        };
        frames.push(stack);
    }
    held.attach(file, len)?;
    for (hash, runs) in later {
        held.hold_later(&hash, runs);
    }
    let manifest = StoreManifest {
        format: FORMAT.into(),
        version: VERSION,
        name: url.name.clone(),
        created: created_now(),
        frame_bytes: fb,
        memory_bytes: mb,
        base: Some(base.url.name.clone()),
        regions: Vec::new(),
        working_set: Vec::new(),
        frames: frames
            .iter()
            .map(|s| s.iter().map(Piece::to_ref).collect())
            .collect(),
    };
    Ok(Some(NamedLater {
        manifest: serde_json::to_vec(&manifest).expect("serialises"),
        diff_bytes,
    }))
}

/// The placeholder of frame `i` under a move's `key`.
fn placeholder(key: &[u8; 32], i: u64) -> blake3::Hash {
    blake3::keyed_hash(key, &i.to_le_bytes())
}

/// The store's names of the pieces `chain` names by `placeholders`, from `pushed` (the
/// manifest a push of the same diff wrote): (placeholder, its hash or `None` for a frame of
/// zeros, its plain length). Refused, saying where, unless `pushed` has `chain`'s shape: the
/// same frames, the same pieces but for the placeholders' names, the same pages in each (a
/// whole piece of the diff may be stored as zeros: no piece).
pub(crate) fn later_names(
    pushed: &Snapshot,
    chain: &Snapshot,
    placeholders: &HashSet<[u8; 32]>,
) -> Result<Vec<(blake3::Hash, Option<blake3::Hash>, usize)>, String> {
    if pushed.frames.len() != chain.frames.len() {
        return Err(format!(
            "{} frames, the chain {}",
            pushed.frames.len(),
            chain.frames.len()
        ));
    }
    let later = |h: &blake3::Hash| placeholders.contains(h.as_bytes());
    let mut names = Vec::new();
    for (i, (a, b)) in pushed.frames.iter().zip(&chain.frames).enumerate() {
        let flen = chain.frame_len(i as u64);
        match (a.as_slice(), b.as_slice()) {
            // A whole frame of the diff that the push found all zeros: stored nowhere.
            ([], [p]) if p.pages.is_none() && later(&p.hash) => {
                names.push((p.hash, None, flen as usize));
            }
            _ if a.len() != b.len() => {
                return Err(format!(
                    "frame {i}: {} pieces, the chain's {}",
                    a.len(),
                    b.len()
                ))
            }
            _ => {
                for (k, (x, y)) in a.iter().zip(b).enumerate() {
                    if x.pages != y.pages {
                        return Err(format!(
                            "frame {i}, piece {k}: other pages than the chain's"
                        ));
                    }
                    match later(&y.hash) {
                        true => names.push((y.hash, Some(x.hash), y.plain_len(flen) as usize)),
                        false if x.hash != y.hash => {
                            return Err(format!(
                                "frame {i}, piece {k}: {}, the chain's {}",
                                x.hash, y.hash
                            ))
                        }
                        false => {}
                    }
                }
            }
        }
    }
    Ok(names)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileExt;
    use std::sync::atomic::Ordering;
    use std::sync::Arc;

    use super::{later_names, name_later};
    use crate::snapshot::RemoteMemory;
    use crate::store::fetch::{FetchPolicy, Frames};
    use crate::store::peer::held_tests::{
        base_in_store, diff_config, diff_on, diff_scratch, BaseAndDiff, FB, MEM, PAGE,
    };
    use crate::store::{
        push, read_snapshot, Client, FrameCache, HeldFrames, PeerServer, PushSource, Snapshot,
        StoreMemory, StoreUrl,
    };

    #[test]
    fn a_diff_named_later_is_served_by_placeholder_then_named_by_the_push() {
        let Some(scratch) = diff_scratch("later") else {
            return;
        };
        let base_bytes: Vec<u8> = (0..MEM).map(|i| (i / PAGE) as u8 ^ 0x5a).collect();
        let (store, base) = base_in_store(&scratch, &base_bytes);
        let diff_path = scratch.join("diff");
        let want = diff_on(&base_bytes, &diff_path);
        let frames0 = Frames::new(Arc::clone(&store), None, FetchPolicy::default());
        let snap = read_snapshot(&frames0, &base).unwrap();
        let diff = StoreUrl::parse("s3://bkt/diff", false).unwrap();

        let held_frames = Arc::new(HeldFrames::new());
        let named = name_later(&diff_path, &snap, &diff, &held_frames)
            .unwrap()
            .expect("one layer on a base: nothing to flatten");
        assert_eq!(named.diff_bytes, 2 * FB + 4 * PAGE);
        // Frame 0, the piece of frame 2, frame 5 (its zeros unread), the last page.
        assert_eq!(held_frames.len(), 4);
        let chain = Snapshot::parse(&diff, &named.manifest).unwrap();

        // What a push of the same diff names: the same shape, but frame 5 (zeros) empty.
        let src = PushSource::RawDiff {
            path: diff_path.clone(),
            base: base.clone(),
        };
        push(&store, &src, &diff, &diff_config(&store, snap.clone())).unwrap();
        let pushed = read_snapshot(&frames0, &diff).unwrap();
        let in_base: std::collections::HashSet<_> =
            snap.frames.iter().flatten().map(|p| p.hash).collect();
        let owed: Vec<_> = chain
            .frames
            .iter()
            .flatten()
            .map(|p| p.hash)
            .filter(|h| !in_base.contains(h))
            .collect();
        assert_eq!(owed.len(), 4);
        let placeholders = owed.iter().map(|h| *h.as_bytes()).collect();
        let names = later_names(&pushed, &chain, &placeholders).unwrap();
        assert_eq!(names.len(), 4);
        for (i, (c, p)) in chain.frames.iter().zip(&pushed.frames).enumerate() {
            if i == 5 {
                // Whole and all zero: named later, stored nowhere.
                assert!(p.is_empty() && c.len() == 1 && c[0].pages.is_none());
                assert!(names.contains(&(c[0].hash, None, FB as usize)));
                continue;
            }
            assert_eq!(c.len(), p.len(), "frame {i}");
            for (x, y) in c.iter().zip(p) {
                assert_eq!(x.pages, y.pages, "frame {i}");
                if !in_base.contains(&x.hash) {
                    assert_ne!(x.hash, y.hash, "frame {i}: a placeholder names no content");
                    let len = y.plain_len(FB) as usize;
                    assert!(names.contains(&(x.hash, Some(y.hash), len)), "frame {i}");
                }
            }
        }
        // Another shape is refused, saying where.
        let mut other = pushed.clone();
        other.frames[2].last_mut().unwrap().pages.as_mut().unwrap()[0] ^= 1 << 9;
        let e = later_names(&other, &chain, &placeholders).unwrap_err();
        assert!(e.contains("frame 2, piece 1"), "{e}");
        let mut other = pushed.clone();
        other.frames[7].pop();
        let e = later_names(&other, &chain, &placeholders).unwrap_err();
        assert!(e.contains("frame 7"), "{e}");
        let mut other = pushed.clone();
        other.frames[1][0].hash = blake3::hash(b"other");
        let e = later_names(&other, &chain, &placeholders).unwrap_err();
        assert!(e.contains("frame 1, piece 0"), "{e}");

        // Served by placeholder, checked against the hash served with it, kept in the
        // cache under that hash; every byte right.
        let server = PeerServer::start(
            "127.0.0.1:0".parse().unwrap(),
            Arc::clone(&held_frames),
            Arc::new(Client::in_memory("held").unwrap()),
        )
        .unwrap();
        let peer = Arc::new(Client::peer(&format!("http://{}", server.addr())).unwrap());
        let cache = Arc::new(FrameCache::open(&scratch.join("cache"), 16 << 20).unwrap());
        let frames = Frames::new(
            Arc::clone(&store),
            Some(Arc::clone(&cache)),
            FetchPolicy::default(),
        );
        frames.name_later(owed.iter().copied());
        frames.follow(Arc::clone(&peer), owed.iter().copied());
        let memory = StoreMemory::from_snapshot(Arc::clone(&frames), chain.clone());
        for i in 0..MEM / FB {
            let got = memory.frame(i).unwrap();
            let at = (i * FB) as usize;
            assert_eq!(got.as_slice(), &want[at..at + FB as usize], "frame {i}");
        }
        assert_eq!(frames.counters.peer_gets.load(Ordering::Relaxed), 4);
        // Kept in the background, after their readers had them.
        frames.settle();
        for (_, h, _) in names.iter().filter(|n| n.1.is_some()) {
            assert!(cache.contains(&h.unwrap()), "kept under its hash");
        }

        // Locked (a move with a key): served with their seals to the token's holder, and
        // taken with the move's seal key only.
        let locked = PeerServer::start_locked(
            "127.0.0.1:0".parse().unwrap(),
            Arc::clone(&held_frames),
            Arc::new(Client::in_memory("held").unwrap()),
        )
        .unwrap();
        let token = "ab".repeat(32);
        locked.unlock(token.clone(), [5; 32]);
        let base = format!("http://{}", locked.addr());
        for (seal, right) in [([5; 32], true), ([6; 32], false)] {
            let peer = Arc::new(Client::peer_locked(&base, &token, seal).unwrap());
            let frames = Frames::new(Arc::clone(&store), None, FetchPolicy::default());
            frames.name_later(owed.iter().copied());
            frames.follow(Arc::clone(&peer), owed.iter().copied());
            let memory = StoreMemory::from_snapshot(Arc::clone(&frames), chain.clone());
            for i in 0..MEM / FB {
                let owes = chain.frames[i as usize]
                    .iter()
                    .any(|p| owed.contains(&p.hash));
                match (memory.frame(i), right || !owes) {
                    (Ok(got), true) => {
                        let at = (i * FB) as usize;
                        assert_eq!(got.as_slice(), &want[at..at + FB as usize], "frame {i}");
                    }
                    (Err(e), false) => assert!(e.to_string().contains("seal"), "frame {i}: {e}"),
                    (got, _) => panic!("frame {i}, seal {right}: {:?}", got.map(|_| ())),
                }
            }
        }

        // A name other than the hash a piece was served as is refused; so is a placeholder
        // named twice.
        let mut wrong = names.clone();
        wrong[3].1 = Some(blake3::hash(b"other"));
        let e = frames.name_later_as(&wrong).unwrap_err();
        assert!(e.contains("the store names"), "{e}");
        let mut twice = names.clone();
        twice.push(names[0]);
        let e = frames.name_later_as(&twice).unwrap_err();
        assert!(e.contains("named twice"), "{e}");

        // A destination that read none of them before the store named them: each fetched
        // from the store under its name (no cache, no source), read through `read`.
        let fresh = Frames::new(Arc::clone(&store), None, FetchPolicy::default());
        fresh.name_later(owed.iter().copied());
        fresh.follow(Arc::clone(&peer), owed.iter().copied());

        // The store's names: from now on read as any frame (from the cache or the store).
        frames.name_later_as(&names).unwrap();
        frames.release();
        fresh.name_later_as(&names).unwrap();
        fresh.release();
        drop(server);
        let mut all = vec![0u8; MEM as usize];
        memory.read(0, &mut all).unwrap();
        assert!(all == want, "named, from the cache");
        assert_eq!(frames.counters.peer_gets.load(Ordering::Relaxed), 4);
        let fresh_memory = StoreMemory::from_snapshot(Arc::clone(&fresh), chain.clone());
        let mut all = vec![0u8; MEM as usize];
        fresh_memory.read(0, &mut all).unwrap();
        assert!(all == want, "named, from the store");
        assert_eq!(fresh.counters.peer_gets.load(Ordering::Relaxed), 0);
        // The base's pieces of frames 1-4, 6 and 7, and the three named: frame 0, the
        // piece of frame 2, the last page (frame 5: zeros, no GET).
        assert_eq!(fresh.counters.gets.load(Ordering::Relaxed), 6 + 3);
        frames.forget_later(owed.iter().copied());
        fresh.forget_later(owed);
    }

    #[test]
    fn a_read_through_the_cache_counts_each_frame_once() {
        let scratch = guestmem_testkit::Scratch::new("cache-counts");
        let bytes: Vec<u8> = (0..MEM).map(|i| (i / PAGE) as u8 | 1).collect();
        let (store, base) = base_in_store(&scratch, &bytes);
        let cache = Arc::new(FrameCache::open(&scratch.join("cache"), 16 << 20).unwrap());
        let frames = Frames::new(
            Arc::clone(&store),
            Some(Arc::clone(&cache)),
            FetchPolicy::default(),
        );
        let memory = StoreMemory::open(Arc::clone(&frames), &base).unwrap();
        let frames_in = MEM / FB;
        for pass in 1..=2 {
            let mut all = vec![0u8; MEM as usize];
            // One frame at a time, then all at once.
            match pass {
                1 => (0..frames_in).for_each(|i| {
                    let at = (i * FB) as usize;
                    memory.read(i * FB, &mut all[at..at + FB as usize]).unwrap()
                }),
                _ => memory.read(0, &mut all).unwrap(),
            }
            assert!(all == bytes, "pass {pass}");
            // Kept in the background, after their readers had them.
            frames.settle();
        }
        let c = &cache.counters;
        assert_eq!(
            c.misses.load(Ordering::Relaxed),
            frames_in,
            "each miss once"
        );
        assert_eq!(c.hits.load(Ordering::Relaxed), frames_in);
        assert_eq!(frames.counters.gets.load(Ordering::Relaxed), frames_in);

        // A frame whose cached bytes went bad: counted corrupt and missed once, fetched
        // again, read right.
        cache.spoil(&memory.snapshot().frames[3][0].hash, 10, b"bad");
        let mut all = vec![0u8; MEM as usize];
        memory.read(0, &mut all).unwrap();
        assert!(all == bytes, "after the bad record");
        assert_eq!(c.corrupt.load(Ordering::Relaxed), 1);
        assert_eq!(c.misses.load(Ordering::Relaxed), frames_in + 1);
        assert_eq!(frames.counters.gets.load(Ordering::Relaxed), frames_in + 1);
    }

    #[test]
    fn a_piece_served_again_with_other_bytes_fails_closed() {
        let Some(scratch) = diff_scratch("later-changed") else {
            return;
        };
        let BaseAndDiff {
            store,
            snap,
            diff_path,
            want,
            ..
        } = BaseAndDiff::new(&scratch, &vec![3u8; MEM as usize]);
        let diff = StoreUrl::parse("s3://bkt/diff", false).unwrap();
        let held_frames = Arc::new(HeldFrames::new());
        let named = name_later(&diff_path, &snap, &diff, &held_frames)
            .unwrap()
            .unwrap();
        let chain = Snapshot::parse(&diff, &named.manifest).unwrap();
        let x = chain.frames[0][0].hash;
        let server = PeerServer::start(
            "127.0.0.1:0".parse().unwrap(),
            Arc::clone(&held_frames),
            Arc::new(Client::in_memory("held").unwrap()),
        )
        .unwrap();
        let peer = Arc::new(Client::peer(&format!("http://{}", server.addr())).unwrap());
        // No cache: each read of the piece is a GET of its placeholder.
        let frames = Frames::new(Arc::clone(&store), None, FetchPolicy::default());
        frames.name_later([x]);
        frames.follow(peer, [x]);
        let first = frames.get(&x, FB as usize).unwrap();
        assert_eq!(first.as_slice(), &want[..FB as usize]);
        // The file changes under the source: the same piece now has other bytes.
        std::fs::File::options()
            .write(true)
            .open(&diff_path)
            .unwrap()
            .write_all_at(b"changed", 100)
            .unwrap();
        let e = frames.get(&x, FB as usize).unwrap_err().to_string();
        assert!(e.contains("before as"), "{e}");
        drop(server);
    }
}
