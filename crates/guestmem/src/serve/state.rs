//! What a page server keeps on disk so that a server started after it died takes its VMs back.
//!
//! Firecracker keeps its own reference to the userfaultfd it sent, so a VM whose server
//! dies is frozen, not lost: its faults wait. For each VM it serves, a server with a state
//! directory writes one record, whole (temporary file, fsync, rename), when it admits the
//! VM and removes it when the session ends: the VM's pid and start time (so a reused pid is
//! never taken for it), the number of the userfaultfd in the VM (found with
//! `kcmp(KCMP_FILE)`), the memory file's identity (device, inode, size, modification time:
//! a file replaced or truncated since is refused) and the regions of its handshake. A new
//! server reads the records, takes each VM's userfaultfd back with `pidfd_getfd`, and
//! serves it again (see `restart.rs`).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use super::error::{RecordProblem, StateDirProblem};
use super::files::FileId;
use super::regions::{parse_regions, UffdRegion};
use super::ServeError;

/// A record's `format`.
const FORMAT: &str = "guestmem-session";
/// Largest record read (its regions are at most a handshake's).
const MAX_RECORD_BYTES: u64 = 8 << 20;

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
        let bad = |problem| ServeError::StateDir {
            path: path.to_path_buf(),
            problem,
        };
        let io = |op| move |source| bad(StateDirProblem::Io { op, source });
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(path)
            .map_err(io("make"))?;
        let dir = crate::files::Dir::open(path).map_err(|e| io("open")(e.source))?;
        // Its records make this server take descriptors from processes and end those it
        // cannot serve: only its owner may write them.
        let m = std::fs::metadata(path).map_err(io("stat"))?;
        let euid = crate::sys::euid();
        if m.uid() != euid || m.mode() & 0o022 != 0 {
            return Err(bad(StateDirProblem::NotPrivate {
                uid: m.uid(),
                mode: m.mode() & 0o7777,
                euid,
            }));
        }
        match dir.lock(true, false) {
            Ok(true) => {}
            Ok(false) => return Err(bad(StateDirProblem::Held)),
            Err(e) => return Err(io("lock")(e)),
        }
        Ok(StateDir {
            path: path.to_path_buf(),
            _lock: dir,
        })
    }

    /// Where it is.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Writes `r` whole; returns its path.
    pub(crate) fn write(&self, r: &SessionRecord) -> Result<PathBuf, RecordProblem> {
        let path = self.path.join(format!(
            "session-{}-{}-{}.json",
            r.pid, r.start_time, r.uffd_fd
        ));
        let text = serde_json::to_vec_pretty(r).map_err(|e| RecordProblem::Io {
            op: "serialise",
            source: e.into(),
        })?;
        crate::files::publish_file(&path, &text).map_err(|e| RecordProblem::Io {
            op: e.op,
            source: e.source,
        })?;
        Ok(path)
    }

    /// Removes a record (its session ended), and its removed-pages file.
    pub(crate) fn forget(&self, path: &Path) {
        let _ = std::fs::remove_file(path);
        let _ = std::fs::remove_file(removed_path(path));
    }

    /// The removed-pages file beside the record at `record` (see the lazy engine's
    /// `removed_log.rs`), opened to read and write, never through a link: the one a previous
    /// server left, or a new empty one (`0600`). Whether it was there.
    pub(crate) fn removed_file(&self, record: &Path) -> std::io::Result<(std::fs::File, bool)> {
        use std::os::unix::fs::OpenOptionsExt;
        let path = removed_path(record);
        let open = |create: bool| {
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(create)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                .open(&path)
        };
        match open(false) {
            Ok(f) => Ok((f, true)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok((open(true)?, false)),
            Err(e) => Err(e),
        }
    }

    /// Every record in it, each read (capped) and parsed, or why not.
    pub(crate) fn records(&self) -> Vec<(PathBuf, Result<SessionRecord, RecordProblem>)> {
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
                .map_err(|e| RecordProblem::Io {
                    op: e.op,
                    source: e.source,
                })
                .and_then(|bytes| {
                    serde_json::from_slice::<SessionRecord>(&bytes).map_err(|e| RecordProblem::Io {
                        op: "parse",
                        source: e.into(),
                    })
                })
                .and_then(|r| {
                    if r.format == FORMAT {
                        Ok(r)
                    } else {
                        Err(RecordProblem::Format(r.format))
                    }
                });
            out.push((path, read));
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }
}

/// Where the removed-pages file of the record at `record` is.
fn removed_path(record: &Path) -> PathBuf {
    record.with_extension("removed")
}
