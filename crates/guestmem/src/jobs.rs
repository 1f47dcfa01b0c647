//! One job splitter for every parallel operation, after Linux `padata_do_multithreaded`.
//!
//! A `Job` (crate-private: populate, save and restore use it) is a list of ranges (one per region of a map, or a single length) and a
//! few tuning fields; `Job::run` cuts it into chunks and runs a function on each, on up to
//! `max_threads` threads. The choices, and why:
//!
//! - **One job spans all ranges.** Chunks come from one list that covers every region, so a
//!   map of one 60 GiB and one 4 GiB region keeps every thread busy to the end, instead of one
//!   job per region where the small one's threads go idle.
//! - **Chunk size** is `total / (threads * CHUNKS_PER_THREAD)`, then at least 1, at least
//!   `min_chunk`, and rounded up to the alignment *last*: rounding first and then raising to an
//!   unaligned `min_chunk` would leave chunk edges off the huge-page boundaries they must sit on.
//!   Several chunks per thread let threads that finish early take more ("in case threads
//!   finish at different times", padata).
//! - **Edges.** Inside a range, every chunk edge is a multiple of the chunk size, itself a
//!   multiple of the range's alignment (a region's huge-page size, in guest addresses, which
//!   the layout keeps congruent with host addresses). Only a range's own ends may be
//!   unaligned. A chunk never spans two ranges.
//! - **Load balancing.** Workers take the next chunk from a shared atomic cursor; the calling
//!   thread works too.
//! - **Start gate.** Every worker thread is created, and waiting, before any chunk starts
//!   (`workers.rs`, seed 001); a thread that cannot be created just means one worker
//!   fewer.
//! - **Fast paths.** The empty job returns at once; a job that needs one worker runs on the
//!   calling thread with no thread created.
//! - **Failure.** When a chunk fails, the other workers stop before their next chunk; the job
//!   returns the first error with the chunks that completed and those that failed, so the
//!   caller can undo exactly the work that was done.
//! - **NUMA** ([`Numa::Affine`]): before a chunk of a range bound to a node, the worker moves
//!   itself to that node's CPUs, so the kernel clears the node's pages from a CPU next to them.
//!   This is a hint: a failure to move is ignored.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};

use crate::host::NumaNode;
use crate::sys;
use crate::workers::{Caller, Crew, Shortfall};

/// Chunks per worker thread: more than one, so threads that finish early take more.
pub const CHUNKS_PER_THREAD: u64 = 4;

/// Most threads one job runs on, whatever the caller asks.
pub const MAX_JOB_THREADS: usize = 1024;

/// Most threads a job uses by default (QEMU and Cloud Hypervisor stop at 16 too); the
/// caller may ask for more.
pub const DEFAULT_MAX_THREADS: usize = 16;

/// The default thread count of every parallel operation (populate, save, restore, the page
/// server): this host's CPUs, at most [`DEFAULT_MAX_THREADS`].
pub fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(DEFAULT_MAX_THREADS)
}

/// Stack size of a worker thread, in bytes: workers only make syscalls.
pub const WORKER_STACK_BYTES: usize = 256 << 10;

/// How far a long operation has got: `done` of `total`, in the operation's unit (bytes for a
/// bring-up, blocks for a restore).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Progress {
    /// Units done.
    pub done: u64,
    /// Units in all.
    pub total: u64,
}

impl Progress {
    /// Whether all is done.
    pub fn is_complete(&self) -> bool {
        self.done >= self.total
    }
}

/// Why a job could not be built.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// A range's end runs past the end of the 64-bit address space.
    #[error("job range {index} at {start:#x} len {len:#x}: end overflows u64")]
    RangeOverflow {
        /// Index of the range.
        index: usize,
        /// Its start.
        start: u64,
        /// Its length.
        len: u64,
    },
}

