//! Prefetch: the blocks a restore brings in before they are faulted. A plan (a recorded
//! working set in its order, then the rest in address order) run by threads of its own
//! under `SCHED_IDLE` (see [`PREFETCH_NICE`]), or a step at a time by a page server's pool
//! between faults; and
//! read-ahead that follows the guest, the blocks just past its latest fault first.

use std::cell::Cell;
use std::sync::atomic::Ordering;
use std::sync::OnceLock;

use super::Lazy;
use crate::jobs::{Job, JobRange};

/// The priority of prefetch threads: `SCHED_IDLE`, so that they take only CPU time nothing
/// else wants and give it up the moment a thread of the VMM or a vCPU wakes (a woken thread
/// preempts a `SCHED_IDLE` one at once). At nice 5, as they ran before, a woken thread still
/// queued behind them: traced here, Firecracker's `snapshot/load` thread, woken on the CPU a
/// prefetch thread was copying on, waited 4 ms there while the other CPU was idle, and a
/// load beside prefetch took a median 10.9 ms against 8.6 ms under `SCHED_IDLE` (20 rounds;
/// 8.2 ms with no prefetch at all).
///
/// A fault can wait on a prefetch thread (it fills the faulting block, or holds faults it
/// read while draining events): then [`Lazy::boost_prefetch`] puts the prefetch threads at
/// [`PREFETCH_NICE`] under `SCHED_OTHER` until each has finished the block it is on, so a
/// busy host cannot starve the block a vCPU waits for. Leaving `SCHED_IDLE` needs
/// `CAP_SYS_NICE` or an `RLIMIT_NICE` that allows [`PREFETCH_NICE`]; without either the
/// threads run at [`PREFETCH_NICE`] throughout.
const PREFETCH_NICE: libc::c_int = 5;

thread_local! {
    /// This prefetch thread's priority: `Unset` before its first block.
    static PRIORITY: Cell<Priority> = const { Cell::new(Priority::Unset) };
}

#[derive(Clone, Copy)]
enum Priority {
    Unset,
    /// At [`PREFETCH_NICE`] throughout.
    Nice,
    /// Under `SCHED_IDLE`, last lowered when the boost count was this.
    Idle(u64),
}

/// Whether this process may bring a thread at [`PREFETCH_NICE`] out of `SCHED_IDLE`:
/// `CAP_SYS_NICE`, or an `RLIMIT_NICE` of at least `20 - PREFETCH_NICE`. Read once.
fn may_boost() -> bool {
    static MAY: OnceLock<bool> = OnceLock::new();
    *MAY.get_or_init(|| {
        /// `CAP_SYS_NICE`'s bit in `CapEff`.
        const CAP_SYS_NICE: u32 = 23;
        let cap = std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| crate::host::read::parse_cap_eff(&s))
            .is_some_and(|c| c & (1 << CAP_SYS_NICE) != 0);
        let rlimit = crate::sys::nice_limit().is_ok_and(|l| l >= (20 - PREFETCH_NICE) as u64);
        cap || rlimit
    })
}

/// A prefetch thread inside a run of blocks: listed in `Lazy::prefetchers` while it is (so
/// a boost only ever names a live thread of this restore), unlisted on drop.
struct Prefetcher<'a> {
    lazy: &'a Lazy,
    tid: Option<libc::pid_t>,
}

impl Drop for Prefetcher<'_> {
    fn drop(&mut self) {
        if let Some(tid) = self.tid {
            let mut list = self
                .lazy
                .prefetchers
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            list.retain(|&t| t != tid);
        }
    }
}

impl Prefetcher<'_> {
    /// Before each block: lowers the thread again if it was boosted since it last looked;
    /// raises it for good once someone waits for the prefetch to end.
    fn lower_again(&self) {
        PRIORITY.with(|p| {
            let (Priority::Idle(seen), Some(tid)) = (p.get(), self.tid) else {
                return;
            };
            if self.lazy.hurry.load(Ordering::Acquire) {
                if crate::sys::set_policy(tid, crate::sys::Policy::Normal).is_ok() {
                    p.set(Priority::Nice);
                }
                return;
            }
            let now = self.lazy.boosts.load(Ordering::Acquire);
            if now != seen {
                let _ = crate::sys::set_policy(tid, crate::sys::Policy::Idle);
                p.set(Priority::Idle(now));
            }
        })
    }
}

/// How far past the guest's latest fault the prefetch reads ahead (see `Lazy::follow`).
const FOLLOW_BYTES: u64 = 32 << 20;

