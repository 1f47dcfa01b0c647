//! The one intake: connections accepted on any of a server's sockets, each handshake read
//! on a thread of its own (at most [`MAX_PENDING_HANDSHAKES`] at once), so a squatter or a
//! slow peer holds up nobody. Past that, a connection that has sent nothing for
//! [`SILENT_FOR`] is dropped to make room for the next (a VM sends its handshake as it
//! connects), else connections wait in the backlog: sixteen silent connections renewed
//! every handshake timeout no longer keep real VMs waiting. Each result ([`Arrival`]) is
//! left for the server's supervisor, which admits or refuses it.
//!
//! Once the server takes no more VMs ([`Intake::close`]: it has its one VM, or it drains), a
//! handshake that completes later ends its own VM as the failure policy says: no VM that
//! sent its userfaultfd is left waiting on a server that will not serve it.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::config::SessionEvent;
use super::handshake::{receive_checked, Handshake, HandshakeError, Refused};
use super::listener::Listener;
use super::peer::Ending;
use super::status::StatusHandle;
use super::ServeError;
use crate::sys::PollFd;

/// Most handshakes read at once; past them, one silent for [`SILENT_FOR`] is dropped for
/// the next connection, else connections wait in the backlog.
pub(super) const MAX_PENDING_HANDSHAKES: usize = 16;
/// A connection pending this long with nothing sent may be dropped to make room (a VM's
/// handshake comes with its connect; Firecracker's in one `sendmsg`).
pub(super) const SILENT_FOR: Duration = Duration::from_secs(1);
/// Handshake threads at most, those of dropped connections still ending included.
const MAX_HANDSHAKE_THREADS: usize = 2 * MAX_PENDING_HANDSHAKES;

/// A handshake's result, and the socket it came on.
pub(super) struct Arrival {
    pub(super) socket: usize,
    pub(super) result: Result<Handshake, Refused>,
}

/// Why the intake stopped taking VMs: what a VM whose handshake completes later is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Closed {
    /// A one-VM server has its VM (or gave up waiting).
    HasItsVm,
    /// The server is draining.
    Draining,
}

#[derive(Default)]
struct Inbox {
    results: Mutex<Results>,
    /// Handshakes still being read (threads running).
    pending: AtomicUsize,
    /// Those not dropped, oldest first: each with a second handle on its connection.
    reading: Mutex<Vec<Reading>>,
    keys: AtomicU64,
}

/// A handshake being read.
struct Reading {
    key: u64,
    since: Instant,
    stream: UnixStream,
}

impl Reading {
    /// Whether it may be dropped now: pending for [`SILENT_FOR`] with nothing to read (a
    /// hang-up reads as something: its thread ends at once).
    fn silent(&self, now: Instant) -> bool {
        now.duration_since(self.since) >= SILENT_FOR
            && !crate::sys::is_readable(self.stream.as_fd())
    }
}

#[derive(Default)]
struct Results {
    closed: Option<Closed>,
    arrivals: VecDeque<Arrival>,
}

/// The intake of one server (see the module docs).
pub(super) struct Intake {
    inbox: Arc<Inbox>,
    /// Signalled by each handshake thread as it ends.
    notify: Arc<OwnedFd>,
    timeout: Duration,
    ending: Ending,
    /// Where a VM ended as late is counted as refused.
    status: StatusHandle,
}

impl Intake {
    /// An intake giving each peer `timeout` for its whole handshake, and ending late VMs
    /// as `ending` says (counted as refused in `status`).
    pub(super) fn new(
        timeout: Duration,
        ending: Ending,
        status: StatusHandle,
    ) -> Result<Intake, ServeError> {
        Ok(Intake {
            inbox: Arc::default(),
            notify: Arc::new(crate::sys::eventfd().map_err(ServeError::io("make an eventfd"))?),
            timeout,
            ending,
            status,
        })
    }

