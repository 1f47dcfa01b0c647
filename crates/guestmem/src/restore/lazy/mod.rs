//! Lazy restore: userfaultfd, parallel handlers, background prefetch.
//!
//! Every region is registered with one userfaultfd, and each image block has one state
//! (empty, busy, done, failed) changed by compare-and-swap: whoever moves a block from empty
//! to busy (a handler serving a fault in it, or a prefetch worker) reads it, checks its
//! checksum and installs it whole, so a page is copied exactly once whoever gets there first.
//! A fault on a busy block needs nothing: the ioctl that installs the block wakes every thread
//! waiting inside it. A fault on a block already done (the message raced the install) is
//! answered with `UFFDIO_WAKE`.
//!
//! - Private anonymous regions: the block is read into a per-thread staging buffer, checked,
//!   and placed with `UFFDIO_COPY` (a zero block with `UFFDIO_ZEROPAGE`). The kernel installs
//!   4 KiB pages, collapsed back to huge pages a second after the restore is complete
//!   (`regain`).
//!   Blocks of whole 2 MiB pages in memory advised `MADV_HUGEPAGE` are read into a staging
//!   buffer on huge pages and moved in whole with `UFFDIO_MOVE` instead: huge from the start
//!   (`moved.rs` says where and why).
//! - memfd and hugetlb regions: registered for missing and minor faults; the block is read
//!   into the page cache through a second, unregistered mapping of the same file (a zero block
//!   with `fallocate`), then mapped with `UFFDIO_CONTINUE`. Blocks are whole huge pages, so
//!   hugetlb regions are served in whole huge pages.
//!
//! Prefetch runs on the job splitter: the recorded working set's runs first, in recorded
//! order, then the rest in address order.
//!
//! # Failure
//!
//! A checksum mismatch, a short file or an I/O error while filling a block stops the
//! restore: the first error is kept (it names the region, guest address and file offset),
//! the failed block is poisoned (`UFFDIO_POISON`) at once, then every
//! [`LazyRestore::on_failure`] hook runs with its text on a thread of its own (a VMM stops
//! its vCPUs there; a hook that blocks holds up no handler and no [`LazyRestore::finish`]),
//! prefetch stops, and [`LazyRestore::finish`] returns the error; the other blocks not in are
//! poisoned then. A poisoned page reads as lost memory, never as a zero page standing in for
//! missing data: a thread touching it gets `SIGBUS` (with `si_code` `BUS_ADRERR` on Linux
//! 6.18, as the test `a_hook_that_reads_the_failed_block_does_not_hang_finish` checks), a
//! kernel read of it (`process_vm_readv`, `/proc/PID/mem`) fails with `EFAULT`, and a vCPU
//! touching it leaves `KVM_RUN` with `EINTR` and a `SIGBUS` that KVM sends it, which a VMM
//! handles as QEMU and Firecracker do hardware memory errors. Measured on this machine's
//! nested KVM: a signal alone does not take a vCPU out of a fault it waits on (KVM retries
//! the fault with the signal pending), the poisoned page does. Should the kernel lack
//! `UFFDIO_POISON` (before Linux 6.6), the descriptor is kept open instead: such accesses
//! wait forever rather than read zeros.
//!
//! Each region's restore state ([`super::RestoreState`]) is `Restoring` from the start until
//! [`LazyRestore::finish`] makes it `Whole` (every block in) or `Lost` (the restore failed):
//! populate, bring-up and save refuse it meanwhile.

use std::cell::RefCell;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Instant;

use super::latency::{ClassHistograms, ExactLatency, FaultLatency};
use super::regain::{self, Regaining};
use crate::mmap::Mapping;
use crate::snapshot::{Image, SnapshotError};
use crate::uffd::Uffd;

mod fill;
mod moved;
mod place;
mod prefetch;
mod remote;
mod removed_log;
mod serve;
mod start;

pub(crate) use fill::{staging_oversized, trim_staging, STAGING_IDLE};
#[cfg(feature = "store")]
pub(crate) use prefetch::is_prefetcher;
pub(crate) use remote::{as_prefetcher, PeerRange, Pooled, RemoteRestore};

