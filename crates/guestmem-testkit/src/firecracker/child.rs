//! Stand-in VMs in child processes of a test binary: a server that ends its peer (a pidfd
//! kill) ends the child, not the test.

use std::path::Path;
use std::time::Instant;

use super::{word, Standin, PAGE};

/// What a stand-in VM in a child process does ([`vm_child`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum ChildDoes {
    /// Sends Firecracker's handshake, then waits for the parent's go file and reads every
    /// page, comparing each with [`word`].
    Handshake,
    /// Sends garbage with its userfaultfd.
    Garbage,
    /// Sends Firecracker's handshake, closes its socket at once holding its userfaultfd,
    /// then waits for the go file, reads every page as `Handshake` does, and exits 0.
    HangUpAndRunOn,
    /// Sends Firecracker's handshake and closes its socket holding its userfaultfd, then
    /// once the go file exists unmaps all its memory, writes the go file's name with
    /// `.unmapped` added, and sleeps (a VM that lets go of its memory and runs on).
    HangUpUnmapAndRunOn,
    /// Sends Firecracker's handshake; its main thread then exits alone (the process's
    /// `stat` says zombie), and another thread closes the socket holding the userfaultfd
    /// and goes on as `HangUpAndRunOn` does.
    MainThreadExitsHangsUpAndRunsOn,
}

/// Environment variables that make a test binary a stand-in VM.
const CHILD_SOCKET: &str = "GM_TEST_STANDIN_SOCKET";
const CHILD_SIZE: &str = "GM_TEST_STANDIN_SIZE";
const CHILD_FEATURES: &str = "GM_TEST_STANDIN_FEATURES";
const CHILD_DOES: &str = "GM_TEST_STANDIN_DOES";
const CHILD_GO: &str = "GM_TEST_STANDIN_GO";
/// A stand-in child's exit code when the server refused its connection.
pub const CHILD_REFUSED: i32 = 3;

/// Defines the test `standin_child` that [`vm_child`] runs in a child process of the test
/// binary (a test of its own does nothing): put it once in every test file that uses
/// [`vm_child`].
#[macro_export]
macro_rules! standin_child_test {
    () => {
        /// Not a test of its own: run by `vm_child` as a separate process, so that a server
        /// that kills its peer kills the child, not the test.
        #[test]
        fn standin_child() {
            $crate::firecracker::child_main();
        }
    };
}

/// The body of the `standin_child` test ([`standin_child_test!`]): a stand-in VM, when the
/// environment says so.
pub fn child_main() {
    let Ok(socket) = std::env::var(CHILD_SOCKET) else {
        return;
    };
    let size: usize = std::env::var(CHILD_SIZE)
        .expect("size")
        .parse()
        .expect("a size");
    let features: u64 = std::env::var(CHILD_FEATURES)
        .expect("features")
        .parse()
        .expect("features");
    let mut vm = Standin::with_features(&[size], features).expect("a stand-in");
    let sent = match std::env::var(CHILD_DOES).expect("does").as_str() {
        "Garbage" => vm.send(Path::new(&socket), b"[{not json", true),
        _ => vm.connect(Path::new(&socket)),
    };
    if sent.is_err() {
        // Refused at connect: exit with a code of its own.
        std::process::exit(CHILD_REFUSED);
    }
    let does = std::env::var(CHILD_DOES).expect("does");
    if does == "MainThreadExitsHangsUpAndRunsOn" {
        let on = std::thread::spawn(move || {
            let main = format!("/proc/self/task/{}/stat", std::process::id());
            while !std::fs::read_to_string(&main).is_ok_and(|s| s.contains(") Z ")) {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            vm.hang_up();
            println!("SENT");
            read_when_told(&vm, size);
            std::process::exit(0);
        });
        end_main_thread();
        let _ = on.join();
        std::process::exit(0);
    }
    let hang_up = does.starts_with("HangUp");
    if hang_up {
        vm.hang_up();
    }
    println!("SENT");
    if does == "HangUpUnmapAndRunOn" {
        let go = wait_for_go();
        vm.unmap();
        let mut done = go.into_os_string();
        done.push(".unmapped");
        std::fs::write(done, b"").expect("write the mark");
        std::thread::sleep(std::time::Duration::from_secs(60));
        std::process::exit(0);
    }
    read_when_told(&vm, size);
    if hang_up {
        std::process::exit(0);
    }
    std::thread::sleep(std::time::Duration::from_secs(60));
}

/// Waits (at most 60 s) for the parent's go file; its path.
fn wait_for_go() -> std::path::PathBuf {
    let go = std::path::PathBuf::from(std::env::var(CHILD_GO).expect("go"));
    let t = Instant::now();
    while !go.exists() && t.elapsed() < std::time::Duration::from_secs(60) {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    go
}

/// Once the go file exists, reads every page of `vm`, comparing each with [`word`].
fn read_when_told(vm: &Standin, size: usize) {
    wait_for_go();
    for p in 0..size / PAGE {
        assert_eq!(vm.word(p * PAGE), word((p * PAGE) as u64), "page {p}");
    }
    println!("READ");
}

/// Ends this process's main thread alone (`exit`, not `exit_group`), the other threads
/// running on; from the main thread itself, or from another through a signal whose handler
/// exits.
fn end_main_thread() {
    extern "C" fn exit_thread(_: libc::c_int) {
        // SAFETY: exit(2) ends the calling thread only; a raw syscall is
        // async-signal-safe.
        unsafe { libc::syscall(libc::SYS_exit, 0) };
    }
    let pid = std::process::id() as libc::pid_t;
    // SAFETY: gettid takes nothing and cannot fail.
    if unsafe { libc::gettid() } == pid {
        // SAFETY: as above; nothing of this thread is used after (the others own what
        // they use).
        unsafe { libc::syscall(libc::SYS_exit, 0) };
    }
    // SAFETY: a zeroed sigaction with a handler that only makes a raw syscall, installed
    // for SIGUSR1, which nothing else in a test's child uses; tgkill sends it to the main
    // thread alone.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = exit_thread as extern "C" fn(libc::c_int) as usize;
        libc::sigaction(libc::SIGUSR1, &sa, std::ptr::null_mut());
        libc::syscall(libc::SYS_tgkill, pid, pid, libc::SIGUSR1);
    }
}

/// A stand-in VM in a child process of this test binary (which must define
/// [`standin_child_test!`]): `does` to `socket`, with `size` bytes of memory and the
/// userfaultfd `features`; it reads its memory once `go` exists. Killed and reaped when the
/// guard drops.
pub fn vm_child(
    socket: &Path,
    size: usize,
    features: u64,
    does: ChildDoes,
    go: &Path,
) -> crate::ChildGuard {
    crate::ChildGuard::new(
        std::process::Command::new(std::env::current_exe().expect("the test binary"))
            .args([
                "--exact",
                "standin_child",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env(CHILD_SOCKET, socket)
            .env(CHILD_SIZE, size.to_string())
            .env(CHILD_FEATURES, features.to_string())
            .env(CHILD_DOES, format!("{does:?}"))
            .env(CHILD_GO, go)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("spawn the stand-in VM"),
    )
}
