//! Starting a lazy restore: the userfaultfd opened and the regions registered (our own
//! memory) or taken as a peer sent them (a page server's), the handler and prefetch threads
//! started, and a start that fails undone.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Instant;

use linux_raw_sys::general as uapi;

use super::place::{alias, LRegion};
use super::{
    Blocks, Counters, Handlers, HostSpan, Lazy, LazyRestore, Outcome, Readahead, Signals, Start,
    ThreadCounts, Times, EMPTY,
};
use crate::layout::Backing;
use crate::region::Region;
use crate::restore::latency::ClassHistograms;
use crate::restore::{Prefetch, RestoreConfig};
use crate::snapshot::Ahead;
use crate::snapshot::{Image, SnapshotError};
use crate::uffd::{RegisterMode, Uffd};

impl LazyRestore {
    pub(in crate::restore) fn start(
        image: &Image,
        regions: Vec<Arc<Region>>,
        cfg: &RestoreConfig,
        t0: Instant,
    ) -> Result<LazyRestore, SnapshotError> {
        let uerr = |op: &str| {
            let op = op.to_string();
            move |source| SnapshotError::Userfaultfd { op, source }
        };
        let want = uapi::UFFD_FEATURE_MISSING_SHMEM
            | uapi::UFFD_FEATURE_MISSING_HUGETLBFS
            | uapi::UFFD_FEATURE_MINOR_SHMEM
            | uapi::UFFD_FEATURE_MINOR_HUGETLBFS
            | uapi::UFFD_FEATURE_POISON
            | uapi::UFFD_FEATURE_MOVE;
        let uffd = Uffd::open(u64::from(want)).map_err(uerr(
            "open (needs CAP_SYS_PTRACE, or vm.unprivileged_userfaultfd = 1, to see KVM's faults)",
        ))?;
        let mut lregions = Vec::with_capacity(regions.len());
        for (r, ir) in regions.iter().zip(image.regions()) {
            let (shared, feature) = match r.backing() {
                Backing::Anonymous => (false, 0),
                Backing::Memfd => (true, uapi::UFFD_FEATURE_MINOR_SHMEM),
                Backing::Hugetlb(_) => (true, uapi::UFFD_FEATURE_MINOR_HUGETLBFS),
                b => {
                    return Err(SnapshotError::LazyBacking {
                        region: r.guest_addr().0,
                        backing: b.name(),
                    })
                }
            };
            if shared && !uffd.has(feature) {
                return Err(SnapshotError::Userfaultfd {
                    op: format!(
                        "region at {:#x} ({}): the kernel offers no minor faults for it",
                        r.guest_addr().0,
                        r.backing().name()
                    ),
                    source: std::io::Error::from_raw_os_error(libc::EOPNOTSUPP),
                });
            }
            let alias = if shared { Some(alias(r)?) } else { None };
            lregions.push(LRegion::own(r.clone(), alias, ir.first_block));
        }
        let mut registered = Vec::new();
        for lr in &lregions {
            let region = lr.region().expect("our own regions");
            let mode = if lr.alias().is_some() {
                RegisterMode::MissingMinor
            } else {
                RegisterMode::Missing
            };
            if let Err(e) = uffd.register(region.mapping(), mode) {
                for m in registered {
                    let _ = uffd.unregister(m);
                }
                return Err(SnapshotError::Userfaultfd {
                    op: format!(
                        "register region at {:#x} ({:#x} bytes)",
                        region.guest_addr().0,
                        region.size()
                    ),
                    source: e,
                });
            }
            registered.push(region.mapping());
        }
        let first = match cfg.prefetch {
            Prefetch::WorkingSet => Some(image.working_set().to_vec()),
            Prefetch::None => None,
        };
        let threads = Threads {
            handlers: Handlers::Own(cfg.handler_threads),
            prefetch: cfg.threads,
        };
        let from = Origin {
            t0,
            start: Start::Fresh,
        };
        LazyRestore::launch(image, lregions, uffd, from, threads, first)
            .map_err(uerr("spawn a handler or prefetch thread"))
    }

