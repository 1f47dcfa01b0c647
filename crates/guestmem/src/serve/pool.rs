//! The server's threads: a fixed number serve every VM's faults, woken by epoll, and a fixed
//! number prefetch every VM's memory, below the faults in priority; never a thread (or
//! several) per VM.
//!
//! Each VM's userfaultfd is in one epoll set with `EPOLLONESHOT`. A fault thread that epoll
//! wakes for a VM reads at most one batch of its messages (the kernel queues faults per
//! userfaultfd: that is the VM's queue), re-arms it, and serves the batch. Re-arming before
//! serving lets a second thread take the same VM's next batch meanwhile (a VM's vCPUs fault
//! in parallel); re-arming puts the VM at the back of epoll's ready list, so a VM whose
//! vCPUs storm gets one batch per turn and cannot starve the others. Idle means blocked:
//! fault threads wait in `epoll_wait` with no timeout; a stop eventfd wakes them all. (A
//! thread that staged a block larger than 2 MiB waits once with a timeout of a second, then
//! lets go of that buffer and waits without one: a server's memory follows what it serves.)
//!
//! Prefetch threads run at a lower priority (nice 5), so the kernel gives the CPU to fault
//! threads, vCPUs and the VMM first. They take the VMs that have blocks left to bring in in
//! turn, one block each (the block after that VM's latest fault first, then its planned
//! order), and put a VM with more to do at the back of the queue; a fault never waits for
//! more than the blocks in flight. With nothing queued they wait on a condition variable
//! (with the same one timeout to let go of a large block's buffer).

use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use crate::restore::Pooled;

/// The epoll token of the stop eventfd (session ids count up from 0 and never reach it).
const STOP: u64 = u64::MAX;
/// Readiness events one `epoll_wait` returns at most.
const EVENTS_PER_WAIT: usize = 8;

/// The sessions with blocks left to prefetch, in turn.
#[derive(Default)]
struct PrefetchQueue {
    ids: VecDeque<u64>,
    stopping: bool,
    /// Holds taken ([`PrefetchHold`]): while any is, no prefetch thread starts a step.
    held: usize,
}

/// The shared state of the pool's threads.
struct Shared {
    epoll: OwnedFd,
    stop: OwnedFd,
    sessions: Mutex<HashMap<u64, Pooled>>,
    turns: Arc<Turns>,
}

/// The prefetch queue and its signal (shared with the holds, which keep nothing else of
/// the pool alive).
#[derive(Default)]
struct Turns {
    queue: Mutex<PrefetchQueue>,
    /// Signalled when a session joins the prefetch queue, when the last hold goes, and
    /// when the pool stops.
    cv: Condvar,
}

impl Shared {
    /// Session `id`'s fault side, if it is still in the pool.
    fn session(&self, id: u64) -> Option<Pooled> {
        self.sessions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id)
            .cloned()
    }

    fn queue(&self) -> std::sync::MutexGuard<'_, PrefetchQueue> {
        self.turns.queue.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The threads serving and prefetching every VM added to it (see the module docs).
pub(super) struct Pool {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    counts: (usize, usize),
}

impl Pool {
    /// Starts `fault_threads` fault-serving threads (at least one) and `prefetch_threads`
    /// prefetch threads, all waiting.
    pub(super) fn start(fault_threads: usize, prefetch_threads: usize) -> io::Result<Pool> {
        // SAFETY: flags only; returns a new descriptor or -1.
        let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if ep < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor nothing else owns.
        let epoll = unsafe { OwnedFd::from_raw_fd(ep) };
        let stop = crate::sys::eventfd()?;
        // Level-triggered and never read: once signalled, every thread sees it.
        ctl(
            epoll.as_fd(),
            libc::EPOLL_CTL_ADD,
            stop.as_fd(),
            libc::EPOLLIN as u32,
            STOP,
        )?;
        let shared = Arc::new(Shared {
            epoll,
            stop,
            sessions: Mutex::new(HashMap::new()),
            turns: Arc::default(),
        });
        let fault_threads = fault_threads.max(1);
        let mut pool = Pool {
            shared,
            threads: Vec::new(),
            counts: (fault_threads, prefetch_threads),
        };
        for i in 0..fault_threads {
            let s = pool.shared.clone();
            let h = std::thread::Builder::new()
                .name(format!("guestmem-pool{i}"))
                .spawn(move || serve_loop(&s))?;
            pool.threads.push(h);
        }
        for i in 0..prefetch_threads {
            let s = pool.shared.clone();
            let h = std::thread::Builder::new()
                .name(format!("guestmem-prefetch{i}"))
                .spawn(move || prefetch_loop(&s))?;
            pool.threads.push(h);
        }
        Ok(pool)
    }

    /// Holds every prefetch thread back (after the step each is on) until the hold is
    /// dropped; faults are served as ever.
    pub(super) fn hold(&self) -> PrefetchHold {
        self.shared.queue().held += 1;
        PrefetchHold {
            turns: Arc::clone(&self.shared.turns),
        }
    }

    /// Threads serving faults, and prefetching.
    pub(super) fn threads(&self) -> (usize, usize) {
        self.counts
    }

