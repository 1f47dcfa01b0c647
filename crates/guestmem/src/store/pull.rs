//! Pulling a snapshot back into a raw memory file (for Firecracker's File backend): every
//! frame fetched, checked and written by many threads at once, zero frames left as holes,
//! the file published whole (written beside, synced, renamed).

use std::os::unix::fs::FileExt;
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

/// Writes the memory of `memory` to `out` (which must not exist), on `threads` threads.
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
    let tmp = parent.join(format!(
        ".{}.{}.pulling",
        out.file_name()
            .map_or("memory".into(), |n| n.to_string_lossy()),
        std::process::id()
    ));
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)
        .map_err(io("create"))?;
    let cleanup = |e: StoreError| {
        let _ = std::fs::remove_file(&tmp);
        e
    };
    file.set_len(snap.memory_bytes())
        .map_err(io("size"))
        .map_err(cleanup)?;
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
        return Err(cleanup(e));
    }
    file.sync_all().map_err(io("sync")).map_err(cleanup)?;
    std::fs::rename(&tmp, out)
        .map_err(io("rename into place"))
        .map_err(cleanup)?;
    if let Ok(d) = std::fs::File::open(parent) {
        let _ = d.sync_all();
    }
    Ok(PullReport {
        url: snap.url.to_string(),
        memory_bytes: snap.memory_bytes(),
        data_frames: snap.data_frames(),
        bytes_fetched: memory.frames().counters.bytes.load(Ordering::Relaxed) - before,
        wall_secs: t0.elapsed().as_secs_f64(),
    })
}
