//! The VMs a server did not admit itself, and those it lets go whole: taken back from the
//! state directory's records after a restart or from a server that handed them over, and,
//! at the end, graduated (a drain) or handed to the next server.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;

use super::{RecordKey, Server};
use crate::serve::files::MemoryFile;
use crate::serve::handoff::{Asked, Outgoing};
use crate::serve::intake::Closed;
use crate::serve::peer::PeerProcess;
use crate::serve::report::SessionEnd;
use crate::serve::restart::{record_of, take_back};
use crate::serve::session::{Concluded, Over, Session};
use crate::serve::state::SessionRecord;
use crate::serve::ServeError;

/// VMs graduated side by side at most (each brings in the rest of its memory with a
/// prefetch thread of its own).
const GRADUATING: usize = 16;

impl Server {
    /// Serves the VMs another server handed over, as after a restart; their records' keys:
    /// those served (the state directory's copies are not taken back a second time), and
    /// those gone or not served (their copies are removed, not left for a later server).
    pub(super) fn resume_handed(&mut self) -> (Vec<RecordKey>, Vec<RecordKey>) {
        let (mut served, mut dropped) = (Vec::new(), Vec::new());
        let handed = std::mem::take(&mut self.handed);
        for h in handed.into_iter().flat_map(|t| t.into_sessions()) {
            let r = &h.record;
            let process = match PeerProcess::reopen(r.pid, r.start_time) {
                Ok(p) => p,
                Err(e) => {
                    self.ending
                        .log
                        .say(&format!("handed-over VM {}: gone ({e})", r.pid));
                    dropped.push(RecordKey::of(r));
                    continue;
                }
            };
            if self.resume(r, process, Some(h.uffd), h.removed) {
                self.ending.log.say(&format!(
                    "took over peer {} (socket {} before) from the old server",
                    r.pid, h.index
                ));
                served.push(RecordKey::of(r));
            } else {
                dropped.push(RecordKey::of(r));
            }
        }
        (served, dropped)
    }

    /// Takes back every VM the state directory records (see [`Server::run`]), but those
    /// `handed` over already; the records of those `dropped` (handed over, then gone or not
    /// served) are removed.
    pub(super) fn resume_recorded(&mut self, handed: &[RecordKey], dropped: &[RecordKey]) {
        let Some(state) = &self.state else { return };
        let records = state.records();
        for (path, read) in records {
            let r = match read {
                Ok(r) => r,
                Err(e) => {
                    self.ending.log.say(&format!(
                        "session record {}: unreadable, left as it is: {e}",
                        path.display()
                    ));
                    continue;
                }
            };
            if handed.contains(&RecordKey::of(&r)) {
                // Handed over by the old server and served already.
                continue;
            }
            if dropped.contains(&RecordKey::of(&r)) {
                // Handed over, and gone or ended since: no later server is to take it back.
                self.forget_path(&path);
                continue;
            }
            let process = match PeerProcess::reopen(r.pid, r.start_time) {
                Ok(p) => p,
                Err(e)
                    if matches!(e.raw_os_error(), Some(libc::ESRCH))
                        || e.kind() == std::io::ErrorKind::NotFound =>
                {
                    self.ending.log.say(&format!(
                        "session record {}: the VM has gone ({e}); record removed",
                        path.display()
                    ));
                    self.forget_path(&path);
                    continue;
                }
                Err(e) => {
                    // Not known to be gone: the record stays for a later server.
                    self.ending.log.say(&format!(
                        "session record {}: cannot reach the VM now ({e}); record kept",
                        path.display()
                    ));
                    continue;
                }
            };
            if self.resume(&r, process, None, None) {
                self.ending.log.say(&format!(
                    "took back peer {} (its userfaultfd {}) from a server that died",
                    r.pid, r.uffd_fd
                ));
            } else {
                self.forget_path(&path);
            }
        }
    }

