//! A VM's session in the fleet: admitted within the limits (or refused and ended), started
//! on the pool and recorded, and ended when its VM goes, its serving fails or its memory
//! file changes under it.

use std::time::Instant;

use super::super::handshake::Handshake;
use super::super::{end_peer, PageServer, ServeError, SessionEvent};
use super::learn::learn_into;
use super::{Fleet, Session, SessionEnd, SessionReport};
use crate::restore::lazy::{Handlers, Target};

impl Fleet {
    /// Serves the VM of handshake `h` on socket `i`, or refuses it at a limit (ending it).
    pub(super) fn admit(&mut self, i: usize, h: Handshake) {
        let bytes: u64 = h.regions.iter().map(|r| r.size).sum();
        if self.retired[i] {
            let e = ServeError::MemoryFile {
                path: self.mems[i].path().to_path_buf(),
                reason: "changed while served: this socket takes no more VMs".into(),
            };
            end_peer(&h.process, &self.cfg.serve, &e);
            self.refused(h.process.pid(), bytes, e.to_string());
            return;
        }
        let limit = if self.sessions.len() >= self.cfg.max_sessions {
            Some(ServeError::Limit {
                limit: "VMs served at once",
                have: self.sessions.len() as u64,
                needs: 1,
                max: self.cfg.max_sessions as u64,
            })
        } else {
            match self.cfg.max_bytes {
                Some(max) if self.served_bytes.saturating_add(bytes) > max => {
                    Some(ServeError::Limit {
                        limit: "guest memory served at once, bytes",
                        have: self.served_bytes,
                        needs: bytes,
                        max,
                    })
                }
                _ => None,
            }
        };
        if let Some(e) = limit {
            end_peer(&h.process, &self.cfg.serve, &e);
            self.refused(h.process.pid(), bytes, e.to_string());
            return;
        }
        let mut cfg = self.cfg.serve.clone();
        cfg.first = self.first_for(i);
        if !cfg.first.is_empty() && cfg.prefetch_threads == 0 {
            // A working set to replay: one thread per VM, below its faults in priority.
            cfg.prefetch_threads = 1;
        }
        let server =
            match PageServer::launch(h, &self.mems[i], &cfg, (Handlers::Pool, Target::Fresh)) {
                Ok(s) => s,
                Err((e, p)) => {
                    end_peer(&p, &cfg, &e);
                    self.refused(p.pid(), bytes, e.to_string());
                    return;
                }
            };
        self.start_session(i, server, bytes);
    }

    /// Serves `server`'s VM on the pool, recorded in the state directory.
    pub(super) fn start_session(&mut self, i: usize, server: PageServer, bytes: u64) {
        let cfg = &self.cfg.serve;
        let id = self.next_id;
        self.next_id += 1;
        // Recorded before its first fault is served: a server that dies from here on
        // leaves the record its successor needs.
        let record = self.record(&server, i);
        if let Err(e) = self.pool.add(id, server.pooled()) {
            if let (Some(state), Some(p)) = (&self.state, &record) {
                state.forget(p);
            }
            let (_, p) = server.conclude(None);
            let e = ServeError::Socket {
                op: "add the VM to the fault-serving pool".into(),
                source: e,
            };
            end_peer(&p, cfg, &e);
            self.refused(p.pid(), bytes, e.to_string());
            return;
        }
        self.cfg.serve.log.session(
            &SessionEvent {
                event: "start",
                session: Some(id),
                pid: server.peer_pid(),
                socket: i,
                bytes,
                reason: None,
                failed: false,
            },
            &format!(
                "session {id}: peer {} on socket {i} sent {} regions ({} MiB); {} VMs served",
                server.peer_pid().map_or("?".into(), |p| p.to_string()),
                server.regions().len(),
                bytes >> 20,
                self.sessions.len() + 1
            ),
        );
        self.served_bytes += bytes;
        self.status
            .started(id, i, server.peer_pid(), bytes, server.pooled());
        self.sessions.insert(
            id,
            Session {
                server,
                socket: i,
                bytes,
                t0: Instant::now(),
                record,
            },
        );
    }

    /// Merges a VM's working set into its socket's learnt one and keeps it (when learning).
    pub(super) fn learn(&self, socket: usize, ws: &[u64]) {
        learn_into(&self.learnt, &self.cfg.serve, socket, ws);
    }

