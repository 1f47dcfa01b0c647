//! A zero-downtime upgrade: a running server hands its sockets and its VMs to a new server
//! (a new binary, say) over its control socket, with `SCM_RIGHTS`, and exits without
//! ending or graduating any VM.
//!
//! The new server ([`take_over`]) connects to the old one's control socket and sends
//! `handoff acknowledged`. The old one stops serving (its pool no longer reads the VMs'
//! faults, which wait in the kernel) and sends, one message each: every listening socket
//! (so no VM that connects meanwhile is refused: it waits in the same backlog), then every
//! VM's session record (the same record a restart reads) with its userfaultfd, then an end
//! mark. Nothing is given away yet: the new server checks that it can serve everything
//! (every socket is one of its own, every VM's memory file one it serves:
//! [`TakeOver::confirm`]) and only then says `taken`; the old server answers `yours` and
//! exits, leaving the socket paths in place and the records on disk. Without `taken`
//! within [`ACK_WAIT`] (the new server failed, was stopped, or cannot serve a VM), the old
//! server serves every VM on, and the new one, told nothing or something else, ends none.
//! The new server waits for the old process to be gone (its pidfd), takes the state
//! directory's lock if it keeps one, and serves every VM again as after a crash: pages
//! already in are left, the ranges are woken so waiting faults come again
//! ([`super::Server::run`]). The VMs stall only for the hand-over itself.
//!
//! A server of an earlier version knows only `handoff`: it hands over at once, with no
//! acknowledgement, and exits. [`take_over`] falls back to that when the old server does
//! not know the new command, and a server still answers `handoff` so (an older new server
//! taking over from it).

use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::files::MemoryFile;
use super::handshake::{receive_checked, recv_with_fds};
use super::peer::{same_user, PeerProcess};
use super::state::SessionRecord;
use super::{Listener, ServeError};

/// The command a new server of an earlier version sends: a hand-off with no
/// acknowledgement.
pub(super) const COMMAND: &str = "handoff";
/// The command a new server of an earlier version sends: a hand-off it acknowledges once it
/// knows it can serve everything.
pub(super) const COMMAND_ACKNOWLEDGED: &str = "handoff acknowledged";
/// The command a new server sends: as [`COMMAND_ACKNOWLEDGED`], and it takes each VM's
/// removed pages (a second descriptor). A server of an earlier version, which knows only
/// the commands before, answers it as unknown, and the new server asks again with those.
pub(super) const COMMAND_REMOVED: &str = "handoff acknowledged removed";

/// What a new server asked for, by the command it sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Asked {
    /// [`COMMAND`]: everything at once, with the end mark.
    AtOnce,
    /// [`COMMAND_ACKNOWLEDGED`]: nothing given away until it says `taken`.
    Acknowledged,
    /// [`COMMAND_REMOVED`]: as that, each VM with its removed pages.
    WithRemoved,
}

impl Asked {
    /// The hand-off a control-socket line asks for, if it asks for one.
    pub(super) fn parse(line: &str) -> Option<Asked> {
        match line {
            COMMAND => Some(Asked::AtOnce),
            COMMAND_ACKNOWLEDGED => Some(Asked::Acknowledged),
            COMMAND_REMOVED => Some(Asked::WithRemoved),
            _ => None,
        }
    }

    /// Whether the new server acknowledges what it takes.
    pub(super) fn acknowledged(self) -> bool {
        self != Asked::AtOnce
    }
}
/// How long an old server waits, after its end mark, for the new server's `taken`; then it
/// serves on.
pub(super) const ACK_WAIT: Duration = Duration::from_secs(30);
/// How long a new server waits, once told `yours`, for the old one to exit (it stops its
/// prefetch threads first, which may be waiting on a fetch up to its deadline) before it
/// gives up and ends the VMs handed: no other server will serve them.
pub(super) const EXIT_WAIT: Duration = Duration::from_secs(120);
/// How long a new server waits for the old one's `yours` (sent as soon as it reads
/// `taken`).
const YOURS_WAIT: Duration = Duration::from_secs(10);
/// The new server's acknowledgement, and the old server's answer.
const TAKEN: &[u8] = b"taken\n";
const YOURS: &[u8] = b"yours\n";

