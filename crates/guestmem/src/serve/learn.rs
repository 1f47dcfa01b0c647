//! Working sets learnt across clones: the blocks each VM of a snapshot faulted, first fault
//! first, merged per snapshot and kept beside its memory file, so that every later VM of
//! that snapshot gets them prefetched in that order while it runs (its own faults first).
//!
//! Clones of one snapshot touch nearly the same pages in nearly the same order, so the
//! merge keeps the order the first VM touched its blocks in and appends, in their order,
//! the blocks later VMs touched that no earlier one did. The file
//! (`<memory file>.guestmem-ws.json`) names the memory file by its identity (device, inode,
//! size, modification time), not its name: a file replaced since is not served a working
//! set learnt from another. It is written whole (temporary file, fsync, rename). The server
//! loads them when it starts, hands them to its VMs, and merges in each VM's as it ends.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use super::files::{FileId, MemoryFile, MAX_WORKING_SET_BYTES};
use super::regions::SMALL_PAGE_BYTES;

/// The file's `format`.
const FORMAT: &str = "guestmem-learnt-working-set";

/// A learnt working set as stored.
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Stored {
    format: String,
    file: FileId,
    /// Memory-file offsets of blocks, in the order to prefetch them.
    offsets: Vec<u64>,
    /// VMs merged into it.
    vms: u64,
}

/// Why a learnt working set was not read or written.
#[derive(Debug, thiserror::Error)]
pub(super) enum LearnError {
    /// Reading, parsing or writing it failed.
    #[error("{op}: {source}")]
    Io {
        op: &'static str,
        source: std::io::Error,
    },
    /// It is another format's.
    #[error("format {0:?} is not {FORMAT:?}")]
    Format(String),
    /// It was learnt from another memory file.
    #[error("learnt from another file (device, inode, size or mtime differ)")]
    OtherFile,
    /// A snapshot in object storage served without a cache: nowhere to keep it.
    #[error("nowhere to keep it: a snapshot in object storage keeps what was learnt in the frame cache's directory, and there is no cache")]
    NoPlace,
    /// The memory file's identity cannot be read, so nothing can be kept for it.
    #[error("the memory file's identity is unknown")]
    NoIdentity,
}

/// One snapshot's learnt working set.
pub(super) struct Learnt {
    path: PathBuf,
    file: Option<FileId>,
    offsets: Vec<u64>,
    seen: HashSet<u64>,
    vms: u64,
    changed: bool,
}

impl Learnt {
    /// The working set kept beside `mem`, if one is there and was learnt from this very
    /// file; else an empty one. Why one was not taken is returned to be logged (a missing
    /// file is no reason: nothing was learnt yet).
    pub(super) fn load(mem: &MemoryFile) -> (Learnt, Option<LearnError>) {
        let Some(path) = mem.learnt_path() else {
            return (
                Learnt {
                    path: PathBuf::new(),
                    file: None,
                    offsets: Vec::new(),
                    seen: HashSet::new(),
                    vms: 0,
                    changed: false,
                },
                Some(LearnError::NoPlace),
            );
        };
        let file = mem.identity().ok();
        let mut l = Learnt {
            path: path.clone(),
            file,
            offsets: Vec::new(),
            seen: HashSet::new(),
            vms: 0,
            changed: false,
        };
        let read = (|| {
            let io = |e: crate::files::FileError| LearnError::Io {
                op: e.op,
                source: e.source,
            };
            let (dir, name) = crate::files::split(&path).map_err(io)?;
            let bytes = crate::files::Dir::open(&dir)
                .and_then(|d| d.read_capped(&name, MAX_WORKING_SET_BYTES))
                .map_err(io)?;
            let s: Stored = serde_json::from_slice(&bytes).map_err(|e| LearnError::Io {
                op: "parse",
                source: e.into(),
            })?;
            if s.format != FORMAT {
                return Err(LearnError::Format(s.format));
            }
            if Some(s.file) != file {
                return Err(LearnError::OtherFile);
            }
            Ok(s)
        })();
        match read {
            Ok(s) => {
                // Outside input: only offsets inside the file, at page boundaries, each once,
                // and never more than the file has pages.
                let size = file.map_or(0, |f| f.size());
                let cap = (size / SMALL_PAGE_BYTES) as usize;
                for &o in &s.offsets {
                    if l.offsets.len() >= cap {
                        break;
                    }
                    if o < size {
                        l.merge(&[o / SMALL_PAGE_BYTES * SMALL_PAGE_BYTES]);
                    }
                }
                l.vms = s.vms;
                l.changed = false;
                // Marked used (its modification time now): a frame cache keeps the learnt
                // working sets used lately, not those written lately (one that has stopped
                // growing is written no more).
                touch(&path);
                (l, None)
            }
            Err(LearnError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                (l, None)
            }
            Err(e) => (l, Some(e)),
        }
    }

