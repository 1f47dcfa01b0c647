//! Reading a userfaultfd: waiting for it (or a stop descriptor), and the fault and event
//! messages the kernel queued on it, a batch at a time.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

use linux_raw_sys::general as uapi;

use super::Uffd;

/// One fault or event read from the descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Event {
    /// A thread faulted at this (page-aligned) host address and waits.
    Fault { addr: u64, write: bool, minor: bool },
    /// The range was removed (`MADV_DONTNEED`/`MADV_REMOVE`) by its owner.
    Remove { start: u64, end: u64 },
    /// Another event guestmem does not ask for.
    Other(u8),
}

impl Uffd {
    /// Waits up to `timeout_ms` (or until `stop` is readable) and reads what is pending into
    /// `out`. Returns `Ok(false)` when `stop` fired.
    ///
    /// Each remove read is handed to `removes` (host range `start..end`) before any other
    /// thread can read a message from this descriptor, and left out of `out`. The owner's
    /// `madvise` returns once its remove is read, and its next touch of the range's
    /// neighbours may fault at once: a thread that read that fault and filled the block
    /// before the remove was applied would fill the removed pages too (the balloon's memory
    /// back, holding the snapshot's bytes where the owner gets zeros).
    pub(crate) fn read_events(
        &self,
        stop: &OwnedFd,
        timeout_ms: i32,
        out: &mut Vec<Event>,
        removes: &dyn Fn(u64, u64),
    ) -> io::Result<bool> {
        out.clear();
        if timeout_ms == 0 {
            // Called from inside a fill: whatever is pending, no waiting.
            return self.read_applying(out, removes).map(|()| true);
        }
        let mut fds = [
            libc::pollfd {
                fd: self.fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: stop.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: `fds` is a live array of two pollfds.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout_ms) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return if e.raw_os_error() == Some(libc::EINTR) {
                Ok(true)
            } else {
                Err(e)
            };
        }
        if fds[1].revents != 0 {
            return Ok(false);
        }
        if fds[0].revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0 {
            // The kernel reports POLLERR on a userfaultfd whose O_NONBLOCK flag was cleared
            // (the peer shares the open file and can clear it): it would stay "ready" and
            // every handler spin. A failure, not a spin.
            return Err(io::Error::other(
                "the userfaultfd reports an error to poll (its O_NONBLOCK flag was cleared by \
                 another holder, or it is no longer valid)",
            ));
        }
        if fds[0].revents & libc::POLLIN == 0 {
            return Ok(true);
        }
        self.read_applying(out, removes).map(|()| true)
    }

