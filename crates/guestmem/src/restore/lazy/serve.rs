//! The lazy restore's engine: handler threads reading faults, block fills, prefetch and
//! failure. What a block fill does per backing, and what failure does, is in the parent
//! module's docs.

use std::os::fd::AsFd;
use std::sync::atomic::Ordering;
use std::time::Instant;

use linux_raw_sys::general as uapi;

use super::{Lazy, BUSY, DONE, EMPTY, FAILED, POLL_MS, SCRATCH, STAGING};
use crate::jobs::{Job, JobRange};
use crate::mmap::{Advice, Mapping};
use crate::snapshot::SnapshotError;
use crate::uffd::Event;

/// Nice value of prefetch threads: below the vCPUs, the VMM and the fault handlers, so
/// prefetch takes the CPU time they leave (a vCPU waiting on a fault leaves its CPU), and a
/// guest's start is not queued behind it.
const PREFETCH_NICE: libc::c_int = 5;

/// Lowers the calling thread's priority to [`PREFETCH_NICE`], once per thread.
fn lower_priority() {
    thread_local!(static DONE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) });
    if !DONE.with(|d| d.replace(true)) {
        // SAFETY: gettid takes nothing; setpriority on our own thread id touches no memory.
        // Best effort: a failure leaves the thread at its priority.
        unsafe {
            let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
            libc::setpriority(libc::PRIO_PROCESS, tid, PREFETCH_NICE);
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
            for ev in &events {
                if let Event::Fault { addr, .. } = *ev {
                    self.counters.faults.fetch_add(1, Ordering::Relaxed);
                    self.fault(addr);
                }
            }
        }
    }

    fn locate(&self, addr: u64) -> Option<(usize, u64)> {
        let i = self.by_host.partition_point(|&(s, _, _)| s <= addr);
        let &(s, e, ri) = self.by_host.get(i.checked_sub(1)?)?;
        (addr < e).then_some((ri, addr - s))
    }

    fn fault(&self, addr: u64) {
        let Some((ri, off)) = self.locate(addr) else {
            return;
        };
        let lr = &self.regions[ri];
        let block = lr.first_block + off / self.image.block_bytes();
        match self.claim(block) {
            Ok(()) => {
                self.recorded
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(block);
                self.counters.fault_blocks.fetch_add(1, Ordering::Relaxed);
                self.serve(block);
            }
            Err(DONE) => {
                // The message raced the block's install, or the owner dropped the page since
                // (MADV_DONTNEED, a balloon): private memory then reads as zero, shared
                // memory as its page cache holds it. Either way the page is mapped (or is
                // already) and the thread woken.
                self.counters.late.fetch_add(1, Ordering::Relaxed);
                let page = lr.region.page_size() as usize;
                let at = off as usize / page * page;
                let m = lr.region.mapping();
                let _ = match &lr.alias {
                    None => self.uffd.zeropage(m, at, page),
                    Some(_) => self.uffd.continue_range(m, at, page, page).or_else(|_| {
                        let fo = lr
                            .region
                            .file_offset()
                            .expect("a shared region has its file");
                        crate::sys::fallocate(
                            fo.file().as_fd(),
                            fo.start() + at as u64,
                            page as u64,
                        )
                        .and_then(|()| self.uffd.continue_range(m, at, page, page))
                    }),
                };
                let _ = self.uffd.wake(m, at, page);
            }
            Err(BUSY) => {
                self.counters.busy.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => {}
        }
    }

    fn claim(&self, block: u64) -> Result<(), u8> {
        self.state[block as usize]
            .compare_exchange(EMPTY, BUSY, Ordering::AcqRel, Ordering::Acquire)
            .map(|_| ())
    }

    /// Fills a claimed block and marks it done, or fails the restore.
    fn serve(&self, block: u64) {
        match self.fill(block) {
            Ok(()) => {
                self.state[block as usize].store(DONE, Ordering::Release);
                let n = self.done.fetch_add(1, Ordering::AcqRel) + 1;
                if n == self.total {
                    let _ = self.complete_at.set(Instant::now());
                    let _g = self.wait.lock().unwrap_or_else(|e| e.into_inner());
                    self.cv.notify_all();
                }
            }
            Err(e) => {
                self.state[block as usize].store(FAILED, Ordering::Release);
                self.fail(e);
                // Release the threads waiting in this block: a vCPU's KVM_RUN then reports
                // the lost memory (SIGBUS, EINTR) instead of retrying the fault for ever.
                self.poison_block(block);
            }
        }
    }

    fn fill(&self, block: u64) -> Result<(), SnapshotError> {
        let (ri, offset, len) = self.image.block_span(block);
        let lr = &self.regions[ri];
        let region = &lr.region;
        let guest_addr = region.guest_addr().0 + offset;
        let mem_err = |op: &'static str| {
            move |source| SnapshotError::Memory {
                region: region.guest_addr().0,
                guest_addr,
                op,
                source,
            }
        };
        let zero = !self.image.held_from(block, 0);
        let (off, n) = (offset as usize, len as usize);
        match &lr.alias {
            None if zero => {
                self.uffd
                    .zeropage(region.mapping(), off, n)
                    .map_err(mem_err("UFFDIO_ZEROPAGE"))?;
                self.counters.zero.fetch_add(1, Ordering::Relaxed);
            }
            None => {
                let scratch = SCRATCH.take();
                let r = STAGING.with(|cell| -> Result<(), SnapshotError> {
                    let mut scratch = scratch;
                    let mut cell = cell.borrow_mut();
                    let bb = self.image.block_bytes() as usize;
                    if cell.as_ref().map_or(true, |m| m.len() < bb) {
                        let m = Mapping::anonymous(bb)
                            .map_err(|e| mem_err("map a staging buffer")(e.into_io()))?;
                        // Best effort: only saves the first copy's page faults.
                        let _ = m.advise(0, bb, Advice::PopulateWrite);
                        *cell = Some(m);
                    }
                    let staging = cell.as_ref().expect("set above");
                    // SAFETY: the staging mapping is this thread's own, at least a block
                    // long, page-aligned, and nothing else touches it.
                    unsafe {
                        self.image
                            .read_block(block, staging.as_ptr(), false, &mut scratch)?
                    };
                    SCRATCH.set(scratch);
                    // SAFETY: as above: the first n bytes of this thread's staging mapping,
                    // just written, borrowed only for the copies below.
                    let src = unsafe { std::slice::from_raw_parts(staging.as_ptr(), n) };
                    let copied = self
                        .uffd
                        .copy(region.mapping(), off, src)
                        .map_err(mem_err("UFFDIO_COPY"))?;
                    if copied < n {
                        // A page of a block nobody had filled was there already: something
                        // else wrote this memory behind the restore's back.
                        return Err(SnapshotError::Memory {
                            region: region.guest_addr().0,
                            guest_addr: guest_addr + copied as u64,
                            op: "UFFDIO_COPY (a page was present before its block was restored)",
                            source: std::io::Error::from_raw_os_error(libc::EEXIST),
                        });
                    }
                    Ok(())
                });
                r?;
                self.counters.bytes.fetch_add(len, Ordering::Relaxed);
            }
            Some(alias) => {
                if zero {
                    let fo = region.file_offset().expect("a shared region has its file");
                    crate::sys::fallocate(fo.file().as_fd(), fo.start() + offset, len)
                        .map_err(mem_err("fallocate"))?;
                    self.counters.zero.fetch_add(1, Ordering::Relaxed);
                } else {
                    let mut scratch = SCRATCH.take();
                    // Only the thread that claimed the block writes it, and the registered
                    // mapping maps none of it before the UFFDIO_CONTINUE below.
                    // SAFETY: the block lies inside the alias (the region's length), aligned.
                    let r = unsafe {
                        self.image
                            .read_block(block, alias.as_ptr().add(off), false, &mut scratch)
                    };
                    SCRATCH.set(scratch);
                    r?;
                    self.counters.bytes.fetch_add(len, Ordering::Relaxed);
                }
                self.uffd
                    .continue_range(region.mapping(), off, n, region.page_size() as usize)
                    .map_err(mem_err("UFFDIO_CONTINUE"))?;
            }
        }
        Ok(())
    }

    /// Records the first failure, runs the hooks and wakes waiters; later failures are
    /// dropped.
    pub(super) fn fail(&self, e: SnapshotError) {
        if self.failed.swap(true, Ordering::AcqRel) {
            return;
        }
        let text = e.to_string();
        *self.error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
        let hooks = {
            let mut h = self.hooks.lock().unwrap_or_else(|p| p.into_inner());
            let _ = self.message.set(text.clone());
            std::mem::take(&mut *h)
        };
        for hook in hooks {
            // A panicking hook must not stop the failed block from being poisoned.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| hook(&text)));
        }
        let _g = self.wait.lock().unwrap_or_else(|p| p.into_inner());
        self.cv.notify_all();
    }

    /// Prefetches `first` (runs of it, in its order), then every other block.
    pub(super) fn prefetch(&self, first: &[u64], threads: usize) {
        let mut seen = vec![false; self.total as usize];
        let mut ranges = Vec::new();
        let push = |ranges: &mut Vec<JobRange>, b: u64| match ranges.last_mut() {
            Some(r) if r.start + r.len == b => r.len += 1,
            _ => ranges.push(JobRange::new(b, 1)),
        };
        for &b in first {
            if b < self.total && !std::mem::replace(&mut seen[b as usize], true) {
                push(&mut ranges, b);
            }
        }
        for b in 0..self.total {
            if !seen[b as usize] {
                push(&mut ranges, b);
            }
        }
        let job = Job::over(ranges)
            .expect("block ranges fit")
            .with_max_threads(threads);
        let _ = job.run(|chunk| {
            lower_priority();
            for b in chunk.start..chunk.start + chunk.len {
                if self.failed.load(Ordering::Acquire) || self.cancel.load(Ordering::Acquire) {
                    return Err(());
                }
                if self.claim(b).is_ok() {
                    self.counters.prefetched.fetch_add(1, Ordering::Relaxed);
                    self.serve(b);
                }
            }
            Ok(())
        });
    }

    /// Poisons one block (see the module docs). Returns false when the kernel cannot.
    fn poison_block(&self, block: u64) -> bool {
        if !self.uffd.has(uapi::UFFD_FEATURE_POISON) {
            return false;
        }
        let (ri, offset, len) = self.image.block_span(block);
        let m = self.regions[ri].region.mapping();
        let page = self.regions[ri].region.page_size() as usize;
        self.uffd
            .poison(m, offset as usize, len as usize, page)
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