use place::{LRegion, Place};

const EMPTY: u8 = 0;
const BUSY: u8 = 1;
const DONE: u8 = 2;
const FAILED: u8 = 3;

/// How long a handler waits in `poll`: for ever (-1). Idle means blocked: the stop
/// eventfd wakes it when it must go.
const POLL_MS: i32 = -1;

/// Who reads a restore's faults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Handlers {
    /// Threads of its own, blocking in `poll` on its userfaultfd (at least one).
    Own(usize),
    /// None of its own: a shared pool reads its userfaultfd when epoll says it is ready
    /// ([`Pooled`]), as the page server's fleet does.
    Pool,
}

/// What a lazy restore did (so far, or in all).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct LazyReport {
    /// Fault messages read: each one a thread (a vCPU, or the VMM) that waited on a handler.
    pub faults: u64,
    /// Blocks a handler brought in for a fault.
    pub fault_blocks: u64,
    /// Faults on a block another thread was bringing in (woken when it landed).
    pub faults_on_busy: u64,
    /// Faults on a block already in (the message raced its install; answered with a wake).
    pub faults_late: u64,
    /// Blocks the prefetch brought in.
    pub prefetched_blocks: u64,
    /// Blocks that were zero (mapped without reading).
    pub zero_blocks: u64,
    /// Bytes read from the image and installed.
    pub bytes_copied: u64,
    /// Of those, bytes of blocks moved in with `UFFDIO_MOVE` rather than copied: pages read
    /// into a staging buffer on transparent huge pages move whole and stay huge (in-process
    /// restores of anonymous memory advised `MADV_HUGEPAGE`, blocks of whole 2 MiB pages,
    /// Linux 6.16 and later).
    pub bytes_moved: u64,
    /// Blocks in all.
    pub blocks: u64,
    /// From the start of the restore until every block was in, seconds.
    pub complete_secs: Option<f64>,
    /// From the start of the restore until the first fault was read, seconds.
    pub first_fault_secs: Option<f64>,
    /// Handler threads.
    pub handler_threads: usize,
    /// Prefetch threads.
    pub prefetch_threads: usize,
    /// Blocks in the recorded working set this restore prefetched first.
    pub prefetched_working_set: usize,
    /// Remove events read (a remote peer's `MADV_DONTNEED`, a balloon inflating).
    pub removes: u64,
    /// How long faults took to answer, from reading the message to the install, by class.
    pub fault_latency: FaultLatency,
    /// The latest faults whose block came from the file (at most 4,096; the class `file`
    /// of `fault_latency`), their quantiles as measured, which a bucket's width (up to 19%)
    /// does not blur. Quantiles of several restores do not add up: `fault_latency` does.
    pub file_fault_exact: ExactLatency,
    /// The huge pages brought back once every block was in, if that has ended (see
    /// [`LazyRestore::regaining`]).
    pub regain: Option<regain::RegainReport>,
}

#[derive(Default)]
struct Counters {
    faults: AtomicU64,
    fault_blocks: AtomicU64,
    busy: AtomicU64,
    late: AtomicU64,
    prefetched: AtomicU64,
    zero: AtomicU64,
    bytes: AtomicU64,
    moved: AtomicU64,
    removes: AtomicU64,
}

type Hook = Box<dyn Fn(&str) + Send + Sync>;

/// One restore's engine, shared by its handler, prefetch and pool threads.
struct Lazy {
    image: Image,
    regions: Vec<LRegion>,
    /// The regions by host address, sorted: where a fault's address is.
    by_host: Vec<HostSpan>,
    uffd: Uffd,
    signals: Signals,
    blocks: Blocks,
    outcome: Outcome,
    times: Times,
    counters: Counters,
    /// How long each fault took to answer, by class.
    latency: ClassHistograms,
    /// The blocks the guest faulted, first fault first (its working set).
    recorded: Mutex<Vec<u64>>,
    /// Faults read while a fill waited for the sender's address space to settle, served
    /// next by whichever handler or prefetch worker gets there.
    pending: Mutex<Vec<u64>>,
    /// Serving memory a previous server already partly filled: a page found present is
    /// skipped, not an error.
    resumed: bool,
    readahead: Readahead,
    /// The huge-page collapse to queue once every block is in.
    regain: Mutex<Option<regain::Job>>,
    /// Where a remote restore's removed pages are kept for a later server (see
    /// `removed_log.rs`).
    removed_log: std::sync::OnceLock<std::fs::File>,
}

