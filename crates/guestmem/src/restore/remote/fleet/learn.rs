//! Working sets learnt across clones: the blocks each VM of a snapshot faulted, first fault
//! first, merged per snapshot and kept beside its memory file, so that every later VM of
//! that snapshot gets them prefetched in that order while it runs (its own faults first).
//!
//! Clones of one snapshot touch nearly the same pages in nearly the same order, so the
//! merge keeps the order the first VM touched its blocks in and appends, in their order,
//! the blocks later VMs touched that no earlier one did. The file
//! (`<memory file>.guestmem-ws.json`) names the memory file by its identity (device, inode,
//! size, modification time), not its name: a file replaced since is not served a working
//! set learnt from another. It is written whole (temporary file, fsync, rename). The fleet
//! loads them when it starts, hands them to its VMs, and merges in each VM's as it ends.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use super::super::state::FileId;
use super::super::{MemoryFile, ServeConfig, MAX_WORKING_SET_BYTES};
use super::Fleet;

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

/// One snapshot's learnt working set.
pub(super) struct Learnt {
    path: PathBuf,
    file: Option<FileId>,
    offsets: Vec<u64>,
    seen: HashSet<u64>,
    vms: u64,
    changed: bool,
}

/// Where the working set of `mem` is kept.
fn path_of(mem: &Path) -> PathBuf {
    let mut p = mem.as_os_str().to_owned();
    p.push(".guestmem-ws.json");
    PathBuf::from(p)
}

impl Learnt {
    /// The working set kept beside `mem`, if one is there and was learnt from this very
    /// file; else an empty one. Why one was not taken is returned to be logged.
    pub(super) fn load(mem: &MemoryFile) -> (Learnt, Option<String>) {
        let path = path_of(mem.path());
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
            let (dir, name) = crate::files::split(&path).map_err(|e| e.to_string())?;
            let bytes = crate::files::Dir::open(&dir)
                .and_then(|d| d.read_capped(&name, MAX_WORKING_SET_BYTES))
                .map_err(|e| e.source.to_string())?;
            let s: Stored = serde_json::from_slice(&bytes).map_err(|e| e.to_string())?;
            if s.format != FORMAT {
                return Err(format!("format {:?} is not {FORMAT:?}", s.format));
            }
            if Some(s.file) != file {
                return Err(
                    "learnt from another file (device, inode, size or mtime differ)".into(),
                );
            }
            Ok(s)
        })();
        match read {
            Ok(s) => {
                // Outside input: only offsets inside the file, at page boundaries, each once,
                // and never more than the file has pages.
                let size = file.map_or(0, |f| f.size());
                let cap = (size / 4096) as usize;
                for &o in &s.offsets {
                    if l.offsets.len() >= cap {
                        break;
                    }
                    if o < size {
                        l.merge(&[o / 4096 * 4096]);
                    }
                }
                l.vms = s.vms;
                l.changed = false;
                (l, None)
            }
            Err(e) if e.contains("No such file") => (l, None),
            Err(e) => (l, Some(format!("{}: not used: {e}", path.display()))),
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
    pub(super) fn store(&mut self) -> Result<(), String> {
        let Some(file) = self.file else {
            return Err("the memory file's identity is unknown".into());
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
        let text = serde_json::to_vec(&s).map_err(|e| e.to_string())?;
        crate::files::publish_file(&self.path, &text).map_err(|e| e.to_string())?;
        self.changed = false;
        Ok(())
    }

    /// Where it is kept.
    pub(super) fn path(&self) -> &Path {
        &self.path
    }
}

impl Fleet {
    /// Loads each socket's learnt working set (when learning).
    pub(super) fn load_learnt(&self) {
        if !self.cfg.learn_working_sets {
            return;
        }
        let mut all = Vec::new();
        for mem in &self.mems {
            let (l, why) = Learnt::load(mem);
            if let Some(why) = why {
                self.cfg.serve.log.say(&format!("learnt working set {why}"));
            } else if !l.offsets().is_empty() {
                self.cfg.serve.log.say(&format!(
                    "learnt working set {}: {} blocks to prefetch for each VM",
                    l.path().display(),
                    l.offsets().len()
                ));
            }
            all.push(l);
        }
        *self.learnt.lock().unwrap_or_else(|e| e.into_inner()) = all;
    }

    /// The blocks to prefetch first for a VM of socket `i`: its given working set, else what
    /// was learnt.
    pub(super) fn first_for(&self, i: usize) -> Vec<u64> {
        if !self.firsts[i].is_empty() {
            return self.firsts[i].clone();
        }
        self.learnt
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(i)
            .map_or(Vec::new(), |l| l.offsets().to_vec())
    }
}

/// Merges `ws` into socket `socket`'s learnt working set and writes it; a failure to write
/// is logged (the VMs are served all the same).
pub(super) fn learn_into(
    learnt: &Mutex<Vec<Learnt>>,
    cfg: &ServeConfig,
    socket: usize,
    ws: &[u64],
) {
    let mut all = learnt.lock().unwrap_or_else(|e| e.into_inner());
    let Some(l) = all.get_mut(socket) else { return };
    if ws.is_empty() {
        return;
    }
    l.merge(ws);
    l.count_vm();
    if let Err(e) = l.store() {
        cfg.log.say(&format!(
            "learnt working set {}: not written: {e}",
            l.path().display()
        ));
    }
}

#[cfg(test)]
mod tests {
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
        assert!(l.store().is_err(), "no identity, no file");
    }
}
