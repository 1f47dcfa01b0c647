//! Listing the snapshots of a bucket, and collecting the frames no snapshot names.
//!
//! `gc` deletes a frame only when no manifest names it, it is older than the grace period,
//! and no push is in progress (a lease younger than `LEASE_STALE` in `leases/`), looked at
//! again before every batch of deletes; ages are on the store's clock. It marks itself in
//! `leases/gc/` while it runs (written again every minute by a thread of its own, and no
//! delete once it ever went unwritten for half of `LEASE_STALE`: a push would have taken it
//! for a dead gc's), and a push that finds the mark once its own lease is written
//! waits for it to go before it looks at any frame (`lease.rs`): a push that began after
//! gc's last look at the leases cannot skip a frame gc is about to delete. A push also looks
//! again at every frame it skipped as already there just before it writes its manifest,
//! and uploads any that went: so a manifest never names a frame that is not there.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::client::Client;
use super::lease::{live_push, GcMark};
use super::manifest::Snapshot;
use super::url::{StoreUrl, FRAMES, SNAPSHOTS};
use super::StoreError;

/// A snapshot as `ls` shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Listing {
    /// Its URL.
    pub url: String,
    /// Bytes of memory.
    pub memory_bytes: u64,
    /// Bytes per frame.
    pub frame_bytes: u64,
    /// Frames that hold data.
    pub data_frames: u64,
    /// The snapshot it was pushed as a diff on.
    pub base: Option<String>,
    /// When it was pushed (seconds since the epoch).
    pub created: i64,
    /// Whether it is a guestmem snapshot (with regions) or a raw memory file.
    pub guestmem: bool,
}

/// Every snapshot in the bucket of `at` (under its name, if it has one), read and checked.
pub fn list(client: &Client, at: &StoreUrl) -> Result<Vec<Listing>, StoreError> {
    Ok(snapshots(client, at)?
        .into_iter()
        .map(|s| Listing {
            url: s.url.to_string(),
            memory_bytes: s.memory_bytes(),
            frame_bytes: s.frame_bytes(),
            data_frames: s.data_frames(),
            base: s.manifest.base.clone(),
            created: s.manifest.created,
            guestmem: !s.manifest.regions.is_empty(),
        })
        .collect())
}

fn snapshots(client: &Client, at: &StoreUrl) -> Result<Vec<Snapshot>, StoreError> {
    let mut out = Vec::new();
    each_snapshot(client, at, |s| {
        out.push(s);
        true
    })?;
    Ok(out)
}

/// Each snapshot in the bucket of `at` (under its name, if it has one), read and checked,
/// handed to `f` one at a time (gc keeps only the names of their frames), until `f` says
/// false. A manifest listed and then not found is skipped (deleted since).
fn each_snapshot(
    client: &Client,
    at: &StoreUrl,
    mut f: impl FnMut(Snapshot) -> bool,
) -> Result<(), StoreError> {
    let prefix = if at.name.is_empty() {
        SNAPSHOTS.to_string()
    } else {
        format!("{SNAPSHOTS}{}/", at.name)
    };
    for o in client.list(&prefix)? {
        let Some(name) = o
            .key
            .strip_prefix(SNAPSHOTS)
            .and_then(|k| k.strip_suffix("/manifest.json"))
        else {
            continue;
        };
        let url = at.sibling(name);
        // A manifest deleted since the listing is no longer a snapshot.
        // Asked for as listed: a name another tool wrote with a character object_store
        // escapes was asked for escaped, not found, and (to gc) taken for one deleted
        // since, its frames deleted.
        match client.get_listed(&o.key)? {
            Some(text) if !f(Snapshot::parse(&url, &text)?) => break,
            // Deleted since the listing: no longer a snapshot.
            Some(_) | None => {}
        }
    }
    Ok(())
}

/// What gc did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct GcReport {
    /// Snapshots whose frames were kept.
    pub snapshots: u64,
    /// Frames in the bucket.
    pub frames: u64,
    /// Frames some snapshot names.
    pub named: u64,
    /// Frames no snapshot names, younger than the grace period: kept.
    pub young: u64,
    /// Frames deleted.
    pub deleted: u64,
    /// Bytes deleted.
    pub bytes_deleted: u64,
    /// Whether it stopped early because a push began.
    pub stopped_for_push: bool,
    /// Its caller asked it to stop before it was done.
    pub stopped: bool,
    /// With `dry_run`, nothing was deleted (`deleted` says what would have been).
    pub dry_run: bool,
}