    /// The blocks to prefetch for a new VM, in order.
    pub(super) fn offsets(&self) -> &[u64] {
        &self.offsets
    }

    /// Merges one VM's working set (memory-file offsets, first fault first).
    pub(super) fn merge(&mut self, ws: &[u64]) {
        for &o in ws {
            if self.seen.insert(o) {
                self.offsets.push(o);
                self.changed = true;
            }
        }
    }

    /// Counts a VM merged.
    pub(super) fn count_vm(&mut self) {
        self.vms += 1;
        self.changed = true;
    }

    /// Writes it whole beside the memory file, if it changed since it was read or written.
    pub(super) fn store(&mut self) -> Result<(), LearnError> {
        let Some(file) = self.file else {
            return Err(LearnError::NoIdentity);
        };
        if !self.changed {
            return Ok(());
        }
        let s = Stored {
            format: FORMAT.into(),
            file,
            offsets: self.offsets.clone(),
            vms: self.vms,
        };
        let text = serde_json::to_vec(&s).map_err(|e| LearnError::Io {
            op: "serialise",
            source: e.into(),
        })?;
        crate::files::publish_file(&self.path, &text).map_err(|e| LearnError::Io {
            op: e.op,
            source: e.source,
        })?;
        self.changed = false;
        Ok(())
    }

    /// Merges one VM's working set and writes the result; a failure to write is for the
    /// caller to log (the VMs are served all the same).
    pub(super) fn learn(&mut self, ws: &[u64]) -> Result<(), LearnError> {
        if ws.is_empty() {
            return Ok(());
        }
        self.merge(ws);
        self.count_vm();
        self.store()
    }

    /// Where it is kept.
    pub(super) fn path(&self) -> &Path {
        &self.path
    }
}

/// Sets `path`'s modification time to now (best effort; a link is not followed).
fn touch(path: &std::path::Path) {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
        return;
    };
    let times = [
        libc::timespec {
            tv_sec: 0,
            tv_nsec: libc::UTIME_OMIT,
        },
        libc::timespec {
            tv_sec: 0,
            tv_nsec: libc::UTIME_NOW,
        },
    ];
    // SAFETY: a NUL-terminated path and two timespecs, all live for the call.
    unsafe {
        libc::utimensat(
            libc::AT_FDCWD,
            c.as_ptr(),
            times.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
}

#[cfg(test)]
mod tests {

    /// `touch` marks a file used now; a missing one is no error.
    #[test]
    fn touch_sets_the_modification_time_to_now() {
        let scratch = guestmem_testkit::Scratch::new("learnt-touch");
        let p = scratch.join("x.guestmem-ws.json");
        std::fs::write(&p, b"{}").unwrap();
        let long_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(86_400 * 40);
        std::fs::File::options()
            .write(true)
            .open(&p)
            .unwrap()
            .set_modified(long_ago)
            .unwrap();
        super::touch(&p);
        let age = p
            .metadata()
            .unwrap()
            .modified()
            .unwrap()
            .elapsed()
            .unwrap_or_default();
        assert!(age < std::time::Duration::from_secs(3600), "{age:?}");
        super::touch(&scratch.join("missing"));
    }
    use super::*;

    #[test]
    fn a_merge_keeps_the_first_order_and_appends_what_is_new() {
        let mut l = Learnt {
            path: PathBuf::from("/nonexistent"),
            file: None,
            offsets: Vec::new(),
            seen: HashSet::new(),
            vms: 0,
            changed: false,
        };
        l.merge(&[3, 1, 2]);
        l.merge(&[1, 5, 3, 4]);
        assert_eq!(l.offsets(), &[3, 1, 2, 5, 4]);
        assert!(
            matches!(l.store(), Err(LearnError::NoIdentity)),
            "no identity, no file"
        );
    }
}