/// One message of a hand-off (its descriptors travel beside it).
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
enum Message {
    /// A listening socket (one descriptor): the fleet's socket `index`, at `path`.
    Listener { index: usize, path: PathBuf },
    /// A VM (one descriptor: its userfaultfd) of socket `index`; `removed`: a second
    /// descriptor follows, a file of the pages its balloon removed (see the lazy engine's
    /// `removed_log.rs`; absent from a server of an earlier version, and never sent to one).
    Session {
        index: usize,
        record: SessionRecord,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        removed: bool,
    },
    /// Nothing more; `ack`: nothing is given away until the new server says `taken`
    /// (absent from a server of an earlier version).
    End {
        // Left out when false: the end mark an earlier version sent, byte for byte.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        ack: bool,
        /// The old server's state directory, where it keeps one: the new server must keep
        /// its records there too.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        state_dir: Option<PathBuf>,
    },
}

/// Sends `bytes` with `fds` in one `sendmsg`.
fn send_with_fds(s: &UnixStream, bytes: &[u8], fds: &[RawFd]) -> io::Result<()> {
    // u64 words keep the control buffer aligned for cmsghdr.
    let mut control = [0u64; 8];
    let data_len = std::mem::size_of_val(fds);
    // SAFETY: CMSG_SPACE is arithmetic.
    let space = unsafe { libc::CMSG_SPACE(data_len as u32) } as usize;
    assert!(space <= std::mem::size_of_val(&control) && !bytes.is_empty());
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    // SAFETY: an all-zero msghdr is valid (null pointers, zero lengths); set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        msg.msg_control = control.as_mut_ptr() as *mut libc::c_void;
        msg.msg_controllen = space;
        // SAFETY: the control buffer holds `space` bytes, enough for one cmsghdr carrying
        // `fds`; CMSG_FIRSTHDR and CMSG_DATA point inside it.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(data_len as u32) as usize;
            std::ptr::copy_nonoverlapping(fds.as_ptr() as *const u8, libc::CMSG_DATA(c), data_len);
        }
    }
    // SAFETY: msg points at live iov (over `bytes`) and control buffers; the kernel only
    // reads them.
    let n = unsafe { libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if n as usize != bytes.len() {
        return Err(io::Error::other("a hand-off message was cut short"));
    }
    Ok(())
}

/// One message as sent: its JSON, then a newline (a message is one `sendmsg`; the kernel
/// never joins two that carry descriptors into one read).
fn send(s: &UnixStream, m: &Message, fds: &[RawFd]) -> io::Result<()> {
    let mut text = serde_json::to_vec(m).map_err(io::Error::other)?;
    text.push(b'\n');
    send_with_fds(s, &text, fds)
}

/// The old server's side: what it hands over.
pub(super) struct Outgoing<'a> {
    pub(super) to: &'a UnixStream,
}

impl Outgoing<'_> {
    pub(super) fn listener(&self, index: usize, path: &Path, fd: RawFd) -> io::Result<()> {
        send(
            self.to,
            &Message::Listener {
                index,
                path: path.to_path_buf(),
            },
            &[fd],
        )
    }

    pub(super) fn session(
        &self,
        index: usize,
        record: SessionRecord,
        uffd: RawFd,
        removed: Option<RawFd>,
    ) -> io::Result<()> {
        let m = Message::Session {
            index,
            record,
            removed: removed.is_some(),
        };
        match removed {
            Some(r) => send(self.to, &m, &[uffd, r]),
            None => send(self.to, &m, &[uffd]),
        }
    }

    pub(super) fn end(&self, ack: bool, state_dir: Option<&Path>) -> io::Result<()> {
        let state_dir = state_dir.map(|d| d.canonicalize().unwrap_or_else(|_| d.to_path_buf()));
        send(self.to, &Message::End { ack, state_dir }, &[])
    }

    /// Waits for the new server's `taken` (at most [`ACK_WAIT`]) and answers `yours`:
    /// from then on its VMs are the new server's. Anything else (nothing said, the
    /// connection closed, another answer) is an error that says which, and leaves them
    /// here.
    pub(super) fn acknowledged(&self) -> io::Result<()> {
        let line = read_line(self.to, TAKEN.len(), ACK_WAIT).map_err(|e| match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => io::Error::new(
                io::ErrorKind::TimedOut,
                format!("no acknowledgement within {} s", ACK_WAIT.as_secs()),
            ),
            _ => e,
        })?;
        if line.is_empty() {
            return Err(io::Error::other(
                "it closed the connection without an acknowledgement",
            ));
        }
        if line != TAKEN {
            return Err(io::Error::other(format!(
                "it answered {:?}",
                String::from_utf8_lossy(&line)
            )));
        }
        let mut to = self.to;
        to.write_all(YOURS)
    }
}

