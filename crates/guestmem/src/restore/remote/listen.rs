//! The page server's socket: published whole, removed only while it is still ours, and an
//! accept loop that runs handshakes side by side until one is a VM's.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::handshake::{receive_checked, Handshake, HandshakeError, Refused};
use super::{end_peer, ServeConfig, ServeError};
use crate::files::{split, unique_suffix, Dir};

/// Most handshakes read at once; past them, connections wait in the backlog.
pub(super) const MAX_PENDING_HANDSHAKES: usize = 16;

/// Why a socket path cannot be listened on.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SocketRefusal {
    /// Something other than a socket is there.
    #[error("exists and is not a socket; refusing to replace it")]
    NotASocket,
    /// A live server listens there.
    #[error("another server listens there")]
    InUse,
    /// Connecting to the socket there failed in a way that does not say whether anyone
    /// listens.
    #[error("cannot tell whether a server listens there ({0}); refusing to replace it")]
    Unknown(#[source] io::Error),
    /// Another server published its socket there between the check and the rename.
    #[error("another server took the path just now")]
    Taken,
}

/// A listening Unix socket at a path, published atomically. Dropping it closes the socket
/// and removes the path if it still names this socket (same device and inode).
#[derive(Debug)]
pub struct Listener {
    socket: UnixListener,
    path: PathBuf,
    dir: Dir,
    name: String,
    id: (u64, u64),
    /// Leave the path when dropped (handed to another server).
    keep_path: bool,
}

impl Listener {
    /// Listens at `path`: bound and listening under a temporary name beside it, then renamed
    /// into place. Refuses a path held by anything but a socket, and a socket another server
    /// listens on; a stale socket (nobody listening) is replaced.
    pub fn bind(path: &Path) -> Result<Listener, ServeError> {
        Listener::bind_mode(path, None)
    }

    /// As [`Listener::bind`], for a socket only this user may connect to (mode 0600, set
    /// before the path appears): a control socket, whose commands drain the server or hand
    /// its VMs' descriptors to whoever asks.
    pub fn bind_private(path: &Path) -> Result<Listener, ServeError> {
        Listener::bind_mode(path, Some(0o600))
    }

