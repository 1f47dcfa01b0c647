//! Transparent huge pages back after a restore.
//!
//! A restore fills anonymous memory a page or a block at a time (`UFFDIO_COPY`, or `pread`
//! into memory whose region is not THP-advised), so a guest that ran on transparent huge
//! pages comes back on 4 KiB pages and pays the TLB misses for the rest of its life. Once
//! every block is in, `MADV_COLLAPSE` (Linux 6.1) gives each 2 MiB of it a huge page again:
//! in this process with `madvise`, in a served VM's process with
//! `process_madvise(pidfd, ..., MADV_COLLAPSE)`.
//!
//! One thread per process does it for every restore, one 2 MiB chunk at a time, and rests
//! after each chunk as long as the chunk took (at most half a CPU): a collapse holds that
//! chunk's page table while it copies, so a vCPU touching it waits for one chunk (a few
//! milliseconds), never for a region. It starts [`REGAIN_SETTLE`] after the restore
//! completes, not at once: a guest is busiest, and its latency counts most, just after a
//! restore (the request that woke it), and the collapse is work beside it that can wait.
//! Only chunks whose every page is present are collapsed, so no memory is added (a
//! balloon's holes stay holes). A chunk the kernel cannot collapse (no huge page free, a
//! range in use) is counted, the first reason is logged once per restore, and the memory
//! stays as it was: the restore has succeeded either way. The thread waits on its queue
//! when there is nothing to do.
//!
//! A collapse ends with its memory's owner. Once a restore is halted (a page server's VM
//! closed its socket, exited, failed, graduated or was handed over), its collapse stops
//! after the chunk it is on ([`Regaining::stop`]): the memory is no longer the restore's to
//! change, and a VM that exits mid-collapse has nothing left to collapse (a chunk of a
//! process that has gone ends the collapse at once). What was collapsed stays huge, the
//! rest stays on 4 KiB pages, and the end is logged with what was done. A page server
//! waits for the collapses it stopped before it returns (each ends within one chunk), so
//! none is cut off by its process exiting and every one reports its end. A collapse stopped
//! while it waits its turn leaves the queue at once, with the pidfd and ranges it held: the
//! queue holds only what is served now, however many VMs came and went behind a long
//! collapse.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use crate::layout::THP_BYTES;
use crate::region::Region;

/// How long a collapse waits after its restore completes before the first chunk.
///
/// A collapse copies each 2 MiB again and holds its page table meanwhile; beside a guest
/// that is still touching its memory for the first time, that is work the guest feels.
/// Measured on this project's test host (a real Firecracker guest served by `serve-uffd`,
/// its first full touch of 512 MiB sent the moment `snapshot/load` returns, warm page
/// cache, 20 interleaved rounds): with the collapse starting as the last block came in, the
/// pass took a median 7.5 ms longer than the same pass once everything was resident (38 ms
/// in the slowest quarter of rounds); with no collapse, 3.5 ms (14 ms). There the last
/// block was in about 0.25 s after the load and the pass ended about half a second later
/// (cold: in at about 0.4 s, the pass over 0.4 s later): a second covers it, and costs the
/// huge pages no more than that second.
pub const REGAIN_SETTLE: Duration = Duration::from_secs(1);

/// How often a collapse waiting out its settle looks whether its memory is gone.
const SETTLE_CHECK: Duration = Duration::from_millis(100);

/// Whether a restore brings transparent huge pages back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RegainHuge {
    /// Collapse the anonymous regions that had huge pages when saved (the snapshot records
    /// it per region), from [`REGAIN_SETTLE`] after the restore is complete, in the
    /// background (the default).
    #[default]
    Saved,
    /// Leave the pages as the restore made them.
    Off,
}

