//! A VM's session in the server, from its arrival to its end: admitted (the limits, the
//! plan, the record written before its first fault) or refused (the VM ended, the reason
//! logged), then ended when its VM goes, its serving fails or its memory file changes.

use std::sync::Arc;

use super::Server;
use crate::serve::error::MemoryFileProblem;
use crate::serve::handshake::{Handshake, Refused};
use crate::serve::intake::Arrival;
use crate::serve::peer::PeerProcess;
use crate::serve::report::SessionEnd;
use crate::serve::restart::record_of;
use crate::serve::session::{Concluded, Over, Plan, Session};
use crate::serve::{ServeError, SessionEvent};

impl Server {
    /// Admits the VM of an arrival, refuses it (ending it, and returning why), or drops a
    /// connection that sent no userfaultfd.
    pub(super) fn arrive(&mut self, a: Arrival) -> Result<(), ServeError> {
        match a.result {
            Ok(h) => self.admit(a.socket, h),
            Err(Refused {
                error,
                process: Some(p),
            }) => self.refuse(p, 0, error),
            Err(Refused {
                error,
                process: None,
            }) => {
                self.status.dropped();
                self.ending.log.say(&format!(
                    "dropped a connection that is not a VM's (it sent no userfaultfd): {error}"
                ));
                Ok(())
            }
        }
    }

    /// Serves the VM of handshake `h` on socket `i`, or refuses it (ending it).
    pub(super) fn admit(&mut self, i: usize, h: Handshake) -> Result<(), ServeError> {
        let bytes: u64 = h.regions.iter().map(|r| r.size).sum();
        if self.sockets[i].retired {
            let e = self.sockets[i].memory.error(MemoryFileProblem::Changed);
            return self.refuse(h.process, bytes, e);
        }
        if let Some(e) = self.over_limit(bytes) {
            return self.refuse(h.process, bytes, e);
        }
        let working_set = self.sockets[i].working_set();
        let plan = self.plan(i, &working_set);
        match Session::start(h, &plan) {
            Ok(s) => self.start_session(s).map(|_| ()),
            Err((e, p)) => self.refuse(p, bytes, e),
        }
    }

    /// What a session of socket `i` is started with, `working_set` its prefetch order.
    pub(super) fn plan<'a>(&'a self, i: usize, working_set: &'a [u64]) -> Plan<'a> {
        Plan {
            memory: &self.sockets[i].memory,
            socket: i,
            prefetch: (self.cfg.prefetch_threads > 0).then_some(working_set),
            block_bytes: self.cfg.block_bytes,
            regain_huge: self.cfg.regain_huge,
        }
    }

    /// The limit a VM of `bytes` would pass, if any.
    pub(super) fn over_limit(&self, bytes: u64) -> Option<ServeError> {
        if self.sessions.len() >= self.cfg.max_vms {
            return Some(ServeError::Limit {
                limit: "VMs served at once",
                have: self.sessions.len() as u64,
                needs: 1,
                max: self.cfg.max_vms as u64,
            });
        }
        match self.cfg.max_bytes {
            Some(max) if self.served_bytes.saturating_add(bytes) > max => Some(ServeError::Limit {
                limit: "guest memory served at once, bytes",
                have: self.served_bytes,
                needs: bytes,
                max,
            }),
            _ => None,
        }
    }

    /// Serves `session`'s VM on the pool, recorded in the state directory; its id. A VM
    /// the pool cannot take is refused (and ended).
    pub(super) fn start_session(&mut self, mut session: Session) -> Result<u64, ServeError> {
        let id = self.next_id;
        self.next_id += 1;
        let i = session.socket;
        // Recorded before its first fault is served: a server that dies from here on
        // leaves the record its successor needs.
        session.record = self.record(&session);
        let handed = session.handed_removed.take();
        self.keep_removes(&session, handed);
        if let Err(e) = self.pool.add(id, session.pooled()) {
            self.forget(&session);
            let bytes = session.bytes;
            let e = ServeError::Io {
                op: "add the VM to the serving threads",
                source: e,
            };
            return self.refuse(session.abandon(), bytes, e).map(|()| id);
        }
        let pid = session.process().pid();
        self.ending.log.session(
            &SessionEvent {
                event: "start",
                session: Some(id),
                pid,
                socket: Some(i),
                bytes: session.bytes,
                reason: None,
                failed: false,
            },
            &format!(
                "session {id}: peer {} on socket {i} sent {} regions ({} MiB); {} VMs served",
                pid.map_or("?".into(), |p| p.to_string()),
                session.regions().len(),
                session.bytes >> 20,
                self.sessions.len() + 1
            ),
        );
        self.served_bytes += session.bytes;
        self.status
            .started(id, i, pid, session.bytes, session.pooled());
        self.sessions.insert(id, session);
        Ok(id)
    }

