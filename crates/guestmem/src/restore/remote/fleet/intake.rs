//! The fleet's intake: connections accepted, handshakes read on threads of their own
//! (at most `MAX_PENDING_HANDSHAKES` at once), their results admitted by the supervisor, and
//! what happens to a VM whose handshake completes after the fleet stopped taking them.

use std::io;
use std::os::fd::AsFd;
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::super::handshake::{receive_checked, Handshake, Refused};
use super::super::listen::MAX_PENDING_HANDSHAKES;
use super::super::{end_peer, ServeConfig, ServeError};
use super::{drain_eventfd, pollin, Fleet, DRAIN_HANDSHAKE_GRACE};

impl Fleet {
    /// Before a hand-off: waits (at most [`DRAIN_HANDSHAKE_GRACE`]) for handshakes in
    /// flight, admits what came, and closes the inbox (a VM whose handshake completes later
    /// ends itself rather than waits for a server that has gone).
    pub(super) fn settle_handshakes(&mut self) {
        let deadline = Instant::now() + DRAIN_HANDSHAKE_GRACE;
        while self.inbox.pending.load(Ordering::Acquire) > 0 && Instant::now() < deadline {
            let mut p = pollin(self.notify.as_fd());
            let ms = deadline
                .saturating_duration_since(Instant::now())
                .as_millis()
                .clamp(1, 1000) as i32;
            // SAFETY: one live pollfd.
            unsafe { libc::poll(&mut p, 1, ms) };
            drain_eventfd(self.notify.as_fd());
            self.take_results();
        }
        self.close_inbox();
    }

    /// Stops taking handshakes: from here a VM whose handshake completes ends itself
    /// (`end_late`); what came before is admitted.
    pub(super) fn close_inbox(&mut self) {
        self.inbox
            .results
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .closed = true;
        self.take_results();
    }

    /// Accepts the connections waiting on socket `i`, a handshake thread each (at most
    /// [`MAX_PENDING_HANDSHAKES`] in flight; the rest wait in the backlog).
    pub(super) fn accept(&mut self, i: usize) {
        self.accept_up_to(i, MAX_PENDING_HANDSHAKES);
    }

    /// Accepts every connection waiting on socket `i`, past the cap (a drain: the socket is
    /// about to close, and those VMs would be left hung).
    pub(super) fn accept_all(&mut self, i: usize) {
        self.accept_up_to(i, usize::MAX);
    }

    pub(super) fn accept_up_to(&mut self, i: usize, cap: usize) {
        let Some(l) = &self.listeners[i] else { return };
        while self.inbox.pending.load(Ordering::Acquire) < cap {
            let stream = match l.socket().accept() {
                Ok((stream, _)) => stream,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    // Out of descriptors, say: the connection stays queued and the listener
                    // readable; wait a little rather than spin.
                    self.cfg
                        .serve
                        .log
                        .say(&format!("accept failed: {e}; trying again in 100 ms"));
                    std::thread::sleep(std::time::Duration::from_millis(100));
                    return;
                }
            };
            if stream.set_nonblocking(false).is_err() {
                continue;
            }
            self.inbox.pending.fetch_add(1, Ordering::AcqRel);
            let (inbox, notify) = (self.inbox.clone(), self.notify.clone());
            let timeout = self.cfg.serve.handshake_timeout;
            let late_cfg = ServeConfig {
                first: Vec::new(),
                ..self.cfg.serve.clone()
            };
            let spawned = std::thread::Builder::new()
                .name("guestmem-handshake".into())
                .spawn(move || {
                    // A panic (a bug) must not leave the count up: the drain waits on it.
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        receive_checked(stream, timeout)
                    }));
                    let Ok(r) = r else {
                        inbox.pending.fetch_sub(1, Ordering::AcqRel);
                        let _ = crate::sys::eventfd_signal(notify.as_fd());
                        return;
                    };
                    let mut g = inbox.results.lock().unwrap_or_else(|e| e.into_inner());
                    if g.closed {
                        drop(g);
                        end_late(r, &late_cfg);
                    } else {
                        g.results.push_back((i, r));
                        drop(g);
                    }
                    inbox.pending.fetch_sub(1, Ordering::AcqRel);
                    let _ = crate::sys::eventfd_signal(notify.as_fd());
                });
            if let Err(e) = spawned {
                self.inbox.pending.fetch_sub(1, Ordering::AcqRel);
                self.cfg.serve.log.say(&format!(
                    "dropped a connection: no thread for its handshake: {e}"
                ));
            }
        }
    }

    /// Admits or refuses every handshake that has finished.
    pub(super) fn take_results(&mut self) {
        loop {
            let next = self
                .inbox
                .results
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .results
                .pop_front();
            match next {
                None => return,
                Some((i, Ok(h))) => self.admit(i, h),
                Some((
                    _,
                    Err(Refused {
                        error,
                        process: Some(p),
                    }),
                )) => {
                    end_peer(&p, &self.cfg.serve, &error);
                    self.refused(p.pid(), 0, error.to_string());
                }
                Some((_, Err(Refused { error, .. }))) => {
                    self.report.dropped += 1;
                    self.status.dropped();
                    self.cfg.serve.log.say(&format!(
                        "dropped a connection that is not a VM's (it sent no userfaultfd): \
                         {error}"
                    ));
                }
            }
        }
    }
}

/// Ends a VM whose handshake completed after the fleet stopped taking them.
pub(super) fn end_late(r: Result<Handshake, Refused>, cfg: &ServeConfig) {
    let late = match r {
        Ok(h) => Some((
            h.process,
            ServeError::Handshake(super::super::HandshakeError::Draining),
        )),
        Err(Refused { error, process }) => process.map(|p| (p, error)),
    };
    if let Some((p, why)) = late {
        end_peer(&p, cfg, &why);
    }
}
