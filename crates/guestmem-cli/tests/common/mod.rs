//! What the `guestmem serve-uffd` tests share: starting the server as a process (one VM or
//! every VM), ending it (waiting, or SIGTERM) with what it printed, and reading a process's
//! threads, CPU and memory from `/proc`. The Firecracker stand-in and the test memory file
//! are the test kit's (`guestmem_testkit::firecracker`).

#![allow(dead_code, unused_imports)]

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

pub use guestmem_testkit::firecracker::{
    memory_file, missing_uffd, vm_child, word, ChildDoes, Standin, CHILD_REFUSED, PAGE,
};
pub use guestmem_testkit::{ChildGuard as Guard, Scratch};

pub const MIB: usize = 1 << 20;

/// Skips the test (counted) where userfaultfd is unavailable.
#[macro_export]
macro_rules! need_uffd {
    () => {
        guestmem_testkit::skip_unless!($crate::common::missing_uffd());
    };
}

/// A fresh folder for one test, removed when dropped (a failing test leaves nothing either).
pub fn dir(name: &str) -> Scratch {
    Scratch::new(&format!("serve-{name}"))
}

/// A `guestmem serve-uffd` process, and what it prints, read as it prints it (a server
/// that logs more than a pipe holds must never block on its log).
pub struct Srv {
    guard: Guard,
    out: Option<std::thread::JoinHandle<String>>,
    err: Option<std::thread::JoinHandle<String>>,
}

impl std::ops::Deref for Srv {
    type Target = Guard;
    fn deref(&self) -> &Guard {
        &self.guard
    }
}

impl std::ops::DerefMut for Srv {
    fn deref_mut(&mut self) -> &mut Guard {
        &mut self.guard
    }
}

/// A thread reading all of `r`.
fn reader(r: impl Read + Send + 'static) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut r = r;
        let mut s = String::new();
        let _ = r.read_to_string(&mut s);
        s
    })
}

impl Srv {
    /// `cmd` started, its output read as it comes (`GM_DEBUG_STDERR=FILE` sends its log
    /// to FILE instead, to watch a test that hangs).
    pub fn start(cmd: &mut Command) -> Srv {
        let debug = std::env::var_os("GM_DEBUG_STDERR");
        let err = match &debug {
            Some(p) => Stdio::from(std::fs::File::create(p).unwrap()),
            None => Stdio::piped(),
        };
        let mut guard = Guard::new(cmd.stdout(Stdio::piped()).stderr(err).spawn().unwrap());
        let c = guard.child();
        let out = c.stdout.take().map(reader);
        let err = c.stderr.take().map(reader);
        Srv { guard, out, err }
    }

    /// What it printed to stdout and stderr, once it has exited.
    pub fn output(&mut self) -> (String, String) {
        let take = |h: Option<std::thread::JoinHandle<String>>| {
            h.map_or(String::new(), |h| h.join().unwrap())
        };
        (take(self.out.take()), take(self.err.take()))
    }
}

/// `guestmem serve-uffd` over `pairs` (socket, memory file) with `extra` flags, started
/// without waiting for its sockets.
pub fn spawn(pairs: &[(&Path, &Path)], extra: &[&str]) -> Srv {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_guestmem"));
    cmd.arg("serve-uffd");
    for (socket, mem) in pairs {
        cmd.arg("--socket").arg(socket).arg("--mem-file").arg(mem);
    }
    Srv::start(cmd.args(extra))
}

/// [`spawn`], then waits for every socket to appear.
pub fn server(pairs: &[(&Path, &Path)], extra: &[&str]) -> Srv {
    let mut g = spawn(pairs, extra);
    let t = Instant::now();
    while !pairs.iter().all(|(s, _)| s.exists()) {
        assert!(g.running(), "the server exited before listening");
        assert!(t.elapsed() < Duration::from_secs(20), "no socket appeared");
        std::thread::sleep(Duration::from_millis(5));
    }
    g
}

/// `guestmem serve-uffd --once` on `socket` serving `mem`, its socket listening.
pub fn once(socket: &Path, mem: &Path, extra: &[&str]) -> Srv {
    let mut args = vec!["--once"];
    args.extend_from_slice(extra);
    server(&[(socket, mem)], &args)
}

/// Waits (at most 20 s) for the server to exit; its status, stdout and stderr.
pub fn finish(mut g: Srv) -> (i32, String, String) {
    let status = g.wait_exit(20);
    let (out, err) = g.output();
    (status.code().unwrap_or(-1), out, err)
}

/// Sends SIGTERM to the server and waits (at most 10 s) for it to exit: its status, stdout,
/// stderr and how long it took.
pub fn terminate(mut g: Srv) -> (i32, String, String, Duration) {
    let t = Instant::now();
    // SAFETY: kill on our own child's pid (the guard has not reaped it yet).
    assert_eq!(unsafe { libc::kill(g.id() as i32, libc::SIGTERM) }, 0);
    let status = g.wait_exit(10);
    let took = t.elapsed();
    let (out, err) = g.output();
    (status.code().unwrap_or(-1), out, err, took)
}

/// A field of `/proc/PID/status` (`Threads:`, `VmRSS:`), as a number (kB for sizes).
pub fn status_field(pid: u32, field: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix(field))
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

/// CPU time (user + system) the process has used, in clock ticks.
pub fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name (which may hold spaces) start at ") ".
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line: 12 and 13 after the name.
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

/// CPU time the process uses over `window` from now, clock ticks, and the ticks of the
/// window itself (a whole core's worth): an idle process uses a small part of that.
pub fn cpu_over(pid: u32, window: Duration) -> (u64, u64) {
    // SAFETY: sysconf reads a constant.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
    let before = cpu_ticks(pid);
    std::thread::sleep(window);
    let used = cpu_ticks(pid) - before;
    (used, (window.as_secs_f64() * hz as f64) as u64)
}

/// Runs `guestmem serve-ctl --control PATH COMMAND`; its stdout.
pub fn ctl(control: &Path, command: &str) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_guestmem"))
        .args(["serve-ctl", "--control"])
        .arg(control)
        .arg(command)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Waits (at most 10 s) until the server on `control` serves no VM: every session ended.
pub fn wait_no_vms(control: &Path) {
    let t = Instant::now();
    while !ctl(control, "health").contains("\"vms\":0") {
        assert!(t.elapsed() < Duration::from_secs(10), "sessions not ended");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Waits, from `REGAIN_SETTLE` on, until a collapse of `vm`'s memory to huge pages is over:
/// all of it huge, or no change for a second (a chunk the kernel refused, or memory not all
/// in). Waited for, not slept for: on a busy host compaction can take seconds.
pub fn wait_collapse_over(vm: &Standin) {
    std::thread::sleep(guestmem::restore::REGAIN_SETTLE);
    let t = Instant::now();
    let mut last = (vm.anon_huge().unwrap(), Instant::now());
    while last.0 < vm.size() as u64 && last.1.elapsed() < Duration::from_secs(1) {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the collapse went on"
        );
        std::thread::sleep(Duration::from_millis(20));
        let now = vm.anon_huge().unwrap();
        if now != last.0 {
            last = (now, Instant::now());
        }
    }
}

/// `GET path` from 127.0.0.1:`port`; the whole response.
pub fn http_get(port: u16, path: &str) -> String {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// Waits (at most 20 s) for `path` to exist.
pub fn wait_for(path: &Path) {
    let t = Instant::now();
    while !path.exists() {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}
