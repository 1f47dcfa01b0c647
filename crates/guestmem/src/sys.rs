//! The syscalls guestmem makes that touch no memory range: page size, limits, memfds, CPU
//! affinity. Crate-private. (Reading and touching a mapping's pages through `/proc/self`
//! is [`crate::mmap::ProcMem`]: it names a range, so it lives with the range's owner.)
//!
//! Calls on a range of address space are not here: they are methods of the range's owner in
//! [`crate::mmap`], which checks the range before its one `unsafe` call.

pub mod inotify;

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// The base page size of this host, in bytes.
pub fn base_page_size() -> u64 {
    // SAFETY: sysconf has no memory-safety preconditions; it only reads a kernel constant.
    let v = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if v <= 0 {
        4096
    } else {
        v as u64
    }
}

fn check(ret: libc::c_int) -> io::Result<()> {
    if ret == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Creates a memfd named `name` with `flags` (`MFD_CLOEXEC` and `MFD_ALLOW_SEALING` are
/// always added, so its size can be sealed with [`seal_size`]).
pub fn memfd_create(name: &CStr, flags: libc::c_uint) -> io::Result<OwnedFd> {
    // SAFETY: `name` is a valid NUL-terminated string for the duration of the call.
    let fd = unsafe {
        libc::memfd_create(
            name.as_ptr(),
            flags | libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: memfd_create returned a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Seals a memfd's size: no one holding the descriptor can shrink or grow it any more, nor
/// add or remove seals. A mapping of a memfd that shrank under it raises `SIGBUS` on access;
/// after this, `ftruncate` fails with `EPERM` instead.
pub fn seal_size(fd: BorrowedFd<'_>) -> io::Result<()> {
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: fcntl(F_ADD_SEALS) on a descriptor we borrow touches no memory of this process.
    let ret = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) };
    check(ret)
}

/// The data ranges of `fd` within `start..end` (`SEEK_DATA`/`SEEK_HOLE`): for a memfd, the
/// pages it holds, in memory or swapped out, however they were written.
pub fn data_ranges(fd: BorrowedFd<'_>, start: u64, end: u64) -> io::Result<Vec<(u64, u64)>> {
    let mut out = Vec::new();
    let mut at = start;
    while at < end {
        // SAFETY: lseek on a descriptor we borrow touches no memory of this process.
        let data = unsafe { libc::lseek(fd.as_raw_fd(), at as libc::off_t, libc::SEEK_DATA) };
        if data < 0 {
            let e = io::Error::last_os_error();
            // ENXIO: no data at or after `at`.
            return if e.raw_os_error() == Some(libc::ENXIO) {
                Ok(out)
            } else {
                Err(e)
            };
        }
        let data = data as u64;
        if data >= end {
            break;
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd.as_raw_fd(), data as libc::off_t, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(io::Error::last_os_error());
        }
        let hole = (hole as u64).min(end);
        out.push((data, hole));
        at = hole;
    }
    Ok(out)
}

/// Why `SEEK_DATA` on files in the directory `dir` may report more than the pages written,
/// or `None`. A sparse file read there as "pages written, holes not" (a Firecracker Diff on
/// its base) would take the zeros around each write for data. Asked of the file system
/// itself: a page written into a sparse file made there must show as that page and no
/// more (a tmpfs whose files take huge pages at a `write(2)` shows 2 MiB; NFS, FUSE or 9p
/// through the kernel's generic lseek the whole file; ZFS a record); where no file can be
/// made there, by its type. A tmpfs that may take huge pages (mounted with `huge=always`
/// or `within_size`, or every tmpfs where `shmem_enabled` is `force`) is named as such.
/// (Diffs are read so only by pushes and moves.)
#[cfg(feature = "store")]
pub fn coarse_data_ranges(dir: BorrowedFd<'_>) -> io::Result<Option<String>> {
    if let Some(why) = huge_tmpfs(dir)? {
        return Ok(Some(format!(
            "{why}: a 4 KiB write there shows as 2 MiB of data, so the base's pages around it would read as zeros (use a tmpfs with huge=never, as /dev/shm, or a disk)"
        )));
    }
    // SAFETY: statfs is plain data, for which all zeros is a valid value.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: fstatfs writes one statfs into a live struct; the descriptor is borrowed.
    check(unsafe { libc::fstatfs(dir.as_raw_fd(), &mut fs) })?;
    // As u32: the magic numbers are 32 bits (f_type is a long, and signed where it is 32).
    let f_type = fs.f_type as u32;
    // Asked of the file system itself where a file can be made here: a page written into
    // a sparse file must show as that page of data and no more. (By its type alone an
    // overlayfs tells nothing of the file system under it, which answers SEEK_DATA.)
    const PROBE_LEN: u64 = 4 << 20;
    const PROBE_AT: u64 = (2 << 20) + 4096;
    if let Some(found) = probe_data_ranges(dir, PROBE_LEN, PROBE_AT)? {
        if found == [(PROBE_AT, PROBE_AT + 4096)] {
            return Ok(None);
        }
        let shown: Vec<String> = found
            .iter()
            .map(|(a, b)| format!("{a:#x}..{b:#x}"))
            .collect();
        return Ok(Some(format!(
            "a 4 KiB page written at {PROBE_AT:#x} into a sparse file here shows as data at \
             [{}]: its file system (type {f_type:#x}) reports more than the pages written, and \
             the base's pages around each write would read as zeros (put it on a local ext4, \
             xfs or btrfs, or a tmpfs with huge=never, as /dev/shm)",
            shown.join(", ")
        )));
    }
    // No file can be made here (read-only, full, or no O_TMPFILE): by its type. Those
    // whose SEEK_DATA reports the blocks written; others may report a whole file (NFSv3,
    // FUSE without lseek, 9p: the kernel's generic lseek) or a record (ZFS) as data.
    const EXACT: [(u32, &str); 6] = [
        (0xEF53, "ext4"),
        (0x5846_5342, "xfs"),
        (0x9123_683E, "btrfs"),
        (0xF2F5_2010, "f2fs"),
        (0xCA45_1A4E, "bcachefs"),
        (0x0102_1994, "tmpfs"),
    ];
    if !EXACT.iter().any(|&(t, _)| t == f_type) {
        return Ok(Some(format!(
            "its file system (type {f_type:#x}) is not one known to report as data only the \
             pages written ({}), and no file could be made here to ask it: NFS, FUSE, 9p, ZFS \
             or an overlayfs over one may report more, and the base's pages around each write \
             would read as zeros (put it on a local disk, or a tmpfs with huge=never, as \
             /dev/shm)",
            EXACT.map(|(_, n)| n).join(", ")
        )));
    }
    Ok(None)
}

/// The data ranges `SEEK_DATA` reports of an unnamed file made in `dir`, `len` bytes long,
/// with one 4 KiB page written at `at`; `None` where no such file can be made (read-only,
/// full, no `O_TMPFILE`).
#[cfg(feature = "store")]
fn probe_data_ranges(
    dir: BorrowedFd<'_>,
    len: u64,
    at: u64,
) -> io::Result<Option<Vec<(u64, u64)>>> {
    // SAFETY: "." is a NUL-terminated literal; the directory descriptor is borrowed.
    let fd = unsafe {
        libc::openat(
            dir.as_raw_fd(),
            c".".as_ptr(),
            libc::O_TMPFILE | libc::O_RDWR | libc::O_CLOEXEC,
            0o600 as libc::c_uint,
        )
    };
    if fd < 0 {
        return Ok(None);
    }
    // SAFETY: a descriptor the kernel just gave us, owned by nothing else.
    let file = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    use std::os::fd::AsFd;
    use std::os::unix::fs::FileExt;
    if file.set_len(len).is_err() || file.write_all_at(&[0x5a; 4096], at).is_err() {
        return Ok(None);
    }
    data_ranges(file.as_fd(), 0, len).map(Some)
}

/// Why `fd`'s filesystem is a tmpfs that may take huge pages at a `write(2)`, or `None`.
#[cfg(feature = "store")]
fn huge_tmpfs(fd: BorrowedFd<'_>) -> io::Result<Option<String>> {
    const TMPFS_MAGIC: libc::c_long = 0x0102_1994;
    // SAFETY: statfs is plain data, for which all zeros is a valid value.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: fstatfs writes one statfs into a live struct; the descriptor is borrowed.
    check(unsafe { libc::fstatfs(fd.as_raw_fd(), &mut fs) })?;
    if fs.f_type as libc::c_long != TMPFS_MAGIC {
        return Ok(None);
    }
    let global = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
        .unwrap_or_default();
    // `deny` keeps every tmpfs on base pages, whatever it was mounted with.
    if global.contains("[deny]") {
        return Ok(None);
    }
    if global.contains("[force]") {
        return Ok(Some(
            "every tmpfs takes huge pages here (transparent_hugepage/shmem_enabled is force)"
                .into(),
        ));
    }
    // SAFETY: stat is plain data, for which all zeros is a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat writes one stat into a live struct; the descriptor is borrowed.
    check(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) })?;
    let dev = format!("{}:{}", libc::major(st.st_dev), libc::minor(st.st_dev));
    let info = std::fs::read_to_string("/proc/self/mountinfo")?;
    Ok(match huge_tmpfs_option(&info, &dev) {
        Some(Some(h)) => Some(format!("its tmpfs is mounted with huge={h}")),
        Some(None) => None,
        // Another mount namespace's, or the kernel's own (a memfd): its option unknown.
        None => Some(format!(
            "its tmpfs (device {dev}) is not in this process's /proc/self/mountinfo, so whether it takes huge pages cannot be read"
        )),
    })
}

/// For the mount of device `dev` (`major:minor`) in `mountinfo` (`/proc/self/mountinfo`'s
/// text): `Some(Some(huge))` where it is mounted with a `huge=` that gives a `write(2)` huge
/// pages, `Some(None)` where it is not (`never`, `deny`, `advise`: a write has no mapping to
/// advise), `None` where no mount has that device. (Tested without the `store` feature too.)
#[cfg_attr(not(feature = "store"), allow(dead_code))]
fn huge_tmpfs_option(mountinfo: &str, dev: &str) -> Option<Option<String>> {
    mountinfo.lines().find_map(|line| {
        // Field 3 comes before the optional fields; paths have their spaces escaped.
        if line.split(' ').nth(2) != Some(dev) {
            return None;
        }
        // After the optional fields and " - ": fstype, source, super options.
        let (_, tail) = line.split_once(" - ")?;
        let opts = tail.split(' ').nth(2)?;
        Some(
            opts.split(',')
                .find_map(|o| o.strip_prefix("huge="))
                .filter(|h| !matches!(*h, "never" | "deny" | "advise"))
                .map(str::to_string),
        )
    })
}

/// Allocates `offset..offset+len` of `fd` (zeroed pages for a memfd or hugetlbfs file),
/// keeping its size.
pub fn fallocate(fd: BorrowedFd<'_>, offset: u64, len: u64) -> io::Result<()> {
    // SAFETY: fallocate on a descriptor we borrow touches no memory of this process.
    let ret = unsafe {
        libc::fallocate(
            fd.as_raw_fd(),
            libc::FALLOC_FL_KEEP_SIZE,
            offset as libc::off_t,
            len as libc::off_t,
        )
    };
    check(ret)
}

/// A non-blocking eventfd, used to stop threads that poll.
pub fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: eventfd takes flags only and returns a new descriptor or -1.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Makes an eventfd readable (for every poller, until read).
pub fn eventfd_signal(fd: BorrowedFd<'_>) -> io::Result<()> {
    let one = 1u64.to_ne_bytes();
    // SAFETY: writes 8 bytes from a live buffer to a descriptor we borrow.
    let ret = unsafe { libc::write(fd.as_raw_fd(), one.as_ptr() as *const libc::c_void, 8) };
    if ret == 8 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Reads (and so clears) an eventfd's count; `WouldBlock` when it was not signalled.
pub fn eventfd_read(fd: BorrowedFd<'_>) -> io::Result<u64> {
    let mut buf = [0u8; 8];
    // SAFETY: reads at most 8 bytes into a live buffer from a descriptor we borrow.
    let ret = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr() as *mut libc::c_void, 8) };
    if ret == 8 {
        Ok(u64::from_ne_bytes(buf))
    } else {
        Err(io::Error::last_os_error())
    }
}

