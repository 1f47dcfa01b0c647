//! A lab run stopped by a signal (Ctrl-C, `kill`, a closed terminal) leaves nothing behind:
//! its scratch folders (an object-store run's holds a 1 GiB memory file and a frame cache
//! a round, gigabytes) are removed and the processes it guards (Firecracker, its handlers)
//! killed, as they are when a scenario ends by itself. Without this the default action
//! ended the process where it stood, and no guard dropped.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

/// Scratch folders of scenarios under way, removed on a signal.
static FOLDERS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

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

/// Takes SIGINT, SIGTERM and SIGHUP from here on: on one, the children guarded are killed,
/// the scratch folders of scenarios under way removed, and the process exits with
/// 128 + the signal's number, as the default action's status reads to a shell. Call it
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
    std::thread::Builder::new()
        .name("guestmem-lab-signals".into())
        .spawn(move || {
            let mut sig: libc::c_int = 0;
            // SAFETY: `set` is an initialised sigset; sigwait writes one int.
            while unsafe { libc::sigwait(&set, &mut sig) } != 0 {}
            guestmem_testkit::kill_guarded_children();
            let dirs = folders().clone();
            for d in &dirs {
                // A thread of the run may still write into it: tried again once.
                if std::fs::remove_dir_all(d).is_err() {
                    let _ = std::fs::remove_dir_all(d);
                }
            }
            eprintln!(
                "guestmem-lab: stopped by signal {sig}; removed {}",
                match dirs.len() {
                    0 => "no scratch folder".to_string(),
                    _ => dirs
                        .iter()
                        .map(|d| d.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", "),
                }
            );
            std::process::exit(128 + sig);
        })?;
    Ok(())
}
