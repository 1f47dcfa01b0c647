//! A memory file read for a push: a raw file checked to be one, and a Firecracker Diff
//! checked to be read right (its holes the base's pages, its folder's file system reporting
//! data page by page, not merged into a file that was there).

use std::fs::File;
use std::os::fd::AsFd;
use std::path::Path;

use super::manifest::{check_frame_bytes, Snapshot};
use super::url::StoreUrl;
use super::StoreError;

/// Checks that a Firecracker Diff written into `folder` can be pushed as one
/// ([`PushSource::RawDiff`]) or taken by a move: its file system must report a sparse
/// file's data page by page (a hole is the base's page, so data reported in coarser
/// ranges, as a tmpfs with huge pages does, would read the base's pages around each write
/// as zeros). Asked of the file system itself, by writing one page into a sparse file
/// there that is never linked. An error names the folder and why.
pub fn check_diff_folder(folder: &Path) -> Result<(), StoreError> {
    let refused = |source| StoreError::Io {
        op: "hold a Firecracker Diff in",
        path: folder.to_path_buf(),
        source,
    };
    match diff_folder_problem(folder).map_err(refused)? {
        None => Ok(()),
        Some(why) => Err(refused(std::io::Error::other(why))),
    }
}

/// Why a Diff in `folder` would not read right, if it would not.
pub(crate) fn diff_folder_problem(folder: &Path) -> std::io::Result<Option<String>> {
    let dir = File::open(folder)?;
    crate::sys::coarse_data_ranges(dir.as_fd())
}

/// Opens the memory file at `path` to read: a regular file (a FIFO is not waited on for a
/// writer, a device not read), refused naming what it is.
pub(super) fn open_memory_file(path: &Path) -> Result<File, StoreError> {
    use std::os::unix::fs::OpenOptionsExt;
    let err = |op, source| StoreError::Io {
        op,
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| err("open", e))?;
    let meta = file.metadata().map_err(|e| err("stat", e))?;
    if !meta.is_file() {
        use std::os::unix::fs::FileTypeExt;
        let t = meta.file_type();
        let what = match () {
            _ if t.is_dir() => "a directory",
            _ if t.is_fifo() => "a FIFO",
            _ if t.is_socket() => "a socket",
            _ if t.is_block_device() || t.is_char_device() => "a device",
            _ => "not a regular file",
        };
        return Err(err(
            "read as a memory file",
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{what}: a memory file is a regular file"),
            ),
        ));
    }
    Ok(file)
}

/// The slowest a Firecracker Diff is taken to be written (bytes a second, of the data the
/// file holds: Firecracker writes only the dirty pages): a file born longer before its
/// last write than its data takes at this rate, and at least a minute, was there before
/// the Diff.
const DIFF_WRITE_MIN_BYTES_PER_SEC: u64 = 32 << 20;

/// How long before its last write a Diff file holding `data` bytes may have been made:
/// writing them at [`DIFF_WRITE_MIN_BYTES_PER_SEC`], and at least a minute.
fn diff_write_limit(data: u64) -> std::time::Duration {
    std::time::Duration::from_secs((data / DIFF_WRITE_MIN_BYTES_PER_SEC).max(60))
}

/// Why a Diff file looks written into a file that was there before, if it does: born
/// (`statx`'s birth time) more than `limit` before its last write. Firecracker opens a
/// Diff's path without truncating a file of the memory's size (it merges into it), so the
/// pages such a file held before read as the diff's. A file system that keeps no birth
/// time, or a file modified before its birth (copied keeping its times), is taken as it is.
fn written_into_older(meta: &std::fs::Metadata, limit: std::time::Duration) -> Option<String> {
    let (born, written) = (meta.created().ok()?, meta.modified().ok()?);
    let apart = written.duration_since(born).ok()?;
    (apart > limit).then(|| {
        format!(
            "it was made {}s before its last write (writing its data takes under \
             {}s): Firecracker writes a Diff into a file of the memory's size that is there \
             already without truncating it, so every page it held before would be pushed as \
             changed (stale where a later layer changed it). Write each Diff to a new path (remove \
             an old file, not truncate it: a truncated file keeps its birth time); \
             if this file held only pages of this VM on this base before (an earlier diff \
             of it on this base), push with --reused-file",
            apart.as_secs(),
            limit.as_secs()
        )
    })
}

/// The ranges (offset, end) of a file that hold data.
pub(super) type DataRanges = Vec<(u64, u64)>;

