//! The lazy restore's engine: handler threads reading faults, block fills, prefetch and
//! failure. What a block fill does per backing, and what failure does, is in the parent
//! module's docs.

use std::os::fd::AsFd;
use std::sync::atomic::Ordering;
use std::time::Instant;

use linux_raw_sys::general as uapi;

use super::{LRegion, Lazy, Place, BUSY, DONE, EMPTY, FAILED, POLL_MS, SCRATCH, STAGING};
use crate::mmap::{Advice, Mapping};
use crate::restore::latency::FaultClass;
use crate::snapshot::SnapshotError;
use crate::uffd::Event;

/// A block being filled: where it is in its region, and whether it reads as zero.
#[derive(Clone, Copy)]
struct BlockAt<'a> {
    block: u64,
    lr: &'a LRegion,
    /// Offset in the region, bytes.
    off: usize,
    /// Length, bytes.
    n: usize,
    /// No save holds any of it.
    zero: bool,
}

impl BlockAt<'_> {
    /// An error of `op` on this block's memory.
    fn mem_err(&self, op: &'static str) -> impl FnOnce(std::io::Error) -> SnapshotError {
        let (region, guest_addr) = (self.lr.name, self.lr.name + self.off as u64);
        move |source| SnapshotError::Memory {
            region,
            guest_addr,
            op,
            source,
        }
    }

    /// A page of a block nobody had filled was there already, `copied` bytes in: something
    /// else wrote this memory behind the restore's back.
    fn present_before(&self, copied: usize) -> SnapshotError {
        SnapshotError::Memory {
            region: self.lr.name,
            guest_addr: self.lr.name + (self.off + copied) as u64,
            op: "UFFDIO_COPY (a page was present before its block was restored)",
            source: std::io::Error::from_raw_os_error(libc::EEXIST),
        }
    }
}