    fn bind_mode(path: &Path, mode: Option<u32>) -> Result<Listener, ServeError> {
        let serr = |op: String| move |source| ServeError::Socket { op, source };
        let shown = path.display();
        let refuse = |refusal| ServeError::SocketPath {
            path: path.to_path_buf(),
            refusal,
        };
        let (parent, name) =
            split(path).map_err(|e| serr(format!("--socket {shown}"))(e.source))?;
        let dir = Dir::open(&parent).map_err(|e| serr(format!("--socket {shown}"))(e.source))?;
        let stale = match std::fs::symlink_metadata(path) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => false,
            Err(e) => return Err(serr(format!("stat --socket {shown}"))(e)),
            Ok(m) if !m.file_type().is_socket() => return Err(refuse(SocketRefusal::NotASocket)),
            Ok(_) => match UnixStream::connect(path) {
                Ok(_) => return Err(refuse(SocketRefusal::InUse)),
                // Nobody listens: a socket left by a server that died, replaced below.
                Err(e) if e.raw_os_error() == Some(libc::ECONNREFUSED) => true,
                Err(e) => return Err(refuse(SocketRefusal::Unknown(e))),
            },
        };
        let tmp = format!(".{name}.{}", unique_suffix());
        let tmp_path = dir.join(&tmp);
        let socket = UnixListener::bind(&tmp_path).map_err(|e| {
            let hint = if e.raw_os_error() == Some(libc::EINVAL) {
                " (a socket path is at most 107 bytes, and the temporary name beside --socket \
                 is longer than it: use a shorter path)"
            } else {
                ""
            };
            serr(format!("bind {}{hint}", tmp_path.display()))(e)
        })?;
        if let Err(e) = socket.set_nonblocking(true) {
            dir.unlink(&tmp);
            return Err(serr("make the socket non-blocking".into())(e));
        }
        if let Some(mode) = mode {
            use std::os::unix::fs::PermissionsExt;
            // Under its temporary name, before anyone can find it.
            let set = std::fs::set_permissions(&tmp_path, std::fs::Permissions::from_mode(mode));
            if let Err(e) = set {
                dir.unlink(&tmp);
                return Err(serr(format!("chmod {}", tmp_path.display()))(e));
            }
        }
        let published = (|| {
            let m = std::fs::symlink_metadata(&tmp_path)?;
            // A stale socket is replaced in one rename; otherwise nothing may be.
            dir.rename(&tmp, &name, stale).map_err(|e| e.source)?;
            Ok((m.dev(), m.ino()))
        })();
        let id = match published {
            Ok(id) => id,
            Err(e) => {
                dir.unlink(&tmp);
                let e: io::Error = e;
                return Err(if e.raw_os_error() == Some(libc::EEXIST) {
                    refuse(SocketRefusal::Taken)
                } else {
                    serr(format!("publish --socket {shown}"))(e)
                });
            }
        };
        Ok(Listener {
            socket,
            path: path.to_path_buf(),
            dir,
            name,
            id,
            keep_path: false,
        })
    }

    /// A listening socket handed over by another server (`fd`), published at `path`: it
    /// must be a listening Unix socket, and `path` a socket.
    pub(crate) fn adopt(fd: OwnedFd, path: &Path) -> Result<Listener, ServeError> {
        let serr = |op: String| move |source| ServeError::Socket { op, source };
        let shown = path.display();
        let mut on: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: `on` is a live c_int and len its size; the kernel writes at most len bytes.
        let r = unsafe {
            libc::getsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_ACCEPTCONN,
                &mut on as *mut libc::c_int as *mut libc::c_void,
                &mut len,
            )
        };
        if r != 0 || on == 0 {
            return Err(serr(format!("adopt the socket handed over for {shown}"))(
                io::Error::other("not a listening socket"),
            ));
        }
        let socket = UnixListener::from(fd);
        socket
            .set_nonblocking(true)
            .map_err(serr("make the socket non-blocking".into()))?;
        let (parent, name) =
            split(path).map_err(|e| serr(format!("--socket {shown}"))(e.source))?;
        let dir = Dir::open(&parent).map_err(|e| serr(format!("--socket {shown}"))(e.source))?;
        let m = std::fs::symlink_metadata(path).map_err(serr(format!("stat --socket {shown}")))?;
        if !m.file_type().is_socket() {
            return Err(ServeError::SocketPath {
                path: path.to_path_buf(),
                refusal: SocketRefusal::NotASocket,
            });
        }
        Ok(Listener {
            socket,
            path: path.to_path_buf(),
            dir,
            name,
            id: (m.dev(), m.ino()),
            keep_path: false,
        })
    }

    /// Leaves the path in place when dropped: the socket was handed to another server.
    pub(super) fn keep_path(&mut self) {
        self.keep_path = true;
    }

    /// The listening socket (non-blocking).
    pub(super) fn socket(&self) -> &UnixListener {
        &self.socket
    }

    /// The path it listens at.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Accepts connections until one completes a VM's handshake, or
    /// [`ServeConfig::accept_timeout`] passes with none in progress. Each connection's
    /// handshake runs on a thread of its own (at most [`MAX_PENDING_HANDSHAKES`] at once;
    /// past that the server stops accepting until one ends), so a squatter does not hold up
    /// the real VM. A connection that hands over no userfaultfd is dropped with a log line;
    /// one that did and is then refused is ended as [`ServeConfig::on_failure`] says, and its
    /// refusal returned (this server had a VM and cannot serve it). Every VM that completes
    /// its handshake after another won, or waits in the backlog then, is ended the same way
    /// (a one-VM server has its VM).
    pub(crate) fn next_vm(&self, cfg: &ServeConfig) -> Result<Handshake, ServeError> {
        let mailbox = Arc::new(Mailbox::default());
        let notify = Arc::new(crate::sys::eventfd().map_err(|source| ServeError::Socket {
            op: "make an eventfd".into(),
            source,
        })?);
        let deadline = cfg.accept_timeout.map(|d| Instant::now() + d);
        let outcome = loop {
            if let Some(done) = decide(cfg, &mailbox) {
                break done;
            }
            let pending = mailbox.pending.load(Ordering::Acquire);
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left.is_some_and(|l| l.is_zero()) && pending == 0 {
                break Err(HandshakeError::NoVm(cfg.accept_timeout.unwrap_or_default()).into());
            }
            // With handshakes in flight past the deadline, wait for them (each ends within
            // the handshake timeout).
            let ms = match left {
                Some(l) if !l.is_zero() => l.as_millis().clamp(1, i32::MAX as u128) as i32,
                _ => -1,
            };
            // At the cap the listener is not watched: connections wait in the backlog.
            let listen = (pending < MAX_PENDING_HANDSHAKES).then(|| self.socket.as_fd());
            match wait_two(listen, notify.as_fd(), ms) {
                Ok(true) => {
                    self.accept_one(cfg, &mailbox, &notify);
                }
                Ok(false) => {}
                Err(e) => break Err(e),
            }
            drain(notify.as_fd());
        };
        // Whatever happens next, no handshake thread hands this loop a VM any more: each
        // ends its own. VMs already waiting in the backlog get the same.
        mailbox.close(cfg);
        while self.accept_one(cfg, &mailbox, &notify) {}
        outcome
    }

    /// Accepts one waiting connection (if any; whether one was) and starts its handshake
    /// thread.
    fn accept_one(&self, cfg: &ServeConfig, mailbox: &Arc<Mailbox>, notify: &Arc<OwnedFd>) -> bool {
        let stream = match self.socket.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return false,
            Err(e) => {
                // Out of descriptors, say: the connection stays queued; wait a little rather
                // than spin on a listener that stays readable.
                cfg.log
                    .say(&format!("accept failed: {e}; trying again in 100 ms"));
                std::thread::sleep(std::time::Duration::from_millis(100));
                return false;
            }
        };
        if stream.set_nonblocking(false).is_err() {
            return true;
        }
        mailbox.pending.fetch_add(1, Ordering::AcqRel);
        let (mailbox2, notify, cfg2) = (mailbox.clone(), notify.clone(), cfg.clone());
        let spawned = std::thread::Builder::new()
            .name("guestmem-handshake".into())
            .spawn(move || {
                let r = receive_checked(stream, cfg2.handshake_timeout);
                mailbox2.deliver(r, &cfg2);
                let _ = crate::sys::eventfd_signal(notify.as_fd());
            });
        if let Err(e) = spawned {
            mailbox.pending.fetch_sub(1, Ordering::AcqRel);
            cfg.log.say(&format!(
                "dropped a connection: no thread for its handshake: {e}"
            ));
        }
        true
    }
}