    /// Records a VM refused (and already ended as the policy says).
    pub(super) fn refused(&mut self, pid: Option<i32>, bytes: u64, why: String) {
        self.status.refused();
        self.cfg.serve.log.session(
            &SessionEvent {
                event: "refused",
                session: None,
                pid,
                socket: usize::MAX,
                bytes,
                reason: Some(&why),
                failed: true,
            },
            &format!(
                "peer {} refused: {why}",
                pid.map_or("?".into(), |p| p.to_string())
            ),
        );
        self.report.sessions.push(SessionReport {
            id: u64::MAX,
            socket: usize::MAX,
            pid,
            bytes,
            end: SessionEnd::Failed(why),
            engine: None,
            served_secs: 0.0,
        });
    }

    /// Socket `i`'s memory file changed while served: every VM of it is ended (it would be
    /// served a mix of two files) and the socket takes no more VMs.
    pub(super) fn file_changed(&mut self, i: usize) {
        let e = ServeError::MemoryFile {
            path: self.mems[i].path().to_path_buf(),
            reason: "changed while served (written in place, truncated or touched): its VMs \
                     are ended and the socket closed; restart the server to serve the file \
                     as it is now"
                .into(),
        };
        self.cfg.serve.log.warn(&e.to_string());
        // VMs already waiting in its backlog get their handshakes read, then are refused
        // (admit ends them) rather than dropped with the socket.
        self.retired[i] = true;
        self.accept_all(i);
        if let Some(l) = self.listeners[i].take() {
            drop(l);
        }
        let ids: Vec<u64> = self
            .sessions
            .iter()
            .filter(|(_, s)| s.socket == i)
            .map(|(&id, _)| id)
            .collect();
        for id in ids {
            let Some(s) = self.sessions.remove(&id) else {
                continue;
            };
            self.pool.remove(id);
            if let (Some(state), Some(p)) = (&self.state, &s.record) {
                state.forget(p);
            }
            self.served_bytes -= s.bytes;
            let (result, process) = s.server.conclude(None);
            end_peer(&process, &self.cfg.serve, &e);
            self.status
                .ended(id, result.as_ref().ok().map(|r| &r.engine));
            self.report.sessions.push(SessionReport {
                id,
                socket: i,
                pid: process.pid(),
                bytes: s.bytes,
                end: SessionEnd::Failed(e.to_string()),
                engine: result.ok().map(|r| r.engine),
                served_secs: s.t0.elapsed().as_secs_f64(),
            });
        }
    }

    /// Ends session `id` if its VM went or its serving failed.
    pub(super) fn check_session(&mut self, id: u64) {
        let Some(ended) = self.sessions.get(&id).and_then(|s| s.server.ended(0)) else {
            return;
        };
        let s = self.sessions.remove(&id).expect("checked above");
        self.pool.remove(id);
        if let (Some(state), Some(p)) = (&self.state, &s.record) {
            state.forget(p);
        }
        self.served_bytes -= s.bytes;
        let (socket, bytes, t0) = (s.socket, s.bytes, s.t0);
        let (result, process) = s.server.conclude(ended);
        let (end, engine) = match result {
            Ok(r) => {
                self.learn(socket, &r.working_set);
                (
                    match ended {
                        Some("peer exited") => SessionEnd::PeerExited,
                        _ => SessionEnd::PeerClosed,
                    },
                    Some(r.engine),
                )
            }
            Err(e) => {
                end_peer(&process, &self.cfg.serve, &e);
                (SessionEnd::Failed(e.to_string()), None)
            }
        };
        self.status.ended(id, engine.as_ref());
        let reason = format!("{end:?}");
        self.cfg.serve.log.session(
            &SessionEvent {
                event: "end",
                session: Some(id),
                pid: process.pid(),
                socket,
                bytes,
                reason: Some(&reason),
                failed: matches!(end, SessionEnd::Failed(_)),
            },
            &format!(
                "session {id}: ended ({end:?}) after {:.3} s; {} VMs served",
                t0.elapsed().as_secs_f64(),
                self.sessions.len()
            ),
        );
        self.report.sessions.push(SessionReport {
            id,
            socket,
            pid: process.pid(),
            bytes,
            end,
            engine,
            served_secs: t0.elapsed().as_secs_f64(),
        });
    }
}
