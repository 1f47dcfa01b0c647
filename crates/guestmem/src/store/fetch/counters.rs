//! What fetching did: GETs, bytes, retries and latencies, counted since it started.

use std::sync::atomic::AtomicU64;

use crate::restore::latency::{ExactLatency, Histogram, LatencySummary, Recent};

/// What fetching did, counted since it started.
#[derive(Debug, Default)]
pub struct FetchCounters {
    /// GETs of frames sent (attempts, retries included).
    pub gets: AtomicU64,
    /// Bytes of frame objects received.
    pub bytes: AtomicU64,
    /// GETs that failed (and were retried, or ended a fetch).
    pub errors: AtomicU64,
    /// Frames whose bytes did not match their hash.
    pub mismatches: AtomicU64,
    /// Fetches that waited on another's flight instead of a GET of their own.
    pub joined: AtomicU64,
    /// Frames fetched by read-ahead.
    pub ahead: AtomicU64,
    /// Frames a fill took from memory, read ahead for it (`fetch/stage.rs`).
    pub staged: AtomicU64,
    /// GET latency (to the whole object).
    pub(crate) latency: Histogram,
    /// GETs sent to a move's source host (in `gets` too).
    pub peer_gets: AtomicU64,
    /// Bytes received from it (in `bytes` too).
    pub peer_bytes: AtomicU64,
    /// Its GET latency.
    pub(crate) peer_latency: Histogram,
    /// The latency of its GETs a fault sent itself (not read-ahead, nor a prefetch thread).
    pub(crate) peer_fault_latency: Histogram,
    /// How long a fault waited for a frame of which the source owed a piece this host's
    /// cache did not hold as it looked: its own GET, or one in flight it joined, and the
    /// frame's other pieces (a remote fault, but for the install; a store's frame is a
    /// fault's block). One read ahead and still in memory, or landed and not yet written,
    /// counts too, with a short wait. Frames it could not get are not counted.
    pub(crate) peer_fault_wait: Histogram,
    /// The latest of those waits as measured, for exact quantiles.
    pub(crate) peer_fault_wait_recent: Recent,
}

impl FetchCounters {
    /// GET latency so far.
    pub fn latency(&self) -> LatencySummary {
        LatencySummary::of(self.latency.counts(), self.latency.sum_ns() as f64 / 1000.0)
    }

    /// GET latency from a move's source host so far.
    pub fn peer_latency(&self) -> LatencySummary {
        let h = &self.peer_latency;
        LatencySummary::of(h.counts(), h.sum_ns() as f64 / 1000.0)
    }

    /// The latency of the GETs from a move's source host that a fault sent itself.
    pub fn peer_fault_latency(&self) -> LatencySummary {
        let h = &self.peer_fault_latency;
        LatencySummary::of(h.counts(), h.sum_ns() as f64 / 1000.0)
    }

    /// How long faults waited for frames of which a move's source host owed a piece this
    /// host did not hold yet (their own GET, or one in flight they joined, and the rest of
    /// the frame).
    pub fn peer_fault_wait(&self) -> LatencySummary {
        let h = &self.peer_fault_wait;
        LatencySummary::of(h.counts(), h.sum_ns() as f64 / 1000.0)
    }

    /// [`FetchCounters::peer_fault_wait`]'s quantiles as measured, over the latest 4096
    /// waits (a bucket spans up to 19% of its value: 4 ms at a 20 ms round trip).
    pub fn peer_fault_wait_exact(&self) -> ExactLatency {
        self.peer_fault_wait_recent.exact()
    }
}
