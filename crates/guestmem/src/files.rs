//! Files that come from outside or must be published whole. Crate-private.
//!
//! Two rules, the ones git keeps for its refs and objects:
//!
//! - **Reading outside input**: a file is opened relative to its directory's descriptor
//!   with `O_NOFOLLOW` (a symlink is refused, not followed) and `O_NONBLOCK` (a FIFO cannot
//!   hang the open), then `fstat`ed: anything but a regular file (a FIFO, a device, a
//!   directory) is refused by name before a byte is read, and a file past its cap is refused
//!   before it is read into memory.
//! - **Publishing**: what must appear whole is written under a unique temporary name beside
//!   its target, synced, and moved into place with one `rename` (`renameat2` with
//!   `RENAME_NOREPLACE` where nothing may be overwritten), and the directory is synced so the
//!   rename itself survives a crash. A reader sees the old state or the new one, never half.

use std::ffi::{CString, OsStr};
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// Why opening a file from outside failed: the path, what was done, and the errno or reason.
#[derive(Debug, thiserror::Error)]
#[error("{op} {}: {source}", path.display())]
pub(crate) struct FileError {
    /// What was done (`open`, `read`, `rename`...).
    pub(crate) op: &'static str,
    /// The path.
    pub(crate) path: PathBuf,
    /// The errno, or an `InvalidData` error saying what is wrong.
    pub(crate) source: io::Error,
}