/// One range of a job: `len` units from `start` (see [`Chunk`]), whose chunk edges fall on
/// multiples of `align`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct JobRange {
    /// First unit (a guest address for populate, a block index for save and restore).
    pub start: u64,
    /// Length in units.
    pub len: u64,
    /// Alignment of interior chunk edges, in units; 0 means 1. Combined with the job's
    /// alignment by taking the larger, so both should be powers of two.
    pub align: u64,
    /// NUMA node the range's memory is bound to, if any.
    pub node: Option<u32>,
}

impl JobRange {
    /// `len` bytes from `start`, no alignment of its own, no node.
    pub fn new(start: u64, len: u64) -> JobRange {
        JobRange {
            start,
            len,
            align: 1,
            node: None,
        }
    }
}

/// Whether workers follow the NUMA node of the range they work on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Numa {
    /// Workers run wherever the scheduler puts them (the default).
    #[default]
    Ignore,
    /// Before a chunk of a range bound to a node, a worker moves to that node's CPUs; the
    /// calling thread's CPU affinity is restored when the job ends.
    Affine,
}

/// A parallel job: its ranges and how to split them. See the module docs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Job {
    ranges: Vec<JobRange>,
    align: u64,
    min_chunk: u64,
    max_threads: usize,
    numa: Numa,
    /// Address ranges `(start, end)` whose chunks run first, in this order.
    first: Vec<(u64, u64)>,
}

/// One piece of a job: `len` units from `start` inside range number `range`. A job's unit is
/// its caller's: bytes of guest memory for populate, blocks for save and restore.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct Chunk {
    /// Index of the range in the job.
    pub range: usize,
    /// First unit (a guest address for populate, a block index for save and restore).
    pub start: u64,
    /// Length in units (never 0).
    pub len: u64,
}

/// How a job is cut up: what [`Job::plan`] decides and [`Job::run`] follows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Plan {
    /// Worker threads, the calling thread included (0 for the empty job).
    pub threads: usize,
    /// Chunk size before each range's own alignment is applied (0 for the empty job).
    pub chunk_bytes: u64,
    /// The chunks, in the order they are handed out: those of the job's first ranges, then
    /// the rest in address order.
    pub chunks: Vec<Chunk>,
}

/// What a job did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct JobStats {
    /// Threads that worked, the calling thread included.
    pub threads: usize,
    /// Chunk size the job was cut with.
    pub chunk_bytes: u64,
    /// Number of chunks.
    pub chunks: usize,
}

/// A job that failed: the first error, where, and what had been done.
#[derive(Debug)]
pub(crate) struct JobFailure<E> {
    /// The first error returned by a chunk.
    pub error: E,
    /// The chunk that returned it.
    pub chunk: Chunk,
    /// Chunks that completed; sorted.
    pub completed: Vec<Chunk>,
    /// Chunks that failed, `chunk` among them: they may have done part of their work; sorted.
    pub failed: Vec<Chunk>,
}

impl<E> JobFailure<E> {
    /// Every chunk that started: those that completed and those that failed, sorted. Undoing
    /// these undoes the job.
    pub fn started(&self) -> Vec<Chunk> {
        let mut v: Vec<Chunk> = self.completed.iter().chain(&self.failed).copied().collect();
        v.sort_unstable();
        v
    }
}

fn round_up(v: u64, align: u64) -> u64 {
    // A chunk size that would overflow is "the whole range": any range fits in u64::MAX.
    v.checked_next_multiple_of(align.max(1)).unwrap_or(u64::MAX)
}

impl Job {
    /// A job over `len` bytes from address 0.
    pub fn new(len: u64) -> Job {
        Job {
            ranges: vec![JobRange::new(0, len)],
            align: 1,
            min_chunk: 0,
            max_threads: 1,
            numa: Numa::Ignore,
            first: Vec::new(),
        }
    }

    /// A job over `ranges`, each split on its own alignment; empty ranges are allowed.
    pub fn over(ranges: Vec<JobRange>) -> Result<Job, JobError> {
        for (index, r) in ranges.iter().enumerate() {
            if r.start.checked_add(r.len).is_none() {
                return Err(JobError::RangeOverflow {
                    index,
                    start: r.start,
                    len: r.len,
                });
            }
        }
        Ok(Job {
            ranges,
            ..Job::new(0)
        })
    }

