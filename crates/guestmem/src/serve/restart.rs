//! Surviving the server's own crash, and a hand-over: what a VM's session record holds is
//! made here ([`record_of`]), and a VM is taken back from its record ([`take_back`]): its
//! memory file found among the sockets by identity, its regions checked again, its
//! userfaultfd taken back from the VM itself (`pidfd_getfd`) or as the old server handed
//! it. The server then serves it as a resumed session (see [`super::Server::run`] for what
//! is promised).

use std::os::fd::OwnedFd;

use super::error::RecordProblem;
use super::files::MemoryFile;
use super::peer::PeerProcess;
use super::regions::UffdRegion;
use super::session::{Refusal, Session};
use super::state::SessionRecord;
use super::ServeError;
use crate::uffd::Uffd;

/// A VM taken back: the socket whose memory file it was served, its regions and
/// userfaultfd, and its process.
pub(super) struct TakenBack {
    pub(super) socket: usize,
    pub(super) regions: Vec<UffdRegion>,
    pub(super) uffd: Uffd,
    pub(super) process: PeerProcess,
}

/// What a later server needs to serve `session`'s VM again, its memory file `memory`.
///
/// For a hand-off (`handing_off`) the VM's userfaultfd travels with the record (over
/// `SCM_RIGHTS`), so its number in the VM, which only a later restart needs and which
/// takes ptrace access to the VM to find, is `-1` where it cannot be found, for a VM with
/// no record on disk (one with a record had its number found at admission: a record under
/// another key would be taken back a second time from the disk). Such a record, read back
/// at a restart, cannot take the VM back (the VM is ended then, never left hung).
pub(super) fn record_of(
    session: &Session,
    memory: &MemoryFile,
    handing_off: bool,
) -> Result<SessionRecord, RecordProblem> {
    let p = session.process();
    let pid = p.pid().ok_or(RecordProblem::NoPid)?;
    let start = p.start_time().ok_or(RecordProblem::NoStartTime)?;
    let fd = match p.fd_number_of(session.uffd_fd()) {
        Ok(n) => n,
        Err(_) if handing_off && session.record.is_none() => -1,
        Err(e) => return Err(RecordProblem::UffdNumber(e)),
    };
    let mem = memory.identity().map_err(RecordProblem::MemoryFile)?;
    Ok(SessionRecord::new(pid, start, fd, mem, session.regions()))
}

/// Which of `memories` the VM of record `r` was served (the same device, inode, size and
/// modification time), if any.
pub(super) fn served_from(r: &SessionRecord, memories: &[&MemoryFile]) -> Option<usize> {
    memories
        .iter()
        .position(|m| m.identity().is_ok_and(|id| id == r.mem))
}

/// Takes back the VM of record `r` (its process reopened as `process`): its userfaultfd
/// as handed over, or taken from the VM. `memories` are the sockets' memory files, in
/// order.
pub(super) fn take_back(
    r: &SessionRecord,
    process: PeerProcess,
    handed: Option<OwnedFd>,
    memories: &[&MemoryFile],
) -> Result<TakenBack, Refusal> {
    let Some(socket) = served_from(r, memories) else {
        return Err((ServeError::Unmatched { pid: r.pid }, process));
    };
    let regions = match r.regions() {
        Ok(x) => x,
        Err(e) => return Err((e, process)),
    };
    let fd = match handed {
        Some(fd) => Ok(fd),
        None => process.take_fd(r.uffd_fd),
    };
    match fd.and_then(Uffd::from_received) {
        Ok(uffd) => Ok(TakenBack {
            socket,
            regions,
            uffd,
            process,
        }),
        Err(source) => Err((
            ServeError::TakeBack {
                pid: r.pid,
                fd: r.uffd_fd,
                source,
            },
            process,
        )),
    }
}
