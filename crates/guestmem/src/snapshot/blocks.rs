//! Saving one block: which of its pages may hold data, hashing it as the file will hold it,
//! and writing its non-zero runs in place.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;

use super::hash::BlockHasher;
use super::{BlockRecord, SnapshotError, IMAGE_PAGE_BYTES};
use crate::layout::Backing;
use crate::mmap::ProcMem;
use crate::region::Region;

/// One block's place.
pub(super) struct BlockAt<'a> {
    pub(super) region: &'a Region,
    /// Offset in the region.
    pub(super) offset: u64,
    pub(super) len: u64,
    /// Offset in the memory file.
    pub(super) file_offset: u64,
}

/// The dirty 4 KiB pages of `offset..offset+len` of a region, as block-relative words.
pub(super) fn dirty_pages(words: &[u64], offset: u64, len: u64, block_bytes: u64) -> Vec<u64> {
    let first = offset / IMAGE_PAGE_BYTES;
    let n = len.div_ceil(IMAGE_PAGE_BYTES);
    // Every block's page list has the whole block's length, a region's short last block too.
    let mut out = vec![0u64; (block_bytes / IMAGE_PAGE_BYTES).div_ceil(64) as usize];
    for i in 0..n {
        let p = first + i;
        if words
            .get((p / 64) as usize)
            .is_some_and(|w| w >> (p % 64) & 1 != 0)
        {
            out[(i / 64) as usize] |= 1 << (i % 64);
        }
    }
    out
}

/// Which 4 KiB pages of the block may hold data (others read as zero without being read).
fn maybe_data(at: &BlockAt<'_>, proc: &ProcMem) -> std::io::Result<Vec<bool>> {
    let r = at.region;
    let (off, len) = (at.offset as usize, at.len as usize);
    match r.backing() {
        // Private memory: a page never faulted in (present or swapped) reads as zero.
        Backing::Anonymous => proc.faulted_in(r.mapping(), off, len),
        // A memfd holds what its page cache (or swap) holds, whoever wrote it.
        Backing::Memfd => {
            let fo = r.file_offset().expect("a memfd region has its file");
            let start = fo.start() + at.offset;
            let ranges = crate::sys::data_ranges(
                std::os::fd::AsFd::as_fd(fo.file()),
                start,
                start + at.len,
            )?;
            let mut v = vec![false; len / IMAGE_PAGE_BYTES as usize];
            for (s, e) in ranges {
                let (a, b) = (
                    (s - start) / IMAGE_PAGE_BYTES,
                    (e - start).div_ceil(IMAGE_PAGE_BYTES),
                );
                for x in &mut v[a as usize..(b as usize).min(len / IMAGE_PAGE_BYTES as usize)] {
                    *x = true;
                }
            }
            Ok(v)
        }
        // Hugetlb: a page may be in the file without being mapped here (another process's
        // mapping, a vhost-user backend): read them all (the zero check keeps holes).
        Backing::Hugetlb(_) => Ok(vec![true; len / IMAGE_PAGE_BYTES as usize]),
        // A file's pages are the file's: read them all.
        Backing::File { .. } | Backing::FilePrivate { .. } => {
            Ok(vec![true; len / IMAGE_PAGE_BYTES as usize])
        }
    }
}

/// Saves one block: hashes it as the file will hold it, writes its non-zero pages. Returns
/// its record and the bytes written, or `None` when the save holds nothing of it.
pub(super) fn save_block(
    at: &BlockAt<'_>,
    index: u64,
    dirty: Option<Vec<u64>>,
    proc: &ProcMem,
    file: &File,
    path: &Path,
) -> Result<Option<(BlockRecord, u64)>, SnapshotError> {
    let r = at.region;
    let page = IMAGE_PAGE_BYTES as usize;
    let n = at.len as usize / page;
    let guest_addr = r.guest_addr().0 + at.offset;
    let wanted: Vec<bool> = match &dirty {
        Some(words) => (0..n).map(|i| words[i / 64] >> (i % 64) & 1 != 0).collect(),
        None => vec![true; n],
    };
    if !wanted.iter().any(|&w| w) {
        return Ok(None);
    }
    let there = maybe_data(at, proc).map_err(|source| SnapshotError::Memory {
        region: r.guest_addr().0,
        guest_addr,
        op: "read page state",
        source,
    })?;
    let (nonzero, checksum) = hash_pages(at, &wanted, &there);
    if dirty.is_none() && !nonzero.iter().any(|&z| z) {
        // A full save leaves an all-zero block out: no record reads as zero.
        return Ok(None);
    }
    let bytes = write_runs(at, &nonzero, file, path)?;
    let pages = match dirty {
        Some(words) if wanted.iter().any(|&w| !w) => Some(words),
        _ => None,
    };
    Ok(Some((
        BlockRecord {
            index,
            checksum: format!("{checksum:016x}"),
            pages,
        },
        bytes,
    )))
}