    pub(super) fn forget_path(&self, path: &std::path::Path) {
        if let Some(state) = &self.state {
            state.forget(path);
        }
    }

    /// Serves the VM of record `r` again (its record written again, whole); whether it
    /// is. One that cannot be is ended as the policy says.
    pub(super) fn resume(
        &mut self,
        r: &SessionRecord,
        process: PeerProcess,
        handed: Option<OwnedFd>,
        removed: Option<OwnedFd>,
    ) -> bool {
        let mems: Vec<&MemoryFile> = self.sockets.iter().map(|s| &s.memory).collect();
        let started = take_back(r, process, handed, &mems).and_then(|t| {
            let ws = self.sockets[t.socket].working_set();
            let plan = self.plan(t.socket, &ws);
            Session::resume(t.regions, t.uffd, t.process, &plan)
        });
        match started {
            Ok(mut s) => {
                s.handed_removed = removed;
                self.start_session(s).is_ok()
            }
            Err((e, p)) => {
                let _ = self.refuse(p, 0, e);
                false
            }
        }
    }

    /// Graduates every VM still served, side by side (up to [`GRADUATING`] at once); the
    /// pool serves their faults meanwhile. A VM that cannot graduate (a failure, or a
    /// graduation that panicked) is ended as the policy says. A thread that cannot be had
    /// leaves its VMs to the threads that could and to this one: fewer side by side, none
    /// left behind.
    pub(super) fn graduate_all(&mut self) {
        let sessions = std::mem::take(&mut self.sessions);
        self.served_bytes = 0;
        let (pool, state) = (&self.pool, &self.state);
        let helpers = sessions.len().min(GRADUATING).saturating_sub(1);
        let queue = std::sync::Mutex::new(sessions.into_iter().collect::<Vec<_>>());
        let done = std::sync::Mutex::new(Vec::<Concluded>::new());
        let work = || loop {
            let next = queue.lock().unwrap_or_else(|e| e.into_inner()).pop();
            let Some((id, mut s)) = next else {
                return;
            };
            let graduated = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| s.graduate()));
            // Concluded whatever the graduation did, so that its VM is ended if it did not
            // graduate, never left with no one serving it.
            let concluded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
                pool.remove(id);
                if let (Some(state), Some(p)) = (state, &s.record) {
                    state.forget(p);
                }
                let end = match graduated {
                    Ok(Ok(())) => SessionEnd::Graduated,
                    Ok(Err(_)) if s.over() == Some(Over::PeerExited) => SessionEnd::PeerExited,
                    Ok(Err(_)) if s.let_go() => SessionEnd::PeerClosed,
                    Ok(Err(e)) => SessionEnd::Failed(Arc::new(ServeError::Serve(Box::new(e)))),
                    Err(_) => SessionEnd::Failed(Arc::new(ServeError::Io {
                        op: "graduate a VM",
                        source: std::io::Error::other("its graduation panicked"),
                    })),
                };
                s.conclude(id, end)
            }));
            match concluded {
                Ok(c) => done.lock().unwrap_or_else(|e| e.into_inner()).push(c),
                Err(_) => tracing::error!(session = id, "concluding a graduation panicked"),
            }
        };
        let started = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..helpers)
                .map_while(|_| {
                    std::thread::Builder::new()
                        .name("guestmem-graduate".into())
                        .spawn_scoped(sc, work)
                        .ok()
                })
                .collect();
            let started = hs.len();
            work();
            for h in hs {
                let _ = h.join();
            }
            started
        });
        if started < helpers {
            tracing::warn!(
                started,
                wanted = helpers,
                "graduating with fewer threads: no more could be created"
            );
        }
        for c in done.into_inner().unwrap_or_else(|e| e.into_inner()) {
            self.ended(c, "graduated");
        }
    }

    /// A hand-off asked for on the control socket ([`super::Drainer::hand_off`]): made.
    /// Whether everything went (the server then returns), or the new server did not take
    /// it and every VM is served on here.
    pub(super) fn hand_off_asked(&mut self) -> Result<bool, ServeError> {
        // Read before the slot is taken: a command that comes in between signals again. (A
        // server that serves on after a hand-off not taken must not find it readable for
        // ever.)
        let _ = crate::sys::eventfd_read(self.handoff.ready.as_fd());
        let to = self
            .handoff
            .to
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let Some((to, asked)) = to else {
            return Ok(false);
        };
        self.intake.settle(super::DRAIN_HANDSHAKE_GRACE);
        if !asked.acknowledged() {
            // An earlier version's hand-off: everything goes at once.
            for a in self.intake.close(Closed::Draining) {
                let _ = self.arrive(a);
            }
            self.hand_off(&to, asked);
            return Ok(true);
        }
        // VMs whose handshakes ended are handed with the rest; the intake stays open in
        // case the new server does not take them.
        self.admit_arrivals()?;
        if !self.hand_off(&to, asked) {
            return Ok(false);
        }
        // A handshake that ended since is not handed: ended as at a drain.
        for a in self.intake.close(Closed::Draining) {
            self.intake.end(a, Closed::Draining);
        }
        Ok(true)
    }

    /// Hands every socket and VM to the server on `to` and stops serving them: none is
    /// ended, none graduates (see `handoff.rs`); records stay on disk. Acknowledged (as the
    /// new server `asked`): only once the new server says it has taken them; where it does
    /// not (or a message cannot be sent), every VM is served on here, and this returns
    /// false. Otherwise everything goes with the end mark (a new server of an earlier
    /// version). Each VM's removed pages go with it where the new server asked for them.
    pub(super) fn hand_off(&mut self, to: &UnixStream, asked: Asked) -> bool {
        let acknowledged = asked.acknowledged();
        let out = Outgoing { to };
        let mut failed: Option<std::io::Error> = None;
        let mut sent = vec![false; self.sockets.len()];
        for (i, s) in self.sockets.iter().enumerate() {
            if let Some(l) = &s.listener {
                // Absolute: the new server, in another working directory, must find it.
                let path = std::path::absolute(l.path()).unwrap_or_else(|_| l.path().into());
                match out.listener(i, &path, l.socket().as_raw_fd()) {
                    Ok(()) => sent[i] = true,
                    Err(e) => failed = failed.or(Some(e)),
                }
            }
        }
        // Each VM stops being served here before it is sent: the new server may start as
        // soon as it has it.
        let ids: Vec<u64> = self.sessions.keys().copied().collect();
        let mut unsent = Vec::new();
        // Those whose process exited meanwhile (its record can no longer be made): not a
        // failure of the hand-off. Served again with the rest when it is not taken, where
        // the session ends as the exit it is.
        let mut exited = Vec::new();
        // Those no longer served here: with an acknowledgement, the first failure stops
        // the hand-off, and only these are served again.
        let mut stopped = Vec::new();
        // Why the connection failed, once a send on it did.
        let mut broken: Option<String> = None;
        for &id in &ids {
            if acknowledged && failed.is_some() {
                break;
            }
            self.pool.remove(id);
            stopped.push(id);
            let s = &self.sessions[&id];
            // A thread of the pool still at work on it reads no more of its messages: they
            // are the new server's (a remove read here would be lost to it).
            s.stop_reading();
            // Its removed pages go too, to a server that asked for them (an earlier one
            // would take the second descriptor for the next VM's). Where they cannot, the VM
            // goes without: the new server fills those pages, and the log says so.
            let removed = match asked {
                Asked::WithRemoved => s.removed_memfd().unwrap_or_else(|e| {
                    self.ending.log.say(&format!(
                        "peer {:?}: its removed pages cannot go with it ({e}): the new \
                         server fills them with the snapshot's bytes",
                        s.process().pid()
                    ));
                    None
                }),
                _ => None,
            };
            // Once a send failed (a new server that stopped reading made it wait its
            // SEND_WAIT), the connection is no good: the rest are not sent, each would wait
            // as long again (reached only without an acknowledgement, which stops at the
            // first failure).
            let handed = match &broken {
                Some(e) => Err(std::io::Error::other(format!(
                    "not sent: an earlier send on this hand-off failed ({e})"
                ))),
                None => record_of(s, &self.sockets[s.socket].memory, true)
                    .map_err(std::io::Error::other)
                    .and_then(|r| {
                        let removed = removed.as_ref().map(|f| f.as_raw_fd());
                        let sent = out.session(s.socket, r, s.uffd_fd().as_raw_fd(), removed);
                        if let Err(e) = &sent {
                            broken = Some(e.to_string());
                        }
                        sent
                    }),
            };
            if handed.is_err() && s.process().pidfd().is_some_and(crate::sys::is_readable) {
                exited.push(id);
                continue;
            }
            if let Err(e) = handed {
                let e = ServeError::HandOff(e);
                failed = failed.or(Some(std::io::Error::other(e.to_string())));
                unsent.push((id, e));
            }
        }
        if !acknowledged || failed.is_none() {
            // Only to a new server of this version: an earlier one's end mark is sent as it
            // was, byte for byte.
            let state_dir = self
                .state
                .as_ref()
                .map(|s| s.path())
                .filter(|_| acknowledged);
            if let Err(e) = out.end(acknowledged, state_dir) {
                failed = failed.or(Some(e));
            }
        }
        if acknowledged {
            let taken = match failed.take() {
                Some(e) => Err(e),
                None => out.acknowledged(),
            };
            if let Err(e) = taken {
                self.keep_serving(&stopped, e);
                return false;
            }
        }
        for (i, s) in self.sockets.iter_mut().enumerate() {
            // No socket is served here from now on: connections wait in the backlog the
            // new server took. Its path stays if it was handed.
            if let Some(mut l) = s.listener.take() {
                if sent[i] {
                    l.keep_path();
                }
            }
        }
        let handed = ids.len() - unsent.len() - exited.len();
        for id in ids {
            let Some(s) = self.sessions.remove(&id) else {
                continue;
            };
            // A VM that could not be handed is not left hung: it is ended.
            let end = match unsent.iter().position(|(u, _)| *u == id) {
                None if exited.contains(&id) => SessionEnd::PeerExited,
                None => SessionEnd::HandedOff,
                Some(k) => SessionEnd::Failed(Arc::new(unsent.swap_remove(k).1)),
            };
            let c = s.conclude(id, end);
            self.ended(c, "handed-off");
        }
        self.served_bytes = 0;
        self.ending.log.say(&format!(
            "handed {} sockets and {handed} VMs to the new server{}",
            sent.iter().filter(|&&s| s).count(),
            failed.map_or(String::new(), |e| format!(" (with an error: {e})"))
        ));
        true
    }

    /// After a hand-off the new server did not take (`why`): serves the VMs `ids` on, as
    /// before it. One the pool cannot take again is ended, never left hung.
    fn keep_serving(&mut self, ids: &[u64], why: std::io::Error) {
        for &id in ids {
            let Some(s) = self.sessions.get(&id) else {
                continue;
            };
            s.resume_reading();
            if let Err(e) = self.pool.add(id, s.pooled()) {
                // Ended as any session: its bytes given back, its record forgotten.
                let end = SessionEnd::Failed(Arc::new(ServeError::Io {
                    op: "serve a VM again after a hand-off not taken",
                    source: e,
                }));
                self.end_session(id, end, "failed");
            }
        }
        self.ending.log.say(&format!(
            "the new server did not take the hand-off ({why}): serving {} VMs on, and \
             listening",
            self.sessions.len()
        ));
    }
}
