//! The lazy restore's engine: handler threads reading faults, block fills, prefetch and
//! failure. What a block fill does per backing, and what failure does, is in the parent
//! module's docs.

use std::os::fd::AsFd;
use std::sync::atomic::Ordering;
use std::time::Instant;

use linux_raw_sys::general as uapi;

use super::{HostSpan, LRegion, Lazy, Place, BUSY, DONE, EMPTY, FAILED, POLL_MS};
use crate::restore::latency::FaultClass;
use crate::snapshot::SnapshotError;
use crate::uffd::Event;

impl Lazy {
    /// A handler thread: read faults, serve them, until told to stop.
    pub(super) fn handle(&self) {
        let mut events = Vec::new();
        loop {
            match self
                .uffd
                .read_events(&self.signals.stop, POLL_MS, &mut events, &|s, e| {
                    self.remove(s, e)
                }) {
                Ok(true) => {}
                Ok(false) => return,
                Err(e) => {
                    self.fail(SnapshotError::Userfaultfd {
                        op: "read fault messages".into(),
                        source: e,
                    });
                    return;
                }
            }
            self.dispatch(&events);
        }
    }

    /// Serves the faults one read brought (its removes were applied as it read them); then
    /// the faults queued meanwhile.
    pub(super) fn dispatch(&self, events: &[Event]) {
        // What a fault's read puts off (a fetched frame handed to the cache's writers)
        // waits until every fault here is installed.
        let _batch = crate::batch::batch();
        for ev in events {
            match *ev {
                Event::Fault { addr, .. } => {
                    self.counters.faults.fetch_add(1, Ordering::Relaxed);
                    let t = Instant::now();
                    let _ = self.times.first_fault.set(t);
                    let class = self.fault(addr);
                    self.latency.record(class, t.elapsed());
                }
                // Applied as they were read (`Uffd::read_events`).
                Event::Remove { .. } | Event::Other(_) => {}
            }
        }
        self.serve_pending();
    }

    /// Called when a copy finds the sender's address space changing (`EAGAIN`): an event
    /// (a remove) waits to be read before the kernel lets the copy go on, and this thread
    /// may be the only reader. Reads what is pending: removes are applied at once, faults
    /// queued for [`Lazy::serve_pending`].
    pub(super) fn drain(&self) {
        let mut events = Vec::new();
        if self
            .uffd
            .read_events(&self.signals.stop, 0, &mut events, &|s, e| {
                self.remove(s, e)
            })
            .is_ok()
        {
            for ev in events {
                match ev {
                    Event::Fault { addr, .. } => {
                        self.counters.faults.fetch_add(1, Ordering::Relaxed);
                        self.pending
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .push(addr);
                    }
                    // Applied as they were read.
                    Event::Remove { .. } | Event::Other(_) => {}
                }
            }
        }
        if self.uffd.reading_stopped() {
            // The events are another server's to read now (a hand-off): the copy waits
            // for that one, without a spin.
            std::thread::sleep(std::time::Duration::from_millis(1));
        } else {
            std::thread::yield_now();
        }
    }

    /// Serves the faults [`Lazy::drain`] queued.
    pub(super) fn serve_pending(&self) {
        loop {
            let next = self.pending.lock().unwrap_or_else(|e| e.into_inner()).pop();
            match next {
                Some(addr) => {
                    let t = Instant::now();
                    let class = self.fault(addr);
                    self.latency.record(class, t.elapsed());
                }
                None => return,
            }
        }
    }

    /// The peer removed `start..end` (`MADV_DONTNEED` or `MADV_REMOVE`, a balloon's
    /// inflation): those pages read as zero from now on, whether their block is in already
    /// (the next fault there gets a zero page) or not (its fill leaves them zero).
    pub(super) fn remove(&self, start: u64, end: u64) {
        self.counters.removes.fetch_add(1, Ordering::Relaxed);
        let first = self.by_host.partition_point(|h| h.end <= start);
        for &HostSpan {
            start: s,
            end: e,
            region: ri,
        } in &self.by_host[first..]
        {
            if s >= end {
                break;
            }
            let lr = &self.regions[ri];
            if lr.removed.is_empty() {
                continue;
            }
            let from = (start.max(s) - s) / lr.page;
            let to = (end.min(e) - s).div_ceil(lr.page);
            for p in from..to {
                lr.removed[(p / 64) as usize].fetch_or(1 << (p % 64), Ordering::AcqRel);
            }
            self.log_removed(lr, from, to);
        }
    }