    /// Alignment of interior chunk edges for every range (0 means 1).
    #[cfg(test)]
    pub fn with_align(mut self, align: u64) -> Job {
        self.align = align.max(1);
        self
    }

    /// Smallest chunk worth a thread, in bytes; 0 means 1.
    pub fn with_min_chunk(mut self, min_chunk: u64) -> Job {
        self.min_chunk = min_chunk;
        self
    }

    /// Most threads, the calling thread included; 0 means 1, and more than
    /// [`MAX_JOB_THREADS`] means that many.
    pub fn with_max_threads(mut self, max_threads: usize) -> Job {
        self.max_threads = max_threads.clamp(1, MAX_JOB_THREADS);
        self
    }

    /// Chunks that overlap these `(start, len)` ranges are handed out first, range by range
    /// in the order given (low memory where a guest kernel boots, say); the rest follow in
    /// address order. Where the chunk edges fall does not change.
    pub fn with_first(mut self, first: &[(u64, u64)]) -> Job {
        self.first = first
            .iter()
            .map(|&(start, len)| (start, start.saturating_add(len)))
            .collect();
        self
    }

    /// Sets NUMA awareness.
    pub fn with_numa(mut self, numa: Numa) -> Job {
        self.numa = numa;
        self
    }

    /// The ranges.
    #[cfg(test)]
    pub fn ranges(&self) -> &[JobRange] {
        &self.ranges
    }

    /// Total bytes over all ranges (saturating at `u64::MAX`).
    pub fn total_len(&self) -> u64 {
        self.ranges
            .iter()
            .fold(0u64, |a, r| a.saturating_add(r.len))
    }

    /// Cuts the job into chunks, as [`Job::run`] will. Pure: runs nothing.
    pub fn plan(&self) -> Plan {
        let total = self.total_len();
        if total == 0 {
            return Plan {
                threads: 0,
                chunk_bytes: 0,
                chunks: Vec::new(),
            };
        }
        // As padata: no more workers than min_chunk-sized pieces, and at least one.
        let min_chunk = self.min_chunk.max(1);
        let workers = (total / min_chunk).clamp(1, self.max_threads as u64);
        // The order matters: at least 1, at least min_chunk, and only then rounded up to the
        // alignment, so the result is aligned whatever min_chunk is.
        let chunk = (total / (workers * CHUNKS_PER_THREAD))
            .max(1)
            .max(min_chunk);
        let chunk_bytes = round_up(chunk, self.align);
        let mut chunks = Vec::new();
        for (i, r) in self.ranges.iter().enumerate() {
            let c = round_up(chunk_bytes, r.align.max(self.align));
            let end = r.start + r.len; // checked in `over`
            let mut at = r.start;
            while at < end {
                // The next multiple of `c` above `at`, or the range's end.
                let edge = (at / c)
                    .checked_add(1)
                    .and_then(|k| k.checked_mul(c))
                    .map_or(end, |e| e.min(end));
                chunks.push(Chunk {
                    range: i,
                    start: at,
                    len: edge - at,
                });
                at = edge;
            }
        }
        if !self.first.is_empty() {
            // Stable: within each rank, address order stays.
            let rank = |c: &Chunk| {
                self.first
                    .iter()
                    .position(|&(s, e)| c.start < e && s < c.start + c.len)
                    .unwrap_or(self.first.len())
            };
            chunks.sort_by_key(rank);
        }
        let threads = (workers as usize).min(chunks.len());
        Plan {
            threads,
            chunk_bytes,
            chunks,
        }
    }