    /// Readable once a handshake thread has ended (cleared by [`Intake::clear`]).
    pub(super) fn fd(&self) -> BorrowedFd<'_> {
        self.notify.as_fd()
    }

    /// Clears [`Intake::fd`].
    pub(super) fn clear(&self) {
        let _ = crate::sys::eventfd_read(self.notify.as_fd());
    }

    /// Handshakes being read now.
    pub(super) fn pending(&self) -> usize {
        self.inbox.pending.load(Ordering::Acquire)
    }

    /// Whether another connection may be accepted now (the listeners are watched): fewer
    /// than [`MAX_PENDING_HANDSHAKES`] being read, or one of them silent long enough to be
    /// dropped for it.
    pub(super) fn has_room(&self) -> bool {
        if self.pending() >= MAX_HANDSHAKE_THREADS {
            return false;
        }
        let r = self.inbox.reading.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        r.len() < MAX_PENDING_HANDSHAKES || r.iter().any(|p| p.silent(now))
    }

    /// When there will be room again, if there is none now for want of a connection silent
    /// long enough to be dropped (the supervisor wakes then; a thread that ends wakes it
    /// sooner).
    pub(super) fn room_at(&self) -> Option<Instant> {
        if self.has_room() || self.pending() >= MAX_HANDSHAKE_THREADS {
            return None;
        }
        let r = self.inbox.reading.lock().unwrap_or_else(|e| e.into_inner());
        r.iter()
            .filter(|p| !crate::sys::is_readable(p.stream.as_fd()))
            .map(|p| p.since + SILENT_FOR)
            .min()
    }

    /// Drops the oldest connection silent for [`SILENT_FOR`]; whether there was one.
    fn drop_silent(&self) -> bool {
        let mut r = self.inbox.reading.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let Some(i) = r.iter().position(|p| p.silent(now)) else {
            return false;
        };
        let p = r.remove(i);
        drop(r);
        // Its thread reads the end of the stream, and ends.
        let _ = p.stream.shutdown(std::net::Shutdown::Both);
        self.ending.log.say(&format!(
            "dropped a connection silent for {:.1} s to make room ({MAX_PENDING_HANDSHAKES} \
             handshakes pending)",
            now.duration_since(p.since).as_secs_f64()
        ));
        true
    }

    /// Accepts the connections waiting on `listener` (socket `socket`), a handshake thread
    /// each, while fewer than `cap` handshakes are in flight (`usize::MAX`: all of them, as
    /// a socket about to close must: those VMs would be left hung).
    pub(super) fn accept(&self, socket: usize, listener: &Listener, cap: usize) {
        let live = || {
            self.inbox
                .reading
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .len()
        };
        loop {
            if cap != usize::MAX
                && (live() >= cap || self.pending() >= MAX_HANDSHAKE_THREADS)
                && !self.has_room()
            {
                return;
            }
            let stream = match listener.socket().accept() {
                Ok((stream, _)) => stream,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    // Out of descriptors, say: the connection stays queued and the listener
                    // readable; wait a little rather than spin.
                    self.ending
                        .log
                        .say(&format!("accept failed: {e}; trying again in 100 ms"));
                    std::thread::sleep(Duration::from_millis(100));
                    return;
                }
            };
            if stream.set_nonblocking(false).is_err() {
                continue;
            }
            // Room for it: a connection silent long enough goes (has_room said one is).
            if cap != usize::MAX && live() >= cap {
                self.drop_silent();
            }
            let Ok(second) = stream.try_clone() else {
                continue;
            };
            let key = self.inbox.keys.fetch_add(1, Ordering::Relaxed);
            self.inbox
                .reading
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(Reading {
                    key,
                    since: Instant::now(),
                    stream: second,
                });
            self.inbox.pending.fetch_add(1, Ordering::AcqRel);
            let (inbox, notify) = (self.inbox.clone(), self.notify.clone());
            let (timeout, ending) = (self.timeout, self.ending.clone());
            let status = self.status.clone();
            let spawned = std::thread::Builder::new()
                .name("guestmem-handshake".into())
                .spawn(move || {
                    // A panic (a bug) must not leave the count up: a drain waits on it.
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        receive_checked(stream, timeout)
                    }));
                    if let Ok(result) = r {
                        let mut g = inbox.results.lock().unwrap_or_else(|e| e.into_inner());
                        match g.closed {
                            Some(why) => {
                                drop(g);
                                end_late(result, why, &ending, &status);
                            }
                            None => g.arrivals.push_back(Arrival { socket, result }),
                        }
                    }
                    inbox
                        .reading
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .retain(|p| p.key != key);
                    inbox.pending.fetch_sub(1, Ordering::AcqRel);
                    let _ = crate::sys::eventfd_signal(notify.as_fd());
                });
            if let Err(e) = spawned {
                self.inbox
                    .reading
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .retain(|p| p.key != key);
                self.inbox.pending.fetch_sub(1, Ordering::AcqRel);
                self.ending.log.say(&format!(
                    "dropped a connection: no thread for its handshake: {e}"
                ));
            }
        }
    }

    /// The next handshake that has ended, if any.
    pub(super) fn take(&self) -> Option<Arrival> {
        self.inbox
            .results
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .arrivals
            .pop_front()
    }

    /// Waits, at most `grace`, until no handshake is in flight (each ends within the
    /// handshake timeout). Arrivals stay for [`Intake::take`].
    pub(super) fn settle(&self, grace: Duration) {
        let deadline = Instant::now() + grace;
        while self.pending() > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            let mut fds = [PollFd::readable(self.notify.as_fd())];
            let _ = crate::sys::poll(&mut fds, Some(left));
            self.clear();
        }
    }

    /// Stops taking VMs: from here a VM whose handshake completes ends itself (told `why`).
    /// Returns what arrived before, for the caller to admit or end.
    pub(super) fn close(&self, why: Closed) -> Vec<Arrival> {
        let mut g = self.inbox.results.lock().unwrap_or_else(|e| e.into_inner());
        g.closed.get_or_insert(why);
        g.arrivals.drain(..).collect()
    }

    /// Ends the VM of an arrival the server will not serve (told `why`); a connection that
    /// sent no userfaultfd is only dropped.
    pub(super) fn end(&self, a: Arrival, why: Closed) {
        end_late(a.result, why, &self.ending, &self.status);
    }
}

/// Ends a VM whose handshake completed after the server stopped taking them, counted and
/// logged as refused (as a VM refused at admission is).
fn end_late(r: Result<Handshake, Refused>, why: Closed, ending: &Ending, status: &StatusHandle) {
    let late = match r {
        Ok(h) => Some((
            h.process,
            ServeError::Handshake(match why {
                Closed::HasItsVm => HandshakeError::Late,
                Closed::Draining => HandshakeError::Draining,
            }),
        )),
        Err(Refused { error, process }) => process.map(|p| (p, error)),
    };
    if let Some((p, why)) = late {
        ending.end(&p, &why);
        status.refused();
        let reason = why.to_string();
        ending.log.session(
            &SessionEvent {
                event: "refused",
                session: None,
                pid: p.pid(),
                socket: None,
                bytes: 0,
                reason: Some(&reason),
                failed: true,
            },
            &format!(
                "peer {} refused: {reason}",
                p.pid().map_or("?".into(), |p| p.to_string())
            ),
        );
    }
}