impl Lazy {
    /// A handler thread: read faults, serve them, until told to stop.
    pub(super) fn handle(&self) {
        let mut events = Vec::new();
        loop {
            match self.uffd.read_events(&self.stop, POLL_MS, &mut events) {
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

    /// Serves what one read brought: faults, removes; then the faults queued meanwhile.
    pub(super) fn dispatch(&self, events: &[Event]) {
        for ev in events {
            match *ev {
                Event::Fault { addr, .. } => {
                    self.counters.faults.fetch_add(1, Ordering::Relaxed);
                    let t = Instant::now();
                    let _ = self.first_fault.set(t);
                    let class = self.fault(addr);
                    self.latency.record(class, t.elapsed());
                }
                Event::Remove { start, end } => self.remove(start, end),
                Event::Other(_) => {}
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
        if self.uffd.read_events(&self.stop, 0, &mut events).is_ok() {
            for ev in events {
                match ev {
                    Event::Fault { addr, .. } => {
                        self.counters.faults.fetch_add(1, Ordering::Relaxed);
                        self.pending
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .push(addr);
                    }
                    Event::Remove { start, end } => self.remove(start, end),
                    Event::Other(_) => {}
                }
            }
        }
        std::thread::yield_now();
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
    fn remove(&self, start: u64, end: u64) {
        self.counters.removes.fetch_add(1, Ordering::Relaxed);
        let first = self.by_host.partition_point(|&(_, e, _)| e <= start);
        for &(s, e, ri) in &self.by_host[first..] {
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
        let i = self.by_host.partition_point(|&(s, _, _)| s <= addr);
        let &(s, e, ri) = self.by_host.get(i.checked_sub(1)?)?;
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
        self.fault_next.store(block + 1, Ordering::Release);
        self.ahead.store(block + 1, Ordering::Release);
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
                if self.state[block as usize].load(Ordering::SeqCst) == DONE {
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

    /// Maps zero pages at `at..at + len` of a private region: `UFFDIO_ZEROPAGE` for 4 KiB
    /// pages; hugetlb has no zero-page call, so a zeroed staging buffer is copied there.
    fn zero_pages(&self, lr: &LRegion, at: usize, len: usize) -> std::io::Result<()> {
        if lr.page as usize <= crate::sys::base_page_size() as usize {
            return self.uffd.zeropage(lr.target(), at, len, &|| self.drain());
        }
        with_staging(
            len,
            |e| e,
            |staging| {
                // SAFETY: this thread's own staging mapping, at least len bytes, borrowed for
                // the copy only.
                unsafe { std::ptr::write_bytes(staging.as_ptr(), 0, len) };
                // SAFETY: as above; just written.
                let src = unsafe { std::slice::from_raw_parts(staging.as_ptr(), len) };
                self.uffd
                    .copy(lr.target(), at, src, &|| self.drain())
                    .map(|_| ())
            },
        )
    }

    /// For memory a dead server partly filled: copies `src` (zeros when `None`) into
    /// `off..off + n` of `lr`, page by page past any page already present (`EEXIST`: never
    /// overwritten).
    fn copy_missing(
        &self,
        lr: &LRegion,
        off: usize,
        src: Option<&[u8]>,
        n: usize,
    ) -> std::io::Result<()> {
        // The page size the peer declared is not trusted to step by: a present page is
        // skipped a base page at a time; memory of larger pages (hugetlb) refuses a copy
        // inside a page (EINVAL), and then the step goes on to the next declared page.
        let base = crate::sys::base_page_size() as usize;
        let page = lr.page as usize;
        let copy = |src: &[u8]| {
            let mut done = 0;
            while done < n {
                match self
                    .uffd
                    .copy(lr.target(), off + done, &src[done..n], &|| self.drain())
                {
                    Ok(k) => done += k,
                    Err(e)
                        if e.raw_os_error() == Some(libc::EINVAL)
                            && page > base
                            && !(off + done).is_multiple_of(page) =>
                    {
                        done = (off + done).next_multiple_of(page) - off;
                        continue;
                    }
                    Err(e) => return Err(e),
                }
                if done < n {
                    // A present page: skip it.
                    done += base;
                }
            }
            Ok(())
        };
        match src {
            Some(src) => copy(src),
            None => with_staging(
                n,
                |e| e,
                |staging| {
                    // SAFETY: this thread's own staging mapping, at least n bytes, borrowed for
                    // the copies only.
                    unsafe { std::ptr::write_bytes(staging.as_ptr(), 0, n) };
                    // SAFETY: as above; just written.
                    copy(unsafe { std::slice::from_raw_parts(staging.as_ptr(), n) })
                },
            ),
        }
    }

    pub(super) fn claim(&self, block: u64) -> Result<(), u8> {
        self.state[block as usize]
            .compare_exchange(EMPTY, BUSY, Ordering::AcqRel, Ordering::Acquire)
            .map(|_| ())
    }

    /// Fills a claimed block and marks it done, or fails the restore. Whether it was a zero
    /// block, or `None` when it could not be filled.
    pub(super) fn serve(&self, block: u64) -> Option<bool> {
        let busy = self.counters.busy.load(Ordering::SeqCst);
        match self.fill(block) {
            Ok(()) => {
                self.state[block as usize].store(DONE, Ordering::SeqCst);
                if self.counters.busy.load(Ordering::SeqCst) != busy {
                    // A thread faulted on this block while it was filled, perhaps on a page
                    // the fill had copied and woken already and the peer removed since: wake
                    // the block, and it faults again (to a late zero page) or reads on.
                    let (ri, offset, len) = self.image.block_span(block);
                    let lr = &self.regions[ri];
                    let _ = self.uffd.wake(lr.target(), offset as usize, len as usize);
                }
                let n = self.done.fetch_add(1, Ordering::AcqRel) + 1;
                if n == self.total {
                    let _ = self.complete_at.set(Instant::now());
                    {
                        let _g = self.wait.lock().unwrap_or_else(|e| e.into_inner());
                        self.cv.notify_all();
                    }
                    let job = self.regain.lock().unwrap_or_else(|e| e.into_inner()).take();
                    if let Some(job) = job {
                        job.queue();
                    }
                }
                Some(!self.image.held_from(block, 0))
            }
            Err(e) if self.remote() && peer_gone(&e) => {
                // The peer's address space is gone (it exited): nothing is left to serve.
                self.state[block as usize].store(FAILED, Ordering::Release);
                self.gone.store(true, Ordering::Release);
                self.cancel.store(true, Ordering::Release);
                {
                    let _g = self.wait.lock().unwrap_or_else(|e| e.into_inner());
                    self.cv.notify_all();
                }
                let _ = crate::sys::eventfd_signal(self.changed.as_fd());
                None
            }
            Err(e) => {
                self.state[block as usize].store(FAILED, Ordering::Release);
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

    /// Brings `block` in: a private region's through a staging copy and `UFFDIO_COPY`, a
    /// shared region's into its page cache and `UFFDIO_CONTINUE`; a zero block without
    /// reading anything.
    fn fill(&self, block: u64) -> Result<(), SnapshotError> {
        let (ri, offset, len) = self.image.block_span(block);
        let lr = &self.regions[ri];
        let at = BlockAt {
            block,
            lr,
            off: offset as usize,
            n: len as usize,
            zero: !self.image.held_from(block, 0),
        };
        match lr.alias() {
            None => self.fill_private(&at),
            Some(alias) => self.fill_shared(&at, alias),
        }
    }

    fn fill_private(&self, at: &BlockAt<'_>) -> Result<(), SnapshotError> {
        let BlockAt {
            block, lr, off, n, ..
        } = *at;
        if at.zero && self.resumed {
            self.copy_missing(lr, off, None, n)
                .map_err(at.mem_err("UFFDIO_COPY"))?;
            self.counters.zero.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        if at.zero {
            self.zero_pages(lr, off, n)
                .map_err(at.mem_err("UFFDIO_ZEROPAGE"))?;
            self.counters.zero.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        if !self.resumed && !self.any_removed(lr, off, n) {
            if let Some(src) = self.image.mapped_block(block) {
                // SAFETY: the image keeps its source mapping for as long as it lives, and
                // `self` holds the image.
                let copied =
                    unsafe { self.uffd.copy_from(lr.target(), off, src, &|| self.drain()) }
                        .map_err(|e| match e.raw_os_error() {
                            Some(libc::EFAULT) => self.image.mapped_copy_error(block, e),
                            _ => at.mem_err("UFFDIO_COPY")(e),
                        })?;
                self.image.release_mapped(block);
                if copied < n {
                    return Err(at.present_before(copied));
                }
                self.counters.bytes.fetch_add(n as u64, Ordering::Relaxed);
                return Ok(());
            }
        }
        if !self.resumed && self.movable(lr, off, n) {
            let err = |op, e| at.mem_err(op)(e);
            if let Some(placed) = self.fill_moved(block, lr, off, n, err)? {
                if placed < n {
                    return Err(at.present_before(placed));
                }
                self.counters.bytes.fetch_add(n as u64, Ordering::Relaxed);
                return Ok(());
            }
        }
        let scratch = SCRATCH.take();
        // Sized once per thread by the largest block the image holds (a block is cut at its
        // region's end), capped by the manifest's block-size limits.
        let bb = self.image.largest_block() as usize;
        with_staging(bb, at.mem_err("map a staging buffer"), |staging| {
            let mut scratch = scratch;
            // SAFETY: the staging mapping is this thread's own, at least a block long,
            // page-aligned, and nothing else touches it.
            unsafe {
                self.image
                    .read_block(block, staging.as_ptr(), false, &mut scratch)?
            };
            SCRATCH.set(scratch);
            self.zero_removed(lr, off, n, staging);
            // SAFETY: as above: the first n bytes of this thread's staging mapping, just
            // written, borrowed only for the copies below.
            let src = unsafe { std::slice::from_raw_parts(staging.as_ptr(), n) };
            if self.resumed {
                return self
                    .copy_missing(lr, off, Some(src), n)
                    .map_err(at.mem_err("UFFDIO_COPY"));
            }
            let copied = self
                .uffd
                .copy(lr.target(), off, src, &|| self.drain())
                .map_err(at.mem_err("UFFDIO_COPY"))?;
            if copied < n {
                return Err(at.present_before(copied));
            }
            Ok(())
        })?;
        self.counters.bytes.fetch_add(n as u64, Ordering::Relaxed);
        Ok(())
    }

    fn fill_shared(&self, at: &BlockAt<'_>, alias: &Mapping) -> Result<(), SnapshotError> {
        let BlockAt {
            block, lr, off, n, ..
        } = *at;
        let region = lr.region().expect("an alias belongs to our own region");
        if at.zero {
            let fo = region.file_offset().expect("a shared region has its file");
            crate::sys::fallocate(fo.file().as_fd(), fo.start() + off as u64, n as u64)
                .map_err(at.mem_err("fallocate"))?;
            self.counters.zero.fetch_add(1, Ordering::Relaxed);
        } else {
            let mut scratch = SCRATCH.take();
            // Only the thread that claimed the block writes it, and the registered mapping
            // maps none of it before the UFFDIO_CONTINUE below.
            // SAFETY: the block lies inside the alias (the region's length), aligned.
            let r = unsafe {
                self.image
                    .read_block(block, alias.as_ptr().add(off), false, &mut scratch)
            };
            SCRATCH.set(scratch);
            r?;
            self.counters.bytes.fetch_add(n as u64, Ordering::Relaxed);
        }
        self.uffd
            .continue_range(lr.target(), off, n, lr.page as usize)
            .map_err(at.mem_err("UFFDIO_CONTINUE"))?;
        Ok(())
    }

    /// Whether the peer has removed a page of `off..off + n` of `lr`.
    fn any_removed(&self, lr: &LRegion, off: usize, n: usize) -> bool {
        if lr.removed.is_empty() {
            return false;
        }
        let page = lr.page as usize;
        (off / page..(off + n).div_ceil(page))
            .any(|p| lr.removed[p / 64].load(Ordering::Acquire) >> (p % 64) & 1 != 0)
    }

    /// Zeroes, in a block's staging copy (`off..off + n` of `lr`), the pages the peer has
    /// removed: they must read as zero, not as the image holds them.
    fn zero_removed(&self, lr: &LRegion, off: usize, n: usize, staging: &Mapping) {
        if lr.removed.is_empty() {
            return;
        }
        let page = lr.page as usize;
        for p in off / page..(off + n).div_ceil(page) {
            if lr.removed[p / 64].load(Ordering::Acquire) >> (p % 64) & 1 != 0 {
                // SAFETY: page p of the block lies in the first n bytes of this thread's own
                // staging mapping, which nothing else touches.
                unsafe { std::ptr::write_bytes(staging.as_ptr().add(p * page - off), 0, page) };
            }
        }
    }

    /// Records the first failure, wakes waiters and runs the hooks on a thread of their own
    /// (a hook that blocks, on guest memory or anything else, holds up no handler and no
    /// [`super::LazyRestore::finish`]); later failures are dropped.
    pub(super) fn fail(&self, e: SnapshotError) {
        if self.failed.swap(true, Ordering::AcqRel) {
            return;
        }
        let text = e.to_string();
        *self.error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
        // No collapse of memory that will not be whole.
        drop(self.regain.lock().unwrap_or_else(|p| p.into_inner()).take());
        let hooks = {
            let mut h = self.hooks.lock().unwrap_or_else(|p| p.into_inner());
            let _ = self.message.set(text.clone());
            std::mem::take(&mut *h)
        };
        {
            let _g = self.wait.lock().unwrap_or_else(|p| p.into_inner());
            self.cv.notify_all();
        }
        let _ = crate::sys::eventfd_signal(self.changed.as_fd());
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
        for b in 0..self.total {
            if self.state[b as usize].load(Ordering::Acquire) != DONE {
                all &= self.poison_block(b);
            }
        }
        all
    }
}

/// Runs `f` with this thread's staging buffer, at least `len` bytes (mapped and faulted in
/// the first time a thread needs one).
fn with_staging<T, E>(
    len: usize,
    map_err: impl FnOnce(std::io::Error) -> E,
    f: impl FnOnce(&Mapping) -> Result<T, E>,
) -> Result<T, E> {
    STAGING.with(|cell| {
        let mut cell = cell.borrow_mut();
        if cell.as_ref().is_none_or(|m| m.len() < len) {
            let m = Mapping::anonymous(len).map_err(|e| map_err(e.into_io()))?;
            // Best effort: only saves the first copy's page faults.
            let _ = m.advise(0, len, Advice::PopulateWrite);
            *cell = Some(m);
        }
        f(cell.as_ref().expect("set above"))
    })
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

/// Whether a fill failed because the peer's address space is gone (`ESRCH`: the process
/// that registered the memory exited).
fn peer_gone(e: &SnapshotError) -> bool {
    matches!(e, SnapshotError::Memory { source, .. } if source.raw_os_error() == Some(libc::ESRCH))
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