/// Bytes up to and including a newline, at most `max` of them (fewer at the end of the
/// stream or past `max`), read one at a time so that nothing after the line is taken;
/// within `limit` for the whole line (a timed-out read is an error).
fn read_line(mut s: &UnixStream, max: usize, limit: Duration) -> io::Result<Vec<u8>> {
    let deadline = Instant::now() + limit;
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while line.len() < max && line.last() != Some(&b'\n') {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::from(io::ErrorKind::TimedOut));
        }
        s.set_read_timeout(Some(left))?;
        match s.read(&mut b) {
            Ok(0) => break,
            Ok(_) => line.push(b[0]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(line)
}

/// A VM handed over: its record and its userfaultfd.
#[derive(Debug)]
pub struct HandedSession {
    pub(super) index: usize,
    pub(super) record: SessionRecord,
    pub(super) uffd: OwnedFd,
    /// The pages its balloon removed, as the old server last knew them.
    pub(super) removed: Option<OwnedFd>,
}

/// What a running server handed over ([`take_over`]): its VMs are this server's once
/// [`TakeOver::confirm`] has succeeded. Dropped before that, it gives nothing away (the
/// old server serves on); after, whatever no server took is ended.
#[derive(Debug)]
pub struct TakeOver {
    listeners: Vec<(usize, PathBuf, OwnedFd)>,
    /// A descriptor of each handed socket given out by [`TakeOver::listener`]: until a
    /// server serves them ([`TakeOver::into_sessions`]), VMs in their backlogs are this
    /// take-over's to end if it is dropped.
    claimed: Vec<(PathBuf, OwnedFd)>,
    pub(super) sessions: Vec<HandedSession>,
    /// The connection to the old server, until it has said `yours` (`None` with a server
    /// of an earlier version, which gave everything away with its end mark).
    pending: Option<UnixStream>,
    /// Whether the VMs are this server's (the old one said `yours`, or gave them away).
    owned: bool,
    /// The old server's state directory, where it keeps one.
    old_state_dir: Option<PathBuf>,
    old: PeerProcess,
    t0: Instant,
    /// The old server's process id.
    pub old_pid: Option<i32>,
    /// From sending the command to the old server's exit, seconds (its VMs' faults waited
    /// no longer than this before the new server can serve them).
    pub handed_secs: f64,
}

impl TakeOver {
    /// The listening socket that was at `path` (socket `index` of the old server), to serve
    /// on in its place.
    pub fn listener(&mut self, path: &Path) -> Result<Option<Listener>, ServeError> {
        use std::os::unix::fs::MetadataExt;
        // The same file, however the path is spelled (relative, absolute, through a link).
        let id = |p: &Path| std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino()));
        let want = id(path);
        let Some(k) = self
            .listeners
            .iter()
            .position(|(_, p, _)| p == path || (want.is_some() && id(p) == want))
        else {
            return Ok(None);
        };
        let (_, p, fd) = self.listeners.remove(k);
        let serr = |source| ServeError::Io {
            op: "keep a handed socket",
            source,
        };
        self.claimed
            .push((p.clone(), fd.try_clone().map_err(serr)?));
        // Its path stays when it is dropped until the take-over is confirmed: the old
        // server, which serves on if it is not, listens there too.
        Listener::adopt(fd, &p, true).map(Some)
    }

    /// Makes the VMs this server's, once it knows it can serve them: every handed socket
    /// was given out by [`TakeOver::listener`], every VM's memory file is among `memories`
    /// (the same device, inode, size and modification time), and where the old server kept
    /// a state directory, `state_dir` is that one (a server started later on the old
    /// directory would take back VMs this one serves). Then says `taken`
    /// to the old server, which answers `yours` and exits; waits, at most `wait`, for that.
    /// Nothing to do with a server of an earlier version, or when confirmed already.
    ///
    /// When a check fails or the old server does not answer `yours`, nothing was given
    /// away: the old server serves every VM on (within [`ACK_WAIT`] of its end mark), and
    /// this take-over ends none when dropped. A server that keeps a state directory must
    /// confirm before [`super::Server::new`], whose lock the old server holds until it
    /// exits; [`super::Server::adopt`] confirms what is not.
    pub fn confirm(
        &mut self,
        memories: &[&MemoryFile],
        state_dir: Option<&Path>,
        wait: Duration,
    ) -> Result<(), ServeError> {
        let serr = |op: &'static str| move |source| ServeError::Io { op, source };
        let Some(s) = self.pending.take() else {
            if self.owned {
                return Ok(());
            }
            return Err(serr("take over")(io::Error::other(
                "this take-over was not confirmed before: nothing was taken, the old server \
                 serves its VMs on",
            )));
        };
        let kept = |why: String| {
            serr("take over")(io::Error::other(format!(
                "{why}: nothing was taken, the old server serves its VMs on"
            )))
        };
        if let Some((_, p, _)) = self.listeners.first() {
            return Err(kept(format!(
                "the old server's socket {} is not among this server's sockets (--socket)",
                p.display()
            )));
        }
        if let Some(old) = &self.old_state_dir {
            use std::os::unix::fs::MetadataExt;
            let id = |p: &Path| std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino()));
            if !state_dir.is_some_and(|d| d == old || (id(d).is_some() && id(d) == id(old))) {
                return Err(kept(format!(
                    "the old server keeps its records in {}: give this server that \
                     --state-dir (a server started there later would take back the VMs \
                     this one serves)",
                    old.display()
                )));
            }
        }
        for h in &self.sessions {
            let r = &h.record;
            if super::restart::served_from(r, memories).is_none() {
                return Err(kept(format!(
                    "the memory file served to peer {} (socket {} of the old server) is not \
                     among this server's memory files (--mem-file)",
                    r.pid, h.index
                )));
            }
        }
        let answer = (&s)
            .write_all(TAKEN)
            .and_then(|()| read_line(&s, YOURS.len(), YOURS_WAIT));
        let yours = Instant::now();
        match answer {
            Ok(a) if a == YOURS => {}
            // The old server exited without a word (it crashed, or its answer was lost):
            // no one else will serve its VMs.
            _ if self.old_exited(Duration::from_secs(2)) => {}
            Ok(a) => {
                return Err(kept(format!(
                    "the old server did not hand its VMs over (it answered {:?}; it waits {} s \
                     for this server's acknowledgement)",
                    String::from_utf8_lossy(&a),
                    ACK_WAIT.as_secs()
                )))
            }
            Err(e) => return Err(kept(format!("no answer from the old server ({e})"))),
        }
        self.owned = true;
        drop(s);
        self.wait_for_old(yours, wait)
    }

    /// Whether the old server has exited, waiting at most `wait` for it.
    fn old_exited(&self, wait: Duration) -> bool {
        let Some(p) = self.old.pidfd() else {
            return false;
        };
        let mut fds = [crate::sys::PollFd::readable(p)];
        crate::sys::poll(&mut fds, Some(wait)).is_ok_and(|n| n == 1)
    }

    /// Waits, at most `wait` from `from`, for the old server to exit (its pidfd), so that
    /// one server at a time serves the VMs and holds the state directory.
    fn wait_for_old(&mut self, from: Instant, wait: Duration) -> Result<(), ServeError> {
        let serr = |op: &'static str| move |source| ServeError::Io { op, source };
        if let Some(p) = self.old.pidfd() {
            let left = wait.saturating_sub(from.elapsed());
            let mut fds = [crate::sys::PollFd::readable(p)];
            let n = crate::sys::poll(&mut fds, Some(left))
                .map_err(serr("wait for the old server to exit"))?;
            if n != 1 {
                return Err(serr("wait for the old server to exit")(io::Error::from(
                    io::ErrorKind::TimedOut,
                )));
            }
        }
        self.handed_secs = self.t0.elapsed().as_secs_f64();
        Ok(())
    }

    /// Whether the VMs are this server's ([`TakeOver::confirm`] succeeded, or the old
    /// server was of an earlier version).
    pub fn confirmed(&self) -> bool {
        self.owned
    }

    /// VMs handed over.
    pub fn vms(&self) -> usize {
        self.sessions.len()
    }

    /// The VMs, for the server that serves them from now on (and the VMs in the handed
    /// sockets' backlogs with them).
    pub(super) fn into_sessions(mut self) -> Vec<HandedSession> {
        self.claimed.clear();
        std::mem::take(&mut self.sessions)
    }
}