/// One descriptor `poll` watches, and what it found: `libc::pollfd` with the descriptor
/// borrowed, so it cannot be closed while polled. `PollFd::skip` is a slot poll ignores
/// (a negative descriptor), kept so that indices stay fixed.
#[repr(transparent)]
pub struct PollFd<'a>(libc::pollfd, std::marker::PhantomData<BorrowedFd<'a>>);

impl<'a> PollFd<'a> {
    /// Waits for `fd` to be readable (`POLLIN`; hang-ups and errors are always reported).
    pub fn readable(fd: BorrowedFd<'a>) -> PollFd<'a> {
        PollFd::with(fd, libc::POLLIN)
    }

    /// Waits for `events` on `fd`.
    pub fn with(fd: BorrowedFd<'a>, events: libc::c_short) -> PollFd<'a> {
        PollFd(
            libc::pollfd {
                fd: fd.as_raw_fd(),
                events,
                revents: 0,
            },
            std::marker::PhantomData,
        )
    }

    /// A slot poll skips (it never reports anything).
    pub fn skip() -> PollFd<'a> {
        PollFd(
            libc::pollfd {
                fd: -1,
                events: 0,
                revents: 0,
            },
            std::marker::PhantomData,
        )
    }

    /// What poll reported.
    pub fn revents(&self) -> libc::c_short {
        self.0.revents
    }

    /// Whether poll reported anything at all.
    pub fn ready(&self) -> bool {
        self.0.revents != 0
    }
}

/// `poll(2)` over `fds`, for at most `timeout` (`None`: until something is ready); how many
/// are ready (0: the time ran out). A signal does not cut the wait short: it goes on for
/// what is left of the time.
pub fn poll(fds: &mut [PollFd<'_>], timeout: Option<std::time::Duration>) -> io::Result<usize> {
    let deadline = timeout.map(|t| std::time::Instant::now() + t);
    loop {
        let ms = match deadline {
            None => -1,
            Some(d) => {
                let left = d.saturating_duration_since(std::time::Instant::now());
                // Rounded up, so a wait of under a millisecond waits rather than spins.
                left.as_micros().div_ceil(1000).min(i32::MAX as u128) as libc::c_int
            }
        };
        // SAFETY: `PollFd` is `repr(transparent)` over `libc::pollfd`, so `fds` is a live
        // array of `fds.len()` pollfds, over descriptors borrowed for the call; the kernel
        // writes only their `revents`.
        let n = unsafe {
            libc::poll(
                fds.as_mut_ptr() as *mut libc::pollfd,
                fds.len() as libc::nfds_t,
                ms,
            )
        };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(e);
        }
    }
}

/// Whether `fd` is readable now (or hung up, or in error), without waiting.
pub fn is_readable(fd: BorrowedFd<'_>) -> bool {
    let mut p = [PollFd::readable(fd)];
    poll(&mut p, Some(std::time::Duration::ZERO)).is_ok_and(|n| n > 0)
}

/// Punches a hole over `offset..offset+len` of `fd`, freeing its pages.
pub fn punch_hole(fd: BorrowedFd<'_>, offset: u64, len: u64) -> io::Result<()> {
    let off =
        libc::off_t::try_from(offset).map_err(|_| io::Error::from_raw_os_error(libc::EOVERFLOW))?;
    let l =
        libc::off_t::try_from(len).map_err(|_| io::Error::from_raw_os_error(libc::EOVERFLOW))?;
    // SAFETY: fallocate on a descriptor we borrow touches no memory of this process.
    check(unsafe {
        libc::fallocate(
            fd.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            off,
            l,
        )
    })
}

/// Has the kernel probe an idle TCP connection: after `idle` without traffic, every
/// `interval`, `count` times, then reset it; and reset it when data sent stays unacknowledged
/// for `idle + interval * count` (`TCP_USER_TIMEOUT`). A read waiting on a peer whose host
/// went away (power, a partition: no FIN, no RST) then ends in an error instead of never.
#[cfg(feature = "store")]
pub(crate) fn tcp_keepalive(
    fd: BorrowedFd<'_>,
    idle: std::time::Duration,
    interval: std::time::Duration,
    count: u32,
) -> io::Result<()> {
    let secs = |d: std::time::Duration| d.as_secs().clamp(1, i32::MAX as u64) as libc::c_int;
    let user_ms = (idle + interval * count).as_millis().min(i32::MAX as u128) as libc::c_int;
    for (level, opt, v) in [
        (libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1),
        (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, secs(idle)),
        (libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, secs(interval)),
        (
            libc::IPPROTO_TCP,
            libc::TCP_KEEPCNT,
            count.min(i32::MAX as u32) as libc::c_int,
        ),
        (libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT, user_ms),
    ] {
        // SAFETY: an int option read from our stack, on a descriptor we borrow.
        let r = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                level,
                opt,
                &v as *const libc::c_int as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// This process's effective user id.
pub(crate) fn euid() -> u32 {
    // SAFETY: geteuid takes nothing and cannot fail.
    unsafe { libc::geteuid() }
}

/// 32 bytes no one else draws (`getrandom`): a move's placeholders' key, its nonces.
#[cfg(feature = "store")]
pub(crate) fn random_32() -> io::Result<[u8; 32]> {
    let mut key = [0u8; 32];
    let mut got = 0;
    while got < key.len() {
        // SAFETY: getrandom writes at most the given length into the buffer, which is ours
        // and that long from `got`.
        let n = unsafe {
            libc::getrandom(
                key[got..].as_mut_ptr() as *mut libc::c_void,
                key.len() - got,
                0,
            )
        };
        match n {
            n if n > 0 => got += n as usize,
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(key)
}

/// Sets the calling thread's nice value: background work (prefetch, cache writes) below the
/// vCPUs and the fault handlers. Best effort: a failure leaves the thread as it was.
pub fn set_thread_nice(nice: libc::c_int) {
    // SAFETY: gettid takes nothing; setpriority on our own thread id touches no memory.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, nice);
    }
}

/// The soft `RLIMIT_MEMLOCK` of this process in bytes, or `None` when it is unlimited.
pub fn memlock_limit() -> io::Result<Option<u64>> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid, writable rlimit that outlives the call.
    check(unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) })?;
    Ok(if lim.rlim_cur == libc::RLIM_INFINITY {
        None
    } else {
        Some(lim.rlim_cur)
    })
}

/// A set of CPUs, for [`sched_setaffinity`].
#[derive(Clone, Copy)]
pub struct CpuSet(libc::cpu_set_t);

impl std::fmt::Debug for CpuSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.cpus()).finish()
    }
}

