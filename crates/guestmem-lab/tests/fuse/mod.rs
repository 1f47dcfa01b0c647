//! A test rig: a one-file, read-only FUSE filesystem whose reads fail with `EIO` from a given
//! offset on, so a restore meets a real I/O error from the kernel (`pread` returns `EIO`).
//!
//! Written against the kernel's FUSE protocol directly (`/dev/fuse` and `mount(2)`; root, no
//! libfuse or fusermount needed). The file is opened `FOPEN_DIRECT_IO`, so every `pread`
//! becomes READ requests with no page cache in between: bytes before the offset come from
//! the backing file, a read at or past it fails.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;

const FUSE_LOOKUP: u32 = 1;
const FUSE_FORGET: u32 = 2;
const FUSE_GETATTR: u32 = 3;
const FUSE_OPEN: u32 = 14;
const FUSE_READ: u32 = 15;
const FUSE_STATFS: u32 = 17;
const FUSE_RELEASE: u32 = 18;
const FUSE_FLUSH: u32 = 25;
const FUSE_INIT: u32 = 26;
const FUSE_OPENDIR: u32 = 27;
const FUSE_READDIR: u32 = 28;
const FUSE_RELEASEDIR: u32 = 29;
const FUSE_INTERRUPT: u32 = 36;
const FUSE_DESTROY: u32 = 38;
const FUSE_BATCH_FORGET: u32 = 42;
const FOPEN_DIRECT_IO: u32 = 1;
const IN_HEADER: usize = 40;
const ROOT: u64 = 1;
const FILE: u64 = 2;

/// A mounted one-file filesystem; unmounted (and its server joined) on drop.
pub struct FailingFile {
    mountpoint: PathBuf,
    name: String,
    server: Option<JoinHandle<()>>,
}

