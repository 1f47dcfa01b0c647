//! The QEMU peer: how `qemu_prealloc_mem` brings up anonymous guest RAM, reproduced from
//! QEMU's `util/oslib-posix.c` as it reads today:
//!
//! - Each RAM block is its own mapping, 2 MiB aligned (QEMU aligns RAM blocks), and advised
//!   `MADV_HUGEPAGE` before it is populated.
//! - Blocks are preallocated one after another (each backend on its own).
//! - Threads per block = min(CPUs, 16, size / 64 MiB), at least 1.
//! - One static even split in 4 KiB units: `pages / threads` pages each, the first
//!   `pages % threads` threads one more; the edges are not rounded to huge pages. No load
//!   balancing.
//! - Each thread gives `MADV_POPULATE_WRITE` on its part; threads wait until all are created
//!   (QEMU's `threads_created_flag`; see [`Start::AllArrived`] for why a Rust reproduction
//!   waits for them to arrive); the calling thread only waits.

use guestmem::layout::THP_BYTES;
use guestmem::mmap::{Advice, Mapping, Reservation};
use guestmem::workers::Start;

use crate::peer::{advise, len_of, mmap_err, populate_parts, PeerError, PeerRun};

/// The peer's name in reports.
pub const NAME: &str = "qemu-style";

/// QEMU's cap on preallocation threads.
pub const MAX_THREADS: usize = 16;

/// Smallest share of a block QEMU gives a thread, in bytes.
pub const MIN_BYTES_PER_THREAD: u64 = 64 << 20;

/// The unit QEMU splits anonymous memory in, in bytes (the base page).
pub const SPLIT_UNIT_BYTES: usize = 4096;

/// Threads QEMU uses for a block of `size` bytes on `cpus` CPUs.
pub fn threads_for(size: u64, cpus: usize) -> usize {
    let by_size = usize::try_from(size / MIN_BYTES_PER_THREAD).unwrap_or(usize::MAX);
    cpus.min(MAX_THREADS).min(by_size).max(1)
}

/// QEMU's static split of `len` bytes among `threads`, as `(offset, len)` parts in 4 KiB
/// units (a tail under 4 KiB, never present in page-sized blocks, goes to the last part).
pub fn split(len: usize, threads: usize) -> Vec<(usize, usize)> {
    let pages = len / SPLIT_UNIT_BYTES;
    let threads = threads.max(1);
    let (per, leftover) = (pages / threads, pages % threads);
    let mut parts = Vec::with_capacity(threads);
    let mut at = 0;
    for i in 0..threads {
        let n = per + usize::from(i < leftover);
        let mut bytes = n * SPLIT_UNIT_BYTES;
        if i + 1 == threads {
            bytes = len - at;
        }
        if bytes > 0 {
            parts.push((at, bytes));
        }
        at += bytes;
    }
    parts
}

/// A read-write private anonymous mapping of `len` bytes starting on a 2 MiB boundary: a
/// reservation with 2 MiB to spare, trimmed to the aligned range, the memory placed there.
fn map_aligned(len: usize) -> Result<Mapping, PeerError> {
    let align = THP_BYTES as usize;
    let total = len.checked_add(align).ok_or(PeerError::Size {
        peer: NAME,
        size: len as u64,
    })?;
    let res = Reservation::new(total).map_err(mmap_err(NAME))?;
    let head = res.addr().next_multiple_of(align) - res.addr();
    let res = res.trim(head, len).map_err(mmap_err(NAME))?;
    res.place(0, len).map_err(mmap_err(NAME))
}

/// Maps, advises and preallocates each region of `sizes` in turn, as QEMU does.
pub fn bring_up(sizes: &[u64], cpus: usize) -> Result<PeerRun, PeerError> {
    let mut run = PeerRun {
        mappings: Vec::with_capacity(sizes.len()),
        threads: Vec::with_capacity(sizes.len()),
    };
    for &size in sizes {
        let len = len_of(NAME, size)?;
        let m = map_aligned(len)?;
        advise(NAME, &m, Advice::HugePage)?;
        let threads = threads_for(size, cpus);
        populate_parts(NAME, &m, &split(len, threads), Start::AllArrived)?;
        run.mappings.push(m);
        run.threads.push(threads);
    }
    Ok(run)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threads_for_follows_qemu_caps() {
        assert_eq!(threads_for(4 << 30, 2), 2);
        assert_eq!(threads_for(32 << 20, 2), 1);
        assert_eq!(threads_for(128 << 20, 64), 2);
        assert_eq!(threads_for(64 << 30, 64), 16);
    }

    #[test]
    fn split_uneven_pages_edges_not_huge_aligned() {
        // 3 threads over 6 MiB + 4 KiB: 1537 pages -> 513, 512, 512.
        let parts = split((6 << 20) + 4096, 3);
        assert_eq!(
            parts,
            vec![
                (0, 513 * 4096),
                (513 * 4096, 512 * 4096),
                (1025 * 4096, 512 * 4096)
            ]
        );
        assert_ne!(parts[1].0 % (2 << 20), 0);
        assert_eq!(parts.iter().map(|p| p.1).sum::<usize>(), (6 << 20) + 4096);
    }
}