impl Drop for TakeOver {
    /// Before the take-over is confirmed, nothing: the old server serves on. After,
    /// whatever was handed over and not served (the new server failed before it could
    /// serve) is ended, never left hung: each VM handed over, and each VM waiting in a
    /// handed socket's backlog that has sent its userfaultfd, is killed through a pidfd.
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        for h in self.sessions.drain(..) {
            let r = &h.record;
            match PeerProcess::reopen(r.pid, r.start_time).and_then(|p| p.kill()) {
                Ok(()) => tracing::warn!(
                    target: "guestmem::fleet",
                    "killed peer {} handed over but not served: the new server stopped first",
                    r.pid
                ),
                Err(e) => tracing::warn!(
                    target: "guestmem::fleet",
                    "peer {} handed over but not served, and not killed ({e})",
                    r.pid
                ),
            }
        }
        let handed = self.listeners.drain(..).map(|(_, p, fd)| (p, fd));
        for (path, fd) in handed.chain(self.claimed.drain(..)) {
            let l = std::os::unix::net::UnixListener::from(fd);
            if l.set_nonblocking(true).is_err() {
                continue;
            }
            while let Ok((stream, _)) = l.accept() {
                let _ = stream.set_nonblocking(false);
                let got = receive_checked(stream, Duration::from_millis(200));
                let vm = match got {
                    Ok(h) => Some(h.process),
                    Err(r) => r.process,
                };
                if let Some(p) = vm {
                    let _ = p.kill();
                    tracing::warn!(
                        target: "guestmem::fleet",
                        "killed peer {:?} waiting on {} handed over but not served",
                        p.pid(),
                        path.display()
                    );
                }
            }
        }
    }
}

