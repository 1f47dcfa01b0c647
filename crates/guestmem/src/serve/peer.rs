//! The process on the other end of a page server's socket, held by a pidfd: a signal sent
//! through it reaches that process or none, never one that reused its pid. The pidfd comes
//! from `SO_PEERPIDFD` (Linux 6.5), which the kernel takes at `connect`; on older kernels it
//! is `pidfd_open` of `SO_PEERCRED`'s pid at accept, which leaves a window (the peer exits
//! and its pid is reused before the accept) that only `SO_PEERPIDFD` closes.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

use super::{OnFailure, ServeLog};

/// What a server does with a VM it cannot serve, and where it says so: every path that
/// stops serving a VM that sent its userfaultfd goes through [`Ending::end`].
#[derive(Debug, Clone)]
pub(crate) struct Ending {
    pub(crate) on_failure: OnFailure,
    pub(crate) log: ServeLog,
}

impl Ending {
    /// Applies the policy to a VM that cannot be served, and logs what was done and why.
    pub(crate) fn end(&self, process: &PeerProcess, why: &dyn std::fmt::Display) {
        let who = process.pid().map_or("?".into(), |p| p.to_string());
        match self.on_failure {
            OnFailure::Kill => match process.kill() {
                Ok(()) => self.log.warn(&format!(
                    "killed the peer {who} (through its pidfd): its memory cannot be served: \
                     {why}"
                )),
                Err(e) => self.log.warn(&format!(
                    "could not kill the peer {who} ({e}); it may wait for ever: {why}"
                )),
            },
            OnFailure::Leave => self.log.warn(&format!(
                "left the peer {who} (the failure policy leaves it); it waits on memory that \
                 will not come: {why}"
            )),
        }
    }
}

/// `SO_PEERPIDFD` (Linux 6.5): a pidfd of the process that connected, taken by the kernel at
/// `connect` time. Not in the libc crate yet; the value is the kernel's
/// (`include/uapi/asm-generic/socket.h`).
const SO_PEERPIDFD: libc::c_int = 77;

/// The peer of a connection: its pid and a pidfd for it.
#[derive(Debug)]
pub struct PeerProcess {
    pid: Option<i32>,
    pidfd: Option<OwnedFd>,
}

impl PeerProcess {
    /// The process that connected `stream`: a pidfd from `SO_PEERPIDFD`, or, on kernels
    /// without it, `pidfd_open` of the pid from `SO_PEERCRED` at once.
    pub(crate) fn of(stream: &UnixStream) -> PeerProcess {
        let pid = peer_pid(stream);
        let pidfd = peer_pidfd(stream).or_else(|| pid.and_then(pidfd_open));
        PeerProcess { pid, pidfd }
    }

    /// Its process id, as the socket told it.
    pub fn pid(&self) -> Option<i32> {
        self.pid
    }

    /// Whether a signal can reach it (a pidfd was had).
    pub fn can_signal(&self) -> bool {
        self.pidfd.is_some()
    }

    /// Sends `SIGKILL` through the pidfd. Refuses this very process (a peer in the same
    /// process, as in tests and the lab) and a peer with no pidfd.
    pub(crate) fn kill(&self) -> io::Result<()> {
        if self.pid == Some(std::process::id() as i32) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "the peer is this process",
            ));
        }
        let Some(fd) = &self.pidfd else {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "no pidfd for the peer (SO_PEERPIDFD and pidfd_open both failed)",
            ));
        };
        // SAFETY: pidfd_send_signal takes a pidfd we own, a signal number, a null siginfo
        // and no flags; it touches no memory of ours.
        let r = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                fd.as_raw_fd(),
                libc::SIGKILL,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

impl PeerProcess {
    /// [`PeerProcess::kill`], then waits up to `limit` for it to have exited (its pidfd
    /// readable): whether it has. A process already gone counts as ended.
    #[cfg(feature = "store")]
    pub(crate) fn kill_and_wait(&self, limit: std::time::Duration) -> io::Result<bool> {
        if let Err(e) = self.kill() {
            if e.raw_os_error() != Some(libc::ESRCH) {
                return Err(e);
            }
        }
        let Some(fd) = self.pidfd() else {
            return Ok(false);
        };
        let mut fds = [crate::sys::PollFd::readable(fd)];
        Ok(crate::sys::poll(&mut fds, Some(limit))? > 0)
    }

