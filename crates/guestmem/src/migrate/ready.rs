//! What a move's source checks before it pauses the VM: the base (a raw memory file's
//! snapshot in the store), its work folder and the files Firecracker will write there, that
//! folder's file system, and that the store will take the diff under its name. Anything that fails here leaves the VM running, nothing paused.

use std::path::PathBuf;
use std::sync::Arc;

use super::MoveError;
use crate::store::{check_push, read_snapshot, Client, FetchPolicy, Frames, Snapshot, StoreUrl};

/// What of a move [`before_the_pause`] checks (the move's own fields).
pub(super) struct Move<'a> {
    /// The snapshot in the store the VM was restored from.
    pub(super) base: &'a StoreUrl,
    /// The name its diff gets.
    pub(super) push_as: &'a StoreUrl,
    /// Where Firecracker writes the diff.
    pub(super) work_dir: &'a std::path::Path,
}

/// The base's manifest, and the paths of the vmstate and the Diff Firecracker will write.
pub(super) fn before_the_pause(
    m: Move<'_>,
    store: &Arc<Client>,
) -> Result<(Arc<Snapshot>, PathBuf, PathBuf), MoveError> {
    let base = Arc::new(read_snapshot(
        &Frames::new(Arc::clone(store), None, FetchPolicy::default()),
        m.base,
    )?);
    if !base.manifest.regions.is_empty() {
        return Err(MoveError::Refused {
            side: "source",
            reason: format!(
                "{} is a guestmem snapshot; a Firecracker VM moves on a raw memory file's snapshot",
                m.base
            ),
        });
    }
    let io = |op, path: &std::path::Path| {
        let path = path.to_path_buf();
        move |source| MoveError::Io { op, path, source }
    };
    super::private_dir(m.work_dir).map_err(io("use as the work folder", m.work_dir))?;
    let local = m.push_as.name.replace('/', "_");
    let vmstate = m.work_dir.join(format!("{local}.vmstate"));
    let memfile = m.work_dir.join(format!("{local}.mem"));
    for f in [&vmstate, &memfile] {
        match f.symlink_metadata() {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            // Firecracker merges a Diff into a file of the memory's size that is there.
            Ok(_) => {
                return Err(MoveError::Io {
                    op: "write a diff to (a file is there already)",
                    path: f.clone(),
                    source: std::io::Error::from(std::io::ErrorKind::AlreadyExists),
                })
            }
            // A name too long for a file here (ENAMETOOLONG), say: refused before the
            // pause, where Firecracker's Diff would fail in it.
            Err(source) => {
                return Err(MoveError::Io {
                    op: "write a diff to",
                    path: f.clone(),
                    source,
                })
            }
        }
    }
    // Checked before the pause: Firecracker's Diff there keeps its holes page by page.
    if let Some(why) = crate::store::diff_folder_problem(m.work_dir)
        .map_err(io("find the file system of", m.work_dir))?
    {
        return Err(MoveError::Refused {
            side: "source",
            reason: format!(
                "the work dir {} cannot hold a Diff: {why}; nothing paused",
                m.work_dir.display()
            ),
        });
    }
    // Checked before the pause: the name is free and this host may write the store.
    check_push(store, m.push_as)?;
    Ok((base, vmstate, memfile))
}
