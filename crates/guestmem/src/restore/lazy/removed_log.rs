//! A served VM's removed pages, kept in a file for the server that comes after this one.
//!
//! A balloon's remove (`UFFD_EVENT_REMOVE`) marks its pages in the restore's bitmap, and they
//! read as zero from then on, whether their block had come in or not. A server that takes
//! the VM back (after this one crashed, or handed it over) finds those pages missing, and
//! cannot tell a removed page from one never filled: without the bitmap it would fill them
//! with the snapshot's bytes, and the balloon's memory would come back to the host. So the
//! page server gives each session a file beside its record that mirrors the bitmap. Each
//! remove writes the words it changed. Removes are applied one at a time per userfaultfd,
//! under its read lock, so a word written is never older than the file's. A session taken
//! back reads the file before its first fault is served. The file holds every region's words
//! in order, little-endian, and nothing else.
//!
//! A remove the server read and had not yet written when it was killed is lost (its pages
//! are then filled with the snapshot's bytes): the window is one `pwrite`.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;

use super::place::LRegion;
use super::Lazy;

impl Lazy {
    /// Bytes a removed-pages file of this restore holds.
    fn removed_bytes(&self) -> u64 {
        self.regions
            .iter()
            .map(|r| r.removed.len() as u64 * 8)
            .sum()
    }

    /// The removed pages now, as a removed-pages file holds them.
    fn removed_now(&self) -> Vec<u8> {
        self.regions
            .iter()
            .flat_map(|r| r.removed.iter())
            .flat_map(|w| w.load(Ordering::Acquire).to_le_bytes())
            .collect()
    }

    /// Marks removed the pages `file` holds: a previous server's removed-pages file, or
    /// the memfd a server that handed this VM over sent. A file of another length is
    /// refused, naming both lengths, and nothing is read from it. Returns the pages marked.
    pub(super) fn load_removes(&self, file: &File) -> io::Result<u64> {
        let want = self.removed_bytes();
        let len = file.metadata()?.len();
        if len != want {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("it holds {len} bytes, where this VM's regions take {want}"),
            ));
        }
        let mut buf = vec![0u8; want as usize];
        file.read_exact_at(&mut buf, 0)?;
        let mut words = buf.chunks_exact(8);
        let mut marked = 0;
        for lr in &self.regions {
            let pages = lr.size / lr.page;
            for (i, w) in lr.removed.iter().enumerate() {
                let word = words.next().expect("sized above");
                let mut v = u64::from_le_bytes(word.try_into().expect("8 bytes"));
                // Bits past the region's last page mean nothing.
                let first = i as u64 * 64;
                if pages < first + 64 {
                    v &= (1u64 << (pages - first)) - 1;
                }
                marked += u64::from(v.count_ones());
                w.fetch_or(v, Ordering::AcqRel);
            }
        }
        if marked > 0 {
            // Its owner removes pages: copies hold the read lock from the start.
            self.uffd.note_removes();
        }
        Ok(marked)
    }

    /// Keeps this restore's removed pages in `file` from now on: sized, and written whole
    /// first (what is marked now; a new file with nothing marked is left sparse). Under the
    /// userfaultfd's read lock: no remove falls between what is written and the log.
    pub(super) fn log_removes_to(&self, file: File) -> io::Result<()> {
        let _reading = self.uffd.reading();
        let was = file.metadata()?.len();
        file.set_len(self.removed_bytes())?;
        let now = self.removed_now();
        if was != 0 || now.iter().any(|&b| b != 0) {
            file.write_all_at(&now, 0)?;
        }
        let _ = self.removed_log.set(file);
        Ok(())
    }

    /// A memfd holding the removed pages as a removed-pages file does, for a server this
    /// VM is handed to; `None` when no page was removed. Taken under the read lock: a
    /// remove being applied is in it whole or not at all (and none is read here once
    /// reading has stopped: `Uffd::stop_reading`).
    pub(super) fn removed_memfd(&self) -> io::Result<Option<std::os::fd::OwnedFd>> {
        let bytes = {
            let _reading = self.uffd.reading();
            self.removed_now()
        };
        if bytes.iter().all(|&b| b == 0) {
            return Ok(None);
        }
        let f = File::from(crate::sys::memfd_create(
            c"guestmem-removed",
            libc::MFD_CLOEXEC,
        )?);
        f.write_all_at(&bytes, 0)?;
        Ok(Some(f.into()))
    }

    /// Writes the words of `lr` that hold pages `from..to` to the removed-pages file, if
    /// this restore keeps one. A write that fails is logged: the VM is served as before,
    /// and only a later server would fill those pages.
    pub(super) fn log_removed(&self, lr: &LRegion, from: u64, to: u64) {
        let Some(f) = self.removed_log.get() else {
            return;
        };
        if from >= to {
            return;
        }
        let (w0, w1) = ((from / 64) as usize, ((to - 1) / 64) as usize);
        let bytes: Vec<u8> = lr.removed[w0..=w1]
            .iter()
            .flat_map(|w| w.load(Ordering::Acquire).to_le_bytes())
            .collect();
        if let Err(e) = f.write_all_at(&bytes, ((lr.removed_at + w0) * 8) as u64) {
            tracing::warn!(
                "pages removed at host address {:#x} not kept for a later server (they would \
                 be filled with the snapshot's bytes after a restart): {e}",
                lr.host + from * lr.page
            );
        }
    }
}