impl FailingFile {
    /// Mounts at `mountpoint` (an empty directory) a file `name` with `backing`'s bytes,
    /// whose reads fail from `fail_from` on. `Err` when FUSE cannot be used here.
    pub fn mount(mountpoint: &Path, name: &str, backing: File, fail_from: u64) -> io::Result<Self> {
        let size = backing.metadata()?.len();
        // SAFETY: open(2) with a NUL-terminated literal path.
        let raw = unsafe { libc::open(c"/dev/fuse".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let opts = std::ffi::CString::new(format!(
            "fd={},rootmode=40000,user_id=0,group_id=0",
            fd.as_raw_fd()
        ))
        .unwrap();
        let target = std::ffi::CString::new(mountpoint.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: every pointer is a live NUL-terminated string for the call.
        let ret = unsafe {
            libc::mount(
                c"guestmem-test".as_ptr(),
                target.as_ptr(),
                c"fuse".as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV,
                opts.as_ptr() as *const libc::c_void,
            )
        };
        if ret != 0 {
            return Err(io::Error::last_os_error());
        }
        let fname = name.to_string();
        let server = std::thread::Builder::new()
            .name("fuse-server".into())
            .spawn(move || serve(fd, &fname, backing, size, fail_from))?;
        Ok(FailingFile {
            mountpoint: mountpoint.to_path_buf(),
            name: name.to_string(),
            server: Some(server),
        })
    }

    /// The file's path.
    pub fn path(&self) -> PathBuf {
        self.mountpoint.join(&self.name)
    }
}

impl Drop for FailingFile {
    fn drop(&mut self) {
        let target =
            std::ffi::CString::new(self.mountpoint.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a live NUL-terminated path.
        unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
        if let Some(s) = self.server.take() {
            let _ = s.join();
        }
    }
}

fn attr(node: u64, size: u64) -> Vec<u8> {
    let mut a = Vec::with_capacity(88);
    let (mode, nlink, size) = if node == ROOT {
        (libc::S_IFDIR | 0o755, 2u32, 0)
    } else {
        (libc::S_IFREG | 0o444, 1u32, size)
    };
    for v in [node, size, size.div_ceil(512), 0, 0, 0] {
        a.extend_from_slice(&v.to_le_bytes());
    }
    for v in [0u32, 0, 0, mode, nlink, 0, 0, 0, 4096, 0] {
        a.extend_from_slice(&v.to_le_bytes());
    }
    a
}

fn reply(fd: &OwnedFd, unique: u64, error: i32, payload: &[u8]) {
    let mut out = Vec::with_capacity(16 + payload.len());
    out.extend_from_slice(&((16 + payload.len()) as u32).to_le_bytes());
    out.extend_from_slice(&(-error).to_le_bytes());
    out.extend_from_slice(&unique.to_le_bytes());
    out.extend_from_slice(payload);
    // SAFETY: writes a live buffer to our descriptor.
    unsafe {
        libc::write(
            fd.as_raw_fd(),
            out.as_ptr() as *const libc::c_void,
            out.len(),
        )
    };
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

fn serve(fd: OwnedFd, name: &str, backing: File, size: u64, fail_from: u64) {
    let mut buf = vec![0u8; (1 << 20) + 4096];
    loop {
        // SAFETY: reads into a live buffer of buf.len() bytes.
        let n = unsafe {
            libc::read(
                fd.as_raw_fd(),
                buf.as_mut_ptr() as *mut libc::c_void,
                buf.len(),
            )
        };
        if n < 0 {
            match io::Error::last_os_error().raw_os_error() {
                Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::ENOENT) => continue,
                _ => return, // ENODEV: unmounted
            }
        }
        let req = &buf[..n as usize];
        if req.len() < IN_HEADER {
            continue;
        }
        let opcode = u32_at(req, 4);
        let unique = u64_at(req, 8);
        let node = u64_at(req, 16);
        let body = &req[IN_HEADER..];
        match opcode {
            FUSE_INIT => {
                let max_readahead = u32_at(body, 8);
                let mut out = Vec::with_capacity(64);
                for v in [7u32, 31, max_readahead, 0] {
                    out.extend_from_slice(&v.to_le_bytes());
                }
                out.extend_from_slice(&16u16.to_le_bytes()); // max_background
                out.extend_from_slice(&12u16.to_le_bytes()); // congestion_threshold
                out.extend_from_slice(&(128u32 << 10).to_le_bytes()); // max_write
                out.extend_from_slice(&1u32.to_le_bytes()); // time_gran
                out.extend_from_slice(&32u16.to_le_bytes()); // max_pages
                out.extend_from_slice(&0u16.to_le_bytes()); // map_alignment
                out.resize(64, 0);
                reply(&fd, unique, 0, &out);
            }
            FUSE_LOOKUP => {
                let want = body.split(|&c| c == 0).next().unwrap_or(&[]);
                if node == ROOT && want == name.as_bytes() {
                    let mut out = Vec::with_capacity(128);
                    for v in [FILE, 1, 3600, 3600] {
                        out.extend_from_slice(&v.to_le_bytes());
                    }
                    out.extend_from_slice(&[0u8; 8]);
                    out.extend_from_slice(&attr(FILE, size));
                    reply(&fd, unique, 0, &out);
                } else {
                    reply(&fd, unique, libc::ENOENT, &[]);
                }
            }
            FUSE_GETATTR => {
                let mut out = Vec::with_capacity(104);
                out.extend_from_slice(&3600u64.to_le_bytes());
                out.extend_from_slice(&[0u8; 8]);
                out.extend_from_slice(&attr(node, size));
                reply(&fd, unique, 0, &out);
            }
            FUSE_OPEN | FUSE_OPENDIR => {
                let flags = if opcode == FUSE_OPEN {
                    FOPEN_DIRECT_IO
                } else {
                    0
                };
                let mut out = 1u64.to_le_bytes().to_vec();
                out.extend_from_slice(&flags.to_le_bytes());
                out.extend_from_slice(&[0u8; 4]);
                reply(&fd, unique, 0, &out);
            }
            FUSE_READ => {
                let offset = u64_at(body, 8);
                let len = u32_at(body, 16) as u64;
                if offset >= fail_from {
                    reply(&fd, unique, libc::EIO, &[]);
                    continue;
                }
                let end = (offset + len).min(size).min(fail_from);
                let mut data = vec![0u8; end.saturating_sub(offset) as usize];
                match backing.read_exact_at(&mut data, offset) {
                    Ok(()) => reply(&fd, unique, 0, &data),
                    Err(_) => reply(&fd, unique, libc::EIO, &[]),
                }
            }
            FUSE_READDIR => reply(&fd, unique, 0, &[]),
            FUSE_STATFS => {
                let mut out = vec![0u8; 80];
                out[44..48].copy_from_slice(&255u32.to_le_bytes());
                reply(&fd, unique, 0, &out);
            }
            FUSE_RELEASE | FUSE_RELEASEDIR | FUSE_FLUSH => reply(&fd, unique, 0, &[]),
            FUSE_FORGET | FUSE_BATCH_FORGET | FUSE_INTERRUPT => {}
            FUSE_DESTROY => {
                reply(&fd, unique, 0, &[]);
                return;
            }
            _ => reply(&fd, unique, libc::ENOSYS, &[]),
        }
    }
}