/// The first result in the mailbox that settles the wait, if any; drops non-VM peers.
fn decide(cfg: &ServeConfig, mailbox: &Mailbox) -> Option<Result<Handshake, ServeError>> {
    loop {
        match mailbox.take_one()? {
            Ok(h) => return Some(Ok(h)),
            Err(Refused {
                error,
                process: Some(p),
            }) => {
                end_peer(&p, cfg, &error);
                return Some(Err(error));
            }
            Err(Refused {
                error,
                process: None,
            }) => cfg.log.say(&format!(
                "dropped a connection that is not a VM's (it sent no userfaultfd): {error}"
            )),
        }
    }
}

/// Where handshake threads leave their results while the server still waits for its VM.
/// Once closed, a thread ends its own VM instead: no result is left unread.
#[derive(Default)]
struct Mailbox {
    inner: Mutex<MailboxInner>,
    /// Handshakes still being read.
    pending: AtomicUsize,
}

#[derive(Default)]
struct MailboxInner {
    closed: bool,
    results: VecDeque<Result<Handshake, Refused>>,
}

impl Mailbox {
    fn deliver(&self, r: Result<Handshake, Refused>, cfg: &ServeConfig) {
        let mut m = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if m.closed {
            drop(m);
            end_late(r, cfg);
        } else {
            m.results.push_back(r);
        }
        self.pending.fetch_sub(1, Ordering::AcqRel);
    }

    fn take_one(&self) -> Option<Result<Handshake, Refused>> {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .results
            .pop_front()
    }

    /// Closes it and ends every VM still in it.
    fn close(&self, cfg: &ServeConfig) {
        let left: Vec<_> = {
            let mut m = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            m.closed = true;
            m.results.drain(..).collect()
        };
        for r in left {
            end_late(r, cfg);
        }
    }
}

/// Ends a VM whose handshake settled after the server had its VM (or had given up).
fn end_late(r: Result<Handshake, Refused>, cfg: &ServeConfig) {
    let late = match r {
        Ok(h) => Some((h.process, ServeError::Handshake(HandshakeError::Late))),
        Err(Refused { error, process }) => process.map(|p| (p, error)),
    };
    if let Some((p, why)) = late {
        end_peer(&p, cfg, &why);
    }
}

impl Listener {
    /// Removes the path if it still names this socket (same device and inode): new
    /// connections are refused at `connect` from then on, while those already in the
    /// backlog can still be accepted.
    pub(super) fn unpublish(&self) {
        // Only our own socket: another server may have taken the path since.
        if std::fs::symlink_metadata(&self.path).is_ok_and(|m| (m.dev(), m.ino()) == self.id) {
            self.dir.unlink(&self.name);
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if !self.keep_path {
            self.unpublish();
        }
    }
}

/// Waits up to `ms` (-1: for ever) for `a` (when given) or `b` to be readable; whether `a`
/// is.
fn wait_two(
    a: Option<std::os::fd::BorrowedFd<'_>>,
    b: std::os::fd::BorrowedFd<'_>,
    ms: i32,
) -> Result<bool, ServeError> {
    let mut fds = [
        libc::pollfd {
            // A negative descriptor is skipped by poll.
            fd: a.map_or(-1, |a| a.as_raw_fd()),
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: b.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    // SAFETY: two live pollfds.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, ms) };
    if n < 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EINTR) {
            return Ok(false);
        }
        return Err(ServeError::Socket {
            op: "wait for a VM to connect".into(),
            source: e,
        });
    }
    Ok(fds[0].revents & libc::POLLIN != 0)
}

/// Reads an eventfd's count (leaves it unreadable until signalled again).
fn drain(fd: std::os::fd::BorrowedFd<'_>) {
    let mut buf = [0u8; 8];
    // SAFETY: reads at most 8 bytes into a live buffer; the eventfd is non-blocking.
    unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr() as *mut libc::c_void, 8) };
}