    /// Serves session `id`'s faults from now on, and prefetches it if it has a plan.
    pub(super) fn add(&self, id: u64, p: Pooled) -> io::Result<()> {
        let fd = p.fd().as_raw_fd();
        self.shared
            .sessions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, p.clone());
        // SAFETY: `p` (kept in the map and here) holds the descriptor open.
        let fd = unsafe { BorrowedFd::borrow_raw(fd) };
        let r = ctl(
            self.shared.epoll.as_fd(),
            libc::EPOLL_CTL_ADD,
            fd,
            armed(),
            id,
        );
        if r.is_err() {
            self.remove(id);
        } else if p.wants_prefetch() && self.counts.1 > 0 {
            // Once: a session served again (a hand-off not taken) may still be queued.
            let mut q = self.shared.queue();
            if !q.ids.contains(&id) {
                q.ids.push_back(id);
            }
            drop(q);
            self.shared.turns.cv.notify_one();
        }
        r
    }

    /// Stops serving session `id` (a thread serving a batch of it finishes that batch; it
    /// drops out of the prefetch queue at its next turn).
    pub(super) fn remove(&self, id: u64) {
        let p = self
            .shared
            .sessions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id);
        if let Some(p) = p {
            // ENOENT when it was never added: nothing to take out.
            let _ = ctl(
                self.shared.epoll.as_fd(),
                libc::EPOLL_CTL_DEL,
                p.fd(),
                0,
                id,
            );
        }
    }
}

/// Prefetching held back on a server: no prefetch thread starts a step until this is
/// dropped (see [`super::Server::hold_prefetch`]).
#[must_use = "prefetching resumes when the hold is dropped"]
pub struct PrefetchHold {
    turns: Arc<Turns>,
}

impl std::fmt::Debug for PrefetchHold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefetchHold").finish_non_exhaustive()
    }
}

impl Drop for PrefetchHold {
    fn drop(&mut self) {
        let mut q = self.turns.queue.lock().unwrap_or_else(|e| e.into_inner());
        q.held -= 1;
        if q.held == 0 {
            self.turns.cv.notify_all();
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        let _ = crate::sys::eventfd_signal(self.shared.stop.as_fd());
        self.shared.queue().stopping = true;
        self.shared.turns.cv.notify_all();
        for h in self.threads.drain(..) {
            let _ = h.join();
        }
    }
}

/// The events a session's userfaultfd is armed for.
fn armed() -> u32 {
    (libc::EPOLLIN | libc::EPOLLONESHOT) as u32
}

/// One `epoll_ctl`.
fn ctl(
    epoll: BorrowedFd<'_>,
    op: i32,
    fd: BorrowedFd<'_>,
    events: u32,
    token: u64,
) -> io::Result<()> {
    let mut ev = libc::epoll_event { events, u64: token };
    // SAFETY: both descriptors are live (borrowed); `ev` is a live epoll_event the kernel
    // only reads.
    let r = unsafe { libc::epoll_ctl(epoll.as_raw_fd(), op, fd.as_raw_fd(), &mut ev) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// A prefetch thread: at a lower priority, one block of the session at the head of the
/// queue, which goes to the back at once (so that other prefetch threads may work on it
/// meanwhile) and leaves the queue once it has nothing more to bring in; waits while the
/// queue is empty or prefetching is held.
fn prefetch_loop(s: &Shared) {
    crate::restore::as_prefetcher();
    loop {
        let id = {
            let mut q = s.queue();
            loop {
                if q.stopping {
                    return;
                }
                if q.held > 0 {
                    // Released by the hold's drop.
                } else if let Some(id) = q.ids.pop_front() {
                    q.ids.push_back(id);
                    break id;
                }
                if crate::restore::staging_oversized() {
                    // Idle with a large block's buffer: let go of it after a while.
                    let (g, waited) = s
                        .turns
                        .cv
                        .wait_timeout(q, crate::restore::STAGING_IDLE)
                        .unwrap_or_else(|e| e.into_inner());
                    q = g;
                    if waited.timed_out() {
                        crate::restore::trim_staging();
                    }
                    continue;
                }
                q = s.turns.cv.wait(q).unwrap_or_else(|e| e.into_inner());
            }
        };
        s.turns.cv.notify_one();
        // A session removed meanwhile drops out of the queue too.
        if !s.session(id).is_some_and(|p| p.prefetch_step()) {
            s.queue().ids.retain(|&i| i != id);
        }
    }
}

/// A fault thread: wait, read a batch of a ready VM's messages, re-arm it, serve the batch.
fn serve_loop(s: &Shared) {
    let mut ready = [libc::epoll_event { events: 0, u64: 0 }; EVENTS_PER_WAIT];
    let mut batch = Vec::new();
    loop {
        // Idle means blocked: no timeout, unless this thread holds a large block's staging
        // buffer, which it lets go of once idle that long (then waits without one).
        let timeout = if crate::restore::staging_oversized() {
            crate::restore::STAGING_IDLE.as_millis() as i32
        } else {
            -1
        };
        // SAFETY: `ready` is a live array of EVENTS_PER_WAIT events the kernel writes into.
        let n = unsafe {
            libc::epoll_wait(
                s.epoll.as_raw_fd(),
                ready.as_mut_ptr(),
                EVENTS_PER_WAIT as i32,
                timeout,
            )
        };
        if n == 0 {
            crate::restore::trim_staging();
            continue;
        }
        if n < 0 {
            if io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            // Not expected of a valid epoll descriptor; end the thread rather than spin.
            return;
        }
        for ev in &ready[..n as usize] {
            let (events, id) = (ev.events, ev.u64);
            if id == STOP {
                return;
            }
            let Some(p) = s.session(id) else { continue };
            if events & (libc::EPOLLERR | libc::EPOLLHUP) as u32 != 0 {
                // Not re-armed: the session is failed, and its supervisor ends it.
                p.fail_descriptor();
                continue;
            }
            p.read(&mut batch);
            if p.over() {
                // Failed or stopped: not re-armed; its supervisor ends it.
                continue;
            }
            // ENOENT: removed meanwhile; `p` still holds the descriptor open, so the number
            // names the same userfaultfd.
            let _ = ctl(s.epoll.as_fd(), libc::EPOLL_CTL_MOD, p.fd(), armed(), id);
            p.serve(&batch);
        }
    }
}