    /// Runs `f` on every chunk, on up to `max_threads` threads, the calling thread included.
    ///
    /// If a chunk fails, workers stop before their next chunk and the first error is returned
    /// with the chunks done; `f` is never called again after the job returns.
    pub fn run<E, F>(&self, f: F) -> Result<JobStats, JobFailure<E>>
    where
        E: Send,
        F: Fn(&Chunk) -> Result<(), E> + Sync,
    {
        let plan = self.plan();
        let mut stats = JobStats {
            threads: plan.threads,
            chunk_bytes: plan.chunk_bytes,
            chunks: plan.chunks.len(),
        };
        if plan.chunks.is_empty() {
            return Ok(stats);
        }
        let shared = Shared {
            chunks: &plan.chunks,
            ranges: &self.ranges,
            numa: self.numa,
            cursor: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            first: Mutex::new(None),
        };
        let saved_affinity = match self.numa {
            Numa::Affine => sys::sched_getaffinity().ok(),
            Numa::Ignore => None,
        };
        let nodes = match self.numa {
            Numa::Affine => crate::host::numa_nodes(),
            Numa::Ignore => Vec::new(),
        };
        let crew = Crew::new("guestmem-job")
            .with_stack_bytes(WORKER_STACK_BYTES)
            .with_caller(Caller::Works)
            .with_shortfall(Shortfall::RunWithFewer);
        // With RunWithFewer a failed creation only means fewer workers, never an error.
        let per_worker = crew
            .run(plan.threads, |_| shared.work(&f, &nodes))
            .unwrap_or_default();
        stats.threads = per_worker.len().max(1);
        let mut done = Done::default();
        for d in per_worker {
            done.merge(d);
        }
        if let Some(set) = saved_affinity {
            // Best effort, like the moves themselves.
            let _ = sys::sched_setaffinity(&set);
        }
        let first = shared
            .first
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner);
        match first {
            None => Ok(stats),
            Some((error, chunk)) => {
                done.completed.sort_unstable();
                done.failed.sort_unstable();
                Err(JobFailure {
                    error,
                    chunk,
                    completed: done.completed,
                    failed: done.failed,
                })
            }
        }
    }
}

/// Chunks one worker completed or failed.
#[derive(Default)]
struct Done {
    completed: Vec<Chunk>,
    failed: Vec<Chunk>,
}

impl Done {
    fn merge(&mut self, other: Done) {
        self.completed.extend(other.completed);
        self.failed.extend(other.failed);
    }
}

/// What the workers of one job share.
struct Shared<'a, E> {
    chunks: &'a [Chunk],
    ranges: &'a [JobRange],
    numa: Numa,
    cursor: AtomicUsize,
    stop: AtomicBool,
    first: Mutex<Option<(E, Chunk)>>,
}

impl<E> Shared<'_, E> {
    fn work<F: Fn(&Chunk) -> Result<(), E>>(&self, f: &F, nodes: &[NumaNode]) -> Done {
        let mut done = Done::default();
        let mut node: Option<u32> = None;
        loop {
            if self.stop.load(Ordering::Acquire) {
                break;
            }
            let i = self.cursor.fetch_add(1, Ordering::Relaxed);
            let Some(chunk) = self.chunks.get(i) else {
                break;
            };
            if self.numa == Numa::Affine {
                let want = self.ranges[chunk.range].node;
                if want.is_some() && want != node {
                    node = want;
                    if let Some(cpus) = want.and_then(|n| node_cpus(nodes, n)) {
                        // A hint: the chunk is correct on any CPU.
                        let _ = sys::sched_setaffinity(&cpus);
                    }
                }
            }
            match f(chunk) {
                Ok(()) => done.completed.push(*chunk),
                Err(e) => {
                    done.failed.push(*chunk);
                    self.stop.store(true, Ordering::Release);
                    let mut first = self.first.lock().unwrap_or_else(PoisonError::into_inner);
                    if first.is_none() {
                        *first = Some((e, *chunk));
                    }
                }
            }
        }
        done
    }
}

