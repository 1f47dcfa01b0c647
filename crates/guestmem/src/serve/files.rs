//! The files a page server reads and writes: the snapshot's memory file, opened and checked
//! once before any VM connects, its identity (which file it is, beyond its name), and
//! working-set files (read capped, written whole).

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use super::error::{MemoryFileProblem, WorkingSetProblem};
use super::ServeError;
use crate::files::{Dir, FileError};

/// Largest working-set file read (8 bytes a block, in JSON).
pub const MAX_WORKING_SET_BYTES: u64 = 64 << 20;

/// A snapshot's memory file, opened and checked once (a regular file, no symlink followed,
/// no FIFO waited on) before any VM connects: every read uses this descriptor, so a file
/// renamed over the path later is not the one served. Or, with the `store` feature, a
/// snapshot in object storage ([`MemoryFile::from_store`]), its manifest read and checked
/// once, its frames fetched as VMs read them.
#[derive(Debug)]
pub struct MemoryFile {
    pub(super) source: Source,
    pub(super) len: u64,
    pub(super) path: PathBuf,
}

/// Where a memory file's bytes are.
#[derive(Debug)]
pub(super) enum Source {
    /// A file of this host.
    File(File),
    /// A snapshot in object storage.
    #[cfg(feature = "store")]
    Store(crate::store::StoreMemory),
}

impl MemoryFile {
    /// Opens `path`.
    pub fn open(path: &Path) -> Result<MemoryFile, ServeError> {
        let ferr = |e: FileError| ServeError::MemoryFile {
            path: path.to_path_buf(),
            problem: MemoryFileProblem::Open {
                op: e.op,
                source: e.source,
            },
        };
        let (dir, name) = crate::files::split(path).map_err(ferr)?;
        let (file, len) = Dir::open(&dir)
            .and_then(|d| d.open_regular(&name, u64::MAX))
            .map_err(ferr)?;
        Ok(MemoryFile {
            source: Source::File(file),
            len,
            path: path.to_path_buf(),
        })
    }

    /// A snapshot in object storage, opened (its manifest read and checked) by the caller:
    /// served as a memory file of its memory's length, its frames fetched as VMs read them.
    #[cfg(feature = "store")]
    pub fn from_store(memory: crate::store::StoreMemory) -> MemoryFile {
        MemoryFile {
            len: memory.snapshot().memory_bytes(),
            path: PathBuf::from(memory.snapshot().url.to_string()),
            source: Source::Store(memory),
        }
    }

    /// The working set recorded with it (memory offsets, first read first): a guestmem
    /// snapshot pushed to the store keeps its own; none for a file.
    pub fn recorded_working_set(&self) -> Vec<u64> {
        match &self.source {
            Source::File(_) => Vec::new(),
            #[cfg(feature = "store")]
            Source::Store(m) => m.working_set_offsets(),
        }
    }

    /// The frames a snapshot in the store is read through (none for a file).
    #[cfg(feature = "store")]
    pub(crate) fn frames(&self) -> Option<&std::sync::Arc<crate::store::Frames>> {
        match &self.source {
            Source::File(_) => None,
            Source::Store(m) => Some(m.frames()),
        }
    }

    /// Whether it is a file of this host (which can be watched, and kept beside).
    pub(crate) fn is_local(&self) -> bool {
        matches!(self.source, Source::File(_))
    }

    /// Where what its VMs taught is kept: beside the file; for a snapshot in the store, in
    /// the frame cache's directory under the manifest's hash (none without a cache).
    pub(crate) fn learnt_path(&self) -> Option<PathBuf> {
        match &self.source {
            Source::File(_) => {
                let mut p = self.path.as_os_str().to_owned();
                p.push(".guestmem-ws.json");
                Some(PathBuf::from(p))
            }
            #[cfg(feature = "store")]
            Source::Store(m) => m.frames().cache().map(|c| {
                let dir = c.dir().join("learnt");
                let _ = std::fs::create_dir_all(&dir);
                dir.join(format!("{}.guestmem-ws.json", m.snapshot().digest.to_hex()))
            }),
        }
    }

