//! A zero-downtime upgrade: a running server hands its sockets and its VMs to a new server
//! (a new binary, say) over its control socket, with `SCM_RIGHTS`, and exits without
//! ending or graduating any VM. This is the protocol and the old server's side; the new
//! server's is in `takeover.rs`.
//!
//! The new server ([`super::take_over`]) connects to the old one's control socket and sends
//! `handoff acknowledged removed`. The old one stops serving (its pool no longer reads the
//! VMs' faults or removes, which wait in the kernel) and sends, one message each: every
//! listening socket (so no VM that connects meanwhile is refused: it waits in the same
//! backlog), then every VM's session record (the same record a restart reads) with its
//! userfaultfd (and a memfd of the pages its balloon removed, where it removed any), then
//! an end mark. Nothing is given away yet: the new server checks that it can serve
//! everything (every socket is one of its own, every VM's memory file one it serves:
//! [`super::TakeOver::confirm`]) and only then says `taken`; the old server answers `yours`
//! and exits, leaving the socket paths in place and the records on disk. Without `taken`
//! within [`ACK_WAIT`] (the new server failed, was stopped, or cannot serve a VM), the old
//! server serves every VM on, and the new one, told nothing or something else, ends none.
//! The new server waits for the old process to be gone (its pidfd), takes the state
//! directory's lock if it keeps one, and serves every VM again as after a crash: pages
//! already in are left, the ranges are woken so waiting faults come again
//! ([`super::Server::run`]). The VMs stall only for the hand-over itself.
//!
//! A server of an earlier version answers a command it does not know as unknown, and
//! [`super::take_over`] asks again with the one before: `handoff acknowledged` (no removed
//! pages), then `handoff`, which hands over at once, with no acknowledgement. A server
//! still answers both so (an older new server taking over from it).

use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::handshake::recv_with_fds;
use super::state::SessionRecord;
use super::ServeError;

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
/// How long one send of the hand-off may wait on a new server that reads nothing (stopped,
/// in a debugger): then the send fails, and the old server serves on (or, for a new server
/// of an earlier version, ends the VMs it could not send, as that version's hand-off does).
/// Without it, the old server's supervisor waited for ever, the VMs taken off its pool
/// unserved.
pub(super) const SEND_WAIT: Duration = Duration::from_secs(10);
/// How long a new server waits, once told `yours`, for the old one to exit (it stops its
/// prefetch threads first, which may be waiting on a fetch up to its deadline) before it
/// gives up and ends the VMs handed: no other server will serve them.
pub(super) const EXIT_WAIT: Duration = Duration::from_secs(120);
/// How long a new server waits for the old one's `yours` (sent as soon as it reads
/// `taken`).
pub(super) const YOURS_WAIT: Duration = Duration::from_secs(10);
/// The new server's acknowledgement, and the old server's answer.
pub(super) const TAKEN: &[u8] = b"taken\n";
pub(super) const YOURS: &[u8] = b"yours\n";

/// One message of a hand-off (its descriptors travel beside it).
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub(super) enum Message {
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
pub(super) fn read_line(mut s: &UnixStream, max: usize, limit: Duration) -> io::Result<Vec<u8>> {
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

/// The messages of a hand-off as they come: a message is one line of JSON, sent in one
/// `sendmsg` with its descriptor, but a long one (a VM of hundreds of regions) arrives in
/// several reads, only the first carrying the descriptor, and a read may run on into the
/// next message. So bytes and descriptors are kept as they come, and a message is taken
/// once its line is whole, with the descriptors not yet taken, in order (every message but
/// the end mark carries one; a session with its removed pages two).
#[derive(Default)]
pub(super) struct Incoming {
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
    pub(super) fn next(
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

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    use super::{Incoming, Message, Outgoing};
    use crate::serve::regions::UffdRegion;
    use crate::serve::state::SessionRecord;

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
