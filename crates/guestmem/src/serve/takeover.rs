//! The new server's side of a hand-off ([`take_over`], [`TakeOver`]; the protocol and the
//! old server's side are in `handoff.rs`): it asks, receives every socket and VM, checks it
//! can serve them all ([`TakeOver::confirm`]) before it says `taken`, and waits for the old
//! server to exit. Dropped before that, it gives nothing away; after, whatever it did not
//! serve is ended, never left hung.

use std::io::{self, Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::files::MemoryFile;
use super::handoff::{
    read_line, Incoming, Message, ACK_WAIT, COMMAND, COMMAND_ACKNOWLEDGED, COMMAND_REMOVED, TAKEN,
    YOURS, YOURS_WAIT,
};
use super::handshake::receive_checked;
use super::peer::{same_user, PeerProcess};
use super::state::SessionRecord;
use super::{Listener, ServeError};

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
    use crate::serve::handoff::{Outgoing, COMMAND_ACKNOWLEDGED, COMMAND_REMOVED, TAKEN};

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
        assert_eq!(line, format!("{}\n", COMMAND_REMOVED));
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
        assert_eq!(line, format!("{}\n", COMMAND_ACKNOWLEDGED));
        Outgoing { to: &c }.end(true, None).unwrap();
        line.clear();
        r.read_line(&mut line).unwrap();
        assert_eq!(line.as_bytes(), TAKEN);
        if how == "exits" {
            std::process::exit(0);
        }
        (&c).write_all(b"not now\n").unwrap();
        let _ = (&c).read_to_end(&mut Vec::new());
        std::process::exit(0);
    }

    /// Runs the stand-in `test` (a test of this binary, named under `serve::takeover::tests`)
    /// in a child with `var` set to `value`, and waits for its socket `control`.
    fn start_stand_in(
        test: &str,
        var: &str,
        value: &std::ffi::OsStr,
        control: &std::path::Path,
    ) -> guestmem_testkit::ChildGuard {
        let mut old = guestmem_testkit::ChildGuard::new(
            std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--exact", &format!("serve::takeover::tests::{test}")])
                .args(["--nocapture", "--test-threads", "1"])
                .env(var, value)
                .stdout(std::process::Stdio::null())
                .spawn()
                .unwrap(),
        );
        let t0 = std::time::Instant::now();
        while !control.exists() {
            assert!(t0.elapsed() < std::time::Duration::from_secs(20) && old.running());
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        old
    }

    /// Runs the stand-in of `ENDING_SERVER` the way `how`, and waits for its socket.
    fn start_ending_server(
        how: &str,
        d: &guestmem_testkit::Scratch,
    ) -> (std::path::PathBuf, guestmem_testkit::ChildGuard) {
        let control = d.join("ctl.sock");
        let value = format!("{how}:{}", control.display());
        let old = start_stand_in("ending_server", ENDING_SERVER, value.as_ref(), &control);
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
        let mut old = start_stand_in("earlier_server", EARLIER_SERVER, control.as_ref(), &control);
        let t = super::take_over(&control, std::time::Duration::from_secs(20)).unwrap();
        assert!(t.confirmed() && t.vms() == 0);
        assert_eq!(old.wait_exit(20).code(), Some(0));
    }
}