/// The messages of a hand-off as they come: a message is one line of JSON, sent in one
/// `sendmsg` with its descriptor, but a long one (a VM of hundreds of regions) arrives in
/// several reads, only the first carrying the descriptor, and a read may run on into the
/// next message. So bytes and descriptors are kept as they come, and a message is taken
/// once its line is whole, with the descriptors not yet taken, in order (every message but
/// the end mark carries one; a session with its removed pages two).
#[derive(Default)]
struct Incoming {
    bytes: Vec<u8>,
    fds: std::collections::VecDeque<OwnedFd>,
}

/// Longest hand-off message (a session record of the most regions a handshake takes is
/// well under this).
const MAX_MESSAGE: usize = 64 << 20;

impl Incoming {
    /// The next message, with its descriptor and, for a session with its removed pages, its
    /// second.
    #[allow(clippy::type_complexity)]
    fn next(
        &mut self,
        s: &UnixStream,
    ) -> Result<(Message, Option<OwnedFd>, Option<OwnedFd>), ServeError> {
        let serr = |op: &'static str| move |source| ServeError::Io { op, source };
        let mut buf = vec![0u8; 1 << 20];
        let line = loop {
            if let Some(i) = self.bytes.iter().position(|&b| b == b'\n') {
                break self.bytes.drain(..=i).collect::<Vec<u8>>();
            }
            if self.bytes.len() > MAX_MESSAGE {
                return Err(serr("receive the hand-off")(io::Error::other(format!(
                    "a message past {MAX_MESSAGE} bytes"
                ))));
            }
            let (n, fds) = recv_with_fds(s, &mut buf).map_err(serr("receive the hand-off"))?;
            self.fds.extend(fds?);
            if n == 0 {
                return Err(serr("receive the hand-off")(io::Error::other(
                    "the old server closed the connection before the end of the hand-off (is \
                     it a server with this version's control socket?)",
                )));
            }
            self.bytes.extend_from_slice(&buf[..n]);
        };
        let text = String::from_utf8_lossy(&line);
        if text.starts_with("{\"error\":\"unknown command") {
            // A server of an earlier version, which knows only the command without an
            // acknowledgement.
            return Err(serr("take over")(io::Error::new(
                io::ErrorKind::Unsupported,
                text.trim_end().to_string(),
            )));
        }
        let m: Message = serde_json::from_str(text.trim_end()).map_err(|e| {
            serr("parse the hand-off")(io::Error::other(format!(
                "{e}: {}",
                text.chars().take(200).collect::<String>()
            )))
        })?;
        let (fd, second) = match m {
            Message::End { .. } => (None, None),
            Message::Session { removed: true, .. } => {
                let fd = self.fds.pop_front();
                (fd, self.fds.pop_front())
            }
            _ => (self.fds.pop_front(), None),
        };
        if matches!(m, Message::Session { removed: true, .. }) && second.is_none() {
            return Err(serr("receive the hand-off")(io::Error::other(
                "a VM's message came without its removed pages' descriptor",
            )));
        }
        Ok((m, fd, second))
    }
}