impl CpuSet {
    /// Most CPUs a set can name (`CPU_SETSIZE`).
    pub const CAPACITY: usize = libc::CPU_SETSIZE as usize;

    /// The set of `cpus`; CPUs at or above [`CpuSet::CAPACITY`] are left out.
    pub fn from_cpus(cpus: impl IntoIterator<Item = usize>) -> CpuSet {
        // SAFETY: cpu_set_t is a plain bit array; all zeroes is the empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        for cpu in cpus.into_iter().filter(|&c| c < Self::CAPACITY) {
            // SAFETY: CPU_SET writes only bit `cpu` of `set`; the filter above keeps `cpu`
            // below CPU_SETSIZE, the number of bits in the set.
            unsafe { libc::CPU_SET(cpu, &mut set) };
        }
        CpuSet(set)
    }

    /// The CPUs in the set.
    pub fn cpus(&self) -> Vec<usize> {
        (0..Self::CAPACITY)
            // SAFETY: CPU_ISSET reads only bit `c` of the set; the range keeps `c` below
            // CPU_SETSIZE, the number of bits in the set.
            .filter(|&c| unsafe { libc::CPU_ISSET(c, &self.0) })
            .collect()
    }
}

/// The CPUs the calling thread may run on.
pub fn sched_getaffinity() -> io::Result<CpuSet> {
    let mut set = CpuSet::from_cpus([]);
    // SAFETY: `set.0` is a valid, writable cpu_set_t of the size passed; pid 0 is this thread.
    check(unsafe {
        libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set.0)
    })?;
    Ok(set)
}

