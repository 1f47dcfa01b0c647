//! Block fills: what bringing one block in does for each backing (a private region's copy,
//! zero pages, or move; a shared region's page cache and `UFFDIO_CONTINUE`), and the
//! per-thread staging buffer the copies go through.

use std::os::fd::AsFd;
use std::sync::atomic::Ordering;

use super::{LRegion, Lazy, SCRATCH, STAGING};
use crate::mmap::{Advice, Mapping};
use crate::snapshot::SnapshotError;
use crate::uffd::RemovedMeanwhile;

/// A block being filled: where it is in its region, and whether it reads as zero.
#[derive(Clone, Copy)]
struct BlockAt<'a> {
    block: u64,
    lr: &'a LRegion,
    /// Offset in the region, bytes.
    off: usize,
    /// Length, bytes.
    n: usize,
    /// No save holds any of it.
    zero: bool,
}

impl BlockAt<'_> {
    /// An error of `op` on this block's memory.
    fn mem_err(&self, op: &'static str) -> impl FnOnce(std::io::Error) -> SnapshotError {
        let (region, guest_addr) = (self.lr.name, self.lr.name + self.off as u64);
        move |source| SnapshotError::Memory {
            region,
            guest_addr,
            op,
            source,
        }
    }

    /// A page of a block nobody had filled was there already, `copied` bytes in: something
    /// else wrote this memory behind the restore's back.
    fn present_before(&self, copied: usize) -> SnapshotError {
        SnapshotError::Memory {
            region: self.lr.name,
            guest_addr: self.lr.name + (self.off + copied) as u64,
            op: "UFFDIO_COPY (a page was present before its block was restored)",
            source: std::io::Error::from_raw_os_error(libc::EEXIST),
        }
    }
}

impl Lazy {
    /// Maps zero pages at `at..at + len` of a private region: `UFFDIO_ZEROPAGE` for 4 KiB
    /// pages; hugetlb has no zero-page call, so a zeroed staging buffer is copied there.
    pub(super) fn zero_pages(&self, lr: &LRegion, at: usize, len: usize) -> std::io::Result<()> {
        if lr.page as usize <= crate::sys::base_page_size() as usize {
            return self.uffd.zeropage(lr.target(), at, len, &|| self.drain());
        }
        with_staging(
            len,
            |e| e,
            |staging| {
                // SAFETY: this thread's own staging mapping, at least len bytes, borrowed for
                // the copy only.
                unsafe { std::ptr::write_bytes(staging.as_ptr(), 0, len) };
                // SAFETY: as above; just written.
                let src = unsafe { std::slice::from_raw_parts(staging.as_ptr(), len) };
                self.uffd
                    .copy(lr.target(), at, src, &|| self.drain())
                    .map(|_| ())
            },
        )
    }

    /// For memory a dead server partly filled: copies `src` (zeros when `None`) into
    /// `off..off + n` of `lr`, page by page past any page already present (`EEXIST`: never
    /// overwritten). A copy of `src` stops with [`RemovedMeanwhile`] (its bytes counted from
    /// `off`) where `stale` says a remove came in that `src` does not know of.
    fn copy_missing(
        &self,
        lr: &LRegion,
        off: usize,
        src: Option<&[u8]>,
        n: usize,
        stale: &dyn Fn() -> bool,
    ) -> std::io::Result<()> {
        // The page size the peer declared is not trusted to step by: a present page is
        // skipped a base page at a time; memory of larger pages (hugetlb) refuses a copy
        // inside a page (EINVAL), and then the step goes on to the next declared page.
        let base = crate::sys::base_page_size() as usize;
        let page = lr.page as usize;
        let copy = |src: &[u8], stale: &dyn Fn() -> bool| {
            let mut done = 0;
            while done < n {
                let copied = self.uffd.copy_checked(
                    lr.target(),
                    off + done,
                    &src[done..n],
                    &|| self.drain(),
                    stale,
                );
                match copied {
                    Ok(k) => done += k,
                    Err(e) if RemovedMeanwhile::of(&e).is_some() => {
                        let k = RemovedMeanwhile::of(&e).unwrap_or(0);
                        return Err(RemovedMeanwhile::error(done + k));
                    }
                    Err(e)
                        if e.raw_os_error() == Some(libc::EINVAL)
                            && page > base
                            && !(off + done).is_multiple_of(page) =>
                    {
                        done = (off + done).next_multiple_of(page) - off;
                        continue;
                    }
                    Err(e) => return Err(e),
                }
                if done < n {
                    // A present page: skip it.
                    done += base;
                }
            }
            Ok(())
        };
        match src {
            Some(src) => copy(src, stale),
            None => with_staging(
                n,
                |e| e,
                |staging| {
                    // SAFETY: this thread's own staging mapping, at least n bytes, borrowed for
                    // the copies only.
                    unsafe { std::ptr::write_bytes(staging.as_ptr(), 0, n) };
                    // SAFETY: as above; just written. Zeros: no remove makes them stale.
                    copy(
                        unsafe { std::slice::from_raw_parts(staging.as_ptr(), n) },
                        &|| false,
                    )
                },
            ),
        }
    }

