//! The engine's side for a page server: a restore's faults read by a shared pool of
//! threads ([`Pooled`]), and graduation (every block in, then the peer's ranges
//! unregistered).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::place::Place;
use super::{Lazy, LazyReport, LazyRestore};
use crate::snapshot::SnapshotError;

/// A restore's fault side, for a shared pool of threads: its userfaultfd to watch, and a
/// call that reads and serves one batch of what is pending. Holding it keeps the engine
/// (and the descriptor) alive.
#[derive(Clone)]
pub(crate) struct Pooled(pub(super) Arc<Lazy>, pub(super) (usize, usize, usize));

impl Pooled {
    /// The userfaultfd to watch (non-blocking: Firecracker opens it with `O_NONBLOCK`).
    pub(crate) fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.0.uffd.fd()
    }

    /// Reads at most one batch of pending messages into `events` without waiting (another
    /// pool thread may have taken them: then none).
    pub(crate) fn read(&self, events: &mut Vec<crate::uffd::Event>) {
        if let Err(e) = self.0.uffd.read_events(&self.0.stop, 0, events) {
            self.0.fail(SnapshotError::Userfaultfd {
                op: "read fault messages".into(),
                source: e,
            });
        }
    }

    /// Serves what [`Pooled::read`] read, then any faults queued meanwhile.
    pub(crate) fn serve(&self, events: &[crate::uffd::Event]) {
        self.0.dispatch(events);
    }

    /// Fails the restore: its userfaultfd reports an error to epoll.
    pub(crate) fn fail_descriptor(&self) {
        self.0.fail(SnapshotError::Userfaultfd {
            op: "wait for fault messages".into(),
            source: std::io::Error::other(
                "the userfaultfd reports an error (its O_NONBLOCK flag was cleared by another \
                 holder, or it is no longer valid)",
            ),
        });
    }

    /// What the restore did so far.
    pub(crate) fn report(&self) -> LazyReport {
        self.0.report(self.1)
    }

    /// Whether the pool prefetches it, a step at a time between faults.
    pub(crate) fn wants_prefetch(&self) -> bool {
        self.0.order.get().is_some()
    }

    /// One step of its prefetch (one block, following the guest's latest fault first);
    /// false when nothing is left to bring in.
    pub(crate) fn prefetch_step(&self) -> bool {
        self.0.prefetch_step()
    }

    /// Whether it has failed, lost its peer or been stopped: nothing more to serve.
    pub(crate) fn over(&self) -> bool {
        self.0.failed.load(Ordering::Acquire) || self.0.cancel.load(Ordering::Acquire)
    }
}

impl LazyRestore {
    /// Detaches a remote restore's peer from the server ("graduation"): brings in every block
    /// not in yet (the recorded working set's prefetch goes on, or a prefetch of the rest
    /// starts), waits until all are in, and only then unregisters the peer's ranges from the
    /// userfaultfd, so the peer depends on neither this server nor the memory file. A peer
    /// that goes, or a failure, stops it: nothing is unregistered then (a failed block is
    /// poisoned, never left to read as zero). Faults must go on being served meanwhile (by
    /// the handlers, or the pool).
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
            let mut g = l.wait.lock().unwrap_or_else(|e| e.into_inner());
            while l.done.load(Ordering::Acquire) != l.total
                && !l.failed.load(Ordering::Acquire)
                && !l.cancel.load(Ordering::Acquire)
            {
                g = l.cv.wait(g).unwrap_or_else(|e| e.into_inner());
            }
        }
        if l.done.load(Ordering::Acquire) != l.total {
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
