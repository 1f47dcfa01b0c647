//! Opening a caller's backing file (`Backing::File`, `Backing::FilePrivate`): only a regular
//! file of a file system whose files are data. A device, a FIFO or a pseudo-file may map (a
//! PCI BAR's sysfs resource is a regular file), but its pages need not read and write as
//! memory, nor stay.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsFd;
use std::path::Path;

/// Opens `path` for a region: read and write if `write` (else read only), falling back to
/// read only where writing is refused and `read_only_ok`; whether it was opened to write.
/// Looked at before the open (opening a FIFO waits for a writer, a device may act on its
/// open) and on what was opened (the path may have changed in between); never blocking on
/// the open, nor taking a terminal.
pub(super) fn open(path: &Path, write: bool, read_only_ok: bool) -> io::Result<(File, bool)> {
    if let Some(why) = not_memory(std::fs::metadata(path)?.is_file(), None) {
        return Err(why);
    }
    let open = |write: bool| {
        use std::os::unix::fs::OpenOptionsExt;
        OpenOptions::new()
            .read(true)
            .write(write)
            .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
            .open(path)
    };
    let (f, wrote) = match open(write) {
        Ok(f) => (f, write),
        Err(e) if write && read_only_ok && e.kind() == io::ErrorKind::PermissionDenied => {
            (open(false)?, false)
        }
        Err(e) => return Err(e),
    };
    if let Some(why) = not_memory(f.metadata()?.is_file(), Some(f.as_fd())) {
        return Err(why);
    }
    Ok((f, wrote))
}

/// Why a caller's backing file is not memory, or `None`: not a regular file, or (with its
/// descriptor) a file of a pseudo-file system (sysfs, proc, debugfs and the like), whose
/// regular files are the kernel's objects, not data.
fn not_memory(regular: bool, fd: Option<std::os::fd::BorrowedFd<'_>>) -> Option<io::Error> {
    if !regular {
        return Some(io::Error::other(
            "not a regular file (a device, FIFO or socket is not memory)",
        ));
    }
    // The magic numbers of <linux/magic.h>.
    const PSEUDO: [(u32, &str); 12] = [
        (0x6265_6572, "sysfs"),
        (0x9fa0, "proc"),
        (0x6462_6720, "debugfs"),
        (0x7472_6163, "tracefs"),
        (0x7363_6673, "securityfs"),
        (0x6265_6570, "configfs"),
        (0xcafe_4a11, "bpf"),
        (0x0027_e0eb, "cgroup"),
        (0x6367_7270, "cgroup2"),
        (0x1cd1, "devpts"),
        (0xde5e_81e4, "efivarfs"),
        (0x6165_676c, "pstore"),
    ];
    let fd = fd?;
    // SAFETY: statfs is plain data, for which all zeros is a valid value.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: fstatfs writes one statfs into a live struct; the descriptor is borrowed.
    if unsafe { libc::fstatfs(std::os::fd::AsRawFd::as_raw_fd(&fd), &mut fs) } != 0 {
        return Some(io::Error::last_os_error());
    }
    let f_type = fs.f_type as u32;
    PSEUDO.iter().find(|&&(t, _)| t == f_type).map(|(_, name)| {
        io::Error::other(format!(
            "a file of {name}, a pseudo-file system: the kernel's object, not memory"
        ))
    })
}