    /// Brings `block` in: a private region's through a staging copy and `UFFDIO_COPY`, a
    /// shared region's into its page cache and `UFFDIO_CONTINUE`; a zero block without
    /// reading anything.
    pub(super) fn fill(&self, block: u64) -> Result<(), SnapshotError> {
        let (ri, offset, len) = self.image.block_span(block);
        let lr = &self.regions[ri];
        let at = BlockAt {
            block,
            lr,
            off: offset as usize,
            n: len as usize,
            zero: !self.image.held_from(block, 0),
        };
        match lr.alias() {
            None => self.fill_private(&at),
            Some(alias) => self.fill_shared(&at, alias),
        }
    }

    fn fill_private(&self, at: &BlockAt<'_>) -> Result<(), SnapshotError> {
        let BlockAt {
            block, lr, off, n, ..
        } = *at;
        if at.zero && self.resumed {
            self.copy_missing(lr, off, None, n, &|| false)
                .map_err(at.mem_err("UFFDIO_COPY"))?;
            self.counters.zero.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        if at.zero {
            self.zero_pages(lr, off, n)
                .map_err(at.mem_err("UFFDIO_ZEROPAGE"))?;
            self.counters.zero.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        // Where a copy below stopped for a remove its source did not know of: the rest
        // comes through a staging copy with the removed pages zeroed.
        let mut from = 0;
        if !self.resumed && !self.any_removed(lr, off, n) {
            if let Some(src) = self.image.mapped_block(block) {
                // SAFETY: the image keeps its source mapping for as long as it lives, and
                // `self` holds the image.
                let copied = unsafe {
                    self.uffd
                        .copy_from(lr.target(), off, src, &|| self.drain(), &|| {
                            self.any_removed(lr, off, n)
                        })
                };
                self.image.release_mapped(block);
                match copied {
                    Err(e) if RemovedMeanwhile::of(&e).is_some() => {
                        from = RemovedMeanwhile::of(&e).unwrap_or(0);
                    }
                    copied => {
                        let copied = copied.map_err(|e| match e.raw_os_error() {
                            Some(libc::EFAULT) => self.image.mapped_copy_error(block, e),
                            _ => at.mem_err("UFFDIO_COPY")(e),
                        })?;
                        if copied < n {
                            return Err(at.present_before(copied));
                        }
                        self.counters.bytes.fetch_add(n as u64, Ordering::Relaxed);
                        return Ok(());
                    }
                }
            }
        }
        // A block moved into a huge page (below) keeps it: it reads its frame (a staged one
        // too) into the huge staging buffer itself.
        let moves = from == 0 && !self.resumed && self.movable(lr, off, n);
        if !moves && !self.any_removed(lr, off, n) {
            if let Some(src) = self.image.ready_block(block) {
                // Read ahead and checked by the image's source (a frame from object storage,
                // staged in memory): installed straight from there.
                let stale = || self.any_removed(lr, off, n);
                let placed = match self.resumed {
                    true => self
                        .copy_missing(lr, off, Some(&src), n, &stale)
                        .map(|()| n),
                    false => self.uffd.copy_checked(
                        lr.target(),
                        off,
                        &src[..n],
                        &|| self.drain(),
                        &stale,
                    ),
                };
                self.image.give_back(src);
                match placed {
                    Err(e) if RemovedMeanwhile::of(&e).is_some() => {
                        from = RemovedMeanwhile::of(&e).unwrap_or(0);
                    }
                    placed => {
                        let placed = placed.map_err(at.mem_err("UFFDIO_COPY"))?;
                        if placed < n {
                            return Err(at.present_before(placed));
                        }
                        self.counters.bytes.fetch_add(n as u64, Ordering::Relaxed);
                        return Ok(());
                    }
                }
            }
        }
        if moves {
            let err = |op, e| at.mem_err(op)(e);
            if let Some(placed) = self.fill_moved(block, lr, off, n, err)? {
                if placed < n {
                    return Err(at.present_before(placed));
                }
                self.counters.bytes.fetch_add(n as u64, Ordering::Relaxed);
                return Ok(());
            }
        }
        let scratch = SCRATCH.take();
        // Sized once per thread by the largest block the image holds (a block is cut at its
        // region's end), capped by the manifest's block-size limits.
        let bb = self.image.largest_block() as usize;
        with_staging(bb, at.mem_err("map a staging buffer"), |staging| {
            let mut scratch = scratch;
            // SAFETY: the staging mapping is this thread's own, at least a block long,
            // page-aligned, and nothing else touches it.
            unsafe {
                self.image
                    .read_block(block, staging.as_ptr(), false, &mut scratch)?
            };
            SCRATCH.set(scratch);
            // The removed pages zeroed in the copy: a remove applied since makes it stale,
            // and the copy stops before it installs any page of it; those pages are zeroed
            // too, and the copy goes on where it stopped.
            let zeroed = std::cell::Cell::new(self.zero_removed(lr, off, n, staging));
            let stale = || self.removed_in(lr, off, n) > zeroed.get();
            let mut from = from;
            loop {
                // SAFETY: as above: the first n bytes of this thread's staging mapping, just
                // written, borrowed only for the copies below.
                let src = unsafe { std::slice::from_raw_parts(staging.as_ptr(), n) };
                let copied = match self.resumed {
                    true => self
                        .copy_missing(lr, off + from, Some(&src[from..]), n - from, &stale)
                        .map(|()| n - from),
                    false => self.uffd.copy_checked(
                        lr.target(),
                        off + from,
                        &src[from..],
                        &|| self.drain(),
                        &stale,
                    ),
                };
                match copied {
                    Err(e) if RemovedMeanwhile::of(&e).is_some() => {
                        from += RemovedMeanwhile::of(&e).unwrap_or(0);
                        zeroed.set(self.zero_removed(lr, off, n, staging));
                    }
                    copied => {
                        let copied = copied.map_err(at.mem_err("UFFDIO_COPY"))?;
                        if copied < n - from {
                            return Err(at.present_before(from + copied));
                        }
                        return Ok(());
                    }
                }
            }
        })?;
        self.counters.bytes.fetch_add(n as u64, Ordering::Relaxed);
        Ok(())
    }

    fn fill_shared(&self, at: &BlockAt<'_>, alias: &Mapping) -> Result<(), SnapshotError> {
        let BlockAt {
            block, lr, off, n, ..
        } = *at;
        let region = lr.region().expect("an alias belongs to our own region");
        if at.zero {
            let fo = region.file_offset().expect("a shared region has its file");
            crate::sys::fallocate(fo.file().as_fd(), fo.start() + off as u64, n as u64)
                .map_err(at.mem_err("fallocate"))?;
            self.counters.zero.fetch_add(1, Ordering::Relaxed);
        } else if self.image.is_remote() {
            // A remote image's block is read as a `&mut [u8]`, which the alias may not be:
            // it maps the region's file, which others may reach (its descriptor is lent for
            // vhost-user). Read into this thread's staging buffer, then copied raw.
            let bb = self.image.largest_block() as usize;
            with_staging(bb, at.mem_err("map a staging buffer"), |staging| {
                let mut scratch = SCRATCH.take();
                // SAFETY: the staging mapping is this thread's own, at least a block long,
                // page-aligned, and nothing else touches it.
                let r = unsafe {
                    self.image
                        .read_block(block, staging.as_ptr(), false, &mut scratch)
                };
                SCRATCH.set(scratch);
                r?;
                // Only the thread that claimed the block writes it, and the registered
                // mapping maps none of it before the UFFDIO_CONTINUE below.
                // SAFETY: the block lies inside the alias (the region's length); the staging
                // buffer holds its n bytes; the two never overlap.
                unsafe {
                    std::ptr::copy_nonoverlapping(staging.as_ptr(), alias.as_ptr().add(off), n)
                };
                Ok::<(), SnapshotError>(())
            })?;
            self.counters.bytes.fetch_add(n as u64, Ordering::Relaxed);
        } else {
            let mut scratch = SCRATCH.take();
            // Only the thread that claimed the block writes it, and the registered mapping
            // maps none of it before the UFFDIO_CONTINUE below; a local image's block is
            // written through raw pointers only (file reads, zeroes).
            // SAFETY: the block lies inside the alias (the region's length), aligned.
            let r = unsafe {
                self.image
                    .read_block(block, alias.as_ptr().add(off), false, &mut scratch)
            };
            SCRATCH.set(scratch);
            r?;
            self.counters.bytes.fetch_add(n as u64, Ordering::Relaxed);
        }
        self.uffd
            .continue_range(lr.target(), off, n, lr.page as usize)
            .map_err(at.mem_err("UFFDIO_CONTINUE"))?;
        Ok(())
    }

    /// Whether the peer has removed a page of `off..off + n` of `lr`.
    fn any_removed(&self, lr: &LRegion, off: usize, n: usize) -> bool {
        if lr.removed.is_empty() {
            return false;
        }
        let page = lr.page as usize;
        (off / page..(off + n).div_ceil(page))
            .any(|p| lr.removed[p / 64].load(Ordering::Acquire) >> (p % 64) & 1 != 0)
    }

    /// How many pages of `off..off + n` of `lr` the peer has removed.
    fn removed_in(&self, lr: &LRegion, off: usize, n: usize) -> u32 {
        if lr.removed.is_empty() {
            return 0;
        }
        let page = lr.page as usize;
        (off / page..(off + n).div_ceil(page))
            .filter(|&p| lr.removed[p / 64].load(Ordering::Acquire) >> (p % 64) & 1 != 0)
            .count() as u32
    }

    /// Zeroes, in a block's staging copy (`off..off + n` of `lr`), the pages the peer has
    /// removed: they must read as zero, not as the image holds them. Returns how many.
    fn zero_removed(&self, lr: &LRegion, off: usize, n: usize, staging: &Mapping) -> u32 {
        if lr.removed.is_empty() {
            return 0;
        }
        let page = lr.page as usize;
        let mut zeroed = 0;
        for p in off / page..(off + n).div_ceil(page) {
            if lr.removed[p / 64].load(Ordering::Acquire) >> (p % 64) & 1 != 0 {
                zeroed += 1;
                // SAFETY: page p of the block lies in the first n bytes of this thread's own
                // staging mapping, which nothing else touches.
                unsafe { std::ptr::write_bytes(staging.as_ptr().add(p * page - off), 0, page) };
            }
        }
        zeroed
    }
}

/// The largest staging buffer a long-lived thread (a page server's) keeps once idle: a
/// 2 MiB huge page's, enough for the default blocks. One made larger for a VM of larger
/// blocks (up to [`crate::snapshot::MAX_STAGED_BLOCK_BYTES`]) is kept while the thread is
/// busy (mapping one per block would cost 2.7x the block's copy: 850 against 310 us for
/// 4 MiB on this project's host) and let go of once it has been idle
/// [`STAGING_IDLE`]: a server's memory follows what it serves now.
const STAGING_KEPT: usize = 2 << 20;

/// How long a thread holding a staging buffer larger than [`STAGING_KEPT`] waits idle
/// before it lets go of it.
pub(crate) const STAGING_IDLE: std::time::Duration = std::time::Duration::from_secs(1);

/// Whether this thread holds a staging buffer larger than it keeps while idle.
pub(crate) fn staging_oversized() -> bool {
    STAGING.with(|c| c.borrow().as_ref().is_some_and(|m| m.len() > STAGING_KEPT))
}

/// Lets go of this thread's staging buffer if it is larger than it keeps while idle.
pub(crate) fn trim_staging() {
    let m = STAGING.with(|c| {
        let mut c = c.borrow_mut();
        if c.as_ref().is_some_and(|m| m.len() > STAGING_KEPT) {
            c.take()
        } else {
            None
        }
    });
    drop(m);
}

/// Runs `f` with this thread's staging buffer, at least `len` bytes (mapped and faulted in
/// the first time a thread needs one).
fn with_staging<T, E>(
    len: usize,
    map_err: impl FnOnce(std::io::Error) -> E,
    f: impl FnOnce(&Mapping) -> Result<T, E>,
) -> Result<T, E> {
    STAGING.with(|cell| {
        let mut cell = cell.borrow_mut();
        if cell.as_ref().is_none_or(|m| m.len() < len) {
            let m = Mapping::anonymous(len).map_err(|e| map_err(e.into_io()))?;
            // Best effort: only saves the first copy's page faults.
            let _ = m.advise(0, len, Advice::PopulateWrite);
            *cell = Some(m);
        }
        f(cell.as_ref().expect("set above"))
    })
}