/// What bringing huge pages back did.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct RegainReport {
    /// Bytes the saved memory had in transparent huge pages (`None` for a served VM: a
    /// Firecracker memory file does not say).
    pub saved_huge_bytes: Option<u64>,
    /// Bytes mapped by transparent huge pages (smaps `AnonHugePages`) before the collapse.
    pub huge_before: u64,
    /// The same, after.
    pub huge_after: u64,
    /// 2 MiB chunks tried.
    pub chunks: u64,
    /// Of them, collapsed (or huge already).
    pub collapsed: u64,
    /// Skipped: the chunk holds no saved data, or a page of it was not present (collapsing
    /// would allocate memory the guest never had).
    pub skipped: u64,
    /// Refused by the kernel.
    pub failed: u64,
    /// Why the first refused chunk was refused.
    pub first_failure: Option<String>,
    /// Seconds from the restore's completion to the collapse's start: [`REGAIN_SETTLE`], or
    /// more when another restore's collapse ran first (one thread does them in turn); or to
    /// its end, when it was stopped, or its memory went, while it waited.
    pub settle_secs: f64,
    /// Seconds from the start of the collapse to its end (rests included).
    pub secs: f64,
    /// Stopped before the end: the memory or its process went, or the owner stopped it.
    pub stopped: bool,
}

/// A collapse queued or running: what [`Regaining::wait`] waits on.
#[derive(Debug, Clone, Default)]
pub struct Regaining(Arc<Shared>);

#[derive(Debug, Default)]
struct Shared {
    report: Mutex<Option<RegainReport>>,
    cv: Condvar,
    stop: std::sync::atomic::AtomicBool,
}