    /// A fault on a block already in: the message raced the block's install, or the owner
    /// dropped the page since. Maps the page (a zero page for private memory, the page
    /// cache's for shared) if it is missing, and wakes the thread either way.
    fn late(&self, lr: &LRegion, off: u64) {
        self.counters.late.fetch_add(1, Ordering::Relaxed);
        let page = lr.page as usize;
        let at = off as usize / page * page;
        let t = lr.target();
        let _ = match lr.alias() {
            None => self.zero_pages(lr, at, page),
            Some(_) => self.uffd.continue_range(t, at, page, page).or_else(|_| {
                let fo = lr
                    .region()
                    .and_then(|r| r.file_offset())
                    .expect("a shared region has its file");
                crate::sys::fallocate(fo.file().as_fd(), fo.start() + at as u64, page as u64)
                    .and_then(|()| self.uffd.continue_range(t, at, page, page))
            }),
        };
        let _ = self.uffd.wake(t, at, page);
    }

    fn locate(&self, addr: u64) -> Option<(usize, u64)> {
        let i = self.by_host.partition_point(|h| h.start <= addr);
        let &HostSpan {
            start: s,
            end: e,
            region: ri,
        } = self.by_host.get(i.checked_sub(1)?)?;
        (addr < e).then_some((ri, addr - s))
    }

    fn fault(&self, addr: u64) -> FaultClass {
        let Some((ri, off)) = self.locate(addr) else {
            if self.remote() {
                // The peer registered memory it did not declare: nobody can serve it.
                self.fail(SnapshotError::PeerFaultOutside { addr });
            }
            return FaultClass::Error;
        };
        let lr = &self.regions[ri];
        let block = lr.first_block + off / self.image.block_bytes();
        // The prefetch follows from here while this fault is served.
        self.readahead
            .fault_next
            .store(block + 1, Ordering::Release);
        self.readahead.ahead.store(block + 1, Ordering::Release);
        match self.claim(block) {
            Ok(()) => {
                self.recorded
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(block);
                self.counters.fault_blocks.fetch_add(1, Ordering::Relaxed);
                match self.serve(block) {
                    Some(true) => FaultClass::Zero,
                    Some(false) => FaultClass::File,
                    None => FaultClass::Error,
                }
            }
            Err(DONE) => {
                // The message raced the block's install, or the owner dropped the page since
                // (MADV_DONTNEED, a balloon): private memory then reads as zero, shared
                // memory as its page cache holds it. Either way the page is mapped (or is
                // already) and the thread woken.
                self.late(lr, off);
                FaultClass::Present
            }
            Err(BUSY) => {
                self.counters.busy.fetch_add(1, Ordering::SeqCst);
                // The block may have landed since the claim failed, its fill's wakes all
                // done before this fault was raised (a page the peer removed after it was
                // copied): then it is served as late. Else its filler wakes the block once
                // in (see `serve`: one of the two sees the other).
                if self.blocks.state[block as usize].load(Ordering::SeqCst) == DONE {
                    self.late(lr, off);
                    return FaultClass::Present;
                }
                FaultClass::InFlight
            }
            Err(_) => FaultClass::Error,
        }
    }

    /// Whether this engine serves another process's memory.
    fn remote(&self) -> bool {
        self.regions
            .first()
            .is_some_and(|r| matches!(r.place, Place::Remote(_)))
    }

    pub(super) fn claim(&self, block: u64) -> Result<(), u8> {
        self.blocks.state[block as usize]
            .compare_exchange(EMPTY, BUSY, Ordering::AcqRel, Ordering::Acquire)
            .map(|_| ())
    }

