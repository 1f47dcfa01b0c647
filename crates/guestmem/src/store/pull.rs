//! Pulling a snapshot back into a raw memory file (for Firecracker's File backend): every
//! frame fetched, checked and written by many threads at once, zero frames left as holes,
//! the file published whole (written unnamed, or beside, synced, then named).

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
    // Unnamed until whole where the file system can (nothing left behind however the pull
    // ends: an error, Ctrl-C, kill -9); else beside the target, removed on an error.
    let unnamed = dir.create_unnamed().map_err(|e| StoreError::Io {
        op: e.op,
        path: e.path,
        source: e.source,
    })?;
    let (file, mut pulling) = match unnamed {
        Some(f) => (f, None),
        None => (
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&tmp)
                .map_err(io("create"))?,
            Some(Pulling(&tmp, false)),
        ),
    };
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
    let placed = match &pulling {
        None => dir.link_unnamed(&file, name),
        Some(_) => dir.rename(&tmp_name, name, false),
    };
    placed.map_err(|e| StoreError::Io {
        op: "put into place (a pull never overwrites a file)",
        path: out.to_path_buf(),
        source: e.source,
    })?;
    if let Some(p) = &mut pulling {
        p.1 = true;
    }
    let _ = dir.sync();
    Ok(PullReport {
        url: snap.url.to_string(),
        memory_bytes: snap.memory_bytes(),
        data_frames: snap.data_frames(),
        bytes_fetched: memory.frames().counters.bytes.load(Ordering::Relaxed) - before,
        wall_secs: t0.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;
    use std::sync::Arc;
    use std::time::Duration;

    use guestmem_testkit::s3::S3Server;
    use guestmem_testkit::Scratch;

    use crate::store::{
        pull, push, Client, FetchPolicy, Frames, PushConfig, PushSource, StoreMemory, StoreUrl,
    };

    /// While a pull runs, nothing of it is in the folder it pulls into (its file has no
    /// name until it is whole: a pull ended by Ctrl-C or kill -9 leaves nothing); once it
    /// ends, the file is there whole, its owner's only.
    #[test]
    fn a_pull_names_its_file_only_once_it_is_whole() {
        let scratch = Scratch::new("pull-unnamed");
        let s3 = S3Server::start("pull-unnamed", &["snaps"]);
        let env = s3.env();
        let get = move |k: &str| env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone());
        let client = Arc::new(Client::connect_with("snaps", &get).unwrap());
        let raw = scratch.join("mem");
        let bytes: Vec<u8> = (0..(1u32 << 20))
            .map(|i| (i / 4096 % 251) as u8 + 1)
            .collect();
        std::fs::write(&raw, &bytes).unwrap();
        let url = StoreUrl::parse("s3://snaps/vm", false).unwrap();
        let cfg = PushConfig {
            frame_bytes: 64 << 10,
            ..PushConfig::default()
        };
        push(&client, &PushSource::Raw(raw), &url, &cfg).unwrap();
        let into = scratch.join("into");
        std::fs::create_dir(&into).unwrap();
        let memory =
            StoreMemory::open(Frames::new(client, None, FetchPolicy::default()), &url).unwrap();
        // 16 frames, each answered 50 ms late, one thread: the pull takes most of a second.
        s3.delay_gets(Duration::from_millis(50));
        let out = into.join("memory");
        let pulling = {
            let out = out.clone();
            std::thread::spawn(move || pull(&memory, &out, 1))
        };
        // Where no unnamed file can be made here, the pull writes one beside (removed on
        // an error, not on a signal): nothing to look for.
        let unnamed = crate::files::Dir::open(&into)
            .unwrap()
            .create_unnamed()
            .unwrap()
            .is_some();
        if !unnamed {
            let r = pulling.join().unwrap().unwrap();
            assert_eq!(std::fs::read(&out).unwrap(), bytes);
            assert_eq!(r.memory_bytes, 1 << 20);
            return guestmem_testkit::skip(format!(
                "{} cannot hold unnamed files (O_TMPFILE): the pull's file is named as it is written",
                into.display()
            ));
        }
        // Looked at while it runs: nothing but the file itself, and that only whole.
        let mut looked = 0;
        while !pulling.is_finished() {
            let names: Vec<_> = std::fs::read_dir(&into)
                .unwrap()
                .flatten()
                .map(|e| e.file_name())
                .collect();
            match &names[..] {
                [] => looked += 1,
                [one] if one == "memory" => {
                    assert_eq!(
                        std::fs::read(&out).unwrap(),
                        bytes,
                        "named before it was whole"
                    );
                }
                _ => panic!("{names:?} while pulling"),
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let r = pulling.join().unwrap().unwrap();
        assert_eq!(r.memory_bytes, 1 << 20);
        assert!(looked > 0, "the pull ended before it was looked at");
        assert_eq!(std::fs::read(&out).unwrap(), bytes);
        let mode = std::fs::metadata(&out).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(std::fs::read_dir(&into).unwrap().count(), 1);
    }
}