impl Regaining {
    /// Waits until the collapse has ended, and says what it did. The collapse starts
    /// [`REGAIN_SETTLE`] after the restore is complete: a lazy restore without prefetch
    /// completes only when its guest has touched every block, or at `LazyRestore::finish`,
    /// so do not wait on this before either on the thread that would call `finish`. A
    /// restore that fails, is halted or dropped ends it with a report that says `stopped`.
    pub fn wait(&self) -> RegainReport {
        let mut g = self.0.report.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(r) = &*g {
                return r.clone();
            }
            g = self.0.cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// What it did, once it has ended.
    pub fn report(&self) -> Option<RegainReport> {
        self.0
            .report
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Asks the collapse to stop after the chunk it is on (or not to start: one still
    /// waiting its turn leaves the queue now, and its report says `stopped`).
    pub fn stop(&self) {
        self.0
            .stop
            .store(true, std::sync::atomic::Ordering::Release);
        // Dropped outside the queue's lock; its drop ends this handle.
        drop(QUEUE.take(self));
        // Under the lock: a collapse waiting out its settle either sees the flag or is
        // already waiting, and is woken.
        let _g = self.0.report.lock().unwrap_or_else(|e| e.into_inner());
        self.0.cv.notify_all();
    }

    fn stopped(&self) -> bool {
        self.0.stop.load(std::sync::atomic::Ordering::Acquire)
    }

    fn end(&self, r: RegainReport) {
        let mut g = self.0.report.lock().unwrap_or_else(|e| e.into_inner());
        if g.is_none() {
            *g = Some(r);
        }
        self.0.cv.notify_all();
    }

    /// Ends it without a collapse (the restore failed, or never completed).
    fn abandon(&self) {
        self.end(RegainReport {
            stopped: true,
            ..RegainReport::default()
        });
    }
}

/// Memory to collapse.
#[derive(Debug)]
pub(crate) enum Memory {
    /// Regions of this process (weak: a map dropped meanwhile is not kept alive).
    Local(Vec<Weak<Region>>),
    /// Host ranges `(start, len)` of another process, reached through its pidfd.
    Remote {
        /// A pidfd of the process.
        pidfd: OwnedFd,
        /// Its pid, for `/proc/PID/smaps` and `pagemap` (checked alive through the pidfd).
        pid: u32,
        /// The ranges.
        ranges: Vec<(u64, u64)>,
    },
}

/// One restore's collapse, queued on the process's collapse thread when its restore
/// completes.
#[derive(Debug)]
pub(crate) struct Job {
    memory: Memory,
    saved: Option<u64>,
    /// Host ranges that hold saved data, sorted: only a chunk inside one is collapsed (a
    /// chunk of zero blocks would become 2 MiB of real memory once the range is no longer
    /// registered, where the kernel no longer refuses it).
    data: Vec<(u64, u64)>,
    handle: Regaining,
    /// When its restore completed (set by [`Job::queue`]).
    completed: Option<Instant>,
}

impl Job {
    /// A collapse of `memory`, whose saved form had `saved` bytes in huge pages, where
    /// `data` (host ranges, sorted) holds saved data.
    pub(crate) fn new(
        memory: Memory,
        saved: Option<u64>,
        data: Vec<(u64, u64)>,
    ) -> (Job, Regaining) {
        let handle = Regaining::default();
        (
            Job {
                memory,
                saved,
                data,
                handle: handle.clone(),
                completed: None,
            },
            handle,
        )
    }

    /// Whether the 2 MiB at `addr` lie inside one range of saved data.
    fn holds_data(&self, addr: u64) -> bool {
        let i = self.data.partition_point(|&(s, _)| s <= addr);
        i > 0 && {
            let (s, l) = self.data[i - 1];
            addr + THP_BYTES <= s + l
        }
    }

    /// Hands it to the collapse thread (started on first use), its restore complete now; it
    /// starts [`REGAIN_SETTLE`] later. A job dropped unqueued (its restore failed or
    /// stopped) ends its handle as stopped.
    pub(crate) fn queue(mut self) {
        self.completed = Some(Instant::now());
        static WORKER: OnceLock<bool> = OnceLock::new();
        let started = *WORKER.get_or_init(|| {
            std::thread::Builder::new()
                .name("guestmem-regain".into())
                .spawn(|| loop {
                    QUEUE.next().run();
                })
                .is_ok()
        });
        if !started {
            tracing::warn!("huge pages not regained: no thread to collapse them");
            return;
        }
        // Those whose memory went while they waited (a map dropped, a VM gone without a
        // stop) go too, dropped outside the lock.
        drop(QUEUE.push(self));
    }

    fn run(self) {
        let completed = self.completed.unwrap_or_else(Instant::now);
        let mut r = RegainReport {
            saved_huge_bytes: self.saved,
            ..RegainReport::default()
        };
        let settled = self.settle(completed);
        let t0 = Instant::now();
        r.settle_secs = t0.saturating_duration_since(completed).as_secs_f64();
        if !settled {
            r.stopped = true;
            self.handle.end(r);
            return;
        }
        r.huge_before = self.huge_now();
        let chunks = self.chunks();
        for (addr, region) in chunks {
            if self.handle.stopped() {
                r.stopped = true;
                break;
            }
            if !self.holds_data(addr) {
                r.skipped += 1;
                r.chunks += 1;
                continue;
            }
            let t = Instant::now();
            let region = region.map(|w| w.upgrade());
            match self.collapse(addr, region.as_ref().map(Option::as_ref)) {
                Chunk::Collapsed => r.collapsed += 1,
                Chunk::NotPresent => r.skipped += 1,
                Chunk::Failed(why, denied) => {
                    r.failed += 1;
                    if r.first_failure.is_none() {
                        tracing::warn!(
                            "huge pages not regained at host address {addr:#x} (the memory \
                             stays on 4 KiB pages there; the restore is complete): {why}"
                        );
                        r.first_failure = Some(why);
                    }
                    if denied {
                        // No right to this process's memory: every chunk would be refused.
                        r.stopped = true;
                        break;
                    }
                }
                Chunk::Gone => {
                    r.stopped = true;
                    break;
                }
            }
            r.chunks += 1;
            // Rest as long as the chunk took: at most half a CPU, and a vCPU never waits on
            // more than one chunk's collapse at a time.
            std::thread::sleep(t.elapsed().min(Duration::from_millis(50)));
        }
        r.huge_after = self.huge_now();
        r.secs = t0.elapsed().as_secs_f64();
        let whose = match &self.memory {
            Memory::Local(_) => "this process".to_string(),
            Memory::Remote { pid, .. } => format!("process {pid}"),
        };
        tracing::info!(
            "huge pages regained in {whose}: AnonHugePages {} MiB -> {} MiB ({} of {} chunks \
             of 2 MiB collapsed, {} not whole, {} refused) in {:.2} s, from {:.2} s after \
             the restore completed{}",
            r.huge_before >> 20,
            r.huge_after >> 20,
            r.collapsed,
            r.chunks,
            r.skipped,
            r.failed,
            r.secs,
            r.settle_secs,
            if r.stopped { ", stopped early" } else { "" }
        );
        self.handle.end(r);
    }

    /// Waits until [`REGAIN_SETTLE`] after `completed`; false when stopped, or when its
    /// memory went (the VM exited, the map was dropped), meanwhile: then at once, so that
    /// the one collapse thread is not held for nothing.
    fn settle(&self, completed: Instant) -> bool {
        let until = completed + REGAIN_SETTLE;
        let shared = &self.handle.0;
        let mut g = shared.report.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if self.handle.stopped() || self.gone() {
                return false;
            }
            let now = Instant::now();
            if now >= until {
                return true;
            }
            // `stop` notifies under this lock; the memory going does not, so look again
            // every SETTLE_CHECK.
            g = shared
                .cv
                .wait_timeout(g, (until - now).min(SETTLE_CHECK))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Whether the memory is gone: every local region dropped, or the process exited.
    fn gone(&self) -> bool {
        match &self.memory {
            Memory::Local(regions) => regions.iter().all(|w| w.strong_count() == 0),
            Memory::Remote { pidfd, .. } => exited(pidfd),
        }
    }

    /// Every whole 2 MiB chunk of the memory, with the region it lies in (local; weak, so
    /// that a map dropped meanwhile goes).
    fn chunks(&self) -> Vec<(u64, Option<Weak<Region>>)> {
        let spans: Vec<(u64, u64, Option<Weak<Region>>)> = match &self.memory {
            Memory::Local(regions) => regions
                .iter()
                .filter_map(|w| {
                    let r = w.upgrade()?;
                    Some((r.host_addr() as u64, r.size(), Some(w.clone())))
                })
                .collect(),
            Memory::Remote { ranges, .. } => ranges.iter().map(|&(s, l)| (s, l, None)).collect(),
        };
        let mut out = Vec::new();
        for (start, len, region) in spans {
            let mut a = start.next_multiple_of(THP_BYTES);
            while a + THP_BYTES <= start + len {
                out.push((a, region.clone()));
                a += THP_BYTES;
            }
        }
        out
    }

    /// Collapses the chunk at host address `addr`, in `region` when local (`Some(None)`:
    /// the region is gone).
    fn collapse(&self, addr: u64, region: Option<Option<&Arc<Region>>>) -> Chunk {
        match (&self.memory, region) {
            (Memory::Local(_), Some(Some(r))) => {
                let offset = (addr - r.host_addr() as u64) as usize;
                match crate::mmap::ProcMem::open()
                    .and_then(|p| p.faulted_in(r.mapping(), offset, THP_BYTES as usize))
                {
                    Ok(pages) if pages.iter().all(|&p| p) => {}
                    Ok(_) => return Chunk::NotPresent,
                    Err(e) => return failed("read /proc/self/pagemap".into(), &e),
                }
                match r
                    .mapping()
                    .advise(offset, THP_BYTES as usize, crate::mmap::Advice::Collapse)
                {
                    Ok(()) => Chunk::Collapsed,
                    Err(e) => Chunk::Failed(e.to_string(), false),
                }
            }
            (Memory::Remote { pidfd, pid, .. }, _) => {
                // The pid is read through /proc: first make sure it is still this process
                // (its pidfd turns readable when it exits).
                if exited(pidfd) {
                    return Chunk::Gone;
                }
                match remote_present(*pid, addr) {
                    Ok(true) => {}
                    Ok(false) => return Chunk::NotPresent,
                    Err(e)
                        if e.raw_os_error() == Some(libc::ESRCH)
                            || e.kind() == std::io::ErrorKind::UnexpectedEof =>
                    {
                        return Chunk::Gone
                    }
                    Err(e) => return failed(format!("read /proc/{pid}/pagemap"), &e),
                }
                match process_collapse(pidfd, addr) {
                    Ok(()) => Chunk::Collapsed,
                    Err(e) if e.raw_os_error() == Some(libc::ESRCH) => Chunk::Gone,
                    Err(e) => failed(
                        format!("process_madvise(MADV_COLLAPSE) in process {pid}"),
                        &e,
                    ),
                }
            }
            (Memory::Local(_), _) => Chunk::Gone,
        }
    }

    /// Bytes in transparent huge pages now.
    fn huge_now(&self) -> u64 {
        match &self.memory {
            Memory::Local(regions) => {
                let live: Vec<Arc<Region>> = regions.iter().filter_map(Weak::upgrade).collect();
                crate::inspect::inspect_regions(&live)
                    .map(|u| u.iter().map(|u| u.huge).sum())
                    .unwrap_or(0)
            }
            Memory::Remote { pid, ranges, .. } => {
                crate::inspect::anon_huge_in(*pid, ranges).unwrap_or(0)
            }
        }
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        // After `run` the handle holds its report already; otherwise it never ran.
        self.handle.abandon();
    }
}

/// The collapses waiting their turn, in order.
struct Queue {
    jobs: Mutex<VecDeque<Job>>,
    cv: Condvar,
}

/// The process's one queue (its thread starts on the first [`Job::queue`]).
static QUEUE: Queue = Queue {
    jobs: Mutex::new(VecDeque::new()),
    cv: Condvar::new(),
};

impl Queue {
    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Job>> {
        self.jobs.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds `job` at the end; returns those that no longer need their turn (stopped, or
    /// their memory gone), taken out, for the caller to drop.
    fn push(&self, job: Job) -> Vec<Job> {
        let mut q = self.lock();
        let mut out = Vec::new();
        let mut kept = VecDeque::with_capacity(q.len() + 1);
        for j in q.drain(..) {
            if j.handle.stopped() || j.gone() {
                out.push(j);
            } else {
                kept.push_back(j);
            }
        }
        kept.push_back(job);
        *q = kept;
        self.cv.notify_one();
        out
    }

    /// The job of `handle`, taken out if it still waits its turn.
    fn take(&self, handle: &Regaining) -> Option<Job> {
        let mut q = self.lock();
        let i = q.iter().position(|j| Arc::ptr_eq(&j.handle.0, &handle.0))?;
        q.remove(i)
    }

    /// The next job, waiting (blocked) for one.
    fn next(&self) -> Job {
        let mut q = self.lock();
        loop {
            if let Some(j) = q.pop_front() {
                return j;
            }
            q = self.cv.wait(q).unwrap_or_else(|e| e.into_inner());
        }
    }
}

enum Chunk {
    Collapsed,
    NotPresent,
    /// Refused, and why; `true` when for want of the right to (every chunk would be).
    Failed(String, bool),
    Gone,
}

/// A refusal of `op`: its text, and whether it is for want of the right to.
fn failed(op: String, e: &std::io::Error) -> Chunk {
    let denied = matches!(e.raw_os_error(), Some(libc::EACCES | libc::EPERM));
    Chunk::Failed(format!("{op}: {e}"), denied)
}

/// Whether the process of `pidfd` has exited (its pidfd polls readable).
fn exited(pidfd: &OwnedFd) -> bool {
    let mut p = libc::pollfd {
        fd: pidfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one live pollfd, no timeout.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n != 0
}

/// Whether every page of the 2 MiB at `addr` in process `pid` is present.
fn remote_present(pid: u32, addr: u64) -> std::io::Result<bool> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(format!("/proc/{pid}/pagemap")).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            std::io::Error::from_raw_os_error(libc::ESRCH)
        } else {
            e
        }
    })?;
    // pagemap has one 8-byte entry per base page.
    let page = crate::sys::base_page_size();
    let pages = (THP_BYTES / page) as usize;
    let mut buf = vec![0u8; pages * 8];
    f.read_exact_at(&mut buf, addr / page * 8)?;
    Ok(buf.chunks_exact(8).all(|e| {
        let v = u64::from_ne_bytes(e.try_into().expect("8-byte entry"));
        v & (1 << 63) != 0
    }))
}

/// `process_madvise(pidfd, [addr, 2 MiB], MADV_COLLAPSE)`.
fn process_collapse(pidfd: &OwnedFd, addr: u64) -> std::io::Result<()> {
    let iov = libc::iovec {
        iov_base: addr as usize as *mut libc::c_void,
        iov_len: THP_BYTES as usize,
    };
    // SAFETY: process_madvise reads one iovec from our stack and advises the other
    // process's memory; nothing of this process is touched. MADV_COLLAPSE keeps that
    // memory's contents (it copies them into a huge page).
    let ret = unsafe {
        libc::syscall(
            libc::SYS_process_madvise,
            pidfd.as_raw_fd(),
            &iov as *const libc::iovec,
            1usize,
            libc::MADV_COLLAPSE,
            0u32,
        )
    };
    if ret < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A job over this process through a pidfd of its own, with no ranges: it settles for
    /// [`REGAIN_SETTLE`], then has nothing to collapse.
    fn own_process() -> (Job, Regaining) {
        // SAFETY: pidfd_open takes a pid and flags, and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, std::process::id(), 0) };
        assert!(fd >= 0, "pidfd_open: {}", std::io::Error::last_os_error());
        // SAFETY: a descriptor just returned to us, owned by nothing else.
        let pidfd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32) };
        let memory = Memory::Remote {
            pidfd,
            pid: std::process::id(),
            ranges: Vec::new(),
        };
        Job::new(memory, None, Vec::new())
    }

    #[test]
    fn collapses_stopped_or_gone_while_waiting_their_turn_leave_the_queue_at_once() {
        let (first, first_handle) = own_process();
        let queued = std::time::Instant::now();
        first.queue();
        // The first waits out its settle (a second) on the one thread; behind it:
        let (waiting, waiting_handle) = own_process();
        waiting.queue();
        let (gone, gone_handle) = Job::new(Memory::Local(vec![Weak::new()]), None, Vec::new());
        gone.queue();
        if queued.elapsed() > REGAIN_SETTLE / 2 {
            // This thread was held up so long that the first may be done and the next
            // taken off the queue: what the test is about cannot be seen this time.
            eprintln!("not checked: held up {:?} while queueing", queued.elapsed());
            waiting_handle.stop();
            first_handle.stop();
            return;
        }
        waiting_handle.stop();
        // Ended by the stop itself, with its pidfd: not when its turn comes.
        let r = waiting_handle.report().expect("ended by the stop");
        assert!(r.stopped && r.chunks == 0, "{r:?}");
        // One whose memory went is let go of by the next job queued.
        let (next, next_handle) = own_process();
        next.queue();
        let r = gone_handle.report().expect("let go of by the next push");
        assert!(r.stopped, "{r:?}");
        next_handle.stop();
        assert!(!first_handle.wait().stopped);
    }
}
