//! The files a page server reads and writes: the snapshot's memory file, opened and checked
//! once before any VM connects, and working-set files (read capped, written whole).

use std::fs::File;
use std::path::{Path, PathBuf};

use super::{ServeError, MAX_WORKING_SET_BYTES};
use crate::files::Dir;

/// A snapshot's memory file, opened and checked once (a regular file, no symlink followed,
/// no FIFO waited on) before any VM connects: every read uses this descriptor, so a file
/// renamed over the path later is not the one served.
#[derive(Debug)]
pub struct MemoryFile {
    pub(super) file: File,
    pub(super) len: u64,
    pub(super) path: PathBuf,
}

impl MemoryFile {
    /// Opens `path`.
    pub fn open(path: &Path) -> Result<MemoryFile, ServeError> {
        let ferr = |reason: String| ServeError::MemoryFile {
            path: path.to_path_buf(),
            reason,
        };
        let (dir, name) = crate::files::split(path).map_err(|e| ferr(e.source.to_string()))?;
        let (file, len) = Dir::open(&dir)
            .and_then(|d| d.open_regular(&name, u64::MAX))
            .map_err(|e| ferr(e.source.to_string()))?;
        Ok(MemoryFile {
            file,
            len,
            path: path.to_path_buf(),
        })
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
        let werr = |reason: String| ServeError::WorkingSet {
            path: path.to_path_buf(),
            reason,
        };
        let (dir, name) = crate::files::split(path).map_err(|e| werr(e.source.to_string()))?;
        let text = Dir::open(&dir)
            .and_then(|d| d.read_capped(&name, MAX_WORKING_SET_BYTES))
            .map_err(|e| werr(e.source.to_string()))?;
        Self::parse(&text).map_err(werr)
    }

    /// Parses a working-set file's text.
    pub fn parse(text: &[u8]) -> Result<Vec<u64>, String> {
        let w: WorkingSetFile = serde_json::from_slice(text).map_err(|e| e.to_string())?;
        if w.format != Self::FORMAT {
            return Err(format!(
                "format {:?}, expected {:?}",
                w.format,
                Self::FORMAT
            ));
        }
        Ok(w.offsets)
    }

    /// Checks, before serving starts, that [`WorkingSetFile::write`] can write `path`: its
    /// directory exists and takes a new file, and nothing but a regular file is there.
    pub fn check_writable(path: &Path) -> Result<(), ServeError> {
        crate::files::check_publishable(path).map_err(|e| ServeError::WorkingSet {
            path: path.to_path_buf(),
            reason: e.to_string(),
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
            reason: e.to_string(),
        })
    }
}
