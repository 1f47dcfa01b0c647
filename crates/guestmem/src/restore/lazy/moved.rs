//! Blocks moved in whole: an in-process restore of anonymous memory that may hold huge
//! pages reads each 2 MiB-aligned block into a staging buffer on transparent huge pages and
//! moves those pages into place with `UFFDIO_MOVE` (Linux 6.8 and later), instead of
//! copying them with `UFFDIO_COPY`.
//!
//! Why: `UFFDIO_COPY` always fills 4 KiB pages, so a guest saved on huge pages comes back
//! on small ones until a collapse copies it again; a moved huge page stays huge, and the
//! second copy is saved. Measured on this kind of host (256 MiB from a warm file, 2 MiB per
//! call): read and move 0.08 s, with every page huge after; read and copy 0.14 s, every page
//! 4 KiB. Moving 4 KiB pages out of a plain buffer is slower than copying them (0.24 s
//! against 0.15 s: the buffer's pages must be faulted and zeroed again after each move), so
//! moves are used only where the staging buffer can be on huge pages (THP not `never`).
//! Peers' memory (a page server's) is never moved: the kernel moves only within the
//! descriptor's own address space. Not for regions bound to a NUMA node: a moved page stays
//! on the node the worker thread allocated it on. Only on Linux 6.16 and later: earlier
//! kernels had a race between `UFFDIO_MOVE` and the swap cache (fixed there, "mm:
//! userfaultfd: fix race of userfaultfd_move and swap cache") that could move stale data.

use std::cell::{Cell, RefCell};
use std::sync::atomic::Ordering;
use std::sync::OnceLock;

use super::place::LRegion;
use super::{Lazy, SCRATCH};
use crate::layout::{Backing, Thp, THP_BYTES};
use crate::mmap::{Advice, Mapping, Reservation};
use crate::snapshot::SnapshotError;

thread_local! {
    /// A worker's staging buffer for moves: 2 MiB-aligned, advised `MADV_HUGEPAGE`, its
    /// pages moved out by every block (the next read faults fresh ones).
    static HUGE_STAGING: RefCell<Option<Mapping>> = const { RefCell::new(None) };
    /// This thread could not map one: it copies from then on.
    static NO_STAGING: Cell<bool> = const { Cell::new(false) };
}

/// Whether this host may move huge pages in: Linux 6.16 or later (see the module's docs)
/// and transparent huge pages not `never`. Read once.
fn host_moves() -> bool {
    static MOVES: OnceLock<bool> = OnceLock::new();
    *MOVES.get_or_init(|| {
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .unwrap_or_default();
        kernel_at_least(&release, (6, 16)) && !thp.is_empty() && !thp.contains("[never]")
    })
}

/// Whether a kernel release string (`6.18.44-fc`) is `want` or later.
fn kernel_at_least(release: &str, want: (u32, u32)) -> bool {
    let mut v = release
        .trim()
        .split(['.', '-'])
        .map(|p| p.parse::<u32>().unwrap_or(0));
    (v.next().unwrap_or(0), v.next().unwrap_or(0)) >= want
}

/// A staging mapping of `len` bytes (a multiple of 2 MiB) starting on a 2 MiB boundary,
/// advised to take transparent huge pages.
fn huge_staging(len: usize) -> std::io::Result<Mapping> {
    let thp = THP_BYTES as usize;
    let res = Reservation::new(len + thp).map_err(|e| e.into_io())?;
    let head = res.addr().next_multiple_of(thp) - res.addr();
    let m = res
        .trim(head, len)
        .and_then(|r| r.place(0, len))
        .map_err(|e| e.into_io())?;
    m.advise(0, len, Advice::HugePage)
        .map_err(|e| e.into_io())?;
    // A child of a fork sharing its pages would make every move fail (`EBUSY`).
    m.advise(0, len, Advice::DontFork)
        .map_err(|e| e.into_io())?;
    Ok(m)
}