fn cstr(name: &OsStr) -> io::Result<CString> {
    CString::new(name.as_bytes()).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

/// A directory, opened once: files inside it are opened relative to this descriptor, so a
/// rename of the path mid-way cannot swap which directory they come from.
#[derive(Debug)]
pub(crate) struct Dir {
    fd: OwnedFd,
    path: PathBuf,
}

impl Dir {
    /// Opens `path` as a directory (following symlinks in the path itself: the caller named
    /// it).
    pub(crate) fn open(path: &Path) -> Result<Dir, FileError> {
        Dir::open_flags(path, 0)
    }

    fn open_flags(path: &Path, extra: libc::c_int) -> Result<Dir, FileError> {
        let err = |source| FileError {
            op: "open the directory",
            path: path.to_path_buf(),
            source,
        };
        let c = cstr(path.as_os_str()).map_err(err)?;
        // SAFETY: `c` is a NUL-terminated path that lives across the call.
        let fd = unsafe {
            libc::open(
                c.as_ptr(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC | extra,
            )
        };
        if fd < 0 {
            return Err(err(io::Error::last_os_error()));
        }
        Ok(Dir {
            // SAFETY: a descriptor the kernel just gave us, owned by nothing else.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            path: path.to_path_buf(),
        })
    }

    /// The directory `name` inside this one, opened relative to this descriptor and never
    /// through a symlink.
    pub(crate) fn open_child(&self, name: &str) -> Result<Dir, FileError> {
        let fd = self
            .openat(name, libc::O_RDONLY | libc::O_DIRECTORY, 0)
            .map_err(|source| FileError {
                op: "open the directory",
                path: self.join(name),
                source,
            })?;
        Ok(Dir {
            fd,
            path: self.join(name),
        })
    }

    /// A second descriptor of the same directory.
    pub(crate) fn try_clone(&self) -> io::Result<Dir> {
        Ok(Dir {
            fd: self.fd.try_clone()?,
            path: self.path.clone(),
        })
    }

    /// Whether `name` in this directory is, right now, the very directory `other` is open
    /// on (same device and inode; a symlink there is not).
    pub(crate) fn names(&self, name: &str, other: &Dir) -> bool {
        use std::os::unix::fs::MetadataExt;
        let Ok(here) = std::fs::symlink_metadata(self.join(name)) else {
            return false;
        };
        // SAFETY: fstat into a zeroed stat we own, on a descriptor we own.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::fstat(other.fd.as_raw_fd(), &mut st) } != 0 {
            return false;
        }
        here.is_dir() && here.dev() == st.st_dev && here.ino() == st.st_ino
    }

    /// Checks the directory is this process's own (its owner is our effective uid) and
    /// private (no group or other bits): one made to hold guest memory, not one swapped in.
    pub(crate) fn check_private(&self) -> io::Result<()> {
        use std::os::unix::fs::MetadataExt;
        let meta = File::from(self.fd.try_clone()?).metadata()?;
        let euid = crate::sys::euid();
        if meta.uid() != euid || meta.mode() & 0o077 != 0 {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!(
                    "is owned by uid {} with mode {:o}, not ours with mode 0700: swapped in by someone else?",
                    meta.uid(),
                    meta.mode() & 0o7777
                ),
            ));
        }
        Ok(())
    }

    /// The path it was opened by (for messages).
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// `name` inside this directory, as a path (for messages).
    pub(crate) fn join(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }

    fn openat(&self, name: &str, flags: libc::c_int, mode: libc::mode_t) -> io::Result<OwnedFd> {
        if name.is_empty() || name.contains('/') || name == "." || name == ".." {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{name:?} is not a plain file name"),
            ));
        }
        let c = cstr(OsStr::new(name))?;
        // SAFETY: `c` is a NUL-terminated name that lives across the call; the directory
        // descriptor is ours.
        let fd = unsafe {
            libc::openat(
                self.fd.as_raw_fd(),
                c.as_ptr(),
                flags | libc::O_CLOEXEC | libc::O_NOFOLLOW,
                libc::c_uint::from(mode),
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a descriptor the kernel just gave us, owned by nothing else.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Opens `name` for reading: no symlink followed, no FIFO waited on, and refused unless
    /// it is a regular file of at most `cap` bytes. Returns it and its length.
    pub(crate) fn open_regular(&self, name: &str, cap: u64) -> Result<(File, u64), FileError> {
        let path = self.join(name);
        let err = |op, source| FileError {
            op,
            path: path.clone(),
            source,
        };
        let fd = self
            .openat(name, libc::O_RDONLY | libc::O_NONBLOCK, 0)
            .map_err(|e| {
                let e = if e.raw_os_error() == Some(libc::ELOOP) {
                    io::Error::new(
                        io::ErrorKind::InvalidData,
                        "is a symlink; snapshot files are never followed through one",
                    )
                } else {
                    e
                };
                err("open", e)
            })?;
        let file = File::from(fd);
        let meta = file.metadata().map_err(|e| err("stat", e))?;
        let kind = meta.file_type();
        if !kind.is_file() {
            use std::os::unix::fs::FileTypeExt;
            let what = if kind.is_dir() {
                "a directory"
            } else if kind.is_fifo() {
                "a FIFO"
            } else if kind.is_block_device() || kind.is_char_device() {
                "a device"
            } else if kind.is_socket() {
                "a socket"
            } else {
                "not a regular file"
            };
            return Err(err(
                "open",
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("is {what}, not a regular file"),
                ),
            ));
        }
        if meta.len() > cap {
            return Err(err(
                "open",
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("is {} bytes, more than the {cap} allowed", meta.len()),
                ),
            ));
        }
        // Regular files never block; clear the flag anyway so reads are plain.
        // SAFETY: fcntl on a descriptor we own touches no memory.
        unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETFL, 0) };
        Ok((file, meta.len()))
    }

    /// Reads `name` whole (see [`Dir::open_regular`]); it may not grow past `cap` while read.
    pub(crate) fn read_capped(&self, name: &str, cap: u64) -> Result<Vec<u8>, FileError> {
        let (file, len) = self.open_regular(name, cap)?;
        let mut out = Vec::with_capacity(len as usize);
        file.take(cap + 1)
            .read_to_end(&mut out)
            .map_err(|source| FileError {
                op: "read",
                path: self.join(name),
                source,
            })?;
        if out.len() as u64 > cap {
            return Err(FileError {
                op: "read",
                path: self.join(name),
                source: io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("grew past the {cap} bytes allowed while read"),
                ),
            });
        }
        Ok(out)
    }

    /// Creates `name`, which must not exist (`O_EXCL`), for reading and writing.
    pub(crate) fn create_new(&self, name: &str) -> Result<File, FileError> {
        self.openat(
            name,
            libc::O_RDWR | libc::O_CREAT | libc::O_EXCL,
            0o644 as libc::mode_t,
        )
        .map(File::from)
        .map_err(|source| FileError {
            op: "create",
            path: self.join(name),
            source,
        })
    }

    /// A new file in this directory with no name (`O_TMPFILE`), readable and writable by
    /// its owner only: nothing is left of it if the process ends before
    /// [`Dir::link_unnamed`] names it. `Ok(None)` where the file system cannot make one, or
    /// it could not be named (no `/proc/self/fd` of this process).
    #[cfg(feature = "store")]
    pub(crate) fn create_unnamed(&self) -> Result<Option<File>, FileError> {
        // SAFETY: "." is a NUL-terminated literal; the directory descriptor is ours.
        let fd = unsafe {
            libc::openat(
                self.fd.as_raw_fd(),
                c".".as_ptr(),
                libc::O_TMPFILE | libc::O_RDWR | libc::O_CLOEXEC,
                0o600 as libc::c_uint,
            )
        };
        if fd < 0 {
            let e = io::Error::last_os_error();
            return match e.raw_os_error() {
                // The file system (or an old kernel) does not make unnamed files.
                Some(libc::EOPNOTSUPP) | Some(libc::EISDIR) | Some(libc::EINVAL) => Ok(None),
                _ => Err(FileError {
                    op: "create (unnamed, O_TMPFILE) in",
                    path: self.path.clone(),
                    source: e,
                }),
            };
        }
        // SAFETY: a descriptor the kernel just gave us, owned by nothing else.
        let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        // Named later through /proc/self/fd: where that is not this process's (no /proc in
        // a chroot, another PID namespace's), it could never be named, and all written to
        // it would be lost at the end.
        let proc_fd = format!("/proc/self/fd/{}", file.as_raw_fd());
        let ours = |m: std::fs::Metadata| {
            use std::os::unix::fs::MetadataExt;
            file.metadata()
                .is_ok_and(|f| f.ino() == m.ino() && f.dev() == m.dev())
        };
        if !std::fs::metadata(&proc_fd).is_ok_and(ours) {
            return Ok(None);
        }
        Ok(Some(file))
    }

    /// Names `file` (made by [`Dir::create_unnamed`]) `name` in this directory; fails with
    /// `EEXIST`, never replacing, if something is there. Through `/proc/self/fd` (linking
    /// the descriptor itself, `AT_EMPTY_PATH`, needs `CAP_DAC_READ_SEARCH`).
    #[cfg(feature = "store")]
    pub(crate) fn link_unnamed(&self, file: &File, name: &str) -> Result<(), FileError> {
        let err = |source| FileError {
            op: "name the file written as",
            path: self.join(name),
            source,
        };
        if name.is_empty() || name.contains('/') || name == "." || name == ".." {
            return Err(err(io::Error::from_raw_os_error(libc::EINVAL)));
        }
        let from = cstr(OsStr::new(&format!("/proc/self/fd/{}", file.as_raw_fd()))).map_err(err)?;
        let to = cstr(OsStr::new(name)).map_err(err)?;
        // SAFETY: both paths are NUL-terminated and live across the call; the directory
        // descriptor is ours.
        let r = unsafe {
            libc::linkat(
                libc::AT_FDCWD,
                from.as_ptr(),
                self.fd.as_raw_fd(),
                to.as_ptr(),
                libc::AT_SYMLINK_FOLLOW,
            )
        };
        if r != 0 {
            return Err(err(io::Error::last_os_error()));
        }
        Ok(())
    }

    /// Syncs the directory (its entries: a create or rename in it reaches the disk).
    pub(crate) fn sync(&self) -> Result<(), FileError> {
        // SAFETY: fsync on a descriptor we own touches no memory.
        if unsafe { libc::fsync(self.fd.as_raw_fd()) } != 0 {
            return Err(FileError {
                op: "sync",
                path: self.path.clone(),
                source: io::Error::last_os_error(),
            });
        }
        Ok(())
    }

    /// Renames `from` to `to`, both in this directory; with `replace` false, fails with
    /// `EEXIST` rather than replace anything at `to`.
    pub(crate) fn rename(&self, from: &str, to: &str, replace: bool) -> Result<(), FileError> {
        let err = |source| FileError {
            op: "rename",
            path: self.join(to),
            source,
        };
        let (a, b) = (
            cstr(OsStr::new(from)).map_err(err)?,
            cstr(OsStr::new(to)).map_err(err)?,
        );
        let flags = if replace { 0 } else { libc::RENAME_NOREPLACE };
        let err = |source: io::Error| {
            if !replace && source.raw_os_error() == Some(libc::EINVAL) {
                // renameat2 refuses flags the filesystem does not implement.
                return err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    "this filesystem cannot rename without replacing (RENAME_NOREPLACE): \
                     save to a local filesystem (ext4, xfs, btrfs, tmpfs)",
                ));
            }
            err(source)
        };
        // SAFETY: both names are NUL-terminated and live across the call; the descriptor is
        // ours.
        let r = unsafe {
            libc::renameat2(
                self.fd.as_raw_fd(),
                a.as_ptr(),
                self.fd.as_raw_fd(),
                b.as_ptr(),
                flags,
            )
        };
        if r != 0 {
            return Err(err(io::Error::last_os_error()));
        }
        Ok(())
    }

    /// Removes the file `name` (not a directory); a missing one is fine.
    pub(crate) fn unlink(&self, name: &str) {
        if let Ok(c) = cstr(OsStr::new(name)) {
            // SAFETY: a NUL-terminated name; the descriptor is ours.
            unsafe { libc::unlinkat(self.fd.as_raw_fd(), c.as_ptr(), 0) };
        }
    }

    /// Removes the empty directory `name`; `Ok(false)` when it is missing.
    pub(crate) fn rmdir(&self, name: &str) -> io::Result<bool> {
        let c = cstr(OsStr::new(name))?;
        // SAFETY: a NUL-terminated name; the descriptor is ours.
        if unsafe { libc::unlinkat(self.fd.as_raw_fd(), c.as_ptr(), libc::AT_REMOVEDIR) } == 0 {
            return Ok(true);
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ENOENT) {
            Ok(false)
        } else {
            Err(e)
        }
    }

    /// Makes the directory `name` (mode 0700: it holds guest memory until published).
    pub(crate) fn mkdir(&self, name: &str) -> io::Result<()> {
        let c = cstr(OsStr::new(name))?;
        // SAFETY: a NUL-terminated name; the descriptor is ours.
        if unsafe { libc::mkdirat(self.fd.as_raw_fd(), c.as_ptr(), 0o700) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Takes an advisory lock on the directory: `exclusive` or shared; with `wait` false,
    /// `Ok(false)` when someone else holds a conflicting one. Released when the descriptor
    /// closes (the process exits, or this `Dir` drops).
    pub(crate) fn lock(&self, exclusive: bool, wait: bool) -> io::Result<bool> {
        let mut op = if exclusive {
            libc::LOCK_EX
        } else {
            libc::LOCK_SH
        };
        if !wait {
            op |= libc::LOCK_NB;
        }
        loop {
            // SAFETY: flock on a descriptor we own touches no memory.
            if unsafe { libc::flock(self.fd.as_raw_fd(), op) } == 0 {
                return Ok(true);
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::EWOULDBLOCK) if !wait => return Ok(false),
                _ => return Err(e),
            }
        }
    }
}