    /// Its length when opened, bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Its path, as given.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Its identity now (`fstat` of the descriptor served from).
    // Without the store, `Source` has one variant: the match still reads as the two cases.
    #[cfg_attr(not(feature = "store"), allow(clippy::infallible_destructuring_match))]
    pub(crate) fn identity(&self) -> std::io::Result<FileId> {
        let file = match &self.source {
            Source::File(f) => f,
            // A snapshot in the store is named by its manifest's hash: the same name with
            // other contents is another snapshot.
            #[cfg(feature = "store")]
            Source::Store(m) => {
                let d = m.snapshot().digest;
                let b = d.as_bytes();
                return Ok(FileId {
                    dev: 0,
                    ino: u64::from_le_bytes(b[..8].try_into().expect("8 bytes")),
                    size: self.len,
                    mtime_s: i64::from_le_bytes(b[8..16].try_into().expect("8 bytes")),
                    mtime_nsec: i64::from_le_bytes(b[16..24].try_into().expect("8 bytes")),
                });
            }
        };
        let m = file.metadata()?;
        Ok(FileId {
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            mtime_s: m.mtime(),
            mtime_nsec: m.mtime_nsec(),
        })
    }

    /// An error about this file.
    pub(super) fn error(&self, problem: MemoryFileProblem) -> ServeError {
        ServeError::MemoryFile {
            path: self.path.clone(),
            problem,
        }
    }
}

/// Which file a memory file is, beyond its name: a file replaced, truncated or written
/// since has another.
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

/// A recorded working set, as `guestmem serve-uffd --record` writes it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkingSetFile {
    /// Always `guestmem-working-set`.
    pub format: String,
    /// Memory-file offsets of the blocks faulted, first fault first.
    pub offsets: Vec<u64>,
}

impl WorkingSetFile {
    /// The format's name.
    pub const FORMAT: &'static str = "guestmem-working-set";

    /// Reads and checks `path` (a regular file of at most [`MAX_WORKING_SET_BYTES`], no
    /// symlink followed).
    pub fn read(path: &Path) -> Result<Vec<u64>, ServeError> {
        let werr = |problem| ServeError::WorkingSet {
            path: path.to_path_buf(),
            problem,
        };
        let io = |e: FileError| {
            werr(WorkingSetProblem::Io {
                op: e.op,
                source: e.source,
            })
        };
        let (dir, name) = crate::files::split(path).map_err(io)?;
        let text = Dir::open(&dir)
            .and_then(|d| d.read_capped(&name, MAX_WORKING_SET_BYTES))
            .map_err(io)?;
        Self::parse(&text).map_err(werr)
    }

    /// Parses a working-set file's text.
    pub fn parse(text: &[u8]) -> Result<Vec<u64>, WorkingSetProblem> {
        let w: WorkingSetFile = serde_json::from_slice(text).map_err(WorkingSetProblem::Parse)?;
        if w.format != Self::FORMAT {
            return Err(WorkingSetProblem::Format(w.format));
        }
        Ok(w.offsets)
    }

    /// Checks, before serving starts, that [`WorkingSetFile::write`] can write `path`: its
    /// directory exists and takes a new file, and nothing but a regular file is there.
    pub fn check_writable(path: &Path) -> Result<(), ServeError> {
        crate::files::check_publishable(path).map_err(|e| ServeError::WorkingSet {
            path: path.to_path_buf(),
            problem: WorkingSetProblem::Io {
                op: e.op,
                source: e.source,
            },
        })
    }

    /// Writes `offsets` to `path` whole or not at all: a new temporary file beside it,
    /// synced and renamed over it (a symlink there is replaced, never written through).
    pub fn write(path: &Path, offsets: &[u64]) -> Result<(), ServeError> {
        let w = WorkingSetFile {
            format: Self::FORMAT.into(),
            offsets: offsets.to_vec(),
        };
        let text = serde_json::to_vec(&w).expect("serialises");
        crate::files::publish_file(path, &text).map_err(|e| ServeError::WorkingSet {
            path: path.to_path_buf(),
            problem: WorkingSetProblem::Io {
                op: e.op,
                source: e.source,
            },
        })
    }
}