impl Lazy {
    /// Whether `block` (`off..off + n` of `lr`) is moved in rather than copied: this
    /// process's own anonymous memory advised to take huge pages and bound to no NUMA node,
    /// whole 2 MiB pages at a 2 MiB-aligned address, a descriptor that can move, a host
    /// that may ([`host_moves`]).
    pub(super) fn movable(&self, lr: &LRegion, off: usize, n: usize) -> bool {
        let thp = THP_BYTES as usize;
        let Some(region) = lr.region() else {
            return false;
        };
        self.uffd.can_move()
            && matches!(region.backing(), Backing::Anonymous)
            && region.thp() == Thp::Huge
            && region.numa_node().is_none()
            && n >= thp
            && n.is_multiple_of(thp)
            && (lr.host as usize + off).is_multiple_of(thp)
            && host_moves()
            && !NO_STAGING.get()
    }

    /// Reads `block` into this thread's huge staging buffer and moves it into `lr` at `off`
    /// (`n` bytes, [`Lazy::movable`]); what the kernel would not move (a staging page it
    /// could not take, say) is copied instead. Returns the bytes placed: fewer than `n`
    /// when a page of the block was present already. `Ok(None)`: no staging buffer could
    /// be had; the caller copies.
    pub(super) fn fill_moved(
        &self,
        block: u64,
        lr: &LRegion,
        off: usize,
        n: usize,
        mem_err: impl Fn(&'static str, std::io::Error) -> SnapshotError,
    ) -> Result<Option<usize>, SnapshotError> {
        let region = lr.region().expect("movable: our own region");
        let target = region.mapping();
        let len = (self.image.largest_block() as usize).next_multiple_of(THP_BYTES as usize);
        HUGE_STAGING.with(|cell| {
            let mut cell = cell.borrow_mut();
            if cell.as_ref().is_none_or(|m| m.len() < len) {
                match huge_staging(len) {
                    Ok(m) => *cell = Some(m),
                    Err(_) => {
                        NO_STAGING.set(true);
                        return Ok(None);
                    }
                }
            }
            let staging = cell.as_ref().expect("set above");
            let mut scratch = SCRATCH.take();
            // SAFETY: the staging mapping is this thread's own, at least a block long,
            // 2 MiB-aligned, and nothing else touches it; it is not known to read as zero.
            let read = unsafe {
                self.image
                    .read_block(block, staging.as_ptr(), false, &mut scratch)
            };
            SCRATCH.set(scratch);
            read?;
            // SAFETY: no reference into the staging buffer is live, and only this thread
            // uses it.
            let (moved, stop) = unsafe {
                self.uffd
                    .move_in(target, off, staging, 0, n, &|| self.drain())
            };
            if moved == n {
                self.counters.moved.fetch_add(n as u64, Ordering::Relaxed);
                return Ok(Some(n));
            }
            if stop.as_ref().and_then(|e| e.raw_os_error()) == Some(libc::EEXIST) {
                return Ok(Some(moved));
            }
            // The rest is still in the staging buffer: copy it.
            // SAFETY: bytes moved..n of the staging mapping, which the move left in place.
            let rest =
                unsafe { std::slice::from_raw_parts(staging.as_ptr().add(moved), n - moved) };
            let copied = self
                .uffd
                .copy(target, off + moved, rest, &|| self.drain())
                .map_err(|e| mem_err("UFFDIO_COPY", e))?;
            // What was not moved stays resident in the staging buffer: give it back.
            let _ = staging.advise(0, n, Advice::DontNeed);
            if moved + copied == n {
                self.counters
                    .moved
                    .fetch_add(moved as u64, Ordering::Relaxed);
            }
            Ok(Some(moved + copied))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::kernel_at_least;

    #[test]
    fn kernel_releases_compare_by_major_and_minor() {
        assert!(kernel_at_least("6.18.44-fc-v782\n", (6, 16)));
        assert!(kernel_at_least("6.16.0", (6, 16)));
        assert!(!kernel_at_least("6.15.9-rc1", (6, 16)));
        assert!(!kernel_at_least("5.19.0", (6, 16)));
        assert!(kernel_at_least("7.0", (6, 16)));
        assert!(!kernel_at_least("", (6, 16)));
    }
}
