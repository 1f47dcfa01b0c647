//! What the object-store scenario records: a round's sample, a variant's rounds, the pushes,
//! the whole body of the result.

use super::CpuSplit;
use crate::run::{Sampled, Summary};

/// One round of one variant.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StoreSample {
    /// From the VM's connect until it has read its working set, seconds.
    pub ws_secs: f64,
    /// Until it has read all its memory (the many-VM variant reads its working set only).
    pub all_secs: f64,
    /// Demand misses (faults that brought their block in), microseconds: one VM, the
    /// engine's latency (from a fault thread's read of the fault to the install); many VMs,
    /// each VM's own wait at its first touch of each frame (since 2026-11-29; before, the
    /// engine's histogram, which leaves out the faults' wait for one of 2 threads).
    pub miss_p50_us: f64,
    /// 99th percentile.
    pub miss_p99_us: f64,
    /// Whether the two are as measured (nearest rank), not a histogram bucket's upper
    /// bound (many VMs in runs before 2026-11-29, and runs before this field).
    #[serde(default)]
    pub miss_exact: bool,
    /// Demand misses counted.
    pub misses: u64,
    /// The VMs' own waits at their first touch of each frame of the working set,
    /// microseconds, nearest rank, every VM's together: many VMs (as `miss_p50_us`), and one
    /// VM that nothing is prefetched for (`cold`: its misses as it sees them, a fault on a
    /// block the prefetch thread was bringing and the wait for a fault thread included,
    /// and a touch read-ahead was there first for). 0 where not timed (and in runs before
    /// 2026-11-30).
    #[serde(default)]
    pub vm_wait_p50_us: f64,
    /// 99th percentile.
    #[serde(default)]
    pub vm_wait_p99_us: f64,
    /// First touches timed.
    #[serde(default)]
    pub vm_waits: u64,
    /// GETs when the working set had been read.
    pub gets_at_ws: u64,
    /// Bytes fetched then.
    pub bytes_at_ws: u64,
    /// GETs in all.
    pub gets: u64,
    /// Bytes fetched in all.
    pub bytes: u64,
    /// Frames the VMs read (for GETs per frame).
    pub frames_read: u64,
    /// Where the CPUs went until the working set was read (none in runs before
    /// 2026-11-30's afternoon).
    #[serde(default)]
    pub cpu_ws: Option<CpuSplit>,
    /// And until all memory was (one VM).
    #[serde(default)]
    pub cpu_all: Option<CpuSplit>,
}

/// One variant's samples.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StoreVariant {
    /// Its name.
    pub name: String,
    /// Seconds until the working set was read.
    pub ws_secs: Summary,
    /// Seconds until all memory was read.
    pub all_secs: Summary,
    /// Each round's measurements.
    pub samples: Vec<Sampled<StoreSample>>,
}

/// What pushing cost.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PushFigures {
    /// Seconds of the full push (straight to the S3 server, no proxy).
    pub full_secs: f64,
    /// Bytes stored by it.
    pub full_stored: u64,
    /// Bytes of the diff's rewritten pages.
    pub diff_changed: u64,
    /// Bytes stored by the diff's push.
    pub diff_stored: u64,
    /// Seconds of the diff's push.
    pub diff_secs: f64,
    /// Seconds to fetch every frame once through the first proxy with 16 threads (16 GETs at
    /// once: what that many deliver, each waiting its first byte).
    pub fetch_all_secs: f64,
    /// The same with 64 threads, more than read-ahead keeps in flight (48): near what the
    /// rig's store, proxy and client deliver at all on this host's CPUs (0: a run before
    /// 2026-11-30).
    #[serde(default)]
    pub fetch_all_64_secs: f64,
}

/// Every variant (the result's body).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StoreFindings {
    /// Bytes of the working set.
    pub ws_bytes: u64,
    /// Pushes.
    pub push: PushFigures,
    /// In the order they were listed.
    pub variants: Vec<StoreVariant>,
    /// Whether each round's folder (its frame cache) was kept until the run ended, not
    /// removed before the next round (when the disk had room; see `Lab::round`).
    #[serde(default)]
    pub rounds_kept: bool,
}