/// Takes over the server whose control socket is `control`: receives its sockets and VMs
/// (see the module docs). They are this server's once [`TakeOver::confirm`] has succeeded
/// (with a server of an earlier version, already: then this waits, at most `wait`, for it
/// to exit, as that server gives everything away with its end mark).
pub fn take_over(control: &Path, wait: Duration) -> Result<TakeOver, ServeError> {
    let unknown = |r: &Result<TakeOver, ServeError>| matches!(r, Err(ServeError::Io { source, .. }) if source.kind() == io::ErrorKind::Unsupported);
    // Each server of an earlier version answers a command it does not know as unknown, and
    // is asked again with the one before.
    let r = receive(control, COMMAND_REMOVED, wait);
    if !unknown(&r) {
        return r;
    }
    let r = receive(control, COMMAND_ACKNOWLEDGED, wait);
    if !unknown(&r) {
        return r;
    }
    let mut t = receive(control, COMMAND, wait)?;
    let from = t.t0;
    t.wait_for_old(from, wait)?;
    Ok(t)
}

/// Sends `command` to the server whose control socket is `control`, and receives what it
/// hands over, up to its end mark.
fn receive(control: &Path, command: &str, wait: Duration) -> Result<TakeOver, ServeError> {
    let serr = |op: &'static str| move |source| ServeError::Io { op, source };
    let s = UnixStream::connect(control).map_err(serr("connect to the old server"))?;
    // Records from whoever listens there make this server kill processes it cannot serve:
    // only a server of this user (or root) is believed.
    if !same_user(&s) {
        return Err(serr("connect to the old server")(io::Error::other(
            "the process listening there runs as another user",
        )));
    }
    let old = PeerProcess::of(&s);
    s.set_read_timeout(Some(wait))
        .map_err(serr("set a timeout on the old server's socket"))?;
    let t0 = Instant::now();
    (&s).write_all(format!("{command}\n").as_bytes())
        .map_err(serr("send the old server its command"))?;
    let mut out = TakeOver {
        listeners: Vec::new(),
        claimed: Vec::new(),
        sessions: Vec::new(),
        pending: None,
        owned: false,
        old_state_dir: None,
        old_pid: old.pid(),
        old,
        t0,
        handed_secs: 0.0,
    };
    let mut incoming = Incoming::default();
    let ack = loop {
        let (m, fd, second) = incoming.next(&s)?;
        match (m, fd) {
            (Message::Listener { index, path }, Some(fd)) => out.listeners.push((index, path, fd)),
            (Message::Session { index, record, .. }, Some(uffd)) => {
                out.sessions.push(HandedSession {
                    index,
                    record,
                    uffd,
                    removed: second,
                })
            }
            (Message::End { ack, state_dir }, _) => {
                out.old_state_dir = state_dir;
                break ack;
            }
            (_, None) => {
                return Err(serr("receive the hand-off")(io::Error::other(
                    "a hand-off message came without its descriptor",
                )))
            }
        }
    };
    if ack {
        out.pending = Some(s);
    } else {
        // Given away with the end mark: the old server exits.
        out.owned = true;
        let mut rest = Vec::new();
        let _ = (&s).read_to_end(&mut rest);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    use super::{Incoming, Message, Outgoing};
    use crate::serve::regions::UffdRegion;
    use crate::serve::state::SessionRecord;

    /// Where the stand-in for a server of an earlier version listens (set only in its
    /// child process).
    const EARLIER_SERVER: &str = "GM_TEST_EARLIER_SERVER";

    /// Not a test of its own: the stand-in for a server of an earlier version, run by
    /// `a_server_of_an_earlier_version_is_taken_over_with_its_command` in a child process
    /// (the new server waits for the old one's exit). It answers as that version's control
    /// socket did, byte for byte: the acknowledged command as an unknown one, and `handoff`
    /// with its end mark, after which it exits.
    #[test]
    fn earlier_server() {
        use std::io::{BufRead, BufReader, Write};
        let Some(control) = std::env::var_os(EARLIER_SERVER) else {
            return;
        };
        let l = listen_at(std::path::Path::new(&control));
        loop {
            let (mut c, _) = l.accept().unwrap();
            let mut line = String::new();
            BufReader::new(&c).read_line(&mut line).unwrap();
            if line.trim() == "handoff" {
                c.write_all(b"{\"kind\":\"end\"}\n").unwrap();
                std::process::exit(0);
            }
            let reply = format!(
                "{{\"error\":\"unknown command {:?}: status, health, drain or metrics\"}}\n",
                line.trim()
            );
            c.write_all(reply.as_bytes()).unwrap();
        }
    }

    /// A socket listening at `path`, which appears only once it listens (bound under another
    /// name, then renamed): a client that sees the path is never refused.
    fn listen_at(path: &std::path::Path) -> std::os::unix::net::UnixListener {
        let tmp = path.with_extension("binding");
        let l = std::os::unix::net::UnixListener::bind(&tmp).unwrap();
        std::fs::rename(&tmp, path).unwrap();
        l
    }

    /// Where the stand-in for a server of this version that ends its acknowledged
    /// hand-off its own way listens, and how (`exits`: once told `taken`, without a word;
    /// `refuses`: answers something other than `yours` and stays until the new server
    /// hangs up). Set only in its child process.
    const ENDING_SERVER: &str = "GM_TEST_ENDING_SERVER";

    /// Not a test of its own: the stand-in run by
    /// `a_take_over_is_the_new_servers_when_the_old_one_exits_without_a_word`: a server
    /// of the version before removed pages went with a VM (it answers the newest command as
    /// unknown). It hands nothing but its end mark, byte for byte as that version sent it.
    #[test]
    fn ending_server() {
        use std::io::{BufRead, BufReader, Read, Write};
        let Some(v) = std::env::var(ENDING_SERVER).ok() else {
            return;
        };
        let (how, control) = v.split_once(':').unwrap();
        let l = listen_at(std::path::Path::new(control));
        // A server of the version before removed pages went with a VM: the newest command
        // is unknown to it.
        let (mut c, _) = l.accept().unwrap();
        let mut line = String::new();
        BufReader::new(&c).read_line(&mut line).unwrap();
        assert_eq!(line, format!("{}\n", super::COMMAND_REMOVED));
        let reply = format!(
            "{{\"error\":\"unknown command {:?}: status, health, drain or metrics\"}}\n",
            line.trim()
        );
        c.write_all(reply.as_bytes()).unwrap();
        drop(c);
        let (c, _) = l.accept().unwrap();
        let mut r = BufReader::new(&c);
        line.clear();
        r.read_line(&mut line).unwrap();
        assert_eq!(line, format!("{}\n", super::COMMAND_ACKNOWLEDGED));
        Outgoing { to: &c }.end(true, None).unwrap();
        line.clear();
        r.read_line(&mut line).unwrap();
        assert_eq!(line.as_bytes(), super::TAKEN);
        if how == "exits" {
            std::process::exit(0);
        }
        (&c).write_all(b"not now\n").unwrap();
        let _ = (&c).read_to_end(&mut Vec::new());
        std::process::exit(0);
    }

    /// Runs the stand-in of `ENDING_SERVER` the way `how`, and waits for its socket.
    fn start_ending_server(
        how: &str,
        d: &guestmem_testkit::Scratch,
    ) -> (std::path::PathBuf, guestmem_testkit::ChildGuard) {
        let control = d.join("ctl.sock");
        let mut old = guestmem_testkit::ChildGuard::new(
            std::process::Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "serve::handoff::tests::ending_server",
                    "--nocapture",
                    "--test-threads",
                    "1",
                ])
                .env(ENDING_SERVER, format!("{how}:{}", control.display()))
                .stdout(std::process::Stdio::null())
                .spawn()
                .unwrap(),
        );
        let t0 = std::time::Instant::now();
        while !control.exists() {
            assert!(t0.elapsed() < std::time::Duration::from_secs(20) && old.running());
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        (control, old)
    }

    /// An old server that exits once told `taken`, without answering `yours` (it crashed,
    /// or its answer was lost), has given its VMs to no one else: the new server takes them.
    /// One that answers anything else and runs on keeps them, and the take-over says so.
    #[test]
    fn a_take_over_is_the_new_servers_when_the_old_one_exits_without_a_word() {
        let wait = std::time::Duration::from_secs(20);
        let d = guestmem_testkit::Scratch::new("handoff-exits");
        let (control, mut old) = start_ending_server("exits", &d);
        let mut t = super::take_over(&control, wait).unwrap();
        assert!(!t.confirmed());
        t.confirm(&[], None, wait).unwrap();
        assert!(t.confirmed());
        assert_eq!(old.wait_exit(20).code(), Some(0));

        let d = guestmem_testkit::Scratch::new("handoff-refuses");
        let (control, mut old) = start_ending_server("refuses", &d);
        let mut t = super::take_over(&control, wait).unwrap();
        let e = t.confirm(&[], None, wait).unwrap_err().to_string();
        assert!(
            // What it said, as far as a `yours` would reach.
            e.contains("did not hand its VMs over") && e.contains("answered \"not no\""),
            "{e}"
        );
        assert!(!t.confirmed());
        drop(t);
        assert_eq!(old.wait_exit(20).code(), Some(0));
    }

    /// A server of an earlier version knows only `handoff`: it answers the acknowledged
    /// command as an unknown one, and `take_over` asks again with the old command, whose
    /// end mark gives everything away at once (confirmed, nothing left to say), and waits
    /// for that server's exit.
    #[test]
    fn a_server_of_an_earlier_version_is_taken_over_with_its_command() {
        let d = guestmem_testkit::Scratch::new("handoff-earlier");
        let control = d.join("ctl.sock");
        let mut old = guestmem_testkit::ChildGuard::new(
            std::process::Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "serve::handoff::tests::earlier_server",
                    "--nocapture",
                    "--test-threads",
                    "1",
                ])
                .env(EARLIER_SERVER, &control)
                .stdout(std::process::Stdio::null())
                .spawn()
                .unwrap(),
        );
        let t0 = std::time::Instant::now();
        while !control.exists() {
            assert!(t0.elapsed() < std::time::Duration::from_secs(20) && old.running());
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let t = super::take_over(&control, std::time::Duration::from_secs(20)).unwrap();
        assert!(t.confirmed() && t.vms() == 0);
        assert_eq!(old.wait_exit(20).code(), Some(0));
    }

    /// A hand-off message longer than one read (a VM of a thousand regions: about 85 KiB of
    /// JSON) arrives whole, with its descriptor, and so do the messages around it. Before,
    /// each message was read in one `recvmsg`, and this one came cut short: the take-over
    /// failed, and every VM handed over was ended.
    #[test]
    fn a_long_hand_off_message_is_read_whole() {
        let (a, b) = UnixStream::pair().unwrap();
        let regions: Vec<UffdRegion> = (0..1000u64)
            .map(|i| UffdRegion {
                base_host_virt_addr: 0x7f00_0000_0000 + i * 0x10_0000,
                size: 4096,
                offset: i * 4096,
                page_size: 4096,
            })
            .collect();
        let mem = serde_json::from_value(serde_json::json!({
            "dev": 1, "ino": 2, "size": 4096 * 1000, "mtime_s": 0, "mtime_nsec": 0
        }))
        .unwrap();
        let record = SessionRecord::new(4242, 77, 9, mem, &regions);
        let fds: Vec<_> = (0..3).map(|_| crate::sys::eventfd().unwrap()).collect();
        let sender = std::thread::spawn(move || {
            let out = Outgoing { to: &a };
            let p = std::path::Path::new("/run/vm.sock");
            out.listener(0, p, fds[0].as_raw_fd()).unwrap();
            out.session(0, record.clone(), fds[1].as_raw_fd(), None)
                .unwrap();
            out.session(0, record, fds[2].as_raw_fd(), Some(fds[0].as_raw_fd()))
                .unwrap();
            out.end(true, None).unwrap();
        });
        let mut incoming = Incoming::default();
        let (m, fd, _) = incoming.next(&b).unwrap();
        assert!(matches!(m, Message::Listener { index: 0, .. }) && fd.is_some());
        for removed in [false, true] {
            let (m, fd, second) = incoming.next(&b).unwrap();
            let Message::Session { record, .. } = m else {
                panic!("not a session");
            };
            assert_eq!(record.regions().unwrap(), regions);
            assert_eq!(record.pid, 4242);
            assert!(fd.is_some());
            assert_eq!(second.is_some(), removed);
        }
        let (m, fd, _) = incoming.next(&b).unwrap();
        assert!(matches!(m, Message::End { ack: true, .. }) && fd.is_none());
        sender.join().unwrap();
    }
}
