//! The sockets' memory files as a server starts: watched for a write in place (which would
//! serve a VM a mix of two snapshots), and their learnt working sets loaded.

use super::Server;
use crate::serve::files::MemoryFile;
use crate::serve::learn::Learnt;
use crate::serve::watch::FileWatch;

impl Server {
    /// Starts watching the memory files (a failure is logged: the server serves all the
    /// same).
    pub(super) fn watch_files(&mut self) {
        let mems: Vec<&MemoryFile> = self.sockets.iter().map(|s| &s.memory).collect();
        if !mems.iter().any(|m| m.is_local()) {
            // Snapshots in the store only, named by their contents: nothing to watch, and no
            // inotify instance taken (a user has few).
            self.watch = None;
            return;
        }
        self.watch = match FileWatch::new(&mems) {
            Ok(w) => Some(w),
            Err(e) => {
                self.ending.log.warn(&format!(
                    "memory files not watched ({e}): a file written in place while served \
                     would not be noticed"
                ));
                None
            }
        };
    }

    /// Loads each socket's learnt working set (when learning).
    pub(super) fn load_learnt(&mut self) {
        if !self.cfg.learn_working_sets {
            return;
        }
        for s in &mut self.sockets {
            let (l, why) = Learnt::load(&s.memory);
            match why {
                Some(why) => self.ending.log.say(&format!(
                    "learnt working set {}: not used: {why}",
                    l.path().display()
                )),
                None if !l.offsets().is_empty() => self.ending.log.say(&format!(
                    "learnt working set {}: {} blocks to prefetch for each VM",
                    l.path().display(),
                    l.offsets().len()
                )),
                None => {}
            }
            *s.learnt.get_mut().unwrap_or_else(|e| e.into_inner()) = Some(l);
        }
    }
}