/// A region's host range, and its index in `Lazy::regions`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct HostSpan {
    start: u64,
    end: u64,
    region: usize,
}

/// The eventfds a restore's threads and its owner wait on.
struct Signals {
    /// Stops the handler threads.
    stop: OwnedFd,
    /// Made readable when the restore fails or its peer goes (what a page server waits on).
    changed: OwnedFd,
}

/// Every block's state, and how many are in: `wait`/`cv` wake whoever waits for all of them.
struct Blocks {
    state: Box<[AtomicU8]>,
    done: AtomicU64,
    total: u64,
    wait: Mutex<()>,
    cv: Condvar,
}

/// How the restore is ending, if it is: failed (the first error and its text, and the hooks
/// to run with it), cancelled, or its peer gone.
struct Outcome {
    failed: AtomicBool,
    cancel: AtomicBool,
    /// A remote restore's peer has gone (its address space with it).
    gone: AtomicBool,
    /// A remote restore's peer hung up and runs on: a fill that finds its memory unmapped
    /// means it let go of it (the peer gone), not a failure.
    let_go: AtomicBool,
    error: Mutex<Option<SnapshotError>>,
    message: OnceLock<String>,
    hooks: Mutex<Vec<Hook>>,
}

/// When the restore started, every block was in, and the first fault was read.
struct Times {
    t0: Instant,
    complete_at: OnceLock<Instant>,
    first_fault: OnceLock<Instant>,
}

/// Where the prefetch goes: after the guest's stream, then its planned order.
struct Readahead {
    /// The block after the latest fault's (`u64::MAX` before the first): where the guest
    /// reads next if it reads in a stream.
    fault_next: AtomicU64,
    /// The next block the prefetch follows the guest's stream with (see `Lazy::follow`).
    ahead: AtomicU64,
    /// For memory read from elsewhere: the end of the window of blocks the follow last asked
    /// to be fetched (`Image::ahead`), so that a stream asks for each block once, not a
    /// window's worth of lookups per block.
    asked: AtomicU64,
    /// The same for the shorter window of blocks asked to be read into memory ahead of
    /// their fills (`Image::stage`).
    staged: AtomicU64,
    /// For a restore whose faults a pool serves: the order its prefetch goes in, a step at a
    /// time on the pool's threads (see `Lazy::prefetch_step`), and how far it has got.
    order: OnceLock<Vec<u64>>,
    cursor: AtomicU64,
    /// How many blocks at the front of `order` are the recorded working set.
    first: AtomicU64,
}

/// What the memory a restore fills holds when it starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Start {
    /// Fresh: no page is present before its block is filled (one that is, is an error).
    Fresh,
    /// Taken over from a server that died: any page may be present already (it is never
    /// overwritten; only the missing ones are filled).
    Resumed,
}

/// A lazy restore in progress: the map is usable at once (a touch of a page not yet in waits
/// for its block); dropping it, or [`LazyRestore::finish`], brings in whatever is left and
/// unregisters the memory.
pub struct LazyRestore {
    lazy: Arc<Lazy>,
    handlers: Vec<JoinHandle<()>>,
    prefetcher: Option<JoinHandle<()>>,
    counts: ThreadCounts,
    finished: bool,
    regaining: Option<Regaining>,
}

/// The threads a restore was started with, as its report gives them.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ThreadCounts {
    /// Handler threads of its own (0 when a pool reads its faults).
    pub(crate) handlers: usize,
    /// Prefetch threads of its own.
    pub(crate) prefetch: usize,
    /// Blocks in the working set it prefetches first.
    pub(crate) working_set: usize,
}

