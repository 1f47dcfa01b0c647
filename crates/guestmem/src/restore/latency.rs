//! Fault latency by class: how long a restore's handlers took to answer each fault, from
//! reading its message to the install that woke the faulting thread, kept per class of
//! fault in a lock-free histogram.
//!
//! Buckets are log-linear (four per power of two, so a bucket spans at most 19% of its
//! value) from 1 ns to about 17 s; a quantile reads as its bucket's upper bound, never an
//! underestimate. Histograms of several restores merge by adding their counts (a
//! snapshot's, a fleet's), which averages of quantiles could not do.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Sub-buckets per power of two.
const SUB: u32 = 4;
/// Buckets: 2^0 .. 2^34 ns (about 17 s), SUB each; the last also holds everything longer.
const BUCKETS: usize = (34 * SUB) as usize;

/// What a fault turned out to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum FaultClass {
    /// Its block was read from the file and installed for it.
    File,
    /// Its block holds no data: zero pages were installed for it.
    Zero,
    /// Its block was being brought in by another thread (the fault waited for that).
    InFlight,
    /// Its block was in already (the message raced the install, or the page was removed
    /// since and reads as zero now): answered with a wake.
    Present,
    /// It could not be served (the restore failed on it, or it lies outside every region).
    Error,
}

impl FaultClass {
    /// Every class, in the order reports list them.
    pub const ALL: [FaultClass; 5] = [
        FaultClass::File,
        FaultClass::Zero,
        FaultClass::InFlight,
        FaultClass::Present,
        FaultClass::Error,
    ];

    /// Its name in reports and metrics.
    pub fn name(self) -> &'static str {
        match self {
            FaultClass::File => "file",
            FaultClass::Zero => "zero",
            FaultClass::InFlight => "in-flight",
            FaultClass::Present => "present",
            FaultClass::Error => "error",
        }
    }
}

/// A lock-free latency histogram (see the module docs).
#[derive(Debug)]
pub(crate) struct Histogram {
    counts: Box<[AtomicU64]>,
    sum_ns: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            counts: (0..BUCKETS).map(|_| AtomicU64::new(0)).collect(),
            sum_ns: AtomicU64::new(0),
        }
    }
}

/// The bucket of `ns`.
fn bucket(ns: u64) -> usize {
    if ns < 2 {
        return 0;
    }
    let log = 63 - ns.leading_zeros();
    // Where in [2^log, 2^(log+1)) it lies, in SUB equal steps.
    let frac = ((u128::from(ns - (1u64 << log)) * u128::from(SUB)) >> log) as u32;
    ((log * SUB + frac) as usize).min(BUCKETS - 1)
}

/// The lower bound of bucket `i`, nanoseconds.
#[cfg(test)]
fn lower(i: usize) -> u64 {
    let (log, frac) = (i as u32 / SUB, i as u32 % SUB);
    let base = 1u64 << log;
    base + (base * u64::from(frac)) / u64::from(SUB)
}

/// The upper bound of bucket `i`, nanoseconds.
fn upper(i: usize) -> u64 {
    let (log, frac) = (i as u32 / SUB, i as u32 % SUB);
    let base = 1u64 << log;
    base + (base * u64::from(frac + 1)) / u64::from(SUB)
}

impl Histogram {
    /// Counts one latency.
    pub(crate) fn record(&self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.counts[bucket(ns)].fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// The sum of every latency counted, nanoseconds.
    pub(crate) fn sum_ns(&self) -> u64 {
        self.sum_ns.load(Ordering::Relaxed)
    }

    /// The counts now.
    pub(crate) fn counts(&self) -> Vec<u64> {
        self.counts
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect()
    }
}

/// Latencies kept as they were, the latest [`RECENT`] of them, for quantiles that a
/// bucket's width (up to 19% of its value) cannot decide: a move's remote fault at a 20 ms
/// round trip falls in a bucket 4 ms wide, where the goal lies 0.5 ms past the round trip,
/// and a demand miss on a store 20 ms away in one from 29.8 to 33.6 ms, where the goal is
/// 30. For events that each wait on a read (a move's remote faults, a restore's faults that
/// read their block): a lock a record costs them nothing, and a long-lived server keeps
/// only the latest.
#[derive(Debug, Default)]
pub(crate) struct Recent {
    /// Nanoseconds, and where the next one goes once full.
    ring: std::sync::Mutex<(Vec<u64>, usize)>,
}

/// Latencies a [`Recent`] keeps at most.
pub(crate) const RECENT: usize = 4096;

impl Recent {
    /// Keeps one latency, in place of the oldest once full.
    pub(crate) fn record(&self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let mut r = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        let (ring, next) = &mut *r;
        if ring.len() < RECENT {
            ring.push(ns);
        } else {
            ring[*next] = ns;
            *next = (*next + 1) % RECENT;
        }
    }

