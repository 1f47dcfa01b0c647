//! The page server's socket: published whole, removed only while it is still ours, and an
//! accept loop that runs handshakes side by side until one is a VM's.

use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Instant;

use super::handshake::{receive_checked, Handshake, Refused};
use super::{end_peer, ServeConfig, ServeError};
use crate::files::{split, unique_suffix, Dir};

/// Most handshakes read at once; a connection past them is dropped at once (logged).
const MAX_PENDING_HANDSHAKES: usize = 16;

/// A listening Unix socket at a path, published atomically. Dropping it closes the socket
/// and removes the path if it still names this socket (same device and inode).
#[derive(Debug)]
pub struct Listener {
    socket: UnixListener,
    path: PathBuf,
    dir: Dir,
    name: String,
    id: (u64, u64),
}

impl Listener {
    /// Listens at `path`: bound and listening under a temporary name beside it, then renamed
    /// into place. Refuses a path held by anything but a socket, and a socket another server
    /// listens on; a stale socket (nobody listening) is replaced.
    pub fn bind(path: &Path) -> Result<Listener, ServeError> {
        let serr = |op: String| move |source| ServeError::Socket { op, source };
        let shown = path.display();
        let (parent, name) =
            split(path).map_err(|e| serr(format!("--socket {shown}"))(e.source))?;
        let dir = Dir::open(&parent).map_err(|e| serr(format!("--socket {shown}"))(e.source))?;
        let stale = match std::fs::symlink_metadata(path) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => false,
            Err(e) => return Err(serr(format!("stat --socket {shown}"))(e)),
            Ok(m) if !m.file_type().is_socket() => {
                return Err(ServeError::Config(format!(
                    "--socket {shown}: exists and is not a socket; refusing to replace it"
                )))
            }
            Ok(_) => {
                if UnixStream::connect(path).is_ok() {
                    return Err(ServeError::Config(format!(
                        "--socket {shown}: another server listens there"
                    )));
                }
                true
            }
        };
        let tmp = format!(".{name}.{}", unique_suffix());
        let tmp_path = dir.join(&tmp);
        let socket = UnixListener::bind(&tmp_path).map_err(serr(format!(
            "bind {} (beside --socket)",
            tmp_path.display()
        )))?;
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
                    ServeError::Config(format!(
                        "--socket {shown}: another server took the path just now"
                    ))
                } else {
                    serr(format!("publish --socket {shown}"))(e)
                });
            }
        };
        socket
            .set_nonblocking(true)
            .map_err(serr("make the socket non-blocking".into()))?;
        Ok(Listener {
            socket,
            path: path.to_path_buf(),
            dir,
            name,
            id,
        })
    }

    /// The path it listens at.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Accepts connections until one completes a VM's handshake, or
    /// [`ServeConfig::accept_timeout`] passes with none in progress. Each connection's
    /// handshake runs on a thread of its own, so a squatter does not hold up the real VM.
    /// A connection that hands over no userfaultfd is dropped with a log line; one that did
    /// and is then refused is ended as [`ServeConfig::on_failure`] says, and its refusal
    /// returned (this server had a VM and cannot serve it). A VM whose handshake completes
    /// after another won is ended the same way (a one-VM server has its VM).
    pub(crate) fn next_vm(&self, cfg: &ServeConfig) -> Result<Handshake, ServeError> {
        let (tx, rx) = mpsc::channel::<Result<Handshake, Refused>>();
        let notify = Arc::new(crate::sys::eventfd().map_err(|source| ServeError::Socket {
            op: "make an eventfd".into(),
            source,
        })?);
        let pending = Arc::new(AtomicUsize::new(0));
        let deadline = cfg.accept_timeout.map(|d| Instant::now() + d);
        loop {
            while let Ok(r) = rx.try_recv() {
                match r {
                    Ok(h) => return Ok(h),
                    Err(Refused {
                        error,
                        process: Some(p),
                    }) => {
                        end_peer(&p, cfg, &error);
                        return Err(error);
                    }
                    Err(Refused {
                        error,
                        process: None,
                    }) => cfg.log.say(&format!(
                        "dropped a connection that is not a VM's (it sent no userfaultfd): {error}"
                    )),
                }
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left.is_some_and(|l| l.is_zero()) && pending.load(Ordering::Acquire) == 0 {
                return Err(ServeError::Handshake(format!(
                    "no VM connected within {:.1} s",
                    cfg.accept_timeout.unwrap_or_default().as_secs_f64()
                )));
            }
            // With handshakes in flight past the deadline, wait for them (each is bounded by
            // the handshake timeout).
            let ms = match left {
                Some(l) if !l.is_zero() => l.as_millis().clamp(1, i32::MAX as u128) as i32,
                _ => -1,
            };
            if wait_two(self.socket.as_fd(), notify.as_fd(), ms)? {
                self.accept_one(cfg, &tx, &notify, &pending);
            }
            drain(notify.as_fd());
        }
    }

    /// Accepts one waiting connection (if any) and starts its handshake thread.
    fn accept_one(
        &self,
        cfg: &ServeConfig,
        tx: &mpsc::Sender<Result<Handshake, Refused>>,
        notify: &Arc<OwnedFd>,
        pending: &Arc<AtomicUsize>,
    ) {
        let stream = match self.socket.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
            Err(e) => {
                cfg.log.say(&format!("accept failed: {e}"));
                return;
            }
        };
        if pending.load(Ordering::Acquire) >= MAX_PENDING_HANDSHAKES {
            cfg.log.say(&format!(
                "dropped a connection: {MAX_PENDING_HANDSHAKES} handshakes are in progress already"
            ));
            return;
        }
        if stream.set_nonblocking(false).is_err() {
            return;
        }
        pending.fetch_add(1, Ordering::AcqRel);
        let (tx, notify, pending2, cfg2) =
            (tx.clone(), notify.clone(), pending.clone(), cfg.clone());
        let spawned = std::thread::Builder::new()
            .name("guestmem-handshake".into())
            .spawn(move || {
                let r = receive_checked(stream, cfg2.handshake_timeout);
                if let Err(mpsc::SendError(r)) = tx.send(r) {
                    // The server has its VM (or gave up): a VM that arrives now is refused.
                    let late = match r {
                        Ok(h) => Some((
                            h.process,
                            ServeError::Handshake(
                                "a second VM connected to a server that serves one".into(),
                            ),
                        )),
                        Err(Refused { error, process }) => process.map(|p| (p, error)),
                    };
                    if let Some((p, why)) = late {
                        end_peer(&p, &cfg2, &why);
                    }
                }
                pending2.fetch_sub(1, Ordering::AcqRel);
                let _ = crate::sys::eventfd_signal(notify.as_fd());
            });
        if let Err(e) = spawned {
            pending.fetch_sub(1, Ordering::AcqRel);
            cfg.log.say(&format!(
                "dropped a connection: no thread for its handshake: {e}"
            ));
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        // Only our own socket: another server may have taken the path since.
        if std::fs::symlink_metadata(&self.path).is_ok_and(|m| (m.dev(), m.ino()) == self.id) {
            self.dir.unlink(&self.name);
        }
    }
}

/// Waits up to `ms` (-1: for ever) for `a` or `b` to be readable; whether `a` is.
fn wait_two(
    a: std::os::fd::BorrowedFd<'_>,
    b: std::os::fd::BorrowedFd<'_>,
    ms: i32,
) -> Result<bool, ServeError> {
    let mut fds = [
        libc::pollfd {
            fd: a.as_raw_fd(),
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
