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

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::restore::lazy::Pooled;

/// The epoll token of the stop eventfd (session ids count up from 0 and never reach it).
const STOP: u64 = u64::MAX;
/// Readiness events one `epoll_wait` returns at most.
const EVENTS_PER_WAIT: usize = 8;

/// The shared state of the pool's threads.
struct Shared {
    epoll: OwnedFd,
    stop: OwnedFd,
    sessions: Mutex<HashMap<u64, Pooled>>,
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
        let shared = Arc::new(Shared {
            epoll,
            stop,
            sessions: Mutex::new(HashMap::new()),
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

/// A pool thread: wait, read a batch of a ready VM's messages, re-arm it, serve the batch.
fn serve_loop(s: &Shared) {
    let mut ready = [libc::epoll_event { events: 0, u64: 0 }; EVENTS_PER_WAIT];
    let mut batch = Vec::new();
    loop {
        // SAFETY: `ready` is a live array of EVENTS_PER_WAIT events the kernel writes into;
        // no timeout (idle means blocked).
        let n = unsafe {
            libc::epoll_wait(
                s.epoll.as_raw_fd(),
                ready.as_mut_ptr(),
                EVENTS_PER_WAIT as i32,
                -1,
            )
        };
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
            let p = s
                .sessions
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(&id)
                .cloned();
            let Some(p) = p else { continue };
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
