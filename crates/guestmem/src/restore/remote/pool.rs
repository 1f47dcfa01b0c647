//! The fleet's fault-serving pool: a fixed number of threads serve every VM's faults,
//! woken by epoll, instead of a thread (or several) per VM.
//!
//! Each VM's userfaultfd is in one epoll set with `EPOLLONESHOT`. A thread that epoll wakes
//! for a VM reads at most one batch of its messages (the kernel queues faults per
//! userfaultfd: that is the VM's queue), re-arms it, and serves the batch. Re-arming before
//! serving lets a second thread take the same VM's next batch meanwhile (a VM's vCPUs fault
//! in parallel); re-arming puts the VM at the back of epoll's ready list, so a VM whose
//! vCPUs storm gets one batch per turn and cannot starve the others. Idle means blocked:
//! the threads wait in `epoll_wait` with no timeout; a stop eventfd wakes them all.
//!
//! The same threads prefetch, below the faults: while some VM still has blocks to bring in,
//! a thread that finds no fault ready (`epoll_wait` with a zero timeout) brings in one block
//! of the VM at the head of the prefetch queue (following that VM's latest fault first) and
//! puts it at the back; so the VMs are prefetched in turn, a block each, and a fault waits
//! for at most the block a thread is on. A kick eventfd wakes one thread when a VM that
//! wants prefetch is added.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::restore::lazy::Pooled;

/// The epoll token of the stop eventfd (session ids count up from 0 and never reach it).
const STOP: u64 = u64::MAX;
/// The epoll token of the kick eventfd: prefetch work came.
const KICK: u64 = u64::MAX - 1;
/// Readiness events one `epoll_wait` returns at most.
const EVENTS_PER_WAIT: usize = 8;

/// The shared state of the pool's threads.
struct Shared {
    epoll: OwnedFd,
    stop: OwnedFd,
    kick: OwnedFd,
    sessions: Mutex<HashMap<u64, Pooled>>,
    /// Sessions with blocks left to prefetch, in turn.
    prefetch: Mutex<VecDeque<u64>>,
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
}

/// Threads serving the faults of every VM added to it (see the module docs).
pub(crate) struct Pool {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl Pool {
    /// Starts `threads` serving threads (at least one), all waiting.
    pub(crate) fn start(threads: usize) -> io::Result<Pool> {
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
        // One-shot: a kick wakes one thread, which re-arms it once it has read it.
        let kick = crate::sys::eventfd()?;
        ctl(
            epoll.as_fd(),
            libc::EPOLL_CTL_ADD,
            kick.as_fd(),
            armed(),
            KICK,
        )?;
        let shared = Arc::new(Shared {
            epoll,
            stop,
            kick,
            sessions: Mutex::new(HashMap::new()),
            prefetch: Mutex::new(VecDeque::new()),
        });
        let mut pool = Pool {
            shared,
            threads: Vec::new(),
        };
        for i in 0..threads.max(1) {
            let s = pool.shared.clone();
            let h = std::thread::Builder::new()
                .name(format!("guestmem-pool{i}"))
                .spawn(move || serve_loop(&s))?;
            pool.threads.push(h);
        }
        Ok(pool)
    }

    /// Threads in the pool.
    pub(crate) fn threads(&self) -> usize {
        self.threads.len()
    }

    /// Serves session `id`'s faults from now on.
    pub(crate) fn add(&self, id: u64, p: Pooled) -> io::Result<()> {
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
        } else if p.wants_prefetch() {
            self.shared
                .prefetch
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push_back(id);
            let _ = crate::sys::eventfd_signal(self.shared.kick.as_fd());
        }
        r
    }

    /// Stops serving session `id` (a thread serving a batch of it finishes that batch).
    pub(crate) fn remove(&self, id: u64) {
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

impl Drop for Pool {
    fn drop(&mut self) {
        let _ = crate::sys::eventfd_signal(self.shared.stop.as_fd());
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

/// One prefetch step for the session at the head of the queue, which goes to the back if it
/// has more to bring in. False when the queue is empty.
fn prefetch_step(s: &Shared) -> bool {
    let id = s
        .prefetch
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .pop_front();
    let Some(id) = id else { return false };
    // A session removed meanwhile drops out of the queue.
    if s.session(id).is_some_and(|p| p.prefetch_step()) {
        s.prefetch
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(id);
    }
    true
}

/// A pool thread: wait, read a batch of a ready VM's messages, re-arm it, serve the batch;
/// with no fault ready and prefetch to do, a prefetch step.
fn serve_loop(s: &Shared) {
    let mut ready = [libc::epoll_event { events: 0, u64: 0 }; EVENTS_PER_WAIT];
    let mut batch = Vec::new();
    loop {
        let prefetching = !s
            .prefetch
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty();
        // SAFETY: `ready` is a live array of EVENTS_PER_WAIT events the kernel writes into;
        // no timeout (idle means blocked) unless prefetch work waits.
        let n = unsafe {
            libc::epoll_wait(
                s.epoll.as_raw_fd(),
                ready.as_mut_ptr(),
                EVENTS_PER_WAIT as i32,
                if prefetching { 0 } else { -1 },
            )
        };
        if n == 0 {
            prefetch_step(s);
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
            if id == KICK {
                let _ = crate::sys::eventfd_read(s.kick.as_fd());
                let _ = ctl(
                    s.epoll.as_fd(),
                    libc::EPOLL_CTL_MOD,
                    s.kick.as_fd(),
                    armed(),
                    KICK,
                );
                continue;
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