/// Opens the raw diff at `path` as a diff on `snap` (the snapshot at `base`): checked that it
/// fits the base, that its holes are the base's pages and, unless `reused_ok`, that it was
/// not written into a file that was there long before; its length and the ranges of it
/// that hold data.
pub(super) fn open_raw_diff(
    path: &Path,
    base: &StoreUrl,
    snap: &Snapshot,
    reused_ok: bool,
) -> Result<(File, u64, DataRanges), StoreError> {
    let io = |op, path: &Path| {
        let path = path.to_path_buf();
        move |source| StoreError::Io { op, path, source }
    };
    let file = open_memory_file(path)?;
    let meta = file.metadata().map_err(io("stat", path))?;
    let len = meta.len();
    if !reused_ok {
        // The data it holds (its blocks), not its length: a Diff is as long as memory.
        use std::os::unix::fs::MetadataExt;
        let data = meta.blocks().saturating_mul(512);
        if let Some(why) = written_into_older(&meta, diff_write_limit(data)) {
            return Err(StoreError::Io {
                op: "read as a diff (Firecracker merges a Diff into a file already there)",
                path: path.to_path_buf(),
                source: std::io::Error::other(why),
            });
        }
    }
    // A base handed in is checked as one read from the store is (its manifest's
    // fields are public): the frames are cut to its frame size.
    check_frame_bytes(snap.frame_bytes())?;
    if snap.frames.len() as u64 != snap.memory_bytes().div_ceil(snap.frame_bytes()) {
        return Err(StoreError::Base {
            url: base.to_string(),
            reason: format!(
                "{} frames for {:#x} bytes in frames of {:#x}",
                snap.frames.len(),
                snap.memory_bytes(),
                snap.frame_bytes()
            ),
        });
    }
    // Firecracker sizes a Diff to the whole of memory: a shorter file is another's, or
    // one cut short (its lost tail would take the base's pages, stale).
    if len != snap.memory_bytes() {
        return Err(StoreError::Base {
            url: base.to_string(),
            reason: format!(
                "{} is {len:#x} bytes, the base's memory {:#x}: not a diff of it (a \
                 Firecracker Diff is as long as the memory it was taken of)",
                path.display(),
                snap.memory_bytes()
            ),
        });
    }
    if !snap.manifest.regions.is_empty() {
        return Err(StoreError::Base {
            url: base.to_string(),
            reason: "a guestmem snapshot: a raw diff goes on a raw memory file's snapshot".into(),
        });
    }
    // A hole is the base's page: data ranges coarser than the pages written would
    // take zeros for memory.
    let folder = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    if let Some(why) = diff_folder_problem(folder).map_err(io("find the filesystem of", path))? {
        return Err(StoreError::Io {
            op: "read as a diff (its holes are the base's pages)",
            path: path.to_path_buf(),
            source: std::io::Error::other(why),
        });
    }
    let data = crate::sys::data_ranges(file.as_fd(), 0, len)
        .map_err(io("find the data (SEEK_DATA) of", path))?;
    // Pages are written whole: data that starts or ends inside one is a file system that
    // reports otherwise than it was written, or not a Diff.
    const PAGE: u64 = 4096;
    if let Some(&(at, end)) = data
        .iter()
        .find(|&&(at, end)| at % PAGE != 0 || (end % PAGE != 0 && end != len))
    {
        return Err(StoreError::Io {
            op: "read as a diff (its holes are the base's pages)",
            path: path.to_path_buf(),
            source: std::io::Error::other(format!(
                "data at {at:#x}..{end:#x} starts or ends inside a 4 KiB page"
            )),
        });
    }
    Ok((file, len, data))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    /// A Diff file made well before its last write (Firecracker merged into a file that
    /// was there: it does not truncate one of the memory's size) is taken as reused; one
    /// written as it is made is not. The limit is a minute at least, and the time the
    /// whole memory takes at 32 MiB/s.
    #[test]
    fn a_diff_file_made_long_before_its_last_write_is_taken_as_reused() {
        use std::io::Write;
        let scratch = guestmem_testkit::Scratch::new("diff-reused");
        let path = scratch.join("diff");
        let mut f = std::fs::File::create(&path).unwrap();
        f.write_all(&[1u8; 4096]).unwrap();
        let Ok(born) = f.metadata().unwrap().created() else {
            eprintln!("skipped: {} keeps no birth time", scratch.display());
            return;
        };
        let meta = f.metadata().unwrap();
        assert!(super::written_into_older(&meta, Duration::from_millis(500)).is_none());
        // Written again past the limit: the file was there before this write.
        while born.elapsed().unwrap() < Duration::from_millis(700) {
            std::thread::sleep(Duration::from_millis(50));
        }
        f.write_all(&[2u8; 4096]).unwrap();
        let meta = f.metadata().unwrap();
        let why = super::written_into_older(&meta, Duration::from_millis(500))
            .expect("a file made before the limit is taken as reused");
        assert!(why.contains("--reused-file"), "{why}");
        assert!(super::written_into_older(&meta, Duration::from_secs(60)).is_none());
        assert_eq!(super::diff_write_limit(1 << 30), Duration::from_secs(60));
        assert_eq!(super::diff_write_limit(64 << 30), Duration::from_secs(2048));
    }
}
