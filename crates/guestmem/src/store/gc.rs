//! Listing the snapshots of a bucket, and collecting the frames no snapshot names.
//!
//! `gc` deletes a frame only when no manifest names it, it is older than the grace period,
//! and no push is in progress (a lease younger than `LEASE_STALE` in `leases/`), looked at
//! again before every batch of deletes. A push, for its part, looks again at every frame it
//! skipped as already there just before it writes its manifest, and uploads any that a gc
//! took meanwhile: so a manifest never names a frame that is not there.

use std::collections::HashSet;
use std::time::Duration;

use super::client::Client;
use super::lease::LEASE_STALE;
use super::manifest::Snapshot;
use super::url::{StoreUrl, FRAMES, LEASES, SNAPSHOTS};
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
    let prefix = if at.name.is_empty() {
        SNAPSHOTS.to_string()
    } else {
        format!("{SNAPSHOTS}{}/", at.name)
    };
    let mut out = Vec::new();
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
        if let Some(text) = client.get(&o.key)? {
            out.push(Snapshot::parse(&url, &text)?);
        }
    }
    Ok(out)
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
    /// With `dry_run`, nothing was deleted (`deleted` says what would have been).
    pub dry_run: bool,
}

/// Frames deleted between looks at the leases.
const BATCH: usize = 100;

/// Deletes the frames of `bucket` no snapshot names, older than `grace`. Refuses while a
/// push is in progress. A manifest that fails its checks stops it (what it names cannot be
/// known).
pub fn gc(
    client: &Client,
    bucket: &StoreUrl,
    grace: Duration,
    dry_run: bool,
) -> Result<GcReport, StoreError> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    let live_push = |client: &Client| -> Result<Option<String>, StoreError> {
        Ok(client
            .list(LEASES)?
            .into_iter()
            .find(|l| now - l.modified < LEASE_STALE.as_secs() as i64)
            .map(|l| l.key))
    };
    if let Some(l) = live_push(client)? {
        return Err(StoreError::Request {
            op: "gc",
            url: client.url(&l),
            reason: "a push is in progress (its lease is younger than 10 minutes): nothing deleted; run gc again once it ends".into(),
            permanent: true,
        });
    }
    let root = bucket.sibling("");
    let snaps = snapshots(client, &root)?;
    let named: HashSet<[u8; 32]> = snaps
        .iter()
        .flat_map(|s| s.frames.iter().flatten().map(|p| *p.hash.as_bytes()))
        .collect();
    let mut r = GcReport {
        snapshots: snaps.len() as u64,
        dry_run,
        ..GcReport::default()
    };
    let mut doomed = Vec::new();
    for o in client.list(FRAMES)? {
        r.frames += 1;
        let Some(h) = o
            .key
            .strip_prefix(FRAMES)
            .and_then(|h| blake3::Hash::from_hex(h).ok())
        else {
            continue;
        };
        if named.contains(h.as_bytes()) {
            r.named += 1;
        } else if now - o.modified < grace.as_secs() as i64 {
            r.young += 1;
        } else {
            doomed.push((o.key, o.size));
        }
    }
    for batch in doomed.chunks(BATCH) {
        if live_push(client)?.is_some() {
            r.stopped_for_push = true;
            break;
        }
        for (key, size) in batch {
            if !dry_run {
                client.delete(key)?;
            }
            r.deleted += 1;
            r.bytes_deleted += size;
        }
    }
    Ok(r)
}