    /// Builds the engine over `lregions` (registered with `uffd`) and starts its handlers,
    /// and with `first` a prefetch that brings in `first`'s blocks first (a plan for the
    /// pool, or threads of its own). Undoes what started if a thread cannot be spawned.
    pub(super) fn launch(
        image: &Image,
        lregions: Vec<LRegion>,
        uffd: Uffd,
        from: Origin,
        threads: Threads,
        first: Option<Vec<u64>>,
    ) -> std::io::Result<LazyRestore> {
        let Origin { t0, start } = from;
        let own_handlers = match threads.handlers {
            Handlers::Own(n) => n.max(1),
            Handlers::Pool => 0,
        };
        let mut by_host: Vec<HostSpan> = lregions
            .iter()
            .enumerate()
            .map(|(i, l)| HostSpan {
                start: l.host,
                end: l.host + l.size,
                region: i,
            })
            .collect();
        by_host.sort_unstable();
        let total = image.total_blocks();
        let stop = crate::sys::eventfd()?;
        let changed = crate::sys::eventfd()?;
        let lazy = Arc::new(Lazy {
            image: image.clone(),
            regions: lregions,
            by_host,
            uffd,
            signals: Signals { stop, changed },
            blocks: Blocks {
                state: (0..total).map(|_| AtomicU8::new(EMPTY)).collect(),
                done: AtomicU64::new(0),
                total,
                wait: Mutex::new(()),
                cv: Condvar::new(),
            },
            outcome: Outcome {
                failed: AtomicBool::new(false),
                cancel: AtomicBool::new(false),
                gone: AtomicBool::new(false),
                let_go: AtomicBool::new(false),
                error: Mutex::new(None),
                message: OnceLock::new(),
                hooks: Mutex::new(Vec::new()),
            },
            times: Times {
                t0,
                complete_at: OnceLock::new(),
                first_fault: OnceLock::new(),
            },
            counters: Counters::default(),
            recorded: Mutex::new(Vec::new()),
            pending: Mutex::new(Vec::new()),
            resumed: start == Start::Resumed,
            latency: ClassHistograms::default(),
            readahead: Readahead {
                fault_next: AtomicU64::new(u64::MAX),
                ahead: AtomicU64::new(u64::MAX),
                asked: AtomicU64::new(0),
                staged: AtomicU64::new(0),
                order: OnceLock::new(),
                cursor: AtomicU64::new(0),
                first: AtomicU64::new(0),
            },
            regain: Mutex::new(None),
            removed_log: std::sync::OnceLock::new(),
        });
        let mut this = LazyRestore {
            lazy: lazy.clone(),
            handlers: Vec::new(),
            prefetcher: None,
            counts: ThreadCounts {
                handlers: own_handlers,
                prefetch: threads.prefetch.max(1),
                working_set: 0,
            },
            finished: false,
            regaining: None,
        };
        let started = (|| {
            for i in 0..own_handlers {
                let l = lazy.clone();
                let h = std::thread::Builder::new()
                    .name(format!("guestmem-uffd{i}"))
                    .spawn(move || l.handle())?;
                this.handlers.push(h);
            }
            if let Some(first) = first {
                this.counts.working_set = first.len();
                // Memory read from elsewhere (object storage): the whole working set is asked
                // for at once, so its fetches run in parallel from the start (bounded by the
                // source), ahead of the prefetch that installs it block by block.
                lazy.image.ahead(first.iter().copied(), Ahead::Wanted);
                if threads.handlers == Handlers::Pool {
                    // No thread of its own: the pool prefetches between faults.
                    let order = lazy.plan(&first);
                    // The blocks of `first` that lead the order: each once, and only those
                    // of this restore (a working set may name a block twice, or past the end).
                    let mut named: Vec<u64> = first
                        .iter()
                        .copied()
                        .filter(|&b| b < lazy.blocks.total)
                        .collect();
                    named.sort_unstable();
                    named.dedup();
                    let in_first = named.len() as u64;
                    lazy.readahead
                        .first
                        .store(in_first, std::sync::atomic::Ordering::Release);
                    let _ = lazy.readahead.order.set(order);
                } else {
                    this.start_prefetch(first)?;
                }
            }
            Ok(())
        })();
        if let Err(e) = started {
            this.abort_start();
            return Err(e);
        }
        Ok(this)
    }

    /// Serves another process's memory: `regions` registered there with `uffd`, which that
    /// process sent, filled from `image` (whose regions are these, in this order), its
    /// faults read by a pool. Nothing is registered here; the peer owns the registration.
    pub(super) fn start_remote(
        image: &Image,
        regions: &[super::PeerRange],
        uffd: Uffd,
        working_set: Option<Vec<u64>>,
        start: Start,
    ) -> std::io::Result<LazyRestore> {
        let mut lregions: Vec<LRegion> = regions
            .iter()
            .zip(image.regions())
            .map(|(r, ir)| LRegion::remote(r.host, r.size, r.page, ir.first_block))
            .collect();
        let mut at = 0;
        for r in &mut lregions {
            r.removed_at = at;
            at += r.removed.len();
        }
        let threads = Threads {
            handlers: Handlers::Pool,
            prefetch: 0,
        };
        let from = Origin {
            t0: Instant::now(),
            start,
        };
        let this = LazyRestore::launch(image, lregions, uffd, from, threads, working_set)?;
        if start == Start::Resumed {
            // Threads that faulted while no server read their messages (or whose messages
            // died with the last server) wait in the kernel: woken, they touch the page
            // again and fault anew, to this server.
            for lr in &this.lazy.regions {
                let _ = this.lazy.uffd.wake(lr.target(), 0, lr.size as usize);
            }
        }
        Ok(this)
    }

    /// Undoes a start that could not spawn its threads: stops what did start and unregisters
    /// the memory. The caller gets the error, and with `restore_into` a map that the
    /// prefetch may have partly filled (with the image's data; the rest reads as fresh
    /// memory), which it should drop.
    pub(super) fn abort_start(&mut self) {
        self.halt();
        let l = self.lazy.clone();
        for r in l.regions.iter().filter_map(LRegion::region) {
            // The prefetch may have filled part of it: not whole, not to be saved.
            r.lifecycle.restore.lose();
            let _ = l.uffd.unregister(r.mapping());
        }
        self.finished = true;
    }

    pub(super) fn start_prefetch(&mut self, first: Vec<u64>) -> std::io::Result<()> {
        let l = self.lazy.clone();
        let threads = self.counts.prefetch;
        self.prefetcher = Some(
            std::thread::Builder::new()
                .name("guestmem-prefetch".into())
                .spawn(move || l.prefetch(&first, threads))?,
        );
        Ok(())
    }
}

/// Who serves a restore's faults and prefetches it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Threads {
    /// Handlers of its own, or a pool's.
    pub(super) handlers: Handlers,
    /// Prefetch threads of its own (with handlers of its own).
    pub(super) prefetch: usize,
}

/// When a restore started, and what its memory held then.
#[derive(Debug, Clone, Copy)]
pub(super) struct Origin {
    pub(super) t0: Instant,
    pub(super) start: Start,
}