    /// The pages its balloon removed under a previous server marked removed (`handed`: the
    /// memfd a server that handed it over sent; else, taken back, its record's file), and a
    /// removed-pages file beside its record from now on, if it has a record. Where either
    /// fails, the VM is served all the same (those pages filled with the snapshot's bytes),
    /// and the log says so.
    fn keep_removes(&self, session: &Session, handed: Option<std::os::fd::OwnedFd>) {
        let pid = session
            .process()
            .pid()
            .map_or("?".into(), |p| p.to_string());
        let record = self.state.as_ref().zip(session.record.as_ref());
        let file = record.map(|(state, path)| state.removed_file(path));
        let loaded = match (handed, &file) {
            (Some(fd), _) => Some(session.load_removes(&std::fs::File::from(fd))),
            (None, Some(Ok((f, true)))) if session.resumed() => Some(session.load_removes(f)),
            (None, Some(Ok((_, false)))) if session.resumed() => {
                self.ending.log.say(&format!(
                    "peer {pid}: no removed-pages file (a server of an earlier version): \
                     pages its balloon removed before are filled with the snapshot's bytes"
                ));
                None
            }
            _ => None,
        };
        match loaded {
            Some(Ok(0)) | None => {}
            Some(Ok(n)) => self.ending.log.say(&format!(
                "peer {pid}: {n} pages its balloon removed before stay removed"
            )),
            Some(Err(e)) => self.ending.log.say(&format!(
                "peer {pid}: the pages its balloon removed before could not be read ({e}): \
                 they are filled with the snapshot's bytes"
            )),
        }
        let kept = match file {
            None => return,
            Some(f) => f.and_then(|(f, _)| session.log_removes_to(f)),
        };
        if let Err(e) = kept {
            self.ending.log.say(&format!(
                "peer {pid}: the pages its balloon removes are not kept for a later server \
                 ({e}): one that takes it back fills them with the snapshot's bytes"
            ));
        }
    }

    /// Writes the session's record, if the server keeps them; a VM whose record cannot be
    /// written is served all the same (it would not outlive this server), with a log line.
    pub(super) fn record(&self, session: &Session) -> Option<std::path::PathBuf> {
        let state = self.state.as_ref()?;
        let written = record_of(session, &self.sockets[session.socket].memory, false)
            .and_then(|r| state.write(&r));
        match written {
            Ok(path) => Some(path),
            Err(problem) => {
                let e = ServeError::Record {
                    pid: session.process().pid(),
                    problem,
                };
                self.ending
                    .log
                    .say(&format!("{e}; the VM will not outlive this server"));
                None
            }
        }
    }

    /// Removes a session's record (it ended).
    pub(super) fn forget(&self, session: &Session) {
        if let (Some(state), Some(p)) = (&self.state, &session.record) {
            state.forget(p);
        }
    }

    /// Refuses a VM that sent its userfaultfd (ending it as the policy says), and returns
    /// why (always an error: what admitting it came to).
    pub(super) fn refuse(
        &mut self,
        p: PeerProcess,
        bytes: u64,
        e: ServeError,
    ) -> Result<(), ServeError> {
        self.ending.end(&p, &e);
        self.status.refused();
        let why = e.to_string();
        self.ending.log.session(
            &SessionEvent {
                event: "refused",
                session: None,
                pid: p.pid(),
                socket: None,
                bytes,
                reason: Some(&why),
                failed: true,
            },
            &format!(
                "peer {} refused: {why}",
                p.pid().map_or("?".into(), |p| p.to_string())
            ),
        );
        Err(e)
    }

