//! The lazy engine as the page server (`crate::serve`) reaches it: [`RemoteRestore`], the
//! whole of what the server may do with a restore of another process's memory, and
//! [`Pooled`], what the server's shared threads call to read and serve its faults and to
//! prefetch it.
//!
//! The page server never sees a block state, a handler or the image's layout: it starts a
//! restore over the ranges a VM sent ([`PeerRange`]), hands the pool its fault side, waits
//! on [`RemoteRestore::changed_fd`], and in the end graduates the VM or halts the restore.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::place::Place;
use super::{Lazy, LazyReport, LazyRestore, Start, ThreadCounts};
use crate::restore::regain::{Job, Memory, Regaining};
use crate::snapshot::{Image, SnapshotError};
use crate::uffd::Uffd;

/// A range of the peer's memory as its handshake declared it: the engine fills it from the
/// image region of the same index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PeerRange {
    /// Where it starts in the peer's address space.
    pub(crate) host: u64,
    /// Bytes.
    pub(crate) size: u64,
    /// Its page size, bytes.
    pub(crate) page: u64,
}

/// A restore of another process's memory, its faults read by a shared pool ([`Pooled`]).
#[derive(Debug)]
pub(crate) struct RemoteRestore(LazyRestore);

impl RemoteRestore {
    /// Starts serving `regions` (registered in the peer with `uffd`, which the peer sent)
    /// from `image`, whose regions are these in this order. With `working_set` (block
    /// numbers), the restore also has a prefetch plan (those blocks first, then the rest)
    /// that a pool's prefetch threads take a block at a time; without, only faults bring
    /// memory in. `start` says whether pages may be present already (a VM taken over from a
    /// server that died: present pages are left, waiting threads woken).
    pub(crate) fn start(
        image: &Image,
        regions: &[PeerRange],
        uffd: Uffd,
        working_set: Option<Vec<u64>>,
        start: Start,
    ) -> std::io::Result<RemoteRestore> {
        LazyRestore::start_remote(image, regions, uffd, working_set, start).map(RemoteRestore)
    }

    /// Queues a collapse of the peer's 4 KiB `ranges` (host addresses in the peer) back to
    /// transparent huge pages once every block is in, through `pidfd` (a duplicate the
    /// collapse keeps) of process `pid`; only chunks that hold the image's data.
    pub(crate) fn regain_when_complete(
        &mut self,
        pidfd: OwnedFd,
        pid: u32,
        ranges: Vec<(u64, u64)>,
    ) {
        let hosts: Vec<u64> = self.0.lazy.regions.iter().map(|r| r.host).collect();
        let data = self.0.lazy.image.data_spans(&hosts);
        let memory = Memory::Remote { pidfd, pid, ranges };
        let (job, handle) = Job::new(memory, None, data);
        self.0.regain_when_complete(job, handle);
    }

    /// Marks removed the pages a previous server's removed-pages file (or the memfd a
    /// hand-off sent) holds; returns how many. Before the first fault is served.
    pub(crate) fn load_removes(&self, file: &std::fs::File) -> std::io::Result<u64> {
        self.0.lazy.load_removes(file)
    }

    /// Keeps the peer's removed pages in `file` from now on (written whole first), for a
    /// server that takes the VM back (see `removed_log.rs`).
    pub(crate) fn log_removes_to(&self, file: std::fs::File) -> std::io::Result<()> {
        self.0.lazy.log_removes_to(file)
    }

    /// From now on reads nothing from the peer's userfaultfd, until
    /// [`RemoteRestore::resume_reading`]: the VM is being handed to another server, whose
    /// messages they are (see `Uffd::stop_reading`).
    pub(crate) fn stop_reading(&self) {
        self.0.lazy.uffd.stop_reading();
    }

    /// Reads again (a hand-off the new server did not take), and wakes every range: a
    /// fault whose block was left while reading had stopped comes again.
    pub(crate) fn resume_reading(&self) {
        let l = &self.0.lazy;
        l.uffd.resume_reading();
        for lr in &l.regions {
            let _ = l.uffd.wake(lr.target(), 0, lr.size as usize);
        }
    }

    /// The peer's removed pages in a memfd, as a removed-pages file holds them, for a
    /// server it is handed to; `None` when it removed none.
    pub(crate) fn removed_memfd(&self) -> std::io::Result<Option<OwnedFd>> {
        self.0.lazy.removed_memfd()
    }

    /// The collapse queued for when the restore completes, if any (to wait for its end).
    pub(crate) fn regaining(&self) -> Option<Regaining> {
        self.0.regaining().cloned()
    }

    /// The fault side, for the pool.
    pub(crate) fn pooled(&self) -> Pooled {
        self.0.pooled()
    }

    /// The peer's userfaultfd.
    pub(crate) fn uffd_fd(&self) -> BorrowedFd<'_> {
        self.0.uffd_fd()
    }

    /// Readable (and so it stays) once the restore has failed or lost its peer: what a
    /// server waits on beside the peer's socket.
    pub(crate) fn changed_fd(&self) -> BorrowedFd<'_> {
        self.0.lazy.signals.changed.as_fd()
    }

    /// From now on, a fill that finds the peer's memory unmapped ends the restore as a
    /// peer gone ([`RemoteRestore::peer_gone`]), not as a failure: a peer that hung up and
    /// runs on, and then unmapped its memory, let go of it.
    pub(crate) fn let_go_on_unmap(&self) {
        self.0.lazy.outcome.let_go.store(true, Ordering::Release);
    }

    /// Whether the peer's address space has gone (a fill found it gone).
    pub(crate) fn peer_gone(&self) -> bool {
        self.0.lazy.outcome.gone.load(Ordering::Acquire)
    }

    /// Whether serving has failed.
    pub(crate) fn has_failed(&self) -> bool {
        self.0.lazy.outcome.failed.load(Ordering::Acquire)
    }

    /// The blocks the peer faulted, first fault first.
    pub(crate) fn working_set(&self) -> Vec<u64> {
        self.0.working_set()
    }

    /// The first error, once failed (taken).
    pub(crate) fn take_error(&self) -> Option<SnapshotError> {
        self.0.take_error()
    }

    /// Detaches the peer (see [`LazyRestore::graduate`]).
    pub(crate) fn graduate(&mut self) -> Result<LazyReport, SnapshotError> {
        self.0.graduate()
    }

    /// Stops at once, leaving what is not in: prefetch and collapse stopped (see
    /// [`LazyRestore::halt`]).
    pub(crate) fn halt(&mut self) -> LazyReport {
        self.0.halt()
    }
}