impl Lazy {
    /// What it did so far; `counts` as the owner started it.
    fn report(&self, counts: ThreadCounts) -> LazyReport {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let since = |t: &OnceLock<Instant>| {
            t.get()
                .map(|t| t.saturating_duration_since(self.times.t0).as_secs_f64())
        };
        LazyReport {
            faults: get(&c.faults),
            fault_blocks: get(&c.fault_blocks),
            faults_on_busy: get(&c.busy),
            faults_late: get(&c.late),
            prefetched_blocks: get(&c.prefetched),
            zero_blocks: get(&c.zero),
            bytes_copied: get(&c.bytes),
            bytes_moved: get(&c.moved),
            blocks: self.blocks.total,
            complete_secs: since(&self.times.complete_at),
            first_fault_secs: since(&self.times.first_fault),
            handler_threads: counts.handlers,
            prefetch_threads: counts.prefetch,
            prefetched_working_set: counts.working_set,
            removes: get(&c.removes),
            fault_latency: self.latency.summary(),
            file_fault_exact: self.latency.file_exact(),
            regain: None,
        }
    }
}

impl std::fmt::Debug for LazyRestore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LazyRestore")
            .field("blocks", &self.lazy.blocks.total)
            .field("done", &self.lazy.blocks.done.load(Ordering::Relaxed))
            .field("failed", &self.lazy.outcome.message.get())
            .finish()
    }
}

thread_local! {
    /// A worker's staging buffer: one block, page-aligned, faulted in once.
    static STAGING: RefCell<Option<Mapping>> = const { RefCell::new(None) };
    /// A worker's scratch for an incremental save's block.
    static SCRATCH: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
}

impl LazyRestore {
    /// Queues `job` (a huge-page collapse) the moment every block is in: now, if they are.
    pub(crate) fn regain_when_complete(&mut self, job: regain::Job, handle: Regaining) {
        let l = &self.lazy;
        let mut slot = l.regain.lock().unwrap_or_else(|e| e.into_inner());
        if l.outcome.failed.load(Ordering::Acquire) {
            drop(job);
        } else if l.blocks.done.load(Ordering::Acquire) == l.blocks.total {
            drop(slot);
            job.queue();
        } else {
            *slot = Some(job);
        }
        self.regaining = Some(handle);
    }

    /// The huge-page collapse this restore queues once complete, if there is one: what it
    /// did, or [`Regaining::wait`] for it.
    pub fn regaining(&self) -> Option<&Regaining> {
        self.regaining.as_ref()
    }