    /// Their quantiles.
    pub(crate) fn exact(&self) -> ExactLatency {
        let mut v = self
            .ring
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .0
            .clone();
        v.sort_unstable();
        // The nearest rank: the least latency at or above which lies the share `p`.
        let q = |p: f64| -> f64 {
            let rank = ((v.len() as f64) * p).ceil().max(1.0) as usize;
            v.get(rank - 1).map_or(0.0, |&ns| ns as f64 / 1000.0)
        };
        ExactLatency {
            count: v.len() as u64,
            p50_us: q(0.5),
            p99_us: q(0.99),
            max_us: q(1.0),
        }
    }
}

/// Quantiles of latencies as measured (no bucket), over the latest [`RECENT`] of them.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct ExactLatency {
    /// Latencies they are taken over (the latest, at most 4096).
    pub count: u64,
    /// Median, microseconds (nearest rank).
    pub p50_us: f64,
    /// 99th percentile, microseconds.
    pub p99_us: f64,
    /// The longest, microseconds.
    pub max_us: f64,
}

/// One class's latencies, summarised.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct LatencySummary {
    /// Faults counted.
    pub count: u64,
    /// Median, microseconds (a bucket's upper bound).
    pub p50_us: f64,
    /// 99th percentile, microseconds.
    pub p99_us: f64,
    /// 99.9th percentile, microseconds.
    pub p999_us: f64,
    /// The highest bucket with a count, microseconds.
    pub max_us: f64,
    /// Every latency added up, microseconds.
    pub sum_us: f64,
    /// The raw bucket counts (four per power of two of nanoseconds), for merging.
    #[serde(skip)]
    pub buckets: Vec<u64>,
}

impl LatencySummary {
    /// Summarises bucket counts.
    pub(crate) fn of(buckets: Vec<u64>, sum_us: f64) -> LatencySummary {
        let count: u64 = buckets.iter().sum();
        let q = |p: f64| -> f64 {
            if count == 0 {
                return 0.0;
            }
            let want = ((count as f64) * p).ceil().max(1.0) as u64;
            let mut seen = 0;
            for (i, &c) in buckets.iter().enumerate() {
                seen += c;
                if seen >= want {
                    return upper(i) as f64 / 1000.0;
                }
            }
            upper(BUCKETS - 1) as f64 / 1000.0
        };
        LatencySummary {
            count,
            p50_us: q(0.5),
            p99_us: q(0.99),
            p999_us: q(0.999),
            max_us: q(1.0),
            sum_us,
            buckets,
        }
    }

    /// Adds `other`'s counts to these (several restores, one distribution).
    pub fn merge(&self, other: &LatencySummary) -> LatencySummary {
        let n = self.buckets.len().max(other.buckets.len());
        let at = |v: &Vec<u64>, i: usize| v.get(i).copied().unwrap_or(0);
        LatencySummary::of(
            (0..n)
                .map(|i| at(&self.buckets, i) + at(&other.buckets, i))
                .collect(),
            self.sum_us + other.sum_us,
        )
    }

    /// Counts at or below each power of two of nanoseconds from 1 us to about 17 s (upper
    /// bound in seconds, count in that span: not cumulative), the last unbounded: buckets
    /// coarse enough for a metrics scrape.
    pub fn coarse(&self) -> Vec<(f64, u64)> {
        let mut out = Vec::new();
        let mut i = 0;
        for k in 10..34u32 {
            // Buckets below 2^k ns end at or below it.
            let end = (k * SUB) as usize;
            let n = self
                .buckets
                .get(i..end.min(self.buckets.len()))
                .map_or(0, |b| b.iter().sum());
            out.push(((1u64 << k) as f64 / 1e9, n));
            i = end;
        }
        out.push((
            f64::MAX,
            self.buckets.get(i..).map_or(0, |b| b.iter().sum()),
        ));
        out
    }
}

/// A restore's fault latency, per class.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct FaultLatency {
    /// Faults whose block came from the file.
    pub file: LatencySummary,
    /// Faults on zero blocks.
    pub zero: LatencySummary,
    /// Faults that waited on a block in flight.
    pub in_flight: LatencySummary,
    /// Faults on blocks already in.
    pub present: LatencySummary,
    /// Faults that could not be served.
    pub error: LatencySummary,
}

