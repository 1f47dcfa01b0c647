//! Prefetch: the blocks a restore brings in before they are faulted. A plan (a recorded
//! working set in its order, then the rest in address order) run by threads of its own at a
//! lower priority, or a step at a time by a page server's pool between faults; and
//! read-ahead that follows the guest, the blocks just past its latest fault first.

use std::sync::atomic::Ordering;

use super::{Lazy, EMPTY};
use crate::jobs::{Job, JobRange};
use crate::snapshot::Ahead;

/// Nice value of prefetch threads: below the vCPUs, the VMM and the fault handlers, so
/// prefetch takes the CPU time they leave (a vCPU waiting on a fault leaves its CPU), and a
/// guest's start is not queued behind it.
const PREFETCH_NICE: libc::c_int = 5;

thread_local!(static PREFETCHER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) });

/// Whether this thread prefetches (it lowered its priority): its reads are not faults.
#[cfg(feature = "store")]
pub(crate) fn is_prefetcher() -> bool {
    PREFETCHER.with(|d| d.get())
}

/// Lowers the calling thread's priority to [`PREFETCH_NICE`], once per thread.
pub(super) fn lower_priority() {
    if !PREFETCHER.with(|d| d.replace(true)) {
        crate::sys::set_thread_nice(PREFETCH_NICE);
    }
}

/// For an image read from elsewhere (object storage), how many blocks past the one it is
/// bringing in a prefetch asks to be fetched in the background (`Image::ahead`): enough to
/// keep the GETs the store's read-ahead may have in flight busy (48, `FetchPolicy`; 64
/// frames of 256 KiB over a 20 ms first byte are up to 800 MiB/s; 16 held the lab's
/// working set to 110-120 MiB/s), few enough that what is
/// fetched stays close to what the prefetch order reaches. A recorded working set's window
/// ends where the working set does, so that nothing past it is fetched before it is in.
const AHEAD_BLOCKS: u64 = 64;

/// For an image read from elsewhere, how many blocks past the one it is bringing in a
/// prefetch asks to have read into memory, checked, on another thread (`Image::stage`: a
/// frame the host's cache holds), so that its own thread only installs them. Short, so that
/// they are still in the CPU's cache when installed, and few are read for nothing when the
/// guest jumps.
const STAGE_BLOCKS: u64 = 8;

/// How far past the guest's latest fault the prefetch reads ahead (see `Lazy::follow`).
const FOLLOW_BYTES: u64 = 32 << 20;

impl Lazy {
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
            lower_priority();
            let end = chunk.start + chunk.len;
            self.image.ahead(
                chunk.start..(chunk.start + AHEAD_BLOCKS).min(end),
                Ahead::Guessed,
            );
            for b in chunk.start..end {
                if b + AHEAD_BLOCKS < end {
                    self.image
                        .ahead(std::iter::once(b + AHEAD_BLOCKS), Ahead::Guessed);
                }
                if self.outcome.failed.load(Ordering::Acquire)
                    || self.outcome.cancel.load(Ordering::Acquire)
                {
                    return Err(());
                }
                if !self.image.is_remote() || first.is_empty() {
                    self.follow();
                }
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
        let mut seen = vec![false; self.blocks.total as usize];
        let mut order = Vec::with_capacity(self.blocks.total as usize);
        for &b in first {
            if b < self.blocks.total && !std::mem::replace(&mut seen[b as usize], true) {
                order.push(b);
            }
        }
        order.extend((0..self.blocks.total).filter(|&b| !seen[b as usize]));
        order
    }