    /// The process `pid` again, after a restart of the server, if it is still the one that
    /// started at `start_time` (clock ticks after boot, `/proc/PID/stat`): the pidfd is
    /// taken first and the start time read after, so a pid reused meanwhile is refused.
    pub(crate) fn reopen(pid: i32, start_time: u64) -> io::Result<PeerProcess> {
        let pidfd = pidfd_open(pid).ok_or_else(io::Error::last_os_error)?;
        match start_time_of(pid) {
            Some(t) if t == start_time => Ok(PeerProcess {
                pid: Some(pid),
                pidfd: Some(pidfd),
            }),
            _ => Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("process {pid} is not the one that started at tick {start_time}"),
            )),
        }
    }

    /// When it started, clock ticks after boot.
    pub(crate) fn start_time(&self) -> Option<u64> {
        self.pid.and_then(start_time_of)
    }

    /// Its pidfd: readable once it has exited.
    pub(crate) fn pidfd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        use std::os::fd::AsFd;
        self.pidfd.as_ref().map(|f| f.as_fd())
    }

    /// A duplicate of its descriptor `fd` (`pidfd_getfd`; needs ptrace access to it).
    pub(crate) fn take_fd(&self, fd: i32) -> io::Result<OwnedFd> {
        let pidfd = self
            .pidfd
            .as_ref()
            .ok_or_else(|| io::Error::from(io::ErrorKind::Unsupported))?;
        // SAFETY: pidfd_getfd takes a pidfd we own, a descriptor number in that process and
        // no flags; it returns a new descriptor of ours or -1.
        let r = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a new descriptor nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(r as i32) })
    }

    /// The number under which it holds the same open file as our `ours`: its descriptors
    /// that are userfaultfds, compared with `kcmp(KCMP_FILE)`.
    pub(crate) fn fd_number_of(&self, ours: std::os::fd::BorrowedFd<'_>) -> io::Result<i32> {
        let pid = self
            .pid
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        // Through a live thread: a main thread that has exited while others run on holds no
        // descriptors (its `/proc/PID/fd` is empty, `kcmp` on it fails).
        let tid = live_thread(pid).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("process {pid} has no live thread"),
            )
        })?;
        for e in std::fs::read_dir(format!("/proc/{pid}/task/{tid}/fd"))? {
            let e = e?;
            let Some(n) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
                continue;
            };
            if !std::fs::read_link(e.path())
                .is_ok_and(|l| l.as_os_str() == "anon_inode:[userfaultfd]")
            {
                continue;
            }
            const KCMP_FILE: libc::c_int = 0;
            // SAFETY: kcmp compares two processes' descriptors by number; it touches no
            // memory of ours.
            let r = unsafe {
                libc::syscall(
                    libc::SYS_kcmp,
                    std::process::id() as libc::pid_t,
                    tid,
                    KCMP_FILE,
                    ours.as_raw_fd() as libc::c_ulong,
                    n as libc::c_ulong,
                )
            };
            if r == 0 {
                return Ok(n);
            }
        }
        Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("process {pid} holds no descriptor of this userfaultfd"),
        ))
    }
}

impl PeerProcess {
    /// Whether it runs on, not exited nor exiting, holding a descriptor of `ours`: a VM that
    /// closed its socket but goes on using its memory. Never this very process (a peer in
    /// the server's process, as in tests: the server's own descriptor would be found).
    /// Asked again after the look at its descriptors, so that an exit begun meanwhile
    /// (a process's descriptors are closed as it exits, its socket's among them) counts as
    /// gone.
    pub(crate) fn runs_on_holding(&self, ours: std::os::fd::BorrowedFd<'_>) -> bool {
        let (Some(pid), Some(pidfd)) = (self.pid, self.pidfd()) else {
            return false;
        };
        if pid == std::process::id() as i32 {
            return false;
        }
        let live = || !crate::sys::is_readable(pidfd) && !exiting(pid);
        live() && self.fd_number_of(ours).is_ok() && live()
    }
}

/// Whether process `pid` is exiting or gone: it has no [`live_thread`].
fn exiting(pid: i32) -> bool {
    live_thread(pid).is_none()
}

/// A thread of process `pid` that is neither a zombie nor dead (field 3 of its `stat`) nor
/// flagged `PF_EXITING` (field 9), which an exit sets before it closes a descriptor. Every
/// thread is looked at, not the main one alone: a main thread may exit while the others run
/// on (its `stat` then says zombie). Unreadable counts as none.
fn live_thread(pid: i32) -> Option<i32> {
    const PF_EXITING: u64 = 0x4;
    let live = |stat: &str| {
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
            return false;
        };
        let f: Vec<&str> = rest.split_whitespace().collect();
        let state = f.first().copied().unwrap_or("X");
        let flags: u64 = f.get(6).and_then(|v| v.parse().ok()).unwrap_or(PF_EXITING);
        !matches!(state, "Z" | "X" | "x") && flags & PF_EXITING == 0
    };
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .find(|tid| {
            std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat")).is_ok_and(|s| live(&s))
        })
}

