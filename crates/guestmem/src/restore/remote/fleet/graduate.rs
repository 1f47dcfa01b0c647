//! Drain's last step: every VM still served graduates (all its blocks in, then its ranges
//! unregistered), side by side, while the pool serves their faults.

use super::super::{end_peer, ServeError, SessionEvent};
use super::{Fleet, SessionEnd, SessionReport};

impl Fleet {
    /// Graduates every VM still served, side by side; the pool serves their faults
    /// meanwhile. A VM that cannot graduate (a failure) is ended as the policy says.
    pub(super) fn graduate_all(&mut self) {
        let sessions = std::mem::take(&mut self.sessions);
        let cfg = &self.cfg.serve;
        let pool = &self.pool;
        let state = &self.state;
        let status = &self.status;
        let learnt = &self.learnt;
        let done: Vec<SessionReport> = std::thread::scope(|sc| {
            let hs: Vec<_> = sessions
                .into_iter()
                .map(|(id, mut s)| {
                    sc.spawn(move || {
                        let graduated = s.server.graduate();
                        pool.remove(id);
                        if let (Some(state), Some(p)) = (state, &s.record) {
                            state.forget(p);
                        }
                        let gone = s.server.ended(0);
                        let (result, process) = s.server.conclude(Some("graduated"));
                        let (end, engine) = match (graduated, result) {
                            (Ok(_), Ok(r)) => {
                                super::learn::learn_into(learnt, cfg, s.socket, &r.working_set);
                                (SessionEnd::Graduated, Some(r.engine))
                            }
                            (Err(_), _) if gone == Some(Some("peer exited")) => {
                                (SessionEnd::PeerExited, None)
                            }
                            (Err(e), _) => {
                                let e = ServeError::Serve(e);
                                end_peer(&process, cfg, &e);
                                (SessionEnd::Failed(e.to_string()), None)
                            }
                            (Ok(_), Err(e)) => (SessionEnd::Failed(e.to_string()), None),
                        };
                        status.ended(id, engine.as_ref());
                        let reason = format!("{end:?}");
                        cfg.log.session(
                            &SessionEvent {
                                event: "graduated",
                                session: Some(id),
                                pid: process.pid(),
                                socket: s.socket,
                                bytes: s.bytes,
                                reason: Some(&reason),
                                failed: matches!(end, SessionEnd::Failed(_)),
                            },
                            &format!(
                                "session {id}: {end:?} after {:.3} s",
                                s.t0.elapsed().as_secs_f64()
                            ),
                        );
                        SessionReport {
                            id,
                            socket: s.socket,
                            pid: process.pid(),
                            bytes: s.bytes,
                            end,
                            engine,
                            served_secs: s.t0.elapsed().as_secs_f64(),
                        }
                    })
                })
                .collect();
            hs.into_iter().filter_map(|h| h.join().ok()).collect()
        });
        self.served_bytes = 0;
        self.report.sessions.extend(done);
    }
}