    /// Fills a claimed block and marks it done, or fails the restore. Whether it was a zero
    /// block, or `None` when it could not be filled.
    pub(super) fn serve(&self, block: u64) -> Option<bool> {
        let busy = self.counters.busy.load(Ordering::SeqCst);
        match self.fill(block) {
            Ok(()) => {
                self.blocks.state[block as usize].store(DONE, Ordering::SeqCst);
                if self.counters.busy.load(Ordering::SeqCst) != busy {
                    // A thread faulted on this block while it was filled, perhaps on a page
                    // the fill had copied and woken already and the peer removed since: wake
                    // the block, and it faults again (to a late zero page) or reads on.
                    let (ri, offset, len) = self.image.block_span(block);
                    let lr = &self.regions[ri];
                    let _ = self.uffd.wake(lr.target(), offset as usize, len as usize);
                }
                let n = self.blocks.done.fetch_add(1, Ordering::AcqRel) + 1;
                if n == self.blocks.total {
                    let _ = self.times.complete_at.set(Instant::now());
                    {
                        let _g = self.blocks.wait.lock().unwrap_or_else(|e| e.into_inner());
                        self.blocks.cv.notify_all();
                    }
                    let job = self.regain.lock().unwrap_or_else(|e| e.into_inner()).take();
                    if let Some(job) = job {
                        job.queue();
                    }
                }
                Some(!self.image.held_from(block, 0))
            }
            Err(e) if stopped(&e) => {
                // The VM is being handed to another server: the block is left (a hand-off
                // not taken wakes every range, and its faults come again).
                self.blocks.state[block as usize].store(EMPTY, Ordering::Release);
                None
            }
            Err(e)
                if self.remote()
                    && (peer_gone(&e)
                        || (self.outcome.let_go.load(Ordering::Acquire) && unmapped(&e))) =>
            {
                // The peer's address space is gone (it exited), or a peer that hung up and
                // runs on unmapped its memory (it let go of it): nothing is left to serve.
                self.blocks.state[block as usize].store(FAILED, Ordering::Release);
                self.outcome.gone.store(true, Ordering::Release);
                self.outcome.cancel.store(true, Ordering::Release);
                {
                    let _g = self.blocks.wait.lock().unwrap_or_else(|e| e.into_inner());
                    self.blocks.cv.notify_all();
                }
                let _ = crate::sys::eventfd_signal(self.signals.changed.as_fd());
                None
            }
            Err(e) => {
                self.blocks.state[block as usize].store(FAILED, Ordering::Release);
                let e = if self.remote() {
                    self.for_peer(block, e)
                } else {
                    e
                };
                // Release the threads waiting in this block first: a vCPU's KVM_RUN then
                // reports the lost memory (SIGBUS, EINTR) instead of retrying the fault for
                // ever, and a hook that touches the block gets SIGBUS, not a wait.
                self.poison_block(block);
                self.fail(e);
                None
            }
        }
    }

    /// Restates an error of a remote block in the peer's terms: host addresses, the
    /// memory-file offset, and what a userfaultfd errno means for a page server.
    fn for_peer(&self, block: u64, e: SnapshotError) -> SnapshotError {
        let (ri, offset, _) = self.image.block_span(block);
        let lr = &self.regions[ri];
        let file_offset = self.image.regions()[ri].file_offset + offset;
        let what = match &e {
            SnapshotError::Memory { op, source, .. } => {
                format!("{op}: {source}{}", uffd_hint(source.raw_os_error()))
            }
            SnapshotError::Io {
                op,
                path,
                offset,
                source,
                ..
            } => {
                format!("{op} at offset {offset:#x} of {}: {source}", path.display())
            }
            SnapshotError::Truncated {
                path,
                offset,
                file_len,
                ..
            } => format!(
                "offset {offset:#x} of {} is past its end: it is only {file_len:#x} bytes \
                 (truncated since the server started)",
                path.display()
            ),
            other => other.to_string(),
        };
        SnapshotError::Peer {
            region: lr.host,
            host_addr: lr.host + offset,
            file_offset,
            what,
        }
    }