/// A unique suffix for a temporary name: the process, the time and a counter.
pub(crate) fn unique_suffix() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!(
        "{}-{nanos:09}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// The directory and file name of `path`, for publishing beside it.
pub(crate) fn split(path: &Path) -> Result<(PathBuf, String), FileError> {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .filter(|n| !n.is_empty() && *n != "." && *n != "..")
        .ok_or_else(|| FileError {
            op: "name",
            path: path.to_path_buf(),
            source: io::Error::new(
                io::ErrorKind::InvalidInput,
                "needs a final UTF-8 file name (not `.`, `..` or `/`)",
            ),
        })?;
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    Ok((parent, name.to_string()))
}

/// Writes `bytes` to `path` whole or not at all: a new temporary file beside it (`O_EXCL`,
/// no symlink followed), synced, renamed over `path` (a symlink there is replaced, never
/// written through), and the directory synced. The temporary is removed if any step fails.
pub(crate) fn publish_file(path: &Path, bytes: &[u8]) -> Result<(), FileError> {
    let (parent, name) = split(path)?;
    let dir = Dir::open(&parent)?;
    let tmp = format!(".{name}.tmp-{}", unique_suffix());
    let written = (|| {
        let mut f = dir.create_new(&tmp)?;
        let werr = |op| {
            let p = dir.join(&tmp);
            move |source| FileError {
                op,
                path: p,
                source,
            }
        };
        f.write_all(bytes).map_err(werr("write"))?;
        f.sync_all().map_err(werr("sync"))?;
        dir.rename(&tmp, &name, true)?;
        dir.sync()
    })();
    if written.is_err() {
        dir.unlink(&tmp);
    }
    written
}

/// Checks that `path` can be published later: its directory opens, and what is there now
/// (if anything) is a regular file, not a directory, a symlink or something else.
pub(crate) fn check_publishable(path: &Path) -> Result<(), FileError> {
    let (parent, name) = split(path)?;
    let dir = Dir::open(&parent)?;
    match std::fs::symlink_metadata(dir.join(&name)) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(source) => {
            return Err(FileError {
                op: "stat",
                path: path.to_path_buf(),
                source,
            })
        }
        Ok(m) if m.file_type().is_file() => {}
        Ok(_) => {
            return Err(FileError {
                op: "check",
                path: path.to_path_buf(),
                source: io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "exists and is not a regular file (a symlink, directory or other): \
                     refusing to replace it",
                ),
            })
        }
    }
    // Probe that a file can be created there (write permission, not read-only).
    let probe = format!(".{name}.probe-{}", unique_suffix());
    dir.create_new(&probe)?;
    dir.unlink(&probe);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("gm-files-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn open_regular_refuses_symlinks_fifos_directories_and_oversized_files() {
        let d = scratch("open");
        std::fs::write(d.join("ok"), b"12345").unwrap();
        std::os::unix::fs::symlink(d.join("ok"), d.join("link")).unwrap();
        std::fs::create_dir(d.join("sub")).unwrap();
        let fifo = cstr(d.join("fifo").as_os_str()).unwrap();
        // SAFETY: a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        let dir = Dir::open(&d).unwrap();
        assert_eq!(dir.read_capped("ok", 5).unwrap(), b"12345");
        for (name, says) in [
            ("link", "is a symlink"),
            ("sub", "is a directory"),
            ("fifo", "is a FIFO"),
            ("missing", "No such file"),
            ("../ok", "not a plain file name"),
        ] {
            let e = dir.read_capped(name, 100).unwrap_err().to_string();
            assert!(e.contains(says), "{name}: {e}");
        }
        let e = dir.read_capped("ok", 4).unwrap_err().to_string();
        assert!(e.contains("5 bytes, more than the 4 allowed"), "{e}");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn publish_file_replaces_a_symlink_instead_of_writing_through_it() {
        let d = scratch("publish");
        std::fs::write(d.join("victim"), b"keep").unwrap();
        std::os::unix::fs::symlink(d.join("victim"), d.join("out")).unwrap();
        publish_file(&d.join("out"), b"new").unwrap();
        assert_eq!(std::fs::read(d.join("victim")).unwrap(), b"keep");
        assert_eq!(std::fs::read(d.join("out")).unwrap(), b"new");
        assert!(std::fs::symlink_metadata(d.join("out"))
            .unwrap()
            .file_type()
            .is_file());
        // Nothing but the two files is left.
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 2);
        let e = check_publishable(&d.join("nodir/x"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("nodir"), "{e}");
        std::os::unix::fs::symlink(d.join("victim"), d.join("link2")).unwrap();
        let e = check_publishable(&d.join("link2")).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
        check_publishable(&d.join("fresh")).unwrap();
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 3);
        let _ = std::fs::remove_dir_all(&d);
    }
}
