//! What fetching did, as an operator reads it (`serve-ctl status`, the metrics).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::{FrameCache, Frames};
use crate::restore::latency::LatencySummary;

/// What fetching from the store and the frame cache did, for an operator (`serve-ctl
/// status`, the metrics): totals over every bucket a server reads.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct StoreStatus {
    /// GETs of frames sent (retries included).
    pub gets: u64,
    /// Bytes of frame objects fetched.
    pub bytes_fetched: u64,
    /// GETs that failed.
    pub fetch_errors: u64,
    /// Frames whose bytes did not match their hash.
    pub hash_mismatches: u64,
    /// Fetches that waited on another VM's GET of the same frame.
    pub joined: u64,
    /// Frames fetched ahead of the VMs (read-ahead, working sets).
    pub fetched_ahead: u64,
    /// Read-ahead GETs on a guess that may be in flight now, every VM together
    /// (`fetch/gate.rs`: cut while the store's answers show a queue), summed over the
    /// buckets read. A recorded working set has a gate of its own, not counted here.
    pub ahead_limit: u64,
    /// Frames installed from memory, read ahead for their fill (from the cache, counted in
    /// `cache_hits` too, or as read-ahead fetched them) instead of read by it.
    pub staged: u64,
    /// Frames read from the node-local cache.
    pub cache_hits: u64,
    /// Frames looked for in the cache and not there.
    pub cache_misses: u64,
    /// Frames evicted from the cache.
    pub cache_evictions: u64,
    /// Frames not kept (no room in the cache, or among the frames waiting to be written; a
    /// disk error).
    pub cache_uncached: u64,
    /// Bytes the cache holds now.
    pub cache_bytes: u64,
    /// Its bound, bytes (0: no cache).
    pub cache_capacity: u64,
    /// GET latency.
    pub fetch_latency: LatencySummary,
}

impl StoreStatus {
    /// The totals of `frames` (each bucket's), their caches counted once each.
    pub fn of(frames: &[Arc<Frames>]) -> StoreStatus {
        let mut s = StoreStatus::default();
        let mut caches: Vec<&Arc<FrameCache>> = Vec::new();
        let mut latency: Option<LatencySummary> = None;
        for f in frames {
            let c = &f.counters;
            let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
            s.gets += get(&c.gets);
            s.bytes_fetched += get(&c.bytes);
            s.fetch_errors += get(&c.errors);
            s.hash_mismatches += get(&c.mismatches);
            s.joined += get(&c.joined);
            s.fetched_ahead += get(&c.ahead);
            s.staged += get(&c.staged);
            s.ahead_limit += f.guess.limit() as u64;
            let l = c.latency();
            latency = Some(match latency {
                None => l,
                Some(prev) => prev.merge(&l),
            });
            if let Some(cache) = f.cache() {
                if !caches.iter().any(|k| Arc::ptr_eq(k, cache)) {
                    caches.push(cache);
                }
            }
        }
        for c in caches {
            let k = &c.counters;
            let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
            s.cache_hits += get(&k.hits);
            s.cache_misses += get(&k.misses);
            s.cache_evictions += get(&k.evictions);
            s.cache_uncached += get(&k.uncached);
            s.cache_bytes += c.bytes();
            s.cache_capacity += c.capacity();
        }
        s.fetch_latency = latency.unwrap_or_default();
        s
    }
}