    /// One step of a pool's prefetch for this restore: a block just past the guest's latest
    /// fault, else the next of its planned order not in yet. False once nothing is left to
    /// bring in (or the restore is over).
    pub(super) fn prefetch_step(&self) -> bool {
        if self.outcome.failed.load(Ordering::Acquire)
            || self.outcome.cancel.load(Ordering::Acquire)
        {
            return false;
        }
        // Memory read from elsewhere (object storage) is not followed while the recorded
        // working set is still being brought in: a window after each scattered fault would
        // cost GETs the working set is waiting behind (measured: 5x the working set's bytes
        // fetched before the VM had read it, with 256 KiB frames over 1 GiB).
        let in_first = self.readahead.cursor.load(Ordering::Acquire)
            < self.readahead.first.load(Ordering::Acquire);
        if !(self.image.is_remote() && in_first) && self.follow_one() {
            return true;
        }
        let Some(order) = self.readahead.order.get() else {
            return false;
        };
        loop {
            let i = self.readahead.cursor.fetch_add(1, Ordering::AcqRel) as usize;
            let Some(&b) = order.get(i) else {
                return false;
            };
            if self.image.is_remote() {
                let first = self.readahead.first.load(Ordering::Acquire) as usize;
                let end = if i < first { first } else { order.len() };
                let window = |w: u64| {
                    let from = if i == 0 || i == first {
                        i + 1
                    } else {
                        i + w as usize
                    };
                    let upto = (i + 1 + w as usize).min(end);
                    order.get(from..upto).unwrap_or(&[]).iter().copied()
                };
                self.image.ahead(window(AHEAD_BLOCKS), Ahead::Guessed);
                self.stage(window(STAGE_BLOCKS));
            }
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

    /// Asks for the window after block `h` (up to [`AHEAD_BLOCKS`], not past `limit`) to be
    /// fetched in the background: only its blocks the last window did not reach, so a guest
    /// reading in a stream asks for one new block a step. (Asking for the whole window each
    /// step cost a warm pass from the cache 64 cache lookups a frame: 8% of its prefetch
    /// thread.) A window that does not meet the last one (the guest jumped) is asked whole.
    /// The same for the shorter window of blocks to read into memory ([`STAGE_BLOCKS`]),
    /// of which only two are asked after a jump.
    fn ask_ahead(&self, h: u64, limit: u64) {
        // After a jump, `jumped` blocks; the whole window once the guest goes on.
        let new = |cursor: &std::sync::atomic::AtomicU64, window: u64, jumped: u64| {
            let full = limit.min(h.saturating_add(1 + window));
            let (mut from, mut upto) = (h + 1, full);
            let _ = cursor.fetch_update(Ordering::AcqRel, Ordering::Acquire, |last| {
                (from, upto) = match (h + 1..=full).contains(&last) {
                    true => (last, full),
                    false => (h + 1, limit.min(h.saturating_add(1 + jumped))),
                };
                Some(upto)
            });
            from..upto.max(from)
        };
        self.image.ahead(
            new(&self.readahead.asked, AHEAD_BLOCKS, AHEAD_BLOCKS),
            Ahead::Guessed,
        );
        // Staged after a jump: only the next two blocks, since a guest that faults at
        // random moves on before more are installed (a full window read 7 frames in 8 for
        // nothing while the lab's VM read its scattered working set).
        self.stage(new(&self.readahead.staged, STAGE_BLOCKS, 2));
    }

    /// Asks for those of `blocks` not brought in yet to be read into memory ahead of their
    /// fills (`Image::stage`): a block the guest's stream brought in already is not read
    /// again for a prefetch order that catches up with it.
    fn stage(&self, blocks: impl Iterator<Item = u64>) {
        self.image.stage(blocks.filter(|&b| {
            self.blocks
                .state
                .get(b as usize)
                .is_some_and(|s| s.load(Ordering::Acquire) == EMPTY)
        }));
    }

    /// One block of [`Lazy::follow`]: true when one was brought in (or found in already)
    /// and the stream may go on.
    pub(super) fn follow_one(&self) -> bool {
        let window = (FOLLOW_BYTES / self.image.block_bytes()).max(1);
        loop {
            let h = self.readahead.ahead.load(Ordering::Acquire);
            let limit = self
                .readahead
                .fault_next
                .load(Ordering::Acquire)
                .saturating_add(window);
            if h >= self.blocks.total || h >= limit {
                return false;
            }
            if self
                .readahead
                .ahead
                .compare_exchange(h, h + 1, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
            {
                continue;
            }
            if self.outcome.failed.load(Ordering::Acquire)
                || self.outcome.cancel.load(Ordering::Acquire)
            {
                return false;
            }
            if self.claim(h).is_ok() {
                if self.image.is_remote() {
                    self.ask_ahead(h, limit);
                }
                self.counters.prefetched.fetch_add(1, Ordering::Relaxed);
                self.serve(h);
                self.serve_pending();
                return true;
            }
        }
    }
}