    /// Its userfaultfd.
    pub(crate) fn uffd_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.lazy.uffd.fd()
    }

    /// The fault side, for a shared pool (see [`Handlers::Pool`]).
    pub(crate) fn pooled(&self) -> Pooled {
        Pooled {
            lazy: self.lazy.clone(),
            counts: self.counts,
        }
    }

    /// Stops at once, leaving what is not in: prefetch cancelled, handlers stopped. For a
    /// remote restore whose peer has gone, or that is told to stop.
    pub(crate) fn halt(&mut self) -> LazyReport {
        let l = self.lazy.clone();
        l.outcome.cancel.store(true, Ordering::Release);
        // Not complete now, it never will be: no collapse. One queued already stops after
        // the chunk it is on (the memory is no longer this restore's to change).
        drop(l.regain.lock().unwrap_or_else(|e| e.into_inner()).take());
        if let Some(r) = &self.regaining {
            r.stop();
        }
        let _ = crate::sys::eventfd_signal(l.signals.stop.as_fd());
        if let Some(p) = self.prefetcher.take() {
            let _ = p.join();
        }
        for h in self.handlers.drain(..) {
            let _ = h.join();
        }
        self.finished = true;
        self.report()
    }

    /// The first error, once the restore has failed (taken: a second call gets `None`).
    pub(crate) fn take_error(&self) -> Option<SnapshotError> {
        self.lazy
            .outcome
            .error
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }

    /// Runs `hook` with the error's text when the restore fails (at once, on this thread, if
    /// it has): where a VMM stops its vCPUs. Hooks run on a thread of their own after the
    /// failed block is poisoned, so one that touches that block gets `SIGBUS` (or `EFAULT`
    /// through the kernel) rather than a wait, and one that blocks holds up nothing else.
    pub fn on_failure(&self, hook: impl Fn(&str) + Send + Sync + 'static) {
        let mut hooks = self
            .lazy
            .outcome
            .hooks
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(m) = self.lazy.outcome.message.get() {
            drop(hooks);
            hook(m);
            return;
        }
        hooks.push(Box::new(hook));
    }

    /// The first error's text, once the restore has failed.
    pub fn failure(&self) -> Option<String> {
        self.lazy.outcome.message.get().cloned()
    }

    /// Blocks in, of all.
    pub fn progress(&self) -> crate::Progress {
        crate::Progress {
            done: self.lazy.blocks.done.load(Ordering::Acquire),
            total: self.lazy.blocks.total,
        }
    }

    /// Waits until every block is in (`Ok`) or the restore has failed (the error's text).
    /// Without prefetch, only the guest's faults bring blocks in.
    pub fn wait_complete(&self) -> Result<(), String> {
        let l = &self.lazy;
        let mut g = l.blocks.wait.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(m) = l.outcome.message.get() {
                return Err(m.clone());
            }
            if l.blocks.done.load(Ordering::Acquire) == l.blocks.total {
                return Ok(());
            }
            g = l.blocks.cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// The blocks the guest faulted, first fault first (for [`Image::record_working_set`]).
    pub fn working_set(&self) -> Vec<u64> {
        self.lazy
            .recorded
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// What it did so far.
    pub fn report(&self) -> LazyReport {
        let mut r = self.lazy.report(self.counts);
        r.regain = self.regaining.as_ref().and_then(Regaining::report);
        r
    }

    /// Brings in every block not in yet, stops the handlers and unregisters the memory.
    /// Returns what the restore did, or its first error (the memory that never arrived is
    /// then poisoned: see the module docs).
    pub fn finish(mut self) -> Result<LazyReport, SnapshotError> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> Result<LazyReport, SnapshotError> {
        if self.finished {
            return Err(SnapshotError::FinishedAlready);
        }
        self.finished = true;
        let l = self.lazy.clone();
        if !l.outcome.failed.load(Ordering::Acquire) && self.prefetcher.is_none() {
            if let Err(e) = self.start_prefetch(Vec::new()) {
                l.fail(SnapshotError::Userfaultfd {
                    op: "spawn the prefetch thread".into(),
                    source: e,
                });
            }
        }
        if let Some(p) = self.prefetcher.take() {
            let _ = p.join();
        }
        let _ = self.wait_complete();
        let _ = crate::sys::eventfd_signal(l.signals.stop.as_fd());
        for h in self.handlers.drain(..) {
            let _ = h.join();
        }
        let report = self.report();
        if l.outcome.failed.load(Ordering::Acquire) {
            let poisoned = l.poison_rest();
            for r in l.regions.iter().filter_map(LRegion::region) {
                if poisoned {
                    let _ = l.uffd.unregister(r.mapping());
                }
            }
            if !poisoned {
                // No poison: keep the registration (and the descriptor) for good, so a touch
                // of missing memory waits instead of reading a zero page.
                std::mem::forget(Arc::clone(&l));
            }
            for r in l.regions.iter().filter_map(LRegion::region) {
                r.lifecycle.restore.lose();
            }
            let e = l
                .outcome
                .error
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take();
            return Err(e.unwrap_or(SnapshotError::AlreadyReported));
        }
        for r in l.regions.iter().filter_map(LRegion::region) {
            r.lifecycle.restore.complete();
            l.uffd
                .unregister(r.mapping())
                .map_err(|source| SnapshotError::Userfaultfd {
                    op: format!("unregister region at {:#x}", r.guest_addr().0),
                    source,
                })?;
        }
        Ok(report)
    }
}

impl Drop for LazyRestore {
    fn drop(&mut self) {
        if !self.finished {
            let _ = self.shutdown();
        }
    }
}