    /// Records the first failure, wakes waiters and runs the hooks on a thread of their own
    /// (a hook that blocks, on guest memory or anything else, holds up no handler and no
    /// [`super::LazyRestore::finish`]); later failures are dropped.
    pub(super) fn fail(&self, e: SnapshotError) {
        if self.outcome.failed.swap(true, Ordering::AcqRel) {
            return;
        }
        let text = e.to_string();
        *self.outcome.error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
        // No collapse of memory that will not be whole.
        drop(self.regain.lock().unwrap_or_else(|p| p.into_inner()).take());
        let hooks = {
            let mut h = self.outcome.hooks.lock().unwrap_or_else(|p| p.into_inner());
            let _ = self.outcome.message.set(text.clone());
            std::mem::take(&mut *h)
        };
        {
            let _g = self.blocks.wait.lock().unwrap_or_else(|p| p.into_inner());
            self.blocks.cv.notify_all();
        }
        let _ = crate::sys::eventfd_signal(self.signals.changed.as_fd());
        if hooks.is_empty() {
            return;
        }
        let run = move || {
            for hook in hooks {
                // One panicking hook must not keep the others from running.
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| hook(&text)));
            }
        };
        let spawned = std::thread::Builder::new()
            .name("guestmem-onfail".into())
            .spawn(run);
        if let Err(e) = spawned {
            // No thread to be had: nothing to do but say so (running them here could block
            // this handler on the memory it serves).
            eprintln!("guestmem: lazy restore failure hooks not run: cannot spawn a thread: {e}");
        }
    }

    /// Poisons one block (see the module docs). Returns false when the kernel cannot.
    fn poison_block(&self, block: u64) -> bool {
        if !self.uffd.has(uapi::UFFD_FEATURE_POISON) {
            return false;
        }
        let (ri, offset, len) = self.image.block_span(block);
        let lr = &self.regions[ri];
        self.uffd
            .poison(lr.target(), offset as usize, len as usize, lr.page as usize)
            .is_ok()
    }

    /// Poisons every block not in. Returns false when the kernel cannot.
    pub(super) fn poison_rest(&self) -> bool {
        let mut all = true;
        for b in 0..self.blocks.total {
            if self.blocks.state[b as usize].load(Ordering::Acquire) != DONE {
                all &= self.poison_block(b);
            }
        }
        all
    }
}

/// What a userfaultfd call's errno means when serving a peer.
fn uffd_hint(errno: Option<i32>) -> &'static str {
    match errno {
        Some(libc::ENOENT) => {
            " (the peer unmapped or moved this memory while it was served: no VMA is there)"
        }
        Some(libc::EINVAL) => {
            " (the range is not registered with this userfaultfd, or not aligned to its page \
             size: the handshake does not match the peer's registration)"
        }
        Some(libc::ESRCH) => " (the peer's address space is gone: it exited)",
        Some(libc::ENOMEM) => " (the kernel could not allocate the pages)",
        _ => "",
    }
}

/// Whether a fill found no VMA where it went (`ENOENT`: the peer unmapped the memory).
fn unmapped(e: &SnapshotError) -> bool {
    matches!(e, SnapshotError::Memory { source, .. } if source.raw_os_error() == Some(libc::ENOENT))
}

/// Whether a fill failed because the peer's address space is gone (`ESRCH`: the process
/// that registered the memory exited).
fn peer_gone(e: &SnapshotError) -> bool {
    matches!(e, SnapshotError::Memory { source, .. } if source.raw_os_error() == Some(libc::ESRCH))
}

/// Whether a fill stopped because this process reads the VM's userfaultfd no more (it is
/// being handed over).
fn stopped(e: &SnapshotError) -> bool {
    matches!(e, SnapshotError::Memory { source, .. } if crate::uffd::ReadingStopped::is(source))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn userfaultfd_errnos_are_explained_for_a_page_server() {
        assert!(uffd_hint(Some(libc::ENOENT)).contains("unmapped or moved"));
        assert!(uffd_hint(Some(libc::EINVAL)).contains("not registered"));
        assert!(uffd_hint(Some(libc::ESRCH)).contains("exited"));
        assert_eq!(uffd_hint(Some(libc::EIO)), "");
        assert_eq!(uffd_hint(None), "");
    }
}