    /// Ends session `id` if its VM went or its serving failed.
    pub(super) fn check_session(&mut self, id: u64) {
        let Some(over) = self.sessions.get(&id).and_then(Session::over) else {
            return;
        };
        if over == Over::PeerClosed {
            if let Some(s) = self.sessions.get_mut(&id).filter(|s| s.runs_on()) {
                s.follow_pidfd();
                let (pid, socket, bytes) = (s.process().pid(), s.socket, s.bytes);
                let why = "closed its socket and still holds its userfaultfd: served until \
                           its process exits";
                self.ending.log.session(
                    &SessionEvent {
                        event: "runs-on",
                        session: Some(id),
                        pid,
                        socket: Some(socket),
                        bytes,
                        reason: Some(why),
                        failed: false,
                    },
                    &format!(
                        "session {id}: peer {} {why}",
                        pid.map_or("?".into(), |p| p.to_string())
                    ),
                );
                return;
            }
        }
        let end = match over {
            Over::PeerClosed => SessionEnd::PeerClosed,
            Over::PeerExited => SessionEnd::PeerExited,
            Over::Failed => {
                let e = self.sessions[&id].failure();
                SessionEnd::Failed(Arc::new(e))
            }
        };
        self.end_session(id, end, "end");
    }

    /// Stops serving session `id`: out of the pool, its record removed, its engine halted;
    /// a failed one's VM ended as the policy says; what it did counted and logged.
    pub(super) fn end_session(&mut self, id: u64, end: SessionEnd, event: &'static str) {
        let Some(s) = self.sessions.remove(&id) else {
            return;
        };
        self.pool.remove(id);
        self.forget(&s);
        self.served_bytes -= s.bytes;
        let c = s.conclude(id, end);
        self.ended(c, event);
    }

    /// Counts, logs and keeps what a concluded session did; ends its VM if it failed, and
    /// teaches its socket its working set if not.
    pub(super) fn ended(&mut self, c: Concluded, event: &'static str) {
        let Concluded {
            report,
            process,
            collapse,
        } = c;
        match &report.end {
            SessionEnd::Failed(e) => self.ending.end(&process, e),
            SessionEnd::HandedOff => {}
            _ => self.sockets[report.socket].learn(&report.working_set, &self.ending),
        }
        self.status.ended(report.id, &report.end, &report.engine);
        let reason = report.end.to_string();
        self.ending.log.session(
            &SessionEvent {
                event,
                session: Some(report.id),
                pid: report.pid,
                socket: Some(report.socket),
                bytes: report.bytes,
                reason: Some(&reason),
                failed: matches!(report.end, SessionEnd::Failed(_)),
            },
            &format!(
                "session {}: {reason} after {:.3} s; {} VMs served",
                report.id,
                report.served_secs,
                self.sessions.len()
            ),
        );
        self.collapses.retain(|r| r.report().is_none());
        self.collapses.extend(collapse);
        self.last = Some(report);
    }

    /// Socket `i`'s memory file changed while served: every VM of it is ended (it would be
    /// served a mix of two files) and the socket takes no more VMs.
    pub(super) fn file_changed(&mut self, i: usize) {
        let e = Arc::new(self.sockets[i].memory.error(MemoryFileProblem::Changed));
        self.ending.log.warn(&e.to_string());
        // VMs already waiting in its backlog get their handshakes read, then are refused
        // (admit ends them) rather than dropped with the socket.
        self.sockets[i].retired = true;
        if let Some(l) = self.sockets[i].listener.take() {
            l.unpublish();
            self.intake.accept(i, &l, usize::MAX);
        }
        let ids: Vec<u64> = self
            .sessions
            .iter()
            .filter(|(_, s)| s.socket == i)
            .map(|(&id, _)| id)
            .collect();
        for id in ids {
            self.end_session(id, SessionEnd::Failed(e.clone()), "end");
        }
    }
}