    /// The read lock, held whole: no reader of this descriptor is between reading a remove
    /// and applying it, and no copy into memory that may be removed is under way.
    pub(crate) fn reading(&self) -> std::sync::RwLockWriteGuard<'_, ()> {
        self.reading.write().unwrap_or_else(|e| e.into_inner())
    }

    /// From now on (once a reader applying removes has finished), reads nothing: the
    /// messages stay queued for another process that holds the descriptor (a page server
    /// the VM is being handed to; a remove read here would be lost to it). Until
    /// [`Uffd::resume_reading`].
    /// Copies from then on stop before their next attempt (`ReadingStopped`): one that
    /// retried after the new server read a remove would know nothing of it.
    pub(crate) fn stop_reading(&self) {
        let _reading = self.reading();
        self.stopped
            .store(true, std::sync::atomic::Ordering::Release);
        self.note_removes();
    }

    /// From now on copies hold the read lock (`Uffd::copy_from`): the owner removes pages
    /// (a remove was read, or a previous server's record says so), or reading stopped.
    pub(crate) fn note_removes(&self) {
        self.removes_seen
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// Reads again after [`Uffd::stop_reading`].
    pub(crate) fn resume_reading(&self) {
        let _reading = self.reading();
        self.stopped
            .store(false, std::sync::atomic::Ordering::Release);
    }

    /// Whether reading has stopped ([`Uffd::stop_reading`]).
    pub(crate) fn reading_stopped(&self) -> bool {
        self.stopped.load(std::sync::atomic::Ordering::Acquire)
    }

    /// [`Uffd::read_pending`], with the removes read handed to `removes` under the read
    /// lock (see [`Uffd::read_events`]); nothing once reading has stopped.
    fn read_applying(&self, out: &mut Vec<Event>, removes: &dyn Fn(u64, u64)) -> io::Result<()> {
        let _reading = self.reading();
        if self.reading_stopped() {
            return Ok(());
        }
        self.read_pending(out)?;
        if out.iter().any(|e| matches!(e, Event::Remove { .. })) {
            // Copies hold the lock from now on (see `Uffd::copy_from`).
            self.note_removes();
        }
        out.retain(|e| match *e {
            Event::Remove { start, end } => {
                removes(start, end);
                false
            }
            _ => true,
        });
        Ok(())
    }

    /// Reads the messages pending now (none is fine) into `out`. Never waits for one,
    /// whatever the descriptor's flags: a VM shares the open file with the server and may
    /// clear its `O_NONBLOCK` between the server's `poll` and its read (or take the message
    /// itself), and a read that waited would hold a fault thread every VM shares until that
    /// VM faulted again. `preadv2(RWF_NOWAIT)` asks for that on this read alone (Linux 6.8
    /// and later, where userfaultfd reads through `read_iter`); before that, a plain read.
    fn read_pending(&self, out: &mut Vec<Event>) -> io::Result<()> {
        use std::sync::atomic::{AtomicBool, Ordering};
        /// Whether this host refused `RWF_NOWAIT` on a userfaultfd, or `preadv2`, once.
        static NO_NOWAIT: AtomicBool = AtomicBool::new(false);
        const BATCH: usize = 16;
        let mut msgs = [std::mem::MaybeUninit::<uapi::uffd_msg>::uninit(); BATCH];
        let size = std::mem::size_of::<uapi::uffd_msg>();
        let buf = msgs.as_mut_ptr() as *mut libc::c_void;
        let mut refused = NO_NOWAIT.load(Ordering::Relaxed);
        let mut got = -1;
        if !refused {
            let iov = libc::iovec {
                iov_base: buf,
                iov_len: BATCH * size,
            };
            // SAFETY: `iov` names the buffer of BATCH messages; the kernel writes whole
            // messages only. Offset -1: the file's own position (none, for a userfaultfd).
            got = unsafe { libc::preadv2(self.fd.as_raw_fd(), &iov, 1, -1, libc::RWF_NOWAIT) };
            // EOPNOTSUPP: no RWF_NOWAIT on this kernel's userfaultfd; ENOSYS, EPERM: no
            // preadv2 at all (a kernel before 4.6, a seccomp filter).
            let e = io::Error::last_os_error().raw_os_error();
            refused = got < 0
                && matches!(
                    e,
                    Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) | Some(libc::EPERM)
                );
            if refused {
                NO_NOWAIT.store(true, Ordering::Relaxed);
            }
        }
        if refused {
            // SAFETY: the buffer holds BATCH messages; the kernel writes whole messages only.
            got = unsafe { libc::read(self.fd.as_raw_fd(), buf, BATCH * size) };
        }
        if got < 0 {
            let e = io::Error::last_os_error();
            // Another handler took the message first.
            return match e.raw_os_error() {
                Some(libc::EAGAIN) | Some(libc::EINTR) => Ok(()),
                _ => Err(e),
            };
        }
        for m in msgs.iter().take(got as usize / size) {
            // SAFETY: the kernel wrote this message (got / size whole messages).
            let m = unsafe { m.assume_init() };
            let event = m.event;
            out.push(match u32::from(event) {
                uapi::UFFD_EVENT_PAGEFAULT => {
                    // SAFETY: a pagefault message carries the pagefault member.
                    let pf = unsafe { m.arg.pagefault };
                    let flags = pf.flags;
                    Event::Fault {
                        addr: pf.address,
                        write: flags & u64::from(uapi::UFFD_PAGEFAULT_FLAG_WRITE) != 0,
                        minor: flags & u64::from(uapi::UFFD_PAGEFAULT_FLAG_MINOR) != 0,
                    }
                }
                uapi::UFFD_EVENT_REMOVE => {
                    // SAFETY: a remove message carries the remove member.
                    let r = unsafe { m.arg.remove };
                    Event::Remove {
                        start: r.start,
                        end: r.end,
                    }
                }
                _ => Event::Other(event),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A userfaultfd whose `O_NONBLOCK` another holder cleared: reading what is pending
    /// (nothing) returns at once instead of waiting for a fault that may never come.
    #[test]
    fn reading_pending_messages_never_waits_though_o_nonblock_was_cleared() {
        let Ok(u) = Uffd::open(0) else {
            return guestmem_testkit::skip("userfaultfd unavailable (needs root)");
        };
        let fd = u.fd.as_raw_fd();
        let mut m = std::mem::MaybeUninit::<uapi::uffd_msg>::uninit();
        let iov = libc::iovec {
            iov_base: m.as_mut_ptr() as *mut libc::c_void,
            iov_len: std::mem::size_of::<uapi::uffd_msg>(),
        };
        // SAFETY: `iov` names `m`, one message; the descriptor is still non-blocking here.
        let probe = unsafe { libc::preadv2(fd, &iov, 1, -1, libc::RWF_NOWAIT) };
        if probe < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::EOPNOTSUPP) {
            return guestmem_testkit::skip(
                "this kernel reads a userfaultfd without RWF_NOWAIT (before Linux 6.8)",
            );
        }
        // SAFETY: fcntl on a descriptor `u` owns.
        let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        // SAFETY: as above.
        let set = unsafe { libc::fcntl(fd, libc::F_SETFL, fl & !libc::O_NONBLOCK) };
        assert_eq!(set, 0);
        let (tx, rx) = std::sync::mpsc::channel();
        let t = std::thread::spawn(move || {
            let mut out = Vec::new();
            let r = u.read_pending(&mut out).map(|()| out.len());
            let _ = tx.send(r.map_err(|e| e.to_string()));
            u
        });
        match rx.recv_timeout(std::time::Duration::from_secs(5)) {
            Ok(r) => assert_eq!(r, Ok(0)),
            // The read waits (the thread is left blocked; the test process ends it).
            Err(_) => {
                let v = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
                panic!(
                    "a read of a blocking userfaultfd waited (kernel {})",
                    v.trim()
                );
            }
        }
        drop(t.join());
    }
}
