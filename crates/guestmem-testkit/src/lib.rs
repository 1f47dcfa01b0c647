//! Test support shared by the tests of every guestmem crate. Not library API: a
//! dev-dependency only, and it depends on no guestmem crate (so a crate's own tests can use
//! it without a second copy of that crate).
//!
//! - [`host_lock`]: one lock for what the host holds for everyone (hugetlb pools, memory
//!   mappings that may merge with a neighbour's, cgroups): tests that touch them take it.
//! - [`skip`] and [`skip_unless!`]: a test that cannot run here says why on the terminal
//!   (written past the test harness's capture, so it shows without `--nocapture`) and in
//!   `target/test-skips.log`, which `.ci/run` counts and prints at the end.
//! - [`ChildGuard`] and [`Scratch`]: a child process killed and reaped, a folder removed,
//!   however the test ends.
//! - [`HugePool2M`]: the hugetlb pool grown for a test and put back.
//! - [`firecracker`]: a stand-in for Firecracker restoring a snapshot through a page server
//!   (its exact handshake), for the page server's tests and the lab's measurements.
#![deny(missing_docs)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub mod firecracker;
pub mod s3;

/// A one-request HTTP server on 127.0.0.1 (a port of its own): it takes one connection,
/// reads one request's head, and hands the connection to `answer` on its thread. Its
/// address, and the thread (what `answer` returned).
pub fn http_once<T: Send + 'static>(
    answer: impl FnOnce(std::net::TcpStream) -> T + Send + 'static,
) -> (std::net::SocketAddr, std::thread::JoinHandle<T>) {
    use std::io::BufRead;
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    let addr = l.local_addr().expect("its address");
    let t = std::thread::spawn(move || {
        let (s, _) = l.accept().expect("a connection");
        let mut r = std::io::BufReader::new(s.try_clone().expect("a second handle"));
        loop {
            let mut h = String::new();
            if r.read_line(&mut h).expect("the request's head") == 0 || h == "\r\n" {
                break;
            }
        }
        answer(s)
    });
    (addr, t)
}

static HOST: Mutex<()> = Mutex::new(());

/// Takes the one lock for host-wide resources (held until the guard drops). A test that
/// panicked while holding it does not poison it for the others.
pub fn host_lock() -> MutexGuard<'static, ()> {
    HOST.lock().unwrap_or_else(|e| e.into_inner())
}

/// Where skips are recorded: `$GUESTMEM_SKIP_LOG`, else `test-skips.log` in the cargo
/// target directory this test binary was built in.
pub fn skip_log() -> PathBuf {
    if let Some(p) = std::env::var_os("GUESTMEM_SKIP_LOG") {
        return PathBuf::from(p);
    }
    // target/<profile>/deps/<test binary>
    std::env::current_exe()
        .ok()
        .and_then(|e| e.ancestors().nth(3).map(Path::to_path_buf))
        .unwrap_or_else(std::env::temp_dir)
        .join("test-skips.log")
}

/// Records that the calling test does not run here, and why: a line on the terminal and one
/// in [`skip_log`]. The caller returns after it.
pub fn skip(why: impl std::fmt::Display) {
    let test = std::thread::current()
        .name()
        .unwrap_or("(unnamed test)")
        .to_string();
    let line = format!("SKIPPED {test}: {why}\n");
    // Straight to descriptor 2: the harness captures `eprintln!`, not the descriptor.
    // SAFETY: writes a live buffer of its own length to stderr.
    unsafe { libc::write(2, line.as_ptr() as *const libc::c_void, line.len()) };
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(skip_log())
    {
        let _ = f.write_all(line.as_bytes());
    }
}

/// `skip_unless!(why)` with `why: Option<impl Display>`: when it is `Some`, records the skip
/// (see [`skip`]) and returns from the test.
#[macro_export]
macro_rules! skip_unless {
    ($why:expr) => {
        if let Some(why) = $why {
            $crate::skip(why);
            return;
        }
    };
}

/// A child process that is killed and reaped when dropped, however the test ends.
#[derive(Debug)]
pub struct ChildGuard {
    child: Option<Child>,
    /// Its entry among [`GUARDED`] (0: none).
    serial: u64,
}

/// The pidfds of guarded children, by their guards' serials, so that
/// [`kill_guarded_children`] can end them all when the process ends without unwinding (a lab
/// run stopped by a signal). A pidfd names its one process: a child reaped meanwhile is
/// not there to signal, and its pid reused by another process is not it. Each guard so
/// holds one descriptor more while it lives (a fleet of 1,000 handlers, 1,000); where none
/// is left, its child is guarded by its drop alone.
static GUARDED: Mutex<Vec<(u64, std::os::fd::OwnedFd)>> = Mutex::new(Vec::new());

fn guarded() -> MutexGuard<'static, Vec<(u64, std::os::fd::OwnedFd)>> {
    GUARDED.lock().unwrap_or_else(|e| e.into_inner())
}

