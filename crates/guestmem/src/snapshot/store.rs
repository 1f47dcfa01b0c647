//! Where a save is published and how: a locked staging directory beside the target,
//! published with one `renameat2(RENAME_NOREPLACE)`, removed if the save fails, and swept
//! by a later save if the process that made it died.

use std::path::{Path, PathBuf};

use super::{SnapshotError, MANIFEST_FILE, MEMORY_FILE};
use crate::files::Dir;

/// Where a save is published: the directory it goes in, and its name there.
pub(super) struct Destination {
    parent: Dir,
    name: String,
    path: PathBuf,
}

impl Destination {
    /// Refuses a target that exists as anything but an empty directory.
    pub(super) fn new(dir: &Path) -> Result<Destination, SnapshotError> {
        let (parent, name) = crate::files::split(dir)?;
        if let Ok(meta) = std::fs::symlink_metadata(dir) {
            let empty_dir =
                meta.is_dir() && std::fs::read_dir(dir).is_ok_and(|mut d| d.next().is_none());
            if !empty_dir {
                return Err(SnapshotError::Exists {
                    dir: dir.to_path_buf(),
                });
            }
        }
        Ok(Destination {
            parent: Dir::open(&parent)?,
            name,
            path: dir.to_path_buf(),
        })
    }

    /// `parent` as the child published here should name it: `../NAME` when both sit in one
    /// directory, else its absolute path.
    pub(super) fn name_parent(&self, parent: &Path) -> PathBuf {
        let (Ok(here), Ok(p)) = (self.parent.path().canonicalize(), parent.canonicalize()) else {
            return parent.to_path_buf();
        };
        match (p.parent(), p.file_name()) {
            (Some(pp), Some(name)) if pp == here => Path::new("..").join(name),
            _ => p,
        }
    }
}

/// A save in the making: a directory beside its target, named `.NAME.guestmem-save-*` and
/// locked (`flock`) while its save runs, removed unless published.
pub(super) struct Staging {
    /// The directory it was made in.
    parent: Dir,
    pub(super) dir: Dir,
    name: String,
    published: bool,
}

/// How old an unlocked staging directory must be before a later save removes it as the
/// remains of a save that died (so one just made, not yet locked, is never taken).
const STALE_STAGING_SECS: u64 = 60;

impl Staging {
    fn prefix(target: &Destination) -> String {
        format!(".{}.guestmem-save-", target.name)
    }

    pub(super) fn create(target: &Destination) -> Result<Staging, SnapshotError> {
        Staging::sweep(target);
        let name = format!(
            "{}{}",
            Staging::prefix(target),
            crate::files::unique_suffix()
        );
        let path = target.parent.join(&name);
        let ferr = |op| {
            let path = path.clone();
            move |source| SnapshotError::File { op, path, source }
        };
        target.parent.mkdir(&name).map_err(ferr("create"))?;
        let opened = target.parent.open_child(&name).and_then(|d| {
            d.check_private()
                .map_err(|source| crate::files::FileError {
                    op: "check",
                    path: path.clone(),
                    source,
                })?;
            Ok(d)
        });
        let dir = match opened {
            Ok(d) => d,
            Err(e) => {
                let _ = target.parent.rmdir(&name);
                return Err(e.into());
            }
        };
        let mut staging = Staging {
            parent: target.parent.try_clone().map_err(ferr("open"))?,
            dir,
            name,
            published: false,
        };
        if let Err(e) = staging.dir.lock(true, true) {
            staging.remove();
            return Err(ferr("lock")(e));
        }
        Ok(staging)
    }

    /// Removes what saves that died left beside `target`: staging directories nobody holds
    /// the lock of, older than [`STALE_STAGING_SECS`]. Best effort.
    fn sweep(target: &Destination) {
        let prefix = Staging::prefix(target);
        let Ok(entries) = std::fs::read_dir(target.parent.path()) else {
            return;
        };
        for e in entries.flatten() {
            let Some(name) = e.file_name().to_str().map(str::to_string) else {
                continue;
            };
            // Only real directories: an entry is never followed through a symlink (a link
            // named like a staging directory must not make this sweep delete elsewhere).
            if !e.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let old = e
                .metadata()
                .ok()
                .and_then(|m| m.modified().ok())
                .is_some_and(|t| t.elapsed().is_ok_and(|a| a.as_secs() >= STALE_STAGING_SECS));
            if !name.starts_with(&prefix) || !old {
                continue;
            }
            let Ok(dir) = target.parent.open_child(&name) else {
                continue;
            };
            // Locked, and the name still names it: its save died. (A save that published
            // it since has renamed it away; one that still runs holds the lock.)
            if dir.lock(true, false).unwrap_or(false) && target.parent.names(&name, &dir) {
                let Ok(parent) = target.parent.try_clone() else {
                    continue;
                };
                Staging {
                    parent,
                    dir,
                    name,
                    published: false,
                }
                .remove();
            }
        }
    }

    /// Moves the staging directory to the target in one rename that never replaces a
    /// snapshot, then syncs the directory holding both.
    pub(super) fn publish(mut self, target: &Destination) -> Result<(), SnapshotError> {
        self.dir.sync()?;
        let exists = || SnapshotError::Exists {
            dir: target.path.clone(),
        };
        // An empty directory at the target is taken as a place to save into: removed just
        // before the rename. If another save publishes there in between, one rename loses.
        match target.parent.rmdir(&target.name) {
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOTEMPTY) => return Err(exists()),
            Err(e) if e.raw_os_error() == Some(libc::ENOTDIR) => return Err(exists()),
            Err(source) => {
                return Err(SnapshotError::File {
                    op: "replace the empty directory",
                    path: target.path.clone(),
                    source,
                })
            }
        }
        match target.parent.rename(&self.name, &target.name, false) {
            Ok(()) => {}
            Err(e)
                if matches!(
                    e.source.raw_os_error(),
                    Some(libc::EEXIST | libc::ENOTEMPTY)
                ) =>
            {
                return Err(exists())
            }
            Err(e) => return Err(e.into()),
        }
        self.published = true;
        target.parent.sync()?;
        Ok(())
    }

    fn remove(&mut self) {
        self.dir.unlink(MEMORY_FILE);
        self.dir.unlink(MANIFEST_FILE);
        let _ = self.parent.rmdir(&self.name);
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.published {
            self.remove();
        }
    }
}