impl Lazy {
    /// Lowers the calling prefetch thread (see [`PREFETCH_NICE`]) the first time, and lists
    /// it for boosts while the returned guard lives.
    fn prefetcher(&self) -> Prefetcher<'_> {
        let tid = crate::sys::gettid();
        let idle = PRIORITY.with(|p| {
            if let Priority::Unset = p.get() {
                // Best effort: a failure leaves the thread where it was.
                let _ = crate::sys::set_nice(tid, PREFETCH_NICE);
                let idle = may_boost()
                    && !self.hurry.load(Ordering::Acquire)
                    && crate::sys::set_policy(tid, crate::sys::Policy::Idle).is_ok();
                p.set(match idle {
                    true => Priority::Idle(self.boosts.load(Ordering::Acquire)),
                    false => Priority::Nice,
                });
            }
            matches!(p.get(), Priority::Idle(_))
        });
        if !idle {
            return Prefetcher {
                lazy: self,
                tid: None,
            };
        }
        self.prefetchers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(tid);
        let me = Prefetcher {
            lazy: self,
            tid: Some(tid),
        };
        // A boost may have come while this thread was between runs, unlisted.
        me.lower_again();
        me
    }

    /// Lets every listed prefetch thread run at [`PREFETCH_NICE`] like any other thread
    /// until it has finished the block it is on: a fault is waiting on one of them.
    pub(super) fn boost_prefetch(&self) {
        let list = self.prefetchers.lock().unwrap_or_else(|e| e.into_inner());
        if list.is_empty() {
            return;
        }
        // Under the lock: a listed thread cannot unlist itself and exit meanwhile, so each
        // tid names a live prefetch thread of this restore.
        for &tid in list.iter() {
            let _ = crate::sys::set_policy(tid, crate::sys::Policy::Normal);
        }
        // After the boosts: a thread that sees the new count lowers itself again only once
        // it has been boosted, never before.
        self.boosts.fetch_add(1, Ordering::AcqRel);
    }

    /// Someone now waits for the prefetch to end: its threads run at [`PREFETCH_NICE`] from
    /// here on, so that a busy host cannot hold the waiter up behind them.
    pub(super) fn hurry_prefetch(&self) {
        self.hurry.store(true, Ordering::Release);
        self.boost_prefetch();
    }

    /// Prefetches `first` (runs of it, in its order), then every other block.
    pub(super) fn prefetch(&self, first: &[u64], threads: usize) {
        let mut ranges: Vec<JobRange> = Vec::new();
        for b in self.plan(first) {
            match ranges.last_mut() {
                Some(r) if r.start + r.len == b => r.len += 1,
                _ => ranges.push(JobRange::new(b, 1)),
            }
        }
        let job = Job::over(ranges)
            .expect("block ranges fit")
            .with_max_threads(threads);
        let _ = job.run(|chunk| {
            let me = self.prefetcher();
            for b in chunk.start..chunk.start + chunk.len {
                me.lower_again();
                if self.failed.load(Ordering::Acquire) || self.cancel.load(Ordering::Acquire) {
                    return Err(());
                }
                self.follow();
                if self.claim(b).is_ok() {
                    self.counters.prefetched.fetch_add(1, Ordering::Relaxed);
                    self.serve(b);
                }
                self.serve_pending();
            }
            Ok(())
        });
    }

    /// Every block once: those of `first` (a recorded working set) in its order, then the
    /// rest in address order.
    pub(super) fn plan(&self, first: &[u64]) -> Vec<u64> {
        let mut seen = vec![false; self.total as usize];
        let mut order = Vec::with_capacity(self.total as usize);
        for &b in first {
            if b < self.total && !std::mem::replace(&mut seen[b as usize], true) {
                order.push(b);
            }
        }
        order.extend((0..self.total).filter(|&b| !seen[b as usize]));
        order
    }

    /// One step of a pool's prefetch for this restore: a block just past the guest's latest
    /// fault, else the next of its planned order not in yet. False once nothing is left to
    /// bring in (or the restore is over).
    pub(super) fn prefetch_step(&self) -> bool {
        if self.failed.load(Ordering::Acquire) || self.cancel.load(Ordering::Acquire) {
            return false;
        }
        if self.follow_one() {
            return true;
        }
        let Some(order) = self.order.get() else {
            return false;
        };
        loop {
            let i = self.cursor.fetch_add(1, Ordering::AcqRel) as usize;
            let Some(&b) = order.get(i) else {
                return false;
            };
            if self.claim(b).is_ok() {
                self.counters.prefetched.fetch_add(1, Ordering::Relaxed);
                self.serve(b);
                self.serve_pending();
                return true;
            }
        }
    }

    /// Read-ahead that follows the guest: brings in, in order, the blocks just past its
    /// latest fault, up to [`FOLLOW_BYTES`] beyond it, before the planned order goes on. A
    /// guest that reads its memory in a stream (a boot, a scan, a checksum) then finds its
    /// next blocks in before it gets there, and faults once per window instead of once per
    /// block; one that reads at random loses a window of prefetch order, no more.
    pub(super) fn follow(&self) {
        while self.follow_one() {}
    }

    /// One block of [`Lazy::follow`]: true when one was brought in (or found in already)
    /// and the stream may go on.
    pub(super) fn follow_one(&self) -> bool {
        let window = (FOLLOW_BYTES / self.image.block_bytes()).max(1);
        loop {
            let h = self.ahead.load(Ordering::Acquire);
            let limit = self
                .fault_next
                .load(Ordering::Acquire)
                .saturating_add(window);
            if h >= self.total || h >= limit {
                return false;
            }
            if self
                .ahead
                .compare_exchange(h, h + 1, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
            {
                continue;
            }
            if self.failed.load(Ordering::Acquire) || self.cancel.load(Ordering::Acquire) {
                return false;
            }
            if self.claim(h).is_ok() {
                self.counters.prefetched.fetch_add(1, Ordering::Relaxed);
                self.serve(h);
                self.serve_pending();
                return true;
            }
        }
    }
}