/// Set by [`kill_guarded_children`]: a guard made after it kills its child at once.
static STOPPED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Kills (`SIGKILL`) every child a [`ChildGuard`] holds, without reaping them: for a process
/// about to exit whose guards will not drop. A child guarded after this call is killed as
/// its guard is made (a thread of the process may still be starting one).
pub fn kill_guarded_children() {
    use std::os::fd::AsRawFd;
    let list = guarded();
    STOPPED.store(true, std::sync::atomic::Ordering::SeqCst);
    for (_, fd) in list.iter() {
        // SAFETY: pidfd_send_signal takes a pidfd this process owns (held open in
        // GUARDED), a signal number and no siginfo; it touches no memory of ours.
        unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                fd.as_raw_fd(),
                libc::SIGKILL,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
    }
}

impl ChildGuard {
    /// Guards `child`.
    pub fn new(mut child: Child) -> ChildGuard {
        use std::os::fd::FromRawFd;
        static SERIAL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let mut list = guarded();
        if STOPPED.load(std::sync::atomic::Ordering::SeqCst) {
            let _ = child.kill();
            return ChildGuard {
                child: Some(child),
                serial: 0,
            };
        }
        // SAFETY: pidfd_open takes a pid and flags, and returns a new descriptor or -1. The
        // child is not reaped yet (it is ours to wait on), so its pid is still its own.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, child.id() as libc::pid_t, 0) };
        let serial = match fd {
            fd if fd >= 0 => {
                let serial = SERIAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                // SAFETY: a descriptor pidfd_open just made, owned by nothing else.
                let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) };
                list.push((serial, fd));
                serial
            }
            // No pidfds (a kernel before 5.3): guarded by its drop alone.
            _ => 0,
        };
        ChildGuard {
            child: Some(child),
            serial,
        }
    }

    /// An empty guard (nothing to kill).
    pub fn none() -> ChildGuard {
        ChildGuard {
            child: None,
            serial: 0,
        }
    }

    /// The child, while guarded.
    pub fn child(&mut self) -> &mut Child {
        self.child.as_mut().expect("a guarded child")
    }

    /// Its process id.
    pub fn id(&self) -> u32 {
        self.child.as_ref().expect("a guarded child").id()
    }

    /// Whether it still runs.
    pub fn running(&mut self) -> bool {
        self.child().try_wait().is_ok_and(|s| s.is_none())
    }

    /// Its exit status, if it has exited (reaped then).
    pub fn try_status(&mut self) -> std::io::Result<Option<ExitStatus>> {
        self.child().try_wait()
    }

    /// Kills and reaps it now (a no-op once reaped).
    pub fn kill(&mut self) {
        if let Some(c) = self.child.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.unlist();
    }

    /// Out of [`GUARDED`]: reaped, or about to be.
    fn unlist(&mut self) {
        let serial = std::mem::take(&mut self.serial);
        if serial != 0 {
            guarded().retain(|(s, _)| *s != serial);
        }
    }

    /// Waits for it to exit by itself, at most `limit`; an error past that.
    pub fn wait_within(&mut self, limit: Duration) -> std::io::Result<ExitStatus> {
        let t = Instant::now();
        loop {
            if let Some(s) = self.child().try_wait()? {
                return Ok(s);
            }
            if t.elapsed() > limit {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("process {} still running after {limit:?}", self.id()),
                ));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Waits at most `secs` for it to exit (panics past that: the guard then kills it).
    pub fn wait_exit(&mut self, secs: u64) -> ExitStatus {
        let t = Instant::now();
        loop {
            if let Some(s) = self.child().try_wait().expect("try_wait") {
                return s;
            }
            let id = self.id();
            assert!(
                t.elapsed() < Duration::from_secs(secs),
                "process {id} did not exit within {secs} s"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.unlist();
    }
}

/// A fresh folder for one test (under the system's temporary directory, named by the
/// process and `name`), removed when dropped.
#[derive(Debug)]
pub struct Scratch(PathBuf);

impl Scratch {
    /// Makes it, removing what a run before may have left.
    pub fn new(name: &str) -> Scratch {
        let d = std::env::temp_dir().join(format!("gm-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("create a scratch folder");
        Scratch(d)
    }
}

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_skip_is_written_to_the_log_with_the_test_name() {
        let log = Scratch::new("testkit-skip");
        let path = log.join("skips.log");
        std::env::set_var("GUESTMEM_SKIP_LOG", &path);
        skip(format_args!("no {} here", "widget"));
        std::env::remove_var("GUESTMEM_SKIP_LOG");
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(
            text,
            "SKIPPED tests::a_skip_is_written_to_the_log_with_the_test_name: no widget here\n"
        );
    }

    #[test]
    fn a_guarded_child_is_killed_and_reaped_on_drop() {
        let child = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        drop(ChildGuard::new(child));
        // Reaped: the pid is no longer ours to wait on.
        // SAFETY: waitpid with WNOHANG on a pid; touches only `status`.
        let r = unsafe { libc::waitpid(pid, std::ptr::null_mut(), libc::WNOHANG) };
        assert_eq!(r, -1);
    }
}

/// The 2 MiB hugetlb pool, grown by some pages for a test and put back when dropped (the
/// caller holds [`host_lock`] meanwhile: the pool is the host's).
#[derive(Debug)]
pub struct HugePool2M {
    old: u64,
    serial: u64,
}

/// Pools grown and not put back yet, the first grown first: (serial, the size before).
static GROWN: Mutex<Vec<(u64, u64)>> = Mutex::new(Vec::new());

fn grown() -> MutexGuard<'static, Vec<(u64, u64)>> {
    GROWN.lock().unwrap_or_else(|e| e.into_inner())
}

/// Puts the 2 MiB pool back to its size before the first [`HugePool2M`] still held grew
/// it: for a process about to exit whose guards will not drop.
pub fn put_back_grown_pools() {
    if let Some(&(_, old)) = grown().first() {
        let _ = std::fs::write(format!("{POOL_2M_DIR}/nr_hugepages"), old.to_string());
    }
}

const POOL_2M_DIR: &str = "/sys/kernel/mm/hugepages/hugepages-2048kB";

fn pool_2m(file: &str) -> Result<u64, String> {
    let p = format!("{POOL_2M_DIR}/{file}");
    std::fs::read_to_string(&p)
        .map_err(|e| format!("{p}: {e}"))?
        .trim()
        .parse()
        .map_err(|e| format!("{p}: {e}"))
}

impl HugePool2M {
    /// Grows the pool so that at least `pages` pages are free and unreserved; why not,
    /// when it cannot (not root, no such pool, the kernel found no memory).
    pub fn grow(pages: u64) -> Result<HugePool2M, String> {
        static SERIAL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let old = pool_2m("nr_hugepages")?;
        let serial = SERIAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        grown().push((serial, old));
        let guard = HugePool2M { old, serial };
        std::fs::write(
            format!("{POOL_2M_DIR}/nr_hugepages"),
            (old + pages).to_string(),
        )
        .map_err(|e| format!("cannot grow the 2 MiB hugetlb pool ({e}); needs root"))?;
        let free = pool_2m("free_hugepages")?.saturating_sub(pool_2m("resv_hugepages")?);
        if free < pages {
            return Err(format!(
                "asked for {pages} free 2 MiB pages, the pool has {free}"
            ));
        }
        Ok(guard)
    }
}

impl Drop for HugePool2M {
    fn drop(&mut self) {
        if let Err(e) = std::fs::write(format!("{POOL_2M_DIR}/nr_hugepages"), self.old.to_string())
        {
            eprintln!("could not put nr_hugepages back to {}: {e}", self.old);
        }
        grown().retain(|(s, _)| *s != self.serial);
    }
}

/// A tmpfs mounted at a fresh directory for one test (a small disk that fills, a tmpfs with
/// huge pages); unmounted, and the directory removed, on drop.
pub struct Tmpfs(PathBuf);

impl Tmpfs {
    /// Mounts one at `at` (made here) with `opts` (`size=1m`, `huge=always`); `Err(why)`
    /// where this host cannot (not root, no tmpfs): skip the test with it.
    pub fn mount(at: PathBuf, opts: &str) -> Result<Tmpfs, String> {
        Tmpfs::mount_as("tmpfs", at, opts)
    }

    /// [`Tmpfs::mount`] of another memory file system (`ramfs`), unmounted the same way.
    pub fn mount_as(fstype: &str, at: PathBuf, opts: &str) -> Result<Tmpfs, String> {
        std::fs::create_dir(&at).map_err(|e| format!("mkdir {}: {e}", at.display()))?;
        let out = std::process::Command::new("mount")
            .args(["-t", fstype, "-o", opts, "guestmem-test"])
            .arg(&at)
            .output();
        match out {
            Ok(o) if o.status.success() => Ok(Tmpfs(at)),
            Ok(o) => {
                let _ = std::fs::remove_dir(&at);
                Err(format!(
                    "mount -t {fstype} -o {opts} failed (needs root): {}",
                    String::from_utf8_lossy(&o.stderr).trim()
                ))
            }
            Err(e) => {
                let _ = std::fs::remove_dir(&at);
                Err(format!("no mount command: {e}"))
            }
        }
    }
}

impl std::ops::Deref for Tmpfs {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        // Lazily: a file still open under it does not keep it mounted.
        let ok = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            eprintln!("could not unmount the test's tmpfs at {}", self.0.display());
        }
        let _ = std::fs::remove_dir(&self.0);
    }
}
