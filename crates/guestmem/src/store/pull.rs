//! Pulling a snapshot back into a raw memory file (for Firecracker's File backend): every
//! frame fetched, checked and written by many threads at once, zero frames left as holes,
//! the file published whole (written beside, synced, renamed).

use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use super::memory::StoreMemory;
use super::StoreError;

/// What a pull did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct PullReport {
    /// The snapshot's URL.
    pub url: String,
    /// Bytes of memory written (the file's length).
    pub memory_bytes: u64,
    /// Frames that hold data (fetched and written).
    pub data_frames: u64,
    /// Bytes of frame objects fetched.
    pub bytes_fetched: u64,
    /// Seconds.
    pub wall_secs: f64,
}

/// The file being written, removed when dropped unless published (an error, a panic).
struct Pulling<'a>(&'a Path, bool);

impl Drop for Pulling<'_> {
    fn drop(&mut self) {
        if !self.1 {
            let _ = std::fs::remove_file(self.0);
        }
    }
}

/// Writes the memory of `memory` to `out` (which must not exist, and is never replaced: a
/// file made there meanwhile fails the pull), on `threads` threads. The file is readable
/// by its owner only (a VM's memory holds its secrets).
pub fn pull(memory: &StoreMemory, out: &Path, threads: usize) -> Result<PullReport, StoreError> {
    let t0 = Instant::now();
    let snap = memory.snapshot();
    let io = |op| {
        move |source| StoreError::Io {
            op,
            path: out.to_path_buf(),
            source,
        }
    };
    if out.symlink_metadata().is_ok() {
        return Err(StoreError::Io {
            op: "pull into (it exists: a pull never overwrites a file)",
            path: out.to_path_buf(),
            source: std::io::Error::from_raw_os_error(libc::EEXIST),
        });
    }
    let parent = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = out.file_name().ok_or_else(|| StoreError::Io {
        op: "pull into (not a file name)",
        path: out.to_path_buf(),
        source: std::io::Error::from_raw_os_error(libc::EINVAL),
    })?;
    let name = name.to_str().ok_or_else(|| StoreError::Io {
        op: "pull into (a name that is not UTF-8)",
        path: out.to_path_buf(),
        source: std::io::Error::from_raw_os_error(libc::EINVAL),
    })?;
    let dir = crate::files::Dir::open(parent).map_err(|e| StoreError::Io {
        op: "open the folder to pull into",
        path: parent.to_path_buf(),
        source: e.source,
    })?;
    let tmp_name = format!(".{name}.{}.pulling", std::process::id());
    let tmp = parent.join(&tmp_name);
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(io("create"))?;
    let mut pulling = Pulling(&tmp, false);
    file.set_len(snap.memory_bytes()).map_err(io("size"))?;
    let before = memory.frames().counters.bytes.load(Ordering::Relaxed);
    let next = AtomicU64::new(0);
    let failed: Mutex<Option<StoreError>> = Mutex::new(None);
    let count = snap.frame_count();
    let fb = snap.frame_bytes();
    std::thread::scope(|s| {
        for _ in 0..threads.clamp(1, 64) {
            s.spawn(|| loop {
                if failed.lock().unwrap_or_else(|e| e.into_inner()).is_some() {
                    return;
                }
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= count {
                    return;
                }
                if !snap.held(i) {
                    continue;
                }
                let r = memory
                    .frame(i)
                    .map_err(|e| StoreError::Frame {
                        url: snap.url.to_string(),
                        reason: e.to_string(),
                    })
                    .and_then(|f| file.write_all_at(&f, i * fb).map_err(io("write")));
                if let Err(e) = r {
                    failed
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .get_or_insert(e);
                    return;
                }
            });
        }
    });
    if let Some(e) = failed.into_inner().unwrap_or_else(|e| e.into_inner()) {
        return Err(e);
    }
    file.sync_all().map_err(io("sync"))?;
    dir.rename(&tmp_name, name, false)
        .map_err(|e| StoreError::Io {
            op: "rename into place (a pull never overwrites a file)",
            path: out.to_path_buf(),
            source: e.source,
        })?;
    pulling.1 = true;
    let _ = dir.sync();
    Ok(PullReport {
        url: snap.url.to_string(),
        memory_bytes: snap.memory_bytes(),
        data_frames: snap.data_frames(),
        bytes_fetched: memory.frames().counters.bytes.load(Ordering::Relaxed) - before,
        wall_secs: t0.elapsed().as_secs_f64(),
    })
}
