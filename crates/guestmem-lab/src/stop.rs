//! A lab run stopped by a signal (Ctrl-C, `kill`, a closed terminal) leaves nothing behind:
//! the processes it guards (Firecracker, its handlers) are killed, a hugetlb pool it grew
//! is put back, and its scratch folders (an object-store run's holds a 1 GiB memory file
//! and a frame cache a round, gigabytes) are removed, as when a scenario ends by itself.
//! Without this the default action ended the process where it stood, and no guard dropped.
//!
//! The run's other threads go on until the process ends, and some make folders as they
//! write (the S3 server's, a round's): the folders are removed at once, and again by a
//! small process that waits for this one to end (`sh`, reading a pipe only this process
//! holds open). The process then ends by the signal itself, so that a shell sees what it
//! would have seen without this (a script's loop stops on Ctrl-C).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};

/// Scratch folders of scenarios under way, removed on a signal.
static FOLDERS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Set when a signal came: the run ends by it, not by `main` returning.
static STOPPING: AtomicBool = AtomicBool::new(false);

fn folders() -> MutexGuard<'static, Vec<PathBuf>> {
    FOLDERS.lock().unwrap_or_else(|e| e.into_inner())
}

/// A scratch folder removed if the run is stopped by a signal while this is held (its
/// scenario removes it itself when it ends).
#[derive(Debug)]
pub(crate) struct Tracked(PathBuf);

impl Tracked {
    pub(crate) fn new(dir: &Path) -> Tracked {
        folders().push(dir.to_path_buf());
        Tracked(dir.to_path_buf())
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        let mut f = folders();
        if let Some(i) = f.iter().position(|d| *d == self.0) {
            f.remove(i);
        }
    }
}

/// Blocks the calling thread for good if the run is being stopped by a signal: `main`
/// calls it before it returns (a scenario fails as its children are killed), so that the
/// run ends by the signal, after its clean-up, not with the scenario's error.
pub fn wait_if_stopping() {
    while STOPPING.load(Ordering::SeqCst) {
        std::thread::park();
    }
}

/// Takes SIGINT, SIGTERM and SIGHUP from here on (see the module's doc). Call it once,
/// first thing in `main`, before any thread starts: the signals are blocked in the calling
/// thread, and so in every thread it starts after (a child process starts with none
/// blocked: the standard library clears the mask before `exec`).
pub fn clean_up_on_signals() -> std::io::Result<()> {
    // SAFETY: sigemptyset initialises the set; sigaddset and pthread_sigmask read it.
    let set = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            libc::sigaddset(&mut set, s);
        }
        let r = libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        if r != 0 {
            return Err(std::io::Error::from_raw_os_error(r));
        }
        set
    };
    // A thread that panics while the run is stopped (its child killed under it) waits for
    // the end instead of unwinding into `main`'s exit.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        wait_if_stopping();
        hook(info)
    }));
    std::thread::Builder::new()
        .name("guestmem-lab-signals".into())
        .spawn(move || {
            let mut sig: libc::c_int = 0;
            // SAFETY: `set` is an initialised sigset; sigwait writes one int.
            while unsafe { libc::sigwait(&set, &mut sig) } != 0 {}
            STOPPING.store(true, Ordering::SeqCst);
            stop(sig);
        })?;
    Ok(())
}

/// The clean-up, then the end by `sig`.
fn stop(sig: libc::c_int) -> ! {
    use std::io::Write;
    guestmem_testkit::kill_guarded_children();
    guestmem_testkit::put_back_grown_pools();
    let dirs = folders().clone();
    if !dirs.is_empty() {
        // Removes them again once this process has ended: its stdin is a pipe whose other
        // end only this process holds (close-on-exec), left open until the end. A process
        // group of its own, so that a second Ctrl-C at the terminal does not end it.
        use std::os::unix::process::CommandExt;
        if let Ok(mut c) = std::process::Command::new("sh")
            .args([
                "-c",
                "read _; exec rm -rf -- \"$@\"",
                "guestmem-lab-clean-up",
            ])
            .args(&dirs)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .process_group(0)
            .spawn()
        {
            std::mem::forget(c.stdin.take());
        }
    }
    for d in &dirs {
        let _ = std::fs::remove_dir_all(d);
    }
    let names: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
    // A closed terminal or a reader gone (`| tee`) fails the write: ignored.
    let _ = writeln!(
        std::io::stderr(),
        "guestmem-lab: stopped by signal {sig}; removed {}",
        match names.is_empty() {
            true => "no scratch folder".to_string(),
            false => names.join(", "),
        }
    );
    // SAFETY: the default action back for `sig`, unblocked in this thread alone, then
    // raised in it: the process ends as the signal's default ends it. The calls take
    // plain values and an initialised set.
    unsafe {
        libc::signal(sig, libc::SIG_DFL);
        let mut one: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut one);
        libc::sigaddset(&mut one, sig);
        libc::pthread_sigmask(libc::SIG_UNBLOCK, &one, std::ptr::null_mut());
        libc::raise(sig);
    }
    std::process::exit(128 + sig)
}
