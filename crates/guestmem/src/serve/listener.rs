//! The page server's socket: published whole (bound and listening under a temporary name,
//! then renamed into place), and removed only while it is still ours.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use super::ServeError;
use crate::files::{split, unique_suffix, Dir};

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
    /// The path is too long for a socket once the temporary name beside it is made.
    #[error(
        "a socket path is at most 107 bytes, and the temporary name beside this one is \
         longer: use a shorter path"
    )]
    TooLong,
    /// The socket handed over by another server is not a listening Unix socket.
    #[error("the socket handed over for it is not a listening socket")]
    NotListening,
    /// A call on the path or the socket failed.
    #[error("cannot {op}: {source}")]
    Io {
        /// What was done.
        op: &'static str,
        /// The errno.
        source: io::Error,
    },
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
        let refuse = |refusal| ServeError::SocketPath {
            path: path.to_path_buf(),
            refusal,
        };
        let io = |op| move |source| refuse(SocketRefusal::Io { op, source });
        let (parent, name) = split(path).map_err(|e| io(e.op)(e.source))?;
        let dir = Dir::open(&parent).map_err(|e| io(e.op)(e.source))?;
        let stale = match std::fs::symlink_metadata(path) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => false,
            Err(e) => return Err(io("stat it")(e)),
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
            // The kernel's EINVAL, or std's own refusal before it asks ("path must be
            // shorter than SUN_LEN", no errno): told apart from std's other refusal of a
            // path (a NUL inside it) by the length, 108 bytes with its NUL.
            if e.raw_os_error() == Some(libc::EINVAL)
                || (e.raw_os_error().is_none() && tmp_path.as_os_str().len() >= 108)
            {
                refuse(SocketRefusal::TooLong)
            } else {
                io("bind a socket beside it")(e)
            }
        })?;
        if let Err(e) = socket.set_nonblocking(true) {
            dir.unlink(&tmp);
            return Err(io("make the socket non-blocking")(e));
        }
        if let Some(mode) = mode {
            use std::os::unix::fs::PermissionsExt;
            // Under its temporary name, before anyone can find it.
            let set = std::fs::set_permissions(&tmp_path, std::fs::Permissions::from_mode(mode));
            if let Err(e) = set {
                dir.unlink(&tmp);
                return Err(io("set the socket's mode")(e));
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
                    io("publish the socket")(e)
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
    /// must be a listening Unix socket, and `path` a socket. `keep_path`: the path is left
    /// in place when it is dropped (until [`Listener::own_path`]).
    pub(crate) fn adopt(fd: OwnedFd, path: &Path, keep_path: bool) -> Result<Listener, ServeError> {
        let refuse = |refusal| ServeError::SocketPath {
            path: path.to_path_buf(),
            refusal,
        };
        let io = |op| move |source| refuse(SocketRefusal::Io { op, source });
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
            return Err(refuse(SocketRefusal::NotListening));
        }
        let socket = UnixListener::from(fd);
        socket
            .set_nonblocking(true)
            .map_err(io("make the socket non-blocking"))?;
        let (parent, name) = split(path).map_err(|e| io(e.op)(e.source))?;
        let dir = Dir::open(&parent).map_err(|e| io(e.op)(e.source))?;
        let m = std::fs::symlink_metadata(path).map_err(io("stat it"))?;
        if !m.file_type().is_socket() {
            return Err(refuse(SocketRefusal::NotASocket));
        }
        Ok(Listener {
            socket,
            path: path.to_path_buf(),
            dir,
            name,
            id: (m.dev(), m.ino()),
            keep_path,
        })
    }

    /// Leaves the path in place when dropped: the socket was handed to another server.
    pub(super) fn keep_path(&mut self) {
        self.keep_path = true;
    }

    /// Removes the path when dropped (if it still names this socket): the socket is this
    /// server's alone now.
    pub(super) fn own_path(&mut self) {
        self.keep_path = false;
    }

    /// The listening socket (non-blocking).
    pub(super) fn socket(&self) -> &UnixListener {
        &self.socket
    }

    /// The path it listens at.
    pub fn path(&self) -> &Path {
        &self.path
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A path too long for a socket (with the temporary name beside it) is refused as
    /// such, whether std or the kernel says so, and leaves nothing.
    #[test]
    fn a_socket_path_too_long_is_refused_as_too_long() {
        let scratch = guestmem_testkit::Scratch::new("listener-long");
        let long = scratch.join("s".repeat(100));
        match Listener::bind(&long) {
            Err(ServeError::SocketPath {
                refusal: SocketRefusal::TooLong,
                ..
            }) => {}
            Err(e) => panic!("not refused as too long: {e}"),
            Ok(_) => panic!("a socket path past 107 bytes was bound"),
        }
        assert_eq!(std::fs::read_dir(&*scratch).unwrap().count(), 0);
    }
}