/// Frames deleted between looks at the leases.
const BATCH: usize = 100;

/// Deletes the frames of `bucket` no snapshot names, older than `grace` (on the store's
/// clock). Refuses while a push is in progress, and stops before its next batch of deletes
/// when one begins. A manifest that fails its checks stops it (what it names cannot be
/// known). A dry run marks itself only for as long as it takes to read the store's clock.
/// `stop`, once set (a signal's handler, say), ends it before its next delete or listed
/// object, its mark given back (`stopped` in the report).
pub fn gc(
    client: &Client,
    bucket: &StoreUrl,
    grace: Duration,
    dry_run: bool,
    stop: Option<&AtomicBool>,
) -> Result<GcReport, StoreError> {
    let (mark, now, leases) = GcMark::take(client)?;
    let mark = (!dry_run).then_some(mark);
    if let Some(l) = live_push(&leases, now) {
        return Err(StoreError::Request {
            op: "gc",
            url: client.url(&l),
            reason: "a push is in progress (its lease is younger than 10 minutes): nothing deleted; run gc again once it ends".into(),
            permanent: true,
        });
    }
    match &mark {
        Some(m) => m.renewed_while(|| collect(client, bucket, grace, now, dry_run, Some(m), stop)),
        None => collect(client, bucket, grace, now, dry_run, None, stop),
    }
}