/// Restricts the calling thread to the CPUs in `set`.
pub fn sched_setaffinity(set: &CpuSet) -> io::Result<()> {
    // SAFETY: `set.0` is a valid cpu_set_t of the size passed; pid 0 is this thread, and
    // affinity touches no memory.
    check(unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set.0) })
}

#[cfg(test)]
mod tests {
    use super::huge_tmpfs_option;

    #[test]
    fn a_tmpfs_mounts_huge_option_is_found_by_its_device() {
        let info = "\
25 1 0:22 / /dev/shm rw,nosuid shared:4 - tmpfs tmpfs rw,size=1024k\n\
26 1 0:23 / /mnt/a rw,relatime - tmpfs none rw,size=2097152k,huge=always\n\
27 1 0:24 / /mnt/b rw,relatime - tmpfs none rw,huge=never\n\
28 1 0:25 / /mnt/c rw - tmpfs none rw,huge=within_size,nr_inodes=4\n\
29 1 0:26 / /mnt/with\\040space rw - tmpfs none rw,huge=advise\n";
        let huge = |dev| huge_tmpfs_option(info, dev);
        assert_eq!(huge("0:22"), Some(None));
        assert_eq!(huge("0:23"), Some(Some("always".into())));
        assert_eq!(huge("0:24"), Some(None));
        assert_eq!(huge("0:25"), Some(Some("within_size".into())));
        assert_eq!(huge("0:26"), Some(None));
        assert_eq!(huge("0:99"), None);
    }
}
