//! The fleet's side of surviving its own crash: each session's record written when it is
//! admitted, and the VMs of a server that died taken back (see `state.rs` for the record and
//! [`Fleet::run`] for what is promised).

use std::io;

use super::super::peer::PeerProcess;
use super::super::state::SessionRecord;
use super::super::{end_peer, PageServer, ServeError};
use super::Fleet;

impl Fleet {
    /// Writes the session's record, if the fleet keeps them; a VM whose record cannot be
    /// written is served all the same (it would not outlive this server), with a log line.
    pub(super) fn record(&self, server: &PageServer, i: usize) -> Option<std::path::PathBuf> {
        let state = self.state.as_ref()?;
        let p = server.process();
        let written = self.session_record(server, i).and_then(|r| state.write(&r));
        match written {
            Ok(path) => Some(path),
            Err(e) => {
                self.cfg.serve.log.say(&format!(
                    "peer {}: no session record ({e}); it will not outlive this server",
                    p.pid().map_or("?".into(), |p| p.to_string())
                ));
                None
            }
        }
    }

    /// What a later server needs to serve `server`'s VM (of socket `i`) again.
    pub(super) fn session_record(
        &self,
        server: &PageServer,
        i: usize,
    ) -> Result<SessionRecord, String> {
        let p = server.process();
        let pid = p.pid().ok_or("no pid")?;
        let start = p.start_time().ok_or("no start time in /proc")?;
        let fd = p
            .fd_number_of(server.uffd_fd())
            .map_err(|e| format!("its userfaultfd's number: {e}"))?;
        let mem = self.mems[i]
            .identity()
            .map_err(|e| format!("the memory file: {e}"))?;
        Ok(SessionRecord::new(pid, start, fd, mem, server.regions()))
    }

    /// Serves the VMs another server handed over (see `handoff.rs`), as after a restart.
    pub(super) fn resume_handed(&mut self) {
        for h in std::mem::take(&mut self.handed) {
            let r = &h.record;
            self.adopted.insert((r.pid, r.start_time, r.uffd_fd));
            let process = match PeerProcess::reopen(r.pid, r.start_time) {
                Ok(p) => p,
                Err(e) => {
                    self.cfg
                        .serve
                        .log
                        .say(&format!("handed-over VM {}: gone ({e})", r.pid));
                    continue;
                }
            };
            match self.resume_one(r, process, Some(h.uffd)) {
                // The memory file is found by identity, whatever socket it is on now.
                Ok((i, server, bytes)) => {
                    self.cfg.serve.log.say(&format!(
                        "took over peer {} (socket {} before, {i} now) from the old server",
                        r.pid, h.index
                    ));
                    self.start_session(i, server, bytes);
                }
                Err((e, process)) => {
                    end_peer(&process, &self.cfg.serve, &e);
                    self.refused(process.pid(), 0, e.to_string());
                }
            }
        }
    }

    /// Takes back every VM the state directory records (see [`Fleet::run`]).
    pub(super) fn resume_all(&mut self) {
        let Some(state) = &self.state else { return };
        for (path, read) in state.records() {
            let r = match read {
                Ok(r) => r,
                Err(e) => {
                    self.cfg.serve.log.say(&format!(
                        "session record {}: unreadable, left as it is: {e}",
                        path.display()
                    ));
                    continue;
                }
            };
            if self.adopted.contains(&(r.pid, r.start_time, r.uffd_fd)) {
                // Handed over by the old server and served already.
                continue;
            }
            let process = match PeerProcess::reopen(r.pid, r.start_time) {
                Ok(p) => p,
                Err(e)
                    if matches!(e.raw_os_error(), Some(libc::ESRCH))
                        || e.kind() == io::ErrorKind::NotFound =>
                {
                    self.cfg.serve.log.say(&format!(
                        "session record {}: the VM has gone ({e}); record removed",
                        path.display()
                    ));
                    self.state.as_ref().expect("some").forget(&path);
                    continue;
                }
                Err(e) => {
                    // Not known to be gone: the record stays for a later server.
                    self.cfg.serve.log.say(&format!(
                        "session record {}: cannot reach the VM now ({e}); record kept",
                        path.display()
                    ));
                    continue;
                }
            };
            match self.resume_one(&r, process, None) {
                Ok((i, server, bytes)) => {
                    self.cfg.serve.log.say(&format!(
                        "took back peer {} (its userfaultfd {}) from a server that died",
                        r.pid, r.uffd_fd
                    ));
                    // Its record is written again (the same name, replaced whole).
                    self.start_session(i, server, bytes);
                }
                Err((e, process)) => {
                    end_peer(&process, &self.cfg.serve, &e);
                    self.refused(process.pid(), 0, e.to_string());
                    self.state.as_ref().expect("some").forget(&path);
                }
            }
        }
    }

    /// Serves the VM of record `r` again; which socket's file, its server and bytes.
    fn resume_one(
        &self,
        r: &SessionRecord,
        process: PeerProcess,
        handed: Option<std::os::fd::OwnedFd>,
    ) -> Result<(usize, PageServer, u64), (ServeError, PeerProcess)> {
        let Some(i) = self
            .mems
            .iter()
            .position(|m| m.identity().is_ok_and(|id| id == r.mem))
        else {
            let e = ServeError::MemoryFile {
                path: format!("(the file served to peer {})", r.pid).into(),
                reason: "no --mem-file given now is that file (device, inode, size and \
                         modification time): it was replaced or truncated, or not given"
                    .into(),
            };
            return Err((e, process));
        };
        let regions = match r.regions() {
            Ok(x) => x,
            Err(e) => return Err((e, process)),
        };
        let fd = match handed {
            Some(fd) => Ok(fd),
            None => process.take_fd(r.uffd_fd),
        };
        let uffd = match fd.and_then(crate::uffd::Uffd::from_received) {
            Ok(u) => u,
            Err(source) => {
                let e = ServeError::Socket {
                    op: format!("take back the userfaultfd {} of peer {}", r.uffd_fd, r.pid),
                    source,
                };
                return Err((e, process));
            }
        };
        let bytes = regions.iter().map(|x| x.size).sum();
        let mut cfg = self.cfg.serve.clone();
        cfg.first = self.firsts[i].clone();
        PageServer::resume((regions, uffd, process), &self.mems[i], &cfg)
            .map(|server| (i, server, bytes))
    }
}