/// gc's work once it holds the bucket: the frames no manifest names, then the deletes.
fn collect(
    client: &Client,
    bucket: &StoreUrl,
    grace: Duration,
    now: i64,
    dry_run: bool,
    mark: Option<&GcMark<'_>>,
    stop: Option<&AtomicBool>,
) -> Result<GcReport, StoreError> {
    let root = bucket.sibling("");
    let mut named: HashSet<[u8; 32]> = HashSet::new();
    let mut snapshots = 0;
    let asked = || stop.is_some_and(|s| s.load(Ordering::Relaxed));
    // A push that began meanwhile waits for this gc to go: it stops at once (as it does
    // when its caller asks).
    let push_began = || asked() || mark.is_some_and(GcMark::push_seen);
    let stopped = |r: &mut GcReport| match asked() {
        true => r.stopped = true,
        false => r.stopped_for_push = true,
    };
    each_snapshot(client, &root, |s| {
        snapshots += 1;
        named.extend(s.frames.iter().flatten().map(|p| *p.hash.as_bytes()));
        !push_began()
    })?;
    let mut r = GcReport {
        snapshots,
        dry_run,
        ..GcReport::default()
    };
    if push_began() {
        stopped(&mut r);
        return Ok(r);
    }
    let mut doomed = Vec::new();
    let whole = client.list_each(FRAMES, &mut |o| {
        r.frames += 1;
        let Some(h) = o
            .key
            .strip_prefix(FRAMES)
            .and_then(|h| blake3::Hash::from_hex(h).ok())
        else {
            return true;
        };
        if named.contains(h.as_bytes()) {
            r.named += 1;
        } else if i128::from(now) - i128::from(o.modified) < i128::from(grace.as_secs()) {
            // (In i128: a grace past i64's range keeps every frame, not none.)
            r.young += 1;
        } else {
            doomed.push((o.key, o.size));
        }
        // A push that began meanwhile waits for this gc: it stops at once.
        !push_began()
    })?;
    if !whole {
        stopped(&mut r);
        return Ok(r);
    }
    for batch in doomed.chunks(BATCH) {
        if let Some(m) = mark {
            m.check_held()?;
            let (now, leases) = m.renew()?;
            if live_push(&leases, now).is_some() {
                r.stopped_for_push = true;
                break;
            }
        }
        for (key, size) in batch {
            if push_began() {
                stopped(&mut r);
                return Ok(r);
            }
            if !dry_run {
                // Before each (no request): on a store slow to delete, one batch can take
                // longer than the mark may go unwritten.
                if let Some(m) = mark {
                    m.check_held()?;
                }
                client.delete(key)?;
            }
            r.deleted += 1;
            r.bytes_deleted += size;
        }
    }
    Ok(r)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use bytes::Bytes;
    use guestmem_testkit::s3::S3Server;

    use super::gc;
    use crate::store::frame;
    use crate::store::{push, Client, FetchPolicy, Frames, PushSource, StoreMemory, StoreUrl};

    fn client(s3: &S3Server) -> Arc<Client> {
        let env = s3.env();
        let get = move |k: &str| env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone());
        Arc::new(Client::connect_with("snaps", &get).unwrap())
    }

    /// A push and a gc asked to stop (a signal's handler sets it) end there and give
    /// their lease and mark back: nothing published, nothing deleted, nothing left in
    /// `leases/` to hold the other off.
    #[test]
    fn a_push_or_gc_asked_to_stop_gives_back_its_lease() {
        use std::sync::atomic::AtomicBool;
        let s3 = S3Server::start("gc-stop", &["snaps"]);
        let c = client(&s3);
        let scratch = guestmem_testkit::Scratch::new("gc-stop");
        let mem = scratch.join("mem");
        let bytes: Vec<u8> = (0..(1u32 << 20)).map(|i| (i / 4096 % 251) as u8).collect();
        std::fs::write(&mem, bytes).unwrap();
        let url = StoreUrl::parse("s3://snaps/vm", false).unwrap();
        let stop = Arc::new(AtomicBool::new(true));
        let cfg = crate::store::PushConfig {
            stop: Some(Arc::clone(&stop)),
            ..Default::default()
        };
        let e = push(&c, &PushSource::Raw(mem.clone()), &url, &cfg).unwrap_err();
        assert!(matches!(e, crate::store::StoreError::Stopped { .. }), "{e}");
        assert!(c.get(&url.manifest_key()).unwrap().is_none());
        assert!(c.list("leases/").unwrap().is_empty(), "a lease left");
        // Asked while it waits for a gc's mark to go: it stops there, not 13 minutes on.
        let mark = "leases/gc/other.1.1";
        c.put(mark, Bytes::from_static(b"{}")).unwrap();
        stop.store(false, std::sync::atomic::Ordering::Relaxed);
        let pushing = {
            let (c, url, mem, cfg) = (Arc::clone(&c), url.clone(), mem.clone(), cfg.clone());
            std::thread::spawn(move || push(&c, &PushSource::Raw(mem), &url, &cfg))
        };
        std::thread::sleep(Duration::from_millis(1500));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let t0 = std::time::Instant::now();
        let e = pushing.join().unwrap().unwrap_err();
        assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
        assert!(matches!(e, crate::store::StoreError::Stopped { .. }), "{e}");
        c.delete(mark).unwrap();
        assert!(c.list("leases/").unwrap().is_empty(), "a lease left");
        // Pushed whole, then an unnamed frame for gc to find: it deletes nothing.
        push(&c, &PushSource::Raw(mem), &url, &Default::default()).unwrap();
        c.put(
            &format!("frames/{}", blake3::hash(b"x").to_hex()),
            Bytes::from_static(b"x"),
        )
        .unwrap();
        let r = gc(&c, &url, Duration::ZERO, false, Some(&stop)).unwrap();
        assert!(r.stopped && !r.stopped_for_push && r.deleted == 0, "{r:?}");
        assert!(c.list("leases/").unwrap().is_empty(), "a mark left");
        stop.store(false, std::sync::atomic::Ordering::Relaxed);
        let r = gc(&c, &url, Duration::ZERO, false, Some(&stop)).unwrap();
        assert!(!r.stopped && r.deleted == 1, "{r:?}");
    }

    /// A push that finds a gc's mark once its lease is written waits for the gc to go
    /// before it looks at any frame (the gc, at its next batch, sees the lease and stops),
    /// and a gc, dry or not, leaves no mark behind.
    #[test]
    fn a_push_waits_for_a_running_gc_and_gc_leaves_no_mark() {
        let s3 = S3Server::start("gc-wait", &["snaps"]);
        let c = client(&s3);
        let scratch = guestmem_testkit::Scratch::new("gc-wait");
        let mem = scratch.join("mem");
        let bytes: Vec<u8> = (0..(1u32 << 20)).map(|i| (i / 4096 % 251) as u8).collect();
        std::fs::write(&mem, bytes).unwrap();
        let mark = "leases/gc/other.1.1";
        c.put(mark, Bytes::from_static(b"{}")).unwrap();
        let url = StoreUrl::parse("s3://snaps/vm", false).unwrap();
        let pushing = {
            let (c, url) = (Arc::clone(&c), url.clone());
            std::thread::spawn(move || push(&c, &PushSource::Raw(mem), &url, &Default::default()))
        };
        // Not a timing: whatever this host's speed, no manifest while the mark is there.
        std::thread::sleep(Duration::from_millis(1500));
        assert!(
            c.get(&url.manifest_key()).unwrap().is_none(),
            "pushed while a gc ran"
        );
        c.delete(mark).unwrap();
        pushing.join().unwrap().unwrap();
        assert!(c.get(&url.manifest_key()).unwrap().is_some());
        let dry = gc(&c, &url, Duration::ZERO, true, None).unwrap();
        assert!(dry.dry_run && dry.deleted == 0, "{dry:?}");
        gc(&c, &url, Duration::ZERO, false, None).unwrap();
        assert!(
            c.list("leases/").unwrap().is_empty(),
            "a mark or a lease left"
        );
    }

    /// A manifest that names one frame with two lengths (a whole piece and a page of it)
    /// gives an error naming the frame, never a panic or bytes of the wrong length, however
    /// the two fetches meet (one flight, the cache); a pull of it leaves no file.
    #[test]
    fn a_frame_named_with_two_lengths_is_refused() {
        let s3 = S3Server::start("two-lengths", &["snaps"]);
        let c = client(&s3);
        let page = vec![0x5au8; 4096];
        let h = blake3::hash(&page);
        c.put(
            &format!("frames/{}", h.to_hex()),
            Bytes::from(frame::raw(&page)),
        )
        .unwrap();
        let manifest = serde_json::json!({
            "format": "guestmem-store-snapshot",
            "version": 1,
            "name": "evil",
            "created": 0,
            "frame_bytes": 65536,
            "memory_bytes": 65536,
            "frames": [[{ "h": h.to_hex().to_string() },
                        { "h": h.to_hex().to_string(), "p": "0100000000000000" }]],
        });
        c.put(
            "snapshots/evil/manifest.json",
            Bytes::from(manifest.to_string()),
        )
        .unwrap();
        let url = StoreUrl::parse("s3://snaps/evil", false).unwrap();
        let scratch = guestmem_testkit::Scratch::new("two-lengths");
        for round in 0..20 {
            let cache = crate::store::FrameCache::open(&scratch.join("cache"), 1 << 20).unwrap();
            let frames = Frames::new(
                Arc::clone(&c),
                Some(Arc::new(cache)),
                FetchPolicy::default(),
            );
            let memory = StoreMemory::open(frames, &url).unwrap();
            let e = memory.frame(0).expect_err("a frame named with two lengths");
            assert!(e.to_string().contains(&h.to_hex()[..16]), "{round}: {e}");
            let out = scratch.join(format!("pulled-{round}"));
            assert!(crate::store::pull(&memory, &out, 2).is_err());
            assert!(!out.exists());
        }
        let left: Vec<_> = std::fs::read_dir(&*scratch)
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().ends_with(".pulling"))
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }

    /// A manifest another tool wrote under a name with a character object_store escapes
    /// (`~`) is read as listed: gc keeps what it names. (It was asked for escaped, not
    /// found, taken for one deleted since the listing, and its frame deleted.)
    #[test]
    fn a_manifest_named_with_a_character_object_store_escapes_is_read() {
        let s3 = S3Server::start("gc-odd-name", &["snaps"]);
        let c = client(&s3);
        let page = vec![0x5au8; 4096];
        let h = blake3::hash(&page);
        let frame_key = format!("frames/{}", h.to_hex());
        c.put(&frame_key, Bytes::from(frame::raw(&page))).unwrap();
        let manifest = serde_json::json!({
            "format": "guestmem-store-snapshot",
            "version": 1,
            "name": "web~old",
            "created": 0,
            "frame_bytes": 65536,
            "memory_bytes": 65536,
            "frames": [[{ "h": h.to_hex().to_string() }]],
        });
        let dir = s3.bucket_dir("snaps").join("snapshots/web~old");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("manifest.json"), manifest.to_string()).unwrap();
        let url = StoreUrl::parse("s3://snaps/any", false).unwrap();
        let listed = c.list("snapshots/").unwrap();
        assert_eq!(listed.len(), 1, "{listed:?}");
        assert!(
            c.get(&listed[0].key).unwrap().is_none(),
            "escaped, not found"
        );
        let r = gc(&c, &url, Duration::ZERO, false, None).unwrap();
        assert!(
            c.get(&frame_key).unwrap().is_some(),
            "deleted a named frame: {r:?}"
        );
        assert_eq!((r.snapshots, r.named, r.deleted), (1, 1, 0), "{r:?}");
    }
}