/// Hashes a block as the file will hold it (pages not wanted, or holding no data, as
/// zeros); which of its pages are non-zero, and the checksum.
fn hash_pages(at: &BlockAt<'_>, wanted: &[bool], there: &[bool]) -> (Vec<bool>, u64) {
    let page = IMAGE_PAGE_BYTES as usize;
    let base = at.region.host_addr() as usize + at.offset as usize;
    let mut h = BlockHasher::default();
    let nonzero = (0..wanted.len())
        .map(|i| {
            if wanted[i] && there[i] {
                // SAFETY: the page lies in the region's mapping (the block is inside the
                // region), which the region keeps mapped; hashing reads it with volatile
                // loads.
                unsafe { h.update_volatile((base + i * page) as *const u8, page) }
            } else {
                h.update_zeros(page);
                false
            }
        })
        .collect();
    (nonzero, h.finish())
}

/// Writes each run of non-zero pages of a block to its place in the file; the bytes written.
fn write_runs(
    at: &BlockAt<'_>,
    nonzero: &[bool],
    file: &File,
    path: &Path,
) -> Result<u64, SnapshotError> {
    let page = IMAGE_PAGE_BYTES as usize;
    let base = at.region.host_addr() as usize + at.offset as usize;
    let n = nonzero.len();
    let mut bytes = 0u64;
    let mut i = 0;
    while i < n {
        if !nonzero[i] {
            i += 1;
            continue;
        }
        let run_start = i;
        while i < n && nonzero[i] {
            i += 1;
        }
        let (from, len) = (run_start * page, (i - run_start) * page);
        // SAFETY: base+from..base+from+len lies in the region's mapping (the block is inside
        // the region), which the region keeps mapped.
        unsafe { pwrite_all(at, file, path, base + from, len, from) }?;
        bytes += len as u64;
    }
    Ok(bytes)
}

/// Writes `len` bytes of guest memory at host address `src` to the file, at the block's
/// file offset plus `from`.
///
/// # Safety
/// `src..src + len` must be mapped, readable memory for the whole call.
unsafe fn pwrite_all(
    at: &BlockAt<'_>,
    file: &File,
    path: &Path,
    src: usize,
    len: usize,
    from: usize,
) -> Result<(), SnapshotError> {
    let mut done = 0usize;
    while done < len {
        let off = at.file_offset + (from + done) as u64;
        // SAFETY: src+done..src+len is readable (the caller's contract); the kernel reads it
        // into the file (no Rust reference to guest memory is made).
        let ret = unsafe {
            libc::pwrite(
                file.as_raw_fd(),
                (src + done) as *const libc::c_void,
                len - done,
                off as libc::off_t,
            )
        };
        if ret <= 0 {
            let source = if ret == 0 {
                std::io::Error::from(std::io::ErrorKind::WriteZero)
            } else {
                std::io::Error::last_os_error()
            };
            if source.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            let region = at.region.guest_addr().0;
            return Err(SnapshotError::Io {
                region,
                guest_addr: region + at.offset + (from + done) as u64,
                op: "write",
                path: path.to_path_buf(),
                offset: off,
                source,
            });
        }
        done += ret as usize;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dirty_pages_cut_a_block_out_of_the_region_bitmap_at_full_block_length() {
        // Region pages 0..256 (1 MiB); dirty: 3, 64, 200, 255.
        let mut words = vec![0u64; 4];
        for p in [3u64, 64, 200, 255] {
            words[(p / 64) as usize] |= 1 << (p % 64);
        }
        // The block at 256 KiB (pages 64..128): only page 64, as the block's page 0.
        let b = dirty_pages(&words, 256 << 10, 256 << 10, 256 << 10);
        assert_eq!(b, [1]);
        // A short last block (pages 192..256 of a 512 KiB block) has the whole block's
        // length: pages 200 and 255 at 8 and 63.
        let b = dirty_pages(&words, 768 << 10, 256 << 10, 512 << 10);
        assert_eq!(b.len(), 2);
        assert_eq!(b[0], (1 << 8) | (1 << 63));
        // Past the bitmap: nothing.
        assert_eq!(dirty_pages(&words, 2 << 20, 4096, 4096), [0]);
    }
}