/// A restore's fault side, for a shared pool of threads: its userfaultfd to watch, and a
/// call that reads and serves one batch of what is pending. Holding it keeps the engine
/// (and the descriptor) alive.
#[derive(Clone)]
pub(crate) struct Pooled {
    pub(super) lazy: Arc<Lazy>,
    pub(super) counts: ThreadCounts,
}

impl Pooled {
    /// The userfaultfd to watch (non-blocking: Firecracker opens it with `O_NONBLOCK`).
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.lazy.uffd.fd()
    }

    /// Reads at most one batch of pending messages into `events` without waiting (another
    /// pool thread may have taken them: then none).
    pub(crate) fn read(&self, events: &mut Vec<crate::uffd::Event>) {
        if let Err(e) = self
            .lazy
            .uffd
            .read_events(&self.lazy.signals.stop, 0, events, &|s, e| {
                self.lazy.remove(s, e)
            })
        {
            self.lazy.fail(SnapshotError::Userfaultfd {
                op: "read fault messages".into(),
                source: e,
            });
        }
    }

    /// Serves what [`Pooled::read`] read, then any faults queued meanwhile.
    pub(crate) fn serve(&self, events: &[crate::uffd::Event]) {
        self.lazy.dispatch(events);
    }

    /// Fails the restore: its userfaultfd reports an error to epoll.
    pub(crate) fn fail_descriptor(&self) {
        self.lazy.fail(SnapshotError::Userfaultfd {
            op: "wait for fault messages".into(),
            source: std::io::Error::other(
                "the userfaultfd reports an error (its O_NONBLOCK flag was cleared by another \
                 holder, or it is no longer valid)",
            ),
        });
    }

    /// What the restore did so far.
    pub(crate) fn report(&self) -> LazyReport {
        self.lazy.report(self.counts)
    }

    /// Whether it has a prefetch plan for the pool's prefetch threads.
    pub(crate) fn wants_prefetch(&self) -> bool {
        self.lazy.readahead.order.get().is_some()
    }

    /// One step of its prefetch (one block, following the guest's latest fault first);
    /// false when nothing is left to bring in.
    pub(crate) fn prefetch_step(&self) -> bool {
        self.lazy.prefetch_step()
    }

    /// Whether it has failed, lost its peer or been stopped: nothing more to serve.
    pub(crate) fn over(&self) -> bool {
        self.lazy.outcome.failed.load(Ordering::Acquire)
            || self.lazy.outcome.cancel.load(Ordering::Acquire)
    }
}

/// Lowers the calling thread to a prefetch thread's priority (below faults, vCPUs and the
/// VMM), as a pool's prefetch threads run.
pub(crate) fn as_prefetcher() {
    super::prefetch::lower_priority();
}

impl LazyRestore {
    /// Detaches a remote restore's peer from the server ("graduation"): brings in every block
    /// not in yet (the working set's prefetch goes on, or a prefetch of the rest starts),
    /// waits until all are in, and only then unregisters the peer's ranges from the
    /// userfaultfd, so the peer depends on neither this server nor the memory file. A peer
    /// that goes, or a failure, stops it: nothing is unregistered then (a failed block is
    /// poisoned, never left to read as zero). Faults must go on being served meanwhile (by
    /// the pool).
    pub(crate) fn graduate(&mut self) -> Result<LazyReport, SnapshotError> {
        let l = self.lazy.clone();
        if self.prefetcher.is_none() {
            self.start_prefetch(Vec::new())
                .map_err(|source| SnapshotError::Userfaultfd {
                    op: "spawn the prefetch thread".into(),
                    source,
                })?;
        }
        if let Some(p) = self.prefetcher.take() {
            let _ = p.join();
        }
        {
            let mut g = l.blocks.wait.lock().unwrap_or_else(|e| e.into_inner());
            while l.blocks.done.load(Ordering::Acquire) != l.blocks.total
                && !l.outcome.failed.load(Ordering::Acquire)
                && !l.outcome.cancel.load(Ordering::Acquire)
            {
                g = l.blocks.cv.wait(g).unwrap_or_else(|e| e.into_inner());
            }
        }
        if l.blocks.done.load(Ordering::Acquire) != l.blocks.total {
            self.halt();
            return Err(self.take_error().unwrap_or(SnapshotError::AlreadyReported));
        }
        for lr in &l.regions {
            if let Place::Remote(r) = &lr.place {
                l.uffd
                    .unregister_remote(r)
                    .map_err(|source| SnapshotError::Userfaultfd {
                        op: format!(
                            "unregister the peer's range at {:#x} ({:#x} bytes) after every \
                             block was in",
                            lr.host, lr.size
                        ),
                        source,
                    })?;
            }
        }
        Ok(self.halt())
    }
}