/// Whether the process on the other end of `s` runs as this process's user, or as root
/// (`SO_PEERCRED`): who may command a server, or hand it VMs.
pub(crate) fn same_user(s: &UnixStream) -> bool {
    let us = crate::sys::euid();
    peer_cred(s).is_some_and(|c| c.uid == us || c.uid == 0)
}

/// Field 22 of `/proc/PID/stat`: when the process started, clock ticks after boot.
fn start_time_of(pid: i32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: count from the last ')'.
    let rest = &s[s.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// The peer's pid (`SO_PEERCRED`).
fn peer_pid(s: &UnixStream) -> Option<i32> {
    peer_cred(s).map(|c| c.pid).filter(|&p| p > 0)
}

/// The peer's credentials as it connected (`SO_PEERCRED`).
fn peer_cred(s: &UnixStream) -> Option<libc::ucred> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: u32::MAX,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: cred is a live ucred and len its size; the kernel writes at most len bytes.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            &mut cred as *mut libc::ucred as *mut libc::c_void,
            &mut len,
        )
    };
    (r == 0).then_some(cred)
}

/// A pidfd of the peer (`SO_PEERPIDFD`).
fn peer_pidfd(s: &UnixStream) -> Option<OwnedFd> {
    let mut fd: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: fd is a live c_int and len its size; the kernel writes at most len bytes.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_PEERPIDFD,
            &mut fd as *mut libc::c_int as *mut libc::c_void,
            &mut len,
        )
    };
    // SAFETY: on success the kernel installed a new descriptor that nothing else owns.
    (r == 0 && fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `pidfd_open(pid)`.
fn pidfd_open(pid: i32) -> Option<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    // SAFETY: a new descriptor nothing else owns.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_in_this_process_is_held_by_pidfd_but_never_killed() {
        let (a, _b) = UnixStream::pair().unwrap();
        let p = PeerProcess::of(&a);
        assert_eq!(p.pid(), Some(std::process::id() as i32));
        assert!(
            p.can_signal(),
            "SO_PEERPIDFD or pidfd_open works on Linux >= 5.3"
        );
        let e = p.kill().unwrap_err();
        assert!(e.to_string().contains("this process"), "{e}");
    }

    /// A process sent SIGKILL is seen to have exited (its pidfd readable) before the
    /// wait returns true; one already gone counts as ended too.
    #[cfg(feature = "store")]
    #[test]
    fn a_killed_process_is_waited_for_until_it_has_exited() {
        let child = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        let mut guard = guestmem_testkit::ChildGuard::new(child);
        let p = PeerProcess::reopen(pid, start_time_of(pid).unwrap()).unwrap();
        assert!(p.kill_and_wait(std::time::Duration::from_secs(10)).unwrap());
        // Exited: /proc says zombie (not yet reaped) or nothing.
        let state = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        assert!(
            state.is_empty()
                || state
                    .rsplit(')')
                    .next()
                    .unwrap()
                    .trim_start()
                    .starts_with('Z'),
            "{state}"
        );
        assert!(p.kill_and_wait(std::time::Duration::from_secs(1)).unwrap());
        assert!(!guard.wait_exit(5).success(), "killed");
    }

    #[test]
    fn a_child_is_killed_through_its_pidfd() {
        let dir = std::env::temp_dir().join(format!("gm-peer-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let sock = dir.join("s");
        let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        // A child that connects and then waits for ever: its socket's peer is the child.
        let mut child = std::process::Command::new("python3")
            .arg("-c")
            .arg(format!(
                "import socket,time; s=socket.socket(socket.AF_UNIX); s.connect({:?}); time.sleep(60)",
                sock.to_str().unwrap()
            ))
            .spawn()
            .unwrap();
        struct Reap<'a>(&'a mut std::process::Child);
        impl Drop for Reap<'_> {
            fn drop(&mut self) {
                let _ = self.0.kill();
                let _ = self.0.wait();
            }
        }
        let guard = Reap(&mut child);
        // Accept with a deadline: a child that never connects fails the test, not hangs it.
        listener.set_nonblocking(true).unwrap();
        let t = std::time::Instant::now();
        let s = loop {
            match listener.accept() {
                Ok((s, _)) => break s,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    assert!(t.elapsed().as_secs() < 20, "the child never connected");
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                Err(e) => panic!("accept: {e}"),
            }
        };
        let p = PeerProcess::of(&s);
        assert_eq!(p.pid(), Some(guard.0.id() as i32));
        p.kill().unwrap();
        let status = guard.0.wait().unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc::SIGKILL));
        drop(guard);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
