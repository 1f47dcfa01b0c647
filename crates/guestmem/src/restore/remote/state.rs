//! What a fleet keeps on disk so that a server started after it died takes its VMs back.
//!
//! Firecracker keeps its own reference to the userfaultfd it sent, so a VM whose server
//! dies is frozen, not lost: its faults wait. For each VM it serves, a fleet with a state
//! directory writes one record, whole (temporary file, fsync, rename), when it admits the
//! VM and removes it when the session ends: the VM's pid and start time (so a reused pid is
//! never taken for it), the number of the userfaultfd in the VM (found with
//! `kcmp(KCMP_FILE)`), the memory file's identity (device, inode, size, modification time:
//! a file replaced or truncated since is refused) and the regions of its handshake. A new
//! server reads the records, takes each VM's userfaultfd back with `pidfd_getfd`, and
//! serves it again (see `PageServer::resume`).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use super::regions::{parse_regions, UffdRegion};
use super::{MemoryFile, ServeError};

/// A record's `format`.
const FORMAT: &str = "guestmem-session";
/// Largest record read (its regions are at most a handshake's).
const MAX_RECORD_BYTES: u64 = 8 << 20;

/// Which file a memory file is, beyond its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct FileId {
    dev: u64,
    ino: u64,
    size: u64,
    mtime_s: i64,
    mtime_nsec: i64,
}

impl FileId {
    /// The file's size, bytes.
    pub(crate) fn size(&self) -> u64 {
        self.size
    }
}

impl MemoryFile {
    /// Its identity now (`fstat` of the descriptor served from).
    pub(crate) fn identity(&self) -> std::io::Result<FileId> {
        let m = self.file.metadata()?;
        Ok(FileId {
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            mtime_s: m.mtime(),
            mtime_nsec: m.mtime_nsec(),
        })
    }
}

/// One VM's session, as a restarted server needs it.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SessionRecord {
    format: String,
    /// The VM's pid.
    pub(crate) pid: i32,
    /// When it started, clock ticks after boot.
    pub(crate) start_time: u64,
    /// The number of its userfaultfd in the VM.
    pub(crate) uffd_fd: i32,
    /// The memory file served.
    pub(crate) mem: FileId,
    /// The regions, as the handshake gave them (parsed again when read).
    regions: serde_json::Value,
}

impl SessionRecord {
    pub(crate) fn new(
        pid: i32,
        start_time: u64,
        uffd_fd: i32,
        mem: FileId,
        regions: &[UffdRegion],
    ) -> SessionRecord {
        SessionRecord {
            format: FORMAT.into(),
            pid,
            start_time,
            uffd_fd,
            mem,
            regions: serde_json::to_value(regions).expect("regions serialise"),
        }
    }

    /// The regions, checked as a handshake's are.
    pub(crate) fn regions(&self) -> Result<Vec<UffdRegion>, ServeError> {
        parse_regions(self.regions.to_string().as_bytes())
    }
}

/// The folder of session records.
#[derive(Debug)]
pub(crate) struct StateDir {
    path: PathBuf,
    /// Held locked (exclusive `flock`) for the server's life: two servers on one state
    /// directory would both serve the same userfaultfds.
    _lock: crate::files::Dir,
}

impl StateDir {
    /// Opens `path`, made (mode 0700) if missing.
    pub(crate) fn open(path: &Path) -> Result<StateDir, ServeError> {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(path)
            .map_err(|e| ServeError::StateDir {
                path: path.to_path_buf(),
                reason: format!("cannot make it: {e}"),
            })?;
        let bad = |reason: String| ServeError::StateDir {
            path: path.to_path_buf(),
            reason,
        };
        let dir = crate::files::Dir::open(path).map_err(|e| bad(e.to_string()))?;
        // Its records make this server take descriptors from processes and end those it
        // cannot serve: only its owner may write them.
        let m = std::fs::metadata(path).map_err(|e| bad(e.to_string()))?;
        // SAFETY: geteuid takes nothing and cannot fail.
        let euid = unsafe { libc::geteuid() };
        if m.uid() != euid || m.mode() & 0o022 != 0 {
            return Err(bad(format!(
                "owned by uid {} with mode {:o}; it must be this user's ({euid}) and writable by \
                 no one else",
                m.uid(),
                m.mode() & 0o7777
            )));
        }
        match dir.lock(true, false) {
            Ok(true) => {}
            Ok(false) => {
                return Err(bad(
                    "another server holds it (two servers would serve the same VMs)".into(),
                ))
            }
            Err(e) => return Err(bad(format!("cannot lock it: {e}"))),
        }
        Ok(StateDir {
            path: path.to_path_buf(),
            _lock: dir,
        })
    }

    /// Writes `r` whole; returns its path.
    pub(crate) fn write(&self, r: &SessionRecord) -> Result<PathBuf, String> {
        let path = self.path.join(format!(
            "session-{}-{}-{}.json",
            r.pid, r.start_time, r.uffd_fd
        ));
        let text = serde_json::to_vec_pretty(r).map_err(|e| e.to_string())?;
        crate::files::publish_file(&path, &text).map_err(|e| e.to_string())?;
        Ok(path)
    }

    /// Removes a record (its session ended).
    pub(crate) fn forget(&self, path: &Path) {
        let _ = std::fs::remove_file(path);
    }

    /// Every record in it, each read (capped) and parsed, or why not.
    pub(crate) fn records(&self) -> Vec<(PathBuf, Result<SessionRecord, String>)> {
        let Ok(rd) = std::fs::read_dir(&self.path) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for e in rd.flatten() {
            let name = e.file_name();
            let Some(name) = name.to_str() else { continue };
            if !(name.starts_with("session-") && name.ends_with(".json")) {
                continue;
            }
            let path = e.path();
            let read = crate::files::Dir::open(&self.path)
                .and_then(|d| d.read_capped(name, MAX_RECORD_BYTES))
                .map_err(|e| e.to_string())
                .and_then(|bytes| {
                    serde_json::from_slice::<SessionRecord>(&bytes).map_err(|e| e.to_string())
                })
                .and_then(|r| {
                    if r.format == FORMAT {
                        Ok(r)
                    } else {
                        Err(format!("format {:?} is not {FORMAT:?}", r.format))
                    }
                });
            out.push((path, read));
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }
}