/// The CPUs of NUMA node `node` as a set, if it has any.
fn node_cpus(nodes: &[NumaNode], node: u32) -> Option<sys::CpuSet> {
    let n = nodes.iter().find(|n| n.id == node)?;
    (!n.cpus.is_empty()).then(|| sys::CpuSet::from_cpus(n.cpus.iter().copied()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::atomic::AtomicU64;

    /// Every byte of every range covered exactly once, in order; every chunk inside one range;
    /// every interior edge aligned.
    fn check_plan(job: &Job, plan: &Plan) -> Result<(), TestCaseError> {
        let mut it = plan.chunks.iter().peekable();
        for (i, r) in job.ranges().iter().enumerate() {
            let align = r.align.max(job.align).max(1);
            let mut at = r.start;
            while let Some(c) = it.next_if(|c| c.range == i) {
                prop_assert!(c.len > 0);
                prop_assert_eq!(c.start, at, "gap or overlap in range {}", i);
                at = c.start + c.len;
                prop_assert!(at <= r.start + r.len, "chunk spills out of range {}", i);
                if at != r.start + r.len {
                    prop_assert_eq!(at % align, 0, "unaligned interior edge {:#x}", at);
                }
            }
            prop_assert_eq!(at, r.start + r.len, "range {} not fully covered", i);
        }
        prop_assert!(it.next().is_none());
        prop_assert!(plan.threads <= job.max_threads);
        prop_assert!(plan.threads <= plan.chunks.len());
        if !plan.chunks.is_empty() {
            prop_assert!(plan.threads >= 1);
            prop_assert!(plan.chunk_bytes >= job.min_chunk.max(1));
            prop_assert_eq!(plan.chunk_bytes % job.align, 0);
        }
        Ok(())
    }

    fn arb_range() -> impl Strategy<Value = JobRange> {
        (
            0u64..(1 << 40),
            prop_oneof![Just(0u64), Just(1), 0u64..(1 << 16), 0u64..(1 << 32)],
            prop::sample::select(vec![0u64, 1, 4096, 2 << 20, 1 << 30]),
        )
            .prop_map(|(start, len, align)| JobRange {
                start,
                len,
                align,
                node: None,
            })
    }

    #[test]
    fn plan_first_ranges_come_first_and_nothing_else_moves() {
        let job = Job::over(vec![
            JobRange::new(0, 64 << 20),
            JobRange::new(1 << 30, 64 << 20),
        ])
        .unwrap()
        .with_min_chunk(8 << 20)
        .with_max_threads(2)
        .with_first(&[((1 << 30) + (20 << 20), 1), (0, 4096)]);
        let plain = Job {
            first: Vec::new(),
            ..job.clone()
        }
        .plan();
        let p = job.plan();
        // Same chunks, reordered: the one holding 1 GiB + 20 MiB, then the one at 0.
        let mut a = p.chunks.clone();
        let mut b = plain.chunks.clone();
        a.sort_unstable();
        b.sort_unstable();
        assert_eq!(a, b);
        assert!(p.chunks[0].start <= (1 << 30) + (20 << 20));
        assert!(p.chunks[0].start + p.chunks[0].len > (1 << 30) + (20 << 20));
        assert_eq!(p.chunks[1].start, 0);
        assert_eq!(
            &p.chunks[2..],
            &plain
                .chunks
                .iter()
                .filter(|c| *c != &p.chunks[0] && *c != &p.chunks[1])
                .copied()
                .collect::<Vec<_>>()[..]
        );
    }

    proptest! {
        #[test]
        fn plan_single_range_covers_once_and_aligns(
            len in prop_oneof![Just(0u64), Just(1), 0u64..4096, 0u64..(1 << 34)],
            align in prop::sample::select(vec![1u64, 4096, 2 << 20, 1 << 30, 1 << 40]),
            min_chunk in prop_oneof![Just(0u64), Just(1), 0u64..(1 << 30)],
            threads in 0usize..70,
        ) {
            let job = Job::new(len)
                .with_align(align)
                .with_min_chunk(min_chunk)
                .with_max_threads(threads);
            check_plan(&job, &job.plan())?;
        }

        #[test]
        fn plan_many_ranges_covers_once_and_aligns(
            ranges in prop::collection::vec(arb_range(), 0..40),
            align in prop::sample::select(vec![1u64, 4096, 2 << 20]),
            min_chunk in prop_oneof![Just(0u64), 0u64..(1 << 26)],
            threads in 1usize..300,
        ) {
            let job = Job::over(ranges).unwrap()
                .with_align(align)
                .with_min_chunk(min_chunk)
                .with_max_threads(threads);
            check_plan(&job, &job.plan())?;
        }

        #[test]
        fn run_visits_every_chunk_once(
            ranges in prop::collection::vec(arb_range(), 0..8),
            threads in 1usize..6,
        ) {
            let job = Job::over(ranges).unwrap().with_max_threads(threads).with_min_chunk(1 << 12);
            let plan = job.plan();
            let seen = Mutex::new(Vec::new());
            let stats = job.run::<(), _>(|c| {
                seen.lock().unwrap().push(*c);
                Ok(())
            }).unwrap();
            let mut seen = seen.into_inner().unwrap();
            seen.sort_unstable();
            prop_assert_eq!(seen, plan.chunks);
            prop_assert!(stats.threads <= threads.max(1));
        }
    }

    #[test]
    fn plan_chunk_size_follows_padata_formula() {
        // 1 GiB over 4 threads: 1 GiB / 16 = 64 MiB, already 2 MiB aligned.
        let p = Job::new(1 << 30)
            .with_align(2 << 20)
            .with_max_threads(4)
            .plan();
        assert_eq!(
            (p.threads, p.chunk_bytes, p.chunks.len()),
            (4, 64 << 20, 16)
        );
        // min_chunk raises it, and the alignment applies last: 3 MiB -> 4 MiB.
        let p = Job::new(1 << 30)
            .with_align(2 << 20)
            .with_min_chunk(3 << 20)
            .with_max_threads(64)
            .plan();
        assert_eq!(p.chunk_bytes, 4 << 20);
        // No more workers than min_chunk-sized pieces.
        let p = Job::new(8 << 20)
            .with_min_chunk(4 << 20)
            .with_max_threads(16)
            .plan();
        assert_eq!(p.threads, 2);
    }

    #[test]
    fn plan_unaligned_range_has_short_first_and_last_chunks() {
        let start = (2 << 20) - 4096;
        let job = Job::over(vec![JobRange {
            start,
            len: 6 << 20,
            align: 2 << 20,
            node: None,
        }])
        .unwrap()
        .with_max_threads(3)
        .with_min_chunk(1);
        let p = job.plan();
        assert_eq!(p.chunks[0].len, 4096);
        assert_eq!(p.chunks.last().unwrap().len, (2 << 20) - 4096);
    }

    #[test]
    fn run_empty_job_calls_nothing() {
        let calls = AtomicU64::new(0);
        let s = Job::new(0)
            .with_max_threads(8)
            .run::<(), _>(|_| {
                calls.fetch_add(1, Ordering::Relaxed);
                Ok(())
            })
            .unwrap();
        assert_eq!((s.threads, s.chunks, calls.into_inner()), (0, 0, 0));
    }

    #[test]
    fn run_one_worker_stays_on_calling_thread() {
        let me = std::thread::current().id();
        let s = Job::new(1 << 20)
            .with_max_threads(1)
            .run::<(), _>(|_| {
                assert_eq!(std::thread::current().id(), me);
                Ok(())
            })
            .unwrap();
        assert_eq!(s.threads, 1);
    }

    #[test]
    fn run_failure_stops_and_reports_done_chunks() {
        let job = Job::new(1 << 20).with_max_threads(4).with_min_chunk(4096);
        let plan = job.plan();
        let bad = plan.chunks[5];
        let e = job
            .run(|c| if *c == bad { Err(c.start) } else { Ok(()) })
            .unwrap_err();
        assert_eq!((e.error, e.chunk), (bad.start, bad));
        assert_eq!(e.failed, vec![bad]);
        assert!(!e.completed.contains(&bad));
        // How many chunks the other workers finish depends on when the failing one is
        // scheduled (all of them, if it is preempted between taking its chunk and failing):
        // the bound is tested where the workers' stop can be seen, below.
        assert_eq!(e.started().len(), e.completed.len() + 1);
    }

    #[test]
    fn workers_take_no_chunk_once_a_failure_is_seen() {
        const THREADS: usize = 4;
        let plan = Job::new(1 << 20)
            .with_max_threads(THREADS)
            .with_min_chunk(4096)
            .plan();
        let bad = 5;
        let shared = Shared {
            chunks: &plan.chunks,
            ranges: &[],
            numa: Numa::Ignore,
            cursor: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            first: Mutex::new(None),
        };
        let f = |c: &Chunk| {
            let i = plan.chunks.iter().position(|p| p == c).unwrap();
            if i == bad {
                return Err(i);
            }
            if i > bad {
                // Hold every chunk after the bad one until the failure is seen: each other
                // worker is then inside at most one chunk, which it may finish.
                let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
                while !shared.stop.load(Ordering::Acquire) {
                    assert!(
                        std::time::Instant::now() < until,
                        "the failure was never seen"
                    );
                    std::thread::yield_now();
                }
            }
            Ok(())
        };
        let done: Vec<Done> = std::thread::scope(|s| {
            let workers: Vec<_> = (0..THREADS)
                .map(|_| s.spawn(|| shared.work(&f, &[])))
                .collect();
            workers.into_iter().map(|w| w.join().unwrap()).collect()
        });
        let mut all = Done::default();
        for d in done {
            all.merge(d);
        }
        assert_eq!(all.failed, vec![plan.chunks[bad]]);
        let after = all
            .completed
            .iter()
            .filter(|c| plan.chunks.iter().position(|p| p == *c).unwrap() > bad)
            .count();
        assert_eq!(
            all.completed.len() - after,
            bad,
            "a chunk before the failure was lost"
        );
        assert!(
            after < THREADS,
            "{after} chunks after the failure were finished"
        );
        assert_eq!(
            shared.first.into_inner().unwrap().map(|(e, _)| e),
            Some(bad)
        );
    }

    #[test]
    fn run_uses_several_threads_when_asked() {
        let ids = Mutex::new(std::collections::HashSet::new());
        let s = Job::new(64 << 20)
            .with_max_threads(3)
            .with_min_chunk(1 << 20)
            .run::<(), _>(|_| {
                ids.lock().unwrap().insert(std::thread::current().id());
                std::thread::yield_now();
                Ok(())
            })
            .unwrap();
        assert_eq!(s.threads, 3);
        assert!(ids.into_inner().unwrap().len() <= 3);
    }

    #[test]
    fn run_numa_affine_moves_workers_and_restores_caller() {
        let Some(node0) = node_cpus(&crate::host::numa_nodes(), 0) else {
            eprintln!("skipped: no NUMA node 0 in sysfs");
            return;
        };
        let before = sys::sched_getaffinity().unwrap().cpus();
        // Narrow the caller first, so a restore is visible.
        sys::sched_setaffinity(&sys::CpuSet::from_cpus([before[0]])).unwrap();
        let job = Job::over(vec![JobRange {
            node: Some(0),
            ..JobRange::new(0, 8 << 20)
        }])
        .unwrap()
        .with_max_threads(2)
        .with_min_chunk(1 << 20)
        .with_numa(Numa::Affine);
        let seen = Mutex::new(Vec::new());
        job.run::<(), _>(|_| {
            seen.lock()
                .unwrap()
                .push(sys::sched_getaffinity().unwrap().cpus());
            Ok(())
        })
        .unwrap();
        assert_eq!(sys::sched_getaffinity().unwrap().cpus(), vec![before[0]]);
        sys::sched_setaffinity(&sys::CpuSet::from_cpus(before)).unwrap();
        for cpus in seen.into_inner().unwrap() {
            assert_eq!(cpus, node0.cpus());
        }
    }

    #[test]
    fn over_overflowing_range_is_refused() {
        let e = Job::over(vec![JobRange::new(u64::MAX, 2)]).unwrap_err();
        assert!(matches!(e, JobError::RangeOverflow { index: 0, .. }), "{e}");
    }
}