impl FaultLatency {
    /// The summary of `class`.
    pub fn class(&self, class: FaultClass) -> &LatencySummary {
        match class {
            FaultClass::File => &self.file,
            FaultClass::Zero => &self.zero,
            FaultClass::InFlight => &self.in_flight,
            FaultClass::Present => &self.present,
            FaultClass::Error => &self.error,
        }
    }

    /// Every class together.
    pub fn all(&self) -> LatencySummary {
        FaultClass::ALL
            .iter()
            .fold(LatencySummary::of(Vec::new(), 0.0), |a, &c| {
                a.merge(self.class(c))
            })
    }

    /// Adds `other`'s counts to these, class by class.
    pub fn merge(&self, other: &FaultLatency) -> FaultLatency {
        FaultLatency {
            file: self.file.merge(&other.file),
            zero: self.zero.merge(&other.zero),
            in_flight: self.in_flight.merge(&other.in_flight),
            present: self.present.merge(&other.present),
            error: self.error.merge(&other.error),
        }
    }
}

/// A histogram per class, and the latest faults of class `File` as measured.
#[derive(Default)]
pub(crate) struct ClassHistograms([Histogram; 5], Recent);

impl ClassHistograms {
    /// Counts one fault of `class` that took `d`.
    pub(crate) fn record(&self, class: FaultClass, d: Duration) {
        self.0[class as usize].record(d);
        if class == FaultClass::File {
            // A lock a fault that read its block: microseconds at least, and the ring
            // holds at most one entry a block.
            self.1.record(d);
        }
    }

    /// The quantiles of the latest faults whose block came from the file, as measured.
    pub(crate) fn file_exact(&self) -> ExactLatency {
        self.1.exact()
    }

    /// The summaries now.
    pub(crate) fn summary(&self) -> FaultLatency {
        let s = |c: FaultClass| {
            let h = &self.0[c as usize];
            LatencySummary::of(h.counts(), h.sum_ns() as f64 / 1000.0)
        };
        FaultLatency {
            file: s(FaultClass::File),
            zero: s(FaultClass::Zero),
            in_flight: s(FaultClass::InFlight),
            present: s(FaultClass::Present),
            error: s(FaultClass::Error),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn a_latency_lies_in_its_bucket(ns in 1u64..(1 << 34)) {
            let b = bucket(ns);
            prop_assert!(ns <= upper(b), "{ns} above bucket {b}'s bound {}", upper(b));
            prop_assert!(ns >= lower(b), "{ns} below bucket {b}'s bound {}", lower(b));
            // The bound is within one sub-bucket: at most 25% over.
            prop_assert!(upper(b) as f64 <= ns as f64 * 1.25 + 1.0);
        }
    }

    #[test]
    fn quantiles_read_the_distribution_and_merge_adds_counts() {
        let h = Histogram::default();
        for us in 1..=1000u64 {
            h.record(Duration::from_micros(us));
        }
        let s = LatencySummary::of(h.counts(), h.sum_ns() as f64 / 1000.0);
        assert_eq!(s.sum_us, 500_500.0);
        let coarse = s.coarse();
        assert_eq!(coarse.iter().map(|b| b.1).sum::<u64>(), 1000);
        assert_eq!(coarse.last().unwrap().0, f64::MAX);
        assert_eq!(s.count, 1000);
        assert!((500.0..=625.0).contains(&s.p50_us), "{s:?}");
        assert!((990.0..=1250.0).contains(&s.p99_us), "{s:?}");
        assert!(s.max_us >= 1000.0 && s.max_us <= 1250.0, "{s:?}");
        let m = s.merge(&s);
        assert_eq!(m.count, 2000);
        assert_eq!(m.p50_us, s.p50_us);
        assert_eq!(LatencySummary::of(vec![], 0.0).p99_us, 0.0);
    }

    #[test]
    fn recent_latencies_give_exact_quantiles_of_the_latest() {
        let r = Recent::default();
        assert_eq!(r.exact(), ExactLatency::default());
        // 1..=100 us, shuffled: exact where a bucket would say 23-27% more.
        for us in (1..=100u64).map(|i| (i * 37) % 100 + 1) {
            r.record(Duration::from_micros(us));
        }
        let e = r.exact();
        assert_eq!(
            (e.count, e.p50_us, e.p99_us, e.max_us),
            (100, 50.0, 99.0, 100.0)
        );
        // Bounded: once full, the oldest go first.
        for _ in 0..RECENT {
            r.record(Duration::from_micros(7));
        }
        let e = r.exact();
        assert_eq!((e.count, e.p50_us, e.max_us), (RECENT as u64, 7.0, 7.0));
    }
}
